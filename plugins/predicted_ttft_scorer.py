"""Scorer ``predicted_ttft``: the backend expected to produce the first token soonest.

Predicted TTFT = queue wait + uncached prompt tokens / that backend's prefill rate, where the
rate is learned from our own TTFT measurements (proxy.routing.learn) and the queue wait is the
larger of the prefill backlog this proxy sent there (proxy.routing.backlog, fresh at every
decision) and the engine's waiting requests * its typical prefill time (as of the last scrape;
it covers what other proxy replicas sent). This folds cache affinity and load into
one physical number, so a cached prefix on a busy backend and a cold prompt on an idle one
are compared in seconds. Score = (best + tau) / (this + tau): 1 for the best, tau keeps
millisecond differences between near-idle backends from looking large.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from proxy.routing.learn import DEFAULT_PREFILL_TOKENS_PER_S
from proxy.routing.types import BackendView, PluginSettings, RouteContext


class PredictedTtftScorer:
    name = "predicted_ttft"
    kind = "scorer"

    def __init__(
        self,
        default_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
        default_queue_item_s: float = 0.1,
        chars_per_token: float = 4.0,
        tau_s: float = 0.02,
    ) -> None:
        self.default_tokens_per_s = default_tokens_per_s
        self.default_queue_item_s = default_queue_item_s
        self.chars_per_token = chars_per_token
        self.tau_s = tau_s

    class Settings(PluginSettings):
        # a backend's prefill rate until its own TTFTs are measured
        default_tokens_per_s: float = Field(DEFAULT_PREFILL_TOKENS_PER_S, gt=0)
        default_queue_item_s: float = Field(0.1, ge=0)  # a waiting request's prefill, unmeasured
        chars_per_token: float = Field(4.0, gt=0)
        tau_s: float = Field(0.02, gt=0)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> PredictedTtftScorer:
        return cls(**cls.Settings.of(cfg).model_dump())

    def predict(self, ctx: RouteContext, b: BackendView, fallback_rate: float) -> float:
        prompt_tokens = ctx.prompt_chars / self.chars_per_token
        cached = ctx.matched_blocks.get(b.name, 0) * ctx.block_chars / self.chars_per_token
        uncached = max(prompt_tokens - cached, 0.0)
        rate = b.prefill_tokens_per_s or fallback_rate
        per_item = b.mean_prefill_s if b.mean_prefill_s is not None else self.default_queue_item_s
        queue_s = max(
            max(b.load.waiting or 0.0, 0.0) * per_item, b.backlog_tokens / max(rate, 1e-9)
        )
        return queue_s + uncached / max(rate, 1e-9)

    def score(self, ctx: RouteContext, candidates: list[BackendView]) -> dict[str, float]:
        # A backend without samples yet is assumed as fast as the average learned one.
        known = [b.prefill_tokens_per_s for b in candidates if b.prefill_tokens_per_s]
        fallback = sum(known) / len(known) if known else self.default_tokens_per_s
        predicted = {b.name: self.predict(ctx, b, fallback) for b in candidates}
        best = min(predicted.values(), default=0.0)
        return {n: (best + self.tau_s) / (p + self.tau_s) for n, p in predicted.items()}


PLUGINS = [PredictedTtftScorer]
