"""Scorer ``predicted_ttft``: the backend expected to produce the first token soonest.

Predicted TTFT = queue wait + uncached prompt tokens / that backend's prefill rate, where the
rate is learned from our own TTFT measurements (proxy.routing.learn) and the queue wait is the
larger of the prefill backlog this proxy sent there (proxy.routing.backlog, fresh at every
decision) and the engine's waiting requests * its typical prefill time (as of the last scrape;
it covers what other proxy replicas sent). This folds cache affinity and load into
one physical number, so a cached prefix on a busy backend and a cold prompt on an idle one
are compared in seconds. Score = (best + tau) / (this + tau): 1 for the best, tau keeps
millisecond differences between near-idle backends from looking large.

Cached means on the GPU (`ctx.matched_blocks`), plus, on engines whose KV events say they
offloaded part of the prompt to a slower tier (`ctx.tier_blocks`), a share of those blocks:
the engine loads them instead of recomputing them, which saves most of their prefill from
host memory and less from disk or a remote pool. The shares are assumptions, worked out in
docs/kv-events.md ("Tiers") from docs/physics.md's numbers: an 8B model's KV is 128 KiB a
token, a PCIe link moves ~25 GB/s (5 us a token) and an SSD ~5 GB/s (26 us), against ~34 us a
token of prefill on an H100 (the fastest preset, where a transfer saves least). They are not
learned: a TTFT does not say which tier served the blocks it skipped.
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
        cpu_saves: float = 0.8,
        disk_saves: float = 0.25,
        remote_saves: float = 0.25,
    ) -> None:
        self.default_tokens_per_s = default_tokens_per_s
        self.default_queue_item_s = default_queue_item_s
        self.chars_per_token = chars_per_token
        self.tau_s = tau_s
        # The share of a block's prefill a hit in each slower tier saves (the GPU saves it all).
        self.saves = {"CPU": cpu_saves, "DISK": disk_saves, "REMOTE": remote_saves}

    class Settings(PluginSettings):
        # a backend's prefill rate until its own TTFTs are measured
        default_tokens_per_s: float = Field(DEFAULT_PREFILL_TOKENS_PER_S, gt=0)
        default_queue_item_s: float = Field(0.1, ge=0)  # a waiting request's prefill, unmeasured
        chars_per_token: float = Field(4.0, gt=0)
        tau_s: float = Field(0.02, gt=0)
        # share of a block's prefill saved when the engine loads it from host memory, from
        # disk, from a remote pool (SGLang's EXTERNAL, LMCache's remote backends)
        cpu_saves: float = Field(0.8, ge=0, le=1)
        disk_saves: float = Field(0.25, ge=0, le=1)
        remote_saves: float = Field(0.25, ge=0, le=1)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> PredictedTtftScorer:
        return cls(**cls.Settings.of(cfg).model_dump())

    def cached_blocks(self, ctx: RouteContext, backend: str) -> float:
        """Blocks of the prompt `backend` holds, counted as GPU blocks: those on the GPU, and
        each block past them that only a slower tier holds, by the share of prefill it saves."""
        gpu = ctx.matched_blocks.get(backend, 0)
        tiers = ctx.tier_blocks.get(backend)
        if not tiers:
            return float(gpu)
        total, reached = float(gpu), gpu
        for tier, saves in self.saves.items():  # fastest first
            reach = tiers.get(tier, reached)
            if reach > reached:
                total += (reach - reached) * saves
                reached = reach
        return total

    def predict(self, ctx: RouteContext, b: BackendView, fallback_rate: float) -> float:
        prompt_tokens = ctx.prompt_chars / self.chars_per_token
        cached = self.cached_blocks(ctx, b.name) * ctx.block_chars / self.chars_per_token
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
