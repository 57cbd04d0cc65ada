"""The simulator in prefill/decode roles, driven by the bodies proxy/disagg/legs.py builds, and
the interference in its physics that makes a split worth it."""

from __future__ import annotations

import asyncio
import itertools
import random

import httpx
import pytest

from proxy.disagg import legs
from proxy.disagg.window import itl_quantiles
from proxy.sim.config import SimConfig
from proxy.sim.engine import Scheduler, make_seq
from tests.test_sim_http import chat, sim, stream, text_of_tokens


@pytest.mark.e2e
async def test_vllm_flow_prefill_returns_kv_params_and_decode_skips_the_prefill() -> None:
    prompt = text_of_tokens(3000, "nixl")
    client_body = {**chat(prompt, 20), "min_tokens": 5}
    with (
        sim("a10g", time_scale=8, role="prefill", pd="vllm") as (p_url, _),
        sim("a10g", time_scale=8, role="decode", pd="vllm") as (d_url, _),
    ):
        async with httpx.AsyncClient() as client:
            first = await client.post(
                p_url + "/v1/chat/completions",
                json=legs.vllm_prefill_body(client_body),
                headers={"x-request-id": "pd-1"},
            )
            answer = first.json()
            params = legs.prefill_kv_params(answer)
            decoded = await stream(client, d_url, legs.vllm_decode_body(client_body, params))
            d_stats = (await client.get(d_url + "/sim/stats")).json()
    assert first.status_code == 200 and answer["usage"]["completion_tokens"] == 1
    assert params is not None and params["do_remote_prefill"] is True
    assert params["remote_request_id"] == "pd-1"
    assert {"remote_engine_id", "remote_block_ids", "remote_host", "remote_port"} <= set(params)
    assert decoded.usage["completion_tokens"] == 20
    assert decoded.usage["prompt_tokens_details"]["cached_tokens"] >= 2990
    assert d_stats["external_kv_tokens"] >= 2990  # KV came over the link, not prefilled


@pytest.mark.e2e
async def test_sglang_flow_batched_rooms_pair_each_prompt_with_its_prefill() -> None:
    prompts = [text_of_tokens(1500, "a"), text_of_tokens(1500, "b")]
    client_body = {"model": "sim-8b", "prompt": prompts, "max_tokens": 6, "ignore_eos": True}
    with (
        sim("a10g", time_scale=8, role="prefill", pd="sglang") as (p_url, _),
        sim("a10g", time_scale=8, role="decode", pd="sglang") as (d_url, _),
    ):
        port = int(p_url.rsplit(":", 1)[1])
        body = legs.sglang_body(client_body, legs.bootstrap_host(p_url), port, random.Random(0))
        assert len(legs.rooms_of(body)) == 2
        async with httpx.AsyncClient() as client:
            decode, prefill = await asyncio.gather(
                client.post(d_url + "/v1/completions", json=body),
                client.post(p_url + "/v1/completions", json=body),
            )
            d_stats = (await client.get(d_url + "/sim/stats")).json()
    assert prefill.status_code == 200 and decode.status_code == 200, decode.text
    assert prefill.json()["usage"]["completion_tokens"] == 2  # one token per prompt
    assert decode.json()["usage"]["completion_tokens"] == 12  # 6 per prompt
    assert d_stats["external_kv_tokens"] >= 2 * 1490


@pytest.mark.e2e
async def test_a_sim_ignores_the_other_engines_pd_fields() -> None:
    prompt = text_of_tokens(1000, "x")
    with sim("h100", time_scale=8, role="decode", pd="vllm") as (url, _):
        body = legs.sglang_body(chat(prompt, 4), "127.0.0.1", 1, random.Random(0))
        async with httpx.AsyncClient() as client:
            r = await client.post(url + "/v1/chat/completions", json=body)  # no bootstrap wait
            stats = (await client.get(url + "/sim/stats")).json()
    assert r.status_code == 200 and stats["external_kv_tokens"] == 0
    with sim("h100", time_scale=8, role="prefill", pd="sglang") as (url, _):
        async with httpx.AsyncClient() as client:
            r = await client.post(
                url + "/v1/chat/completions", json=legs.vllm_prefill_body(chat(prompt, 4))
            )
    assert r.status_code == 200 and r.json()["kv_transfer_params"] is None


def test_sim_rejects_an_unknown_pd_flow() -> None:
    with pytest.raises(ValueError, match="pd must be one of both, vllm, sglang"):
        SimConfig(pd="nixl")


def test_a_long_prefill_batched_with_streams_inflates_their_itl_tail() -> None:
    """The physics the decider looks for: with chunked prefill (2048-token budget), an
    8,000-token prompt arriving mid-stream makes four ~70 ms steps among ~5 ms ones."""

    def stream_quantiles(with_doc: bool) -> tuple[float, float]:
        cfg = SimConfig.from_preset("h100", "8b")
        s = Scheduler(cfg)
        chats = [
            make_seq(cfg, f"c{i}", list(range(i * 1000, i * 1000 + 100)), 200, ignore_eos=True)
            for i in range(8)
        ]
        for c in chats:
            s.add(c)
        times: list[float] = []
        for step in range(200):
            if step == 50 and with_doc:
                s.add(make_seq(cfg, "doc", list(range(50_000, 58_000)), 1, ignore_eos=True))
            plan, outputs = s.step()
            if plan is None:
                break
            if any(o.seq is chats[0] for o in outputs):
                times.append(s.now)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        q = itl_quantiles(gaps)
        assert q is not None
        return q

    p50, p99 = stream_quantiles(with_doc=True)
    base50, base99 = stream_quantiles(with_doc=False)
    assert p99 / p50 > 8  # the prefill chunks stall every stream on the engine
    assert base99 / base50 < 1.5
    assert p50 == pytest.approx(base50, rel=0.1)  # the median hardly moves: a tail effect
