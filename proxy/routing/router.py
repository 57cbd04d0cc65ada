"""The router: runs a policy's filters -> scorers -> picker and records the decision.

When the policy uses prefixes, the router also hashes the prompt (once per request), asks the
prefix index which candidates hold how much of it (one walk of the prompt, after filtering so
no backend that cannot serve the request costs a probe), and records the winner's blocks right
after the pick so the next request with this prefix finds it.

A decision's cost follows the prompt and the backends that hold it, not the fleet: what the
candidates' names give is kept across decisions (proxy.routing.fleet), the index answers for
the holders only, the placement reads the backends it looks at, and on a large fleet the
picker is handed a shortlist it decides on as it would on every candidate
(proxy.routing.shortlist). What remains per candidate is a few C-level passes (the filters,
the names, the load bound).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from pydantic import Field

from proxy.routing.backlog import PrefillBacklog
from proxy.routing.capacity import CapacityLearner, Outcome
from proxy.routing.fallback import fallback_decision
from proxy.routing.fleet import Fleet, FleetCache
from proxy.routing.index import DEFAULT_CAPACITY_BLOCKS, DEFAULT_TTL_S, PrefixIndex
from proxy.routing.learn import DEFAULT_PREFILL_TOKENS_PER_S, PrefillLearner
from proxy.routing.placement import Placement, SharedHomes
from proxy.routing.popularity import PrefixPopularity
from proxy.routing.prefix import PrefixHasher
from proxy.routing.rendezvous import hrw_names
from proxy.routing.shortlist import Plan, shortlist
from proxy.routing.types import (
    BackendView,
    Decision,
    PluginSettings,
    Policy,
    PromptUnreadable,
    Recorded,
    RouteContext,
    Scores,
    ScoresByBackend,
    Views,
)

log = logging.getLogger("warmroute.routing")

# Decisions after which placement upkeep left for the event loop (Router._later) and not yet
# run is run at the start of the next one: requests that arrive together are decided one
# after another before the loop runs it, and a caller may never let the loop run.
UPKEEP_OVERDUE = 8
FAILURE_LOG_EVERY_S = 10.0  # a failing router logs (with the traceback) at most this often


class FirstPlacements(Protocol):
    """Where replicas make first placements together (SharedPlacement.claim)."""

    async def claim(
        self, key: int, need: int, size: float, fleet: int, held: int, names: Sequence[str]
    ) -> SharedHomes | None: ...


class ExactCache(Protocol):
    """What the router reads of an engine's own account of its cache (its KV events)."""

    @property
    def live(self) -> bool:
        """Whether the account is current (events arriving, no unrepaired gap)."""
        ...

    def match(self, blocks: Sequence[int]) -> int:
        """Longest prefix of `blocks` the engine holds."""
        ...

    def match_tiers(self, blocks: Sequence[int]) -> tuple[int, ...]:
        """Leading blocks of `blocks` the engine reaches through each of its cache tiers, the
        GPU first, then CPU, disk and a remote pool (proxy.kvevents.view.TIERS), each counting
        the faster ones: (gpu,) * 4 for an engine that offloads nothing."""
        ...


PREFIX_BLOCK = "prefix"  # RoutingConfig.plugins key for hashing settings (shared with the scorer)


class IndexSettings(PluginSettings):
    """The prefix index's and the capacity learner's keys in the `prefix` block."""

    capacity_blocks: int = Field(DEFAULT_CAPACITY_BLOCKS, ge=1)  # the most kept per backend
    ttl_s: float = Field(DEFAULT_TTL_S, ge=0)  # entries older than this do not match; 0: none
    learn_capacity: bool = True  # size each backend's index from its engine's cached_tokens


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
        capacity: CapacityLearner | None = None,
        placement: Placement | None = None,
    ) -> None:
        self.policy = policy
        self.index = index
        self.hasher = hasher or PrefixHasher()
        self.learner = learner or PrefillLearner()
        self.backlog = backlog or PrefillBacklog()
        self.popularity = PrefixPopularity()
        default_cap = DEFAULT_CAPACITY_BLOCKS if index is None else index.default_capacity
        self.capacity = capacity or CapacityLearner(default_blocks=default_cap)
        # The prompt head whose popularity counts: the picker's affinity key, where it has one.
        hints = policy.hints
        self.head_blocks = hints.affinity_blocks
        self.warm_blocks = hints.warm_blocks
        # Pickers that route hot prefixes to assigned homes get an explicit placement.
        if placement is None and hints.placement is not None:
            placement = Placement(**hints.placement)
        if placement is not None:
            placement.attach(self.popularity)  # its loads follow the shares it is passed
            self.capacity.listener = placement.pin_room  # its room keeps the sizes it read
        if placement is not None:
            placement.later = self._later
        self.placement = placement
        self.upkeep_later = 0  # times placement upkeep was left for after a decision (_later)
        self.upkeep_overdue = 0  # times it ran at a later decision's start instead
        self.failures = 0  # decisions that failed and fell back (route)
        self.last_failure = ""
        self._failure_logged_at = float("-inf")
        self._upkeep: list[Callable[[], object]] = []
        self._upkeep_since = 0  # the decision count when the oldest upkeep left was left
        self._decisions = 0
        # Replicas placing together (proxy.routing.shared_placement): first placements claimed.
        self.claims: FirstPlacements | None = None
        self.fleets = FleetCache()
        # Large fleets: hand the picker a shortlist it decides on as on every candidate.
        self.shortlists = True
        # Backends whose engines publish KV events: their exact cache views (proxy.kvevents).
        self.exact: dict[str, ExactCache] = {}
        # Prefixes recorded on such a backend this recently count as held (being prefilled).
        self.pending_s = 5.0
        self.learn_capacity = True
        # True: the winner's blocks are recorded inside route(). Set False to record only once
        # the upstream accepted the request (call record() with the backend actually used).
        self.record_on_route = record_on_route

    @classmethod
    def from_blocks(
        cls, policy: Policy, blocks: Mapping[str, Any], index: PrefixIndex | None = None
    ) -> Router:
        """Around a policy built by the caller (proxy.routing.setup.build_router builds it from
        the plugins: the router never imports them); `blocks` is RoutingConfig.plugins, read
        here for the prefix hasher and capacity learning."""
        hasher = PrefixHasher.from_config(blocks.get(PREFIX_BLOCK, {}))
        learn = IndexSettings.of(blocks.get(PREFIX_BLOCK)).learn_capacity
        default_cap = DEFAULT_CAPACITY_BLOCKS if index is None else index.default_capacity
        capacity = CapacityLearner(default_blocks=default_cap) if learn else None
        router = cls(policy, index=index, hasher=hasher, capacity=capacity)
        router.learn_capacity = learn
        return router

    async def route(
        self, ctx: RouteContext, backends: Sequence[BackendView], *, record: bool = True
    ) -> Decision:
        """Decide; `record=False` is a dry run (explain) that leaves the index untouched. A
        prompt it cannot read raises PromptUnreadable (the client's fault); any other error is
        the router's own: logged, counted (`failures`), and the request goes where
        fallback_decision sends it, so that a bug in a policy does not fail every request."""
        try:
            return await self._route(ctx, backends, record)
        except PromptUnreadable:
            raise
        except Exception as e:
            self.note_failure(
                "the decision",
                e,
                f"request {ctx.request_id}",
                " to the least loaded backend the filters keep",
            )
            return fallback_decision(self.policy.filters, ctx, backends, type(e).__name__)

    def note_failure(self, step: str, error: Exception, about: str, then: str = "") -> None:
        """A bug in routing's `step` (the decision, or the bookkeeping around a request):
        counted in `failures`, kept as `last_failure`, and logged with its traceback at most
        every FAILURE_LOG_EVERY_S; `then` says what the request got instead."""
        self.failures += 1
        self.last_failure = f"{step}: {type(error).__name__}: {error}"
        now = time.monotonic()
        if now - self._failure_logged_at >= FAILURE_LOG_EVERY_S:
            self._failure_logged_at = now
            log.error(
                "routing failed in %s for %s (%d failure(s) so far); the request goes on%s: %s: %s",
                step,
                about,
                self.failures,
                then,
                type(error).__name__,
                error,
                exc_info=error,
            )

    async def _route(
        self, ctx: RouteContext, backends: Sequence[BackendView], record: bool
    ) -> Decision:
        started = time.perf_counter()
        self._decisions += 1
        if self._upkeep and self._decisions - self._upkeep_since > UPKEEP_OVERDUE:
            self.upkeep_overdue += 1
            self.run_upkeep()  # the loop never ran it: the placement must not fall behind
        dropped: dict[str, str] = {}
        # A Views read is the request's own (made per read): kept whole, its fleet-wide facts
        # with it; any other sequence is copied, as a filter may hand back what it was given.
        candidates = backends if isinstance(backends, Views) else list(backends)
        for f in self.policy.filters:
            candidates = f.filter(ctx, candidates, dropped)
        plan: Plan | None = None
        if self.policy.uses_prefix:
            fleet = self.fleets.of(candidates)
            held = await self._match(ctx, candidates, fleet)
            if ctx.prefix_blocks:
                n = len(ctx.prefix_blocks)  # (no min(): it parses its arguments, every call)
                head = ctx.prefix_blocks[(n if n < self.head_blocks else self.head_blocks) - 1]
                ctx.head = head
                placed = self._placed(head, n)
                if record:
                    self.popularity.observe(head)
                ctx.prefix_share = self.popularity.share(head)
                if isinstance(candidates, Views):
                    inflight = candidates.inflight
                else:
                    inflight = [b.inflight for b in candidates]
                if placed:
                    if record and self.claims is not None:
                        await self._claim(ctx, head, fleet, held)
                    self._place(ctx, head, candidates, fleet, held, inflight, record)
                if self.shortlists:
                    plan = shortlist(ctx, candidates, fleet, held, self.policy.hints, inflight)
                if placed and candidates:
                    assert self.placement is not None
                    # Where a copy would evict a placed prefix (read by the picker for the
                    # backends it is handed only).
                    seen = fleet.names if plan is None else [b.name for b in plan.shortlist]
                    ctx.full = self.placement.full_for(head, seen, self.capacity.measured)
        decision = self.decide(ctx, candidates, dropped, plan.shortlist if plan else None)
        if plan is not None:
            decision.reason = plan.restate(decision.reason)
        decision.decision_s = time.perf_counter() - started
        if record and self.record_on_route and decision.winner is not None:
            self.record(decision, decision.winner)
        return decision

    def _placed(self, head: int, n: int) -> bool:
        """Whether a prompt of `n` blocks with this head is placed (asked before the head's
        request is counted). A prompt under head_blocks is keyed by its whole text, the
        user's turn in it: most such heads never come again, and placing each (re-placed at
        every rebalance) was over half a short request's routing. So one is placed when its
        head comes again (or is placed already: another replica's, or forgotten by the
        popularity since), and routed meanwhile by the picker's rules for prompts not placed."""
        placement = self.placement
        if placement is None or n < self.warm_blocks:
            return False
        return n >= self.head_blocks or self.popularity.seen(head) or head in placement.placed

    async def _match(
        self, ctx: RouteContext, candidates: list[BackendView], fleet: Fleet
    ) -> dict[str, int]:
        """Fill ctx's prefix (hashing the prompt) and its matches (every candidate, zero for
        most); returns the candidates that match any of it, and how much."""
        if not ctx.prefix_blocks:
            try:
                key = self.hasher.key(ctx.model, ctx.api, ctx.body)
            except (ValueError, TypeError, OverflowError, RecursionError) as e:
                raise PromptUnreadable(str(e)) from e
            ctx.prefix_blocks = key.blocks
            ctx.prompt_chars = key.chars
            ctx.block_chars = key.block_chars
            ctx.token_keyed = key.tokens
        blocks = ctx.prefix_blocks
        if self.index is not None and blocks and candidates:
            held = await self.index.holders(blocks, fleet.names)
            ctx.matched_blocks = fleet.zeros.copy()
            ctx.matched_blocks.update(held)
        else:
            inside = fleet.index
            held = {b: n for b, n in ctx.matched_blocks.items() if n > 0 and b in inside}
        if self.exact and blocks and ctx.token_keyed:
            # Engines that publish KV events say exactly what they hold: their word replaces
            # the learned index's estimate while their event stream is live. Only blocks of
            # token ids compare with theirs (exact mode, or a token-id prompt).
            exact = []
            fresh = None if self.index is None else self.index.fresh_prefix
            since = self._index_now() - self.pending_s
            ctx.tier_blocks = {}
            for name, view in self.exact.items():
                if name in fleet.index and view.live:
                    n = view.match(blocks)
                    if fresh is not None and n < len(blocks):
                        # Blocks sent there moments ago are being prefilled: the engine will
                        # hold them before a request sent now gets its turn.
                        n = max(n, fresh(name, blocks, since))
                    if n < len(blocks):
                        # Past the GPU's blocks, what the engine loads from a slower tier.
                        reach = view.match_tiers(blocks)  # GPU, CPU, disk, remote
                        if reach[-1] > n:
                            slower = zip(("CPU", "DISK", "REMOTE"), reach[1:], strict=False)
                            ctx.tier_blocks[name] = {tier: max(r, n) for tier, r in slower}
                    ctx.matched_blocks[name] = n
                    if n > 0:
                        held[name] = n
                    else:
                        held.pop(name, None)
                    exact.append(name)
            ctx.exact = frozenset(exact)
        return held

    async def _claim(
        self, ctx: RouteContext, head: int, fleet: Fleet, held: Mapping[str, int]
    ) -> None:
        """A prefix new here while other replicas place too: placed together with them."""
        placement, claims = self.placement, self.claims
        assert placement is not None and claims is not None
        if not placement.alike or head in placement.placed:
            return
        share = self.popularity.current
        proposal = placement.first_proposal(
            head, ctx.prefix_blocks, fleet.names, fleet.weights, self.capacity.capacity, share,
            held, fleet.rendezvous, self.warm_blocks,
        )  # fmt: skip
        if proposal is None:
            return
        need, size, holding, names = proposal
        homes = await claims.claim(head, need, size, len(fleet.names), holding, names)
        if homes is not None:
            placement.take_first(head, ctx.prefix_blocks, homes, share)

    def _place(
        self,
        ctx: RouteContext,
        head: int,
        candidates: list[BackendView],
        fleet: Fleet,
        held: Mapping[str, int],
        inflight: Sequence[int],
        record: bool,
    ) -> None:
        """Look up (or make) the prefix's assigned homes among the candidates."""
        placement = self.placement
        assert placement is not None
        names = fleet.names
        if not names:
            return
        weights = fleet.weights
        share = self.popularity.current
        order = fleet.rendezvous  # hrw_names, kept per prefix for this fleet
        if record:
            total = candidates.inflight_total if isinstance(candidates, Views) else sum(inflight)
            placement.note_load(float(total + 1))
            placement.observe(head, ctx.prefix_blocks)
            if placement.due():
                placement.start_rebalance(
                    names, weights, self.capacity.capacity, share, order, ctx.model
                )
            if placement.rebalancing:
                self._later(placement.advance)  # (REBALANCE_STEP of it)
        index = fleet.index

        def busy(name: str) -> float:
            """Weight-normalised requests in flight on `name` (asked when placing)."""
            i = index.get(name)
            if i is None:
                return 0.0
            b = candidates[i]
            return b.inflight / (1e-9 if b.weight < 1e-9 else b.weight)

        ctx.homes = placement.homes(
            head,
            ctx.prefix_blocks,
            names,
            weights,
            self.capacity.capacity,
            share,
            held,
            order,
            self.warm_blocks,
            busy,
        )
        placed = placement.placed.get(head)
        if placed is not None and placed.model is None:
            placed.model = ctx.model  # (its head is seeded by it: one model per head)
        ctx.shared_blocks = placed.size if placed is not None else 0.0

    def _later(self, upkeep: Callable[[], object]) -> None:
        """Run the placement's `upkeep` (a rebalance's step, a hot prefix's new homes) once
        this request is on its way: it is not this request's decision (at 1,024 backends
        either can be a millisecond), so it runs as the event loop's next callback, while the
        request waits for its engine. Inline where no loop runs; and at the start of a
        decision when UPKEEP_OVERDUE decisions came since without the loop running it (a
        caller that never lets the loop run, such as a discrete-event simulation)."""
        pending = self._upkeep
        pending.append(upkeep)
        if len(pending) > 1:
            return  # (the callback that runs them is already scheduled)
        self._upkeep_since = self._decisions
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.run_upkeep()
            return
        self.upkeep_later += 1
        loop.call_soon(self.run_upkeep)

    def run_upkeep(self) -> None:
        """Run the placement upkeep left for after a decision (_later), in the order left."""
        pending, self._upkeep = self._upkeep, []
        for upkeep in pending:
            upkeep()

    def record(self, decision: Decision, backend: str) -> None:
        """Note that `backend` is about to hold the decided prompt's prefix and prefill the rest
        of it; where, and how the index stood there, goes on the decision (`recorded`)."""
        blocks = decision.blocks
        if self.index is not None and blocks:
            matched = decision.matched_blocks.get(backend, 0)
            seen, ghost = self.index.probe(backend, blocks, matched)
            age = None if seen is None else self.index.now() - seen
            decision.recorded = Recorded(
                backend, None if age is None else 0.0 if age < 0.0 else age, ghost
            )
            self.index.record(backend, blocks)
        if decision.prompt_chars:
            self.finished(decision)  # (a retry: the attempt before is over)
            cached = decision.matched_blocks.get(backend, 0) * decision.block_chars
            left = decision.prompt_chars - cached
            uncached = (0 if left < 0 else left) / self.hasher.chars_per_token
            self.backlog.add(backend, uncached, self.prefill_rate(backend))
            decision.backlogged = (backend, uncached)

    def finished(self, decision: Decision) -> None:
        """The decided request had its first token, or is over (or moved to another backend):
        its prompt is no longer being prefilled where it was recorded, whatever the backlog's
        drain says. Once per decision: a second call does nothing."""
        done = decision.backlogged
        if done is not None:
            decision.backlogged = None
            self.backlog.finished(*done)

    def _index_now(self) -> float:
        """The index's clock (monotonic in memory, wall time with Redis, virtual in the sim);
        wall time without an index."""
        return time.time() if self.index is None else self.index.now()

    def observe(
        self,
        decision: Decision | None,
        backend: str,
        input_tokens: int | None,
        cached_tokens: int | None,
        ttft_s: float | None,
        settle_s: float | None = None,
    ) -> None:
        """A response from `backend` finished: teach the prefill-rate and capacity learners.

        `input_tokens` and `cached_tokens` are the engine's own usage numbers (cached_tokens
        None when the engine does not report it); `ttft_s` the upstream time to first token
        (None: not streamed; `settle_s`, the response time, then bounds when prefill ended)."""
        if ttft_s is not None and input_tokens:
            self.learner.observe(backend, input_tokens - (cached_tokens or 0), ttft_s)
        if decision is None or not decision.blocks or not self.learn_capacity:
            return
        recorded = decision.recorded
        if self.index is None or recorded is None or recorded.backend != backend:
            return  # recorded elsewhere (or not at all): no prediction to check
        fraction = None
        if cached_tokens is not None and input_tokens:
            fraction = cached_tokens / input_tokens
        outcome = Outcome(
            predicted_blocks=decision.matched_blocks.get(backend, 0),
            prompt_blocks=len(decision.blocks),
            cached_fraction=fraction,
            occupancy=self.index.occupancy(backend),
            ghost_blocks=recorded.ghost_blocks,
            recorded_age_s=recorded.age_s,
            ttft_s=ttft_s if ttft_s is not None else settle_s,
        )
        moved = self.capacity.observe(backend, outcome)
        if moved is not None:
            blocks = self.capacity.capacity(backend)
            self.index.set_capacity(backend, blocks)
            log.debug(
                "prefix index: %s's learned cache is now %d blocks (%s)",
                backend,
                blocks,
                self.capacity.estimate(backend).last_change,
            )

    def set_published_capacity(self, backend: str, blocks: int) -> None:
        """The engine published its KV pool size: the upper bound of what the index keeps."""
        self.capacity.set_upper(backend, blocks)
        if self.index is not None:
            self.index.set_capacity(backend, self.capacity.capacity(backend))

    def forget(
        self, backend: str, remaining: Sequence[str] | None = None, departure: str = ""
    ) -> int:
        """`backend` left the fleet: everything routing learned about it goes (its prefix
        index entries, learned cache, prefill rate, backlog, KV-event view), and the prefixes
        placed on it move to their next rendezvous choice among `remaining` (None: the other
        backends the placement knows). Returns how many placed prefixes moved. The KV-event
        view is only unregistered here: its owner closes it."""
        self.run_upkeep()  # (left before the departure: it must not bring the backend back)
        if self.index is not None:
            self.index.forget(backend, departure)
        self.capacity.forget(backend)
        self.exact.pop(backend, None)
        self.learner.forget(backend)
        self.backlog.forget(backend)
        if self.placement is None:
            return 0
        return self.placement.forget(backend, hrw_names, remaining)

    def reset_cache(self, backend: str, departure: str = "") -> None:
        """A new engine answers at `backend`'s address (a restart): its cache is cold, so the
        index entries, the learned cache size and the KV-event view's contents go. What
        belongs to the address stays: the placed prefixes' homes (they warm again where every
        replica expects them) and the prefill rate (the same hardware and model)."""
        self.run_upkeep()
        if self.index is not None:
            self.index.forget(backend, departure)
        self.capacity.forget(backend)
        view = self.exact.get(backend)
        reset = getattr(view, "reset", None)
        if callable(reset):
            reset()  # the subscription stays: the same endpoint, a new engine behind it
        else:
            self.exact.pop(backend, None)

    def cache_info(self) -> dict[str, Any]:
        """Per backend, the learned cache and how well the index predicts it; the placement of
        the hottest prefixes (for /admin/routing)."""
        out: dict[str, Any] = {
            "failures": {"count": self.failures, "last": self.last_failure},
            "learn_capacity": self.learn_capacity,
            "backends": self.capacity.snapshot(),
        }
        if self.placement is not None:
            out["placement"] = self.placement.snapshot(self.popularity.current)
        if self.exact:
            out["kv_events"] = {b: _exact_stats(v) for b, v in self.exact.items()}
        return out

    def prefill_rate(self, backend: str) -> float:
        """Learned prompt tokens/s of `backend` (a default before the first measurements)."""
        return self.learner.rate(backend) or DEFAULT_PREFILL_TOKENS_PER_S

    def backlog_tokens(self, backend: str) -> float:
        return self.backlog.level(backend, self.prefill_rate(backend))

    def decide(
        self,
        ctx: RouteContext,
        candidates: list[BackendView],
        dropped: dict[str, str],
        picked_from: list[BackendView] | None = None,
    ) -> Decision:
        """Score and pick among filtered candidates (pure: everything needed is in ctx).
        `picked_from`: the shortlist the picker orders, when it is not every candidate (the
        scores are still every candidate's: as the picker would see them over all)."""
        # Scored only if the picker (or, later, the span or explain) reads the totals.
        totals = Scores(self.policy.scorers, ctx, candidates)
        chosen = candidates if picked_from is None else picked_from
        ranking, reason = self.policy.picker.pick(ctx, chosen, totals)
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
            exact=ctx.exact,
            blocks=ctx.prefix_blocks,
        )


def _exact_stats(cache: ExactCache) -> dict[str, Any]:
    stats = getattr(cache, "stats", None)
    return dict(stats()) if callable(stats) else {"live": cache.live}
