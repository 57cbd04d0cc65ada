"""The decision made when the router itself fails: the request still goes somewhere sensible.

A routing policy is plugins and state (the index, placement, learners); an error in any of
them is a bug, not the client's fault, and must not fail every request while it lasts. The
fallback keeps what protects the fleet (the policy's filters: health, model, role, in-flight
bounds) and drops what optimises it: it ranks the remaining backends by requests in flight
per unit of weight. Pure: views in, a Decision out.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.routing.types import BackendView, Decision, Filter, RouteContext

FALLBACK_POLICY = "fallback"


def fallback_decision(
    filters: Sequence[Filter], ctx: RouteContext, backends: Sequence[BackendView], why: str
) -> Decision:
    """Least in flight (per weight) among what the filters keep; where a filter fails too,
    the backends that serve the model, healthy ones first. No prefix is recorded for it."""
    dropped: dict[str, str] = {}
    candidates = list(backends)
    try:
        for f in filters:
            candidates = f.filter(ctx, candidates, dropped)
    except Exception:
        dropped = {}
        serving = [b for b in backends if b.serves(ctx.model)]
        candidates = [b for b in serving if b.healthy] or serving
    ranked = sorted(
        candidates, key=lambda b: (not b.healthy, b.inflight / max(b.weight, 1e-9), b.name)
    )
    return Decision(
        policy=FALLBACK_POLICY,
        ranking=[b.name for b in ranked],
        reason=f"routing failed ({why}): least in flight",
        filtered_out=dropped,
    )
