"""create_app(config): the app whose lifespan owns every resource."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.routing import Mount, Route

import plugins
from proxy.admission.backend_queue import BackendQueue
from proxy.admission.slots import CLASSES, Admission
from proxy.config import BackendConfig, Config, ConfigError, section_errors, unknown_key
from proxy.doctor.http import backend_info
from proxy.doctor.http import install as install_doctor
from proxy.doctor.http import routes as doctor_routes
from proxy.edge.gate import Edge
from proxy.fleet.http import routes as fleet_routes
from proxy.fleet.reconciler import Reconciler
from proxy.fleet.reload import ConfigReloader
from proxy.forwarding.forward import API_PATHS, Forwarding, ProxyEndpoint
from proxy.forwarding.retry import RetryPolicy
from proxy.forwarding.state import AppState, RequestRouting
from proxy.routing.index import capacity_blocks_from_tokens
from proxy.routing.setup import block_errors, block_names, build_router, build_routing
from proxy.routing.slot_turns import SlotTurns
from proxy.routing.slots import SlotLayout
from proxy.server import handlers
from proxy.telemetry import Telemetry
from proxy.tenants import http as tenants_http
from proxy.tenants.budgets import DEFAULT_TENANT, Budgets
from proxy.upstream.backends import CONTROL_LIMITS, Backend, BackendRegistry
from proxy.upstream.control import ControlClient
from proxy.upstream.pool import Upstream, client_ssl_context

log = logging.getLogger("warmroute")


def check_config(config: Config) -> None:
    """The checks that need more than the schema (no I/O)."""
    for i, b in enumerate(config.backends):
        if not isinstance(b, BackendConfig):
            continue
        ev = b.kv_events
        if ev is not None and not ev.model and len(b.models or ()) != 1:
            raise ConfigError(
                f"backends.{i}.kv_events.model: which served model do {b.key}'s KV blocks "
                "belong to? Set kv_events.model, or list exactly one model under `models:`"
            )
    if not config.backends:
        raise ConfigError(
            "backends: none configured; pass --backend URL (repeatable), set "
            "WARMROUTE_BACKENDS=url1,url2, or list them under `backends:` in the config file "
            "(a URL each, or `dns:` / `kubernetes:` to follow a fleet)"
        )
    if config.routing.policy not in plugins.policy_names():
        raise ConfigError(
            f"routing.policy: unknown policy {config.routing.policy!r}; choose one of: "
            + ", ".join(plugins.policy_names())
        )
    _check_plugin_blocks(config)
    try:
        build_router(config.routing)
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"routing.plugins: {e}") from None


def _check_plugin_blocks(config: Config) -> None:
    """Each `routing.plugins` block against its plugin's typed settings: a misspelt key or
    block name, or a value of the wrong type, is reported as any other configuration key."""
    lines: list[str] = []
    for name, err, model in block_errors(config.routing.plugins):
        at = ("routing", "plugins", name)
        if err is None or model is None:
            lines.append(f"  {'.'.join(at)}: {unknown_key(name, block_names())}")
        else:
            lines += section_errors(err, at, model).splitlines()[1:]
    if lines:
        raise ConfigError("invalid configuration:\n" + "\n".join(lines))


def create_app(
    config: Config,
    telemetry: Telemetry | None = None,
    reload: Callable[[], Config] | None = None,
    config_path: str | None = None,
) -> WarmrouteApp:
    """The proxy app; `telemetry` lets tests pass one with in-memory exporters. `reload`
    re-reads the configuration (serve passes it): SIGHUP, and changes of `config_path` when
    fleet.watch_config_s is set, apply its `backends:` while running."""
    check_config(config)
    state = _build_state(config, telemetry)
    engine_caches = _wire_routing(state)
    lifecycle = AppLifecycle(state, engine_caches, state.routing.router.hasher.kv_block_tokens)
    fleet = Reconciler(config, state.registry, lifecycle, state.telemetry)
    state.fleet = fleet
    state.telemetry.read_fleet(state.registry.counts)
    reloader = None
    if reload is not None:

        def load_checked() -> Config:
            new = reload()
            check_config(new)
            return new

        reloader = ConfigReloader(
            load_checked, fleet.reload, config_path, config.fleet.watch_config_s
        )
    forwarding = _forwarding(state, fleet)
    endpoints = {path: ProxyEndpoint(forwarding, api) for api, path in API_PATHS.items()}
    routes: list[Route | Mount] = [Route(p, ep, methods=["POST"]) for p, ep in endpoints.items()]
    routes += handlers.routes(state)
    routes += fleet_routes(fleet)  # POST/DELETE /admin/backends...: add, drain, resume, remove
    state.doctor = install_doctor(state)
    routes += doctor_routes(state, state.doctor)  # GET /admin/doctor, the findings gauge
    server = config.server
    targets = {CLASSES.index(k): v for k, v in config.tenants.ttft_targets_s.items()}
    state.admission = Admission(
        server.max_inflight,
        server.admission_queue,
        server.admission_timeout_s,
        targets,
        config.tenants.reserve_slots,
        config.tenants.reserve_prefills,
        lambda: len(state.registry.routable()),
    )
    if forwarding.budgets is not None or server.api_keys:
        # GET /admin/tenants: budgets left, and each tenant's place in the queue
        routes += tenants_http.routes(
            forwarding.budgets, state.admission, _tenant_names(config), state.steering.waiting
        )
    lifespan = _lifespan(state, engine_caches, fleet, reloader)
    inner = Starlette(routes=routes, lifespan=lifespan)
    inner.state.warmroute = state
    return WarmrouteApp(inner, endpoints, state)


def _build_state(config: Config, telemetry: Telemetry | None) -> AppState:
    """The app's resources, not opened yet: clients, the backend registry, routing."""
    tls = client_ssl_context(config.upstream)
    # Backends are addressed directly: HTTP(S)_PROXY from the environment is not used, by
    # the health client as by the forwarder (proxy/upstream/pool.py).
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=64), verify=tls, trust_env=False)
    registry = BackendRegistry(
        config,
        http,
        lambda: httpx.AsyncClient(limits=CONTROL_LIMITS, verify=tls, trust_env=False),
        ControlClient(config.timeouts, tls),
    )
    routing = build_routing(config)
    return AppState(
        config=config,
        registry=registry,
        upstream=Upstream(
            config.timeouts,
            config.upstream.max_connections_per_backend,
            tls,
            max_response_bytes=config.upstream.max_response_bytes,
            max_buffered_bytes=config.upstream.max_buffered_bytes,
        ),
        routing=routing,
        http=http,
        telemetry=telemetry or Telemetry(config.telemetry),
        steering=RequestRouting(
            routing, registry, _backend_queue(config), SlotTurns(config.routing.slot_wait)
        ),
    )


def _backend_queue(config: Config) -> BackendQueue | None:
    """Where requests wait while every backend they could go to is at its in-flight bound:
    the admission queue's limits (none: such requests are refused at once)."""
    server = config.server
    if server.admission_queue < 1 or server.admission_timeout_s <= 0:
        return None
    return BackendQueue(server.admission_queue, server.admission_timeout_s)


def _wire_routing(state: AppState) -> dict[str, Any]:
    """What routing reads from elsewhere: telemetry's gauges of it, the KV pool sizes engines
    publish, the engines' own KV events. Returns the KV-event caches by backend."""
    router = state.routing.router
    board = state.routing.board
    state.telemetry.read_inflight(lambda: board.local)
    state.telemetry.read_cache(router.capacity.snapshot)
    index, registry = state.routing.index, state.registry

    def index_blocks() -> dict[str, int]:
        # every backend, 0 where the index holds nothing (a policy that records no prefixes)
        held = dict.fromkeys([b.name for b in list(registry.backends.values())], 0)
        held.update(index.occupancies())
        return held

    state.telemetry.read_index(index_blocks, index.memory)
    hasher = router.hasher

    def kv_capacity(backend: str, tokens: int) -> None:
        # The KV pool bounds what the index keeps; the learner sizes it within that bound.
        blocks = capacity_blocks_from_tokens(tokens, hasher.block_chars, hasher.chars_per_token)
        router.set_published_capacity(backend, blocks)

    state.registry.on_kv_capacity = kv_capacity

    def slots(backend: str, layout: SlotLayout) -> None:
        # A slot engine holds its slots' prompts whatever its misses say (routing/slots.py).
        tokens = layout.ctx_tokens
        per_slot = None
        if tokens:
            per_slot = capacity_blocks_from_tokens(
                tokens, hasher.block_chars, hasher.chars_per_token
            )
        if router.capacity.set_slots(backend, layout, per_slot) and router.index is not None:
            router.index.set_capacity(backend, router.capacity.capacity(backend))

    state.registry.on_slots = slots
    engine_caches = kv_event_caches(state.config, state.registry, hasher.kv_block_tokens)
    router.exact.update(engine_caches)
    return engine_caches


def _forwarding(state: AppState, fleet: Reconciler) -> Forwarding:
    """The forwarder's collaborators, and telemetry's gauges of its health."""
    config = state.config
    forwarding = Forwarding(
        config=config,
        fleet=state.registry,
        upstream=state.upstream,
        steering=state.steering,
        recorder=state.telemetry,
        retry=RetryPolicy(config.retries),
        pd=pd_flows(config, state),
        membership=fleet,
        budgets=_budgets(state),
    )
    state.forwarding = forwarding
    registry = state.registry
    state.telemetry.read_health(
        lambda: {
            b.name: int(b.breaker is not None and b.breaker.state == "open")
            for b in registry.backends.values()
        },
        lambda: forwarding.retry.exhausted,
    )
    if forwarding.pd is not None:
        state.telemetry.read_disagg(forwarding.pd.gauges)
    return forwarding


def _budgets(state: AppState) -> Budgets | None:
    """The tenants' budgets, when any limit is set: in Redis when it is configured."""
    config = state.config
    if not config.tenants.limited:
        return None
    budgets = Budgets(
        config.tenants,
        redis=state.routing.redis,
        key_prefix=config.redis.key_prefix,
        replica=state.routing.board.replica_id,
        timeout_s=config.redis.timeout_s,
        tenants=_tenant_names(config),
    )
    tenants_http.observe(budgets, state.telemetry)
    return budgets


def _tenant_names(config: Config) -> tuple[str, ...]:
    return tuple(k.name for k in config.server.api_keys) or (DEFAULT_TENANT,)


def _lifespan(
    state: AppState,
    engine_caches: dict[str, Any],
    fleet: Reconciler,
    reloader: ConfigReloader | None,
) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    """Opens every resource in order at startup, says whether the proxy is ready, and
    closes them in reverse at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        config = state.config
        await state.upstream.start()
        await state.routing.start()
        await state.registry.start()
        for cache in engine_caches.values():
            await cache.start()
        await fleet.start()
        budgets = state.forwarding.budgets
        charging = None if budgets is None else asyncio.create_task(budgets.run_charging())
        if reloader is not None:
            reloader.install_signal()
            await reloader.start()
        healthy = sum(b.healthy for b in state.registry.backends.values())
        log.log(
            logging.INFO if healthy else logging.WARNING,
            "warmroute %s: %d of %d backend(s) healthy, policy %s, prefix index %s",
            "ready"
            if healthy
            else "started but not ready (GET /ready answers 503 until a "
            "backend passes its health check)",
            healthy,
            len(state.registry.backends),
            config.routing.policy,
            state.routing.index.info().get("mode", "?"),
        )
        try:
            yield
        finally:
            if charging is not None:
                charging.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await charging
            if budgets is not None:
                await budgets.release_all()  # (before the Redis client closes)
            if reloader is not None:
                await reloader.close()
            await fleet.close()
            for cache in engine_caches.values():
                await cache.close()
            await state.registry.close()
            await state.upstream.close()
            await state.routing.close()
            await state.http.aclose()
            state.telemetry.shutdown()

    return lifespan


def pd_flows(config: Config, state: AppState) -> Any:
    """The prefill/decode flows when disagg.mode is on or auto (None: off, today's path)."""
    if config.disagg.mode == "off":
        return None
    from proxy.disagg.controller import DisaggController
    from proxy.forwarding.pdflow import PdFlows

    hasher = state.routing.router.hasher
    return PdFlows(
        DisaggController(config.disagg),
        state.registry,
        state.steering,
        chars_per_token=hasher.chars_per_token,
    )


def kv_event_caches(
    config: Config, registry: BackendRegistry, default_block_tokens: int
) -> dict[str, Any]:
    """An EngineCache per backend that publishes KV events (pyzmq loads only if one does)."""
    caches: dict[str, Any] = {}
    for b in config.listed:
        cache = kv_event_cache(registry.backends[b.key], default_block_tokens)
        if cache is not None:
            caches[b.key] = cache
    return caches


def kv_event_cache(backend: Backend, default_block_tokens: int) -> Any:
    """The backend's EngineCache when its config names a KV-event endpoint, else None."""
    b = backend.cfg
    ev = b.kv_events
    if ev is None:
        return None
    from proxy.kvevents.source import EngineCache

    return EngineCache(
        b.key,
        ev.model or (b.models or [""])[0],
        ev.block_tokens or default_block_tokens,
        ev.endpoint,
        replay_endpoint=ev.replay_endpoint,
        topic=ev.topic,
        silent_after_s=ev.silent_after_s,
        healthy=_up_now(backend),
    )


class AppLifecycle:
    """What a join and a leave do to the app's per-backend resources (the reconciler's
    Lifecycle): everything kept per backend is released here, so none outlives it."""

    def __init__(self, state: AppState, caches: dict[str, Any], block_tokens: int) -> None:
        self.state = state
        self.caches = caches  # shared with the router's exact views
        self.block_tokens = block_tokens
        self._starting: set[asyncio.Task[None]] = set()

    def joined(self, backend: Backend) -> None:
        shared = self.state.routing.shared
        if shared is not None:
            shared.joined(backend.name)  # adopt its shared entries again, if it was here before
        doctor = self.state.doctor
        if doctor is not None:
            doctor.collector.backends[backend.name] = backend_info(backend.cfg)
        if backend.name in self.caches:
            return
        cache = kv_event_cache(backend, self.block_tokens)
        if cache is not None:
            self.caches[backend.name] = cache
            self.state.routing.router.exact[backend.name] = cache
            task = asyncio.create_task(cache.start(), name=f"kv events {backend.name}")
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    async def forget(self, backend: Backend) -> None:
        state, name = self.state, backend.name
        cache = self.caches.pop(name, None)
        if cache is not None:
            await cache.close()
        remaining = [b.name for b in state.registry.routable()]
        moved = await state.routing.forget(name, remaining)
        if moved:
            log.info(
                "backend %s left: %d placed prefix(es) moved to their next choice", name, moved
            )
        state.telemetry.forget_backend(name, backend.host, backend.port)
        state.upstream.forget_backend(backend.url)
        if state.doctor is not None:
            state.doctor.collector.forget(name)
        self._forget_turns(name)

    def _forget_turns(self, name: str) -> None:
        """A slot engine's collisions said what the engine there was (routing/slot_turns.py)."""
        if self.state.forwarding is not None:
            self.state.forwarding.steering.turns.forget(name)

    def reset(self, name: str) -> None:
        self._forget_turns(name)
        task = asyncio.create_task(self.state.routing.reset_cache(name), name=f"reset {name}")
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)
        cache = self.caches.get(name)
        if cache is not None:
            cache.reset()  # its view is of the engine that was there


def _up_now(backend: Backend) -> Callable[[], bool]:
    return lambda: backend.is_up(time.monotonic())


class WarmrouteApp:
    """Sends the hot POST endpoints straight to their raw ASGI handlers.

    Starlette's router and middleware stack cost ~5% of the proxy's CPU per request on the
    streaming path; everything else (lifespan, small endpoints, 404s) still goes through it.
    """

    def __init__(self, inner: Starlette, endpoints: dict[str, ProxyEndpoint], state: AppState):
        self.inner = inner
        self.endpoints = endpoints
        self.state = state
        backends = state.registry.backends.values()
        # Access, admission, connection limits and path hygiene first (proxy/edge/gate.py).
        self.edge = Edge(
            state.config.server,
            endpoints,
            inner,
            state.telemetry,
            known_model=lambda m: any(b.models is not None and m in b.models for b in backends),
            tenants=state.config.tenants,
            admission=state.admission,
            backend_queue=state.steering.waiting,
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.edge(scope, receive, send)
