"""The role and health filters (plugins/role_filter.py, plugins/health_filter.py): what they
keep, and the reason they record for each backend they drop (what /admin/route/explain and
the 503's message show)."""

from __future__ import annotations

from plugins.health_filter import HealthFilter
from plugins.role_filter import RoleFilter
from proxy.routing.types import BackendView, EngineLoad, RouteContext

CTX = RouteContext("r1", "m", "chat", {"model": "m", "messages": []}, {}, 0.0)


def view(name: str, role: str = "mixed", healthy: bool = True) -> BackendView:
    return BackendView(
        name=name,
        url=f"http://127.0.0.1:{8000 + len(name)}",
        engine="vllm",
        role=role,
        weight=1.0,
        healthy=healthy,
        inflight=0,
        load=EngineLoad(),
        models=frozenset({"m"}),
    )


def test_backends_of_other_roles_are_dropped_with_their_role_and_mixed_ones_kept() -> None:
    dropped: dict[str, str] = {}
    fleet = [view("a"), view("p", role="prefill"), view("b")]
    assert [b.name for b in RoleFilter().filter(CTX, fleet, dropped)] == ["a", "b"]
    assert dropped == {"p": "role prefill is not one of mixed"}
    dropped.clear()
    mixed = [view("a"), view("b")]
    assert RoleFilter().filter(CTX, mixed, dropped) == mixed and dropped == {}
    only = [view("p", role="prefill"), view("d", role="decode")]
    assert RoleFilter().filter(CTX, only, dropped) == only and dropped == {}  # still a home


def test_unhealthy_backends_are_dropped_with_the_reason_unless_none_is_healthy() -> None:
    dropped: dict[str, str] = {}
    fleet = [view("a", healthy=False), view("b"), view("c")]
    assert [b.name for b in HealthFilter().filter(CTX, fleet, dropped)] == ["b", "c"]
    assert dropped == {"a": "unhealthy"}
    dropped.clear()
    both = [view("a"), view("b")]
    assert HealthFilter().filter(CTX, both, dropped) == both and dropped == {}
    down = [view("a", healthy=False), view("b", healthy=False)]
    assert HealthFilter().filter(CTX, down, dropped) == down and dropped == {}
