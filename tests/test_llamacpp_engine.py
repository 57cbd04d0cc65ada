"""What the real engine does, pinned directly (no proxy): the facts warmroute builds on.

llama.cpp's llama-server is the independent referee for measurement and routing, so the
behaviours the proxy relies on are checked here against the engine itself: OpenAI streaming
with the official client, the `timings` and `usage` it reports, its Prometheus metrics, and
above all that its prompt cache is per instance (warm on the instance that saw a prefix, cold
on any other), which is the whole case for prefix-aware routing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import openai
import pytest

from tests.llamacpp import (
    Engine,
    LlamaServer,
    llamacpp_engine,
    long_system_prompt,
    running_servers,
    stream_chat,
)

pytestmark = [pytest.mark.llamacpp, pytest.mark.e2e]

__all__ = ["llamacpp_engine"]  # the fixture, re-exported so pytest finds it in this module


@pytest.fixture(scope="module")
def pair(llamacpp_engine: Engine) -> Iterator[list[LlamaServer]]:
    # Two instances for the whole module: start-up is < 1 s, but tests that need a cold
    # cache use prompts with their own unique tag instead of restarting engines.
    with running_servers(llamacpp_engine, 2) as servers:
        yield servers


def _client(server: LlamaServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_streams_role_then_content_then_usage(pair: list[LlamaServer]) -> None:
    client = _client(pair[0])
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(client.chat.completions.create(**kwargs))  # type: ignore[call-overload]
    # The first chunk is role-only: a TTFT meter must not stop its clock on it.
    first = chunks[0]
    assert first.choices[0].delta.role == "assistant"
    assert not first.choices[0].delta.content
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    # One chunk per token, so ITL samples are per token on this engine.
    assert len(content) == 8
    assert {c.id for c in chunks} == {first.id}
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    # include_usage: a final chunk with empty choices carries usage (and llama.cpp's timings).
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 8
    assert last.usage.prompt_tokens > 0
    assert last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens is not None
    extra = last.model_extra or {}
    assert "timings" in extra

    # temperature 0 is deterministic, so end-to-end tests can compare text via the proxy.
    again = list(client.chat.completions.create(**kwargs))  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == "".join(c.choices[0].delta.content or "" for c in again if c.choices)

    models = [m.id for m in client.models.list()]
    assert "tiny" in models


def test_final_chunk_timings_fields(pair: list[LlamaServer]) -> None:
    r = stream_chat(pair[0].url, [{"role": "user", "content": "timings please"}], max_tokens=5)
    assert r.timings is not None
    for key in ("cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms",
                "predicted_per_token_ms"):  # fmt: skip
        assert key in r.timings, key
    t = r.timings
    assert t["predicted_n"] == 5
    assert r.usage is not None
    # The engine's own accounting and the OpenAI usage agree: prompt = cached + processed.
    assert r.usage["prompt_tokens"] == t["cache_n"] + t["prompt_n"]
    assert r.usage["prompt_tokens_details"]["cached_tokens"] == t["cache_n"]
    assert r.usage["completion_tokens"] == t["predicted_n"]
    # The engine's prefill time is a lower bound for the TTFT any client can observe.
    assert r.ttft * 1000 >= t["prompt_ms"]
    assert t["predicted_ms"] > 0 and t["predicted_per_token_ms"] > 0


def test_prefix_cache_is_per_instance(pair: list[LlamaServer]) -> None:
    """Cold on A, warm on A for the same system prompt, cold again on B.

    The token counts are exact engine facts; the timing ratios are kept loose because the
    machine is shared, but the effect is ~10x so a 2.5x bound is still meaningful.
    """
    a, b = pair
    system = {"role": "system", "content": long_system_prompt()}

    cold = stream_chat(a.url, [system, {"role": "user", "content": "first question"}])
    warm = stream_chat(a.url, [system, {"role": "user", "content": "second question"}])
    other = stream_chat(b.url, [system, {"role": "user", "content": "second question"}])
    for r in (cold, warm, other):
        assert r.timings is not None and r.usage is not None

    prompt_tokens = cold.usage["prompt_tokens"]  # type: ignore[index]
    assert prompt_tokens > 1000  # the prompts are long enough for prefill to dominate TTFT
    # Cold: only the chat template's opening tokens can match whatever a slot held before.
    assert cold.timings["cache_n"] < 32  # type: ignore[index]
    # Warm: everything up to where the user turns differ comes from the slot's KV cache.
    assert warm.timings["cache_n"] > prompt_tokens - 32  # type: ignore[index]
    assert warm.usage["prompt_tokens_details"]["cached_tokens"] == warm.timings["cache_n"]  # type: ignore[index]
    # Another instance never saw the prefix: cold again, exactly what routing must avoid.
    assert other.timings["cache_n"] < 32  # type: ignore[index]
    assert other.timings["prompt_n"] > prompt_tokens - 32  # type: ignore[index]

    # Engine-side prefill time and client-side TTFT both show it.
    assert cold.timings["prompt_ms"] > 2.5 * warm.timings["prompt_ms"]  # type: ignore[index]
    assert other.timings["prompt_ms"] > 2.5 * warm.timings["prompt_ms"]  # type: ignore[index]
    assert cold.ttft > 2.5 * warm.ttft
    assert other.ttft > 2.5 * warm.ttft


def test_metrics_names_and_counters(pair: list[LlamaServer]) -> None:
    b = pair[1]
    before = b.metrics()
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:requests_processing",
                 "llamacpp:requests_deferred", "llamacpp:tokens_predicted_total",
                 "llamacpp:prompt_tokens_cached_total"):  # fmt: skip
        assert name in before, name
    r = stream_chat(b.url, [{"role": "user", "content": f"count me {time.time_ns()}"}], 3)
    assert r.timings is not None
    after = b.metrics()
    # prompt_tokens_total counts tokens actually prefilled, i.e. not the cached ones.
    assert (
        after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"]
        == r.timings["prompt_n"]
    )
    # Not in llama.cpp's README, but present: the engine-side cache-hit counter, the ground
    # truth for "did routing land this prefix where it was cached".
    assert (
        after["llamacpp:prompt_tokens_cached_total"] - before["llamacpp:prompt_tokens_cached_total"]
        == r.timings["cache_n"]
    )
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == 3
    assert after["llamacpp:requests_processing"] == 0
    assert after["llamacpp:requests_deferred"] == 0


def test_metrics_show_processing_and_deferred_under_load(llamacpp_engine: Engine) -> None:
    """With one slot and two long requests, one runs and one waits: the load signals."""
    with running_servers(llamacpp_engine, 1, parallel=1, ctx=4096) as [server]:
        results: list[object] = []

        def go() -> None:
            results.append(
                stream_chat(server.url, [{"role": "user", "content": "busy"}], max_tokens=400)
            )

        threads = [threading.Thread(target=go) for _ in range(2)]
        for t in threads:
            t.start()
        seen = {"processing": 0.0, "deferred": 0.0}
        deadline = time.monotonic() + 30
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            m = server.metrics()
            seen["processing"] = max(seen["processing"], m["llamacpp:requests_processing"])
            seen["deferred"] = max(seen["deferred"], m["llamacpp:requests_deferred"])
            if seen["processing"] >= 1 and seen["deferred"] >= 1:
                break
            time.sleep(0.02)
        for t in threads:
            t.join(60)
        assert len(results) == 2
        assert seen["processing"] == 1
        assert seen["deferred"] == 1
