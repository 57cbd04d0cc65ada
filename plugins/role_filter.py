"""Filter: keep backends whose role can serve a whole request (mixed, or decode with fallback).

Decided per distinct role (a fleet has at most three), applied in flat passes; for a Views read
(proxy.routing.types) the fleet's roles are found once per fleet epoch."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from typing import Any, Literal

from proxy.routing.types import (
    BackendView,
    Dropped,
    PluginSettings,
    RouteContext,
    Verdict,
    Views,
)


class RoleFilter:
    name = "role"
    kind = "filter"

    def __init__(self, roles: tuple[str, ...] = ("mixed",)) -> None:
        self.roles = roles
        self._roles = frozenset(roles)

    class Settings(PluginSettings):
        roles: tuple[Literal["mixed", "prefill", "decode"], ...] = ("mixed",)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> RoleFilter:
        return cls(cls.Settings.of(cfg).roles)

    def filter(
        self, ctx: RouteContext, candidates: list[BackendView], dropped: dict[str, str]
    ) -> list[BackendView]:
        if isinstance(candidates, Views):
            if self._roles.issuperset(candidates.fleetwide("role", _roles)):
                return candidates
        roles = [b.role for b in candidates]
        if self._roles.issuperset(roles):
            return candidates  # (disagg off: every backend is mixed)
        keep = list(map(self._roles.__contains__, roles))
        if not any(keep):
            # Only prefill/decode-role backends: a plain request still needs a home.
            return candidates
        allowed = ", ".join(self.roles)
        for b, ok in zip(candidates, keep, strict=True):
            if not ok:
                why = f"role {b.role} is not one of {allowed}"
                dropped[b.name] = Dropped(Verdict.ROLE, why)
        return list(compress(candidates, keep))


def _roles(views: Sequence[BackendView]) -> frozenset[str]:
    """The roles a fleet's backends have."""
    return frozenset([b.role for b in views])


PLUGINS = [RoleFilter]
