"""Scorer ``kv_usage``: more free KV cache scores higher; a nearly full pool scores zero.

A full KV pool means new requests queue (or running ones get preempted), and whatever we cache
there now is evicted soonest. Unknown (not scraped yet) scores as empty.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from proxy.routing.types import BackendView, PluginSettings, RouteContext


class KvUsageScorer:
    name = "kv_usage"
    kind = "scorer"

    def __init__(self, full: float = 0.95) -> None:
        self.full = full  # usage at or above which the backend scores 0

    class Settings(PluginSettings):
        full: float = Field(0.95, gt=0, le=1)  # KV usage that scores 0

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> KvUsageScorer:
        return cls(full=cls.Settings.of(cfg).full)

    def score(self, ctx: RouteContext, candidates: list[BackendView]) -> dict[str, float]:
        out = {}
        for b in candidates:
            usage = min(max(b.load.kv_usage or 0.0, 0.0), 1.0)
            out[b.name] = 0.0 if usage >= self.full else 1.0 - usage / self.full
        return out


PLUGINS = [KvUsageScorer]
