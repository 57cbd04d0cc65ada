"""The model, role and health filters (plugins/): what they keep, and the reason they record
for each backend they drop (what /admin/route/explain and the 503's message show)."""

from __future__ import annotations

from dataclasses import replace

import proxy.routing.types as routing_types
from plugins.health_filter import HealthFilter
from plugins.model_filter import ModelFilter
from plugins.role_filter import RoleFilter
from proxy.routing.types import (
    MODEL_LISTS_KEPT,
    BackendView,
    EngineLoad,
    RouteContext,
    Verdict,
    one_copy,
    verdict_of,
)

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


def test_backends_not_serving_the_model_are_dropped_and_unknown_lists_kept() -> None:
    dropped: dict[str, str] = {}
    other = replace(view("o"), models=frozenset({"other"}))
    unknown = replace(view("u"), models=None)
    fleet = [view("a"), other, unknown, view("b")]
    assert [b.name for b in ModelFilter().filter(CTX, fleet, dropped)] == ["a", "u", "b"]
    assert dropped == {"o": "does not serve model 'm'"}
    dropped.clear()
    same = [view("a"), unknown, view("b")]
    assert ModelFilter().filter(CTX, same, dropped) is same and dropped == {}
    assert ModelFilter().filter(CTX, [other], dropped) == [] and dropped == {
        "o": "does not serve model 'm'"
    }


def test_backends_at_their_bound_are_dropped_before_health_is_read() -> None:
    dropped: dict[str, str] = {}
    full = replace(view("f"), inflight=2, max_inflight=2)
    room = replace(view("r"), inflight=1, max_inflight=2)
    sick = view("s", healthy=False)
    kept = HealthFilter().filter(CTX, [full, room, sick, view("a")], dropped)
    assert [b.name for b in kept] == ["r", "a"]
    assert dropped == {"f": "at its in-flight bound (2)", "s": "unhealthy"}
    dropped.clear()
    # Every backend with room is unhealthy: they are all tried, the full one still is not.
    kept = HealthFilter().filter(CTX, [full, sick], dropped)
    assert [b.name for b in kept] == ["s"] and dropped == {"f": "at its in-flight bound (2)"}


def test_equal_model_lists_are_one_object_and_the_table_stays_bounded() -> None:
    a, b = one_copy(frozenset({"m", "n"})), one_copy(frozenset({"n", "m"}))
    assert a is b
    for i in range(MODEL_LISTS_KEPT + 5):
        one_copy(frozenset({f"made-up-{i}"}))
    assert len(routing_types._MODEL_LISTS) <= MODEL_LISTS_KEPT


def test_each_filter_says_its_verdict_beside_its_reason() -> None:
    """What the proxy decides from a drop (429 or 503, the P/D flows' role pools) reads the
    verdict; the text stays what operators read."""
    dropped: dict[str, str] = {}
    bound = replace(view("full"), inflight=2, max_inflight=2)
    fleet = [bound, view("sick", healthy=False), view("p", role="prefill"), view("a")]
    fleet.append(replace(view("o"), models=frozenset({"other"})))
    kept = ModelFilter().filter(CTX, fleet, dropped)
    kept = HealthFilter().filter(CTX, kept, dropped)
    kept = RoleFilter().filter(CTX, kept, dropped)
    assert [b.name for b in kept] == ["a"]
    assert {n: verdict_of(r) for n, r in dropped.items()} == {
        "full": Verdict.AT_BOUND,
        "sick": Verdict.UNHEALTHY,
        "p": Verdict.ROLE,
        "o": Verdict.MODEL,
    }
    assert dropped["full"] == "at its in-flight bound (2)" and verdict_of("unhealthy") is None
