"""Picker ``bounded_load``: a prompt goes to its prefix's homes or copies, within a load bound.

Placed prefix (the router assigned its head homes from traffic shares, sizes and the backends'
learned cache capacities; proxy.routing.placement): the least loaded home goes first. Another
backend goes first only when every home is over the load bound *and* that backend has less
prefill work ahead of the request (queued prompt tokens, plus the cold prefill there, plus,
when its learned cache is full of other placed prefixes, the re-prefill of the prefix the
newcomer evicts) than `spill_ratio` of the home's. A close call stays home: a copy made for a
passing burst evicts a prompt that other requests will pay for. The rest of this docstring is
the rule for prompts that are not placed (placement off, or more hot prefixes than it tracks).

Every pick first sets aside backends over the load bound (2x the weighted average in-flight,
or `slack` above the least loaded; proxy.routing.rendezvous) and those whose engine reports a
queue far longer than the others'; they stay in the ranking, last, as retry targets.
- Warm prefix (backends holding at least `warm_blocks` of it): it stays on those copies, best
  total score first (prefix match, predicted TTFT with the prefill backlog, load), as long as
  their number covers its share of the traffic (share x backends / `copy_load`). A hot prefix
  that needs more copies goes to the least loaded of its copies or to the next backend in its
  rendezvous order (a new copy, the same one on every replica). When every copy is over the
  bound, the others follow in the prefix's rendezvous order: one stable second copy, not one
  on whichever backend happens to be least loaded.
- Cold prefix (a prompt of at least `warm_blocks` that no backend holds): the less loaded of
  its first `choices` rendezvous backends (hashed on the first `affinity_blocks` blocks), so a
  new system prompt has at most two possible homes, the same on every replica, whatever
  arrives first.
- Short prompts: highest total score (they save too little prefill to be sticky).

A quiet tenant's cold prompt (`RouteContext.quiet`: a tenant within its share while another's
prompts over their share are being prefilled, with `tenants.reserve_prefills`) goes first to
the backend within the bound with the fewest prompt tokens queued or prefilling, placed or
not: it has no cache to lose anywhere, and an engine finishes the prompt it has begun before
a later one, whatever its priority.

Why stay on copies: with prompts of a few thousand tokens, a cold prefill costs more than
queueing behind several decoding requests, and every extra copy evicts other prefixes from a
full KV pool. Measured in virtual time (docs/benchmarks.md): on tight pools this took the hit
ratio from 71-74% to 90-96% of the oracle's, with hot-prompt load still even.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from plugins.predicted_ttft_scorer import PredictedTtftScorer
from proxy.routing.rendezvous import hrw_order, key_of, split_by_load
from proxy.routing.types import BackendView, PickerHints, PluginSettings, RouteContext

HOME_SETS_KEPT = 1024  # placed prefixes whose homes are kept as sets (placement keeps 256)


class BoundedLoadPicker:
    name = "bounded_load"
    kind = "picker"

    def __init__(
        self,
        epsilon: float = 1.0,
        affinity_blocks: int = 8,
        warm_blocks: int = 4,
        slack: int = 8,
        choices: int = 2,
        copy_load: float = 0.8,
        placement: bool = True,
        spill_ratio: float = 0.5,
        placement_config: dict[str, Any] | None = None,
        shared: bool = True,
    ) -> None:
        self.choices = max(1, choices)
        # A copy should carry at most this fraction of one backend's fair share of traffic.
        self.copy_load = max(copy_load, 0.05)
        self.epsilon = epsilon
        self.slack = slack
        self.affinity_blocks = max(1, affinity_blocks)
        self.warm_blocks = max(1, warm_blocks)
        self.spill_ratio = spill_ratio
        self._ttft = PredictedTtftScorer()
        # A placed prefix's homes as a set, by id of the homes tuple (the placement hands back
        # the same tuple while they stay): a hot prefix has hundreds of homes.
        self._home_sets: dict[int, tuple[tuple[str, ...], frozenset[str]]] = {}
        # What the router around it reads (the policy carries it: proxy.routing.types): hot
        # prefixes get homes (proxy.routing.placement) unless `placement` is off, shared with
        # the other replicas through Redis (proxy.routing.shared_placement) unless `shared` is.
        options = {"copy_load": self.copy_load, **(placement_config or {})}
        self.hints = PickerHints(
            affinity_blocks=self.affinity_blocks,
            warm_blocks=self.warm_blocks,
            placement=options if placement else None,
            shares_placement=shared,
            load_bound=(epsilon, slack, self.choices),
        )

    class PlacementOptions(PluginSettings):
        """The placement's knobs (proxy.routing.placement.Placement); unset: its defaults."""

        fill: float | None = Field(None, gt=0, le=1)
        imbalance: float | None = Field(None, ge=0)
        rebalance_every: int | None = Field(None, ge=1)
        max_keys: int | None = Field(None, ge=1)
        copy_inflight: float | None = Field(None, gt=0)
        shared: bool = True  # with Redis, replicas exchange homes and learned capacities

    class Settings(PluginSettings):
        epsilon: float = Field(1.0, ge=0)
        affinity_blocks: int = Field(8, ge=1)
        warm_blocks: int = Field(4, ge=1)
        slack: int = Field(8, ge=0)
        choices: int = Field(2, ge=1)
        copy_load: float = Field(0.8, gt=0)
        placement: bool = True
        spill_ratio: float = Field(0.5, ge=0)
        placement_options: BoundedLoadPicker.PlacementOptions = Field(
            default_factory=lambda: BoundedLoadPicker.PlacementOptions()
        )

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> BoundedLoadPicker:
        s = cls.Settings.of(cfg)
        options = s.placement_options.model_dump(exclude_none=True)
        shared = options.pop("shared")
        return cls(
            epsilon=s.epsilon,
            affinity_blocks=s.affinity_blocks,
            warm_blocks=s.warm_blocks,
            slack=s.slack,
            choices=s.choices,
            copy_load=s.copy_load,
            placement=s.placement,
            spill_ratio=s.spill_ratio,
            placement_config=options,
            shared=shared,
        )

    def pick(
        self, ctx: RouteContext, candidates: list[BackendView], totals: Mapping[str, float]
    ) -> tuple[list[str], str]:
        if not candidates:
            return [], "no candidates"
        # Prompts shorter than warm_blocks save too little prefill anywhere to be worth
        # stickiness: they go by score, spread by a per-request tie-break.
        blocks = ctx.prefix_blocks if len(ctx.prefix_blocks) >= self.warm_blocks else ()
        if blocks:
            n = len(blocks)  # (no min(): it parses its arguments on every call)
            key = blocks[(n if n < self.affinity_blocks else self.affinity_blocks) - 1]
        else:
            key = key_of(ctx.request_id)
        within, over = split_by_load(candidates, self.epsilon, self.slack)
        queued = _long_queues(within, self.epsilon, self.slack)
        if queued and len(queued) < len(within):
            # The engine itself reports a queue far longer than the others' (traffic from
            # elsewhere: other clients, proxies that share no state): as good as over the bound.
            within = [b for b in within if b not in queued]
            over = queued + over
        matched = ctx.matched_blocks
        warm = self.warm_blocks
        best_match = max([matched.get(b.name, 0) for b in candidates]) if matched else 0
        spill = f"; {len(over)} over the load bound" if over else ""
        placed = self._members(ctx.homes) if blocks and ctx.homes else frozenset()
        homes = [b for b in candidates if b.name in placed] if placed else []
        if ctx.quiet and best_match < warm and len(within) > 1:
            order = self._soonest(ctx, within)
            reason = "quiet tenant's cold prompt: the least prefill ahead" + spill
        elif homes:
            # A backend holding clearly more of this prompt than any home, and more than the
            # part its prefix's requests share (a conversation's earlier turns, placed there
            # before a move), counts as a home too. Not one holding the shared part alone (a
            # spill's copy): after a home lost the prompt, that sent the prompt's traffic to
            # the copy, whose engine then evicted its own prompts, and so on round the fleet.
            most = max(matched.get(b.name, 0) for b in homes)
            shared = ctx.shared_blocks
            reach = (most if most > shared else shared) + warm
            homes += [
                b for b in candidates if b.name not in placed and matched.get(b.name, 0) >= reach
            ]
            return self._pick_placed(ctx, key, candidates, homes, within)
        elif blocks and best_match < warm:
            order, reason = self._cold(key, within, spill)
        elif blocks:
            order, reason = self._warm(ctx, key, candidates, within, totals, spill)
        else:
            # Ties (say, every backend warm and equally loaded) are broken per request: a fixed
            # order would hand the first backend in it the odd extra request every time.
            tie_order = hrw_order(key_of(ctx.request_id), within)
            order = sorted(tie_order, key=lambda b: -round(totals.get(b.name, 0.0), 9))
            reason = "highest score" + spill
        if over:
            order += sorted(over, key=lambda b: (_load(b), -totals.get(b.name, 0)))
        return [b.name for b in order], reason

    @staticmethod
    def _soonest(ctx: RouteContext, within: list[BackendView]) -> list[BackendView]:
        """A cold prompt of a tenant within its share while another's prompts are being
        prefilled (tenants.reserve_prefills): first the backend where its prefill starts
        soonest (the fewest prompt tokens queued or prefilling there: an engine finishes a
        prompt it has begun before a later one, whatever its priority), then the least
        loaded; ties broken per request."""
        tie = hrw_order(key_of(ctx.request_id), within)
        return sorted(tie, key=lambda b: (b.backlog_tokens, _load(b)))

    def _members(self, homes: tuple[str, ...]) -> frozenset[str]:
        kept = self._home_sets.get(id(homes))
        if kept is not None and kept[0] is homes:
            return kept[1]
        if len(self._home_sets) >= HOME_SETS_KEPT:
            self._home_sets.clear()
        members = frozenset(homes)
        self._home_sets[id(homes)] = (homes, members)
        return members

    def _cold(
        self, key: int, within: list[BackendView], spill: str
    ) -> tuple[list[BackendView], str]:
        """A prompt no backend holds: its rendezvous order, led by the less loaded of its first
        `choices` backends."""
        order = hrw_order(key, within)
        reason = f"cold prefix: rendezvous on the first blocks{spill}"
        if self.choices > 1 and len(order) > 1:
            # The less loaded of the prefix's first `choices` rendezvous backends (the
            # power of two choices): hashing alone can hand one engine 3 of 8 prompts,
            # while a prompt still has at most `choices` possible homes.
            best = min(order[: self.choices], key=_load)
            if _load(best) < _load(order[0]):
                order.remove(best)
                order.insert(0, best)
                reason = f"cold prefix: less loaded of its first rendezvous choices{spill}"
        return order, reason

    def _warm(
        self,
        ctx: RouteContext,
        key: int,
        candidates: list[BackendView],
        within: list[BackendView],
        totals: Mapping[str, float],
        spill: str,
    ) -> tuple[list[BackendView], str]:
        """A prompt some backends hold (not placed): stay on its copies while they are as
        many as its traffic needs, else add the next in its rendezvous order."""
        matched, warm = ctx.matched_blocks, self.warm_blocks
        holders = [b for b in within if matched.get(b.name, 0) >= warm]
        copies = sum(1 for b in candidates if matched.get(b.name, 0) >= warm)
        wanted = max(1, math.ceil(ctx.prefix_share * len(candidates) / self.copy_load))
        if holders and copies >= wanted:
            # As many copies as its share of the traffic needs: stay on them (best score
            # first). A backend without the prefix comes only after them, when every copy
            # is over the bound; a copy made for a passing burst would evict other
            # prefixes from a full KV pool and split this one's traffic for good.
            tie_order = hrw_order(key_of(ctx.request_id), holders)
            order = sorted(tie_order, key=lambda b: -round(totals.get(b.name, 0.0), 9))
            order += [b for b in hrw_order(key, within) if b not in holders]
            return order, f"warm prefix: best of its {copies} cached copies{spill}"
        if holders:
            # A hot prefix: its traffic wants more copies than it has. The least loaded of
            # its copies and the next backend in its rendezvous order (a new copy, the same
            # one whichever replica makes it) takes it; ties stay on a copy.
            nxt = [b for b in hrw_order(key, within) if b not in holders][:1]
            rank = {id(b): i for i, b in enumerate(hrw_order(key_of(ctx.request_id), within))}
            pool = sorted(holders + nxt, key=lambda b: (_load(b), b in nxt, rank[id(b)]))
            order = pool + [b for b in within if b not in pool]
            share = f"hot prefix ({ctx.prefix_share:.0%} of traffic)"
            if order[0] in nxt:
                return order, f"{share}: a new copy, next in its rendezvous order{spill}"
            return order, f"{share}: least loaded copy{spill}"
        # Every copy is over the bound: the others in the prefix's rendezvous order.
        order = hrw_order(key, within)
        return order, f"warm backends loaded: next in the prefix's rendezvous order{spill}"

    def _pick_placed(
        self,
        ctx: RouteContext,
        key: int,
        candidates: list[BackendView],
        homes: list[BackendView],
        within: list[BackendView],
    ) -> tuple[list[str], str]:
        """A placed prefix: its least loaded home, unless every home is over the load bound
        and a backend within it has so much less prefill work queued that the cold prefill
        and the eviction there still come out ahead."""
        ok = set(map(id, within))
        tie = {id(b): i for i, b in enumerate(hrw_order(key_of(ctx.request_id), homes))}
        # A home that holds this request's own history (more than the prefix its requests
        # share: a conversation's earlier turns) first, then the least loaded: a hot prefix's
        # new home gets its share of the traffic although it starts cold.
        own = ctx.shared_blocks + self.warm_blocks
        matched = ctx.matched_blocks
        homes.sort(
            key=lambda b: (id(b) not in ok, matched.get(b.name, 0) < own, _load(b), tie[id(b)])
        )
        best = homes[0]
        home_ids = set(map(id, homes))
        others = [b for b in hrw_order(key, within) if id(b) not in home_ids]
        rest = [b.name for b in candidates if id(b) not in home_ids and id(b) not in ok]
        order = [b.name for b in homes] + [b.name for b in others] + rest
        of = f" (1 of {len(homes)} homes)" if len(homes) > 1 else ""
        if id(best) in ok or not others:
            return order, f"placed prefix: its home{of}"
        # Work in prompt tokens, not seconds: learned prefill rates are noisy per backend
        # (queueing inflates some TTFT samples), and a spill is a trade of prefill work.
        per_token = self._ttft.chars_per_token
        prompt = ctx.prompt_chars / per_token

        def work(b: BackendView) -> float:
            # GPU blocks, and a slower tier's at the share of prefill they save
            cached = self._ttft.cached_blocks(ctx, b.name) * ctx.block_chars / per_token
            queued = b.backlog_tokens + max(b.load.waiting or 0.0, 0.0) * prompt
            evicts = prompt if b.name in ctx.full else 0.0  # a placed prefix re-prefills
            return queued + max(prompt - cached, 0.0) + evicts

        alt = min(others, key=work)
        if work(alt) < self.spill_ratio * work(best):
            evicted = " and an eviction" if alt.name in ctx.full else ""
            reason = (
                f"placed prefix: load over affinity: every home over the load bound, "
                f"{work(best):.0f} prompt tokens of prefill ahead there against "
                f"{work(alt):.0f} on {alt.name} with its cold prefill{evicted}"
            )
            return [alt.name] + [n for n in order if n != alt.name], reason
        return order, f"placed prefix: its home{of}, over the load bound but still cheapest"


def _long_queues(backends: list[BackendView], epsilon: float, slack: int) -> list[BackendView]:
    """Backends whose engine-reported waiting queue exceeds slack + (1 + epsilon) x average."""
    if len(backends) < 2:
        return []
    waiting = [w if (w := b.load.waiting) and w > 0.0 else 0.0 for b in backends]
    if not any(waiting):
        return []
    limit = slack + (1.0 + epsilon) * sum(waiting) / len(waiting)
    return [b for b, w in zip(backends, waiting, strict=True) if w > limit]


def _load(b: BackendView) -> float:
    w = b.weight
    return b.inflight / (w if w > 1e-9 else 1e-9)


PLUGINS = [BoundedLoadPicker]
