"""The backend registry: configured backends, their models, health and load signals.

Health, model discovery and engine-metric scraping run in background tasks owned by the app's
lifespan; the request path only reads the in-memory state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

import httpx

from proxy import engines
from proxy.config import BackendConfig, Config
from proxy.routing.slots import SlotLayout
from proxy.routing.types import BackendView, Changes, EngineLoad, one_copy
from proxy.types import FailureKind
from proxy.upstream import slot_scrape
from proxy.upstream.cadence import check_interval, has_work, scrape_due
from proxy.upstream.engine_metrics import LOAD_METRICS, counters_reset, parse_load
from proxy.upstream.outlier import Breaker

if TYPE_CHECKING:
    from proxy.upstream.control import Answer, ControlClient

log = logging.getLogger("warmroute.backends")

HEALTH_PATH = {
    "vllm": "/health",
    "sglang": "/health",
    "llamacpp": "/health",
    "openai": "/v1/models",
    "auto": "/v1/models",  # until /metrics says which engine it is (proxy/engines.py)
}


# joining: added, not yet answered its health check and model list (gets no request);
# serving; draining: no new requests, its streams finish; drained: drained and kept listed
# (an admin drain, a terminating pod); gone: removed (kept a while for /admin/backends).
State = Literal["joining", "serving", "draining", "drained", "gone"]

# What a backend's view shows of it (Backend.view): setting one marks it for the ViewCache.
_VIEWED = frozenset({"healthy", "load", "models", "cfg"})


@dataclass
class Backend:
    cfg: BackendConfig
    models: frozenset[str] | None = None
    # Of `models`, the LoRA adapters the engine lists (vLLM: a card whose `parent` is its base
    # model), each with that parent: loaded and unloaded at run time without a restart.
    adapters: dict[str, str] = field(default_factory=dict)
    healthy: bool = True  # optimistic until the first check says otherwise
    load: EngineLoad = field(default_factory=EngineLoad)
    failures: int = 0  # failed attempts since the last success
    last_error: str | None = None
    breaker: Breaker | None = None  # passive health (outlier ejection), set by the registry
    source: str = "config"  # who listed it (proxy/fleet/members.py)
    state: State = "serving"
    # The requests on it now (forward.py attaches each attempt): a drain waits for them.
    streams: set[Any] = field(default_factory=set)
    since: float = field(default_factory=time.monotonic)  # in this state since
    attached: int = 0  # requests ever attached: the poll loop sees new traffic by it
    # Its registry's record of changed views (None until the registry lists it): health,
    # load, models and configuration mark this backend there, a change of state the fleet.
    changes: Changes | None = field(default=None, repr=False, compare=False)
    # A slot engine's slots (llama.cpp: proxy.upstream.slot_scrape), and whether the engine
    # at this address was asked for them yet (again after a restart).
    slots: SlotLayout | None = None
    slots_asked: bool = False

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _VIEWED:
            changes = self.__dict__.get("changes")
            if changes is not None:
                changes.mark(self.name)
        elif name == "state":
            changes = self.__dict__.get("changes")
            if changes is not None:
                changes.mark_all()

    def __post_init__(self) -> None:
        self.name = self.cfg.key
        self.url = self.cfg.url
        parts = urlsplit(self.url)
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.api_key = self.cfg.api_key()
        if self.cfg.models:
            self.models = one_copy(frozenset(self.cfg.models))
        self._idle = asyncio.Event()
        self._idle.set()
        # Set by each request routed here and each change of state: an idle backend's poll
        # task wakes on it and plans again (a request: back to the busy cadence at once)
        # instead of sleeping out its idle interval.
        self._wake = asyncio.Event()

    def is_up(self, now: float) -> bool:
        return (
            self.state == "serving"
            and self.healthy
            and (self.breaker is None or self.breaker.allows(now))
        )

    def attach(self, request: Any) -> None:
        self.streams.add(request)
        self.attached += 1
        self._idle.clear()
        self._wake.set()

    def detach(self, request: Any) -> None:
        self.streams.discard(request)
        if not self.streams:
            self._idle.set()

    async def idle(self) -> None:
        """Returns once no request is on this backend."""
        await self._idle.wait()

    def set_state(self, state: State) -> None:
        if state != self.state:
            self.state = state
            self.since = time.monotonic()
            self._wake.set()

    def reconfigure(self, cfg: BackendConfig) -> None:
        """The same address listed with other keys (role, weight, models, ...)."""
        self.cfg = cfg
        self.api_key = cfg.api_key()
        if cfg.models:
            self.models = one_copy(frozenset(cfg.models))

    def view(
        self,
        now: float,
        inflight: int,
        prefill_tokens_per_s: float | None = None,
        mean_prefill_s: float | None = None,
        backlog_tokens: float = 0.0,
        up: bool | None = None,
    ) -> BackendView:
        """`up`: is_up(now), where the caller has read it."""
        return BackendView(
            name=self.name,
            url=self.url,
            engine=self.cfg.engine,
            role=self.cfg.role,
            weight=self.cfg.weight,
            healthy=self.is_up(now) if up is None else up,
            inflight=inflight,
            load=self.load,
            models=self.models,
            prefill_tokens_per_s=prefill_tokens_per_s,
            mean_prefill_s=mean_prefill_s,
            backlog_tokens=backlog_tokens,
            max_inflight=self.cfg.max_inflight,
        )


GONE_KEPT = 64  # departed backends /admin/backends still shows


# One connection pool per backend for the background checks: a pool shared by a whole fleet
# scans every connection it holds for each request it assigns (httpcore), which in front of 256
# engines cost more than half a core while idle (deploy/perf/idle_cpu.py).
# A pooled connection is not reused past 2 s idle: engines' servers close theirs (uvicorn's
# keep-alive, which vLLM and SGLang serve with, is 5 s), and a check sent on a connection the
# server is closing fails with "Server disconnected without sending a response".
CONTROL_LIMITS = httpx.Limits(max_connections=2, max_keepalive_connections=1, keepalive_expiry=2.0)
# What a request sent on a kept-alive connection the server closed under it fails with: tried
# once more at once (a new connection) before it counts against the backend.
STALE_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
# Where in its interval a backend's first check and scrape fall (0..1); tests pin it.
JITTER: Callable[[], float] = random.random


class BackendRegistry:
    def __init__(
        self,
        config: Config,
        http: httpx.AsyncClient,
        control: Callable[[], httpx.AsyncClient] | None = None,
        fetch: ControlClient | None = None,
    ) -> None:
        """`http` is the shared client; `control` makes each backend's own client for its
        health checks, model lists and scrapes (without it, they use `http`); `fetch`, where
        given, sends those over the proxy's own pooled connections instead (a fraction of
        httpx's CPU: proxy/upstream/control.py). Engine detection stays on httpx."""
        self.config = config
        self.http = http
        self._control = control
        self._fetch = fetch
        self._clients: dict[str, httpx.AsyncClient] = {}
        self.backends: dict[str, Backend] = {}
        # Whose view changed since the ViewCache last read them (routing.types.Changes).
        self.changes = Changes()
        self._routable: tuple[int, list[Backend]] | None = None  # (changes.epoch, the list)
        for b in config.listed:
            self.backends[b.key] = self._new(b, "config", "serving")
        self.gone: deque[Backend] = deque(maxlen=GONE_KEPT)
        # Called with (backend name, KV pool tokens) when an engine reports its pool size.
        self.on_kv_capacity: Callable[[str, int], None] | None = None
        # Called with a joining backend's name once it answered: it serves from now on.
        self.on_serving: Callable[[Backend], None] | None = None
        # Called with (name, what changed) when the engine at an address is not the one it was.
        self.on_restart: Callable[[Backend, str], None] | None = None
        # Called with (backend name, its slots) when a slot engine's layout is new.
        self.on_slots: Callable[[str, SlotLayout], None] | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._idle: set[str] = set()  # backends on the idle cadence (check_interval's count)
        self._closing: set[asyncio.Task[None]] = set()
        self._started = False

    def _new(self, cfg: BackendConfig, source: str, state: State) -> Backend:
        breaker = Breaker(
            self.config.outlier, self.config.retries.unhealthy_cooldown_s, name=cfg.key
        )
        changes = self.changes
        breaker.watch = partial(changes.mark, cfg.key)  # an ejection changes its view
        return Backend(cfg, breaker=breaker, source=source, state=state, changes=changes)

    def __iter__(self) -> Iterable[Backend]:
        return iter(self.backends.values())

    def __getitem__(self, name: str) -> Backend:
        return self.backends[name]

    def get(self, name: str) -> Backend | None:
        return self.backends.get(name)

    def routable(self) -> list[Backend]:
        """The backends routing may choose from: serving ones (healthy or not: the filters
        say why one is left out); joining, draining and drained ones get no new request."""
        epoch = self.changes.epoch
        kept = self._routable
        if kept is None or kept[0] != epoch:
            # Made again when the fleet changed (a join, a departure, a change of state).
            kept = self._routable = (
                epoch,
                [b for b in self.backends.values() if b.state == "serving"],
            )
        return list(kept[1])

    # -- membership (proxy/fleet/reconciler.py decides; this keeps the records) -------------
    def add(self, cfg: BackendConfig, source: str) -> Backend:
        """A new engine: joining until its health check and model list answered."""
        b = self._new(cfg, source, "joining")
        b.healthy = False  # no request before it answered
        self.backends[cfg.key] = b
        self.changes.mark_all()
        if self._started:
            self._tasks[b.name] = asyncio.create_task(self._poll(b), name=f"poll {b.name}")
        return b

    def remove(self, name: str) -> Backend | None:
        """Forget the record (its requests already ended: the reconciler drained it)."""
        b = self.backends.pop(name, None)
        self.changes.mark_all()
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
        self._idle.discard(name)
        if b is not None and self._fetch is not None:
            self._fetch.forget(b.url)
        client = self._clients.pop(name, None)
        if client is not None:
            closing = asyncio.create_task(client.aclose(), name=f"close {name}")
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        if b is not None:
            b.set_state("gone")
            self.gone.append(b)
        return b

    def counts(self) -> dict[str, int]:
        """Backends per state (the fleet gauge)."""
        out = {"joining": 0, "serving": 0, "draining": 0, "drained": 0}
        for b in self.backends.values():
            out[b.state] = out.get(b.state, 0) + 1
        return out

    # -- what the request path asks -------------------------------------------------------
    def may_serve(self, model: str) -> bool:
        return any(
            (b.models is None or model in b.models) and b.state in ("serving", "joining")
            for b in self.backends.values()
        )

    def model_list(self) -> list[dict[str, object]]:
        """Every model a backend serves, once; a LoRA adapter with its `parent`, as vLLM lists
        it (one card, whichever backend said so first)."""
        seen: dict[str, dict[str, object]] = {}
        for b in self.backends.values():
            for m in sorted(b.models or ()):
                card: dict[str, object] = {
                    "id": m,
                    "object": "model",
                    "created": 0,
                    "owned_by": "warmroute",
                }
                if m in b.adapters:
                    card["parent"] = b.adapters[m]
                seen.setdefault(m, card)
        return list(seen.values())

    def any_ready(self) -> bool:
        now = time.monotonic()
        return any(b.is_up(now) for b in self.backends.values())

    def mark_attempt(self, backend: Backend) -> None:
        if backend.breaker is not None:
            backend.breaker.on_attempt()

    def mark_failure(self, backend: Backend, reason: str, *, kind: FailureKind) -> None:
        """A failed attempt of kind `kind` (proxy/forwarding/retry.py's Retry.kind). A cancelled
        one (the client left, shutdown) says nothing of the backend: only a half-open probe hears
        of it."""
        breaker = backend.breaker
        if kind != FailureKind.CANCELLED:
            backend.failures += 1
            backend.last_error = reason
        now = time.monotonic()
        if breaker is not None and breaker.failure(kind, now):
            log.warning(
                "backend %s ejected for %.1fs after %d consecutive failure(s) (last: %s)",
                backend.name,
                breaker.open_until - now,
                breaker.consecutive,
                reason,
            )

    def mark_success(self, backend: Backend) -> None:
        backend.failures = 0
        breaker = backend.breaker
        if breaker is not None and (breaker.consecutive or breaker.state != "closed"):
            if breaker.state != "closed":
                log.info("backend %s answered again; back in rotation", backend.name)
            breaker.success()

    # -- background work ------------------------------------------------------------------
    async def start(self) -> None:
        """Discover models and health once (bounded), then keep polling in the background."""
        if self._fetch is not None:
            await self._fetch.start()
        timeout = self.config.timeouts.health_s + 0.5
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(self._check(b, discover=True) for b in self.backends.values())),
                timeout,
            )
        for b in self.backends.values():
            self._tasks[b.name] = asyncio.create_task(self._poll(b), name=f"poll {b.name}")
        self._started = True

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        self._idle.clear()
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            await c.aclose()
        if self._fetch is not None:
            await self._fetch.close()

    def client(self, b: Backend) -> httpx.AsyncClient:
        """The client for `b`'s background requests: its own pool, made on first use."""
        if self._control is None:
            return self.http
        c = self._clients.get(b.name)
        if c is None:
            c = self._clients[b.name] = self._control()
        return c

    def _headers(self, b: Backend) -> dict[str, str]:
        return {"authorization": f"Bearer {b.api_key}"} if b.api_key else {}

    async def _get(
        self, b: Backend, url: str, limit_s: float, headers: dict[str, str] | None = None
    ) -> httpx.Response | Answer:
        """A background GET, sent again once at once if the connection it went out on was
        closed under it (the server's keep-alive ran out first): a race, not an outage. One
        such lost check used to mark a busy engine unhealthy, and placement moved its prompts
        away and back, each move a cold prefill."""
        if self._fetch is not None:  # (which retries a stale pooled connection itself)
            return await self._fetch.get(url, headers, limit_s)
        client = self.client(b)
        try:
            return await client.get(url, headers=headers, timeout=limit_s)
        except STALE_CONNECTION:
            return await client.get(url, headers=headers, timeout=limit_s)

    async def _check(self, b: Backend, *, discover: bool) -> None:
        timeout = self.config.timeouts.health_s
        was = b.healthy
        try:
            if discover and b.cfg.models is None:
                url = engines.backend_url(b.url, "/v1/models")
                r = await self._get(b, url, timeout, self._headers(b))
                r.raise_for_status()
                cards = [m for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m]
                ids = frozenset(m["id"] for m in cards)
                if ids != b.models:
                    self._models_changed(b, ids, _adapters(cards))
            fetched_models = discover and b.cfg.models is None
            if not (fetched_models and HEALTH_PATH[b.cfg.engine] == "/v1/models"):
                url = engines.backend_url(b.url, HEALTH_PATH[b.cfg.engine])
                r = await self._get(b, url, timeout, self._headers(b))
                r.raise_for_status()
            b.healthy = True
            if b.breaker is not None:
                b.breaker.health_ok(time.monotonic())
            b.last_error = None
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            b.healthy = False
            b.last_error = f"health check failed: {type(e).__name__}: {e}"
        if was != b.healthy:
            if b.healthy:
                log.info("backend %s is healthy", b.name)
            else:
                log.warning("backend %s is unhealthy: %s", b.name, b.last_error)

    def _models_changed(self, b: Backend, ids: frozenset[str], adapters: dict[str, str]) -> None:
        """A new model list. Only a change of base models says the engine restarted: adapters
        come and go at run time (vLLM's load_lora_adapter, a LoRA resolver), and the cache of
        the base model and of the other adapters stays."""
        old, old_adapters = b.models, b.adapters
        base, old_base = ids - adapters.keys(), None if old is None else old - old_adapters.keys()
        if old is None or base != old_base:
            log.info("backend %s serves %s", b.name, ", ".join(sorted(ids)) or "no models")
            if old is not None and b.state != "joining" and self.on_restart:
                b.slots, b.slots_asked = None, False
                self.on_restart(b, "its model list changed")
        else:
            added = sorted(adapters.keys() - old_adapters.keys())
            gone = sorted(old_adapters.keys() - adapters.keys())
            log.info(
                "backend %s: LoRA adapters%s%s",
                b.name,
                f" loaded: {', '.join(added)}" if added else "",
                f"{';' if added else ''} unloaded: {', '.join(gone)}" if gone else "",
            )
        b.adapters = adapters
        b.models = one_copy(ids)

    async def _scrape(self, b: Backend) -> None:
        if b.cfg.engine == "auto":
            b.cfg = await engines.detect(
                self.client(b), b.cfg, self._headers(b), self.config.timeouts.health_s
            )
        if b.cfg.engine not in LOAD_METRICS:
            return
        try:
            url = engines.backend_url(b.url, "/metrics")
            r = await self._get(b, url, self.config.timeouts.health_s)
            r.raise_for_status()
        except httpx.HTTPError as e:
            log.debug("metrics scrape of %s failed: %s", b.name, e)
            return
        load = parse_load(b.cfg.engine, r.text, time.monotonic())
        if load is not None:
            went_back = counters_reset(b.load.counters, load.counters)
            if went_back and self.on_restart is not None:
                b.slots, b.slots_asked = None, False
                self.on_restart(b, f"its counter {went_back} went back")
            if load.kv_tokens and load.kv_tokens != b.load.kv_tokens and self.on_kv_capacity:
                log.info("backend %s has a KV pool of %d tokens", b.name, load.kv_tokens)
                self.on_kv_capacity(b.name, load.kv_tokens)
            b.load = load
        if b.cfg.engine == "llamacpp" and self.on_slots is not None:
            await self._slots(b)

    async def _slots(self, b: Backend) -> None:
        """A llama.cpp engine's slots: asked once, else inferred from its busy slots."""
        layout, timeout, headers = None, self.config.timeouts.health_s, self._headers(b)
        if not b.slots_asked:  # /props and /slots want the API key, as /v1 does
            b.slots_asked = True
            layout = await slot_scrape.ask(
                lambda path: self._get(b, engines.backend_url(b.url, path), timeout, headers)
            )
        if layout is None:
            layout = slot_scrape.inferred(b.slots, b.load.running)
        if layout is not None and layout != b.slots and self.on_slots is not None:
            log.info("backend %s keeps %d slots (%s)", b.name, layout.slots, layout.source)
            b.slots = layout
            self.on_slots(b.name, layout)

    async def _join(self, b: Backend) -> None:
        """Health and the model list first, at the health interval until both answered (or
        it is no longer joining: drained meanwhile)."""
        h = self.config.health
        while b.state == "joining":
            await self._check(b, discover=True)
            if b.healthy and b.state == "joining":
                b.set_state("serving")
                if self.on_serving is not None:
                    self.on_serving(b)
                return
            await asyncio.sleep(min(h.interval_s, 1.0))

    async def _poll(self, b: Backend) -> None:
        """One backend's background work, each piece when it is due (check_interval and
        scrape_due) and the task asleep in between: an idle fleet's tasks wake once per idle
        interval each, not every scrape interval. The first scrape and the first check after
        start (or a join) fall at a random point of their interval, so a fleet started
        together is not checked in the same tick."""
        h = self.config.health
        phase = JITTER()
        first_check = first_scrape = True
        checked_at = scraped_at = models_at = time.monotonic()
        seen = b.attached
        while True:
            if b.state == "joining":  # added, or resumed while unhealthy
                await self._join(b)
                await self._scrape(b)
                seen, first_scrape = b.attached, False
                checked_at = scraped_at = models_at = time.monotonic()
            b._wake.clear()  # a request or a change of state from here on ends the wait below
            busy = has_work(b, seen)
            ejected = b.breaker is not None and b.breaker.state != "closed"
            idle = b.healthy and not busy and not ejected
            if idle:
                self._idle.add(b.name)
            else:
                self._idle.discard(b.name)
            interval = check_interval(
                h, healthy=b.healthy, busy=busy, ejected=ejected, idle_backends=len(self._idle)
            )
            check_at = checked_at + interval * (phase if first_check else 1.0)
            scrape_at = math.inf  # the first scrape is due whatever: load, KV pool, engine
            if busy or first_scrape:
                scrape_at = scraped_at + h.metrics_scrape_s * (phase if first_scrape else 1.0)
            delay = min(check_at, scrape_at) - time.monotonic()
            if delay > 0:
                if busy:  # woken by the clock: no wake-up per request while it has traffic
                    await asyncio.sleep(delay)
                else:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await b._wake.wait()
                continue  # what is due now may have changed while asleep
            now = time.monotonic()
            checked = now >= check_at
            if checked:
                discover = now >= models_at + h.models_refresh_s  # rides on a health check
                checked_at, first_check = now, False
                if discover:
                    models_at = now
                await self._check(b, discover=discover)
            if first_scrape or scrape_due(b, seen, checked):
                seen, first_scrape = b.attached, False
                scraped_at = time.monotonic()
                await self._scrape(b)


def _adapters(cards: list[dict[str, Any]]) -> dict[str, str]:
    """The LoRA adapters of a /v1/models answer: cards with a `parent` (vLLM names the base
    model there; a base model's is null), as {adapter: parent}."""
    return {
        str(m["id"]): str(m["parent"])
        for m in cards
        if isinstance(m.get("parent"), str) and m["parent"] and m["parent"] != m["id"]
    }
