"""The backend registry: configured backends, their models, health and load signals.

Health, model discovery and engine-metric scraping run in background tasks owned by the app's
lifespan; the request path only reads the in-memory state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from proxy import engines
from proxy.config import BackendConfig, Config
from proxy.outlier import Breaker
from proxy.routing.types import BackendView, EngineLoad

log = logging.getLogger("warmroute.backends")

# Engine-specific load gauges: the engines' own queue and KV signals, scraped.
LOAD_METRICS: dict[str, dict[str, str]] = {
    "vllm": {
        "vllm:num_requests_waiting": "waiting",
        "vllm:num_requests_running": "running",
        "vllm:kv_cache_usage_perc": "kv_usage",
        "vllm:gpu_cache_usage_perc": "kv_usage",  # older vLLM name
        # Cumulative counters (EngineLoad.counters): the doctor compares them across its window
        # to split TTFT into queueing and prefill and to read the prefix cache (docs/doctor.md).
        "vllm:request_queue_time_seconds_sum": "queue_time_sum",
        "vllm:request_queue_time_seconds_count": "queue_time_count",
        "vllm:request_prefill_time_seconds_sum": "prefill_time_sum",
        "vllm:request_prefill_time_seconds_count": "prefill_time_count",
        "vllm:prefix_cache_queries_total": "prefix_queries",
        "vllm:prefix_cache_hits_total": "prefix_hits",
        "vllm:num_preemptions_total": "preemptions",
    },
    "sglang": {
        "sglang:num_queue_reqs": "waiting",
        "sglang:num_running_reqs": "running",
        "sglang:token_usage": "kv_usage",
    },
    "llamacpp": {
        "llamacpp:requests_deferred": "waiting",
        "llamacpp:requests_processing": "running",
    },
}
HEALTH_PATH = {
    "vllm": "/health",
    "sglang": "/health",
    "llamacpp": "/health",
    "openai": "/v1/models",
    "auto": "/v1/models",  # until /metrics says which engine it is (proxy/engines.py)
}


KV_CONFIG_INFO = "vllm:cache_config_info"
_GAUGES = ("waiting", "running", "kv_usage")


def parse_load(engine: str, text: str, now: float) -> EngineLoad | None:
    """Sum the engine's load gauges over all label sets in a Prometheus text exposition.

    Parsed with prometheus_client's parser (values, labels, escapes and timestamps as the
    format defines them), but only on the lines of the few families we read: vLLM's
    exposition runs to hundreds of KB, every scrape, on the event loop, and parsing all of it
    costs ~50x more than picking the lines by name first.
    """
    wanted = LOAD_METRICS.get(engine)
    if not wanted:
        return None
    names = (*wanted, KV_CONFIG_INFO)
    lines = [ln for ln in text.splitlines() if ln.startswith(names)]
    if not lines:
        return None
    sums: dict[str, float] = {}
    kv_tokens: int | None = None
    try:
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except ValueError:
        families = _per_line(lines)  # one bad line must not hide the rest
    for family in families:
        for sample in family.samples:
            if sample.name in (KV_CONFIG_INFO, KV_CONFIG_INFO + "_total"):
                kv_tokens = _kv_pool_tokens(sample.labels) or kv_tokens
                continue
            attr = wanted.get(sample.name)
            if attr is not None and sample.value == sample.value:  # not NaN
                sums[attr] = sums.get(attr, 0.0) + sample.value
    if not sums and kv_tokens is None:
        return None
    return EngineLoad(
        waiting=sums.get("waiting"),
        running=sums.get("running"),
        kv_usage=sums.get("kv_usage"),
        kv_tokens=kv_tokens,
        scraped_at=now,
        counters={k: v for k, v in sums.items() if k not in _GAUGES},
    )


def _per_line(lines: list[str]) -> list[Any]:
    out: list[Any] = []
    for line in lines:
        with contextlib.suppress(ValueError):
            out.extend(text_string_to_metric_families(line + "\n"))
    return out


def _kv_pool_tokens(labels: dict[str, str]) -> int | None:
    """num_gpu_blocks x block_size from vLLM's cache_config_info labels."""
    try:
        return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return None


@dataclass
class Backend:
    cfg: BackendConfig
    models: frozenset[str] | None = None
    healthy: bool = True  # optimistic until the first check says otherwise
    load: EngineLoad = field(default_factory=EngineLoad)
    failures: int = 0  # failed attempts since the last success
    last_error: str | None = None
    breaker: Breaker | None = None  # passive health (outlier ejection), set by the registry

    def __post_init__(self) -> None:
        self.name = self.cfg.key
        self.url = self.cfg.url
        parts = urlsplit(self.url)
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.api_key = self.cfg.api_key()
        if self.cfg.models:
            self.models = frozenset(self.cfg.models)

    def is_up(self, now: float) -> bool:
        return self.healthy and (self.breaker is None or self.breaker.allows(now))

    def view(
        self,
        now: float,
        inflight: int,
        prefill_tokens_per_s: float | None = None,
        mean_prefill_s: float | None = None,
        backlog_tokens: float = 0.0,
    ) -> BackendView:
        return BackendView(
            name=self.name,
            url=self.url,
            engine=self.cfg.engine,
            role=self.cfg.role,
            weight=self.cfg.weight,
            healthy=self.is_up(now),
            inflight=inflight,
            load=self.load,
            models=self.models,
            prefill_tokens_per_s=prefill_tokens_per_s,
            mean_prefill_s=mean_prefill_s,
            backlog_tokens=backlog_tokens,
            max_inflight=self.cfg.max_inflight,
        )


class BackendRegistry:
    def __init__(self, config: Config, http: httpx.AsyncClient) -> None:
        self.config = config
        self.http = http
        self.backends: dict[str, Backend] = {}
        for b in config.backends:
            self.backends[b.key] = Backend(
                b, breaker=Breaker(config.outlier, config.retries.unhealthy_cooldown_s, name=b.key)
            )
        # Called with (backend name, KV pool tokens) when an engine reports its pool size.
        self.on_kv_capacity: Callable[[str, int], None] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def __iter__(self) -> Iterable[Backend]:
        return iter(self.backends.values())

    def __getitem__(self, name: str) -> Backend:
        return self.backends[name]

    # -- what the request path asks -------------------------------------------------------
    def may_serve(self, model: str) -> bool:
        return any(b.models is None or model in b.models for b in self.backends.values())

    def model_list(self) -> list[dict[str, object]]:
        seen: dict[str, dict[str, object]] = {}
        for b in self.backends.values():
            for m in sorted(b.models or ()):
                seen.setdefault(
                    m, {"id": m, "object": "model", "created": 0, "owned_by": "warmroute"}
                )
        return list(seen.values())

    def any_ready(self) -> bool:
        now = time.monotonic()
        return any(b.is_up(now) for b in self.backends.values())

    def mark_attempt(self, backend: Backend) -> None:
        if backend.breaker is not None:
            backend.breaker.on_attempt()

    def mark_failure(self, backend: Backend, reason: str, *, kind: str) -> None:
        """A failed attempt of kind `kind` (proxy/retry.py's Retry.kind). A cancelled one (the
        client left, shutdown) says nothing of the backend: only a half-open probe hears of it."""
        breaker = backend.breaker
        if kind != "cancelled":
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
        timeout = self.config.timeouts.health_s + 0.5
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(self._check(b, discover=True) for b in self.backends.values())),
                timeout,
            )
        for b in self.backends.values():
            self._tasks.append(asyncio.create_task(self._poll(b), name=f"poll {b.name}"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()

    def _headers(self, b: Backend) -> dict[str, str]:
        return {"authorization": f"Bearer {b.api_key}"} if b.api_key else {}

    async def _check(self, b: Backend, *, discover: bool) -> None:
        timeout = self.config.timeouts.health_s
        was = b.healthy
        try:
            if discover and b.cfg.models is None:
                r = await self.http.get(
                    f"{b.url}/v1/models", headers=self._headers(b), timeout=timeout
                )
                r.raise_for_status()
                ids = frozenset(m["id"] for m in r.json().get("data", []) if "id" in m)
                if ids != b.models:
                    log.info("backend %s serves %s", b.name, ", ".join(sorted(ids)) or "no models")
                b.models = ids
            fetched_models = discover and b.cfg.models is None
            if not (fetched_models and HEALTH_PATH[b.cfg.engine] == "/v1/models"):
                r = await self.http.get(
                    b.url + HEALTH_PATH[b.cfg.engine], headers=self._headers(b), timeout=timeout
                )
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

    async def _scrape(self, b: Backend) -> None:
        if b.cfg.engine == "auto":
            b.cfg = await engines.detect(
                self.http, b.cfg, self._headers(b), self.config.timeouts.health_s
            )
        if b.cfg.engine not in LOAD_METRICS:
            return
        try:
            r = await self.http.get(f"{b.url}/metrics", timeout=self.config.timeouts.health_s)
            r.raise_for_status()
        except httpx.HTTPError as e:
            log.debug("metrics scrape of %s failed: %s", b.name, e)
            return
        load = parse_load(b.cfg.engine, r.text, time.monotonic())
        if load is not None:
            if load.kv_tokens and load.kv_tokens != b.load.kv_tokens and self.on_kv_capacity:
                log.info("backend %s has a KV pool of %d tokens", b.name, load.kv_tokens)
                self.on_kv_capacity(b.name, load.kv_tokens)
            b.load = load

    async def _poll(self, b: Backend) -> None:
        h = self.config.health
        next_health = time.monotonic() + h.interval_s
        next_models = time.monotonic() + h.models_refresh_s
        while True:
            await asyncio.sleep(min(h.metrics_scrape_s, h.interval_s))
            now = time.monotonic()
            if now >= next_models:
                next_models = now + h.models_refresh_s
                await self._check(b, discover=True)
            elif now >= next_health or not b.healthy:
                next_health = now + h.interval_s
                await self._check(b, discover=False)
            await self._scrape(b)
