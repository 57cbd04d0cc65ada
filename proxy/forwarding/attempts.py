"""The attempt step: one request sent to backends in turn until one answers.

The forwarder's pipeline is intake -> route -> attempt(s) -> relay (proxy/forwarding/forward.py);
this module is its third step. `Attempts.run` tries the ranking's backends as the retry policy
allows (proxy/forwarding/retry.py), to one deadline per request; each attempt opens one leg to
one backend up to its response head, and hands the answer to the relay, which judges the
backend by its first byte. The prefill/decode flows (proxy/forwarding/pdflow.py) are a variant of
this step: they call `run` (and `open_leg`, for a prefill leg) with their own bodies and a
`Watch` that hears of each attempt, never the endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING, Protocol

from proxy.admission.slots import TICKET
from proxy.errors import error_body
from proxy.forwarding.intake import with_priority
from proxy.forwarding.relay import Relay, respond
from proxy.forwarding.request_headers import upstream_headers
from proxy.forwarding.retry import (
    RETRYABLE_STATUS,
    Resume,
    Retry,
    RetryPolicy,
    classify,
    status_retry,
)
from proxy.types import FailureKind
from proxy.upstream.pool import CONNECT_ERRORS, UpstreamProtocolError

if TYPE_CHECKING:
    from proxy.asgi import Send
    from proxy.forwarding.exchange import Exchange
    from proxy.forwarding.ports import Fleet, UpstreamClient, UpstreamResponseLike
    from proxy.forwarding.state import RequestRouting
    from proxy.routing.slot_turns import Turn
    from proxy.telemetry import AttemptRecord, RequestRecord
    from proxy.types import StreamFacts
    from proxy.upstream.backends import Backend

log = logging.getLogger("warmroute.forward")
# What an attempt can fail with before its response head: all retryable (nothing was sent on).
LEG_ERRORS: tuple[type[BaseException], ...] = (*CONNECT_ERRORS, UpstreamProtocolError, TimeoutError)

# An answered request: the backend that answered, and what its client saw (None: a whole
# answer the relay did not meter as a stream).
Answered = tuple[str, "StreamFacts | None"]


class Watch(Protocol):
    """Hears of each attempt as it is sent (the P/D flow tags its leg and tells its window)."""

    def started(self, backend: str, now: float, attempt: AttemptRecord) -> None: ...


class Collaborators(Protocol):
    """What the attempt step uses of the forwarder's collaborators (forward.Forwarding)."""

    fleet: Fleet
    upstream: UpstreamClient
    steering: RequestRouting
    retry: RetryPolicy


class Attempts:
    """The attempt step of one API's endpoint (its path and relay), on the app's collaborators."""

    def __init__(self, fw: Collaborators, path: str, relay: Relay) -> None:
        self.fw = fw  # read at each call: the app's (or a test's) current collaborators
        self.path = path
        self.relay = relay

    async def run(
        self,
        ex: Exchange,
        ranking: list[str],
        first: str,
        record: RequestRecord,
        send: Send,
        *,
        body: bytes | None = None,
        final: bool = True,
        resume: Resume | None = None,
        watch: Watch | None = None,
    ) -> Answered | None:
        """Attempts until one is answered (its backend and facts), or None: the client got
        an error, or (`final` False) nothing yet, for the caller to fall back. `body`
        replaces what each backend is sent (a decode leg's). `resume`: the request is back
        after a failed leg, and the policy decides its first attempt too. `watch` hears of
        each attempt as it is sent (the P/D flow's). Every call for one request runs to one
        deadline, from the request's arrival."""
        fw = self.fw
        policy = fw.retry
        deadline = policy.deadline(ex.t0)
        failures: list[str] = []
        waits: list[float] = []  # the Retry-After of each attempt answered 429 (0: none given)
        other = resume is not None  # a failure that was not a 429 (a failed leg's included)
        name: str | None = first
        if resume is not None:
            name = await self._resumed(ex, resume, first, ranking, deadline, failures)
        fresh = False
        while name is not None:
            backend = fw.fleet.get(name)
            try:
                if backend is None:  # ranked before it left the fleet
                    ex.attempts.append(name)  # tried, as far as where-next is concerned
                    raise Retry("it left the fleet", "backend_gone", FailureKind.GONE)
                return name, await self._attempt(ex, backend, record, send, fresh, body, watch)
            except Retry as r:
                failures.append(f"{name}: {r.reason}")
                if r.status == 429:
                    waits.append(r.retry_after_s)
                else:
                    other = True
                kind = FailureKind.OVERLOADED if r.status == 429 else r.kind
                if backend is not None:
                    fw.fleet.mark_failure(backend, r.reason, kind=kind)
                if ex.client_gone:
                    break
                nxt, why_not = policy.next(
                    r, name, ranking, ex.attempts, time.perf_counter(), deadline
                )
                if nxt is None and r.kind == FailureKind.GONE and ex.ctx is not None:
                    # Its ranking was made for a fleet that has changed since: rank again.
                    ranking = [*ex.attempts, *await self._reranked(ex)]
                    nxt, why_not = policy.next(
                        r, name, ranking, ex.attempts, time.perf_counter(), deadline
                    )
                log.warning(
                    "request %s attempt %d on %s failed before the first byte: %s; %s",
                    ex.request_id,
                    len(ex.attempts),
                    name,
                    r.reason,
                    f"retrying on {nxt.backend}"
                    + (" over a new connection" if nxt.fresh else "")
                    + (f" in {nxt.delay_s * 1000:.0f} ms" if nxt.delay_s else "")
                    if nxt
                    else f"not retrying: {why_not}",
                )
                if nxt is None:
                    break
                if nxt.delay_s:
                    await asyncio.sleep(nxt.delay_s)
                name, fresh = nxt.backend, nxt.fresh
        if ex.client_gone:
            record.finish(None, status=499, error_type="cancelled")
        elif final:
            await self._gave_up(ex, send, record, failures, waits if not other else [])
        return None

    async def _gave_up(
        self,
        ex: Exchange,
        send: Send,
        record: RequestRecord,
        failures: list[str],
        waits: list[float],
    ) -> None:
        """No attempt was answered: the client's error. `waits`: the Retry-After of each
        attempt when every one was a 429 (else empty)."""
        if waits:
            # Rate limited, not down: a 429 with a Retry-After makes the client (the openai
            # package, as against OpenAI) back off and retry. The soonest any backend named:
            # the retry may go to any of them, and the first with room serves it.
            hinted = [w for w in waits if w > 0]
            after = math.ceil(min(hinted)) if hinted else 1
            message = (
                "Every backend tried is rate limiting requests: " + "; ".join(failures) + "; "
                f"retry after {after} s."
            )
            retry_after = ((b"retry-after", b"%d" % after),)
            await fail(ex, send, record, 429, message, "backends_rate_limited", retry_after)
            return
        message = "All backends failed before responding: " + "; ".join(failures) + "."
        await fail(ex, send, record, 503, message, "backends_unavailable")

    async def _reranked(self, ex: Exchange) -> list[str]:
        """The backends not tried yet, ranked for the fleet as it is now."""
        assert ex.ctx is not None
        decision = await self.fw.steering.route(ex.ctx, record=False)
        return [n for n in decision.ranking if n not in ex.attempts]

    async def _resumed(
        self,
        ex: Exchange,
        resume: Resume,
        first: str,
        ranking: list[str],
        deadline: float,
        failures: list[str],
    ) -> str | None:
        """Where a request back after a failed leg goes first, as the policy says; None: not
        retried (the reason logged and kept for the client's error)."""
        now = time.perf_counter()
        nxt, why_not = self.fw.retry.resume(resume, first, ranking, ex.attempts, now, deadline)
        if nxt is None:
            log.warning("request %s: %s; not retrying: %s", ex.request_id, resume.why, why_not)
            failures.append(f"{resume.why} (not retried: {why_not})")
            return None
        failures.append(resume.why)
        if nxt.delay_s:
            await asyncio.sleep(nxt.delay_s)
        return nxt.backend

    async def open_leg(
        self,
        ex: Exchange,
        backend: Backend,
        body: bytes,
        headers: dict[str, str],
        fresh: bool = False,
        path: str | None = None,
    ) -> UpstreamResponseLike:
        """One request to one backend, up to its response head; failures raise Retry."""
        fw = self.fw
        steering = fw.steering
        decision = ex.decision
        name = backend.name
        try:
            upstream = await fw.upstream.post(
                fw.upstream.url(backend.url, path or self.path),
                body,
                headers,
                lambda: steering.sent(decision, name),
                fresh=fresh,
            )
        except LEG_ERRORS as e:
            raise classify(e) from None
        if upstream.status in RETRYABLE_STATUS:
            raise await status_retry(upstream)
        return upstream

    async def _slot_turn(
        self, ex: Exchange, backend: Backend, record: RequestRecord
    ) -> Turn | None:
        """A slot engine's first attempt waits for its prompt's running request there
        (routing/slot_turns.py); the turn to leave once the attempt is over."""
        if len(ex.attempts) != 1:
            return None
        turn, waited = await self.fw.steering.take_slot(ex.ctx, ex.decision, backend.name)
        if waited:
            record.set_attribute("warmroute.slot_wait_s", round(waited, 6))
        return turn

    async def _attempt(
        self,
        ex: Exchange,
        backend: Backend,
        record: RequestRecord,
        send: Send,
        fresh: bool,
        body: bytes | None,
        watch: Watch | None,
    ) -> StreamFacts | None:
        fw = self.fw
        headers = upstream_headers(ex, backend, ex.client)
        attempt = record.attempt(
            backend=backend.name,
            address=backend.host,
            port=backend.port,
            attempt=len(ex.attempts) + 1,
        )
        attempt.inject_headers(headers)
        ex.attempts.append(backend.name)
        fw.fleet.mark_attempt(backend)
        fw.steering.inflight(backend.name, +1)
        backend.attach(ex)
        turn, facts = None, None
        try:
            if backend.slots is not None:  # (no coroutine for the engines without slots)
                turn = await self._slot_turn(ex, backend, record)
            t_sent = time.perf_counter()
            strip = ex.strip_usage and not _keeps_own_usage(backend)
            if body is None:
                body = ex.raw if strip or not ex.strip_usage else ex.client_raw
            if backend.cfg.engine_priority is not None:
                body = _prioritised(ex, body, backend.cfg.engine_priority, attempt)
            if watch is not None:
                watch.started(backend.name, t_sent, attempt)
            upstream = await self.open_leg(ex, backend, body, headers, fresh)
            ex.upstream = upstream
            try:  # the relay judges the backend: by its first byte, not by this head
                if ex.stream and upstream.status == 200:
                    facts = await self.relay.stream(
                        ex, backend, upstream, t_sent, record, send, strip
                    )
                else:
                    facts = await self.relay.whole(ex, backend, upstream, record, send)
                return facts
            finally:
                ex.upstream = None
                upstream.release()
        except Retry as r:
            attempt.fail(r.error_type, r.status)
            raise
        except asyncio.CancelledError:
            cut = ex.cut_reason
            if cut is None or ex.started_response or ex.client_gone:
                if not ex.started_response:
                    fw.fleet.mark_failure(
                        backend, "attempt cut before an answer", kind=FailureKind.CANCELLED
                    )
                raise
            # Its backend left the fleet before answering: nothing reached the client, so the
            # request goes on elsewhere, as after any failure before the first byte.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            ex.cut_reason = None
            attempt.fail(cut[0], None)
            raise Retry(cut[1], cut[0], FailureKind.GONE) from None
        except BaseException as e:
            if not ex.started_response:
                # Cut before any verdict (the client left, shutdown, a bug): none to give, but
                # a half-open breaker must hear that its probe is over.
                reason = f"attempt ended before an answer ({type(e).__name__})"
                fw.fleet.mark_failure(backend, reason, kind=FailureKind.CANCELLED)
            raise
        finally:
            backend.detach(ex)
            fw.steering.inflight(backend.name, -1)
            if turn is not None:
                fw.steering.leave_slot(turn, facts)


async def fail(
    ex: Exchange,
    send: Send,
    record: RequestRecord,
    status: int,
    message: str,
    code: str,
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """Answer the client with the proxy's own error (an OpenAI-style body) and end the
    record: a 429 logs a warning (overload), anything else an error."""
    if status == 429:
        log.warning("request %s refused: %s", ex.request_id, message)
    else:
        log.error("request %s failed: %s", ex.request_id, message)
    body = error_body(message, "server_error", None, code)
    await respond(send, status, body, ex.request_id, (*extra, *ex.response_headers))
    record.finish(None, status=status, error_type=code)


def _keeps_own_usage(backend: Backend) -> bool:
    """llama.cpp moves its `timings` onto the usage chunk when include_usage is set, so
    stripping that chunk would take them from the client: send such engines the client's
    own request instead (the meter still reads usage from the finish chunk if present)."""
    return backend.cfg.engine == "llamacpp"


def _prioritised(ex: Exchange, body: bytes, order: str, attempt: AttemptRecord) -> bytes:
    """The body for an engine that orders its queue by `priority`: the request's level (its
    class and its tenant's standing, proxy/admission/slots.py), in the engine's sense. Without a
    ticket (no API keys) the body goes as the client sent it."""
    ticket = TICKET.get()
    if ticket is None:
        return body
    level = ticket.level if order == "lower_first" else -ticket.level
    attempt.set_attribute("warmroute.engine.priority", level)
    return with_priority(body, ex.body, level)
