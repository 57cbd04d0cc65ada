"""The router: runs a policy's filters -> scorers -> picker and records the decision."""

from __future__ import annotations

import time
from collections.abc import Sequence

from proxy.routing.types import BackendView, Decision, Policy, RouteContext


class Router:
    """Owns one policy instance (and its picker state) for the life of the app."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    async def route(self, ctx: RouteContext, backends: Sequence[BackendView]) -> Decision:
        started = time.perf_counter()
        dropped: dict[str, str] = {}
        candidates = list(backends)
        for f in self.policy.filters:
            candidates = f.filter(ctx, candidates, dropped)
        decision = self.decide(ctx, candidates, dropped)
        decision.decision_s = time.perf_counter() - started
        return decision

    def decide(
        self, ctx: RouteContext, candidates: list[BackendView], dropped: dict[str, str]
    ) -> Decision:
        """Score and pick among filtered candidates (pure: everything needed is in ctx)."""
        scores: dict[str, dict[str, float]] = {b.name: {} for b in candidates}
        totals: dict[str, float] = dict.fromkeys(scores, 0.0)
        for scorer, weight in self.policy.scorers:
            for name, value in scorer.score(ctx, candidates).items():
                scores[name][scorer.name] = value
                totals[name] += weight * value
        ranking, reason = self.policy.picker.pick(ctx, candidates, totals)
        return Decision(
            policy=self.policy.name,
            ranking=ranking,
            reason=reason,
            scores=scores,
            totals=totals,
            matched_blocks=dict(ctx.matched_blocks),
            prefix_blocks=len(ctx.prefix_blocks),
            filtered_out=dropped,
        )
