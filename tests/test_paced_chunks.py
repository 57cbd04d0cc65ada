"""deploy/perf/paced_chunks.py runs end to end on a tiny load: the paced mock and a real proxy,
the proxy's CPU read from /proc for each stream length, a per-chunk slope from them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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
        split = row["proxy_user_ms_per_request"] + row["proxy_sys_ms_per_request"]
        assert abs(split - row["proxy_cpu_ms_per_request"]) < 0.002  # (each rounded)
    assert "cpu per paced chunk" in done.stdout


def _paced() -> object:
    sys.path.insert(0, str(ROOT / "deploy" / "perf"))
    import paced_chunks

    return paced_chunks


def test_each_proxy_compared_has_a_command_and_nginx_streams_unbuffered(tmp_path: Path) -> None:
    paced: Any = _paced()
    backends = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    for kind in ("warmroute", "floor-bare", "floor-asgi", "nginx", "sglang-router", "vllm-router"):
        cmd, ready = paced._command(kind, 9000, backends, tmp_path)
        assert ready.startswith("http://127.0.0.1:9000/")
        if kind != "nginx":
            assert all(b in cmd for b in backends)
    conf = (tmp_path / "nginx.conf").read_text()
    assert "proxy_buffering off;" in conf and "keepalive 64;" in conf
    assert "server 127.0.0.1:9001;" in conf and "listen 127.0.0.1:9000;" in conf
    nginx = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if nginx is not None:  # the configuration as nginx itself reads it
        check = subprocess.run(
            [nginx, "-t", "-c", str(tmp_path / "nginx.conf")], capture_output=True
        )
        assert check.returncode == 0, check.stderr
    with pytest.raises(SystemExit, match="unknown proxy"):
        paced._command("haproxy", 9000, backends, tmp_path)


def test_a_checkout_with_its_own_venv_runs_on_that_python(tmp_path: Path) -> None:
    """`warmroute@DIR` compares interpreters too: DIR/.venv's Python when there is one."""
    paced: Any = _paced()
    backends = ["http://127.0.0.1:9001"]
    tree = tmp_path / "other"
    (tree / "proxy").mkdir(parents=True)
    (tree / "proxy" / "__main__.py").write_text("")
    cmd, _ = paced._command(f"warmroute@{tree}", 9000, backends, tmp_path)
    assert cmd[0] == sys.executable  # no environment of its own: this one's
    python = tree / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    cmd, _ = paced._command(f"warmroute@{tree}", 9000, backends, tmp_path)
    assert cmd[:3] == [str(python), "-m", "proxy"]
    assert paced._command("warmroute", 9000, backends, tmp_path)[0][0] == sys.executable


def test_a_sessions_cpu_counts_its_live_children(tmp_path: Path) -> None:
    """nginx serves from a worker process that lives as long as it does: the CPU measured is
    that of every process of the proxy's session, not only the one started."""
    paced: Any = _paced()
    marker = tmp_path / "burnt"
    child = f"sum(range(3 * 10**7)); open({str(marker)!r}, 'w').close(); input()"
    parent = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1]])"
    parent += "; input()"
    proc = subprocess.Popen(
        [sys.executable, "-c", parent, child], start_new_session=True, stdin=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:  # the child says when
            time.sleep(0.05)
        assert marker.exists()
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        assert paced.session_cpu_s(proc.pid) >= 0.1 > own
        user, system = paced.session_cpu_split_s(proc.pid)
        assert user >= 0.1  # a loop in the interpreter: user time
        assert abs(user + system - paced.session_cpu_s(proc.pid)) <= 0.02  # (idle by now)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(10)
