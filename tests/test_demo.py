"""`warmroute demo` end to end, small: it runs, prints the table, and leaves no process behind."""

from __future__ import annotations

import os
import re
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


@pytest.mark.slow
def test_disagg_demo_shows_the_split_helping_and_staying_off_where_it_should(tmp_path):
    out = tmp_path / "disagg"
    r = subprocess.run(
        [sys.executable, "-m", "proxy", "demo", "--scenario", "disagg", "--requests", "500",
         "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    row = re.compile(r"[62] engines(, light)? +(off|auto) ")
    table = [ln for ln in r.stdout.splitlines() if row.match(ln)]
    assert len(table) == 6
    assert all(any(n in ln for n in (" 500/500 ", " 250/250 ", " 100/100 ")) for ln in table)
    big_auto = next(ln for ln in table if ln.startswith("6 engines ") and " auto " in ln)
    assert "on at " in big_auto and "(2P/4D)" in big_auto
    small_auto = next(ln for ln in table if ln.startswith("2 engines ") and " auto " in ln)
    assert small_auto.rstrip().endswith("stays off")
    # The verdicts: when and why it switched, how much chat ITL recovered, and the small fleet.
    m = re.search(r"(\d+\.\d)x lower\); throughput (\d+)% of the mixed pool's", r.stdout)
    assert m and float(m.group(1)) >= 2.0 and int(m.group(2)) >= 90
    assert re.search(r"6 engines, auto: at \d+\.\d s, on: 6 healthy backends", r.stdout)
    assert "2 engines, auto: stayed off; last reason: off: 2 healthy backends are too few" in (
        r.stdout
    )
    assert "virtual time" in r.stdout
    doc = orjson.loads((out / "results.json").read_bytes())
    assert len(doc["runs"]) == 6
    switched = [d for d in doc["disagg"] if d["switches"]]
    assert [d["run"] for d in switched] == ["6 engines, disagg auto"]
    assert switched[0]["switches"][0]["pools"]["prefill"]
