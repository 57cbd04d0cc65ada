"""The decider in the loop on the virtual fleet: chat-docs traffic with and without `auto`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.bench.results import RunResult
from proxy.bench.workloads import make_workload
from proxy.config import DisaggConfig, DisaggMode
from proxy.disagg.controller import DisaggController
from proxy.harness.disagg import run_virtual_disagg
from proxy.sim.config import SimConfig


def run(mode: DisaggMode, engines: int, requests: int) -> tuple[RunResult, DisaggController]:
    result, _, ctl = asyncio.run(
        run_virtual_disagg(
            make_workload("chat-docs"),
            sim=SimConfig.from_preset("h100"),
            cfg=DisaggConfig(mode=mode),
            engines=engines,
            requests=requests,
            concurrency=48,
        )
    )
    return result, ctl


def chat_itl_p99(run: RunResult, after: float = 0.0) -> float:
    gaps = sorted(g for r in run.requests if r.kind == "chat" and r.start > after for g in r.itl)
    return gaps[int(0.99 * len(gaps))]


def output_per_s(run: RunResult) -> float:
    return sum(r.output_tokens for r in run.requests if r.ok) / run.duration


@pytest.mark.slow
def test_auto_splits_six_engines_and_chat_itl_tail_recovers_at_the_same_throughput() -> None:
    mixed, _ = run("off", 6, 700)
    split, ctl = run("auto", 6, 700)
    switches: list[dict[str, Any]] = ctl.decider.switches
    assert [s["active"] for s in switches] == [True]
    on_at = switches[0]["at"]
    assert chat_itl_p99(split, after=on_at) * 2 <= chat_itl_p99(mixed)
    assert output_per_s(split) >= 0.9 * output_per_s(mixed)
    assert all(r.ok for r in split.requests)


def test_auto_stays_off_on_two_engines_and_changes_nothing() -> None:
    mixed, _ = run("off", 2, 250)
    same, ctl = run("auto", 2, 250)
    assert not ctl.decider.switches and "2 healthy backends" in ctl.decider.reason
    assert [r.target for r in same.requests] == [r.target for r in mixed.requests]
    assert same.duration == pytest.approx(mixed.duration)
