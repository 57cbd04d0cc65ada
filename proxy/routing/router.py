"""The router: runs a policy's filters -> scorers -> picker and records the decision.

When the policy uses prefixes, the router also hashes the prompt (once per request), asks the
prefix index for every candidate's longest match (one lookup, after filtering so no backend
that cannot serve the request costs a probe), and records the winner's blocks right after the
pick so the next request with this prefix finds it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.routing.backlog import PrefillBacklog
from proxy.routing.index import PrefixIndex
from proxy.routing.learn import DEFAULT_PREFILL_TOKENS_PER_S, PrefillLearner
from proxy.routing.popularity import PrefixPopularity
from proxy.routing.prefix import PrefixHasher
from proxy.routing.types import BackendView, Decision, Policy, RouteContext, Scores, ScoresByBackend

PREFIX_BLOCK = "prefix"  # RoutingConfig.plugins key for hashing settings (shared with the scorer)


class Router:
    """Owns one policy instance (and its picker state) for the life of the app."""

    def __init__(
        self,
        policy: Policy,
        index: PrefixIndex | None = None,
        hasher: PrefixHasher | None = None,
        record_on_route: bool = True,
        learner: PrefillLearner | None = None,
        backlog: PrefillBacklog | None = None,
    ) -> None:
        self.policy = policy
        self.index = index
        self.hasher = hasher or PrefixHasher()
        self.learner = learner or PrefillLearner()
        self.backlog = backlog or PrefillBacklog()
        self.popularity = PrefixPopularity()
        # The prompt head whose popularity counts: the picker's affinity key, where it has one.
        self.head_blocks = int(getattr(policy.picker, "affinity_blocks", 8))
        # True: the winner's blocks are recorded inside route(). Set False to record only once
        # the upstream accepted the request (call record() with the backend actually used).
        self.record_on_route = record_on_route

    @classmethod
    def from_config(cls, routing: Any, index: PrefixIndex | None = None) -> Router:
        """Build from a RoutingConfig (or a mapping with `policy` and `plugins`)."""
        import plugins

        if isinstance(routing, Mapping):
            name, blocks = routing.get("policy", "prefix_aware"), routing.get("plugins", {})
        else:
            name, blocks = routing.policy, routing.plugins
        blocks = dict(blocks or {})
        # A composite policy configures its parts from their own blocks; hand it all of them.
        policy_cfg = {**blocks.get(name, {}), "plugins": blocks}
        policy = plugins.build(name, policy_cfg)
        hasher = PrefixHasher.from_config(blocks.get(PREFIX_BLOCK, {}))
        return cls(policy, index=index, hasher=hasher)

    async def route(
        self, ctx: RouteContext, backends: Sequence[BackendView], *, record: bool = True
    ) -> Decision:
        """Decide; `record=False` is a dry run (explain) that leaves the index untouched."""
        started = time.perf_counter()
        dropped: dict[str, str] = {}
        candidates = list(backends)
        for f in self.policy.filters:
            candidates = f.filter(ctx, candidates, dropped)
        if self.policy.uses_prefix:
            await self._match(ctx, candidates)
            if ctx.prefix_blocks:
                head = ctx.prefix_blocks[min(self.head_blocks, len(ctx.prefix_blocks)) - 1]
                if record:
                    self.popularity.observe(head)
                ctx.prefix_share = self.popularity.share(head)
        decision = self.decide(ctx, candidates, dropped)
        decision.decision_s = time.perf_counter() - started
        if record and self.record_on_route and decision.winner is not None:
            self.record(ctx, decision.winner)
        return decision

    async def _match(self, ctx: RouteContext, candidates: list[BackendView]) -> None:
        if not ctx.prefix_blocks:
            key = self.hasher.key(ctx.model, ctx.api, ctx.body)
            ctx.prefix_blocks = key.blocks
            ctx.prompt_chars = key.chars
            ctx.block_chars = key.block_chars
        if self.index is not None and ctx.prefix_blocks and candidates:
            ctx.matched_blocks = await self.index.lookup(
                ctx.prefix_blocks, [b.name for b in candidates]
            )

    def record(self, ctx: RouteContext, backend: str) -> None:
        """Note that `backend` is about to hold ctx's prefix and prefill the rest of it."""
        if self.index is not None and ctx.prefix_blocks:
            self.index.record(backend, ctx.prefix_blocks)
        if ctx.prompt_chars:
            cached = ctx.matched_blocks.get(backend, 0) * ctx.block_chars
            uncached = max(ctx.prompt_chars - cached, 0) / self.hasher.chars_per_token
            self.backlog.add(backend, uncached, self.prefill_rate(backend))

    def prefill_rate(self, backend: str) -> float:
        """Learned prompt tokens/s of `backend` (a default before the first measurements)."""
        return self.learner.rate(backend) or DEFAULT_PREFILL_TOKENS_PER_S

    def backlog_tokens(self, backend: str) -> float:
        return self.backlog.level(backend, self.prefill_rate(backend))

    def decide(
        self, ctx: RouteContext, candidates: list[BackendView], dropped: dict[str, str]
    ) -> Decision:
        """Score and pick among filtered candidates (pure: everything needed is in ctx)."""
        # Scored only if the picker (or, later, the span or explain) reads the totals.
        totals = Scores(self.policy.scorers, ctx, candidates)
        ranking, reason = self.policy.picker.pick(ctx, candidates, totals)
        return Decision(
            policy=self.policy.name,
            ranking=ranking,
            reason=reason,
            scores=ScoresByBackend(totals),
            totals=totals,
            matched_blocks=dict(ctx.matched_blocks),
            prefix_blocks=len(ctx.prefix_blocks),
            block_chars=ctx.block_chars,
            prompt_chars=ctx.prompt_chars,
            filtered_out=dropped,
        )
