"""The proxy's metric instruments: what one finished request records, and what readers collect.

All recording happens once per request (`RequestMetrics.record`), from the facts the stream
meter aggregated, so the per-chunk hot path pays nothing for metrics. Per-request one-value
samples wait in a batch and are folded into the histograms every few hundred requests and
before every collection.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics.export import Metric

from proxy.routing.types import Decision
from proxy.telemetry.histograms import (
    DURATION_BUCKETS,
    OVERHEAD_BUCKETS,
    RATIO_BUCKETS,
    TOKEN_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    Counts,
    Histogram,
    Point,
    TraceRef,
)
from proxy.telemetry.labels import ErrorLabels
from proxy.telemetry.series import (
    FORWARD,
    NO_FACTS,
    TPOC,
    Row,
    Series,
    fold_rows,
)
from proxy.types import StreamFacts

# Folded this often, and before every collection (scrape, export): a batch is added per point
# with one sort, where one add per value cost ~27k instructions a request.
_FOLD_EVERY = 256

# (metric, CacheEstimate.as_dict() field, unit, description): read at collection time.
CACHE_GAUGES = (
    (
        "warmroute.prefix.capacity",
        "capacity_blocks",
        "{block}",
        "Prefix-index blocks kept per backend: its cache as learned from reported cached_tokens.",
    ),
    (
        "warmroute.prefix.predicted_hit_ratio",
        "predicted_hit_ratio",
        "1",
        "Share of prompts the index predicted cached on each backend (moving average).",
    ),
    (
        "warmroute.prefix.reported_hit_ratio",
        "actual_hit_ratio",
        "1",
        "Share of prompts each backend's engine reported cached (moving average).",
    ),
    (
        "warmroute.prefix.agreement",
        "agreement",
        "1",
        "Share of responses where prediction and report agreed (moving average).",
    ),
)

_DIGITS = re.compile(r"\d+")

# The fleet's changes (warmroute.fleet.change) and a backend's membership states, as the
# reconciler names them; the counter's source label keeps at most FLEET_SOURCES values.
FLEET_CHANGES = frozenset({"join", "leave", "drain", "restart", "update"})
FLEET_STATES = ("joining", "serving", "draining", "drained")
FLEET_SOURCES = 64


class RequestMetrics:
    """The histograms and counts, the series cache, and the batch waiting to be folded."""

    def __init__(self) -> None:
        self.start_ns = time.time_ns()
        self.lock = threading.Lock()  # readers collect from their own threads
        self._make_histograms()
        self.c_decisions = Counts(("warmroute.route.policy", "warmroute.route.reason"))
        self.c_errors = Counts(("warmroute.backend", "error.type"))
        self.error_label = ErrorLabels()  # error.type on metrics: bounded (telemetry/labels.py)
        self.c_retries = Counts(("warmroute.backend",))
        self.c_fleet = Counts(("warmroute.fleet.change", "warmroute.fleet.source"))
        self._fleet_sources: set[str] = set()
        self._read_nothing_yet()
        # the model's metric label: the name when a backend lists it (see bound_model_labels)
        self.model_label: Callable[[str], str] = str
        self._routes: dict[tuple[str, str], tuple[tuple[str, str], Point]] = {}
        self._series: dict[tuple[Any, ...], Series] = {}
        self._pending: list[Row] = []  # requests' one-value samples, until fold()

    def _read_nothing_yet(self) -> None:
        """What the observable instruments read when collected, until the app registers its
        sources (Telemetry.read_*): empty."""
        # backends per membership state (the reconciler's), or None before one is registered
        self.fleet: Callable[[], Mapping[str, int]] | None = None
        # this proxy's open requests per backend: the routing board's count, read when collected
        self.inflight: Callable[[], Mapping[str, int]] = dict
        # per backend: the learned prefix cache and how well the index predicts it
        self.cache: Callable[[], Mapping[str, Mapping[str, Any]]] = dict
        # the prefix index: blocks it holds per backend, and the bytes its tables take
        self.index_blocks: Callable[[], Mapping[str, int]] = dict
        self.index_memory: Callable[[], int] | None = None
        # the doctor's current findings: (finding id, backend, severity)
        self.findings: Callable[[], Iterable[tuple[str, str, str]]] = tuple
        # passive health: backend -> 1 while ejected (outlier detection), and the failures the
        # retry budget answered at once
        self.ejected: Callable[[], Mapping[str, int]] = dict
        self.budget_exhausted: Callable[[], int] = int
        # prefill/decode disaggregation: (active, the decider's numeric inputs), or None (off)
        self.disagg: Callable[[], tuple[bool, Mapping[str, float]] | None] = lambda: None

    def _make_histograms(self) -> None:
        """The request histograms (their points per series: proxy/telemetry/series.py)."""
        self._semconv_histograms()
        self._own_histograms()
        self.histograms = (
            self.h_ttft,
            self.h_tpot,
            self.h_duration,
            self.h_tokens,
            self.h_ttfc,
            self.h_tpoc,
            self.h_overhead,
            self.h_forward,
            self.h_decision,
            self.h_cached,
            self.h_hit,
        )

    def _semconv_histograms(self) -> None:
        """The OpenTelemetry GenAI semantic conventions' request histograms."""
        h = Histogram
        self.h_ttft = h(
            "gen_ai.server.time_to_first_token",
            "s",
            "Time to the first output token written to the client, successful responses.",
            TTFT_BUCKETS,
        )
        self.h_tpot = h(
            "gen_ai.server.time_per_output_token",
            "s",
            "Time per output token after the first, successful responses.",
            TPOT_BUCKETS,
        )
        self.h_duration = h(
            "gen_ai.server.request.duration",
            "s",
            "Request duration to the last output token (or the response) as the client saw it.",
            DURATION_BUCKETS,
        )
        self.h_tokens = h(
            "gen_ai.client.token.usage",
            "{token}",
            "Input and output tokens, as reported by the backend's usage.",
            TOKEN_BUCKETS,
        )
        self.h_ttfc = h(
            "gen_ai.client.operation.time_to_first_chunk",
            "s",
            "Time to the first output chunk written to the client (streaming, any outcome).",
            DURATION_BUCKETS,
        )
        self.h_tpoc = h(
            "gen_ai.client.operation.time_per_output_chunk",
            "s",
            "Gap between consecutive output chunks written to the client (streaming).",
            DURATION_BUCKETS,
        )

    def _own_histograms(self) -> None:
        """warmroute's own: what the proxy added, routing, the prefix cache."""
        h = Histogram
        self.h_overhead = h(
            "warmroute.proxy.overhead",
            "s",
            "Client TTFT minus upstream TTFT: time the proxy added before the first token.",
            OVERHEAD_BUCKETS,
        )
        self.h_forward = h(
            "warmroute.proxy.chunk_forward.duration",
            "s",
            "Time from receiving output bytes from the backend to writing them to the client.",
            OVERHEAD_BUCKETS,
        )
        self.h_decision = h(
            "warmroute.route.decision.duration",
            "s",
            "Time to make one routing decision.",
            OVERHEAD_BUCKETS,
        )
        self.h_cached = h(
            "warmroute.prefix.cached_tokens",
            "{token}",
            "Prompt tokens the backend reported as served from its prefix cache.",
            TOKEN_BUCKETS,
        )
        self.h_hit = h(
            "warmroute.prefix.hit_ratio",
            "1",
            "Prefix cache hit ratio: predicted by the router's index, or actual from usage.",
            RATIO_BUCKETS,
        )

    def observe_with(self, meter: Meter) -> None:
        """Create the observable instruments that read the counts and sources when collected."""
        meter.create_observable_counter(
            "warmroute.route.decisions",
            [self.c_decisions.observe],
            unit="{decision}",
            description="Routing decisions by policy and reason.",
        )
        meter.create_observable_counter(
            "warmroute.upstream.errors",
            [self.c_errors.observe],
            unit="{error}",
            description="Failed upstream attempts by backend and error.type.",
        )
        meter.create_observable_counter(
            "warmroute.upstream.retries",
            [self.c_retries.observe],
            unit="{retry}",
            description="Attempts beyond the first, by the backend retried onto.",
        )
        meter.create_observable_up_down_counter(
            "warmroute.backend.inflight",
            [self._observe_inflight],
            unit="{request}",
            description="Requests this proxy has open on each backend.",
        )
        self._observe_prefix_with(meter)
        meter.create_observable_gauge(
            "warmroute.backend.ejected",
            [self._observe_ejected],
            unit="1",
            description="1 while the backend is ejected by outlier detection (its circuit is "
            "open), else 0.",
        )
        meter.create_observable_counter(
            "warmroute.upstream.retry_budget_exhausted",
            [self._observe_budget],
            unit="{failure}",
            description="Failures answered at once because the retry budget was spent.",
        )
        meter.create_observable_gauge(
            "warmroute.disagg.active",
            [self._observe_disagg_active],
            unit="1",
            description="1 while prefill/decode disaggregation is active, else 0 (also with "
            "disagg.mode off; docs/disaggregation.md).",
        )
        meter.create_observable_gauge(
            "warmroute.disagg.input",
            [self._observe_disagg_inputs],
            description="The disaggregation decider's window inputs, by warmroute.disagg.input.",
        )
        meter.create_observable_counter(
            "warmroute.fleet.changes",
            [self.c_fleet.observe],
            unit="{change}",
            description="Changes to the backend fleet, by warmroute.fleet.change (join, leave, "
            "drain, restart, update) and warmroute.fleet.source (config, admin, dns:NAME, ...).",
        )
        meter.create_observable_gauge(
            "warmroute.fleet.backends",
            [self._observe_fleet],
            unit="{backend}",
            description="Backends by membership state (warmroute.fleet.state: joining, "
            "serving, draining, drained).",
        )
        meter.create_observable_gauge(
            "warmroute.doctor.findings",
            [self._observe_findings],
            unit="{finding}",
            description="The doctor's current findings: 1 per finding id and backend "
            "(docs/doctor.md).",
        )

    def _observe_prefix_with(self, meter: Meter) -> None:
        """The prefix cache's gauges: the capacity learner's per backend, and the index's."""
        for name, field_, unit, text in CACHE_GAUGES:
            meter.create_observable_gauge(
                name, [self._cache_gauge(field_)], unit=unit, description=text
            )
        meter.create_observable_gauge(
            "warmroute.prefix.blocks",
            [self._observe_index_blocks],
            unit="{block}",
            description="Blocks the prefix index holds for each backend: what it believes the "
            "engine's cache holds (warmroute.prefix.capacity bounds it).",
        )
        meter.create_observable_gauge(
            "warmroute.prefix.index.memory",
            [self._observe_index_memory],
            unit="By",
            description="Bytes the prefix index's tables take in this process (with Redis, "
            "the replica's copy); about 55 per (block, backend) entry.",
        )

    def _cache_gauge(self, field_: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            for backend, est in dict(self.cache()).items():
                value = est.get(field_)
                if value is not None:
                    yield Observation(value, {"warmroute.backend": backend})

        return observe

    def _observe_findings(self, _options: CallbackOptions) -> Iterable[Observation]:
        for finding, backend, severity in list(self.findings()):
            attrs = {
                "warmroute.doctor.finding": finding,
                "warmroute.backend": backend,
                "warmroute.doctor.severity": severity,
            }
            yield Observation(1, attrs)

    def _observe_ejected(self, _options: CallbackOptions) -> Iterable[Observation]:
        for backend, n in dict(self.ejected()).items():
            yield Observation(n, {"warmroute.backend": backend})

    def _observe_budget(self, _options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self.budget_exhausted())

    def _observe_disagg_active(self, _options: CallbackOptions) -> Iterable[Observation]:
        # 0 with disagg.mode off too: an alert or a dashboard reads one series in every mode.
        state = self.disagg()
        yield Observation(1 if state is not None and state[0] else 0)

    def _observe_disagg_inputs(self, _options: CallbackOptions) -> Iterable[Observation]:
        state = self.disagg()
        if state is not None:
            for name, value in dict(state[1]).items():
                yield Observation(value, {"warmroute.disagg.input": name})

    def _observe_fleet(self, _options: CallbackOptions) -> Iterable[Observation]:
        if self.fleet is None:
            return
        counts = dict(self.fleet())
        # Every state, 0 included: a dashboard's "draining" line drops to 0, not out of sight.
        for state in (*FLEET_STATES, *sorted(set(counts) - set(FLEET_STATES))):
            yield Observation(counts.get(state, 0), {"warmroute.fleet.state": state})

    def fleet_change(self, change: str, source: str) -> None:
        """Count one change to the fleet. Sources come from configuration and discovery (a
        DNS name, a Service): the first FLEET_SOURCES distinct ones are labels, the rest
        "other", so that the series stay few whatever is configured."""
        if change not in FLEET_CHANGES:
            change = "other"
        sources = self._fleet_sources
        if source not in sources:
            if len(sources) >= FLEET_SOURCES:
                source = "other"
            else:
                sources.add(source)
        with self.lock:
            self.c_fleet.add((change, source))

    def forget_backend(self, name: str, addresses: Iterable[tuple[str, int]] = ()) -> int:
        """Drop every series of backend `name`: the points labelled warmroute.backend=name and
        the server.address/server.port series of its address (from its series, and
        `addresses`), so that a fleet that churns does not grow /metrics by a dead series
        per departed engine. Returns how many points went. A request still finishing there
        starts its series again."""
        with self.lock:
            self.fold()  # a pending row would bring a dropped point's counts back
            gone = {k for k, series in self._series.items() if k[4] == name}
            servers = {(k[2], k[3]) for k in gone} | set(addresses)
            for key in gone:
                del self._series[key]
            # An address another backend's series still uses keeps its series (two backends
            # behind one host and port, told apart by path or name).
            servers -= {(k[2], k[3]) for k in self._series}
            dropped = 0
            for h in self.histograms:
                for key, point in list(h.points.items()):
                    a = point.attributes
                    server = (a.get("server.address"), a.get("server.port"))
                    if a.get("warmroute.backend") == name or server in servers:
                        del h.points[key]
                        dropped += 1
            for counts in (self.c_errors, self.c_retries):
                for key in [k for k in counts.values if k[0] == name]:
                    del counts.values[key]
                    dropped += 1
            return dropped

    def _observe_index_blocks(self, _options: CallbackOptions) -> Iterable[Observation]:
        for backend, n in self.index_blocks().items():
            yield Observation(n, {"warmroute.backend": backend})

    def _observe_index_memory(self, _options: CallbackOptions) -> Iterable[Observation]:
        if self.index_memory is not None:
            yield Observation(self.index_memory())

    def _observe_inflight(self, _options: CallbackOptions) -> Iterable[Observation]:
        # dict() copies in one C call: the event loop thread may be changing the counts
        for backend, n in dict(self.inflight()).items():
            yield Observation(n, {"warmroute.backend": backend})

    def collect(self) -> list[Metric]:
        """The histograms as SDK metrics, with every pending sample folded in."""
        now = time.time_ns()
        with self.lock:
            self.fold()
            return [m for h in self.histograms if (m := h.metric(self.start_ns, now))]

    def fold(self) -> None:
        """Fold the pending per-request samples into the histograms (the lock is held)."""
        rows = self._pending
        if rows:
            self._pending = []
            fold_rows(rows)

    def routing(self, policy: str, reason: str, decision_s: float) -> None:
        """Count one routing decision and time it."""
        seen = self._routes.get((policy, reason))
        with self.lock:
            if seen is None:
                # Reasons may embed counts ("rotated among 3 ties"); keep the label set small.
                label = _DIGITS.sub("N", reason)[:80]
                point = self.h_decision.point({"warmroute.route.policy": policy}, (policy,))
                seen = ((policy, label), point)
                if len(self._routes) >= 1024:
                    self._routes.clear()
                self._routes[(policy, reason)] = seen
            self.c_decisions.add(seen[0])
            seen[1].add(decision_s, None)

    def failed_attempt(self, backend: str, error_type: str) -> None:
        with self.lock:
            self.c_errors.add((backend, self.error_label(error_type)))

    def retried(self, backend: str) -> None:
        with self.lock:
            self.c_retries.add((backend,))

    def record(
        self,
        op: str,
        model: str,
        f: StreamFacts | None,
        err: str | None,
        backend: str,
        address: str,
        port: int,
        duration: float,
        itl: list[float] | None,
        decision: Decision | None,
        exemplar: TraceRef | None,
    ) -> None:
        """Record one finished request (`itl`: its inter-chunk gaps, sorted)."""
        key = (op, model, address, port, backend)
        series = self._series.get(key)
        if series is None:
            # A model no backend lists is client input: one series for all of them ("other")
            label = self.model_label(model)
            if label != model:
                key = (op, label, address, port, backend)
                series = self._series.get(key)
        if series is None:
            with self.lock:
                series = Series(self, op, label, address, port, backend)
            if len(self._series) < 10_000:  # models and backends are few; bound it anyway
                self._series[key] = series
        ok = err is None
        if f is None:
            row: Row = (series, exemplar, duration if ok else None, *NO_FACTS)
        else:
            ttft, up, fin, cached = f.ttft_s, f.upstream_ttft_s, f.input_tokens, f.cached_tokens
            hit = cached / fin if cached is not None and fin else None
            if hit is not None and not hit < 1.0:  # min(1.0, hit): min() parses its arguments
                hit = 1.0
            predicted = None
            if decision is not None and backend and decision.prompt_chars:
                # predicted for the backend that served it (a retry may have moved it)
                matched = decision.matched_blocks.get(backend, 0)
                predicted = matched * decision.block_chars / decision.prompt_chars
                predicted = predicted if predicted < 1.0 else 1.0  # min() parses its arguments
            # In RowFields' order: a plain tuple (a NamedTuple built by keyword cost ~1 µs a
            # request); tests/test_telemetry_rows.py checks each sample reaches its histogram.
            row = (
                series,  # series
                exemplar,  # exemplar
                duration if ok else None,  # duration
                ttft,  # ttfc
                ttft - up if ttft is not None and up is not None else None,  # overhead
                ttft if ok else None,  # ttft
                f.tpot_s if ok else None,  # tpot
                fin,  # tokens_in
                f.output_tokens,  # tokens_out
                cached,  # cached
                hit,  # hit_actual
                predicted,  # hit_predicted
            )
        point = series.point
        with self.lock:
            if not ok:
                label = self.error_label(err)  # type: ignore[arg-type]
                series.duration_with_error(label).add(duration, exemplar)
            if f is not None:
                # a request's per-chunk samples go in at once (sorted, cut at the bounds)
                if itl and f.ttft_s is not None:
                    point(TPOC).add_sorted(itl, sum(itl), exemplar)
                if f.forward_s:
                    point(FORWARD).add_sorted(sorted(f.forward_s), sum(f.forward_s), exemplar)
            pending = self._pending
            pending.append(row)
            if len(pending) >= _FOLD_EVERY:
                self.fold()
