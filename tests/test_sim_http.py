"""The simulated engine over real HTTP on loopback: vLLM's API shapes and the physics on the
wall clock. Timings are compared as ratios with generous margins (shared, noisy machine);
the exact numbers are proven on the pure core in test_sim_core.py."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from proxy.sim import SimApp, SimConfig, SimFleet, create_sim_app, serve
from tests.support import ServerThread, eventually, free_port

SYSTEM = "You are a meticulous assistant who answers with care and cites sources. "


@contextlib.contextmanager
def sim(device: str = "h100", **overrides: Any) -> Iterator[tuple[str, SimApp]]:
    app = create_sim_app(SimConfig.from_preset(device, "8b", "bf16", **overrides))
    with ServerThread(app, **app.uvicorn_kwargs()) as server:
        yield server.url, app


def chat(content: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    body = {"model": "sim-8b", "messages": [{"role": "user", "content": content}]}
    return {**body, "max_tokens": max_tokens, "ignore_eos": True, **extra}


def text_of_tokens(n: int, salt: str = "") -> str:
    """About `n` tokens of text (4 characters each)."""
    base = (salt + " " + SYSTEM) * (n * 4 // len(SYSTEM) + 2)
    return base[: n * 4]


class Stream:
    """Every SSE event of one streamed request with its arrival time."""

    def __init__(self, start: float, events: list[tuple[float, Any]], status: int) -> None:
        self.start, self.events, self.status = start, events, status

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [e for _, e in self.events if isinstance(e, dict)]

    @property
    def content_times(self) -> list[float]:
        out = []
        for t, e in self.events:
            if isinstance(e, dict) and e["choices"]:
                c = e["choices"][0]
                if c.get("delta", {}).get("content") or c.get("text"):
                    out.append(t)
        return out

    @property
    def ttft(self) -> float:
        return self.content_times[0] - self.start

    @property
    def itls(self) -> list[float]:
        ts = self.content_times
        return [b - a for a, b in itertools.pairwise(ts)]

    @property
    def usage(self) -> dict[str, Any]:
        return next(e["usage"] for e in self.chunks if e.get("usage"))


async def stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> Stream:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    events: list[tuple[float, Any]] = []
    async with client.stream("POST", url + path, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(
                    (time.perf_counter(), data if data == "[DONE]" else orjson.loads(data))
                )
    return Stream(start, events, r.status_code)


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} missing"
    return float(m.group(1))


# --- API shape --------------------------------------------------------------------------


@pytest.mark.e2e
async def test_chat_stream_chunks_look_like_vllms() -> None:
    with sim(time_scale=10) as (url, _):
        async with httpx.AsyncClient() as client:
            s = await stream(client, url, chat("hello", max_tokens=5))
    assert s.status == 200 and s.events[-1][1] == "[DONE]"
    first, *tokens, usage = s.chunks
    assert first["object"] == "chat.completion.chunk" and first["id"].startswith("chatcmpl-")
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(tokens) == 5  # one output token per chunk
    assert all(t["choices"][0]["finish_reason"] is None for t in tokens[:-1])
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and set(usage) == {
        "id",
        "object",
        "created",
        "model",
        "choices",
        "usage",
    }
    assert usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


@pytest.mark.e2e
async def test_openai_client_streams_and_matches_the_non_streamed_answer() -> None:
    with sim(time_scale=10) as (url, _):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sim")
        msgs: Any = [{"role": "system", "content": SYSTEM * 8}, {"role": "user", "content": "hi"}]
        full = await client.chat.completions.create(model="sim-8b", messages=msgs, max_tokens=12)
        parts, usage = [], None
        async with await client.chat.completions.create(
            model="sim-8b",
            messages=msgs,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        ) as chunks:
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                usage = chunk.usage or usage
        models = await client.models.list()
        completion = await client.completions.create(model="sim-8b", prompt="Once", max_tokens=3)
        await client.close()
    assert "".join(parts) == full.choices[0].message.content
    assert full.usage is not None and full.usage.completion_tokens == 12
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens > 0  # the second time, the prefix is warm
    assert [m.id for m in models.data] == ["sim-8b"]
    assert completion.usage is not None and completion.usage.completion_tokens == 3


@pytest.mark.e2e
async def test_completions_stream_n_and_stop() -> None:
    with sim(time_scale=10) as (url, _):
        async with httpx.AsyncClient() as client:
            body = {"prompt": "The cache", "max_tokens": 6, "n": 2, "ignore_eos": True}
            s = await stream(client, url, body, "/v1/completions")
            plain = (await client.post(url + "/v1/completions", json=body)).json()
            word = plain["choices"][0]["text"].split()[2].strip(".")
            body2 = {**body, "n": 1, "stop": [word]}
            stopped = (await client.post(url + "/v1/completions", json=body2)).json()
    assert {c["choices"][0]["index"] for c in s.chunks if c["choices"]} == {0, 1}
    assert s.chunks[0]["object"] == "text_completion" and s.usage["completion_tokens"] == 12
    assert [c["finish_reason"] for c in plain["choices"]] == ["length", "length"]
    assert plain["choices"][0]["text"] != plain["choices"][1]["text"]
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == word
    assert word not in choice["text"]


@pytest.mark.e2e
async def test_errors_have_the_openai_shape() -> None:
    with sim() as (url, _):
        async with httpx.AsyncClient() as client:
            bad_json = await client.post(url + "/v1/chat/completions", content=b"{nope")
            no_msgs = await client.post(url + "/v1/chat/completions", json={"model": "sim-8b"})
            too_long = await client.post(
                url + "/v1/chat/completions", json=chat("x", max_tokens=10**6)
            )
            unknown = await client.post(
                url + "/v1/completions", json={"model": "gpt", "prompt": "x"}
            )
            opts_without_stream = await client.post(
                url + "/v1/chat/completions",
                json=chat("x", stream_options={"include_usage": True}),
            )
            wrong_method = await client.get(url + "/v1/chat/completions")
            health = await client.get(url + "/health")
    cases = ((bad_json, 400), (no_msgs, 400), (too_long, 400), (unknown, 404))
    for r, status in (*cases, (opts_without_stream, 400)):
        assert r.status_code == status
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert "maximum context length" in too_long.json()["error"]["message"]
    assert wrong_method.status_code == 405 and health.status_code == 200


@pytest.mark.e2e
async def test_context_is_capped_by_a_tiny_kv_pool_instead_of_hanging() -> None:
    with sim(time_scale=10, kv_blocks=8) as (url, _):  # 128 tokens of KV
        async with httpx.AsyncClient() as client:
            too_big = await client.post(url + "/v1/completions", json={"prompt": "x" * 800})
            body = {"prompt": "y" * 80, "ignore_eos": True}  # no max_tokens: fill the context
            fills = await client.post(url + "/v1/completions", json=body)
            card = (await client.get(url + "/v1/models")).json()["data"][0]
    assert too_big.status_code == 400 and "maximum context length is 128" in too_big.text
    assert fills.json()["usage"]["completion_tokens"] == 128 - 20
    assert card["max_model_len"] == 128


@pytest.mark.e2e
async def test_a_crashed_engine_fails_requests_and_health() -> None:
    with sim() as (url, app):

        def boom() -> None:
            raise RuntimeError("simulated bug")

        app.engine.scheduler.schedule = boom  # type: ignore[assignment, method-assign]
        async with httpx.AsyncClient() as client:
            first = await client.post(url + "/v1/chat/completions", json=chat("x"))
            health = await client.get(url + "/health")
            later = await client.post(url + "/v1/chat/completions", json=chat("x"))
    assert first.status_code == 500 and health.status_code == 500
    assert later.status_code == 500 and "dead" in later.json()["error"]["message"]


# --- physics on the wall clock --------------------------------------------------------


@pytest.mark.e2e
async def test_doubling_the_prompt_doubles_ttft_but_not_itl() -> None:
    with sim("a10g", time_scale=4) as (url, _):
        async with httpx.AsyncClient() as client:
            await stream(client, url, chat("warm up", 2))
            short = await stream(client, url, chat(text_of_tokens(1000, "a"), 20))
            long = await stream(client, url, chat(text_of_tokens(2000, "b"), 20))
    assert long.ttft >= 1.8 * short.ttft, (short.ttft, long.ttft)  # >= 2.0 in simulated time
    assert short.ttft > 0.08  # ~0.46 s of A10G prefill at time scale 4
    ratio = statistics.median(long.itls) / statistics.median(short.itls)
    assert 0.8 < ratio < 1.25, (short.itls, long.itls)


@pytest.mark.e2e
async def test_warm_prefix_cuts_ttft_and_reports_cached_tokens() -> None:
    system = text_of_tokens(2000, "sys")
    with sim("a10g", time_scale=4) as (url, _):
        async with httpx.AsyncClient() as client:

            def body(q: str) -> dict[str, Any]:
                messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
                return {"model": "sim-8b", "messages": messages, "max_tokens": 3}

            cold = await stream(client, url, body("What is a KV cache?"))
            warm = await stream(client, url, body("And prefix caching?"))
            stats = (await client.get(url + "/sim/stats")).json()
    assert cold.usage["prompt_tokens_details"]["cached_tokens"] == 0
    cached = warm.usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.95 * 2000 and cached % 16 == 0
    assert warm.ttft < cold.ttft / 4
    assert [r["cached_tokens"] for r in stats["requests"]] == [0, cached]
    assert stats["prefix_cache_hits"] == cached


@pytest.mark.e2e
async def test_single_stream_decode_rate_tracks_the_device_ceiling() -> None:
    scale = 4
    with sim("a10g", time_scale=scale) as (url, _):
        async with httpx.AsyncClient() as client:
            s = await stream(client, url, chat("count", 60))
    ceiling = 600 / 16  # simulated tokens/s: the a10g's bandwidth over an 8B model's weights
    # The median gap, not the span: a stall of this shared machine delays a few tokens and the
    # engine's anchored clock then catches up, which moves the span but not the median. Nothing
    # a busy machine does can make tokens come faster than the device allows, so the fast side
    # is held tight and the slow side loose (the exact step times are test_sim_core.py's).
    rate = 1 / statistics.median(s.itls) / scale  # back in simulated tokens/s
    assert 0.6 * ceiling <= rate <= 1.15 * ceiling


@pytest.mark.e2e
async def test_batching_raises_throughput() -> None:
    with sim("h100", time_scale=2) as (url, _):
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            t0 = time.perf_counter()
            await stream(client, url, chat(text_of_tokens(100, "solo"), 60))
            single_tput = 60 / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            await asyncio.gather(
                *(stream(client, url, chat(text_of_tokens(100, f"u{i}"), 60)) for i in range(12))
            )
            batch_tput = 12 * 60 / (time.perf_counter() - t0)
            metrics = (await client.get(url + "/metrics")).text
    assert batch_tput > 2.5 * single_tput  # ~10x in simulated time; the client is the limit
    assert metric(metrics, "vllm:inter_token_latency_seconds_count") == 13 * 59
    assert metric(metrics, "vllm:time_to_first_token_seconds_count") == 13
    assert metric(metrics, "vllm:generation_tokens_total") == 13 * 60


@pytest.mark.e2e
async def test_long_prompts_arriving_mid_stream_inflate_p99_itl() -> None:
    with sim("h100", time_scale=2) as (url, _):
        async with httpx.AsyncClient() as client:
            body = {**chat("a chat", 80), "stream": True}
            times: list[float] = []
            docs: list[asyncio.Task[Stream]] = []
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        times.append(time.perf_counter())
                    if len(times) == 20 and not docs:
                        docs = [
                            asyncio.create_task(
                                stream(client, url, chat(text_of_tokens(3000, f"d{i}"), 2))
                            )
                            for i in range(3)
                        ]
            await asyncio.gather(*docs)
    itls = sorted(b - a for a, b in itertools.pairwise(times))
    p50, p99 = itls[len(itls) // 2], itls[int(0.99 * (len(itls) - 1))]
    assert p99 > 4 * p50, (p50, p99)  # each 2048-token chunk: ~66 ms vs ~5 ms per token


@pytest.mark.e2e
async def test_full_kv_pool_makes_requests_wait() -> None:
    with sim("h100", time_scale=2, kv_blocks=64) as (url, _):  # room for 1024 tokens
        async with httpx.AsyncClient() as client:
            seen: list[float] = []

            async def waiting() -> bool:
                text = (await client.get(url + "/metrics")).text
                seen.append(metric(text, "vllm:kv_cache_usage_perc"))
                return metric(text, "vllm:num_requests_waiting") > 0

            tasks = [
                asyncio.create_task(stream(client, url, chat(text_of_tokens(400, f"r{i}"), 60)))
                for i in range(4)
            ]
            await eventually(waiting)
            done = await asyncio.gather(*tasks)
            text = (await client.get(url + "/metrics")).text
    assert max(seen) > 0.75
    assert all(s.usage["completion_tokens"] == 60 for s in done)
    assert metric(text, "vllm:num_requests_waiting") == 0
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.0


@pytest.mark.e2e
async def test_client_disconnect_aborts_the_request_in_the_engine() -> None:
    with sim("h100", time_scale=1) as (url, _):
        async with httpx.AsyncClient() as client:
            body = {**chat(text_of_tokens(300), 5000), "stream": True}
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 4:
                        break

            async def aborted() -> bool:
                return (await client.get(url + "/sim/stats")).json()["aborted"] == 1

            await eventually(aborted)
            stats = (await client.get(url + "/sim/stats")).json()
            metrics = (await client.get(url + "/metrics")).text
    assert stats["running"] == 0 and stats["kv_cache_usage"] == 0.0
    assert stats["requests"][-1]["finish_reason"] == "abort"
    assert stats["requests"][-1]["completion_tokens"] < 100
    assert 'vllm:request_success_total{model_name="sim-8b",finished_reason="abort"} 1' in metrics
    assert metric(metrics, "warmroute_sim_aborted_requests_total") == 1


# --- faults -------------------------------------------------------------------------------


@pytest.mark.e2e
async def test_injected_errors_stalls_cuts_and_slow_starts() -> None:
    with sim("h100", time_scale=1) as (url, _):
        async with httpx.AsyncClient() as client:

            async def faults(**kw: Any) -> None:
                off = {"error_rate": 0, "stall_rate": 0, "cut_rate": 0, "slow_start_rate": 0}
                r = await client.post(url + "/sim/faults", json={**off, **kw})
                assert r.status_code == 200, r.text

            await faults(error_rate=1.0, error_status=503)
            err = await client.post(url + "/v1/chat/completions", json=chat("x"))
            assert err.status_code == 503 and "injected" in err.json()["error"]["message"]

            await faults(stall_rate=1.0, stall_s=0.3, stall_after=2)
            stalled = await stream(client, url, chat("x", 5))
            assert sum(itl >= 0.28 for itl in stalled.itls) == 1  # one stall, once

            await faults(cut_rate=1.0, cut_after=3)
            with pytest.raises(httpx.RemoteProtocolError):
                await stream(client, url, chat("x", 50))

            await faults(slow_start_rate=1.0, slow_start_s=0.3)
            t0 = time.perf_counter()
            slow = await client.post(url + "/v1/chat/completions", json=chat("x", 2))
            assert slow.status_code == 200 and time.perf_counter() - t0 >= 0.28

            await faults()
            bad = await client.post(url + "/sim/faults", json={"error_rate": 2})
            stats = (await client.get(url + "/sim/stats")).json()
    assert bad.status_code == 400
    assert stats["counts"] | {"requests": 0} == {
        "requests": 0,
        "errors_injected": 1,
        "stalls": 1,
        "cuts": 1,
        "slow_starts": 1,
        "refused": 0,
    }
    assert stats["aborted"] == 1 and stats["running"] == 0  # the cut stream freed its KV


@pytest.mark.e2e
async def test_refused_connections_and_model_loading() -> None:
    with sim("h100", time_scale=10) as (url, app):
        async with httpx.AsyncClient() as client:
            r = await client.post(url + "/sim/faults", json={"refuse_for_s": 60})
            assert r.status_code == 200
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                await client.get(url + "/health")
            app.refuse_until = 0.0  # the in-process handle ends the outage
            app.cfg.faults.refuse_rate = 1.0
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                await client.get(url + "/health")
            app.cfg.faults.refuse_rate = 0.0
            assert (await client.get(url + "/health")).status_code == 200
    assert app.counts["refused"] >= 1

    with sim("h100", time_scale=10, faults={"load_s": 3.0}) as (url, _):  # 0.3 s of wall
        async with httpx.AsyncClient() as client:
            assert (await client.get(url + "/health")).status_code == 503
            busy = await client.post(url + "/v1/chat/completions", json=chat("x"))
            assert busy.status_code == 503

            async def loaded() -> bool:
                return (await client.get(url + "/health")).status_code == 200

            await eventually(loaded)


# --- prefill/decode disaggregation --------------------------------------------------------


@pytest.mark.e2e
async def test_nixl_style_prefill_then_decode_skips_prefill_on_the_decode_engine() -> None:
    prompt = text_of_tokens(3000, "doc")
    with sim("a10g", time_scale=8, role="prefill") as (p_url, _):
        with sim("a10g", time_scale=8, role="decode") as (d_url, _):
            async with httpx.AsyncClient() as client:
                leg1 = chat(prompt, 20, kv_transfer_params={"do_remote_decode": True})
                r = await client.post(p_url + "/v1/chat/completions", json=leg1)
                kvp = r.json()["kv_transfer_params"]
                leg2 = chat(prompt, 20, kv_transfer_params=kvp)
                decoded = await stream(client, d_url, leg2)
                local = await stream(client, d_url, chat(text_of_tokens(3000, "other"), 20))
                d_stats = (await client.get(d_url + "/sim/stats")).json()
    assert r.json()["usage"]["completion_tokens"] == 1
    assert kvp["do_remote_prefill"] is True and kvp["remote_engine_id"]
    assert len(kvp["remote_block_ids"]) == -(-r.json()["usage"]["prompt_tokens"] // 16)
    assert decoded.usage["completion_tokens"] == 20
    assert decoded.usage["prompt_tokens_details"]["cached_tokens"] >= 2990
    assert decoded.ttft < local.ttft / 3  # paid a KV transfer (~6 ms here), not a prefill
    assert d_stats["external_kv_tokens"] > 2990


@pytest.mark.e2e
async def test_sglang_style_bootstrap_room_pairs_prefill_and_decode() -> None:
    prompt = text_of_tokens(2000, "room")
    with sim("a10g", time_scale=8, role="prefill") as (p_url, _):
        with sim("a10g", time_scale=8, role="decode") as (d_url, _):
            port = int(p_url.rsplit(":", 1)[1])
            body = chat(prompt, 10, bootstrap_host="127.0.0.1", bootstrap_port=port)
            body["bootstrap_room"] = 4242
            async with httpx.AsyncClient() as client:
                decode, prefill = await asyncio.gather(
                    stream(client, d_url, body),
                    client.post(p_url + "/v1/chat/completions", json=body),
                )
                p_stats = (await client.get(p_url + "/sim/stats")).json()
                d_stats = (await client.get(d_url + "/sim/stats")).json()
    assert prefill.json()["usage"]["completion_tokens"] == 1
    assert decode.usage["completion_tokens"] == 10
    assert decode.usage["prompt_tokens_details"]["cached_tokens"] >= 1990
    assert p_stats["prefix_cache_queries"] > 1990 and d_stats["prefix_cache_hits"] == 0
    assert d_stats["external_kv_tokens"] >= 1990
    assert decode.ttft > 0.06  # it waited for the prefill engine's ~0.12 s (scaled) prefill


@pytest.mark.e2e
async def test_a_decode_leg_whose_client_leaves_stops_waiting_for_its_kv() -> None:
    # The proxy cancels an SGLang decode leg when its prefill leg failed: the engine must not
    # hold that request (and the prefill engine its long poll) until the bootstrap timeout.
    with sim("a10g", time_scale=8, role="prefill", bootstrap_timeout_s=60) as (p_url, _):
        with sim("a10g", time_scale=8, role="decode", bootstrap_timeout_s=60) as (d_url, _):
            port = int(p_url.rsplit(":", 1)[1])
            body = chat(text_of_tokens(500, "gone"), 10, bootstrap_host="127.0.0.1")
            body |= {"bootstrap_port": port, "bootstrap_room": 77}  # never prefilled
            async with httpx.AsyncClient() as client:

                async def waits(n: int) -> bool:
                    return bool((await client.get(d_url + "/sim/stats")).json()["kv_waits"] == n)

                leg = asyncio.create_task(client.post(d_url + "/v1/chat/completions", json=body))
                await eventually(lambda: waits(1))
                leg.cancel()  # the client closes its connection
                with contextlib.suppress(asyncio.CancelledError):
                    await leg
                await eventually(lambda: waits(0))
                health = await client.get(d_url + "/health")
    assert health.status_code == 200


# --- running engines ----------------------------------------------------------------------


@pytest.mark.e2e
async def test_serve_runs_independent_engines_until_cancelled() -> None:
    cfg = SimConfig.from_preset("h100", time_scale=10)
    ports = [free_port(), free_port()]
    ready = asyncio.Event()
    task = asyncio.create_task(serve([cfg, cfg.replace()], "127.0.0.1", ports, ready=ready))
    await asyncio.wait_for(ready.wait(), 10)
    body = chat(text_of_tokens(200, "same"), 2)
    async with httpx.AsyncClient() as client:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        first = [await stream(client, u, body) for u in urls]
        again = await stream(client, urls[0], body)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with pytest.raises(httpx.ConnectError):
            await client.get(urls[0] + "/health")
    assert [s.usage["prompt_tokens_details"]["cached_tokens"] for s in first] == [0, 0]
    assert again.usage["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.e2e
async def test_fleet_picks_free_ports() -> None:
    cfg = SimConfig.from_preset("l40s", time_scale=10)
    async with SimFleet([cfg, cfg.replace(model="other")]) as fleet:
        async with httpx.AsyncClient() as client:
            ids = [(await client.get(u + "/v1/models")).json()["data"][0]["id"] for u in fleet.urls]
    assert ids == ["sim-8b", "other"] and all(p > 0 for p in fleet.ports)


def test_cli_options_come_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.cli import build_parser
    from proxy.sim.cli import config_from_args

    monkeypatch.setenv("WARMROUTE_SIM_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("WARMROUTE_SIM_FAULT_ERROR_RATE", "0.25")
    monkeypatch.setenv("WARMROUTE_SIM_ENABLE_PREFIX_CACHING", "false")
    parser = build_parser()
    args = parser.parse_args(["sim", "--device", "l40s", "--dtype", "int8", "--max-num-seqs", "9"])
    cfg = config_from_args(args)
    assert (cfg.device, cfg.dtype, cfg.max_num_seqs, cfg.model) == ("l40s", "int8", 9, "sim-8b")
    assert cfg.faults.error_rate == 0.25 and cfg.enable_prefix_caching is False
    assert callable(args.func)
    sub = next(a for a in parser._actions if a.dest == "command").choices["sim"]  # type: ignore[union-attr]
    assert "examples:" in sub.format_help() and "WARMROUTE_SIM_" in sub.format_help()


@pytest.mark.e2e
def test_cli_serves_instances_on_consecutive_ports_and_stops_on_sigterm() -> None:
    port = free_port(2)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy",
            "sim",
            "--port",
            str(port),
            "--instances",
            "2",
            "--time-scale",
            "10",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "WARMROUTE_SIM_DEVICE": "a100"},
    )
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        assert "2 x sim-8b" in banner and "a100" in banner, banner
        for p in (port, port + 1):
            r = httpx.post(
                f"http://127.0.0.1:{p}/v1/completions", json={"prompt": "hi", "max_tokens": 2}
            )
            assert r.json()["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.e2e
async def test_hidden_kv_pool_leaves_only_cache_config_info_out_of_the_metrics() -> None:
    async with httpx.AsyncClient() as client:
        with sim(time_scale=10, kv_blocks=512) as (url, _):
            shown = (await client.get(url + "/metrics")).text
        with sim(time_scale=10, kv_blocks=512, hide_kv_pool=True) as (url, _):
            await stream(client, url, chat("hello", max_tokens=2))
            hidden = (await client.get(url + "/metrics")).text
    assert 'num_gpu_blocks="512"' in shown
    assert "cache_config_info" not in hidden and "num_gpu_blocks" not in hidden
    names = {ln.split()[2] for ln in shown.splitlines() if ln.startswith("# TYPE")}
    assert {ln.split()[2] for ln in hidden.splitlines() if ln.startswith("# TYPE")} == names - {
        "vllm:cache_config_info"
    }
    assert metric(hidden, "vllm:kv_cache_usage_perc") >= 0
    assert metric(hidden, "vllm:generation_tokens_total") == 2


def test_hide_kv_pool_comes_from_a_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.cli import build_parser
    from proxy.sim.cli import config_from_args

    assert config_from_args(build_parser().parse_args(["sim"])).hide_kv_pool is False
    args = build_parser().parse_args(["sim", "--hide-kv-pool"])
    assert config_from_args(args).hide_kv_pool is True
    monkeypatch.setenv("WARMROUTE_SIM_HIDE_KV_POOL", "1")
    assert config_from_args(build_parser().parse_args(["sim"])).hide_kv_pool is True


def test_consecutive_free_ports_come_from_below_the_ephemeral_range(tmp_path: Path) -> None:
    """`--instances n` binds n ports in a row; one found free inside the kernel's ephemeral
    range can go to some process's outgoing connection before the child binds it."""
    from proxy.demo.stack import _ephemeral_start, free_ports

    ports = free_ports(4)
    assert ports == list(range(ports[0], ports[0] + 4))
    if _ephemeral_start() > 20_040:  # room below it (Linux's default starts at 32768)
        assert ports[-1] < _ephemeral_start()
    for p in ports:  # free when handed out
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    (tmp_path / "range").write_text("40000\t60999\n")
    assert _ephemeral_start(str(tmp_path / "range")) == 40000
    assert _ephemeral_start(str(tmp_path / "missing")) == 32768
