"""deploy/perf/ttft_path.py runs: every step of a request's path to its first byte is timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT, load_script

ttft_path = load_script("deploy/perf/ttft_path.py", "warmroute_ttft_path")


def test_it_times_each_step_in_the_order_a_request_passes_them(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "deploy/perf/ttft_path.py", "--requests", "20", "--warmup", "5",
         "--json", str(tmp_path / "samples.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "no " not in out.stderr, out.stderr  # every step found by its name
    samples = json.loads((tmp_path / "samples.json").read_text())
    assert len(samples) == 20
    labels = [row.split()[0] for row in out.stdout.splitlines()[1:]]
    assert labels[0] == "read" and labels[-1] == "first"  # ("first byte out")
    steps = [s[0] for s in ttft_path.STEPS]
    for sample in samples:
        # each request passed every step, in the path's order, after its first bytes
        seen = [k for k in sample if k in steps]
        assert seen == steps, seen
        times = [sample[k] for k in ["read", *steps, "first byte out"]]
        assert times == sorted(times) and times[0] == 0.0


def test_the_table_orders_steps_by_their_median_and_gives_each_its_own_share() -> None:
    rows = ttft_path.table([{"read": 0.0, "b": 5.0, "a": 2.0}, {"read": 0.0, "b": 7.0, "a": 4.0}])
    assert rows == [("read", 0.0, 0.0), ("a", 3.0, 3.0), ("b", 6.0, 3.0)]
