"""The fleet-wide facts a decision reads, kept current as views change (pure, no I/O).

A router in front of 1,024 engines used to read them afresh for every request: each filter's
pass over every view (health, models, role), the fleet's names and weights, the in-flight
counts, their sum and least (the load bound) and the longest engine queue (the shortlist's
guard). Between two requests only a few views change (the winner's in-flight count, a request
that ended, a scrape), and the proxy's ViewCache knows which. `ViewKeeper.read` takes the
fleet's views and the positions that changed since the last read and hands back a `Views`
(proxy.routing.types) with those facts updated for the changed views only; what derives from
the stable facts alone (names, weights, roles, models, health, bounds) is kept for as long as
none of them changes (an `Epoch`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from proxy.routing.types import BackendView, Epoch, Views


def _stable(b: BackendView) -> tuple[object, ...]:
    """What a view says that starts a new epoch when it changes."""
    return (b.name, b.weight, b.role, b.models, b.healthy, b.max_inflight)


def _waiting(b: BackendView) -> float:
    waiting = b.load.waiting
    return 0.0 if waiting is None else float(waiting)


def _add(counts: dict[Any, int], value: Any, by: int) -> None:
    """Count `value` `by` more (or fewer) times; a count at zero goes."""
    left = counts.get(value, 0) + by
    if left:
        counts[value] = left
    else:
        del counts[value]


class ViewKeeper:
    """Reads a fleet's views into `Views`, in time proportional to the views that changed.

    `read(views, changed)`: `views` is the whole fleet now, in fleet order; `changed` the
    positions whose view was replaced since the last read (None: any may have been, and
    everything is read again, as when the fleet's membership changes)."""

    __slots__ = ("_counts", "_epoch", "_inflight", "_total", "_views", "_waiting", "epochs")

    def __init__(self) -> None:
        self._views: list[BackendView] = []
        self._epoch = Epoch()
        self._inflight: list[int] = []
        self._total = 0
        self._counts: dict[int, int] = {}
        self._waiting: dict[float, int] = {}
        self.epochs = 0  # epochs started (every other read kept the last one)

    def read(self, views: Sequence[BackendView], changed: Iterable[int] | None = None) -> Views:
        if changed is None or len(views) != len(self._views):
            self._reset(views)
        else:
            self._update(views, changed)
        out = Views(views)
        out.epoch = self._epoch
        out.inflight = self._inflight.copy()
        out.inflight_total = self._total
        counts = self._counts
        out.inflight_counts = counts.copy()
        out.inflight_least = min(counts) if counts else 0
        out.waiting_most = max(self._waiting) if self._waiting else 0.0
        return out

    def _reset(self, views: Sequence[BackendView]) -> None:
        old = self._views
        if len(old) != len(views) or list(map(_stable, old)) != list(map(_stable, views)):
            self._new_epoch()
        self._views = list(views)
        self._inflight = [b.inflight for b in views]
        self._total = sum(self._inflight)
        self._counts = {}
        for i in self._inflight:
            _add(self._counts, i, 1)
        self._waiting = {}
        for b in views:
            _add(self._waiting, _waiting(b), 1)

    def _update(self, views: Sequence[BackendView], changed: Iterable[int]) -> None:
        kept, inflight = self._views, self._inflight
        counts, waiting = self._counts, self._waiting
        stable = True
        for i in changed:
            old, new = kept[i], views[i]
            if old is new:
                continue
            kept[i] = new
            if stable and _stable(old) != _stable(new):
                stable = False
            before, after = old.inflight, new.inflight
            if before != after:
                inflight[i] = after
                self._total += after - before
                _add(counts, before, -1)
                _add(counts, after, 1)
            before_w, after_w = _waiting(old), _waiting(new)
            if before_w != after_w:
                _add(waiting, before_w, -1)
                _add(waiting, after_w, 1)
        if not stable:
            self._new_epoch()

    def _new_epoch(self) -> None:
        self._epoch = Epoch()
        self.epochs += 1
