"""`warmroute demo` end to end, small: it runs, prints the table, and leaves no process behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import orjson
import pytest

pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_demo_compares_policies_and_cleans_up(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxy",
            "demo",
            "--policies",
            "round_robin,least_inflight",
            "--engines",
            "2",
            "--requests",
            "24",
            "--concurrency",
            "4",
            "--prefixes",
            "3",
            "--system-chars",
            "2000",
            "--max-tokens",
            "8",
            "--time-scale",
            "5",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    header = next(line for line in lines if line.startswith("policy"))
    assert "TTFT p50" in header and "ITL p99" in header and "cache hit" in header
    rows = {line.split()[0]: line for line in lines if line.startswith(("round_robin", "least_"))}
    assert set(rows) == {"round_robin", "least_inflight"}
    assert all("24/24" in row for row in rows.values())
    doc = orjson.loads((out / "results.json").read_bytes())
    assert [run["label"] for run in doc["runs"]] == ["round_robin", "least_inflight"]
    assert (out / "ttft_cdf.png").stat().st_size > 5000
    # it ends with the doctor's report, read from the last proxy's admin port
    doctor = r.stdout.split("The doctor on what just ran")[-1]
    assert "warmroute doctor: the least_inflight run, last 300 s; 2 backend(s)" in doctor
    assert "TTFT" in doctor and "Where to look next" not in doctor
    # Every proxy it started is gone: nothing listens on their ports any more.
    ports = [int(f.stem.split("-")[1]) for f in (out / "logs").glob("proxy-*.log")]
    assert ports
    for port in ports:
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            pass


def test_virtual_demo_runs_the_multi_turn_benchmark_without_processes(tmp_path):
    out = tmp_path / "virtual"
    args = "--virtual --workload multi-turn --policies round_robin,prefix_aware --engines 2 "
    args += "--requests 60 --concurrency 6 --prefixes 4 --system-chars 4000 "
    args += f"--system-chars-min 1000 --turns 3 --max-tokens 8 --kv-blocks 400 --out {out}"
    r = subprocess.run(
        [sys.executable, "-m", "proxy", "demo", *args.split()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines() if "60/60" in ln}
    assert set(rows) == {"round_robin", "prefix_aware"}
    assert "virtual time" in r.stdout and "oracle" in r.stdout
    assert "mean in-flight per engine" in r.stderr
    # it ends with the doctor's report on the last policy's run, in the same virtual time
    doctor = r.stdout.split("The doctor on what just ran")[-1]
    assert "warmroute doctor: the prefix_aware run; 2 backend(s)" in doctor
    assert "l40s/8b/bf16" in doctor and "Where to look next" not in doctor
    assert not (out / "logs").exists()  # no child process was started
    doc = orjson.loads((out / "results.json").read_bytes())
    turns = {req["turn"] for run in doc["runs"] for req in run["requests"]}
    assert turns == {0, 1, 2}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("--engines 0", "--engines: must be at least 1"),
        ("--device nosuch", "invalid choice: 'nosuch'"),  # argparse lists the presets
        (
            "--kv-blocks 1 --device l40s --system-chars 9000 --system-chars-min 9500",
            "system_chars_min",
        ),
        ("--workload nope", "invalid choice: 'nope'"),
    ],
)
def test_demo_rejects_bad_arguments_before_starting_anything(tmp_path, args, message):
    r = subprocess.run(
        [sys.executable, "-m", "proxy", "demo", "--virtual", "--out", str(tmp_path), *args.split()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr[-1000:]
    assert message in r.stderr and "Traceback" not in r.stderr
