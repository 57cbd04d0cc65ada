"""proxy.stats.percentile: the definition every report uses (linear interpolation)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.stats import percentile


def test_linear_interpolation_between_the_two_nearest_ranks() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 0.0) == 1.0 and percentile(values, 1.0) == 4.0
    assert percentile(values, 0.5) == 2.5  # the mean of the middle two, not a rank
    assert percentile(values, 0.9) == pytest.approx(3.7)  # 0.9 * 3 = 2.7: 3 + 0.7 * (4 - 3)
    assert percentile([5.0], 0.99) == 5.0


def test_no_values_and_a_q_outside_0_1_are_errors_not_numbers() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        percentile([1.0], 99)  # a percent passed where a fraction is meant


@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=200),
    st.floats(0.0, 1.0),
)
def test_it_is_numpys_default_percentile(values: list[float], q: float) -> None:
    ordered = sorted(values)
    expected = float(np.percentile(ordered, q * 100))
    assert percentile(ordered, q) == pytest.approx(expected, rel=1e-9, abs=1e-6)
