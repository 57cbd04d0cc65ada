"""deploy/perf/floor_proxy.py, the cheapest Python proxy the hot-path benchmarks measure beside
warmroute: both of its servers relay what a backend streams, byte for byte in content, to the
official client, taking the backends in turn over kept-alive connections, and stop on SIGINT
(the counting script stops every proxy that way)."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import openai
import pytest

from proxy.bench.mock import MockBackend
from tests.support import ROOT, ServerThread, free_port, process, stop_servers, until

SCRIPT = str(ROOT / "deploy" / "perf" / "floor_proxy.py")


def _text(client: openai.OpenAI, content: str) -> str:
    stream = client.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": content}], stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


@pytest.mark.parametrize("server", ["bare", "asgi"])
def test_the_floor_relays_streams_and_answers_in_turn(server: str) -> None:
    backends = [MockBackend(chunks=5, record=True), MockBackend(chunks=5, record=True)]
    threads = [ServerThread(b).start() for b in backends]
    port = free_port()
    args = [sys.executable, SCRIPT, "--server", server, "--port", str(port)]
    args += [arg for t in threads for arg in ("--backend", t.url)]
    try:
        direct = _text(openai.OpenAI(base_url=f"{threads[0].url}/v1", api_key="x"), "hello")
        with process(args, ready=f"http://127.0.0.1:{port}/health"):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
            texts = [_text(client, "hello") for _ in range(4)]
            whole = client.chat.completions.create(
                model="mock", messages=[{"role": "user", "content": "hello"}]
            )
        assert direct.startswith("tok0 ") and texts == [direct] * 4
        assert whole.choices[0].message.content == direct
        sent = [b.rec.requests for b in backends if b.rec is not None]
        # the direct request and five through the floor, the backends in turn
        assert [len(s) for s in sent] == [4, 2]
        assert all(r["body"]["messages"][0]["content"] == "hello" for s in sent for r in s)
    finally:
        stop_servers(threads)


def test_the_bare_floor_stops_on_sigint() -> None:
    port = free_port()
    args = [sys.executable, SCRIPT, "--port", str(port), "--backend", "http://127.0.0.1:9"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        until(lambda: _answers(f"http://127.0.0.1:{port}/health"), "the floor's health answer")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
