"""A finished request's samples are a plain tuple in RowFields' order: each must reach the
histogram point POINT_OF names for it, and no other."""

from __future__ import annotations

import pytest

from proxy.routing.types import Decision
from proxy.telemetry.metrics import RequestMetrics
from proxy.telemetry.series import POINT_OF, RowFields
from proxy.types import StreamFacts


def test_each_sample_of_a_request_reaches_its_own_histogram() -> None:
    m = RequestMetrics()
    facts = StreamFacts(
        ttft_s=0.5, upstream_ttft_s=0.3, itl_s=[], tpot_s=0.02, e2e_s=1.0, chunks=3, events=4,
        output_tokens=7, input_tokens=1000, cached_tokens=250, finish_reasons=["stop"],
        response_id="r", response_model="m", error=None, cancelled=False,
        first_output_at=None, last_output_at=None,
    )  # fmt: skip
    # 8 blocks of 64 chars matched on a 1,024-char prompt: a predicted hit of 0.5
    decision = Decision("p", ["b"], "x", matched_blocks={"b": 8}, prompt_chars=1024)
    m.record("chat", "m", facts, None, "b", "127.0.0.1", 9, 1.25, None, decision, None)
    m.fold()
    [series] = m._series.values()
    expected = {
        "duration": 1.25,
        "ttfc": 0.5,
        "overhead": 0.2,  # client TTFT - upstream TTFT
        "ttft": 0.5,
        "tpot": 0.02,
        "tokens_in": 1000,
        "tokens_out": 7,
        "cached": 250,
        "hit_actual": 0.25,
        "hit_predicted": 0.5,
    }
    assert set(expected) == set(RowFields._fields[2:])
    for name, point in POINT_OF.items():
        p = series.point(point)
        assert (p.count, p.total) == (1, pytest.approx(expected[name])), name
