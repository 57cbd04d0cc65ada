"""One object the proxy (or the virtual fleet) holds for disaggregation: window, decider, plans.

Still pure: every method takes the time and the facts; nothing here sends, sleeps or logs.
The forwarder's part, per request:

    plan = ctl.plan(body, prompt_tokens, uncached_tokens, backends)   # after routing
    ctl.started(request_id, backend, now, uncached_tokens)  # each attempt; 0 for a decode leg
    ctl.prefill_started(key, backend, now, uncached_tokens)  # a KV-transfer flow's prefill leg
    ctl.prefill_ended(key, now)
    ctl.first_token(request_id, now)
    ctl.finished(RequestFacts(...))                                  # done, measured
    decision = ctl.evaluate(now, backends)   # at most every disagg.evaluate_s; log if changed

`plan.candidates` narrows the router's candidates (empty: every backend, today's behaviour);
`plan.legs == "two"` asks for a prefill leg on `plan.prefill_candidates` first
(docs/disaggregation.md has both flows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from proxy.config import DisaggConfig
from proxy.disagg.decider import Decider, Decision
from proxy.disagg.legs import KV_TRANSFER_APIS
from proxy.disagg.pools import (
    BackendState,
    OutputHistory,
    PoolSplit,
    RequestPlan,
    classify,
    plan_request,
    requested_output,
)
from proxy.disagg.window import RequestFacts, Window

OFF_REASON = "disagg.mode is off: every request goes whole to the backend routing picks"


class DisaggController:
    """The decider, its window and per-request planning for one proxy replica."""

    def __init__(self, cfg: DisaggConfig) -> None:
        self.cfg = cfg
        self.window = Window(cfg.window_s, cfg.threshold_tokens, cfg.rate_buckets)
        self.decider = Decider(cfg)
        self.history = OutputHistory()
        self._next_eval: float | None = None

    @property
    def split(self) -> PoolSplit | None:
        """The pools while the split is active, else None."""
        return self.decider.split if self.decider.active else None

    def plan(
        self,
        body: Mapping[str, Any],
        prompt_tokens: int,
        uncached_tokens: int,
        backends: Sequence[BackendState],
        api: str = "chat",
    ) -> RequestPlan:
        """Where this request (to `api`, proxy.forwarding.exchange.API_PATHS) goes now. With the
        split inactive (always, in mode off) it is one leg on every candidate: exactly what routing
        does without disaggregation. An embedding outputs nothing: it is its prompt."""
        cfg = self.cfg
        if api == "embeddings":
            expected: float | None = 0.0
        else:
            expected = self.history.expected(prompt_tokens, requested_output(body))
        cls = classify(uncached_tokens, expected, cfg.threshold_tokens, cfg.output_ratio)
        return plan_request(
            self.split,
            backends,
            cls,
            long_prompt=uncached_tokens >= cfg.threshold_tokens,
            kv_transfer=api in KV_TRANSFER_APIS,
        )

    def started(self, request_id: str, backend: str, now: float, uncached_tokens: int) -> None:
        self.window.started(request_id, backend, now, uncached_tokens)

    def prefill_started(self, key: str, backend: str, now: float, uncached_tokens: int) -> None:
        self.window.prefill_started(key, backend, now, uncached_tokens)

    def prefill_ended(self, key: str, now: float) -> None:
        self.window.prefill_ended(key, now)

    def first_token(self, request_id: str, now: float) -> None:
        self.window.first_token(request_id, now)

    def finished(self, facts: RequestFacts, generates: bool = True) -> None:
        """`generates`: False for an embedding, whose zero output would teach the output
        history nothing about the generations of its prompt size."""
        self.window.finished(facts)
        if facts.ok and generates:
            self.history.observe(facts.prompt_tokens, facts.output_tokens)

    def evaluate(
        self, now: float, backends: Sequence[BackendState], *, force: bool = False
    ) -> Decision | None:
        """Run the decider if `evaluate_s` passed since the last time (or `force`); the
        decision, whose `changed` says whether to log a switch. None: not due yet."""
        if not force and self._next_eval is not None and now < self._next_eval:
            return None
        self._next_eval = now + self.cfg.evaluate_s
        return self.decider.update(self.window.snapshot(now, backends))

    def state(self) -> dict[str, Any]:
        """GET /admin/disagg."""
        out = self.decider.state()
        out["in_flight_tracked"] = self.window.in_flight
        return out


def state_when_off(cfg: DisaggConfig, now: float) -> dict[str, Any]:
    """GET /admin/disagg with disagg.mode off: the keys it has in on and auto, with nothing
    measured (no window is kept when off), so that tools read one schema in every mode."""
    out = DisaggController(cfg).state()
    out.update(reason=OFF_REASON, requests={}, now=now)
    return out
