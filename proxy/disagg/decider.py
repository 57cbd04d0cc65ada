"""The disaggregation decider: turns the pool split on and off from measured traffic.

Pure and deterministic: `update(stats)` takes a WindowStats (time is `stats.now`) and returns
the decision; nothing here reads a clock, logs or sends. The caller evaluates every
`disagg.evaluate_s`, logs each switch with its reason, and serves `state()` at /admin/disagg.

In `auto`, the split turns **on** only when the window shows all four of
  1. capacity: at least `min_backends` healthy backends, and a split whose prefill pool carries
     the measured prefill demand and whose decode pool holds the decoding streams;
  2. steady, heavy traffic: `min_requests` finished, `min_rate_per_s`, arrivals per bucket
     with a coefficient of variation at most `max_rate_cv` (bursty traffic leaves one pool idle
     while the other queues);
  3. a mix to separate: between `min_long_share` and 1 - `min_long_share` of requests are
     prefill-heavy (all chat or all documents leaves nothing to separate);
  4. the interference it would remove: at least `min_overlap_share` of streams decoded beside
     a long prefill on their backend, and their ITL p99/p50 was at least `on_inflation` times
     the other streams'.
While on, (4) cannot be measured any more (the split removed it), so the split stays on while
(1)-(3) hold with thresholds loosened by `hysteresis`; it turns **off** when they no longer do.
No switch happens within `min_dwell_s` of the last one, except that a split whose pools lost
their capacity (a backend went down) turns off at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.config import DisaggConfig
from proxy.disagg.pools import Demand, PoolSplit, plan_pools, split_carries_demand
from proxy.disagg.window import WindowStats

MAX_SWITCHES_KEPT = 20


@dataclass(frozen=True, slots=True)
class Decision:
    active: bool
    split: PoolSplit | None  # the pools while active
    reason: str  # one plain sentence
    changed: bool = False  # this update switched (log it)


@dataclass
class _Check:
    ok: bool
    why: str  # the sentence fragment that explains a failure (or a pass)


@dataclass
class Decider:
    """The state machine behind `disagg.mode`; feed it WindowStats, read `state()`."""

    cfg: DisaggConfig
    active: bool = False
    split: PoolSplit | None = None
    candidate: PoolSplit | None = None  # the split the last window would make
    reason: str = "no traffic measured yet"
    switched_at: float | None = None
    inflation_at_switch: float | None = None
    last: WindowStats | None = None
    switches: list[dict[str, Any]] = field(default_factory=list)

    def update(self, stats: WindowStats) -> Decision:
        """Judge one window; returns the (possibly new) decision."""
        self.last = stats
        candidate = self.candidate = self._plan(stats)
        mode = self.cfg.mode
        if mode == "off":
            return self._set(False, None, "disaggregation is off (disagg.mode: off)", stats)
        if mode == "on":
            if candidate.feasible:
                return self._set(True, candidate, f"on by configuration: {candidate.reason}", stats)
            return self._set(False, None, f"on by configuration, but {candidate.reason}", stats)
        return self._auto(stats, candidate)

    # --- auto ---------------------------------------------------------------------------------
    def _auto(self, stats: WindowStats, candidate: PoolSplit) -> Decision:
        cfg = self.cfg
        capacity = self._capacity(stats, candidate)
        if self.active:
            if not capacity.ok:  # safety first: no dwell to wait out
                return self._set(False, None, f"switched off: {capacity.why}", stats)
            loose = 1.0 - cfg.hysteresis
            for check in (self._traffic(stats, loose), self._mix(stats, loose)):
                if not check.ok:
                    if self._dwelling(stats.now):
                        return self._keep(stats, candidate, f"on (dwell): {check.why}")
                    return self._set(False, None, f"switched off: {check.why}", stats)
            return self._keep(stats, candidate, self._on_sentence(stats, candidate))
        checks = (capacity, self._traffic(stats, 1.0), self._mix(stats, 1.0))
        for check in (*checks, self._interference(stats)):
            if not check.ok:
                return self._set(False, None, f"off: {check.why}", stats)
        if self._dwelling(stats.now):
            return self._set(False, None, "off (dwell): traffic justifies a split, but the "
                             "last switch was too recent", stats)  # fmt: skip
        return self._set(True, candidate, self._on_sentence(stats, candidate), stats)

    def _capacity(self, stats: WindowStats, split: PoolSplit) -> _Check:
        healthy = sum(b.healthy for b in stats.backends)
        if healthy < self.cfg.min_backends:
            return _Check(
                False,
                f"{healthy} healthy backend{'s' if healthy != 1 else ''} are too few to split "
                f"(disagg.min_backends is {self.cfg.min_backends})",
            )
        if not split_carries_demand(split):
            return _Check(False, split.reason)
        return _Check(True, split.reason)

    def _traffic(self, stats: WindowStats, loose: float) -> _Check:
        cfg = self.cfg
        need = max(1, int(cfg.min_requests * loose))
        if stats.requests < need:
            return _Check(False, f"only {stats.requests} requests in the window (need {need})")
        min_rate = cfg.min_rate_per_s * loose
        if stats.rate_per_s < min_rate:
            return _Check(
                False,
                f"traffic is light ({stats.rate_per_s:.2f} req/s, need {min_rate:.2f})",
            )
        max_cv = cfg.max_rate_cv / loose if loose > 0 else float("inf")
        if stats.rate_cv is None or stats.rate_cv > max_cv:
            cv = "unknown" if stats.rate_cv is None else f"{stats.rate_cv:.2f}"
            return _Check(False, f"traffic is bursty (arrival CV {cv}, limit {max_cv:.2f})")
        return _Check(True, f"steady {stats.rate_per_s:.1f} req/s (CV {stats.rate_cv:.2f})")

    def _mix(self, stats: WindowStats, loose: float) -> _Check:
        low = self.cfg.min_long_share * loose
        share = stats.long_share
        if share < low:
            return _Check(
                False,
                f"too few long prompts to separate ({share:.0%} of requests, need {low:.0%})",
            )
        if share > 1.0 - low:
            return _Check(
                False, f"almost every request is a long prompt ({share:.0%}): nothing to protect"
            )
        return _Check(True, f"{share:.0%} long prompts")

    def _interference(self, stats: WindowStats) -> _Check:
        cfg = self.cfg
        if stats.overlap_share < cfg.min_overlap_share:
            return _Check(
                False,
                f"few streams ran beside a long prefill ({stats.overlap_share:.0%}, "
                f"need {cfg.min_overlap_share:.0%})",
            )
        excess = stats.interference
        if excess is None or excess < cfg.on_inflation:
            got = "unknown" if excess is None else f"{excess:.1f}x"
            return _Check(
                False,
                f"streams beside long prefills were not slowed enough (p99/p50 ITL {got} the "
                f"others', need {cfg.on_inflation:.1f}x)",
            )
        return _Check(True, f"streams beside long prefills had {excess:.1f}x the ITL tail")

    # --- bookkeeping ------------------------------------------------------------------------
    def _plan(self, stats: WindowStats) -> PoolSplit:
        rate = self.cfg.prefill_tokens_per_s or stats.prefill_rate_per_engine
        return plan_pools(
            stats.backends,
            Demand(stats.prefill_tokens_per_s, rate, stats.mean_streams),
            max_streams_per_engine=self.cfg.max_streams_per_engine,
            target_utilization=self.cfg.target_utilization,
            previous=self.split,
        )

    def _dwelling(self, now: float) -> bool:
        return self.switched_at is not None and now - self.switched_at < self.cfg.min_dwell_s

    def _on_sentence(self, stats: WindowStats, split: PoolSplit) -> str:
        over = stats.itl_inflation
        base = stats.itl_inflation_baseline
        tail = (
            f", and streams beside long prefills had p99 ITL {over:.1f}x their p50 "
            f"(others {base or 1.0:.1f}x)"
            if over is not None and not self.active
            else ""
        )
        return (
            f"on: {sum(b.healthy for b in stats.backends)} healthy backends, steady "
            f"{stats.rate_per_s:.1f} req/s with {stats.long_share:.0%} long prompts{tail}; "
            f"{split.reason}"
        )

    def _keep(self, stats: WindowStats, split: PoolSplit, reason: str) -> Decision:
        return self._set(True, split, reason, stats)

    def _set(
        self, active: bool, split: PoolSplit | None, reason: str, stats: WindowStats
    ) -> Decision:
        changed = active != self.active
        if changed:
            self.switched_at = stats.now
            self.inflation_at_switch = stats.interference if active else None
            self.switches.append(
                {
                    "at": stats.now,
                    "active": active,
                    "reason": reason,
                    "pools": split.as_dict() if split is not None else None,
                    "inputs": stats.inputs(),
                }
            )
            del self.switches[:-MAX_SWITCHES_KEPT]
        self.active = active
        self.split = split
        self.reason = reason
        return Decision(active, split, reason, changed)

    def state(self) -> dict[str, Any]:
        """What GET /admin/disagg returns."""
        return {
            "mode": self.cfg.mode,
            "active": self.active,
            "reason": self.reason,
            "pools": self.split.as_dict() if self.split else None,
            "candidate_pools": self.candidate.as_dict() if self.candidate else None,
            "inputs": self.last.inputs() if self.last else None,
            "switched_at": self.switched_at,
            "interference_at_switch": self.inflation_at_switch,
            "switches": list(self.switches),
            "thresholds": {
                "min_backends": self.cfg.min_backends,
                "min_requests": self.cfg.min_requests,
                "min_rate_per_s": self.cfg.min_rate_per_s,
                "max_rate_cv": self.cfg.max_rate_cv,
                "min_long_share": self.cfg.min_long_share,
                "min_overlap_share": self.cfg.min_overlap_share,
                "on_inflation": self.cfg.on_inflation,
                "hysteresis": self.cfg.hysteresis,
                "min_dwell_s": self.cfg.min_dwell_s,
            },
        }
