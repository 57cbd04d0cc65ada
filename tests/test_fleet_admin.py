"""Backends added, drained and removed through the admin API while the proxy serves, over real
sockets: the mock engines of proxy.bench.mock and the real proxy under uvicorn."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from proxy.bench.mock import MockBackend, Reply
from tests.support import ServerThread, load_script, until

pytestmark = pytest.mark.e2e
MODEL = "test-model"
ELASTIC = load_script("deploy/perf/elastic.py", "warmroute_elastic")


def chat(words: str = "hello", stream: bool = True) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": stream,
        "messages": [{"role": "user", "content": f"{words} {time.monotonic_ns()}"}],
    }


def backends_view(proxy: ServerThread) -> dict[str, dict[str, Any]]:
    data = httpx.get(proxy.url + "/admin/backends").json()
    return {b["name"]: b for b in data["backends"]} | {
        b["name"]: b for b in data["gone"] if b["name"] not in data["backends"]
    }


def wait_state(proxy: ServerThread, name: str, state: str) -> None:
    """The proxy's view changes on its own loop: poll it (no event crosses over)."""
    until(lambda: backends_view(proxy).get(name, {}).get("state") == state, f"{name} {state}")


def name_of(server: ServerThread) -> str:
    return f"127.0.0.1:{server.port}"


def events(lines: Iterator[str]) -> list[str]:
    return [line for line in lines if line.startswith("data: ")]


def test_an_added_backend_gets_no_request_before_it_answered_its_health_check(
    fake_backends: Callable[..., Any],
    proxy_server: Callable[..., ServerThread],
    closed_port_url: str,
) -> None:
    [(app_a, a)] = fake_backends(1)
    proxy = proxy_server([a.url], policy="round_robin")
    r = httpx.post(proxy.url + "/admin/backends", json={"url": closed_port_url, "models": [MODEL]})
    assert r.status_code == 201 and r.json()["state"] == "joining", r.text
    dead = r.json()["name"]
    for _ in range(6):
        assert httpx.post(proxy.url + "/v1/chat/completions", json=chat()).status_code == 200
    view = backends_view(proxy)
    assert view[dead]["state"] == "joining" and view[dead]["source"] == "admin"
    assert "health check failed" in view[dead]["last_error"]
    assert len(app_a.rec.requests) == 6  # every one on the serving backend

    [(app_b, b)] = fake_backends(1)
    r = httpx.post(proxy.url + "/admin/backends", json={"url": b.url})
    assert r.status_code == 201
    wait_state(proxy, name_of(b), "serving")
    for _ in range(4):
        assert httpx.post(proxy.url + "/v1/chat/completions", json=chat()).status_code == 200
    assert len(app_b.rec.requests) == 2  # round robin over the two serving ones
    assert backends_view(proxy)[name_of(b)]["models"] == [MODEL]  # discovered before serving
    metrics = httpx.get(proxy.url + "/metrics").text
    assert 'warmroute_fleet_change="join",warmroute_fleet_source="admin"} 2.0' in metrics


def test_bad_admin_requests_get_clear_errors(
    fake_backends: Callable[..., Any], proxy_server: Callable[..., ServerThread]
) -> None:
    [(_, a)] = fake_backends(1)
    proxy = proxy_server([a.url])
    post = httpx.post(proxy.url + "/admin/backends", content=b"{not json")
    assert post.status_code == 400 and post.json()["error"]["code"] == "invalid_json"
    bad = httpx.post(proxy.url + "/admin/backends", json={"url": "ftp://x"})
    assert bad.status_code == 400
    assert "url: must be an http(s) URL" in bad.json()["error"]["message"]
    unknown = httpx.post(proxy.url + "/admin/backends", json={"url": a.url, "wieght": 2})
    assert (
        unknown.status_code == 400 and "wieght: unknown key" in unknown.json()["error"]["message"]
    )
    taken = httpx.post(proxy.url + "/admin/backends", json={"url": a.url})
    assert taken.status_code == 409 and "listed by config" in taken.json()["error"]["message"]
    gone = httpx.delete(proxy.url + "/admin/backends/10.9.9.9:1")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "backend_not_found"
    listed = httpx.delete(proxy.url + f"/admin/backends/{name_of(a)}")
    assert listed.status_code == 409 and "drain it here" in listed.json()["error"]["message"]


def test_a_removed_backend_finishes_its_stream_then_leaves_and_is_forgotten(
    fake_backends: Callable[..., Any], proxy_server: Callable[..., ServerThread]
) -> None:
    [(_, a)] = fake_backends(1)
    [(app_b, b)] = fake_backends(1)
    proxy = proxy_server([a.url], policy="round_robin")
    assert httpx.post(proxy.url + "/admin/backends", json={"url": b.url}).status_code == 201
    wait_state(proxy, name_of(b), "serving")
    # one request each, so that b has metric series of its own
    for _ in range(2):
        httpx.post(proxy.url + "/v1/chat/completions", json=chat())
    assert f'warmroute_backend="{name_of(b)}"' in httpx.get(proxy.url + "/metrics").text
    with httpx.stream(
        "POST", proxy.url + "/v1/chat/completions", json=chat("chunks:30 delay:0.02")
    ) as stream:
        assert stream.headers["x-warmroute-backend"] == name_of(a)
        lines = stream.iter_lines()
        first = next(lines)
        assert first.startswith("data: ")
        # and one on b, under way while b is removed
        with httpx.stream(
            "POST", proxy.url + "/v1/chat/completions", json=chat("chunks:30 delay:0.02")
        ) as on_b:
            assert on_b.headers["x-warmroute-backend"] == name_of(b)
            b_lines = on_b.iter_lines()
            next(b_lines)
            r = httpx.delete(proxy.url + f"/admin/backends/{name_of(b)}")
            assert r.status_code == 202 and r.json()["state"] == "draining"
            # no new request goes to b while it drains
            for _ in range(3):
                done = httpx.post(proxy.url + "/v1/chat/completions", json=chat(stream=False))
                assert done.headers["x-warmroute-backend"] == name_of(a)
            rest = events(b_lines)
        assert rest[-1] == "data: [DONE]"  # the stream in flight on b finished whole
        assert not any('"error"' in e for e in rest)
        events(lines)
    wait_state(proxy, name_of(b), "gone")
    assert name_of(b) not in httpx.get(proxy.url + "/admin/routing").text
    metrics = httpx.get(proxy.url + "/metrics").text
    assert f'warmroute_backend="{name_of(b)}"' not in metrics  # its series went with it
    assert 'warmroute_fleet_change="leave"' in metrics
    assert app_b.rec.completed >= 2


def test_a_stream_still_open_after_the_drain_grace_gets_a_clean_error_event(
    fake_backends: Callable[..., Any],
    proxy_server: Callable[..., ServerThread],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="warmroute.fleet")
    [(_, a)] = fake_backends(1)
    [(_, b)] = fake_backends(1)
    proxy = proxy_server([a.url], config={"fleet": {"drain_grace_s": 0.2}})
    httpx.post(proxy.url + "/admin/backends", json={"url": b.url})
    wait_state(proxy, name_of(b), "serving")
    httpx.post(proxy.url + f"/admin/backends/{name_of(a)}/drain")  # everything to b now
    wait_state(proxy, name_of(a), "drained")
    with httpx.stream(
        "POST", proxy.url + "/v1/chat/completions", json=chat("chunks:400 delay:0.02")
    ) as stream:
        assert stream.headers["x-warmroute-backend"] == name_of(b)
        lines = stream.iter_lines()
        next(lines)
        assert httpx.delete(proxy.url + f"/admin/backends/{name_of(b)}").status_code == 202
        got = events(lines)
    assert got[-1] == "data: [DONE]"
    error = json.loads(got[-2].removeprefix("data: "))["error"]
    assert error["code"] == "backend_drained" and "left the fleet" in error["message"]
    assert len(got) < 400  # cut, not finished
    wait_state(proxy, name_of(b), "gone")
    # deploy/perf/elastic.py reads the drain from these log lines
    log = ELASTIC.parse_proxy_log("\n".join(r.getMessage() for r in caplog.records))
    assert log["leaves"] == [{"name": name_of(b), "inflight": 1}]
    assert log["cuts"] == [{"name": name_of(b), "cut": 1}]
    assert [x["name"] for x in log["lefts"]] == [name_of(b)]
    # a drained backend is still listed and comes back on resume
    assert httpx.post(proxy.url + f"/admin/backends/{name_of(a)}/resume").status_code == 202
    wait_state(proxy, name_of(a), "serving")
    assert httpx.post(proxy.url + "/v1/chat/completions", json=chat()).status_code == 200


def test_a_request_waiting_for_its_head_on_a_drained_backend_goes_on_elsewhere(
    fake_backends: Callable[..., Any], proxy_server: Callable[..., ServerThread]
) -> None:
    slow = MockBackend(chunks=3, models=(MODEL,), script=lambda request: Reply(head_after_s=30))
    with ServerThread(slow) as s:
        proxy = proxy_server([s.url], config={"fleet": {"drain_grace_s": 0.2}})
        [(app_b, b)] = fake_backends(1)
        with httpx.Client(timeout=20) as client:
            answer: dict[str, Any] = {}

            def call() -> None:
                r = client.post(proxy.url + "/v1/chat/completions", json=chat(stream=False))
                answer["status"], answer["backend"] = (
                    r.status_code,
                    r.headers.get("x-warmroute-backend"),
                )

            t = threading.Thread(target=call)
            t.start()
            until(lambda: backends_view(proxy)[name_of(s)]["requests_here"] > 0, "the request")
            httpx.post(proxy.url + "/admin/backends", json={"url": b.url})
            wait_state(proxy, name_of(b), "serving")
            httpx.post(proxy.url + f"/admin/backends/{name_of(s)}/drain")
            t.join(20)
    assert answer == {"status": 200, "backend": name_of(b)}
    assert len(app_b.rec.requests) == 1
