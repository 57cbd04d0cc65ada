"""`warmroute bench`: workloads, runner, metrics, results schema, plots and the CLI.

Timing tests run against the mock backend scripted with known timing (timed_server, below),
and compare ratios with generous bounds: the 2-core CI machine is shared and noisy.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from proxy.bench import (
    SCHEMA,
    BenchError,
    RequestResult,
    RunResult,
    Workload,
    format_table,
    parse_slo,
    run_bench,
    summarize,
)
from proxy.bench.client import poisson_arrivals
from proxy.bench.metrics import distribution
from proxy.bench.mock import MockBackend, Reply, Request
from proxy.cli import main as warmroute
from proxy.sim import SimConfig, create_sim_app, engine
from tests.support import ServerThread, stop_servers


def timed_server(
    ttft: float = 0.05,
    itl: float = 0.01,
    tokens: int = 8,
    cached_fraction: float = 0.0,
    model: str = "timed-model",
    fail_every: int = 0,
    cut_every: int = 0,
) -> MockBackend:
    """The mock backend with known timing: a role-only chunk at once (it must not count as the
    first token), then `ttft` seconds of silence, `tokens` content chunks `itl` apart, a finish
    chunk, a usage chunk (cached = `cached_fraction` of the prompt) and [DONE]. Request i of a
    plan (read from the workload's "Request i," tag) gets HTTP 500 when i % fail_every == 1
    and loses its connection after two chunks when i % cut_every == 2."""

    def script(request: Request) -> Reply:
        tags = re.findall(r"Request (\d+),", request.text)  # the last one is this turn's
        index = int(tags[-1]) if tags else -1
        return Reply(
            status=500 if fail_every and index % fail_every == 1 else 200,
            first_token_s=ttft,
            interval_s=itl,
            cut_after=2 if cut_every and index % cut_every == 2 else None,
            cached_fraction=cached_fraction,
        )

    return MockBackend(chunks=tokens, model=model, script=script, record=True)


def bodies(app: MockBackend) -> list[dict[str, Any]]:
    assert app.rec is not None
    return [r["body"] for r in app.rec.requests]


@pytest.fixture
def timed() -> Iterator[Any]:
    """timed(**timed_server kwargs) -> (app, ServerThread) on a free loopback port."""
    started: list[ServerThread] = []

    def start(**kwargs: Any) -> tuple[MockBackend, ServerThread]:
        app = timed_server(**kwargs)
        server = ServerThread(app).start()
        started.append(server)
        return app, server

    yield start
    stop_servers(started)


# --- workloads ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["shared-prefix", "multi-turn", "long-doc", "mixed", "hot-prompt"])
def test_workloads_are_deterministic_for_a_seed(name: str) -> None:
    def render(seed: int) -> list[Any]:
        w = Workload(name, seed=seed)
        return [(s, w.messages(s)) for s in w.plan(40)]

    assert render(7) == render(7)
    assert render(7) != render(8)


def test_shared_prefix_uses_k_distinct_prompts_with_zipf_popularity() -> None:
    w = Workload("shared-prefix", seed=1, num_prefixes=4, system_chars=400, user_chars=80)
    plan = w.plan(400)
    counts = np.bincount([s.system_id for s in plan], minlength=4)
    assert counts[0] > counts[1] > counts[3] > 0  # Zipf: the first prompt is the most popular
    systems = {w.messages(s)[0]["content"] for s in plan}
    assert len(systems) == 4 and all(len(t) == 400 for t in systems)
    users = [w.messages(s)[-1]["content"] for s in plan]
    assert len(set(users)) == len(users) and all(len(u) == 80 for u in users)


def test_hot_prompt_and_long_doc_shapes() -> None:
    hot = Workload("hot-prompt", seed=2)
    assert len({hot.messages(s)[0]["content"] for s in hot.plan(50)}) == 1
    doc = Workload("long-doc", seed=2, doc_chars=3000, doc_max_tokens=5)
    msgs = [doc.messages(s) for s in doc.plan(20)]
    assert all(len(m) == 1 and len(m[0]["content"]) == 3000 for m in msgs)
    # Unique from the first characters: no accidental shared prefix between documents.
    assert len({m[0]["content"][:20] for m in msgs}) == 20
    assert {s.max_tokens for s in doc.plan(20)} == {5}
    mixed = Workload("mixed", seed=2, doc_fraction=0.3).plan(500)
    share = sum(s.kind == "doc" for s in mixed) / 500
    assert 0.2 < share < 0.4


def test_multi_turn_plan_issues_each_turn_after_the_previous_one() -> None:
    plan = Workload("multi-turn", seed=3, turns=3, active_conversations=4).plan(22)
    assert len(plan) == 22
    seen: set[tuple[int, int]] = set()
    for s in plan:
        assert s.conversation is not None
        assert s.turn == 0 or (s.conversation, s.turn - 1) in seen
        seen.add((s.conversation, s.turn))
    assert max(s.conversation for s in plan if s.conversation is not None) == 7


def test_unknown_workload_names_the_choices() -> None:
    with pytest.raises(ValueError, match="shared-prefix"):
        Workload("nope")


# --- pure metrics ------------------------------------------------------------------------


def test_distribution_matches_numpy_linear_percentiles() -> None:
    vals = [0.1, 0.2, 0.3, 0.4, 1.0]
    d = distribution(vals)
    assert d["p50"] == pytest.approx(np.percentile(vals, 50))
    assert d["p99"] == pytest.approx(np.percentile(vals, 99))
    assert d["max"] == 1.0 and d["mean"] == pytest.approx(0.4) and d["n"] == 5
    assert distribution([])["p50"] is None  # no data is not a perfect score


def test_tpot_goodput_and_cache_ratio_follow_vllm_definitions() -> None:
    def req(i: int, ttft: float, e2e: float, out: int, ok: bool = True) -> RequestResult:
        return RequestResult(
            index=i, target="t", kind="chat", ok=ok, ttft=ttft, e2e=e2e,
            completion_tokens=out, prompt_tokens=100, cached_tokens=50 if i % 2 else 0,
            error_kind=None if ok else "http_500",
        )  # fmt: skip

    reqs = [
        req(0, 0.1, 1.1, 11),  # tpot 0.1
        req(1, 0.6, 1.6, 11),  # ttft misses the SLO
        req(2, 0.2, 0.2, 1),  # one token: tpot counts as 0 for goodput, excluded from TPOT
        req(3, 0.1, 0.1, 0, ok=False),
    ]
    assert reqs[0].tpot == pytest.approx(0.1) and reqs[2].tpot is None
    run = RunResult("r", ["t"], {"name": "x"}, "m", "chat", 4, None, 4, "now", duration=2.0)
    run.requests = reqs
    s = summarize(run, parse_slo("ttft=500ms,tpot=0.15"))
    assert s["completed"] == 3 and s["failed"] == 1 and s["errors"] == {"http_500": 1}
    assert s["goodput"]["good_requests"] == 2
    assert s["goodput"]["request_goodput"] == pytest.approx(1.0)
    assert s["tpot_s"]["n"] == 2
    assert s["prefix_cache_hit_ratio"] == pytest.approx(50 / 300)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(23 / 2)


def test_slo_parser_rejects_unknown_keys() -> None:
    assert parse_slo("ttft=0.5,tpot=50ms") == {"ttft": 0.5, "tpot": 0.05}
    with pytest.raises(ValueError, match="ttft"):
        parse_slo("latency=1")


def test_poisson_arrivals_are_seeded_and_scaled_to_the_rate() -> None:
    a = poisson_arrivals(200, 10.0, seed=5)
    assert a == poisson_arrivals(200, 10.0, seed=5) and a != poisson_arrivals(200, 10.0, seed=6)
    assert a[0] == 0.0 and a[-1] == pytest.approx(20.0, rel=0.1)
    assert all(x <= y for x, y in itertools.pairwise(a))


# --- runner against a server with known timing -------------------------------------------


@pytest.mark.e2e
async def test_measured_ttft_itl_tpot_agree_with_server_timing(timed: Any) -> None:
    _, srv = timed(ttft=0.12, itl=0.03, tokens=8, cached_fraction=0.5)
    w = Workload("shared-prefix", seed=0, max_tokens=8, system_chars=400)
    run = await run_bench(
        srv.url, w, requests=12, concurrency=4, rate=None, model=None, progress=False
    )
    s = summarize(run)
    assert s["completed"] == 12 and s["errors"] == {}
    assert run.model == "timed-model"  # discovered from /v1/models
    # The role-only chunk arrives at once; TTFT must wait for the first content chunk.
    assert 0.9 < s["ttft_s"]["p50"] / 0.12 < 2.0
    assert 0.8 < s["itl_s"]["p50"] / 0.03 < 2.0
    assert 0.8 < s["tpot_s"]["p50"] / 0.03 < 2.0
    assert s["itl_s"]["n"] == 12 * 7  # one ITL sample per output chunk after the first
    expected_e2e = 0.12 + 7 * 0.03
    assert 0.9 < s["e2e_s"]["p50"] / expected_e2e < 2.0
    assert s["output_tokens"] == 96 and s["prefix_cache_hit_ratio"] == pytest.approx(0.5, 0.05)
    # Closed loop, 4 in flight, 3 waves of ~0.33 s each.
    assert 0.8 < s["duration_s"] / (3 * expected_e2e) < 2.5
    assert s["client_cpu_util"] is not None


@pytest.mark.e2e
async def test_open_loop_completions_endpoint(timed: Any) -> None:
    app, srv = timed(ttft=0.02, itl=0.005, tokens=4)
    w = Workload("long-doc", seed=1, doc_chars=2000, doc_max_tokens=4)
    run = await run_bench(
        srv.url, w, requests=10, concurrency=None, rate=40.0, model="m",
        progress=False, endpoint="completions",
    )  # fmt: skip
    s = summarize(run)
    assert s["completed"] == 10 and s["rate"] == 40.0
    assert all(
        "prompt" in b and b["stream_options"] == {"include_usage": True} for b in bodies(app)
    )
    assert 0.2 < s["duration_s"] < 2.0  # ~10/40 s of arrivals plus one request


@pytest.mark.e2e
async def test_multi_turn_sends_the_real_replies_in_the_history(timed: Any) -> None:
    app, srv = timed(ttft=0.01, itl=0.002, tokens=3)
    w = Workload("multi-turn", seed=4, turns=3, active_conversations=2, max_tokens=3)
    run = await run_bench(srv.url, w, requests=6, concurrency=4, rate=None, progress=False)
    assert summarize(run)["completed"] == 6
    last_turns = [b for b in bodies(app) if len(b["messages"]) == 1 + 2 * 2 + 1]
    assert len(last_turns) == 2
    for body in last_turns:
        roles = [m["role"] for m in body["messages"]]
        assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
        assert body["messages"][2]["content"] == "tok0 tok1 tok2 "


@pytest.mark.e2e
async def test_errors_are_counted_by_kind_never_dropped(timed: Any) -> None:
    _, srv = timed(ttft=0.01, itl=0.002, tokens=4, fail_every=5, cut_every=5)
    w = Workload("hot-prompt", seed=0, max_tokens=4)
    run = await run_bench(srv.url, w, requests=20, concurrency=4, rate=None, progress=False)
    s = summarize(run)
    assert s["requests_sent"] == 20 and s["completed"] == 12
    assert s["errors"]["http_500"] == 4
    assert sum(s["errors"].values()) == 8  # the 4 cut streams count too, whatever their kind
    failed = [r for r in run.requests if not r.ok]
    assert all(r.error for r in failed) and {r.index % 5 for r in failed} == {1, 2}


@pytest.mark.e2e
async def test_max_duration_cancels_and_counts_what_was_not_sent(timed: Any) -> None:
    _, srv = timed(ttft=0.3, itl=0.01, tokens=2)
    run = await run_bench(
        srv.url, Workload("hot-prompt"), requests=50, concurrency=2, rate=None,
        progress=False, max_duration=0.5,
    )  # fmt: skip
    s = summarize(run)
    assert s["errors"].get("deadline") == 2 and s["not_sent"] > 40
    assert any("max duration" in n for n in run.notes)


async def test_unreachable_and_remote_targets_raise_a_clean_error(closed_port_url: str) -> None:
    with pytest.raises(BenchError, match="cannot reach"):
        await run_bench(closed_port_url, Workload(), requests=1, concurrency=1, progress=False)
    with pytest.raises(BenchError, match="--allow-remote"):
        await run_bench("http://192.0.2.1:8000", Workload(), requests=1, concurrency=1)


# --- CLI, results file, table, plots -----------------------------------------------------

RUN_KEYS = {
    "label", "targets", "workload", "model", "endpoint", "concurrency", "rate",
    "requests_planned", "started_at", "duration", "requests", "not_sent", "client_cpu_s",
    "server_cpu_s",
    "role", "notes", "summary",
}  # fmt: skip
REQUEST_KEYS = {
    "index", "target", "kind", "conversation", "turn", "system_id", "start", "ok", "ttft",
    "e2e", "itl", "output_chunks", "output_chars", "prompt_tokens", "completion_tokens",
    "cached_tokens", "finish_reason", "http_status", "error_kind", "error",
}  # fmt: skip
SUMMARY_KEYS = {
    "label", "role", "targets", "workload", "model", "endpoint", "concurrency", "rate",
    "requests_planned", "requests_sent", "not_sent", "completed", "failed", "errors",
    "duration_s", "request_throughput", "output_throughput", "total_token_throughput",
    "input_tokens", "output_tokens", "cached_tokens", "prefix_cache_hit_ratio", "goodput",
    "ttft_s", "tpot_s", "itl_s", "e2e_s", "output_chunks", "chunk_throughput", "client_cpu_s",
    "client_cpu_util", "server_cpu_s", "server_cpu_ms_per_request", "by_kind",
}  # fmt: skip
DIST_KEYS = {"n", "mean", "p50", "p90", "p99", "max"}


@pytest.mark.e2e
def test_cli_writes_a_stable_results_schema_table_and_plots(
    timed: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, srv = timed(ttft=0.02, itl=0.005, tokens=6, cached_fraction=0.25)
    _, other = timed(ttft=0.04, itl=0.005, tokens=6)
    out, md, plots = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "plots"
    rc = warmroute([
        "bench", "--base-url", srv.url, "--compare", other.url, "--workload", "shared-prefix",
        "--requests", "16", "--concurrency", "4", "--seed", "3", "--slo", "ttft=0.5,tpot=0.05",
        "--out", str(out), "--out-md", str(md), "--plots", str(plots), "--no-progress",
        "--label", "first",
    ])  # fmt: skip
    assert rc == 0
    doc = orjson.loads(out.read_bytes())
    assert doc["schema"] == SCHEMA
    assert set(doc) == {
        "schema", "generated_at", "command", "environment", "slo", "runs", "comparisons",
    }  # fmt: skip
    assert [r["label"] for r in doc["runs"]] == ["first", other.url.split("://")[1]]
    for run in doc["runs"]:
        assert set(run) == RUN_KEYS
        assert set(run["summary"]) == SUMMARY_KEYS
        for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            assert set(run["summary"][key]) == DIST_KEYS
        assert len(run["requests"]) == 16
        assert all(set(r) == REQUEST_KEYS for r in run["requests"])
    assert doc["runs"][0]["summary"]["goodput"]["good_requests"] == 16
    assert doc["runs"][0]["summary"]["prefix_cache_hit_ratio"] == pytest.approx(0.25, abs=0.02)
    table = capsys.readouterr().out
    assert table == md.read_text()
    assert "| metric | first |" in table and "TTFT p99 (ms)" in table
    assert re.search(r"\| prefix cache hit ratio \| 2\d\.\d% \| 0\.0% \|", table)
    for name in ("ttft_cdf.png", "itl_cdf.png"):
        png = (plots / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000


@pytest.mark.e2e
def test_direct_run_reports_the_proxy_added_ttft_and_report_merges_files(
    timed: Any, proxy_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, b1 = timed(ttft=0.03, itl=0.005, tokens=4)
    _, b2 = timed(ttft=0.03, itl=0.005, tokens=4)
    proxy = proxy_server([b1.url, b2.url])
    out = tmp_path / "p.json"
    rc = warmroute([
        "bench", "--base-url", proxy.url, "--direct", b1.url, "--direct", b2.url,
        "--workload", "hot-prompt", "--requests", "12", "--concurrency", "3",
        "--out", str(out), "--no-progress", "--vary-seed",
    ])  # fmt: skip
    assert rc == 0
    doc = orjson.loads(out.read_bytes())
    direct = doc["runs"][1]
    assert [r["workload"]["seed"] for r in doc["runs"]] == [0, 1]  # no inherited warm cache
    assert direct["role"] == "direct" and direct["targets"] == [b1.url, b2.url]
    assert {r["target"] for r in direct["requests"]} == {b1.url, b2.url}  # round-robin
    (cmp,) = doc["comparisons"]
    assert cmp["direct"] == "direct" and cmp["ttft_s"]["p50"] is not None
    assert "Proxy added TTFT" in capsys.readouterr().out

    merged_md = tmp_path / "m.md"
    assert warmroute(["bench", "report", str(out), str(out), "--out-md", str(merged_md)]) == 0
    header = merged_md.read_text().splitlines()[0]
    assert header.count("direct") == 2 and "direct#2" in header  # labels kept apart


@pytest.mark.e2e
def test_interleave_pairs_each_request_across_runs_taking_turns_to_go_first(
    timed: Any, proxy_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, b1 = timed(ttft=0.01, itl=0.002, tokens=3)
    proxy = proxy_server([b1.url])
    out = tmp_path / "p.json"
    rc = warmroute([
        "bench", "--base-url", proxy.url, "--direct", b1.url, "--interleave",
        "--workload", "hot-prompt", "--requests", "8", "--concurrency", "1",
        "--out", str(out), "--no-progress", "--server-pid", str(os.getpid()),
    ])  # fmt: skip
    assert rc == 0
    target, direct = orjson.loads(out.read_bytes())["runs"]
    assert [len(r["requests"]) for r in (target, direct)] == [8, 8]
    assert all(r["ok"] for r in target["requests"] + direct["requests"])
    for t, d in zip(target["requests"], direct["requests"], strict=True):
        assert t["index"] == d["index"]
        # one client, one request at a time: the even ones go to the target first
        assert (t["start"] < d["start"]) == (t["index"] % 2 == 0)
    assert "interleaved" in target["notes"][0]
    assert target["server_cpu_s"] is not None
    assert "Proxy added TTFT" in capsys.readouterr().out
    assert warmroute(["bench", "--base-url", proxy.url, "--direct", b1.url, "--interleave",
                      "--rate", "5", "--no-progress"]) == 2  # fmt: skip
    assert "closed loop" in capsys.readouterr().err


def test_cli_unreachable_target_exits_nonzero_with_a_clean_message(
    closed_port_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = warmroute(["bench", "--base-url", closed_port_url, "--requests", "3",
                    "--concurrency", "1", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2
    assert "cannot reach" in err and "Traceback" not in err


@pytest.mark.e2e
def test_cli_exits_1_when_requests_fail_and_names_the_errors(
    timed: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    _, srv = timed(ttft=0.005, itl=0.001, tokens=2, fail_every=3)
    rc = warmroute(["bench", "--base-url", srv.url, "--workload", "hot-prompt", "--requests",
                    "6", "--concurrency", "2", "--no-progress"])  # fmt: skip
    assert rc == 1
    assert "http_500: 2" in capsys.readouterr().err


@pytest.mark.e2e
def test_cli_takes_defaults_from_the_environment(
    timed: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _, srv = timed(ttft=0.005, itl=0.001, tokens=2)
    monkeypatch.setenv("WARMROUTE_BENCH_BASE_URL", srv.url)
    monkeypatch.setenv("WARMROUTE_BENCH_CONCURRENCY", "2")
    monkeypatch.setenv("WARMROUTE_BENCH_REQUESTS", "4")
    out = tmp_path / "e.json"
    assert warmroute(["bench", "--out", str(out), "--no-progress"]) == 0
    run = orjson.loads(out.read_bytes())["runs"][0]
    assert run["concurrency"] == 2 and len(run["requests"]) == 4


def test_format_table_accepts_runs_and_summaries() -> None:
    run = RunResult("a", ["http://x"], {"name": "hot-prompt"}, "m", "chat", 1, None, 0, "now")
    assert format_table([run]) == format_table([summarize(run)])
    assert "| metric | a |" in format_table([run])


# --- against the simulated engine ----------------------------------------------------------


@pytest.mark.e2e
async def test_measured_ttft_and_itl_agree_with_the_sim_physics() -> None:
    # A10G, 8B bf16: decode ~27 ms/token at the bandwidth ceiling, prefill ~0.2 ms/token.
    cfg = SimConfig.from_preset("a10g", "8b", "bf16", time_scale=1.0)
    app = create_sim_app(cfg)
    w = Workload("hot-prompt", seed=0, system_chars=2400, user_chars=200, max_tokens=6)
    with ServerThread(app, **app.uvicorn_kwargs()) as srv:
        # One at a time, so every request is alone in its batch and the physics is exact.
        run = await run_bench(srv.url, w, requests=5, concurrency=1, rate=None, progress=False)
    s = summarize(run)
    assert s["completed"] == 5, s["errors"]
    ratios_ttft, ratios_itl = [], []
    for r in run.requests:
        assert r.prompt_tokens and r.cached_tokens is not None and r.ttft is not None
        ratios_ttft.append(r.ttft / engine.prefill_seconds(cfg, r.prompt_tokens, r.cached_tokens))
        step = engine.step_duration(cfg, [(1, r.prompt_tokens)])[0]
        ratios_itl += [g / step for g in r.itl]
    assert 0.8 < float(np.median(ratios_ttft)) < 2.0
    assert 0.8 < float(np.median(ratios_itl)) < 1.6
    # The hot system prompt is cached after the first request, and the bench sees it.
    assert run.requests[0].cached_tokens == 0 and run.requests[-1].cached_tokens > 500
    assert s["prefix_cache_hit_ratio"] > 0.5
