"""Filter: keep backends whose role can serve a whole request (mixed, or decode with fallback).

Decided per distinct role (a fleet has at most three), applied in flat passes."""

from __future__ import annotations

from itertools import compress
from typing import Any, Literal

from proxy.routing.types import BackendView, Dropped, PluginSettings, RouteContext, Verdict


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


PLUGINS = [RoleFilter]
