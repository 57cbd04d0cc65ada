"""Picker ``bounded_load``: a prompt stays on the copies of its prefix, within a load bound.

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

Why stay on copies: with prompts of a few thousand tokens, a cold prefill costs more than
queueing behind several decoding requests, and every extra copy evicts other prefixes from a
full KV pool. Measured in virtual time (README, Benchmarks): on tight pools this took the hit
ratio from 71-74% to 90-96% of the oracle's, with hot-prompt load still even.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from proxy.routing.rendezvous import hrw_order, key_of, split_by_load
from proxy.routing.types import BackendView, RouteContext


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
    ) -> None:
        self.choices = max(1, choices)
        # A copy should carry at most this fraction of one backend's fair share of traffic.
        self.copy_load = max(copy_load, 0.05)
        self.epsilon = epsilon
        self.slack = slack
        self.affinity_blocks = max(1, affinity_blocks)
        self.warm_blocks = max(1, warm_blocks)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> BoundedLoadPicker:
        return cls(
            epsilon=float(cfg.get("epsilon", 1.0)),
            affinity_blocks=int(cfg.get("affinity_blocks", 8)),
            warm_blocks=int(cfg.get("warm_blocks", 4)),
            slack=int(cfg.get("slack", 8)),
            choices=int(cfg.get("choices", 2)),
            copy_load=float(cfg.get("copy_load", 0.8)),
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
            key = blocks[min(self.affinity_blocks, len(blocks)) - 1]
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
        if blocks and best_match < warm:
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
        elif blocks:
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
                reason = f"warm prefix: best of its {copies} cached copies{spill}"
            elif holders:
                # A hot prefix: its traffic wants more copies than it has. The least loaded of
                # its copies and the next backend in its rendezvous order (a new copy, the same
                # one whichever replica makes it) takes it; ties stay on a copy.
                nxt = [b for b in hrw_order(key, within) if b not in holders][:1]
                rank = {id(b): i for i, b in enumerate(hrw_order(key_of(ctx.request_id), within))}
                pool = sorted(holders + nxt, key=lambda b: (_load(b), b in nxt, rank[id(b)]))
                order = pool + [b for b in within if b not in pool]
                reason = f"hot prefix ({ctx.prefix_share:.0%} of traffic): least loaded copy{spill}"
                if order[0] in nxt:
                    reason = (
                        f"hot prefix ({ctx.prefix_share:.0%} of traffic): a new copy, next in "
                        f"its rendezvous order{spill}"
                    )
            else:
                # Every copy is over the bound: the others in the prefix's rendezvous order.
                order = hrw_order(key, within)
                reason = f"warm backends loaded: next in the prefix's rendezvous order{spill}"
        else:
            # Ties (say, every backend warm and equally loaded) are broken per request: a fixed
            # order would hand the first backend in it the odd extra request every time.
            tie_order = hrw_order(key_of(ctx.request_id), within)
            order = sorted(tie_order, key=lambda b: -round(totals.get(b.name, 0.0), 9))
            reason = "highest score" + spill
        if over:
            order += sorted(over, key=lambda b: (_load(b), -totals.get(b.name, 0)))
        return [b.name for b in order], reason


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
