"""Filter: only backends that serve the requested model (or whose models are not known yet).

A fleet has few distinct model lists (often one), so the verdict is reached once per distinct
list and applied to every backend in flat passes: in front of 1,024 backends a per-backend
call was the largest single cost of a decision. For a Views read (proxy.routing.types) the
distinct lists are found once per fleet epoch, and a model every list serves costs no pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from typing import Any

from proxy.routing.types import (
    BackendView,
    Dropped,
    PluginSettings,
    RouteContext,
    Verdict,
    Views,
)


class ModelFilter:
    name = "model"
    kind = "filter"
    Settings = PluginSettings  # no keys of its own: any key in its block is a mistake

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelFilter:
        return cls()

    def filter(
        self, ctx: RouteContext, candidates: list[BackendView], dropped: dict[str, str]
    ) -> list[BackendView]:
        model = ctx.model
        if isinstance(candidates, Views):
            kinds = candidates.fleetwide("model", _model_lists)
            if all([m is None or model in m for m in kinds]):
                return candidates
        lists = [b.models for b in candidates]
        verdict = {m: m is None or model in m for m in set(lists)}
        if all(verdict.values()):
            return candidates
        serves = list(map(verdict.__getitem__, lists))
        why = Dropped(Verdict.MODEL, f"does not serve model {model!r}")
        for b, ok in zip(candidates, serves, strict=True):
            if not ok:
                dropped[b.name] = why
        return list(compress(candidates, serves))


def _model_lists(views: Sequence[BackendView]) -> frozenset[frozenset[str] | None]:
    """The distinct model lists of a fleet (None: a backend's list is not known yet)."""
    return frozenset([b.models for b in views])


PLUGINS = [ModelFilter]
