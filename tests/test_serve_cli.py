"""`warmroute serve` as a user runs it: config errors, env vars, graceful shutdown."""

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


def _warmroute(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
        **kw,
    )


@pytest.mark.e2e
def test_help_teaches_with_examples():
    out = _warmroute("serve", "--help").stdout
    assert "examples:" in out and "--backend http://" in out and "WARMROUTE_" in out
    top = _warmroute("--help").stdout
    assert "serve" in top


@pytest.mark.e2e
@pytest.mark.slow
def test_config_errors_name_the_key_and_exit_nonzero(tmp_path):
    r = _warmroute("serve", "--check")
    assert r.returncode == 2 and "backends: none configured" in r.stderr
    bad = tmp_path / "w.yaml"
    bad.write_text("backends:\n  - url: ftp://x\ntimeouts:\n  idle_s: -1\n  bogus: 1\n")
    r = _warmroute("serve", "--config", str(bad))
    assert r.returncode == 2
    assert "backends.0.url: must be an http(s) URL" in r.stderr
    assert "timeouts.idle_s" in r.stderr and "timeouts.bogus: unknown key" in r.stderr
    r = _warmroute("serve", "--check", "--backend", "http://127.0.0.1:1", "--policy", "nope")
    assert (
        r.returncode == 2
        and "choose one of: least_inflight" in r.stderr
        and "round_robin" in r.stderr
    )
    r = _warmroute("serve", "--backend", "http://127.0.0.1:1", "--policy", "nope")
    assert r.returncode == 2 and "routing.policy: unknown policy 'nope'" in r.stderr
    bad.write_text("backends: [\n")
    r = _warmroute("serve", "--config", str(bad))
    assert r.returncode == 2 and "not valid YAML" in r.stderr


@pytest.mark.e2e
@pytest.mark.slow
def test_env_vars_and_file_and_flags_layer(tmp_path):
    f = tmp_path / "w.yaml"
    f.write_text("server:\n  port: 7000\nbackends:\n  - url: http://127.0.0.1:9001\n")
    r = _warmroute(
        "serve",
        "--check",
        "--config",
        str(f),
        env={"WARMROUTE_PORT": "7100", "WARMROUTE_TIMEOUTS__IDLE_S": "12"},
    )
    assert '"port": 7100' in r.stdout and '"idle_s": 12.0' in r.stdout
    r = _warmroute(
        "serve", "--check", "--config", str(f), "--port", "7200", env={"WARMROUTE_PORT": "7100"}
    )
    assert '"port": 7200' in r.stdout
    r = _warmroute("serve", "--check", env={"WARMROUTE_BACKENDS": "http://a:1,http://b:2"})
    assert '"url": "http://a:1"' in r.stdout and '"url": "http://b:2"' in r.stdout
    r = _warmroute("serve", "--check", env={"WARMROUTE_BACKNEDS": "http://a:1"})
    assert r.returncode == 2 and "WARMROUTE_BACKNEDS is not a warmroute setting" in r.stderr


@pytest.mark.e2e
def test_graceful_shutdown_lets_inflight_stream_finish(fake_backends):
    [(_, backend)] = fake_backends(1)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy",
            "serve",
            "--backend",
            backend.url,
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        stderr=subprocess.PIPE,
        text=True,
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
        result: dict[str, str] = {}
        first = threading.Event()

        def stream() -> None:
            body = {
                "model": "test-model",
                "stream": True,
                "messages": [{"role": "user", "content": "chunks:20 delay:0.05"}],
            }
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=20) as r:
                text = ""
                for part in r.iter_text():
                    text += part
                    first.set()
                result["text"] = text

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(10)
        proc.send_signal(signal.SIGTERM)
        t.join(20)
        assert result["text"].endswith("data: [DONE]\n\n")  # finished, not cut
        assert result["text"].count("delta") >= 20
        # uvicorn re-raises the signal after draining, so the exit status says SIGTERM.
        assert proc.wait(20) in (0, -signal.SIGTERM)
    finally:
        proc.kill()
        proc.wait()


class _Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: object = None) -> str:
        return f"info:{name}"

    def get_write_buffer_size(self) -> int:
        return len(self.writes)


def test_response_head_goes_out_with_the_first_body_bytes_in_one_write():
    import asyncio

    from proxy.server.serve import HeadWithBodyTransport

    async def main() -> None:
        raw = _Recorder()
        t = HeadWithBodyTransport(raw, asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
        assert raw.writes == []  # held for the body
        assert t.direct_write is None  # nothing may pass it while it holds a head
        t.write(b"5\r\ndata:\r\n")
        assert t.direct_write == raw.write
        assert raw.writes == [
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n5\r\ndata:\r\n"
        ]
        t.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # interim: never held
        t.write(b"HTTP/1.1 204 No Content\r\n\r\n")  # no body follows: out at the turn's end
        assert len(raw.writes) == 2
        await asyncio.sleep(0)
        assert raw.writes[-1] == b"HTTP/1.1 204 No Content\r\n\r\n"
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.close()  # nothing is lost when the connection closes
        assert raw.writes[-1] == b"HTTP/1.1 200 OK\r\n\r\n" and raw.closed
        assert t.is_closing() is True and t.get_extra_info("peername") == "info:peername"
        assert t.get_write_buffer_size() == len(raw.writes)  # the rest is the transport's

    asyncio.run(main())


def test_freed_large_blocks_go_back_to_the_system_on_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    import platform

    from proxy.server import serve

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    expected = platform.libc_ver()[0] == "glibc"
    assert serve.return_freed_memory() is expected
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the operator's own word wins
    assert serve.return_freed_memory() is False
