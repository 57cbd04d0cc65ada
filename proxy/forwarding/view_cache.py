"""Every routable backend's view, read per request in time that follows what changed.

A view shows a backend's health (its breaker's say included), in-flight count, scraped load,
models, learned prefill rate, backlog and configuration. Views are read-only snapshots, so one
that still holds is handed out again, and only a backend whose state moved is read again.
Which ones moved, each source says as it changes them (proxy.routing.types.Changes): the
registry's backends (health, load, models, configuration; a breaker's ejection; a join, a
departure or a change of state, which reads the fleet whole), the in-flight board (this
replica's requests, the peers' counts at each sync) and the prefill learner. Two things move
with time alone and are read at every request while they last: a backlog draining, and a
breaker that is not closed (its ejection ends, a probe goes out).

In front of 256 engines making every view afresh was the largest cost of a request; comparing
every backend's state with the last read's, which came next, cost ~80 us at 256 and ~310 us
at 1,024 engines. Once a second (`verify_s`) the whole fleet is read and compared anyway:
a change that no source marked is counted (`missed`), logged, and served from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any

from proxy.routing.learn import DEFAULT_PREFILL_TOKENS_PER_S
from proxy.routing.types import Changes
from proxy.routing.views import ViewKeeper
from proxy.upstream.outlier import CLOSED

if TYPE_CHECKING:
    from proxy.routing.inflight import InflightBoard
    from proxy.routing.learn import PrefillLearner
    from proxy.routing.router import Router
    from proxy.routing.types import BackendView
    from proxy.upstream.backends import Backend

log = logging.getLogger("warmroute.routing")

_NAME = attrgetter("name")
_HEALTHY = attrgetter("healthy")
_BREAKER = attrgetter("breaker")
_BREAKER_STATE = attrgetter("breaker.state")
_LOAD = attrgetter("load")
_MODELS = attrgetter("models")
_CFG = attrgetter("cfg")
_RATE = itemgetter(0)
_MEAN = itemgetter(1)

VERIFY_S = 1.0  # the whole fleet read and compared at least this often


class ViewCache:
    """The views of `read`'s backends, made again only where something they show changed. The
    read is a `Views` whose fleet-wide facts (the in-flight total, the stable facts' epoch, ...)
    a ViewKeeper updates for the views made again only."""

    __slots__ = (
        "_keeper",
        "_keys",
        "_names",
        "_position",
        "_unsettled",
        "_verified_at",
        "_views",
        "made",
        "missed",
        "verify_s",
    )

    def __init__(self) -> None:
        self._names: list[str] = []
        self._position: dict[str, int] = {}
        self._keys: list[tuple[Any, ...] | None] = []
        self._views: list[Any] = []
        self._keeper = ViewKeeper()
        self._unsettled: set[str] = set()  # breaker not closed at the last read: read again
        self._verified_at = float("-inf")
        self.verify_s = VERIFY_S
        self.made = 0  # views made (the rest were reused)
        self.missed = 0  # changes found by the whole read that no source had marked

    def read(
        self,
        backends: list[Backend],
        now: float,
        board: InflightBoard,
        learner: PrefillLearner,
        router: Router,
        changes: Changes | None = None,
    ) -> list[BackendView]:
        """The views of `backends` (the registry's routable ones, in its order). `changes`:
        the registry's record of changed backends; without it every read is whole."""
        marked = self._marked(backends, board, learner, router, changes)
        if marked is None or now - self._verified_at >= self.verify_s:
            remade = self._whole(backends, now, board, learner, router)
            self._verified_at = now
            if marked is not None and remade is not None:
                self._check(remade, marked)
            return self._keeper.read(self._views, None if marked is None else remade)
        position = self._position
        at = sorted(position[b] for b in marked if b in position)
        remade = self._some(backends, at, now, board, learner, router)
        return self._keeper.read(self._views, remade)

    def _marked(
        self,
        backends: list[Backend],
        board: InflightBoard,
        learner: PrefillLearner,
        router: Router,
        changes: Changes | None,
    ) -> set[str] | None:
        """The backends to read again (None: the whole fleet): those their sources marked,
        and those whose backlog or breaker moves with time."""
        fleet = None if changes is None else changes.take()
        counted = board.changes.take()
        learned, learner.changed = learner.changed, set()
        if fleet is None or counted is None or len(backends) != len(self._names):
            return None
        fleet |= counted
        fleet |= learned
        fleet |= self._unsettled
        fleet.update(router.backlog.backlogged())
        return fleet

    def _check(self, remade: Collection[int], marked: Collection[str]) -> None:
        names = self._names
        missed = [names[i] for i in remade if names[i] not in marked]
        if missed:
            if not self.missed:
                log.warning(
                    "view cache: %d backend view(s) changed unmarked (%s); the whole-fleet "
                    "read each %.1fs caught them",
                    len(missed),
                    ", ".join(missed[:5]),
                    self.verify_s,
                )
            self.missed += len(missed)

    def _whole(
        self,
        backends: list[Backend],
        now: float,
        board: InflightBoard,
        learner: PrefillLearner,
        router: Router,
    ) -> list[int] | None:
        """Read every backend; returns the positions whose view was made again (None: the
        fleet is another one, every view new)."""
        n = len(backends)
        names = list(map(_NAME, backends))
        other = names != self._names
        if other:
            self._names, self._position = names, dict(zip(names, range(n), strict=True))
            self._keys, self._views = [None] * n, [None] * n
        remade = self._reread(backends, list(range(n)), names, now, board, learner, router, True)
        return None if other else remade

    def _some(
        self,
        backends: list[Backend],
        at: list[int],
        now: float,
        board: InflightBoard,
        learner: PrefillLearner,
        router: Router,
    ) -> list[int]:
        """Read the backends at positions `at` only."""
        if not at:
            return []
        if len(at) == 1:  # the usual read: the last request's backend, its count moved
            return self._one(backends[at[0]], at[0], now, board, learner, router)
        names = [self._names[i] for i in at]
        subset = [backends[i] for i in at]
        return self._reread(subset, at, names, now, board, learner, router, False)

    def _reread(
        self,
        backends: Sequence[Backend],
        at: list[int],
        names: list[str],
        now: float,
        board: InflightBoard,
        learner: PrefillLearner,
        router: Router,
        whole: bool,
    ) -> list[int]:
        """Read `backends` (at fleet positions `at`, named `names`) in C-level passes, make
        again the views whose state changed, and note which move with time."""
        up, unsettled = _up(backends, now)
        inflight = board.counts(names)
        fits = learner.fits(names)
        rates, means = list(map(_RATE, fits)), list(map(_MEAN, fits))
        numbered = dict(zip(names, range(len(names)), strict=True)) if not whole else None
        backlogs = router.backlog.levels(
            numbered or self._position, rates, DEFAULT_PREFILL_TOKENS_PER_S
        )
        loads, models, cfgs = map(_LOAD, backends), map(_MODELS, backends), map(_CFG, backends)
        keys = zip(up, inflight, loads, models, rates, means, backlogs, cfgs, strict=True)
        kept, views = self._keys, self._views
        remade: list[int] = []
        for j, key in enumerate(keys):
            i = at[j]
            if key != kept[i]:
                kept[i] = key
                views[i] = backends[j].view(
                    now, inflight[j], rates[j], means[j], backlogs[j], up=up[j]
                )
                remade.append(i)
        self.made += len(remade)
        if whole:
            self._unsettled = {names[j] for j in unsettled}
        else:
            self._unsettled.difference_update(names)
            self._unsettled.update(names[j] for j in unsettled)
        return remade

    def _one(
        self,
        backend: Backend,
        i: int,
        now: float,
        board: InflightBoard,
        learner: PrefillLearner,
        router: Router,
    ) -> list[int]:
        """_reread for the one backend at position `i`, without the passes' lists (what it
        reads, and how, is _reread's and _up's for a fleet of one)."""
        name = self._names[i]
        up = backend.healthy
        breaker = backend.breaker
        settled = breaker is None or breaker.state == CLOSED
        if not settled and up and breaker is not None:
            up = breaker.allows(now)
        inflight = board.get(name)
        rate, mean = learner.fits((name,))[0]
        backlog = router.backlog.levels({name: 0}, (rate,), DEFAULT_PREFILL_TOKENS_PER_S)[0]
        key = (up, inflight, backend.load, backend.models, rate, mean, backlog, backend.cfg)
        if settled:
            self._unsettled.discard(name)
        else:
            self._unsettled.add(name)
        if key == self._keys[i]:
            return []
        self._keys[i] = key
        self._views[i] = backend.view(now, inflight, rate, mean, backlog, up=up)
        self.made += 1
        return [i]


def _up(backends: Sequence[Backend], now: float) -> tuple[list[bool], list[int]]:
    """Backend.is_up(now) for each of `backends` (all serving: the registry's routable ones),
    and which of them have a breaker that is not closed. A breaker is asked only where it is
    not closed (asking may move it to half-open)."""
    up = list(map(_HEALTHY, backends))
    n = len(backends)
    try:
        states = list(map(_BREAKER_STATE, backends))
    except AttributeError:  # a backend with no breaker (the registry gives each one)
        breakers = map(_BREAKER, backends)
        states = list(map(getattr, breakers, repeat("state", n), repeat(CLOSED, n)))
    if states.count(CLOSED) == n:
        return up, []
    unsettled = [i for i in range(n) if states[i] != CLOSED]
    for i in unsettled:
        breaker = backends[i].breaker
        if up[i] and breaker is not None:
            up[i] = breaker.allows(now)
    return up, unsettled
