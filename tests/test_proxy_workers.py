"""`warmroute serve --workers 2`: the supervisor starts the workers and they serve streams."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.support import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_two_workers_serve_a_stream(fake_backends):
    [(_, backend)] = fake_backends(1)
    port = free_port()
    args = ["serve", "--backend", backend.url, "--port", str(port), "--workers", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", *args, "--log-level", "warning"],
        env=os.environ.copy(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.2)
        body = {
            "model": "test-model",
            "messages": [{"role": "user", "content": "chunks:5"}],
            "stream": True,
        }
        for _ in range(4):
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
