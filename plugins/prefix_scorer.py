"""Scorer ``prefix``: backends already holding more of the prompt's prefix score higher.

The score is in prompt tokens saved, not the matched ratio: matched / (best match + half),
so a 4k-token hit scores ~0.94 while a fully matched 30-token prompt scores ~0.1. A short prompt
saves almost no prefill anywhere, and letting its 100% ratio dominate would pile every short
request onto whichever backend saw it first (the hotspot other routers create).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from proxy.routing.types import BackendView, PluginSettings, RouteContext


class PrefixScorer:
    name = "prefix"
    kind = "scorer"

    def __init__(self, half_tokens: float = 256.0, chars_per_token: float = 4.0) -> None:
        self.half_tokens = half_tokens
        self.chars_per_token = chars_per_token

    class Settings(PluginSettings):
        half_tokens: float = Field(256.0, gt=0)  # matched tokens that score 0.5 next to none
        chars_per_token: float = Field(4.0, gt=0)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> PrefixScorer:
        s = cls.Settings.of(cfg)
        return cls(half_tokens=s.half_tokens, chars_per_token=s.chars_per_token)

    def score(self, ctx: RouteContext, candidates: list[BackendView]) -> dict[str, float]:
        per_block = ctx.block_chars / self.chars_per_token
        matched = {b.name: ctx.matched_blocks.get(b.name, 0) * per_block for b in candidates}
        denominator = max(matched.values(), default=0.0) + self.half_tokens
        return {name: tokens / denominator for name, tokens in matched.items()}


PLUGINS = [PrefixScorer]
