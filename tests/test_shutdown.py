"""A shutdown that outlasts its grace period ends the streams it cuts cleanly: each client
gets an OpenAI error event (and [DONE]) on an event boundary, and no traceback is logged."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.support import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_streams_cut_when_the_grace_period_ends_get_an_error_event(fake_backends):
    [(_, backend)] = fake_backends(1)
    port = free_port()
    env = {**os.environ, "WARMROUTE_SERVER__SHUTDOWN_GRACE_S": "0.5"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--backend", backend.url, "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        texts: list[str] = []
        started = threading.Barrier(4)

        def stream() -> None:
            body = {
                "model": "test-model",
                "stream": True,
                "messages": [{"role": "user", "content": "chunks:400 delay:0.05"}],
            }
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
                text = ""
                for part in r.iter_text():
                    if not text:
                        started.wait(10)
                    text += part
                texts.append(text)

        threads = [threading.Thread(target=stream) for _ in range(3)]
        for t in threads:
            t.start()
        started.wait(10)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert len(texts) == 3
        for text in texts:
            assert 0 < text.count("delta") < 400  # cut, not drained
            events = text.split("\n\n")
            assert events[-1] == "" and events[-2] == "data: [DONE]"
            assert '"code":"shutdown"' in events[-3]
        proc.wait(20)
        stderr = proc.stderr.read() if proc.stderr else ""
        assert "Traceback" not in stderr
        assert "stream cut at shutdown" in stderr
    finally:
        proc.kill()
        proc.wait()
