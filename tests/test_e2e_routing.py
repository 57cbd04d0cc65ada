"""Prefix-aware routing end to end: three proxy processes share Redis; Redis may go away."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support import free_port

pytestmark = [
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
    pytest.mark.e2e,
]


def _wait(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.05)
    raise AssertionError(f"{url} not ready")


@contextlib.contextmanager
def private_redis(port: int) -> Iterator[subprocess.Popen[bytes]]:
    """A Redis of this test's own (the shared one on 6379 must never be stopped)."""
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while (
        subprocess.run(
            ["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True
        ).stdout.strip()
        != "PONG"
    ):
        assert time.monotonic() < deadline, "redis did not start"
        time.sleep(0.05)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def proxies(n: int, backends: list[str], redis_url: str) -> Iterator[list[str]]:
    procs, urls = [], []
    try:
        for _ in range(n):
            port = free_port()
            args = [
                sys.executable,
                "-m",
                "proxy",
                "serve",
                "--port",
                str(port),
                "--admin-port",  # /admin on the (loopback) serving port
                str(port),
                "--policy",
                "prefix_aware",
                "--redis",
                redis_url,
                "--log-level",
                "warning",
            ]
            for b in backends:
                args += ["--backend", b]
            procs.append(
                subprocess.Popen(
                    args, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"}
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        for u in urls:
            _wait(u + "/ready")
        yield urls
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _system(i: int) -> str:
    return f"System prompt {i}. " + " ".join(f"rule{i}-{k}" for k in range(400))


def _chat(system: str, user: str) -> dict:
    return {
        "model": "test-model",
        "max_tokens": 4,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def _explain(proxy: str, body: dict) -> dict:
    r = httpx.post(proxy + "/admin/route/explain", json=body, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.redis
@pytest.mark.slow
def test_same_prefix_same_backend_across_three_proxies_sharing_redis(fake_backends):
    # Engines that cache: the proxies learn their caches are big enough.
    started = fake_backends(3, cache_tokens=1_000_000)
    backends = [s.url for _, s in started]
    port = free_port()
    with private_redis(port), proxies(3, backends, f"redis://127.0.0.1:{port}/0") as urls:
        served: dict[int, set[str]] = {}
        for round_ in range(3):
            for i in range(4):
                proxy = urls[(round_ + i) % 3]  # each prompt reaches every replica
                r = httpx.post(
                    proxy + "/v1/chat/completions",
                    json=_chat(_system(i), f"question {round_}"),
                    timeout=10,
                )
                assert r.status_code == 200
                served.setdefault(i, set()).add(r.headers["x-warmroute-backend"])
        assert all(len(b) == 1 for b in served.values()), served
        # The replicas agree because they share the index: a replica that never saw prompt 0
        # until now finds its whole system prompt cached on the backend that served it.
        [home] = served[0]
        for proxy in urls:
            exp = _explain(proxy, _chat(_system(0), "new question"))
            assert exp["matched_blocks"][home] >= 0.9 * len(_system(0)) / 64
            others = [n for n in exp["matched_blocks"] if n != home]
            assert all(exp["matched_blocks"][n] == 0 for n in others)
        info = httpx.get(urls[0] + "/admin/routing").json()
        assert info["index"]["mode"] == "redis"


@pytest.mark.redis
@pytest.mark.slow
def test_redis_outage_fails_no_request_and_sharing_resumes(fake_backends):
    backends = [s.url for _, s in fake_backends(2)]
    port = free_port()
    redis_url = f"redis://127.0.0.1:{port}/0"
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(private_redis(port))
        [a, b] = stack.enter_context(proxies(2, backends, redis_url))
        ok = 0
        for i in range(10):
            r = httpx.post(
                a + "/v1/chat/completions", json=_chat(_system(i % 3), f"q{i}"), timeout=10
            )
            ok += r.status_code == 200
            if i == 4:
                redis.kill()
                redis.wait()
        assert ok == 10  # not one request failed because Redis went away
        t = time.monotonic()
        r = httpx.post(
            a + "/v1/chat/completions", json=_chat(_system(9), "during outage"), timeout=10
        )
        assert r.status_code == 200 and time.monotonic() - t < 2
        assert httpx.get(a + "/admin/routing").json()["index"]["mode"] == "memory-fallback"
        stack.enter_context(private_redis(port))  # Redis is back (empty)
        deadline = time.monotonic() + 15
        while httpx.get(a + "/admin/routing").json()["index"]["mode"] != "redis":
            assert time.monotonic() < deadline, "did not reconnect to Redis"
            time.sleep(0.1)
        # Sharing resumes: what A routes now, B sees in the shared index.
        body = _chat(_system(42), "after the outage")
        r = httpx.post(a + "/v1/chat/completions", json=body, timeout=10)
        winner = r.headers["x-warmroute-backend"]
        deadline = time.monotonic() + 5
        while _explain(b, body)["matched_blocks"].get(winner, 0) == 0:
            assert time.monotonic() < deadline, "B never saw A's record"
            time.sleep(0.05)


def test_hot_system_prompt_spreads_over_backends(fake_backends, proxy_server):
    backends = fake_backends(3)
    proxy = proxy_server([s.url for _, s in backends], policy="prefix_aware")
    import concurrent.futures as cf

    body = {**_chat(_system(0), "chunks:20 delay:0.02"), "stream": True}

    def one(_: int) -> str:
        r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=20)
        assert r.status_code == 200
        return r.headers["x-warmroute-backend"]

    with cf.ThreadPoolExecutor(24) as pool:
        used = list(pool.map(one, range(48)))
    counts = {b: used.count(b) for b in set(used)}
    # One hot prompt in 100% of requests must not pile onto a single backend.
    assert len(counts) == 3, counts
    assert max(counts.values()) <= 3 * min(counts.values()), counts
