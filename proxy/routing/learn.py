"""Online prefill-rate estimates per backend, learned from our own TTFT measurements (pure).

Model: ttft ≈ overhead + uncached_tokens / rate. An exponentially weighted least-squares fit of
ttft against uncached tokens gives the slope (1/rate) and the intercept (overhead: network,
scheduling, first decode step). Queueing inflates single samples far above the line, so once
the fit is warm a sample is clipped to a few times its prediction before it is used (a cheap
Huber-style guard). When the prompts seen so far are all about the same size, the slope is
not identifiable: the slope last identified is kept and only the overhead follows the samples.
Before any slope was identified, the estimate is tokens over time through the origin, but no
slower than DEFAULT_PREFILL_TOKENS_PER_S, the rest counted as overhead.

Why keep the slope: behind a prefix-cache router most requests find their prompt cached, so
their uncached tokens are all about the same (the user's turn, tens of tokens) and their TTFT is
overhead and queueing. Through the origin those samples said a 20,000 tokens/s engine prefills
~900-2,000 tokens/s (a replica that never sent it a cold prompt: docs/routing.md), and what
reads the rate (the prefill backlog, predicted TTFTs, the spill test) took each cached request
for ~0.1 s of serial prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Prompt tokens/s assumed for a backend the learner has not measured yet.
DEFAULT_PREFILL_TOKENS_PER_S = 5000.0


@dataclass(slots=True)
class PrefillRate:
    """Weighted least-squares state for one backend."""

    half_life: float = 64.0  # samples after which a sample's weight has halved
    min_samples: int = 4
    clip: float = 3.0  # a warm sample may count at most clip * its prediction (+ 50 ms)
    min_rate: float = 50.0  # tokens/s bounds keep one odd sample from breaking routing
    # the slowest rate assumed before prompts of varied sizes identified one
    prior_rate: float = DEFAULT_PREFILL_TOKENS_PER_S
    max_rate: float = 1e7
    n: int = 0
    sw: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0
    tokens_ewma: float = 0.0  # mean uncached tokens per request (for queue-wait estimates)
    # seconds per token as last identified (prompt sizes varied), kept while they do not
    identified: float | None = None
    # The last fit, until the next sample: routing reads the rate several times per request.
    _fit_cache: tuple[float, float] | None = None
    _fit_valid: bool = False

    def observe(self, uncached_tokens: float, ttft_s: float, queue_s: float = 0.0) -> None:
        """Add one sample; `queue_s` (time known to be spent queued) is taken off the TTFT."""
        # max()/min() of two values written out on the per-request paths here: each call
        # parses its arguments in CPython 3.11 (~1,200 instructions).
        x = float(uncached_tokens)
        x = 0.0 if x < 0.0 else x
        y = float(ttft_s) - (0.0 if queue_s < 0.0 else queue_s)
        y = 0.0 if y < 0.0 else y
        if self.n >= self.min_samples:
            predicted = self.predict(x)
            if predicted is not None:
                cap = self.clip * predicted + 0.05
                y = cap if cap < y else y
        decay = 0.5 ** (1.0 / self.half_life)
        self.sw = self.sw * decay + 1.0
        self.sx = self.sx * decay + x
        self.sy = self.sy * decay + y
        self.sxx = self.sxx * decay + x * x
        self.sxy = self.sxy * decay + x * y
        self.syy = self.syy * decay + y * y
        self.n += 1
        self._fit_valid = False
        alpha = 1.0 - decay
        self.tokens_ewma = x if self.n == 1 else (1 - alpha) * self.tokens_ewma + alpha * x

    def _fit(self) -> tuple[float, float] | None:
        """(seconds per token, overhead seconds), or None before enough samples."""
        if not self._fit_valid:
            self._fit_cache = self._solve()
            self._fit_valid = True
        return self._fit_cache

    def _solve(self) -> tuple[float, float] | None:
        if self.n < self.min_samples or self.sx <= 0:
            return None
        mx, my = self.sx / self.sw, self.sy / self.sw
        var = self.sxx / self.sw - mx * mx
        cov = self.sxy / self.sw - mx * my
        # Identifiable only when prompt sizes vary (relative spread above 25%).
        lo, hi = 1.0 / self.max_rate, 1.0 / self.min_rate
        fitted = cov / var if var > (0.25 * mx) ** 2 and cov > 0 else 0.0
        if fitted and self._significant(fitted, var, my):
            slope = lo if fitted < lo else (hi if hi < fitted else fitted)
            self.identified = slope
        elif self.identified is not None:
            slope = self.identified  # sizes alike now: the overhead alone follows them
        else:
            # Never identified: through the origin where that is faster than the prior (large
            # prompts alike), else the prior with the rest as overhead (small ones: the TTFT
            # of a cached prompt says nothing of the rate).
            slope = my / mx
            slope = lo if slope < lo else slope
            prior = 1.0 / self.prior_rate
            slope = prior if prior < slope else slope
        intercept = my - slope * mx
        return slope, (0.0 if intercept < 0.0 else intercept)

    def _significant(self, slope: float, var: float, my: float) -> bool:
        """Is the fitted slope at least three times its standard error? Cached requests differ
        in size by their users' turns alone, and their TTFTs by queueing: a slope fitted to
        those is mostly noise, and the one identified before is the better guess. (Tested at
        every read: twice its error would pass by chance every few hundred reads.)"""
        explained = slope * slope * var  # (cov² / var)
        resid = self.syy / self.sw - my * my - explained
        return explained * self.sw > 9.0 * (resid if resid > 0.0 else 0.0)

    @property
    def rate(self) -> float | None:
        """Prefill speed in tokens/s, or None while unknown."""
        fit = self._fit()
        return None if fit is None else 1.0 / fit[0]

    @property
    def overhead_s(self) -> float:
        fit = self._fit()
        return 0.0 if fit is None else fit[1]

    def predict(self, uncached_tokens: float) -> float | None:
        """Predicted TTFT in seconds for a prompt with this many uncached tokens."""
        fit = self._fit()
        if fit is None:
            return None
        return fit[1] + (0.0 if uncached_tokens < 0.0 else uncached_tokens) * fit[0]


@dataclass
class PrefillLearner:
    """One PrefillRate per backend; feed it every finished request's (uncached tokens, TTFT)."""

    half_life: float = 64.0
    min_samples: int = 4
    rates: dict[str, PrefillRate] = field(default_factory=dict)

    # backend -> (rate, mean_prefill_s) as of its last observation (read per request for the
    # whole fleet; a fit changes only when a request on that backend finishes)
    _known: dict[str, tuple[float | None, float | None]] = field(
        default_factory=dict, init=False, repr=False
    )
    # Whose fit moved since the ViewCache last took them (it swaps the set for an empty one).
    changed: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def observe(
        self, backend: str, uncached_tokens: float, ttft_s: float, queue_s: float = 0.0
    ) -> None:
        est = self.rates.get(backend)
        if est is None:
            est = self.rates[backend] = PrefillRate(self.half_life, self.min_samples)
        est.observe(uncached_tokens, ttft_s, queue_s)
        self._known.pop(backend, None)
        self.changed.add(backend)

    def fits(self, backends: Sequence[str]) -> list[tuple[float | None, float | None]]:
        """(rate(b), mean_prefill_s(b)) for each of `backends`, each computed once per
        observation."""
        known = self._known
        found = list(map(known.get, backends))
        if None in found:
            for i, b in enumerate(backends):
                if found[i] is None:
                    found[i] = known[b] = (self.rate(b), self.mean_prefill_s(b))
        return found  # type: ignore[return-value]  # (no None left)

    def rate(self, backend: str) -> float | None:
        est = self.rates.get(backend)
        return None if est is None else est.rate

    def mean_prefill_s(self, backend: str) -> float | None:
        """Typical prefill time of one request on `backend` (to turn a queue into seconds)."""
        est = self.rates.get(backend)
        if est is None:
            return None
        return est.predict(est.tokens_ewma)

    def forget(self, backend: str) -> None:
        """`backend` left the fleet: its fit goes. (A restarted engine keeps it: the same
        hardware prefills at the same speed, whatever its cache lost.)"""
        self.rates.pop(backend, None)
        self._known.pop(backend, None)
        self.changed.add(backend)

    def snapshot(self) -> dict[str, dict[str, float | bool | None]]:
        return {
            b: {
                "tokens_per_s": e.rate,
                "overhead_s": e.overhead_s,
                "samples": float(e.n),
                # the rate from prompts of varied sizes (else tokens over time)
                "identified": e.identified is not None,
            }
            for b, e in self.rates.items()
        }
