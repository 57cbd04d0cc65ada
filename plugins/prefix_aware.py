"""Policy ``prefix_aware`` (the default): send a prompt where its prefix is cached, within load.

Filters: model, health, role. Scorers (weights from this policy's `weights` block): prefix match
3, predicted TTFT 2, queue 1, KV usage 1, in-flight 1. Picker: bounded_load. Each part takes its
thresholds from its own config block (routing.plugins.<name>), e.g.

    routing:
      policy: prefix_aware
      plugins:
        prefix_aware: {weights: {prefix: 3, predicted_ttft: 2, queue: 1, kv_usage: 1, inflight: 1}}
        prefix: {block_chars: 64, half_tokens: 256}
        bounded_load: {epsilon: 1.0, slack: 8, choices: 2, affinity_blocks: 8}
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from plugins.bounded_load_picker import BoundedLoadPicker
from plugins.health_filter import HealthFilter
from plugins.inflight_scorer import InflightScorer
from plugins.kv_usage_scorer import KvUsageScorer
from plugins.model_filter import ModelFilter
from plugins.predicted_ttft_scorer import PredictedTtftScorer
from plugins.prefix_scorer import PrefixScorer
from plugins.queue_scorer import QueueScorer
from plugins.role_filter import RoleFilter
from proxy.routing.types import PluginSettings, Policy

DEFAULT_WEIGHTS = {
    "prefix": 3.0,
    "predicted_ttft": 2.0,
    "queue": 1.0,
    "kv_usage": 1.0,
    "inflight": 1.0,
}
SCORERS: dict[str, Any] = {
    c.name: c
    for c in (PrefixScorer, PredictedTtftScorer, QueueScorer, KvUsageScorer, InflightScorer)
}


class PrefixAwarePolicy:
    name = "prefix_aware"
    kind = "policy"

    class Settings(PluginSettings):
        # Each scorer's weight (0 leaves it out); unset ones keep DEFAULT_WEIGHTS.
        weights: dict[str, float] = Field(default_factory=dict)

        @field_validator("weights")
        @classmethod
        def _known_scorers(cls, weights: dict[str, float]) -> dict[str, float]:
            unknown = set(weights) - set(SCORERS)
            if unknown:
                raise ValueError(f"unknown scorer(s) {sorted(unknown)}; known: {sorted(SCORERS)}")
            return weights

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Policy:
        blocks: dict[str, Any] = cfg.get("plugins", {})
        weights = {**DEFAULT_WEIGHTS, **cls.Settings.of(cfg).weights}
        scorers = [
            (SCORERS[n].from_config(blocks.get(n, {})), w) for n, w in weights.items() if w > 0
        ]
        picker = BoundedLoadPicker.from_config(blocks.get(BoundedLoadPicker.name, {}))
        return Policy(
            name=cls.name,
            filters=[ModelFilter(), HealthFilter(), RoleFilter()],
            scorers=scorers,
            picker=picker,
            uses_prefix=True,
            hints=picker.hints,
        )


PLUGINS = [PrefixAwarePolicy]
