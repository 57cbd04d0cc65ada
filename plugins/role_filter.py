"""Filter: keep backends whose role can serve a whole request (mixed, or decode with fallback)."""

from __future__ import annotations

from typing import Any

from proxy.routing.types import ROLE_REASON_PREFIX, BackendView, RouteContext


class RoleFilter:
    name = "role"
    kind = "filter"

    def __init__(self, roles: tuple[str, ...] = ("mixed",)) -> None:
        self.roles = roles

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> RoleFilter:
        return cls(tuple(cfg.get("roles", ("mixed",))))

    def filter(
        self, ctx: RouteContext, candidates: list[BackendView], dropped: dict[str, str]
    ) -> list[BackendView]:
        kept = [b for b in candidates if b.role in self.roles]
        if not kept:
            # Only prefill/decode-role backends: a plain request still needs a home.
            return candidates
        if len(kept) < len(candidates):  # (disagg off: every backend is mixed)
            for b in candidates:
                if b.role not in self.roles:
                    dropped[b.name] = (
                        f"{ROLE_REASON_PREFIX}{b.role} is not one of {', '.join(self.roles)}"
                    )
        return kept


PLUGINS = [RoleFilter]
