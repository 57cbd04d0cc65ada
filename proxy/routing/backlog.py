"""Prefill backlog per backend: prompt tokens sent there that are probably still being prefilled.

A fluid queue, updated only by routing decisions (no hot-path hook): each request adds the
tokens its backend must prefill (prompt minus the predicted cached prefix), and the level
drains at the backend's prefill rate as learned from our own TTFT measurements. It answers
"how long until a new prefill could start here" at decision time, where the engine's own
queue gauge is a scrape old (seconds, an eternity at hundreds of requests per second) and
counts requests, not tokens: one waiting 8k-token prompt is worse than ten short ones.

The level never exceeds what is outstanding: the uncached tokens of the requests sent to the
backend that have neither had their first token (a stream's first byte: prefill is over) nor
finished. A drain rate learned too slow (a replica that never saw a cold
prompt takes the TTFT of cached ones, mostly overhead, for prefill) would otherwise let the
level grow without bound, each cached request adding more than the drain takes away: measured
at 13,000-20,000 phantom tokens on a home with ten requests of ~54 uncached tokens in flight.

Per proxy replica; the scraped gauges carry what the other replicas sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence


class PrefillBacklog:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._level: dict[str, tuple[float, float]] = {}  # backend -> (tokens, as of)
        self._outstanding: dict[str, float] = {}  # backend -> uncached tokens not finished

    def level(self, backend: str, tokens_per_s: float) -> float:
        """Tokens still to prefill on `backend` now, draining at `tokens_per_s`."""
        tokens, at = self._level.get(backend, (0.0, 0.0))
        if tokens <= 0.0:
            return 0.0
        left = _left(tokens, self.clock() - at, tokens_per_s)
        most = self._outstanding.get(backend, 0.0)
        left = most if most < left else left
        return 0.0 if left < 0.0 else left

    def levels(
        self, position: Mapping[str, int], tokens_per_s: Sequence[float | None], default: float
    ) -> list[float]:
        """level() for the backends `position` numbers (name -> index into the result and into
        `tokens_per_s`, each one's drain rate, `default` where None). Reads the backends with
        a backlog only: one that has drained is dropped (level() reads a missing one as 0.0)."""
        out = [0.0] * len(tokens_per_s)
        level = self._level
        if not level:
            return out
        now = self.clock()
        outstanding = self._outstanding
        for b, (tokens, at) in list(level.items()):
            i = position.get(b)
            if i is None:
                continue  # not routable now: kept for when it is
            left = _left(tokens, now - at, tokens_per_s[i] or default)
            if left > 0.0:
                most = outstanding.get(b, 0.0)
                out[i] = most if most < left else left
            else:
                del level[b]
        return out

    def backlogged(self) -> Collection[str]:
        """The backends that may have a backlog now (each one drains with time: a reader of
        levels reads these again; one that drained leaves at the next levels())."""
        return self._level.keys()

    def add(self, backend: str, tokens: float, tokens_per_s: float) -> None:
        """`backend` was just handed a prompt with `tokens` uncached tokens."""
        now = self.clock()
        added = 0.0 if tokens < 0.0 else tokens
        self._outstanding[backend] = self._outstanding.get(backend, 0.0) + added
        self._level[backend] = (self.level(backend, tokens_per_s) + added, now)

    def finished(self, backend: str, tokens: float) -> None:
        """A request that add() counted `tokens` for on `backend` has had its first token, or
        finished (answered, failed or moved elsewhere): nothing of it is being prefilled
        there any more."""
        left = self._outstanding.get(backend, 0.0) - (0.0 if tokens < 0.0 else tokens)
        if left > 0.5:
            self._outstanding[backend] = left
        else:
            self._outstanding.pop(backend, None)

    def forget(self, backend: str) -> None:
        """`backend` left the fleet: nothing is queued there any more."""
        self._level.pop(backend, None)
        self._outstanding.pop(backend, None)

    def snapshot(self, rate_of: Callable[[str], float]) -> dict[str, int]:
        """Every backend's level now, for /admin/routing."""
        return {b: round(self.level(b, rate_of(b))) for b in sorted(self._level)}


def _left(tokens: float, elapsed_s: float, tokens_per_s: float) -> float:
    """What is left of `tokens` after draining `elapsed_s` at `tokens_per_s` (may be < 0).
    (max(x, 0.0) written out: read per request, and each max() call in CPython 3.11 parses
    its arguments, ~1,200 instructions.)"""
    return tokens - elapsed_s * (0.0 if tokens_per_s < 0.0 else tokens_per_s)
