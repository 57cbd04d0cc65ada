"""deploy/perf/paced_chunks.py runs end to end on a tiny load: the paced mock and a real proxy,
the proxy's CPU read from /proc for each stream length, a per-chunk slope from them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT


@pytest.mark.e2e
@pytest.mark.slow
def test_a_tiny_run_measures_each_stream_length_and_the_slope(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "ITLS": "1",
        "CHUNKS": "2 6",
        "REQUESTS": "6",
        "WARMUP": "2",
        "CONCURRENCY": "2",
        "OUT": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "deploy/perf/paced_chunks.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [pace] = json.loads((tmp_path / "paced_chunks.json").read_text())
    assert pace["itl_ms"] == 1.0 and [r["chunks"] for r in pace["rows"]] == [2, 6]
    for row in pace["rows"]:
        assert row["requests"] == 6 and row["proxy_cpu_s"] >= 0
    assert "cpu per paced chunk" in done.stdout
