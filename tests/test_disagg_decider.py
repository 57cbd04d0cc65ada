"""The disaggregation decider on windows: when it splits, when it does not, and that it does
not flap. Hand-made windows pin each threshold; recorded ones come from the simulated fleet."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.bench.workloads import make_workload
from proxy.config import DisaggConfig
from proxy.disagg.decider import Decider
from proxy.disagg.pools import BackendState
from proxy.disagg.replay import replay
from proxy.disagg.window import Window, WindowStats
from proxy.harness.virtual import run_virtual
from proxy.sim.config import SimConfig

CFG = DisaggConfig(mode="auto", min_dwell_s=120, hysteresis=0.25)


def backends(n: int, down: int = 0) -> tuple[BackendState, ...]:
    return tuple(BackendState(f"10.0.0.{i}:8000", healthy=i >= down) for i in range(n))


def window(now: float = 100.0, **kw: Any) -> WindowStats:
    """Steady, heavy, mixed traffic on six engines with strong interference; override a field."""
    base: dict[str, Any] = {
        "now": now,
        "span_s": 60.0,
        "requests": 1_200,
        "rate_per_s": 20.0,
        "rate_cv": 0.2,
        "prefill_tokens_per_s": 24_000.0,
        "decode_tokens_per_s": 6_000.0,
        "long_prefills": 180,
        "long_share": 0.15,
        "uncached_p50": 60.0,
        "uncached_p90": 8_000.0,
        "streams": 1_000,
        "overlapped": 450,
        "itl_inflation": 12.0,
        "itl_inflation_baseline": 1.1,
        "prefill_rate_per_engine": 27_000.0,
        "mean_streams": 40.0,
        "backends": backends(6),
    }
    base.update(kw)
    return WindowStats(**base)


def test_turns_on_for_steady_heavy_mixed_traffic_on_enough_backends() -> None:
    d = Decider(CFG)
    decision = d.update(window())
    assert decision.active and decision.changed
    assert decision.split is not None
    assert len(decision.split.prefill) == 2 and len(decision.split.decode) == 4
    assert decision.reason.startswith("on: 6 healthy backends, steady 20.0 req/s")
    assert "p99 ITL 12.0x their p50 (others 1.1x)" in decision.reason


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"backends": backends(1)}, "1 healthy backend are too few"),
        ({"backends": backends(2)}, "2 healthy backends are too few"),
        ({"backends": backends(6, down=3)}, "3 healthy backends are too few"),
        ({"requests": 40, "rate_per_s": 0.7}, "only 40 requests"),
        ({"rate_per_s": 0.5}, "traffic is light (0.50 req/s"),
        ({"rate_cv": 1.8}, "traffic is bursty (arrival CV 1.80"),
        ({"rate_cv": None}, "traffic is bursty (arrival CV unknown"),
        ({"long_share": 0.01}, "too few long prompts"),
        ({"long_share": 0.99}, "almost every request is a long prompt"),
        ({"overlapped": 30}, "few streams ran beside a long prefill (3%"),
        ({"itl_inflation": 1.5}, "not slowed enough (p99/p50 ITL 1.4x"),
        ({"prefill_tokens_per_s": 200_000.0}, "prefill demand needs 9.3 engines"),
        ({"mean_streams": 1_500.0}, "decoding streams need 5.9 engines"),
    ],
)
def test_stays_off_without_capacity_steady_traffic_a_mix_or_interference(
    change: dict[str, Any], why: str
) -> None:
    decision = Decider(CFG).update(window(**change))
    assert not decision.active and not decision.changed
    assert decision.reason.startswith("off: ") and why in decision.reason, decision.reason


def test_modes_off_and_on_ignore_the_traffic() -> None:
    off = Decider(CFG.model_copy(update={"mode": "off"})).update(window())
    assert not off.active and "disagg.mode: off" in off.reason
    on = Decider(CFG.model_copy(update={"mode": "on"}))
    d = on.update(window(backends=backends(2), rate_per_s=0.1, overlapped=0))
    assert d.active and d.split is not None and len(d.split.prefill) == 1
    assert on.update(window(backends=backends(1))).reason.startswith(
        "on by configuration, but 1 healthy backend"
    )


def test_while_on_it_stays_on_inside_the_hysteresis_band_then_turns_off_below_it() -> None:
    d = Decider(CFG)
    assert d.update(window(now=100)).active
    # The split removed the interference; the traffic dips 20% below the on threshold.
    calm = {"overlapped": 0, "itl_inflation": None, "rate_per_s": 0.8}
    kept = d.update(window(now=300, **calm))
    assert kept.active and not kept.changed
    gone = d.update(window(now=310, **{**calm, "rate_per_s": 0.7}))
    assert not gone.active and gone.changed
    assert gone.reason.startswith("switched off: traffic is light (0.70 req/s, need 0.75)")


def test_min_dwell_holds_both_switches() -> None:
    d = Decider(CFG)
    assert d.update(window(now=100)).active
    held = d.update(window(now=150, rate_per_s=0.2))
    assert held.active and held.reason.startswith("on (dwell): traffic is light")
    assert not d.update(window(now=221, rate_per_s=0.2)).active  # 121 s after switching on
    again = d.update(window(now=260))
    assert not again.active and again.reason.startswith("off (dwell)")
    assert d.update(window(now=342)).active
    assert [s["active"] for s in d.state()["switches"]] == [True, False, True]


def test_lost_capacity_switches_off_at_once_even_within_the_dwell() -> None:
    d = Decider(CFG)
    assert d.update(window(now=100)).active
    decision = d.update(window(now=105, backends=backends(6, down=3)))
    assert not decision.active and decision.changed
    assert decision.reason == (
        "switched off: 3 healthy backends are too few to split (disagg.min_backends is 4)"
    )


def test_traffic_wobbling_around_the_thresholds_does_not_flap() -> None:
    d = Decider(CFG)
    switches = 0
    for step in range(200):  # 1,000 s of evaluations every 5 s
        wobble = 1 if step % 2 else -1
        stats = window(
            now=100 + 5 * step,
            rate_per_s=1.0 + 0.1 * wobble,  # around min_rate_per_s
            rate_cv=0.5 - 0.05 * wobble,  # around max_rate_cv
            long_share=0.05 + 0.01 * wobble,  # around min_long_share
            overlapped=0 if d.active else 450,
        )
        switches += d.update(stats).changed
    assert switches == 1 and d.active  # on at the first window that passed, then held


def test_state_reports_mode_pools_inputs_and_reason() -> None:
    d = Decider(CFG)
    assert d.state()["active"] is False and d.state()["inputs"] is None
    d.update(window())
    state = d.state()
    assert state["mode"] == "auto" and state["active"] is True
    assert state["pools"]["prefill"] == state["candidate_pools"]["prefill"]
    assert len(state["pools"]["decode"]) == 4
    assert state["inputs"]["interference"] == pytest.approx(12.0 / 1.1, abs=1e-3)
    assert state["inputs"]["healthy_backends"] == 6
    assert state["reason"] == d.reason and state["switches"][0]["reason"] == d.reason
    assert state["thresholds"]["min_dwell_s"] == 120


# --- recorded windows: the simulated fleet's own traffic, replayed ---------------------------


def recorded(engines: int, concurrency: int, requests: int) -> tuple[Decider, list[Any]]:
    sim = SimConfig.from_preset("h100")
    run, fleet = asyncio.run(
        run_virtual(
            make_workload("chat-docs"),
            policy="prefix_aware",
            sim=sim,
            engines=engines,
            requests=requests,
            concurrency=concurrency,
        )
    )
    d = Decider(CFG.model_copy(update={"window_s": 10.0, "min_requests": 60}))
    states = [BackendState(n) for n in fleet.names]
    evaluations = replay(run.requests, Window(10.0, CFG.threshold_tokens), d, states, 2.0)
    return d, evaluations


def test_recorded_heavy_mixed_traffic_on_six_engines_switches_on() -> None:
    d, evaluations = recorded(engines=6, concurrency=48, requests=400)
    assert any(e.decision.changed and e.decision.active for e in evaluations)
    inputs = d.state()["switches"][0]["inputs"]
    assert inputs["interference"] > 5  # a chunked 8k-token prefill: ~70 ms steps vs ~5 ms
    assert inputs["overlap_share"] > 0.3


def test_recorded_traffic_on_two_engines_or_light_stays_off() -> None:
    d, evaluations = recorded(engines=2, concurrency=48, requests=300)
    assert not any(e.decision.active for e in evaluations)
    assert "2 healthy backends are too few" in d.reason
    d, evaluations = recorded(engines=6, concurrency=2, requests=150)
    assert not any(e.decision.active for e in evaluations)
    assert "requests in the window (need 60)" in d.reason, d.reason
