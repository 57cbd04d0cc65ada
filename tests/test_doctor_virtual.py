"""The doctor on simulated fleets in virtual time: each pathology built into the engines'
physics, and the exact finding that names it.

The real router routes, the simulator's scheduler core serves (continuous batching, chunked
prefill, the block pool and its prefix cache), and proxy/doctor/virtual.py records each
finished request and the scraped gauges as the proxy's telemetry hook would. Virtual time is
exact, so a fleet behaves the same on every run and the evidence can be held to the physics
(docs/physics.md). Each run is judged on its steady state, after the first quarter of its
requests: a closed-loop run starts with every client at once, a burst no fleet sees twice.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.bench.workloads import make_workload
from proxy.doctor import diagnose
from proxy.doctor.hardware import declared
from proxy.doctor.model import Hardware, Report
from proxy.doctor.virtual import VirtualRecorder
from proxy.harness.virtual import run_virtual
from proxy.sim.config import SimConfig
from proxy.sim.engine import prefill_seconds

SEED = 7


def fleet(
    workload: str,
    sim: SimConfig,
    *,
    engines: int = 1,
    requests: int = 200,
    concurrency: int = 8,
    hardware: Hardware | None = None,
    **sizes: Any,
) -> Report:
    """Run `workload` on `engines` simulated engines and diagnose its steady state."""
    wl = make_workload(workload, seed=SEED, **sizes)
    recorder = VirtualRecorder(hardware=hardware, policy="prefix_aware")
    run, _ = asyncio.run(
        run_virtual(
            wl,
            policy="prefix_aware",
            sim=sim,
            engines=engines,
            requests=requests,
            concurrency=concurrency,
            on_finish=recorder.finished,
        )
    )
    assert all(r.ok for r in run.requests)
    starts = sorted(r.start for r in run.requests)
    return diagnose(recorder.windows(since=starts[len(starts) // 4]))


def finding(report: Report, expected: str) -> dict[str, Any]:
    """The report's findings are exactly `expected` on every backend; the first, as JSON."""
    assert [f.id for f in report.findings] == [expected] * len(report.backends), [
        (f.id, f.backend) for f in report.findings
    ]
    return report.findings[0].as_dict()


def sim(device: str = "h100", params: str = "8b", **knobs: Any) -> SimConfig:
    return SimConfig.from_preset(device, params, seed=SEED, **knobs)


CHAT = {"num_prefixes": 4, "system_chars": 4000, "max_tokens": 64}  # ~1,000-token prompts


def test_a_healthy_fleet_gets_no_finding() -> None:
    report = fleet(
        "shared-prefix", sim(kv_blocks=4000), engines=2, hardware=declared("h100", "8b"), **CHAT
    )
    assert report.findings == [] and report.as_dict()["healthy"] is True
    assert [b.requests > 50 for b in report.backends] == [True, True]
    # judged, not skipped: the split, the cache and the ceiling were all measured
    m = report.backends[0].measurements
    assert m["split_source"] == "engine histograms" and m["reported_hit_ratio"] > 0.8
    assert m["decode_efficiency"] == pytest.approx(1.0, abs=0.1)  # the sim runs at the roofline


def test_a_tiny_kv_pool_is_kv_pressure() -> None:
    # 300 blocks = 4,800 tokens for 32 clients with ~1,000-token prompts: they cannot all fit.
    tiny = sim(kv_blocks=300)
    report = fleet("shared-prefix", tiny, concurrency=32, **{**CHAT, "max_tokens": 128})
    f = finding(report, "kv_pressure")
    e = f["evidence"]
    assert e["kv_pool_tokens"] == tiny.kv_pool_tokens == 4800
    assert e["kv_usage_max"] >= 0.95 and e["full_while_waiting"] >= 0.5
    assert e["queue_share_of_ttft"] >= 0.5 and e["waiting_mean"] >= 1
    assert e["preemptions"] > 0  # a full pool also evicts running sequences


def test_prefix_caching_off_is_prefill_bound_ttft() -> None:
    # Four ~4,000-token system prompts, repeated, on an engine that keeps nothing.
    off = sim("l40s", kv_blocks=4000, enable_prefix_caching=False)
    report = fleet(
        "shared-prefix",
        off,
        requests=100,
        concurrency=4,
        num_prefixes=4,
        system_chars=16000,
        max_tokens=32,
    )
    f = finding(report, "prefill_bound_ttft")
    e = f["evidence"]
    assert e["engine_caches_nothing"] is True and e["reported_hit_ratio"] == 0.0
    assert e["prefill_share_of_ttft"] >= 0.8 and f["severity"] == "critical"
    assert e["repeated_share_of_prefill"] >= 0.1
    # the prefill rate measured is the device's: a lone prompt's chunks at the roofline
    prompt = e["uncached_tokens_mean"]
    alone = prompt / prefill_seconds(off, int(prompt))
    assert e["prefill_tokens_per_s"] == pytest.approx(alone, rel=0.15)
    assert "enable prefix caching" in f["change"]


def test_long_documents_among_chat_streams_are_prefill_interference() -> None:
    # chat-docs: chat streams with long answers beside ~8,000-token documents (15%).
    l40s = sim("l40s", kv_blocks=6000)
    report = fleet("chat-docs", l40s, concurrency=16, num_prefixes=4, system_chars=2000)
    f = finding(report, "prefill_interference")
    e = f["evidence"]
    assert e["long_prefill_tokens_mean"] == pytest.approx(8000, rel=0.1)
    assert e["itl_p99_over_p50"] >= 4 and e["clean_itl_p99_s"] < 2 * e["itl_p50_s"]
    # a shared step carries a whole chunk of the budget: 2,048 prefill tokens at the device's
    # rate, on top of the decode step
    chunk_s = prefill_seconds(l40s, l40s.max_num_batched_tokens)
    assert e["alongside_itl_p99_s"] == pytest.approx(chunk_s, rel=0.25)
    assert e["advised_chunk_tokens"] % 64 == 0
    assert e["advised_chunk_tokens"] < l40s.max_num_batched_tokens / 2


def test_a_slow_device_declared_as_such_is_decode_at_ceiling() -> None:
    # cpu-ddr5 (90 GB/s) under an 8B bf16 model: 5.6 tokens/s at best, slower than reading.
    cpu = sim("cpu-ddr5", kv_blocks=2000)
    report = fleet(
        "shared-prefix",
        cpu,
        requests=30,
        concurrency=2,
        hardware=declared("cpu-ddr5", "8b"),
        num_prefixes=1,
        system_chars=40,
        user_chars=40,
        max_tokens=32,
    )
    f = finding(report, "decode_at_ceiling")
    e = f["evidence"]
    assert e["single_stream_ceiling_tok_s"] == pytest.approx(cpu.decode_ceiling_tok_s)  # 5.625
    assert e["efficiency"] == pytest.approx(1.0, abs=0.1)
    assert e["decode_tok_s"] < e["target_tok_s"] == 10
    assert "quantize" in f["change"]


def test_an_engine_far_below_its_declared_ceiling_is_decode_below_ceiling() -> None:
    # The same H100 and model, but the engine reaches only 30% of the memory bandwidth.
    report = fleet(
        "shared-prefix",
        sim(kv_blocks=4000, bandwidth_efficiency=0.3),
        hardware=declared("h100", "8b"),
        **CHAT,
    )
    f = finding(report, "decode_below_ceiling")
    assert f["evidence"]["efficiency"] == pytest.approx(0.3, abs=0.05)
    assert f["evidence"]["hardware"] == "h100/8b/bf16"


def test_a_batch_too_small_for_the_load_is_queueing() -> None:
    # --max-num-seqs 2 with 16 clients: requests wait with the KV pool nearly empty.
    report = fleet(
        "shared-prefix", sim("l40s", kv_blocks=4000, max_num_seqs=2), concurrency=16, **CHAT
    )
    f = finding(report, "queueing")
    e = f["evidence"]
    assert e["queue_share_of_ttft"] >= 0.8 and e["split_source"] == "engine histograms"
    assert e["running_mean"] <= 2 and e["waiting_mean"] > 5
    assert e["full_while_waiting"] == 0.0


def test_long_conversations_are_long_context_itl() -> None:
    # 32 conversations over ~8,000-token system prompts: ~270k KV tokens read every step.
    h100 = sim(kv_blocks=40000, min_output_tokens=16, max_output_tokens=96)
    report = fleet(
        "multi-turn",
        h100,
        concurrency=32,
        num_prefixes=4,
        system_chars=32000,
        turns=6,
        max_tokens=128,
        user_chars=100,
        active_conversations=32,
    )
    f = finding(report, "long_context_itl")
    e = f["evidence"]
    assert e["source"] == "measured" and e["context_tokens_p90"] > 100_000
    # The roofline: a step reads the weights once and the KV of every token in flight. The
    # proxy sees only the decoding streams' contexts (not those of prompts still in prefill),
    # so its line through ITL against context is a little flatter than the engine's: the
    # measured share sits just under the roofline's, never above it.
    kv = h100.kv_bytes_per_token * e["context_tokens_p90"]
    roofline = kv / (h100.weight_bytes + kv)
    assert roofline - 0.2 < e["kv_share_of_step"] <= roofline
    per_1k = h100.kv_bytes_per_token / h100.bandwidth * 1000
    assert e["itl_per_1k_context_tokens_s"] == pytest.approx(per_1k, rel=0.3)
    weights_s = h100.weight_bytes / h100.bandwidth + h100.step_overhead_s
    assert weights_s <= e["itl_at_no_context_s"] < 1.6 * weights_s
