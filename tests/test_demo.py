"""`warmroute demo` end to end, small: it runs, prints the table, and leaves no process behind."""

from __future__ import annotations

import itertools
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
    """Every installed policy (no --policies), each on its real stack: the one place the
    policies other than the default and round_robin run in a proxy process under the demo's
    loop (tests/test_newcomer.py runs those two only, at the demo's default size)."""
    import plugins

    policies = plugins.policy_names()
    assert {"prefix_aware", "round_robin"} < set(policies)
    out = tmp_path / "demo"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxy",
            "demo",
            "--verbose",
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
    rows = {line.split()[0]: line for line in lines if line.startswith(tuple(policies))}
    assert set(rows) == set(policies)
    assert all("24/24" in row for row in rows.values())
    doc = orjson.loads((out / "results.json").read_bytes())
    assert [run["label"] for run in doc["runs"]] == policies
    assert (out / "ttft_cdf.png").stat().st_size > 5000
    # --verbose: the proxy's own /metrics lines and the doctor's report, both read from the
    # default policy's proxy (not the last one's), then the summary
    metrics = r.stdout.split("its GET /metrics, prefix_aware):")[-1]
    assert "time_to_first_token_seconds_count" in metrics.split("Results:")[0]
    doctor = r.stdout.split("The doctor on the prefix_aware run")[-1]
    assert "warmroute doctor: the prefix_aware run, last 300 s; 2 backend(s)" in doctor
    assert "TTFT" in doctor and "Where to look next" not in doctor
    summary = r.stdout.split("What this demo showed")[-1]
    sent = 24 * len(policies)
    assert "cache   prefix_aware served" in summary and f"{sent} of {sent} requests" in summary
    assert "doctor  " in summary
    # Every proxy it started is gone: nothing listens on their ports any more.
    ports = [int(f.stem.split("-")[1]) for f in (out / "logs").glob("proxy-*.log")]
    assert ports
    for port in ports:
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            pass


def test_virtual_demo_runs_the_multi_turn_benchmark_without_processes(tmp_path):
    out = tmp_path / "virtual"
    args = "--virtual --workload multi-turn --policies prefix_aware,round_robin --engines 2 "
    args += "--requests 60 --concurrency 6 --prefixes 4 --system-chars 4000 "
    args += f"--system-chars-min 1000 --turns 3 --max-tokens 8 --kv-blocks 400 --out {out} "
    args += "--verbose"
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
    # --verbose: the doctor's report on the default policy's run (not the last policy's), in
    # the same virtual time, before the summary
    doctor = r.stdout.split("The doctor on the prefix_aware run")[-1]
    assert "warmroute doctor: the prefix_aware run; 2 backend(s)" in doctor
    assert "l40s/8b/bf16" in doctor and "Where to look next" not in doctor
    assert doctor.index("warmroute doctor:") < doctor.index("What this demo showed")
    assert not (out / "logs").exists()  # no child process was started
    doc = orjson.loads((out / "results.json").read_bytes())
    turns = {req["turn"] for run in doc["runs"] for req in run["requests"]}
    assert turns == {0, 1, 2}


def test_the_default_demo_ends_on_its_summary_with_a_clean_doctor_on_the_default_policy(
    tmp_path,
):
    """The default fleet and workload (virtual time: seconds, and the same on every machine),
    with `session` run last, as `warmroute demo` runs it: the ending is the summary, the doctor
    is read on prefix_aware's run and finds nothing, and no raw dump is printed."""
    out = tmp_path / "default"
    args = ["--virtual", "--policies", "round_robin,prefix_aware,session", "--out", str(out)]
    r = subprocess.run(
        [sys.executable, "-m", "proxy", "demo", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    *_, summary = r.stdout.split("\nWhat this demo showed")
    lines = summary.strip().splitlines()
    assert lines[0] == "(prefix_aware is warmroute's default policy):"
    assert lines[1].startswith("  cache   prefix_aware served ") and "round_robin" in lines[1]
    assert lines[2].startswith("  TTFT    mean ") and "x lower" in lines[2]
    assert lines[3] == "  served  720 of 720 requests answered under every policy"
    assert lines[4].startswith("  doctor  no finding on the prefix_aware run")
    assert len(lines) == 5  # nothing after it
    assert "CRITICAL" not in r.stdout and "WARNING" not in r.stdout
    # the raw dumps stay behind --verbose
    assert "The doctor on" not in r.stdout and "_sum" not in r.stdout and "--verbose" in r.stdout


def test_the_summary_names_what_the_doctor_found_and_the_policy_it_read() -> None:
    from proxy.demo.run import doctor_verdict, format_summary

    def summary(label: str, hit: float, mean: float, p99: float) -> dict[str, object]:
        ttft = {"mean": mean, "p99": p99}
        return {"label": label, "prefix_cache_hit_ratio": hit, "ttft_s": ttft,
                "requests_sent": 10, "completed": 10}  # fmt: skip

    rows = [summary("least_inflight", 0.5, 0.2, 0.9), summary("session", 0.6, 0.1, 0.8)]
    report = {
        "backends": [{}, {}],
        "findings": [
            {"id": "queueing", "severity": "warning"},
            {"id": "queueing", "severity": "warning"},
            {"id": "kv_pressure", "severity": "critical"},
        ],
    }
    verdict = doctor_verdict(report, "session")
    assert verdict == (
        "on the session run: CRITICAL kv_pressure on 1 of 2 backends; WARNING queueing on 2 "
        "of 2 backends (--verbose prints the report)"
    )
    text = format_summary(rows, 0.8, "session", verdict)
    assert text.splitlines()[0].endswith("the default, prefix_aware, did not run):")
    assert "session served 60.0%" in text and "75% of the 80.0%" in text
    assert "least_inflight 50.0%" in text  # no round_robin: the weakest other policy
    assert "mean 100 ms against least_inflight's 200 ms (2.00x lower)" in text
    assert "20 of 20 requests" in text and "doctor  on the session run: CRITICAL" in text
    assert doctor_verdict("could not reach the proxy", "x") == (
        "no report on the x run: could not reach the proxy"
    )


def test_cdf_plots_tick_labels_do_not_overlap(tmp_path, monkeypatch):
    """Latencies spanning a decade and more get a log axis whose labels stay apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from proxy.bench.report import plot_cdfs
    from proxy.bench.results import RequestResult, RunResult

    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep each figure to measure it
    runs = []
    for label, scale in (("a", 1.0), ("b", 1.7)):
        requests = [
            RequestResult(i, "t", "chat", start=float(i), ok=True, ttft=0.018 * scale * 1.05**i)
            for i in range(80)
        ]
        for req in requests:
            req.itl = [0.02 * scale * (1.08 ** (req.index % 60))]
        runs.append(RunResult(label, ["t"], {}, "m", "chat", 1, None, 80, "", requests=requests))
    plot_cdfs(runs, tmp_path)
    assert len(figures) == 2
    for fig in figures:
        [ax] = fig.axes
        assert ax.get_xscale() == "log"
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        box = ax.get_window_extent(renderer)
        ticks = [*ax.get_xticklabels(minor=False), *ax.get_xticklabels(minor=True)]
        shown = [t.get_window_extent(renderer) for t in ticks if t.get_visible() and t.get_text()]
        shown = [b for b in shown if box.x0 - 1 <= (b.x0 + b.x1) / 2 <= box.x1 + 1]
        assert len(shown) >= 3
        shown.sort(key=lambda b: b.x0)
        for left, right in itertools.pairwise(shown):
            assert left.x1 < right.x0, "x tick labels overlap"
        close(fig)


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
