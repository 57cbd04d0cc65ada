"""deploy/perf/opcodes.py: the bytecodes a request runs, counted per function and per file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT, load_script

opcodes = load_script("deploy/perf/opcodes.py", "warmroute_opcodes")


def test_functions_are_summed_by_their_file() -> None:
    counts = {"proxy/a.py:10:f": 3, "proxy/a.py:20:g": 4, "uvicorn/x.py:1:<module>": 1}
    assert opcodes.per_file(counts) == {"proxy/a.py": 7, "uvicorn/x.py": 1}


@pytest.mark.e2e
@pytest.mark.slow
def test_a_tiny_run_counts_the_request_path_of_the_proxy(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "deploy/perf/opcodes.py", "--requests", "5", "--warmup", "5",
         "--concurrency", "2", "--itl-ms", "1", "--json", str(tmp_path / "counts.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    per = json.loads((tmp_path / "counts.json").read_text())
    files = opcodes.per_file(per)
    # the request's own path, interpreted: the endpoint, routing and the relay
    for path in (
        "proxy/forwarding/forward.py",
        "proxy/routing/router.py",
        "proxy/forwarding/relay.py",
    ):
        assert files.get(path, 0) > 10, sorted(files)
    assert "bytecodes per request (5 requests at c=2, ITL 1 ms)" in done.stdout
