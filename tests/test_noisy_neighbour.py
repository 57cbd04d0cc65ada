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


@pytest.mark.parametrize(
    ("argv", "flags"),
    [
        ([], []),
        (["--engine-priority"], ["--priority-scheduling", "--prefill-chunk-tokens", "2048"]),
        (["--engine-priority", "--engine-chunk-tokens", "0"], ["--priority-scheduling"]),
        (
            ["--engine-preempt", "--engine-chunk-tokens", "512"],
            ["--priority-scheduling", "--prefill-chunk-tokens", "512", "--preempt-prefill"],
        ),
    ],
)
def test_engine_priority_is_vllms_order_and_chunked_prefill(
    argv: list[str], flags: list[str]
) -> None:
    engines = NN.engines_from(NN.build_parser().parse_args(argv))
    assert engines.flags() == flags


def test_preemption_needs_steps() -> None:
    args = NN.build_parser().parse_args(["--engine-preempt", "--engine-chunk-tokens", "0"])
    with pytest.raises(ValueError, match="> 0 with --engine-preempt"):
        NN.engines_from(args)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_short_run_refuses_none_of_the_quiet_tenant() -> None:
    row = NN.run(seed=1, duration=2.0, proxy_dir=ROOT, reserve=2)
    quiet, flood = row["quiet"], row["flood"]
    assert quiet["requests"] > 0 and quiet["refused"] == 0
    assert set(quiet["statuses"]) == {"200"} and row["alone"]["statuses"].keys() == {"200"}
    assert flood["refused"] > 0  # 4x the capacity for 2 s: more than the slots and queue hold
    assert flood["refused_with_retry_after"] == flood["refused"]
    assert set(flood["statuses"]) <= {"200", "429", "503"}


@pytest.mark.e2e
@pytest.mark.slow
def test_the_goodput_mode_runs_with_and_without_a_target() -> None:
    # 1 s at 1.5x the capacity: ~28 requests a run, all this checks (the script's --duration
    # runs it for longer, where goodput with and without the target is worth comparing)
    row = NN.run_goodput(seed=1, duration=1.0, proxy_dir=ROOT, target_s=0.5)
    for label in ("no target", "target"):
        found = row[label]
        assert found["requests"] > 0 and set(found["statuses"]) <= {"200", "503"}
        assert 0 <= found["met"] <= found["statuses"].get("200", 0)


BR = load_script("deploy/perf/budget_replicas.py", "warmroute_budget_replicas")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.redis
def test_replicas_sharing_a_budget_refuse_the_excess_with_retry_after() -> None:
    args = BR.argparse.Namespace(
        replicas=2, tpm=20_000, seconds=4.0, measure_from=0.0, redis="redis://127.0.0.1:6379/0"
    )
    row = BR.run(args, seed=1)
    assert set(row["statuses"]) <= {"200", "429"} and row["statuses"]["200"] > 0
    # (4 s at four times the limit's rate stay within the first minute's burst; refusals
    # come past ~20 s: docs/tenants.md has the measured runs)
    assert row["refusals_with_retry_after"] == row["statuses"].get("429", 0)
    assert row["admitted_tokens_per_minute"] > 0
