"""deploy/perf/route_request.py runs: routing's per-request CPU in the proxy's own terms."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT


def test_it_times_both_prompt_kinds_on_the_app_as_serve_builds_it() -> None:
    out = subprocess.run(
        [sys.executable, "deploy/perf/route_request.py", "--requests", "520", "--backends", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    lines = out.strip().splitlines()
    assert [line.split()[2] for line in lines] == ["600", "200"]
    for line in lines:
        assert "3 backends" in line
        assert float(line.split("backends")[1].split()[0]) > 0
