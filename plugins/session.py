"""Policy ``session``: requests of one session stick to one backend, spilling under load.

The session is the `x-session-id` header (name configurable) or the body's `user` field.
Sticky by rendezvous hashing (every replica agrees, no shared state), with the same load bound
as bounded_load, so one busy session cannot hold a backend hostage. Requests without a session
go to the backend with the fewest requests in flight.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from plugins.health_filter import HealthFilter
from plugins.inflight_scorer import InflightScorer
from plugins.model_filter import ModelFilter
from plugins.role_filter import RoleFilter
from proxy.routing.rendezvous import hrw_order, key_of, split_by_load
from proxy.routing.types import BackendView, PluginSettings, Policy, RouteContext


class SessionPicker:
    name = "session_picker"
    kind = "picker"

    def __init__(self, header: str = "x-session-id", epsilon: float = 0.5) -> None:
        self.header = header.lower()
        self.epsilon = epsilon

    class Settings(PluginSettings):
        header: str = Field("x-session-id", min_length=1)  # the session's request header
        epsilon: float = Field(0.5, ge=0)  # the load bound's slack (as bounded_load's)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> SessionPicker:
        s = cls.Settings.of(cfg)
        return cls(s.header, s.epsilon)

    def session_of(self, ctx: RouteContext) -> str | None:
        if ctx.session_key:
            return ctx.session_key
        value = ctx.headers.get(self.header)
        if value:
            return f"h:{value}"
        user = ctx.body.get("user")
        return f"u:{user}" if isinstance(user, str) and user else None

    def pick(
        self, ctx: RouteContext, candidates: list[BackendView], totals: Mapping[str, float]
    ) -> tuple[list[str], str]:
        if not candidates:
            return [], "no candidates"
        session = self.session_of(ctx)
        within, over = split_by_load(candidates, self.epsilon)
        rest = sorted(over, key=lambda b: b.inflight / max(b.weight, 1e-9))
        if session is None:
            key = key_of(ctx.request_id)
            order = sorted(hrw_order(key, within), key=lambda b: -round(totals.get(b.name, 0), 9))
            return [b.name for b in order + rest], "no session: fewest in flight"
        order = hrw_order(key_of(session), candidates)
        home = order[0]
        ranked = [b for b in order if b in within] + [b for b in order if b not in within]
        reason = "session home" if ranked[0] is home else "session home over load bound: spill"
        return [b.name for b in ranked], reason


class SessionPolicy:
    name = "session"
    kind = "policy"
    Settings = SessionPicker.Settings  # its block configures its picker

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Policy:
        blocks: dict[str, Any] = cfg.get("plugins", {})
        picker_cfg = {
            **blocks.get(SessionPicker.name, {}),
            **{k: v for k, v in cfg.items() if k != "plugins"},
        }
        return Policy(
            name=cls.name,
            filters=[ModelFilter(), HealthFilter(), RoleFilter()],
            scorers=[(InflightScorer(), 1.0)],
            picker=SessionPicker.from_config(picker_cfg),
        )


PLUGINS = [SessionPicker, SessionPolicy]
