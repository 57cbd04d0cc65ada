"""Scorer ``queue``: a shorter engine waiting queue scores higher.

Requests waiting in the engine have not started prefill, so every one of them adds a whole
prefill to our TTFT. Absolute, not relative to the other backends: two and three waiting are
both bad, and zero versus one matters most. Unknown (not scraped yet) scores as empty.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from proxy.routing.types import BackendView, PluginSettings, RouteContext


class QueueScorer:
    name = "queue"
    kind = "scorer"

    def __init__(self, half_queue: float = 2.0) -> None:
        self.half_queue = half_queue  # waiting requests at which the score is 0.5

    class Settings(PluginSettings):
        half_queue: float = Field(2.0, gt=0)  # waiting requests that score 0.5

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> QueueScorer:
        return cls(half_queue=cls.Settings.of(cfg).half_queue)

    def score(self, ctx: RouteContext, candidates: list[BackendView]) -> dict[str, float]:
        return {
            b.name: 1.0 / (1.0 + max(b.load.waiting or 0.0, 0.0) / self.half_queue)
            for b in candidates
        }


PLUGINS = [QueueScorer]
