"""Filter: only backends that serve the requested model (or whose models are not known yet)."""

from __future__ import annotations

from typing import Any

from proxy.routing.types import BackendView, RouteContext


class ModelFilter:
    name = "model"
    kind = "filter"

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelFilter:
        return cls()

    def filter(
        self, ctx: RouteContext, candidates: list[BackendView], dropped: dict[str, str]
    ) -> list[BackendView]:
        kept = []
        for b in candidates:
            if b.serves(ctx.model):
                kept.append(b)
            else:
                dropped[b.name] = f"does not serve model {ctx.model!r}"
        return kept


PLUGINS = [ModelFilter]
