"""What a newcomer meets first: help texts that work as printed, one-line errors for ports that
cannot be had, and logs that say ready only when /ready would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.cli import DESCRIPTION, build_parser
from tests.support import free_port

ROOT = Path(__file__).resolve().parent.parent


def warmroute(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_every_example_in_the_top_level_help_parses() -> None:
    for line in DESCRIPTION.splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("warmroute "):
            args = line.split()[1:]
            parsed = build_parser(args[0]).parse_args(args)
            assert parsed.func is not None, line
    # bench's example gives neither --concurrency nor --rate: closed loop by default
    bench = build_parser("bench").parse_args(["bench", "--base-url", "http://127.0.0.1:1"])
    assert bench.concurrency is None and bench.rate is None  # run_command settles it (8)


def test_demo_help_documents_every_option_and_lists_the_choices() -> None:
    parser = build_parser("demo")
    demo = parser._subparsers._group_actions[0].choices["demo"]  # type: ignore[union-attr]
    for action in demo._actions:
        assert action.help, f"demo {action.option_strings} has no help"
    choices = {a.dest: a.choices for a in demo._actions}
    assert "h100" in choices["device"] and "multi-turn" in choices["workload"]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "-1"], "--port must be between 1 and 65535"),
        (["--port", "65535", "--instances", "2"], "engine 2's port (--port + 1)"),
    ],
)
def test_sim_rejects_ports_out_of_range_in_one_line(args: list[str], message: str) -> None:
    r = warmroute("sim", *args)
    assert r.returncode == 2 and message in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.e2e
def test_sim_and_serve_on_a_taken_port_say_so_in_one_line(busy_port: int) -> None:
    sim = warmroute("sim", "--port", str(busy_port))
    assert sim.returncode == 2 and f"cannot listen on 127.0.0.1:{busy_port}" in sim.stderr
    serve = warmroute("serve", "--port", str(busy_port), "--backend", "http://127.0.0.1:9")
    assert serve.returncode == 1 and f"cannot listen on 127.0.0.1:{busy_port}" in serve.stderr
    for r in (sim, serve):
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "warmroute ready" not in serve.stderr


def wait_ready(url: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while True:  # another process: nothing to wait on but its answer
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, f"{url} not ready"
        time.sleep(0.1)


@pytest.mark.e2e
def test_serve_says_ready_only_when_a_backend_is_and_keeps_health_checks_out_of_info() -> None:
    """A healthy simulated engine behind one proxy, an unreachable backend behind another."""
    sim_port, up_port, down_port = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "WARMROUTE_HEALTH__INTERVAL_S": "0.1",
        "WARMROUTE_HEALTH__IDLE_INTERVAL_S": "0.1",  # idle engines: checked as often
        "WARMROUTE_HEALTH__IDLE_CHECKS_PER_S": "100",  # ... not stretched to one a second
        "WARMROUTE_HEALTH__METRICS_SCRAPE_S": "0.1",
    }
    procs: list[subprocess.Popen[str]] = []
    try:
        sim = ["sim", "--port", str(sim_port)]
        procs.append(subprocess.Popen([sys.executable, "-m", "proxy", *sim], cwd=ROOT, text=True))
        wait_ready(f"http://127.0.0.1:{sim_port}/health", procs[0])
        for port, backend in ((up_port, sim_port), (down_port, free_port())):
            args = ["serve", "--port", str(port), "--backend", f"http://127.0.0.1:{backend}"]
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "proxy", *args],
                    cwd=ROOT,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
        wait_ready(f"http://127.0.0.1:{up_port}/ready", procs[1])
        wait_ready(f"http://127.0.0.1:{down_port}/health", procs[2])
        assert httpx.get(f"http://127.0.0.1:{down_port}/ready", timeout=5).status_code == 503
        time.sleep(1.0)  # ~10 health checks and scrapes per backend at 0.1 s, to be logged or not
    finally:
        for proc in procs:
            proc.terminate()
        logs = [proc.communicate(timeout=20)[1] or "" for proc in procs]
    up, down = logs[1], logs[2]
    assert "warmroute ready: 1 of 1 backend(s) healthy" in up
    assert "engine vllm, detected from its /metrics" in up
    assert "warmroute ready" not in down and "started but not ready" in down
    for log in (up, down):
        assert "HTTP Request:" not in log  # httpx's line per health check, scrape and model poll
        # Every line says something once: no periodic check repeats its line.
        messages = [ln.split(" ", 2)[-1] for ln in log.splitlines()]
        assert len(messages) == len(set(messages)), log
