"""`warmroute bench --direct-affinity system`: the static-affinity bound, system prompt i on
backend i mod N, measured on the bench mock's caching engines over loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.bench import BenchError, Workload, run_bench, summarize
from proxy.bench.mock import EngineSettings, MockBackend, MockEngine
from proxy.cli import main as warmroute
from tests.support import ServerThread, stop_servers

pytestmark = pytest.mark.e2e


@pytest.fixture
def engines() -> Iterator[Callable[..., list[str]]]:
    """engines(n, cache_tokens) -> base URLs of n bench-mock engines on free loopback ports."""
    started: list[ServerThread] = []

    def start(n: int, cache_tokens: int = 100_000) -> list[str]:
        for _ in range(n):
            settings = EngineSettings(cache_tokens=cache_tokens, prefill_tokens_per_s=1e6)
            started.append(ServerThread(MockBackend(MockEngine(settings), chunks=2)).start())
        return [s.url for s in started[-n:]]

    yield start
    stop_servers(started)


async def test_system_affinity_sends_system_prompt_i_to_target_i_mod_n(engines: Any) -> None:
    urls = engines(3)
    w = Workload("shared-prefix", seed=1, num_prefixes=5, zipf_s=0.0, system_chars=300)
    run = await run_bench(urls, w, requests=30, concurrency=4, affinity="system")
    assert summarize(run)["completed"] == 30
    assert {r.system_id for r in run.requests} == set(range(5))
    assert all(r.target == urls[r.system_id % 3] for r in run.requests if r.system_id is not None)
    assert any("static affinity" in n for n in run.notes)


async def test_round_robin_stays_the_default_and_requests_without_a_system_prompt_use_it(
    engines: Any,
) -> None:
    urls = engines(2)
    w = Workload("mixed", seed=2, num_prefixes=3, doc_fraction=0.5, doc_chars=300)
    default = await run_bench(urls, w, requests=20, concurrency=2)
    assert [r.target for r in default.requests] == [urls[r.index % 2] for r in default.requests]
    system = await run_bench(urls, w, requests=20, concurrency=2, affinity="system")
    docs = [r for r in system.requests if r.system_id is None]
    assert docs and all(r.target == urls[r.index % 2] for r in docs)
    with pytest.raises(BenchError, match="round-robin, system"):
        await run_bench(urls, w, requests=1, concurrency=1, affinity="sticky")


def test_cli_direct_affinity_system_beats_round_robin_on_engines_that_cannot_hold_every_prompt(
    engines: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Six ~700-token prompts over three engines that cache ~1500 tokens each: with static
    # affinity every engine holds its two prompts; round robin makes each one cycle through all
    # six, so an LRU never has the next one. One request at a time keeps the order fixed.
    urls = engines(3, cache_tokens=1500)
    args = [
        "bench", "--workload", "shared-prefix", "--prefixes", "6", "--zipf", "0",
        "--system-chars", "2000", "--user-chars", "60", "--requests", "36",
        "--concurrency", "1", "--no-progress",
    ]  # fmt: skip
    for url in urls:
        args += ["--direct", url]
    system_out, rr_out = tmp_path / "system.json", tmp_path / "rr.json"
    assert warmroute([*args, "--direct-affinity", "system", "--out", str(system_out)]) == 0
    assert "static affinity" in capsys.readouterr().err
    assert warmroute([*args, "--seed", "1", "--out", str(rr_out)]) == 0
    (system,) = orjson.loads(system_out.read_bytes())["runs"]
    (rr,) = orjson.loads(rr_out.read_bytes())["runs"]
    assert system["label"] == "direct-system" and system["role"] == "direct"
    assert rr["label"] == "direct" and system["targets"] == rr["targets"] == urls
    assert all(r["target"] == urls[r["system_id"] % 3] for r in system["requests"])
    # Only the first request of each prompt misses with static affinity.
    assert sum(r["cached_tokens"] == 0 for r in system["requests"]) == 6
    assert system["summary"]["prefix_cache_hit_ratio"] > 0.75
    assert rr["summary"]["prefix_cache_hit_ratio"] < system["summary"]["prefix_cache_hit_ratio"]


def test_cli_direct_affinity_comes_from_the_environment(
    engines: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    urls = engines(2)
    monkeypatch.setenv("WARMROUTE_BENCH_DIRECT", ",".join(urls))
    monkeypatch.setenv("WARMROUTE_BENCH_DIRECT_AFFINITY", "system")
    out = tmp_path / "env.json"
    rc = warmroute(["bench", "--requests", "8", "--concurrency", "2", "--no-progress",
                    "--prefixes", "4", "--label", "bound", "--out", str(out)])  # fmt: skip
    assert rc == 0
    (run,) = orjson.loads(out.read_bytes())["runs"]
    assert run["label"] == "bound"  # with no --base-url, --label names the direct run
    assert all(r["target"] == urls[r["system_id"] % 2] for r in run["requests"])
