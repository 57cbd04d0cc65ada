"""Windows of measurements in the running proxy: per backend and model, the last minutes.

The collector is fed where a request's telemetry record finishes (one call per request, a
flat tuple appended to a bounded deque: no work on the way to the first byte), and samples
the engine gauges the backend registry already scrapes each time a request finishes on that
backend and a new scrape has arrived since. Nothing here does I/O or runs a task; the
diagnosis reads a copy when asked, and only then are the tuples made RequestSamples.

Why tuples of plain values, with the gaps packed into bytes: a RequestSample and an
array("d") per request cost ~45,000 instructions (the array converts each gap through
PyArg_Parse) and are two objects the garbage collector walks for as long as the window keeps
them; the tuple is left alone by the collector after its first pass.
"""

from __future__ import annotations

import struct
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.doctor.model import GaugeSample, Hardware, RequestSample, TenantRequest, Window

DEFAULT_WINDOW_S = 300.0
MAX_REQUESTS = 2000  # per backend and model: enough for an ITL p99 at any traffic
MAX_GAPS_PER_STREAM = 4096  # a longer stream keeps its first ones (memory stays bounded)
# Every window's gaps together, once the windows are full. One (backend, model) of 4,096-token
# streams would hold 2,000 x 4,096 doubles = 66 MB: a fleet of long answers would take the
# proxy past its memory limit. More windows keep fewer gaps per stream instead (64 at least).
GAP_BUDGET_BYTES = 64 << 20
MIN_GAPS_PER_STREAM = 64
MAX_GAUGES = 1000  # per backend: 2,000 s of scrapes every 2 s


class Facts(Protocol):
    """What the doctor reads of the stream meter's facts (proxy.types.StreamFacts)."""

    ttft_s: float | None
    upstream_ttft_s: float | None
    itl_s: list[float]
    input_tokens: int | None
    cached_tokens: int | None
    output_tokens: int | None
    first_output_at: float | None
    engine_prefill_s: float | None


class Load(Protocol):
    """What the doctor reads of a backend's scraped gauges (proxy.routing.types.EngineLoad)."""

    waiting: float | None
    running: float | None
    kv_usage: float | None
    kv_tokens: int | None
    scraped_at: float


class DecisionLike(Protocol):
    matched_blocks: Mapping[str, int]
    block_chars: int
    prompt_chars: int


@dataclass(frozen=True, slots=True)
class BackendInfo:
    name: str
    engine: str = "openai"
    hardware: Hardware | None = None


def predicted_tokens(
    decision: DecisionLike | None, backend: str, input_tokens: int | None
) -> tuple[float | None, float | None]:
    """(tokens the index expected cached on `backend`, on the best backend it looked at).

    The index matches blocks of characters; their share of the prompt's characters, times the
    engine's prompt tokens, is the prediction in the engine's unit."""
    if decision is None or not input_tokens or not decision.prompt_chars:
        return None, None
    per_block = decision.block_chars / decision.prompt_chars * input_tokens
    matched = decision.matched_blocks
    cap = float(input_tokens)
    # No min()/max(default=) calls: with keywords they parse their arguments every time
    # (~4,500 instructions of a finished request's ~24,000 here).
    here = matched.get(backend, 0) * per_block
    best = (max(matched.values()) if matched else 0) * per_block
    return (here if here <= cap else cap), (best if best <= cap else cap)


# One finished request as kept in a window: RequestSample's fields in its order (start, ttft_s,
# upstream_ttft_s, first_at, the gaps packed as doubles, input_tokens, cached_tokens,
# output_tokens, predicted_tokens, seen_tokens, engine_prefill_s, end_at, gaps); the last two
# are None unless the stream had more gaps than were kept.
_Row = tuple[
    float,
    float | None,
    float | None,
    float | None,
    bytes,
    int | None,
    int | None,
    int | None,
    float | None,
    float | None,
    float | None,
    float | None,
    int | None,
]
_PACKERS: dict[int, struct.Struct] = {}  # by gap count (at most MAX_GAPS_PER_STREAM of them)


def _pack(gaps: list[float]) -> bytes:
    """The gaps as native doubles (what array("d") holds)."""
    n = len(gaps)
    packer = _PACKERS.get(n)
    if packer is None:
        packer = _PACKERS[n] = struct.Struct(f"{n}d")
    return packer.pack(*gaps)


def _sample(row: _Row) -> RequestSample:
    itl: array[float] | tuple[()] = ()
    if row[4]:
        itl = array("d")
        itl.frombytes(row[4])
    return RequestSample(
        start=row[0],
        ttft_s=row[1],
        upstream_ttft_s=row[2],
        first_at=row[3],
        itl_s=itl,
        input_tokens=row[5],
        cached_tokens=row[6],
        output_tokens=row[7],
        predicted_tokens=row[8],
        seen_tokens=row[9],
        engine_prefill_s=row[10],
        end_at=row[11],
        gaps=row[12],
    )


class Collector:
    """Bounded per-(backend, model) windows of finished requests and sampled gauges."""

    def __init__(
        self,
        backends: Iterable[BackendInfo],
        *,
        loads: Callable[[str], Load | None] | None = None,
        counters: Callable[[Load], Mapping[str, float]] | None = None,
        engines: Callable[[str], str | None] | None = None,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.perf_counter,
        max_requests: int = MAX_REQUESTS,
        gap_budget_bytes: int = GAP_BUDGET_BYTES,
    ) -> None:
        self.backends = {b.name: b for b in backends}
        self.loads = loads
        self.counters = counters
        self.engines = engines  # the engine kind now (an `auto` backend learns it when scraped)
        self.window_s = window_s
        self.clock = clock
        self.max_requests = max_requests
        self.gap_budget_bytes = gap_budget_bytes
        self.gaps_per_stream = self._gaps_per_stream(1)
        self.policy: str | None = None
        self.cache: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None
        self.disagg: Callable[[], Mapping[str, Any]] | None = None  # the decider's view
        self._requests: dict[tuple[str, str], deque[_Row]] = {}
        self._errors: dict[tuple[str, str], deque[float]] = {}
        self._gauges: dict[str, deque[GaugeSample]] = {}
        self._last_scrape: dict[str, float] = {}
        # Requests that presented an API key, for the admission queue's fairness (bounded).
        self._tenants: deque[TenantRequest] = deque(maxlen=max_requests)

    def tenant_finished(self, t0: float, tenant: str, waited_s: float, tokens: int) -> None:
        """A keyed request ended: whose it was, its wait for a slot, its tokens."""
        self._tenants.append(TenantRequest(t0, tenant, waited_s, tokens))

    def tenant_requests(self, window_s: float | None = None) -> list[TenantRequest]:
        """The keyed requests of the last `window_s` seconds."""
        since = self.clock() - (self.window_s if window_s is None else window_s)
        return [r for r in list(self._tenants) if r.t0 >= since]

    # -- fed once per finished request ----------------------------------------------------
    def finished(
        self,
        model: str,
        backend: str,
        facts: Facts | None,
        error: str | None,
        decision: DecisionLike | None,
        t0: float,
    ) -> None:
        if not backend:
            return
        key = (backend, model)
        if error is not None or facts is None:
            errs = self._errors.get(key)
            if errs is None:
                errs = self._errors[key] = deque(maxlen=self.max_requests)
            errs.append(t0)
        else:
            here, best = predicted_tokens(decision, backend, facts.input_tokens)
            window = self._requests.get(key)
            if window is None:
                window = self._requests[key] = deque(maxlen=self.max_requests)
                self.gaps_per_stream = self._gaps_per_stream(len(self._requests))
            gaps = facts.itl_s
            end_at: float | None = None
            n_gaps: int | None = None
            if len(gaps) > self.gaps_per_stream:  # keep the first ones, and where it ended
                first = facts.first_output_at
                end_at = None if first is None else first + sum(gaps)
                n_gaps = len(gaps)
                gaps = gaps[: self.gaps_per_stream]
            window.append(
                (
                    t0,
                    facts.ttft_s,
                    facts.upstream_ttft_s,
                    facts.first_output_at,
                    _pack(gaps) if gaps else b"",
                    facts.input_tokens,
                    facts.cached_tokens,
                    facts.output_tokens,
                    here,
                    best,
                    facts.engine_prefill_s,
                    end_at,
                    n_gaps,
                )
            )
        if self.loads is not None:  # a new scrape is sampled by the next request to see it
            load = self.loads(backend)
            if load is not None and load.scraped_at:
                if self._last_scrape.get(backend) != load.scraped_at:
                    self._sample_load(backend, load)

    def _gaps_per_stream(self, windows: int) -> int:
        """Gaps kept per stream so that `windows` full windows stay within the gap budget
        (the windows already full keep theirs until their requests are replaced)."""
        fit = self.gap_budget_bytes // (8 * self.max_requests * max(1, windows))
        return max(MIN_GAPS_PER_STREAM, min(MAX_GAPS_PER_STREAM, fit))

    def _sample_load(self, backend: str, load: Load) -> None:
        self._last_scrape[backend] = load.scraped_at
        gauges = self._gauges.get(backend)
        if gauges is None:
            gauges = self._gauges[backend] = deque(maxlen=MAX_GAUGES)
        gauges.append(
            GaugeSample(
                at=self.clock(),
                waiting=load.waiting,
                running=load.running,
                kv_usage=load.kv_usage,
                kv_tokens=load.kv_tokens,
                counters=dict(self.counters(load)) if self.counters is not None else {},
            )
        )

    # -- the fleet changes ----------------------------------------------------------------
    def add(self, info: BackendInfo) -> None:
        """A backend joined: it gets a window (empty until it serves) like a configured one."""
        self.backends[info.name] = info

    def forget(self, backend: str) -> None:
        """`backend` left the fleet: its windows (every model's), its errors and its sampled
        gauges go, and the gap budget is shared among the windows left."""
        self.backends.pop(backend, None)
        for windows in (self._requests, self._errors):
            for key in [k for k in windows if k[0] == backend]:
                del windows[key]
        self._gauges.pop(backend, None)
        self._last_scrape.pop(backend, None)
        self.gaps_per_stream = self._gaps_per_stream(len(self._requests))

    # -- read when a report is asked for --------------------------------------------------
    def windows(self, window_s: float | None = None) -> list[Window]:
        """A Window per (backend, model) seen in the last `window_s` seconds, plus one (empty)
        per configured backend that served nothing in it."""
        span = self.window_s if window_s is None else window_s
        since = self.clock() - span
        cache = dict(self.cache()) if self.cache is not None else {}
        disagg = dict(self.disagg()) if self.disagg is not None else None
        out: list[Window] = []
        served: set[str] = set()
        keys = sorted(set(self._requests) | set(self._errors))
        for backend, model in keys:
            # list() copies in one C call: an exporter thread may read while the loop appends
            rows = list(self._requests.get((backend, model), ()))
            reqs = [_sample(r) for r in rows if r[0] >= since]
            errors = sum(1 for t in list(self._errors.get((backend, model), ())) if t >= since)
            if not reqs and not errors:
                continue
            served.add(backend)
            out.append(self._window(backend, model, reqs, errors, since, cache, disagg))
        for name in sorted(self.backends):
            if name not in served:
                out.append(self._window(name, "", [], 0, since, cache, disagg))
        return out

    def _window(
        self,
        backend: str,
        model: str,
        reqs: list[RequestSample],
        errors: int,
        since: float,
        cache: Mapping[str, Mapping[str, Any]],
        disagg: Mapping[str, Any] | None = None,
    ) -> Window:
        info = self.backends.get(backend, BackendInfo(backend))
        gauges = [g for g in list(self._gauges.get(backend, ())) if g.at >= since]
        engine = (self.engines(backend) if self.engines is not None else None) or info.engine
        return Window(
            backend=backend,
            model=model,
            engine=engine,
            requests=reqs,
            gauges=gauges,
            errors=errors,
            hardware=info.hardware,
            cache=cache.get(backend),
            policy=self.policy,
            disagg=disagg,
        )
