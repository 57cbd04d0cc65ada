"""The app's resources, and the narrow faces of them the request path sees.

Layering (docs/architecture.md): `app` builds an AppState and hands each endpoint only what it
uses. The forwarder sees four collaborators, each a small protocol (proxy/forwarding/ports.py) or
the facade defined here:

- `UpstreamClient`: sends one request to a backend and returns its response head
  (proxy.upstream.pool.Upstream in the app; an in-memory fake in tests);
- `Fleet`: backend lookup and passive health (proxy.upstream.backends.BackendRegistry);
- `RequestRouting`: routes a request and learns from its outcome (router, in-flight board,
  prefill learner and backend views, behind one facade);
- `Recorder`: opens the telemetry record of a request (proxy.telemetry.Telemetry).

Nothing here imports the forwarder or the app, so both can import it: no cycle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proxy.admission.slots import prefilled
from proxy.forwarding.ports import Fleet, Recorder, UpstreamClient, UpstreamResponseLike
from proxy.forwarding.view_cache import ViewCache
from proxy.routing.slot_turns import SlotTurns, Turn

__all__ = [
    "AppState",
    "Fleet",
    "Recorder",
    "RequestRouting",
    "UpstreamClient",
    "UpstreamResponseLike",
]

if TYPE_CHECKING:
    import httpx

    from proxy.admission.backend_queue import BackendQueue
    from proxy.config import Config
    from proxy.fleet.reconciler import Reconciler
    from proxy.forwarding.exchange import Exchange
    from proxy.routing.router import Router
    from proxy.routing.setup import Routing
    from proxy.routing.types import BackendView, Decision, RouteContext
    from proxy.telemetry import RequestRecord, Telemetry
    from proxy.types import StreamFacts
    from proxy.upstream.backends import BackendRegistry


class RequestRouting:
    """The routing facade: route a request, note where it went, learn from how it went."""

    __slots__ = ("_board", "_learner", "_registry", "_views", "router", "turns", "waiting")

    def __init__(
        self,
        routing: Routing,
        registry: BackendRegistry,
        waiting: BackendQueue | None = None,
        turns: SlotTurns | None = None,
    ) -> None:
        self.router: Router = routing.router
        # requests whose every backend is at its in-flight bound (None: they are refused)
        self.waiting = waiting
        # slot engines: a prompt's second request waits for its first (routing/slot_turns.py)
        self.turns = turns if turns is not None else SlotTurns()
        self._board = routing.board
        self._learner = routing.learner
        self._registry = registry
        self._views = ViewCache()

    def views(self) -> list[BackendView]:
        """What routing may know of every backend now: health, load, shared in-flight."""
        registry = self._registry
        return self._views.read(
            registry.routable(),
            time.monotonic(),
            self._board,
            self._learner,
            self.router,
            registry.changes,
        )

    async def route(self, ctx: RouteContext, *, record: bool = True) -> Decision:
        return await self.router.route(ctx, self.views(), record=record)

    async def take_slot(
        self, ctx: RouteContext | None, decision: Decision | None, backend: str
    ) -> tuple[Turn | None, float]:
        """Before a request goes to the slot engine `backend`: where a request of its prompt
        runs and collisions there were measured cold, wait for that one to end (at most the
        limit slot_turns.py explains). Returns the turn to `leave_slot` once the request
        there is over (None: nothing to leave) and the seconds waited."""
        if ctx is None or ctx.head is None or decision is None:
            return None, 0.0
        turns = self.turns
        key = (backend, ctx.head)
        limit = 0.0
        if turns.busy(key) and turns.waits_on(backend):
            router = self.router
            tokens = decision.prompt_chars / router.hasher.chars_per_token
            limit = turns.limit_s(tokens, router.prefill_rate(backend))
        return await turns.take(key, limit)

    def leave_slot(self, turn: Turn | None, facts: StreamFacts | None) -> None:
        """The request that took `turn` is over (`facts`: what its engine reported)."""
        if turn is None:
            return
        share = None
        if facts is not None and facts.input_tokens and facts.cached_tokens is not None:
            share = facts.cached_tokens / facts.input_tokens
        self._keep("the slot turns", turn.key[0], self.turns.leave, turn, share)

    # What follows a decision is bookkeeping (the index, the backlog, the learners), each piece
    # run through _keep: a bug in it must not fail the request.

    def sent(self, decision: Decision | None, backend: str) -> None:
        """The request is on the wire to `backend`: note its prefix there (the engine caches it
        where the request lands, which a retry may have moved) while the backend works."""
        if decision is not None:
            self._keep("recording a prefix", backend, self.router.record, decision, backend)

    def prefilled(self, decision: Decision | None) -> None:
        """The first token came: the prompt is no longer queued or prefilling there (the
        backlog's bound; and the prefills kept free count one fewer)."""
        self.finished(decision)
        prefilled()

    def finished(self, decision: Decision | None) -> None:
        """The request is over: whatever of its prompt the backlog still counts is not."""
        if decision is not None:
            self._keep("the backlog", decision.winner, self.router.finished, decision)

    def inflight(self, backend: str, delta: int) -> None:
        if delta > 0:
            self._board.acquire(backend)
        else:
            self._board.release(backend)
            waiting = self.waiting
            if waiting is not None and waiting.waiters:
                waiting.freed(backend)

    def observe_stream(self, backend: str, facts: StreamFacts, decision: Decision | None) -> None:
        """Teach the router from a finished stream: the prefill rate from its upstream TTFT,
        the backend's cache size from the cached_tokens its engine reported."""
        if facts.upstream_ttft_s is None or not facts.input_tokens or facts.error:
            return
        self._keep(
            "learning from a stream", backend, self.router.observe,
            decision, backend, facts.input_tokens, facts.cached_tokens, facts.upstream_ttft_s,
        )  # fmt: skip

    def observe_response(self, backend: str, facts: StreamFacts, decision: Decision | None) -> None:
        """A non-streamed response: its cached_tokens size the backend's cache; its duration
        (prefill and every token) says nothing about the prefill rate on its own."""
        if facts.error or not facts.input_tokens:
            return
        self._keep(
            "learning from a response", backend, self.router.observe,
            decision, backend, facts.input_tokens, facts.cached_tokens, None, facts.e2e_s,
        )  # fmt: skip

    def _keep(self, step: str, backend: str | None, call: Any, *args: Any) -> None:
        """Run one piece of routing's bookkeeping; a bug in it is the router's to count and log
        (Router.note_failure), and the request goes on without it."""
        try:
            call(*args)
        except Exception as e:
            self.router.note_failure(step, e, f"a request to {backend}")


def start_record(recorder: Recorder, ex: Exchange) -> RequestRecord:
    """The telemetry record of one exchange."""
    return recorder.start_request(
        request_id=ex.request_id,
        api=ex.api,
        model=ex.body.get("model"),
        stream=ex.stream,
        params=ex.body,
        headers=ex.headers,
        t0=ex.t0,
    )


@dataclass
class AppState:
    """The app's resources; one per process, created in create_app, opened in lifespan."""

    config: Config
    registry: BackendRegistry
    upstream: Any  # proxy.upstream.pool.Upstream (an UpstreamClient)
    routing: Routing
    http: httpx.AsyncClient
    telemetry: Telemetry
    steering: RequestRouting
    forwarding: Any = None  # proxy.forwarding.forward.Forwarding, set by create_app
    fleet: Reconciler | None = None  # membership changes (proxy/fleet/), set by create_app
    doctor: Any = None  # proxy.doctor.http.Doctor, set by create_app
    admission: Any = None  # proxy.admission.slots.Admission, the edge's, set by create_app

    @property
    def open_requests(self) -> int:
        return self.forwarding.open_requests if self.forwarding is not None else 0

    @property
    def router(self) -> Router:
        return self.routing.router

    def views(self) -> list[BackendView]:
        return self.steering.views()
