"""deploy/perf/noisy_neighbour.py runs, end to end, for a short while: the quiet tenant is
never refused beside the flood, and every refusal of the flood says when to come back."""

from __future__ import annotations

import pytest

from tests.support import ROOT, load_script

NN = load_script("deploy/perf/noisy_neighbour.py", "warmroute_noisy_neighbour")


def test_the_summary_counts_statuses_and_percentiles() -> None:
    rows = [
        {"status": 200, "ttft_s": 0.1, "retry_after": None},
        {"status": 200, "ttft_s": 0.3, "retry_after": None},
        {"status": 429, "ttft_s": None, "retry_after": "5"},
        {"status": "ReadTimeout", "ttft_s": None, "retry_after": None},
    ]
    found = NN.summary(rows)
    assert found["statuses"] == {"200": 2, "429": 1, "ReadTimeout": 1}
    assert (found["refused"], found["refused_with_retry_after"]) == (1, 1)
    assert found["ttft_p50_ms"] == pytest.approx(300) and found["requests"] == 4


@pytest.mark.e2e
@pytest.mark.slow
def test_a_short_run_refuses_none_of_the_quiet_tenant() -> None:
    row = NN.run(seed=1, duration=2.0, proxy_dir=ROOT)
    quiet, flood = row["quiet"], row["flood"]
    assert quiet["requests"] > 0 and quiet["refused"] == 0
    assert set(quiet["statuses"]) == {"200"} and row["alone"]["statuses"].keys() == {"200"}
    assert flood["refused"] > 0  # 4x the capacity for 2 s: more than the slots and queue hold
    assert flood["refused_with_retry_after"] == flood["refused"]
    assert set(flood["statuses"]) <= {"200", "429", "503"}
