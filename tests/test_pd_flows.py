"""Prefill/decode flows through the forwarder: exact leg bodies against an in-memory upstream,
and both KV-transfer flows end to end against `warmroute sim` engines in P/D roles."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import orjson
import pytest

from proxy.config import load_config
from proxy.server.app import create_app
from proxy.upstream.pool import UpstreamConnectError
from tests.test_disagg_legs import VLLM_PREFILL_KV
from tests.test_forward_fake_upstream import CHUNK, DONE, FakeResponse, FakeUpstream, _call

PREFILL, DECODE = "127.0.0.1:9201", "127.0.0.1:9202"
KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "e1",
    "remote_block_ids": [1, 2, 3],
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
}


def _pd_app(scripts: dict[str, list[Any]], engine: str = "vllm") -> tuple[Any, FakeUpstream]:
    cfg = load_config(flags={"backends": ["http://127.0.0.1:1"]}, env={})
    cfg = cfg.model_validate(
        {
            **cfg.model_dump(),
            "backends": [
                {
                    "url": f"http://{PREFILL}",
                    "models": ["m"],
                    "engine": engine,
                    "role": "prefill",
                    "bootstrap_port": 8998,
                },
                {"url": f"http://{DECODE}", "models": ["m"], "engine": engine, "role": "decode"},
            ],
            "disagg": {"mode": "on", "threshold_tokens": 256},
            "retries": {"backoff_base_s": 0.0},
        }
    )
    app = create_app(cfg)
    fake = FakeUpstream(scripts)
    app.state.forwarding.upstream = fake
    return app, fake


def _long_chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "stream": True,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "a long document. " * 400}],
        **extra,
    }


def _prefill_answer() -> FakeResponse:
    answer = {"choices": [{"text": "x"}], "kv_transfer_params": KV}
    r = FakeResponse(200, [orjson.dumps(answer)])
    r.headers = [(b"content-type", b"application/json")]
    return r


def _stream() -> FakeResponse:
    return FakeResponse(200, [CHUNK, DONE])


def _bodies(fake: FakeUpstream, name: str) -> list[dict[str, Any]]:
    return [
        orjson.loads(b) for (n, _, _), b in zip(fake.calls, fake.bodies, strict=True) if n == name
    ]


async def test_vllm_flow_sends_the_exact_prefill_and_decode_bodies() -> None:
    app, fake = _pd_app({PREFILL: [_prefill_answer], DECODE: [_stream]})
    client = _long_chat(min_tokens=4, max_completion_tokens=16)
    status, body, _ = await _call(app, client)
    assert status == 200 and body == CHUNK + DONE
    [prefill] = _bodies(fake, PREFILL)
    [decode] = _bodies(fake, DECODE)
    expected_prefill = {k: v for k, v in client.items() if k != "min_tokens"}
    expected_prefill.update(
        stream=False,
        max_tokens=1,
        max_completion_tokens=1,
        kv_transfer_params=VLLM_PREFILL_KV,
    )
    assert prefill == expected_prefill  # no stream_options, min_tokens held back
    assert decode == {
        **client,
        "stream_options": {"include_usage": True},  # the proxy's own, cut from the stream
        "kv_transfer_params": KV,
    }
    ids = {c[2]["x-request-id"] for c in fake.calls}
    assert len(ids) == 1  # both legs carry the same request id


async def test_sglang_flow_sends_one_body_with_bootstrap_fields_to_both_legs() -> None:
    app, fake = _pd_app({PREFILL: [_prefill_answer], DECODE: [_stream]}, engine="sglang")
    status, body, _ = await _call(app, _long_chat())
    assert status == 200 and body == CHUNK + DONE
    [prefill] = _bodies(fake, PREFILL)
    [decode] = _bodies(fake, DECODE)
    assert prefill == decode
    assert prefill["bootstrap_host"] == "127.0.0.1" and prefill["bootstrap_port"] == 8998
    assert 0 <= prefill["bootstrap_room"] < 2**63


async def test_a_failing_prefill_leg_falls_back_to_decode_only() -> None:
    app, fake = _pd_app({PREFILL: [UpstreamConnectError("refused")], DECODE: [_stream]})
    status, body, _ = await _call(app, _long_chat())
    assert status == 200 and body == CHUNK + DONE
    [decode] = _bodies(fake, DECODE)
    assert "kv_transfer_params" not in decode  # the engine prefills itself
    assert app.state.forwarding.pd.counts["prefill_failed"] == 1


async def test_sglang_decode_giving_up_on_kv_from_a_stalled_prefill_blames_the_prefill() -> None:
    # The decode engine waits for KV that a hung prefill never sends: its leg times out first.
    # That is the prefill's failure (fall back on the same decode engine), not the decode's.
    async def hung() -> FakeResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    app, fake = _pd_app({PREFILL: [hung], DECODE: [TimeoutError(), _stream]}, engine="sglang")
    status, body, _ = await _call(app, _long_chat())
    assert status == 200 and body == CHUNK + DONE
    first, retry = _bodies(fake, DECODE)
    assert "bootstrap_room" in first and "bootstrap_room" not in retry  # decode-only
    counts = app.state.forwarding.pd.counts
    assert counts["prefill_failed"] == 1 and "decode_leg_failed" not in counts


async def test_a_prefill_answer_without_kv_params_falls_back_too() -> None:
    def plain() -> FakeResponse:
        return FakeResponse(200, [b'{"choices":[{"text":"x"}],"kv_transfer_params":null}'])

    app, fake = _pd_app({PREFILL: [plain], DECODE: [_stream]})
    status, _, _ = await _call(app, _long_chat())
    assert status == 200
    assert "kv_transfer_params" not in _bodies(fake, DECODE)[0]


async def test_short_prompts_go_straight_to_decode() -> None:
    app, fake = _pd_app({PREFILL: [_prefill_answer], DECODE: [_stream]})
    short = {**_long_chat(), "messages": [{"role": "user", "content": "hi"}]}
    status, _, _ = await _call(app, short)
    assert status == 200
    assert [c[0] for c in fake.calls] == [DECODE]


async def test_mode_off_never_plans() -> None:
    cfg = load_config(flags={"backends": [f"http://{DECODE}"]}, env={})
    assert create_app(cfg).state.forwarding.pd is None


@pytest.mark.e2e
@pytest.mark.slow
async def test_both_flows_against_sims_in_pd_roles(proxy_server: Any) -> None:
    import openai

    from tests.test_sim_http import sim, text_of_tokens

    for flow in ("vllm", "sglang"):
        with (
            sim("a10g", time_scale=8, role="prefill", pd=flow) as (p_url, _),
            sim("a10g", time_scale=8, role="decode", pd=flow) as (d_url, _),
        ):
            port = int(p_url.rsplit(":", 1)[1])
            proxy = proxy_server(
                [p_url, d_url],
                config={
                    "backends": [
                        {"url": p_url, "engine": flow, "role": "prefill", "bootstrap_port": port},
                        {"url": d_url, "engine": flow, "role": "decode"},
                    ],
                    "disagg": {"mode": "on", "threshold_tokens": 512},
                },
            )
            client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
            stream = await client.chat.completions.create(
                model="sim-8b",
                messages=[{"role": "user", "content": text_of_tokens(3000, flow)}],
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
            assert text and usage is not None and usage.completion_tokens == 12
            import httpx

            async with httpx.AsyncClient() as h:
                d_stats = (await h.get(d_url + "/sim/stats")).json()
                state = (await h.get(proxy.url + "/admin/disagg")).json()
            assert d_stats["external_kv_tokens"] >= 2900, flow  # KV came over, not prefilled
            assert state["requests"].get("two:prefill") == 1
            await asyncio.sleep(0)


async def test_decider_and_passive_health_are_metrics() -> None:
    app, _ = _pd_app({PREFILL: [UpstreamConnectError("refused")], DECODE: [_stream]})
    await _call(app, _long_chat())
    body, _ = app.state.telemetry.prometheus_text()
    text = body.decode() if isinstance(body, bytes) else body
    assert re.search(r"(?m)^warmroute_disagg_active(\{[^}]*\})? 1(\.0)?$", text)
    ejected = re.search(
        r'(?m)^warmroute_backend_ejected\{[^}]*"127\.0\.0\.1:9201"[^}]*\} (\S+)', text
    )
    assert ejected and float(ejected.group(1)) == 1
    assert "warmroute_upstream_retry_budget_exhausted" in text
    assert "warmroute_disagg_input{" in text


async def test_disagg_active_is_reported_as_0_when_the_mode_is_off() -> None:
    cfg = load_config(flags={"backends": [f"http://{DECODE}"]}, env={})
    app = create_app(cfg)
    assert app.state.forwarding.pd is None
    body, _ = app.state.telemetry.prometheus_text()
    text = body.decode() if isinstance(body, bytes) else body
    assert re.search(r"(?m)^warmroute_disagg_active(\{[^}]*\})? 0(\.0)?$", text)
    assert "warmroute_disagg_input{" not in text  # nothing is measured when off


# --- which APIs take two legs ------------------------------------------------------------


def _json_answer() -> FakeResponse:
    r = FakeResponse(200, [b'{"object":"list","data":[]}'])
    r.headers = [(b"content-type", b"application/json")]
    return r


def _sent(fake: FakeUpstream) -> list[tuple[str, str, dict[str, Any]]]:
    """(backend, path, body) of every request the fake upstream was sent."""
    paths = [t.prefix.split(b" ")[1].decode() for t in fake.targets]
    names = [c[0] for c in fake.calls]
    return [(n, p, orjson.loads(b)) for n, p, b in zip(names, paths, fake.bodies, strict=True)]


class PathsUpstream(FakeUpstream):
    """The fake upstream, also keeping where each request went."""

    def __init__(self, scripts: dict[str, list[Any]]) -> None:
        super().__init__(scripts)
        self.targets: list[Any] = []

    async def post(self, target: Any, *args: Any, **kwargs: Any) -> FakeResponse:
        self.targets.append(target)
        return await super().post(target, *args, **kwargs)


def _paths_app(engine: str) -> tuple[Any, PathsUpstream]:
    app, _ = _pd_app({}, engine)
    fake = PathsUpstream({PREFILL: [_json_answer], DECODE: [_json_answer]})
    app.state.forwarding.upstream = fake
    return app, fake


LONG_INPUT = "a long document. " * 400  # ~1,700 tokens: over the 256-token threshold


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_an_embedding_goes_whole_to_the_prefill_pool_if_long_else_to_decode(
    engine: str,
) -> None:
    app, fake = _paths_app(engine)
    long = {"model": "m", "input": LONG_INPUT}
    short = {"model": "m", "input": "a short query"}
    assert (await _call(app, long, path="/v1/embeddings"))[0] == 200
    assert (await _call(app, short, path="/v1/embeddings"))[0] == 200
    # The client's bodies as they were: no prefill leg, no KV-transfer or bootstrap fields.
    assert _sent(fake) == [
        (PREFILL, "/v1/embeddings", long),
        (DECODE, "/v1/embeddings", short),
    ]
    counts = app.state.forwarding.pd.counts
    assert counts == {"one:prefill": 1, "one:decode": 1}  # no prefill_failed, no warning


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_responses_request_gets_the_pool_split_by_its_output_cap_never_two_legs(
    engine: str,
) -> None:
    app, fake = _paths_app(engine)
    brief = {"model": "m", "input": LONG_INPUT, "max_output_tokens": 16}
    essay = {"model": "m", "input": "another report. " * 400, "max_output_tokens": 2_000}
    # (The essay first: the fakes' answers carry no usage, so once one has finished the
    # output history expects nothing of that prompt size.)
    assert (await _call(app, essay, path="/v1/responses"))[0] == 200
    assert (await _call(app, brief, path="/v1/responses"))[0] == 200
    assert _sent(fake) == [
        (DECODE, "/v1/responses", essay),  # a long answer: a stream, on the decode pool
        (PREFILL, "/v1/responses", brief),  # long prompt, short answer: the prefill pool
    ]
    assert app.state.forwarding.pd.counts == {"one:prefill": 1, "one:decode": 1}


async def test_a_long_prompt_with_a_long_answer_still_takes_two_legs() -> None:
    # ~1,700 uncached tokens and 1,000 to write: over the output ratio, but the threshold
    # alone decides a KV transfer (decoded whole, its prefill would stall the decode engine).
    app, fake = _pd_app({PREFILL: [_prefill_answer], DECODE: [_stream]})
    status, body, _ = await _call(app, _long_chat(max_tokens=1_000))
    assert status == 200 and body == CHUNK + DONE
    assert [c[0] for c in fake.calls] == [PREFILL, DECODE]
    assert _bodies(fake, DECODE)[0]["kv_transfer_params"] == KV
    assert app.state.forwarding.pd.counts == {"two:prefill": 1}


# --- an SGLang prefill leg that errors ----------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        (
            lambda: FakeResponse(500, [b'{"error":{"message":"engine down"}}']),
            "HTTP 500 (engine down)",
        ),
        (UpstreamConnectError("connection refused"), "connection refused"),
    ],
    ids=["http_500", "refused"],
)
async def test_an_erroring_sglang_prefill_leg_cancels_the_kv_wait_and_falls_back(
    failure: Any, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    waited, cancelled = asyncio.Event(), asyncio.Event()

    async def waiting_for_kv() -> FakeResponse:
        waited.set()
        try:
            await asyncio.Event().wait()  # the engine waits for the room's KV: it never comes
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError

    app, fake = _pd_app({PREFILL: [failure], DECODE: [waiting_for_kv, _stream]}, "sglang")
    client = _long_chat(stream_options={"include_usage": True})
    with caplog.at_level(logging.WARNING, logger="warmroute.disagg"):
        status, body, _ = await _call(app, client)
    assert (status, body) == (200, CHUNK + DONE)
    assert waited.is_set() and cancelled.is_set()  # the decode leg's wait was cut short
    first, fallback = _bodies(fake, DECODE)
    assert first["bootstrap_room"] == _bodies(fake, PREFILL)[0]["bootstrap_room"]
    assert fallback == client  # decode-only: the client's body, no bootstrap fields
    counts = app.state.forwarding.pd.counts
    assert counts["prefill_failed"] == 1 and "decode_leg_failed" not in counts
    [line] = [r.getMessage() for r in caplog.records if r.name == "warmroute.disagg"]
    assert line.endswith(f"prefill leg on {PREFILL} failed ({reason}); decode-only on {DECODE}")
