"""deploy/perf/workers_scaling.py: its zero-cost backend is a stream the proxy relays whole,
and wrk's report is read right."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import ROOT


def _script() -> Any:
    sys.path.insert(0, str(ROOT / "deploy" / "perf"))
    import workers_scaling

    return workers_scaling


WRK_REPORT = """Running 5s test @ http://127.0.0.1:1/v1/chat/completions
  1 threads and 64 connections
  Latency Distribution
     50%   18.74ms
     99%   40.10ms
  16800 requests in 5.00s, 41.2MB read
  Non-2xx or 3xx responses: 3
Requests/sec:   3360.12
"""


def test_wrks_rate_errors_and_median_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    ws = _script()

    def fake_run(*args: Any, **kwargs: Any) -> Any:
        return subprocess.CompletedProcess(args, 0, stdout=WRK_REPORT, stderr="")

    monkeypatch.setattr(ws.subprocess, "run", fake_run)
    got = ws.wrk("http://127.0.0.1:1/", 5, 64, Path("post.lua"))
    assert got == {"req_per_s": 3360.12, "non_2xx": 3.0, "latency_p50_ms": 18.74}


@pytest.mark.e2e
def test_the_canned_stream_goes_through_the_proxy_whole(tmp_path: Path) -> None:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        pytest.skip("nginx is not installed (apt-get install nginx)")
    ws = _script()
    backend_port, proxy_port = ws.free_ports(2)
    conf = tmp_path / "nginx.conf"
    conf.write_text(ws.NGINX_CONF.format(dir=tmp_path, port=backend_port, body=ws.BODY))
    server = subprocess.Popen(
        [nginx, "-c", str(conf), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    proxy = None
    try:
        backend = f"http://127.0.0.1:{backend_port}"
        ws.wait_ready(f"{backend}/health", 20)
        proxy = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--backend", backend,
             "--port", str(proxy_port), "--log-level", "warning"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        ws.wait_ready(f"http://127.0.0.1:{proxy_port}/ready", 60)
        body = {
            "model": "mock",
            "stream": True,
            "stream_options": {"include_usage": True},  # (else the proxy drops its usage event)
            "messages": [{"role": "user", "content": "hi"}],
        }
        r = httpx.post(f"http://127.0.0.1:{proxy_port}/v1/chat/completions", json=body)
        assert r.status_code == 200
        events = [e for e in r.text.split("\n\n") if e]
        assert len(events) == 18 and events[-1] == "data: [DONE]"
        assert sum('"content":"tok "' in e for e in events) == 16
        assert '"usage"' in events[-2]
    finally:
        ws.stop(proxy, server)
