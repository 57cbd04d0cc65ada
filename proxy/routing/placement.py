"""Which backends are home to each hot prompt prefix: an explicit assignment (pure).

Routing by "stay where the prefix is cached, spill when loaded" keeps whatever placement the
first requests and the load bound happened to make. When the engines' caches are small, that
placement decides everything: each spill makes a second copy, every copy evicts another prompt
from a full cache, and the fleet thrashes while the request counts look perfectly balanced.

So the hot prefixes (their heads, the same key the picker's rendezvous hashing uses) are
assigned homes explicitly, from three measured inputs: each prefix's share of recent traffic,
its size (the blocks its requests share), and each backend's learned cache capacity
(proxy.routing.capacity). Hottest first, each prefix gets as many homes as its load needs
(the fewer of share x backends / copy_load and share x requests in flight / copy_inflight, at
least one: at low concurrency a copy spreads nothing), each on the backend that keeps the
load most even among those with room left in their cache (`fill` of the capacity, leaving the
rest for the unique suffixes and running sequences):

- a prefix keeps its homes while they stay within twice the load bound (a new home must be
  within `imbalance` above the fair share) and have room: moving a prompt costs a cold
  prefill and an eviction, so the assignment changes only when the traffic does (hysteresis);
- a new home prefers a backend that already holds the prefix, then the less loaded (assigned
  traffic, then requests in flight) of the first two backends in the prefix's rendezvous order
  that are within the bound and have room, unless both already host more placed prefixes than
  a fair count (then the least crowded: two choices alone clumped 3 of 8 prompts on one);
- a prefix no backend has room for is still placed for load (marked overflow): its requests
  will prefill, wherever they go.

The assignment is recomputed every `rebalance_every` requests (hottest `max_keys` prefixes),
the work spread over the requests that follow (`REBALANCE_STEP` units each: at 1,024 backends
a whole recomputation is milliseconds); in between, a prefix seen for the first time is placed
at once against the current loads, and one whose traffic grew past a tenth more than its homes
carry gains homes then. (The router places a prompt shorter than its head's eight blocks, keyed
by its whole text, only when that head comes again: Router._placed.)

Replicas that share it (proxy.routing.shared_placement does the I/O) exchange the homes this
module decided: `take_changes` hands over what changed since the last exchange, `adopt` takes
another replica's homes, and with `leads` False this replica leaves the periodic
recomputation to the one that leads (it still places the prefixes it sees first). With `alike`
(other replicas are placing too) a first placement reads only what they all agree on, so a
prompt new to all of them gets the same homes on each before they exchange.

Placing reads what the placed prefixes add up to per backend (how many, their blocks, their
traffic) from tallies kept as homes change (proxy.routing.tallies), not from a sum over all
of them. Traffic needs shares that decay alike (`attach` a PrefixPopularity, as the router
does); with `share_of` alone loads are summed as before.

Size: the rules (rebalance, homes, spill, eviction guard) read and write the same tallies and
must be read together; what they read lazily of the fleet is proxy/routing/placement_views.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.routing.placement_views import (
    EAGER_UP_TO,
    Accumulated,
    Loads,
    Room,
    common_prefix,
    fast_members,
    kept_homes,
    rank_of,
    total_weight,
    uniform_over,
)
from proxy.routing.spares import spare_homes
from proxy.routing.tallies import Placed, Shares, Tallies, unfixed

__all__ = ["Placed", "Placement", "SharedHomes", "Shares"]

REBALANCE_STEP = 64  # units of a rebalance's work carried out per request (see advance)
# A rebalance comes at most once per this many units of its work per request: where the
# placement is large (hundreds of homes), it comes less often than every `rebalance_every`
# requests, so that its amortised cost per request does not grow with the fleet.
REBALANCE_UNITS_PER_REQUEST = 16
GROW_BAND = 0.1  # a prefix gains homes only once it needs this share more than it has
MAX_WOBBLE = 0.5  # the most of its homes a measured share's noise may keep (see _needed)
CLAIM_CHOICES = 8  # backends past the needed homes a shared first placement chooses among
KEEP_IN_PASSES = 16  # previous homes past which _choose keeps them in passes (kept_homes)
# _grow's arguments but `whole`: key, backends, weights, capacity, share_of, order, busy.
GrowArgs = tuple[
    int,
    Sequence[str],
    Mapping[str, float],
    Callable[[str], float],
    Callable[[int], float],
    Callable[[int, Sequence[str]], Sequence[str]],
    Callable[[str], float] | None,
]
# Homes a first placement chooses at once, past the backends that hold the prefix already,
# where the rest can be added after the request (`later`): see Placement.homes.
FIRST_HOMES = 2
DEFER_PAST = 4  # ... when it needs more than this many (past those holders)


@dataclass(frozen=True, slots=True)
class SharedHomes:
    """One prefix's homes as another replica placed them."""

    homes: tuple[str, ...]
    size: float
    overflow: bool = False


@dataclass
class Placement:
    fill: float = 0.8  # share of a backend's learned cache that placed prefixes may take
    copy_load: float = 0.8  # a home should carry at most this share of a fair backend load
    imbalance: float = 0.25  # a home keeps its prefixes up to (1 + imbalance) x fair load
    rebalance_every: int = 64  # requests between recomputations
    max_keys: int = 256  # most prefixes placed explicitly; the rest route by the old rules
    choices: int = 2  # a new prefix takes the less loaded of its first rendezvous choices
    copy_inflight: float = 3.0  # a home should carry at most this many of its requests at once
    inflight: float = 0.0  # running average of the fleet's requests in flight
    size_alpha: float = 0.2  # weight of a new measurement in a prefix's size
    # The shares' effective sample count (Shares.samples, from `attach`): how noisy they are.
    samples: float = 0.0
    placed: dict[int, Placed] = field(default_factory=dict)
    # Free cache per backend, as placed (a Room, read lazily, on fleets of over 64).
    room: MutableMapping[str, float] = field(default_factory=dict)
    requests: int = 0
    rebalances: int = 0
    # The request count at which the next rebalance is due (see start_rebalance; the first
    # after rebalance_every requests).
    next_rebalance: int = field(default=0, init=False)
    moves: int = 0
    # False while another replica recomputes the assignment (shared placement): this one
    # then only places the prefixes it sees first, and adopts the rest.
    leads: bool = True
    adopted: int = 0  # prefixes whose homes were taken from another replica
    claimed: int = 0  # first placements made together with the other replicas (take_first)
    # What this replica decided since its changes were last taken: prefix -> whether it was a
    # first placement (another replica's, if it has one, wins), and whether it recomputed all.
    dirty: dict[int, bool] = field(default_factory=dict)
    reassigned: bool = False
    # Replicas sharing the placement make first placements alike (see _first_alike), and
    # _fresh counts per backend the homes of this replica's first placements not yet exchanged.
    alike: bool = False
    _fresh: dict[str, int] = field(default_factory=dict)
    # What the placed prefixes add up to per backend, kept as homes change (tallies.py).
    tallies: Tallies = field(default_factory=Tallies)
    _steps: Iterator[int] | None = field(default=None, repr=False)  # a rebalance under way
    _rebalance_room: MutableMapping[str, float] | None = field(default=None, repr=False)
    # Runs a callable once the request being placed is on its way (the router's: the event
    # loop's next callback). Set, a prefix that needs more homes gets them then, and this
    # request goes to the homes it has: the growth is upkeep (at 1,024 backends a hot
    # prefix growing by dozens of homes is a millisecond), not this request's decision.
    later: Callable[[Callable[[], object]], None] | None = field(default=None, repr=False)
    # Growths left for later and not yet run: prefix -> up to its whole need (see _grow)
    _growing: dict[int, bool] = field(default_factory=dict, repr=False)

    def attach(self, shares: Shares) -> None:
        """Keep the loads from `shares` (the share_of every call passes must be its current)."""
        self.tallies.shares = shares
        self.samples = shares.samples
        shares.listener = self.reweigh
        self.tallies.recount(self.placed)

    def pin_room(self, backend: str) -> None:
        """`backend`'s learned capacity is about to move (a CapacityLearner listener): a room
        read lazily keeps the value it was taken with (placement_views.Room), the placement's
        and that of a rebalance under way (begun from the capacities of its start)."""
        for room in (self.room, self._rebalance_room):
            if isinstance(room, Room):
                room.pin(backend)

    def reweigh(self, key: int) -> None:
        """`key`'s weight changed (the Shares listener)."""
        if key in self.placed:
            self.tallies.stale.add(key)

    def observe(self, key: int, blocks: Sequence[int]) -> Placed | None:
        """Note one request whose prompt starts with `key`; returns its placement, if any."""
        self.requests += 1
        p = self.placed.get(key)
        if p is None:
            return None
        if not p.last:  # adopted from another replica: nothing of this one's to compare yet
            p.last = blocks
            return p
        shared = common_prefix(p.last, blocks)
        p.size += self.size_alpha * (shared - p.size)
        self.tallies.stale.add(key)
        p.last = blocks
        return p

    def __post_init__(self) -> None:
        self.next_rebalance = self.rebalance_every

    def due(self) -> bool:
        return self.leads and self.requests >= self.next_rebalance

    def homes(
        self,
        key: int,
        blocks: Sequence[int],
        backends: Sequence[str],
        weights: Mapping[str, float],
        capacity: Callable[[str], float],
        share_of: Callable[[int], float],
        warm: Mapping[str, int],
        order: Callable[[int, Sequence[str]], Sequence[str]],
        warm_blocks: int = 4,
        busy: Callable[[str], float] | None = None,
    ) -> tuple[str, ...]:
        """The homes of the prefix `key` among `backends`, placing it now if it has none there."""
        p = self.placed.get(key)
        inside = fast_members(backends)
        homes: tuple[str, ...] = ()
        if p is not None:
            seen = p.inside  # (kept for a tuple of names only: the same object, the same names)
            if seen is None or seen[0] is not backends or seen[1] is not p.homes:
                kept = tuple(filter(inside.__contains__, p.homes))
                seen = (backends, p.homes, p.homes if kept == p.homes else kept)
                p.inside = seen if isinstance(backends, tuple) else None
            homes = seen[2]
        if p is not None and homes:
            whole = self._growing.get(key)
            if whole is not None:
                # Its growth left for later has not run yet (a burst): run it, not pile on.
                return self._grow(
                    key, backends, weights, capacity, share_of, order, busy, whole=whole
                )
            share = share_of(key)
            n = len(backends)
            if len(homes) >= n or self._needed(share, n, len(homes)) <= len(homes):
                return homes
            # Its traffic grew past what its homes should carry: add homes now (or right after
            # this request, `later`), not at the next rebalance (a burst would pile onto one).
            args: GrowArgs = (key, backends, weights, capacity, share_of, order, busy)
            if self.later is None:
                return self._grow(*args)
            self._grow_later(args)
            return homes
        first = p is None
        tallies = self.tallies
        tallies.current(self.placed)
        if p is None:
            if len(self.placed) >= self.max_keys:
                self._forget_coolest(share_of)
            p = self.placed[key] = Placed((), float(len(blocks)), blocks)
            tallies.track(key, p)
        tallies.uncount(p)
        loads, room = self._accounting(backends, weights, capacity, share_of, skip=key)
        p.share = share_of(key)
        # (Their order is the warm mapping's: every use sorts them by rendezvous rank.)
        holders = [b for b, n in warm.items() if n >= warm_blocks and b in inside]
        previous = p.homes
        if first and self.alike:
            p.homes, p.overflow = self._first_alike(key, p, backends, room, holders, order)
            fresh = self._fresh
            for h in p.homes:
                fresh[h] = fresh.get(h, 0) + 1
        else:
            # At first sight the bound is a share of all traffic: the prefix goes to the first
            # backend in its rendezvous order that stays within it, as it would on any replica.
            most = self._first_now(p, len(backends), len(holders)) if first else 0
            p.homes, p.overflow = self._choose(
                key, p, backends, weights, loads, room, holders, order, (), 1.0, busy, most
            )
            if most and not p.overflow and len(p.homes) >= most:
                args = (key, backends, weights, capacity, share_of, order, busy)
                self._grow_later(args, whole=True)
        tallies.count(p)
        for h in p.homes:
            room[h] -= p.size
        self.room = room
        if previous and p.homes != previous:
            p.moves += 1
            self.moves += 1
        self.dirty[key] = self.dirty.get(key, first)
        return p.homes

    def _first_now(self, p: Placed, backends: int, holders: int) -> int:
        """The homes a first placement chooses in its decision; 0: all it needs.

        A new prompt's measured share is large while few requests were seen (one of the first
        hundred: ten or more homes at 1,024 backends), and choosing them all was the slowest
        decision there is; where the rest can be added after this request (`later`, as a
        growth), a prompt needing more than DEFER_PAST gets FIRST_HOMES now (past the
        `holders`, which come first). One needing a few gets them all now: growing by one or
        two would walk its rendezvous order a second time."""
        if self.later is None:
            return 0
        need = self._needed(0.0 if p.share < 0.0 else p.share, backends)
        return FIRST_HOMES + holders if need > DEFER_PAST + holders else 0

    def _grow_later(self, args: GrowArgs, whole: bool = False) -> None:
        """Leave `key`'s growth (args: _grow's) for after this request, once."""
        assert self.later is not None
        key = args[0]
        if key not in self._growing:
            self._growing[key] = whole
            self.later(lambda: self._grow(*args, whole=whole))

    def _grow(
        self,
        key: int,
        backends: Sequence[str],
        weights: Mapping[str, float],
        capacity: Callable[[str], float],
        share_of: Callable[[int], float],
        order: Callable[[int, Sequence[str]], Sequence[str]],
        busy: Callable[[str], float] | None,
        whole: bool = False,
    ) -> tuple[str, ...]:
        """More homes for the placed prefix `key`, whose share outgrew those it has among
        `backends` (asked again: when run later, a rebalance may have placed it since);
        `whole`: up to its whole need, as a first placement choosing them all at once would."""
        self._growing.pop(key, None)
        p = self.placed.get(key)
        if p is None:
            return ()
        inside = fast_members(backends)
        homes = tuple(filter(inside.__contains__, p.homes))
        share = share_of(key)
        n = len(backends)
        need = self._needed(share, n, 0 if whole else len(homes))
        if not homes or len(homes) >= n or need <= len(homes):
            return homes
        p.share = share
        tallies = self.tallies
        tallies.current(self.placed)
        tallies.uncount(p)
        loads, room = self._accounting(backends, weights, capacity, share_of, skip=key)
        p.homes, p.overflow = self._choose(
            key, p, backends, weights, loads, room, [], order, homes, 1.0, busy, whole=whole
        )
        tallies.count(p)
        for h in p.homes:
            room[h] -= p.size
        self.room = room
        self.dirty.setdefault(key, False)
        return p.homes

    def first_proposal(
        self,
        key: int,
        blocks: Sequence[int],
        backends: Sequence[str],
        weights: Mapping[str, float],
        capacity: Callable[[str], float],
        share_of: Callable[[int], float],
        warm: Mapping[str, int],
        order: Callable[[int, Sequence[str]], Sequence[str]],
        warm_blocks: int = 4,
    ) -> tuple[int, float, int, list[str]] | None:
        """What a first placement of `key` could choose from, for replicas that place it
        together (proxy.routing.shared_placement claims it in Redis): (homes needed, its size,
        how many of `names` already hold it, names), the holders with room first (by
        rendezvous rank), then the next CLAIM_CHOICES backends with room in its rendezvous
        order. None: placed here already, or no room for it anywhere (placed for load here)."""
        if key in self.placed or not backends:
            return None
        size = float(len(blocks))
        share = share_of(key)
        need = self._needed(0.0 if share < 0.0 else share, len(backends))
        self.tallies.current(self.placed)
        _, room = self._accounting(backends, weights, capacity, share_of, skip=key)
        inside = fast_members(backends)
        hrw = order(key, backends)
        rank = rank_of(order, key, backends, hrw)
        holders = [b for b, n in warm.items() if n >= warm_blocks and b in inside]
        holders = [b for b in sorted(holders, key=rank.__getitem__) if room[b] >= size][:need]
        names = list(holders)
        for b in hrw:
            if len(names) >= need + CLAIM_CHOICES:
                break
            if b not in holders and room[b] >= size:
                names.append(b)
        if len(names) < need:
            return None
        return need, size, len(holders), names

    def take_first(
        self,
        key: int,
        blocks: Sequence[int],
        shared: SharedHomes,
        share_of: Callable[[int], float],
    ) -> bool:
        """`key`'s first homes as the replicas agreed on them (claimed in Redis): placed here
        as they are, and not handed over again (they are shared already)."""
        if key in self.placed or not shared.homes:
            return False
        tallies = self.tallies
        tallies.current(self.placed)
        if len(self.placed) >= self.max_keys:
            self._forget_coolest(share_of)
        p = self.placed[key] = Placed(shared.homes, float(len(blocks)), blocks)
        p.overflow = shared.overflow
        p.share = share_of(key)
        tallies.track(key, p)
        tallies.count(p)
        self.claimed += 1
        return True

    def full_for(
        self, key: int, backends: Sequence[str], measured: Callable[[str], bool] = bool
    ) -> frozenset[str]:
        """Backends (not homes of `key`) where the prompt would evict a prefix placed there:
        their placed prefixes leave no room for it, or they host placed prefixes and their
        cache size was never `measured` (no engine report ever contradicted the index: the
        size is only an upper bound, and a copy is a cost until shown otherwise)."""
        p = self.placed.get(key)
        if p is None:
            return frozenset()
        room = self.room
        hosted = self.tallies.hosted
        homes = p.home_set()
        return frozenset(
            b
            for b in backends
            if b not in homes
            and (room.get(b, math.inf) < p.size or (b in hosted and not measured(b)))
        )

    def rebalance(
        self,
        backends: Sequence[str],
        weights: Mapping[str, float],
        capacity: Callable[[str], float],
        share_of: Callable[[int], float],
        order: Callable[[int, Sequence[str]], Sequence[str]],
    ) -> None:
        """Recompute every placed prefix's homes, hottest first, keeping homes that still fit."""
        self.start_rebalance(backends, weights, capacity, share_of, order)
        self.advance(math.inf)

    def start_rebalance(
        self,
        backends: Sequence[str],
        weights: Mapping[str, float],
        capacity: Callable[[str], float],
        share_of: Callable[[int], float],
        order: Callable[[int, Sequence[str]], Sequence[str]],
        model: str | None = None,
    ) -> None:
        """Begin a rebalance that `advance` carries out a few prefixes at a time (one left
        unfinished is finished first). At 1,024 backends a whole recomputation is several
        milliseconds: done at once it was the tail of every 64th decision.

        `backends` are the engines a request of `model` may go to: only that model's prefixes
        (and those of no known model) are re-placed, among them; the others keep their homes
        and count, where they share an engine, in its load and room. A fleet whose engines
        serve different models (or LoRA adapters) had every prefix re-placed among the
        engines of whichever model's request came when a rebalance was due: the other models'
        prompts moved to engines that cannot serve them, and back at the next."""
        self.advance(math.inf)
        # Its work in units (as advance counts them, with the homes it has now): the next one
        # comes after rebalance_every requests, or after enough of them to carry this much
        # work at REBALANCE_UNITS_PER_REQUEST, whichever is later.
        units = 2 * len(self.placed) + 2 * sum(len(p.homes) for p in self.placed.values())
        interval = -(-units // REBALANCE_UNITS_PER_REQUEST)
        every = self.rebalance_every
        self.next_rebalance = self.requests + (every if interval < every else interval)
        self._steps = self._rebalance_steps(backends, weights, capacity, share_of, order, model)

    def advance(self, budget: float = REBALANCE_STEP) -> bool:
        """Carry a started rebalance on until about `budget` units of work are spent (a unit:
        one home kept or chosen, one prefix); True when none is left to do. Units, not
        seconds, so that a run placed alike twice decides alike (virtual time)."""
        steps = self._steps
        if steps is None:
            return True
        spent = 0
        for cost in steps:
            spent += cost
            if spent >= budget:
                return False
        self._steps = None
        return True

    @property
    def rebalancing(self) -> bool:
        return self._steps is not None

    def _rebalance_steps(
        self,
        backends: Sequence[str],
        weights: Mapping[str, float],
        capacity: Callable[[str], float],
        share_of: Callable[[int], float],
        order: Callable[[int, Sequence[str]], Sequence[str]],
        model: str | None = None,
    ) -> Iterator[int]:
        """The rebalance, one prefix a step (yielding the step's units). Between steps the
        placement is whole: each prefix has the homes either before or after, and the tallies
        count what is. A prefix forgotten meanwhile is skipped; one placed meanwhile keeps its
        homes (the loads this rebalance sums leave it out until the next one)."""
        self.rebalances = max(self.rebalances + 1, self.requests // max(self.rebalance_every, 1))
        if not backends:
            return
        for key, p in self.placed.items():
            p.share = share_of(key)
        ranked = sorted(self.placed.items(), key=lambda kv: (-kv[1].share, kv[0]))
        keep = ranked[: self.max_keys]
        self.placed = dict(keep)
        tallies = self.tallies
        for key, gone in ranked[self.max_keys :]:
            self.dirty.pop(key, None)  # so it stays bounded where nobody takes the changes
            tallies.uncount(gone)
        for _, p in keep:
            p.seq = tallies.next_seq()  # the new order
        tallies.reheap(self.placed)
        loads: MutableMapping[str, float]
        room: MutableMapping[str, float]
        if len(backends) > EAGER_UP_TO:
            fill, inside = self.fill, fast_members(backends)
            uniform = uniform_over(weights, backends)
            loads = Accumulated(inside, uniform)
            room = self._rebalance_room = Room(inside, lambda b: fill * capacity(b))
        else:
            loads = dict.fromkeys(backends, 0.0)
            room = {b: self.fill * capacity(b) for b in backends}
        mine = keep
        if model is not None and any(p.model not in (None, model) for _, p in keep):
            mine = [(k, p) for k, p in keep if p.model in (None, model)]
        total = sum(p.share for _, p in mine)
        if mine is not keep:
            total += self._others_count(mine, keep, backends, weights, loads, room)
        yield len(keep)
        placed = self.placed
        for key, p in mine:
            if placed.get(key) is not p:
                continue  # forgotten since (or placed again): not this rebalance's
            previous = p.homes
            tallies.uncount(p)
            p.homes, p.overflow = self._choose(
                key, p, backends, weights, loads, room, [], order, previous, total
            )
            tallies.count(p)
            if previous and p.homes != previous:
                p.moves += 1
                self.moves += 1
            need = len(p.homes)
            if isinstance(loads, Accumulated) and isinstance(room, Room):
                loads.add_each(p.homes, p.share / need, weights)  # (a hot prefix: hundreds)
                room.take_each(p.homes, p.size)
            else:
                for h in p.homes:
                    loads[h] += p.share / need / _weight(weights, h)
                    room[h] -= p.size
            yield 1 + len(previous) + need
        self.room = room
        self._rebalance_room = None
        self.reassigned = True
        self._fresh = {}  # the whole assignment goes out: nothing of it is this replica's alone

    def _others_count(
        self,
        mine: list[tuple[int, Placed]],
        keep: list[tuple[int, Placed]],
        backends: Sequence[str],
        weights: Mapping[str, float],
        loads: MutableMapping[str, float],
        room: MutableMapping[str, float],
    ) -> float:
        """Count the prefixes this rebalance leaves where they are (another model's) in the
        loads and room of the engines of `backends` they share; returns their traffic there."""
        chosen = {k for k, _ in mine}
        inside = fast_members(backends)
        traffic = 0.0
        for key, p in keep:
            if key in chosen or not p.homes:
                continue
            need = len(p.homes)
            here = [h for h in p.homes if h in inside]
            for h in here:
                loads[h] += p.share / need / _weight(weights, h)
                room[h] -= p.size
            traffic += p.share * len(here) / need
        return traffic

    def forget(
        self,
        backend: str,
        order: Callable[[int, Sequence[str]], Sequence[str]],
        backends: Sequence[str] | None = None,
    ) -> int:
        """`backend` left the fleet: each prefix homed there takes, in its place, the next
        backend of its rendezvous `order` among the rest (`backends`; None: every backend this
        placement knows of but `backend`) that is not a home yet and has room for it (with no
        room anywhere, the next one, marked overflow). Every other prefix keeps its homes, so
        the caches that stay warm stay used; balancing is the next rebalance's, by its usual
        rules. A prefix left with no backend at all is forgotten. Returns how many moved.

        Rendezvous order is what every replica computes alike, so replicas forgetting the same
        backend move its prefixes to the same places without talking."""
        self.advance(math.inf)  # a rebalance under way may still place on `backend`: end it
        if backends is None:
            known = set(self.room) | set(self.tallies.hosted)
            known |= {h for p in self.placed.values() for h in p.homes}
            rest = sorted(known - {backend})
        else:
            rest = [b for b in backends if b != backend]
        tallies = self.tallies
        tallies.current(self.placed)
        room = self.room
        room.pop(backend, None)
        self._fresh.pop(backend, None)
        moved = 0
        for key, p in list(self.placed.items()):
            if backend not in p.homes:
                continue
            tallies.uncount(p)
            kept = [h for h in p.homes if h != backend]
            spare = [b for b in order(key, rest) if b not in kept]
            if not spare and not kept:  # nowhere to go: placed again when next seen
                del self.placed[key]
                self.dirty.pop(key, None)
                continue
            if spare:
                fits = [b for b in spare if room.get(b, math.inf) >= p.size]
                home = (fits or spare)[0]
                # In the departed home's place: the homes keep their order.
                kept.insert(p.homes.index(backend), home)
                p.overflow = p.overflow or not fits
                if home in room:
                    room[home] -= p.size
            p.homes = tuple(kept)
            tallies.count(p)
            p.moves += 1
            self.moves += 1
            moved += 1
            self.dirty[key] = self.dirty.get(key, False)
        return moved

    # -- sharing with other replicas (the I/O is proxy.routing.shared_placement) --------------

    def take_changes(self) -> tuple[bool, dict[int, bool]]:
        """What this replica decided since the last call: (whether it recomputed the whole
        assignment, {prefix: whether it was a first placement}); forgotten prefixes left out."""
        full, dirty = self.reassigned, self.dirty
        self.reassigned, self.dirty, self._fresh = False, {}, {}
        return full, {k: first for k, first in dirty.items() if k in self.placed}

    def requeue(self, full: bool, changes: Mapping[int, bool]) -> None:
        """Changes taken but not delivered (the exchange failed): hand them over next time."""
        self.reassigned = self.reassigned or full
        fresh = self._fresh
        for key, first in changes.items():
            self.dirty[key] = self.dirty.get(key, True) and first
            p = self.placed.get(key)
            if first and self.alike and p is not None:
                for h in p.homes:
                    fresh[h] = fresh.get(h, 0) + 1

    def adopt(self, shared: Mapping[int, SharedHomes], capacity: Callable[[str], float]) -> int:
        """Take other replicas' homes; returns how many prefixes changed here.

        A prefix this replica changed since its changes were last taken keeps its own homes
        (they are newer and go out with the next exchange), and so does everything when it
        recomputed the whole assignment meanwhile. `capacity` is the learned cache per
        backend, to redo the room the placed prefixes leave."""
        if self.reassigned:
            return 0
        changed = 0
        for key, theirs in shared.items():
            if key in self.dirty or not theirs.homes:
                continue
            p = self.placed.get(key)
            if p is None:
                if len(self.placed) >= self.max_keys:
                    continue
                p = self.placed[key] = Placed((), theirs.size, (), seq=self.tallies.next_seq())
            elif p.homes == theirs.homes:
                continue
            p.homes, p.overflow = theirs.homes, theirs.overflow
            changed += 1
        if changed:
            self.adopted += changed
            self.tallies.recount(self.placed)
            backends = set(self.room) | {h for p in self.placed.values() for h in p.homes}
            room = {b: self.fill * capacity(b) for b in backends}
            for p in self.placed.values():
                for h in p.homes:
                    room[h] -= p.size
            self.room = room
        return changed

    def _accounting(
        self,
        backends: Sequence[str],
        weights: Mapping[str, float],
        capacity: Callable[[str], float],
        share_of: Callable[[int], float],
        skip: int,
    ) -> tuple[Mapping[str, float], MutableMapping[str, float]]:
        """Assigned load (weight-normalised share) and free cache room per backend now, of the
        placed prefixes but `skip` (the caller took it out of the tallies, made current)."""
        tallies = self.tallies
        sizes = tallies.sizes
        room: MutableMapping[str, float]
        shares = tallies.shares
        if len(backends) > EAGER_UP_TO and shares is not None:
            # Read as placing looks (placement_views.py): the sizes as they are now, each
            # capacity as it is now or, if the learner moves it first, as it was (pin_room).
            inside, fill, taken = fast_members(backends), self.fill, dict(sizes)
            room = Room(inside, lambda b: fill * capacity(b) - unfixed(taken.get(b, 0)))
            uniform = uniform_over(weights, backends)
            return Loads(inside, tallies.weights, shares.scale(), weights, uniform), room
        room = {b: self.fill * capacity(b) - unfixed(sizes.get(b, 0)) for b in backends}
        if shares is not None:
            tally = tallies.weights
            scale = shares.scale()
            loads = {b: unfixed(tally.get(b, 0)) * scale / _weight(weights, b) for b in backends}
            return loads, room
        loads = dict.fromkeys(backends, 0.0)
        for key, p in self.placed.items():
            if key == skip or not p.homes:
                continue
            share = share_of(key)
            for h in p.homes:
                if h in loads:
                    loads[h] += share / len(p.homes) / _weight(weights, h)
        return loads, room

    def _choose(
        self,
        key: int,
        p: Placed,
        backends: Sequence[str],
        weights: Mapping[str, float],
        loads: Mapping[str, float],
        room: Mapping[str, float],
        holders: Sequence[str],
        order: Callable[[int, Sequence[str]], Sequence[str]],
        previous: Sequence[str],
        total: float,
        busy: Callable[[str], float] | None = None,
        most: int = 0,
        whole: bool = False,
    ) -> tuple[tuple[str, ...], bool]:
        """Homes for one prefix against the loads and room placed so far; `total` is the
        traffic share of every placed prefix (this one included), which sets the bound.
        `most`: at most that many homes (0: as many as it needs); `whole`: the whole need,
        not held within a band of the `previous` homes (they were a first placement's first)."""
        n = len(backends)
        # Two-value max()/min() written out in this module's per-request paths: each call
        # parses its arguments in CPython 3.11 (~1,200 instructions).
        share = 0.0 if p.share < 0.0 else p.share
        need = self._needed(share, n, 0 if whole else len(previous))
        weight_sum = total_weight(weights, backends)
        per_copy = share / need
        if most and need > most:
            need = most  # (each copy still counted as carrying its part of the whole need)
        chosen = self._kept(
            p, previous, need, backends, weights, loads, room, per_copy, total, weight_sum
        )
        if len(chosen) >= need:
            # Its homes stay (most prefixes at most rebalances): no order to read.
            return tuple(chosen), False
        hrw = order(key, backends)
        rank = rank_of(order, key, backends, hrw)

        def within(b: str, slack: float = 1.0) -> bool:
            over = 1.0 + self.imbalance * slack
            bound = over * total / weight_sum if total > 0 else math.inf
            return loads[b] + per_copy / _weight(weights, b) <= bound + 1e-12

        def fits(b: str) -> bool:
            return room[b] >= p.size

        taken = set(chosen)
        # Then backends that already hold it (with a shared index, what another replica
        # placed), then the first within the bound and with room in the prefix's rendezvous
        # order: the same choice on every replica, where the least loaded would not be.
        for b in sorted(holders, key=lambda b: (loads[b], rank[b])):
            if len(chosen) < need and b not in taken and within(b) and fits(b):
                chosen.append(b)
                taken.add(b)
        overflow = False
        if len(chosen) < need:
            count, tally = need - len(chosen), self.tallies.hosted
            every = loads.within_all if isinstance(loads, Loads | Accumulated) else None
            spares = spare_homes(
                backends, hrw, rank, taken, count, self.choices, loads, within, fits, busy, tally,
                every,
            )  # fmt: skip
            chosen += spares
            taken.update(spares)
        if len(chosen) < need:
            # No room anywhere: placed for load alone; its requests prefill wherever they go.
            overflow = True
            rest = sorted(
                (b for b in hrw if b not in taken), key=lambda b: (not within(b), rank[b])
            )
            chosen += rest[: need - len(chosen)]
        return tuple(chosen), overflow

    def _kept(
        self,
        p: Placed,
        previous: Sequence[str],
        need: int,
        backends: Sequence[str],
        weights: Mapping[str, float],
        loads: Mapping[str, float],
        room: Mapping[str, float],
        per_copy: float,
        total: float,
        weight_sum: float,
    ) -> list[str]:
        """The previous homes that stay (hysteresis), in their order, at most `need`.

        Previous homes that still fit keep their prefix up to twice the imbalance: shares
        measured over a few hundred requests are noisy, and a move costs a cold prefill and an
        eviction. Or while the backend, without this copy, carries less than a fair load:
        copies come whole, and when the placed prefixes need more copies than there are
        backends, some backend must carry two; the second copy should not move at every
        rebalance. `weight_sum`: the backends' total weight (the caller's)."""
        fair = total / weight_sum if total > 0 else math.inf
        twice = (1.0 + self.imbalance * 2.0) * total / weight_sum if total > 0 else math.inf
        if len(previous) > KEEP_IN_PASSES:  # (a hot prefix's hundreds: the same rule)
            members = fast_members(backends) if isinstance(loads, Loads | Accumulated) else loads
            kept = kept_homes(
                previous, need, members, loads, room, p.size, per_copy, weights, twice, fair
            )
            if kept is not None:
                return kept
        chosen: list[str] = []
        for b in previous:
            if len(chosen) < need and b in loads and b not in chosen and room[b] >= p.size:
                if loads[b] + per_copy / _weight(weights, b) <= twice + 1e-12:
                    chosen.append(b)
                elif loads[b] < fair - 1e-12:
                    chosen.append(b)
        return chosen

    def _first_alike(
        self,
        key: int,
        p: Placed,
        backends: Sequence[str],
        room: Mapping[str, float],
        holders: Sequence[str],
        order: Callable[[int, Sequence[str]], Sequence[str]],
    ) -> tuple[tuple[str, ...], bool]:
        """A first placement that every replica sharing the placement makes alike, without
        talking: a burst of new prompts reaches all of them before their first exchange, and
        each placing it its own way gives a prompt a copy per replica. So it reads only what
        they agree on: the prefix's rendezvous order, the holders in the shared index, and the
        placements exchanged (the first placements made here since are left out). Balancing
        the load is left to the leader's recomputation, which every replica adopts."""
        n = len(backends)
        share = 0.0 if p.share < 0.0 else p.share
        need = self._needed(share, n)
        hrw = order(key, backends)
        rank = {b: i for i, b in enumerate(hrw)}
        chosen = [b for b in sorted(holders, key=rank.__getitem__) if room[b] >= p.size][:need]
        if len(chosen) < need:
            hosted, fresh = self.tallies.hosted, self._fresh
            agreed = {b: hosted.get(b, 0) - fresh.get(b, 0) for b in backends}
            spare = [b for b in hrw if b not in chosen and room[b] >= p.size]
            # The less crowded of the first two; the least crowded when both are over a fair
            # count (as _choose does, by exchanged placements only).
            if len(spare) > 1 and self.choices > 1 and agreed[spare[1]] < agreed[spare[0]]:
                spare[0], spare[1] = spare[1], spare[0]
            fair = sum(agreed.values()) / n
            if spare and agreed[spare[0]] > fair:
                spare.sort(key=lambda b: (agreed[b] > fair, agreed[b], rank[b]))
            chosen += spare[: need - len(chosen)]
        if len(chosen) < need:
            chosen += [b for b in hrw if b not in chosen][: need - len(chosen)]
            return tuple(chosen), True
        return tuple(chosen), False

    def note_load(self, inflight: float) -> None:
        """The fleet's requests in flight at a decision: followed at once when it rises (a
        burst needs its copies now), forgotten slowly when it falls (no copy churn)."""
        follow = self.inflight + 0.01 * (inflight - self.inflight)
        self.inflight = follow if inflight < follow else inflight

    def _needed(self, share: float, backends: int, have: int = 0) -> int:
        """Homes a prefix with this share of the traffic needs: no home above copy_load of a
        fair backend load, and none above `copy_inflight` of its requests in flight (at low
        concurrency a copy spreads no load worth a cold prefill and an eviction).

        A prefix that `have`s homes keeps that many while the need stays within a band of it,
        on either side, and past the band takes the whole need at once. A share is measured,
        not known: over a half-life of 256 requests (proxy.routing.popularity) a prompt with
        1% of the traffic is counted ~7 times, give or take 2.7, so its need wobbles by ~37%
        from one rebalance to the next. The band is the larger of a quarter of a home, a
        tenth of what it has, and two standard errors of the share (`samples`: the share's
        effective sample count, from the popularity attached; at most MAX_WOBBLE of it).
        With the tenth alone, a shrink at any dip, and growth to the need less the band (which
        left the prefix at the band's edge, where the next rise of its share grew it again), a
        prompt on 12 of 1,024 engines gained a home at a third of its requests and lost it at
        the next rebalance: each move a cold prefill, and each gain a placement."""
        by_load = share * self.inflight / self.copy_inflight if self.copy_inflight > 0 else 1e9
        x = share * backends / self.copy_load
        x = by_load if by_load < x else x
        need = math.ceil(x - 1e-9)
        if have > 0 and need != have:
            rel = self._wobble(share)
            if need > have:
                band = have * (GROW_BAND if rel < GROW_BAND else rel)
                if math.ceil(x - (0.25 if band < 0.25 else band) - 1e-9) <= have:
                    need = have
            # (Without share statistics, `samples` 0, a shrink is taken at once, as before.)
            elif self.samples and math.ceil(x + rel * have - 1e-9) >= have:
                need = have
        need = need if 1 < need else 1
        return need if need < backends else backends

    def _wobble(self, share: float) -> float:
        """Two standard errors of a measured share, relative to it (0 without `samples`)."""
        samples = self.samples
        if not samples:
            return 0.0
        if share <= 0.0:
            return MAX_WOBBLE
        rel = 2.0 * math.sqrt((1.0 - share) / (share * samples)) if share < 1.0 else 0.0
        return rel if rel < MAX_WOBBLE else MAX_WOBBLE

    def _forget_coolest(self, share_of: Callable[[int], float]) -> None:
        tallies = self.tallies
        if tallies.shares is None:
            coolest = min(self.placed, key=share_of)
        else:
            coolest = tallies.coolest_key(self.placed)
        gone = self.placed.pop(coolest)
        tallies.uncount(gone)
        if self.dirty.pop(coolest, False) and self.alike:
            fresh = self._fresh
            for h in gone.homes:
                if fresh.get(h, 0) > 0:
                    fresh[h] -= 1

    def snapshot(self, share_of: Callable[[int], float], top: int = 32) -> dict[str, Any]:
        ranked = sorted(self.placed.items(), key=lambda kv: -share_of(kv[0]))[:top]
        copies: dict[str, int] = {}
        for _, p in self.placed.items():
            copies[str(len(p.homes))] = copies.get(str(len(p.homes)), 0) + 1
        return {
            "placed_prefixes": len(self.placed),
            "rebalances": self.rebalances,
            "moves": self.moves,
            "leads": self.leads,
            "adopted": self.adopted,
            "claimed": self.claimed,
            "prefixes_by_copies": copies,
            "hottest": [
                {
                    "prefix": f"{key & 0xFFFFFFFFFFFFFFFF:016x}",
                    "share": round(share_of(key), 4),
                    "size_blocks": round(p.size),
                    "homes": list(p.homes),
                    "overflow": p.overflow,
                    "moves": p.moves,
                }
                for key, p in ranked
            ],
        }


def _weight(weights: Mapping[str, float], backend: str) -> float:
    w = weights.get(backend, 1.0)
    return w if w > 1e-9 else 1e-9
