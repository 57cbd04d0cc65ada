"""deploy/perf/added_ttft.py runs end to end on a tiny load: the mock, a real proxy in front of
it, requests through it interleaved with the same requests straight to the mock, and the TTFT
the proxy adds read from the bench's comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT, load_script

added_ttft = load_script("deploy/perf/added_ttft.py", "warmroute_added_ttft")


@pytest.mark.e2e
@pytest.mark.slow
def test_a_tiny_run_compares_each_proxy_with_direct_requests_at_each_pace(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "ITLS": "0 1",
        "CHUNKS": "3",
        "PAIRS": "6",
        "ROUNDS": "2",
        "WARMUP": "3",
        "OUT": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "deploy/perf/added_ttft.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "added_ttft.json").read_text())
    assert [(r["itl_ms"], r["round"], r["proxy"]) for r in rows] == [
        (0.0, 0, "warmroute"), (0.0, 1, "warmroute"), (1.0, 0, "warmroute"), (1.0, 1, "warmroute")
    ]  # fmt: skip
    for row in rows:
        assert row["pairs"] == 6 and row["proxy_p50_ms"] > 0 and row["direct_p50_ms"] > 0
    assert done.stdout.count("added TTFT p50") == 4


def test_the_added_ttft_is_the_proxys_comparison_with_the_direct_requests() -> None:
    doc = {
        "runs": [
            {"summary": {"ttft_s": {"p50": 0.0012}}},
            {"summary": {"ttft_s": {"p50": 0.0007}}},
        ],
        "comparisons": [{"ttft_s": {"p50": 0.0005, "p99": 0.0011}}],
    }
    assert added_ttft.added(doc) == {
        "added_p50_ms": 0.5, "added_p99_ms": 1.1, "proxy_p50_ms": 1.2, "direct_p50_ms": 0.7
    }  # fmt: skip
