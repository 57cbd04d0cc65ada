"""The one percentile every part of warmroute reports (pure; no imports of the proxy).

Linear interpolation between the two nearest ranks: numpy's default (`np.percentile(...,
method="linear")`, Hyndman and Fan's type 7), which `vllm bench serve` uses and
docs/benchmarks.md's numbers were computed with. docs/measurement.md ("Percentiles") says so
for readers.
"""

from __future__ import annotations

from collections.abc import Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile (q in [0, 1]) of values sorted ascending, linearly interpolated.

    Position q * (n - 1) counted from 0: q=0 is the minimum, q=1 the maximum, and the median of
    an even count is the mean of the middle two.
    """
    n = len(sorted_values)
    if n == 0:
        raise ValueError("percentile of no values: check for an empty series first")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    pos = q * (n - 1)
    lo = int(pos)
    if lo + 1 >= n:
        return float(sorted_values[-1])
    low = sorted_values[lo]
    return float(low + (sorted_values[lo + 1] - low) * (pos - lo))
