"""How much of the recent traffic each prompt head carries (pure).

A prefix that carries more than one backend's share of the traffic needs copies on several
backends; one that carries less is best kept on one, where its copy does not evict others
from a full KV pool. The picker asks for the share of the prompt it is placing.

Counts decay per request, not per second (a half-life of `half_life` requests), so the share
means the same at 5 and at 500 requests/s. At most `max_keys` heads are tracked; the least
recently seen go first.

Every count decays by the same factor per request, so a head's share is its `weight` (its
count, decayed to a fixed tick `base`) times one `scale()` common to all heads: the placement
keeps sums of weights per backend up to date from the `listener` (told of each head whose
weight changed) instead of asking every placed head for its share on every request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

# Requests between moves of the weights' base tick: weights of heads seen since the base grow
# by 2x per half-life, so the base follows the tick before they could leave a float's range.
REBASE_EVERY = 1 << 14


class PrefixPopularity:
    def __init__(self, half_life: float = 256.0, max_keys: int = 4096, warmup: int = 16) -> None:
        self.decay = 0.5 ** (1.0 / half_life)
        # Requests a share is effectively measured over (Kish's effective sample size of the
        # decayed weights, (1 + d) / (1 - d): ~739 for a half-life of 256): a share s is
        # known to about sqrt(s (1 - s) / samples).
        self.samples = (1.0 + self.decay) / (1.0 - self.decay)
        self.warmup = warmup  # requests seen before a share means anything
        self.max_keys = max_keys
        self.tick = 0
        self.total = 0.0
        self._counts: OrderedDict[int, tuple[float, int]] = OrderedDict()
        self.base = 0  # the tick weights are decayed to
        self.rebase_every = REBASE_EVERY
        self.listener: Callable[[int], None] | None = None  # told of each weight that changed

    def _value(self, key: int) -> float:
        entry = self._counts.get(key)
        if entry is None:
            return 0.0
        value, at = entry
        return value * self.decay ** (self.tick - at)

    def observe(self, key: int) -> None:
        self.tick += 1
        self.total = self.total * self.decay + 1.0
        self._counts[key] = (self._value(key) + 1.0, self.tick)
        self._counts.move_to_end(key)
        if self.tick - self.base >= self.rebase_every:
            self.base = self.tick  # every weight changes: a listener compares `base`
        listener = self.listener
        if listener is not None:
            listener(key)
        while len(self._counts) > self.max_keys:
            gone, _ = self._counts.popitem(last=False)
            if listener is not None:
                listener(gone)

    def seen(self, key: int) -> bool:
        """Whether `key` was observed among the heads still tracked."""
        return key in self._counts

    def weight(self, key: int) -> float:
        """The head's decayed count at the tick `base`: its share is weight x scale()."""
        entry = self._counts.get(key)
        if entry is None:
            return 0.0
        value, at = entry
        return value * self.decay ** (self.base - at)

    def scale(self) -> float:
        """What turns every head's weight into its current() share now."""
        return self.decay ** (self.tick - self.base) / (self.total + float(self.warmup))

    def current(self, key: int) -> float:
        """The share without the warm-up rule (placement needs a value from the first request)."""
        # Shrunk toward zero by `warmup` requests' worth of prior: after 16 requests a prompt
        # seen 4 times is 1/8 of the traffic, not 1/4 (a count that small is mostly noise).
        return self._value(key) / (self.total + float(self.warmup))

    def share(self, key: int) -> float:
        """Fraction of recent requests (decayed) that started with this head, 0..1; 0 while
        fewer than `warmup` requests were seen (the first few would all look hot)."""
        if self.tick < self.warmup or self.total <= 0:
            return 0.0
        return self._value(key) / self.total
