"""Prefill/decode flows through the real proxy on loopback: a stalling prefill leg falls back
with its reason, a client that leaves aborts both legs' upstreams (vLLM and SGLang, during
either leg), usage through both legs is the engines', and GET /admin/disagg over HTTP."""

from __future__ import annotations

import hashlib
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from proxy.bench.mock import MockBackend
from proxy.forwarding.pdflow import PREFILL_DRAIN_S
from tests.support import ServerThread, stop_servers
from tests.test_disagg_legs import VLLM_PREFILL_KV
from tests.test_sim_http import sim, text_of_tokens

pytestmark = pytest.mark.e2e

MODEL = "sim-8b"
WAIT_S = 10.0  # for what should happen within milliseconds
CHAT = "/v1/chat/completions"


def _pd_config(p_url: str, d_url: str, flow: str, **extra: Any) -> dict[str, Any]:
    port = int(p_url.rsplit(":", 1)[1])
    return {
        "backends": [
            {"url": p_url, "engine": flow, "role": "prefill", "bootstrap_port": port},
            {"url": d_url, "engine": flow, "role": "decode"},
        ],
        "disagg": {"mode": "on", "threshold_tokens": 256},
        **extra,
    }


def _doc_body(directives: str = "", max_tokens: int = 12, stream: bool = True) -> dict[str, Any]:
    """A ~1,500-token document with a short answer: prefill-heavy, so it takes two legs (a
    mock's `chunks:N` streams N chunks whatever max_tokens says)."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{directives} " + text_of_tokens(1500, "d")}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


# --- a stalling prefill leg ---------------------------------------------------------------


@pytest.mark.parametrize("flow", ["vllm", "sglang"])
async def test_a_prefill_leg_stalling_past_the_first_byte_timeout_falls_back_with_its_reason(
    proxy_server: Callable[..., ServerThread], caplog: pytest.LogCaptureFixture, flow: str
) -> None:
    with (
        sim("h100", time_scale=8, role="prefill", pd=flow) as (p_url, _),
        sim("h100", time_scale=8, role="decode", pd=flow) as (d_url, _),
    ):
        async with httpx.AsyncClient(timeout=WAIT_S) as h:
            # Every prefill answer starts 2 s (16 simulated) late, its prefill with it; the
            # proxy waits 0.5 s for a first byte.
            faults = {"slow_start_rate": 1.0, "slow_start_s": 16.0}
            assert (await h.post(p_url + "/sim/faults", json=faults)).status_code == 200
            proxy = proxy_server(
                [p_url, d_url],
                config=_pd_config(p_url, d_url, flow, timeouts={"first_byte_s": 0.5}),
            )
            with caplog.at_level(logging.WARNING, logger="warmroute.disagg"):
                client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
                answer = await client.chat.completions.create(
                    **_doc_body(stream=False), extra_body={"ignore_eos": True}
                )
            state = (await h.get(proxy.url + "/admin/disagg")).json()
            d_stats = (await h.get(d_url + "/sim/stats")).json()
    assert answer.usage is not None and answer.usage.completion_tokens == 12
    assert d_stats["external_kv_tokens"] == 0  # no KV came: the decode engine prefilled it
    assert d_stats["requests"][-1]["prompt_tokens"] == answer.usage.prompt_tokens
    assert state["requests"]["prefill_failed"] == 1
    assert "decode_leg_failed" not in state["requests"]  # the decode engine was not at fault
    p_name, d_name = p_url.removeprefix("http://"), d_url.removeprefix("http://")
    reasons = [
        r.getMessage().split(": ", 1)[1] for r in caplog.records if "prefill leg" in r.getMessage()
    ]
    timed_out = (
        f"prefill leg on {p_name} failed (no response headers within the first-byte timeout)"
    )
    if flow == "vllm":
        assert reasons == [f"{timed_out}; decode-only on {d_name}"]
    else:  # both legs wait 0.5 s at once (the decode engine for KV): either timer may go first
        waited = (
            f"prefill leg on {p_name} had not answered when the decode leg on {d_name} gave up "
            "waiting for its KV"
        )
        assert reasons in ([f"{timed_out}; decode-only on {d_name}"],
                           [f"{waited}; decode-only on {d_name}"]), reasons  # fmt: skip


# --- an erroring prefill leg ---------------------------------------------------------------


@pytest.mark.parametrize("flow", ["vllm", "sglang"])
async def test_a_prefill_engine_answering_500_falls_back_to_decode_only_with_its_reason(
    proxy_server: Callable[..., ServerThread], caplog: pytest.LogCaptureFixture, flow: str
) -> None:
    with (
        sim("h100", time_scale=8, role="prefill", pd=flow) as (p_url, _),
        # An SGLang decode engine told of a room that is never prefilled waits for it until the
        # proxy cancels that leg: then it stops waiting at once.
        sim("h100", time_scale=8, role="decode", pd=flow) as (d_url, _),
    ):
        async with httpx.AsyncClient(timeout=WAIT_S) as h:
            faults = {"error_rate": 1.0, "error_status": 500}
            assert (await h.post(p_url + "/sim/faults", json=faults)).status_code == 200
            proxy = proxy_server([p_url, d_url], config=_pd_config(p_url, d_url, flow))
            with caplog.at_level(logging.WARNING, logger="warmroute.disagg"):
                client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
                answer = await client.chat.completions.create(
                    **_doc_body(stream=False), extra_body={"ignore_eos": True}
                )
            state = (await h.get(proxy.url + "/admin/disagg")).json()
            p_stats = (await h.get(p_url + "/sim/stats")).json()
            d_stats = (await h.get(d_url + "/sim/stats")).json()
            d_received = (await h.get(d_url + "/sim/received")).json()["requests"]
    assert answer.usage is not None and answer.usage.completion_tokens == 12
    assert p_stats["counts"]["errors_injected"] == 1
    assert d_stats["external_kv_tokens"] == 0  # no KV came: the decode engine prefilled it
    assert d_stats["requests"][-1]["prompt_tokens"] == answer.usage.prompt_tokens
    assert "kv_transfer_params" not in d_received[-1]["body"]  # the client's body: decode-only
    assert "bootstrap_room" not in d_received[-1]["body"]
    assert state["requests"]["prefill_failed"] == 1
    assert "decode_leg_failed" not in state["requests"]
    p_name, d_name = p_url.removeprefix("http://"), d_url.removeprefix("http://")
    reasons = [
        r.getMessage().split(": ", 1)[1] for r in caplog.records if "prefill leg" in r.getMessage()
    ]
    assert reasons == [
        f"prefill leg on {p_name} failed (HTTP 500 (injected fault: simulated engine error)); "
        f"decode-only on {d_name}"
    ]


# --- each leg's body, as the engines receive it ---------------------------------------------


def _client_body() -> dict[str, Any]:
    return {
        **_doc_body(max_tokens=12),
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "min_tokens": 4,
        "temperature": 0.0,
        "seed": 7,
    }


def _streamed(url: str, body: dict[str, Any], request_id: str) -> list[dict[str, Any]]:
    """The chunks of one streamed answer through the proxy."""
    headers = {"x-request-id": request_id}
    with httpx.stream("POST", url + CHAT, json=body, headers=headers, timeout=WAIT_S) as r:
        assert r.status_code == 200
        text = r.read().decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


def _received(url: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = httpx.get(url + "/sim/received").json()["requests"]
    return out


def test_vllm_legs_arrive_at_the_engines_exactly_as_the_flow_says(proxy_server: Any) -> None:
    client = _client_body()
    with (
        sim("h100", time_scale=8, role="prefill", pd="vllm") as (p_url, p_app),
        sim("h100", time_scale=8, role="decode", pd="vllm") as (d_url, _),
    ):
        proxy = proxy_server([p_url, d_url], config=_pd_config(p_url, d_url, "vllm"))
        chunks = _streamed(proxy.url, client, "wire-vllm")
        [prefill], [decode] = _received(p_url), _received(d_url)
    p_host, p_port = p_url.removeprefix("http://").split(":")
    assert prefill == {
        "path": CHAT,
        "request_id": "wire-vllm",
        "body": {
            **{k: v for k, v in client.items() if k not in ("stream_options", "min_tokens")},
            "stream": False,
            "max_tokens": 1,
            "kv_transfer_params": VLLM_PREFILL_KV,
        },
    }
    params = decode["body"]["kv_transfer_params"]
    blocks = params.pop("remote_block_ids")
    assert blocks and all(isinstance(b, int) for b in blocks)
    assert params == {  # what the prefill engine answered, passed on untouched
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": p_app.cfg.engine_id,
        "remote_request_id": "wire-vllm",
        "remote_host": p_host,
        "remote_port": int(p_port),
        "tp_size": 1,
    }
    del decode["body"]["kv_transfer_params"]
    assert decode == {"path": CHAT, "request_id": "wire-vllm", "body": client}
    _assert_whole_stream(chunks, 12)


def test_sglang_legs_arrive_at_both_engines_as_one_body_with_one_room(proxy_server: Any) -> None:
    client = _client_body()
    with (
        sim("h100", time_scale=8, role="prefill", pd="sglang") as (p_url, _),
        sim("h100", time_scale=8, role="decode", pd="sglang") as (d_url, _),
    ):
        proxy = proxy_server([p_url, d_url], config=_pd_config(p_url, d_url, "sglang"))
        chunks = _streamed(proxy.url, client, "wire-sglang")
        [prefill], [decode] = _received(p_url), _received(d_url)
        d_stats = httpx.get(d_url + "/sim/stats").json()
    p_host, p_port = p_url.removeprefix("http://").split(":")
    room = decode["body"]["bootstrap_room"]
    assert isinstance(room, int) and 0 <= room < 2**63
    expected = {
        "path": CHAT,
        "request_id": "wire-sglang",
        "body": {
            **client,
            "bootstrap_host": p_host,
            "bootstrap_port": int(p_port),
            "bootstrap_room": room,
        },
    }
    assert prefill == expected and decode == expected
    assert d_stats["external_kv_tokens"] >= 1400  # the decode engine fetched that room's KV
    _assert_whole_stream(chunks, 12)


def _assert_whole_stream(chunks: list[dict[str, Any]], tokens: int) -> None:
    """Every token of the decode leg reached the client, then the usage chunk."""
    text = [c["choices"][0]["delta"].get("content") for c in chunks if c.get("choices")]
    assert sum(1 for t in text if t) == tokens
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == tokens and usage["prompt_tokens"] >= 1500


# --- the client leaves --------------------------------------------------------------------


@pytest.fixture
def mocks() -> Iterator[Callable[[], tuple[MockBackend, ServerThread]]]:
    """Mock engines serving sim-8b that answer as the prompt's words ask and record every
    request and disconnect (proxy.bench.mock.prompt_directives)."""
    from proxy.bench.mock import prompt_directives

    started: list[ServerThread] = []

    def start() -> tuple[MockBackend, ServerThread]:
        app = MockBackend(models=(MODEL,), script=prompt_directives, record=True)
        server = ServerThread(app).start()
        started.append(server)
        return app, server

    yield start
    stop_servers(started)


class LeavingClient:
    """A raw HTTP/1.1 client that sends one request and can hang up at any moment."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
        raw = orjson.dumps(body)
        head = (
            f"POST {CHAT} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(raw)}\r\n\r\n"
        )
        self.sock.sendall(head.encode() + raw)
        self.received = b""

    def read_events(self, n: int) -> None:
        """Read until `n` server-sent events of the answer arrived."""
        while self.received.count(b"data: ") < n:
            data = self.sock.recv(65536)
            assert data, "the proxy closed the stream"
            self.received += data

    def leave(self) -> None:
        self.sock.close()


def _until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)  # another thread's server: nothing to await but its record


@pytest.mark.parametrize("flow", ["vllm", "sglang"])
def test_a_client_leaving_during_the_prefill_leg_aborts_every_upstream(
    flow: str, mocks: Callable[[], tuple[MockBackend, ServerThread]], proxy_server: Any
) -> None:
    (prefill, p), (decode, d) = mocks(), mocks()
    proxy = proxy_server([p.url, d.url], config=_pd_config(p.url, d.url, flow))
    client = LeavingClient(proxy.url, _doc_body("slowstart:60"))
    assert prefill.rec is not None and decode.rec is not None
    _until(lambda: len(prefill.rec.requests) == 1)  # type: ignore[union-attr]
    if flow == "sglang":  # both legs at once: the decode engine waits for the KV
        _until(lambda: len(decode.rec.requests) == 1)  # type: ignore[union-attr]
    client.leave()
    assert prefill.rec.disconnected.wait(WAIT_S)
    if flow == "sglang":
        assert decode.rec.disconnected.wait(WAIT_S)
    else:
        assert decode.rec.requests == []  # the decode leg was never sent
    assert prefill.rec.completed == 0 and decode.rec.completed == 0


def test_a_client_leaving_during_the_vllm_decode_leg_aborts_it(
    mocks: Callable[[], tuple[MockBackend, ServerThread]], proxy_server: Any
) -> None:
    decode, d = mocks()
    assert decode.rec is not None
    with sim("h100", time_scale=8, role="prefill", pd="vllm") as (p_url, _):
        proxy = proxy_server([p_url, d.url], config=_pd_config(p_url, d.url, "vllm"))
        client = LeavingClient(proxy.url, _doc_body("chunks:1000 delay:0.05", 16))
        client.read_events(3)  # the decode leg is streaming
        client.leave()
        assert decode.rec.disconnected.wait(WAIT_S)
        p_stats = httpx.get(p_url + "/sim/stats").json()
    [sent] = decode.rec.requests
    assert sent["body"]["kv_transfer_params"]["do_remote_prefill"] is True
    assert decode.rec.completed == 0
    assert p_stats["running"] == 0 and p_stats["aborted"] == 0  # its one token was done


def test_a_client_leaving_during_the_sglang_decode_leg_aborts_both_legs(
    mocks: Callable[[], tuple[MockBackend, ServerThread]], proxy_server: Any
) -> None:
    # Both legs get the same body, so both stream slowly: the prefill answer is still being
    # drained when the client leaves, and must be closed too.
    (prefill, p), (decode, d) = mocks(), mocks()
    assert prefill.rec is not None and decode.rec is not None
    proxy = proxy_server([p.url, d.url], config=_pd_config(p.url, d.url, "sglang"))
    client = LeavingClient(proxy.url, _doc_body("chunks:1000 delay:0.05", 16))
    client.read_events(3)
    client.leave()
    assert decode.rec.disconnected.wait(WAIT_S)
    assert prefill.rec.disconnected.wait(WAIT_S)
    # Closed with the decode leg, not after the wait a finished stream gives the prefill.
    assert prefill.rec.disconnects[0] - decode.rec.disconnects[0] < PREFILL_DRAIN_S
    assert prefill.rec.completed == 0 and decode.rec.completed == 0


# --- usage through both legs --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("flow", ["vllm", "sglang"])
@pytest.mark.parametrize("stream", [True, False])
async def test_usage_through_both_legs_is_the_decode_engines_for_the_whole_prompt(
    flow: str, stream: bool, proxy_server: Any
) -> None:
    with (
        sim("h100", time_scale=8, role="prefill", pd=flow) as (p_url, _),
        sim("h100", time_scale=8, role="decode", pd=flow) as (d_url, _),
    ):
        proxy = proxy_server([p_url, d_url], config=_pd_config(p_url, d_url, flow))
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        body: dict[str, Any] = {
            **_doc_body(max_tokens=20, stream=stream),
            "extra_body": {"ignore_eos": True},
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
            chunks = [c async for c in await client.chat.completions.create(**body)]
            usage = chunks[-1].usage
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            answer = await client.chat.completions.create(**body)
            usage, text = answer.usage, answer.choices[0].message.content or ""
        async with httpx.AsyncClient() as h:
            p_log = (await h.get(p_url + "/sim/stats")).json()["requests"]
            d_stats = (await h.get(d_url + "/sim/stats")).json()
            state = (await h.get(proxy.url + "/admin/disagg")).json()
    d_log = d_stats["requests"]
    assert state["requests"] == {"two:prefill": 1}
    assert d_stats["external_kv_tokens"] >= 1400  # the KV came over: a real two-leg flow
    assert p_log[-1]["completion_tokens"] == 1  # the prefill leg's one token is not counted
    assert text and usage is not None
    assert usage.completion_tokens == 20 == d_log[-1]["completion_tokens"]
    assert usage.prompt_tokens == d_log[-1]["prompt_tokens"] == p_log[-1]["prompt_tokens"]
    assert usage.prompt_tokens >= 1500
    assert usage.total_tokens == usage.prompt_tokens + 20


# --- GET /admin/disagg over HTTP ----------------------------------------------------------

ADMIN = "admin-secret-for-tests"
STATE_KEYS = {
    "mode",
    "active",
    "reason",
    "pools",
    "candidate_pools",
    "inputs",
    "switched_at",
    "interference_at_switch",
    "switches",
    "thresholds",
    "in_flight_tracked",
    "requests",
    "now",
}


def _admin(url: str) -> dict[str, Any]:
    assert httpx.get(url + "/admin/disagg").status_code == 401  # the token is needed
    r = httpx.get(url + "/admin/disagg", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200
    out: dict[str, Any] = r.json()
    return out


@pytest.mark.parametrize("mode", ["off", "on"])
def test_admin_disagg_over_http_says_the_mode_and_why(
    mode: str, mocks: Callable[[], tuple[MockBackend, ServerThread]], proxy_server: Any
) -> None:
    (_, a), (_, b) = mocks(), mocks()
    digest = hashlib.sha256(ADMIN.encode()).hexdigest()
    proxy = proxy_server(
        [a.url, b.url],
        config={"server": {"admin_token_sha256": digest}, "disagg": {"mode": mode}},
    )
    state = _admin(proxy.url)
    assert state["mode"] == mode
    assert set(state) == STATE_KEYS  # one schema in every mode, for tools that read it
    assert set(state["thresholds"]) >= {"min_backends", "min_dwell_s"}
    if mode == "off":
        assert state["active"] is False and state["switches"] == [] and state["requests"] == {}
        assert state["pools"] is None and state["inputs"] is None  # nothing is measured when off
        assert state["reason"] == (
            "disagg.mode is off: every request goes whole to the backend routing picks"
        )
        return
    # No request has come yet: reading the state is what evaluated it.
    names = sorted(u.removeprefix("http://") for u in (a.url, b.url))
    assert state["active"] is True
    assert state["reason"] == (
        "on by configuration: 1 of 2 healthy backends for prefill-heavy requests, 1 for decoding"
    )
    assert sorted(state["pools"]["prefill"] + state["pools"]["decode"]) == names
    assert state["inputs"]["healthy_backends"] == 2 and state["requests"] == {}
