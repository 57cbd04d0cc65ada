"""warmroute in front of real llama.cpp engines: what clients see is what the engine sent.

Two llama-server instances (tiny deterministic model, CPU) behind the real proxy app. At
temperature 0 the engine is deterministic, so a request sent directly and one sent through
the proxy must give the same stream apart from per-response ids, timestamps and the
cache-dependent counters, whichever instance the proxy picked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
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
from tests.support import ServerThread

pytestmark = [pytest.mark.llamacpp, pytest.mark.e2e]

__all__ = ["llamacpp_engine"]  # the fixture, re-exported so pytest finds it in this module

MAX_TOKENS = 6
ENGINE_COUNTERS = (
    "llamacpp:prompt_tokens_total",  # prefilled (uncached) prompt tokens
    "llamacpp:prompt_tokens_cached_total",
    "llamacpp:tokens_predicted_total",
)


@pytest.fixture(scope="module")
def pair(llamacpp_engine: Engine) -> Iterator[list[LlamaServer]]:
    with running_servers(llamacpp_engine, 2) as servers:
        yield servers


def _backends(servers: list[LlamaServer]) -> list[dict[str, Any]]:
    return [{"url": s.url, "engine": "llamacpp"} for s in servers]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _chat(client: openai.OpenAI, content: str, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kwargs,
    )


def _normalized(chunk: dict[str, Any]) -> dict[str, Any]:
    """Drop what legitimately differs per response or per cache state."""
    out = {k: v for k, v in chunk.items() if k not in ("id", "created", "timings")}
    out["has_timings"] = "timings" in chunk
    if out.get("usage"):
        out["usage"] = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    return out


def _stream(client: openai.OpenAI, content: str, **kwargs: Any) -> list[dict[str, Any]]:
    chunks = [
        c.model_dump(exclude_unset=True) for c in _chat(client, content, stream=True, **kwargs)
    ]
    assert len({c["id"] for c in chunks}) == 1  # one response id across the whole stream
    for c in chunks:
        if c.get("usage"):
            # Whatever the cache state, the engine's two accounts of it agree.
            assert c["usage"]["prompt_tokens_details"]["cached_tokens"] == c["timings"]["cache_n"]
    return chunks


def test_openai_client_streams_through_proxy_unchanged(
    pair: list[LlamaServer], proxy_server: Callable[..., ServerThread]
) -> None:
    proxy = proxy_server(
        [s.url for s in pair], config={"backends": _backends(pair)}, policy="round_robin"
    )
    via = _client(proxy.url)
    usage = {"stream_options": {"include_usage": True}}
    for prompt in ("hello", "tell me about prefix caches"):
        # Round robin: two requests through the proxy cover both instances.
        direct = [[_normalized(c) for c in _stream(_client(s.url), prompt, **usage)] for s in pair]
        proxied = [[_normalized(c) for c in _stream(via, prompt, **usage)] for _ in pair]
        assert direct[0] == direct[1]  # the instances agree with each other...
        assert proxied == direct  # ...and the proxy changes nothing
        [last] = [c for c in proxied[0] if c.get("usage")]
        assert last["usage"]["completion_tokens"] == MAX_TOKENS
        assert last["has_timings"]

        # Without include_usage the proxy still meters (it injects the option upstream) but
        # the client gets no usage chunk, exactly as from the engine directly.
        plain_direct = [_normalized(c) for c in _stream(_client(pair[0].url), prompt)]
        plain_via = [_normalized(c) for c in _stream(via, prompt)]
        assert not any(c.get("usage") for c in plain_via)
        strip = [{k: v for k, v in c.items() if k != "has_timings"} for c in plain_direct]
        assert [{k: v for k, v in c.items() if k != "has_timings"} for c in plain_via] == strip

        # Non-streaming passes through too.
        d = _chat(_client(pair[0].url), prompt).model_dump(exclude_unset=True)
        v = _chat(via, prompt).model_dump(exclude_unset=True)
        assert _normalized(v) == _normalized(d)
        assert v["usage"]["completion_tokens"] == MAX_TOKENS


def test_stream_without_usage_keeps_engine_timings(
    pair: list[LlamaServer], proxy_server: Callable[..., ServerThread]
) -> None:
    proxy = proxy_server([s.url for s in pair], config={"backends": _backends(pair)})
    direct = _stream(_client(pair[0].url), "hello")
    via = _stream(_client(proxy.url), "hello")
    assert any("timings" in c for c in direct)
    assert any("timings" in c for c in via)


def test_usage_matches_engine_counters(
    pair: list[LlamaServer], proxy_server: Callable[..., ServerThread]
) -> None:
    """Usage the client sees through the proxy sums to what the engines say they did."""
    proxy = proxy_server(
        [s.url for s in pair], config={"backends": _backends(pair)}, policy="round_robin"
    )
    before = [s.metrics() for s in pair]
    seen = {"prompt": 0, "cached": 0, "completion": 0}
    for i in range(4):
        r = stream_chat(proxy.url, [{"role": "user", "content": f"usage {i}"}], MAX_TOKENS)
        assert r.usage is not None and r.timings is not None
        assert r.usage["prompt_tokens"] == r.timings["cache_n"] + r.timings["prompt_n"]
        seen["prompt"] += r.timings["prompt_n"]
        seen["cached"] += r.usage["prompt_tokens_details"]["cached_tokens"]
        seen["completion"] += r.usage["completion_tokens"]
    after = [s.metrics() for s in pair]

    def delta(name: str) -> float:
        return sum(a[name] - b[name] for a, b in zip(after, before, strict=True))

    assert delta("llamacpp:prompt_tokens_total") == seen["prompt"]
    assert delta("llamacpp:prompt_tokens_cached_total") == seen["cached"]
    assert delta("llamacpp:tokens_predicted_total") == seen["completion"] == 4 * MAX_TOKENS
    # Round robin really spread them: both engines did work.
    assert all(
        a["llamacpp:tokens_predicted_total"] > b["llamacpp:tokens_predicted_total"]
        for a, b in zip(after, before, strict=True)
    )


def test_engine_metrics_feed_load_signals(
    llamacpp_engine: Engine, proxy_server: Callable[..., ServerThread]
) -> None:
    """One slot, two long requests: the proxy's scrape sees one running and one waiting."""
    with running_servers(llamacpp_engine, 1, parallel=1, ctx=4096) as [server]:
        proxy = proxy_server(
            [server.url],
            # The requests go to the engine directly (as another replica's would): to this
            # proxy the engine is idle, scraped at the idle interval, brought down to count.
            config={
                "backends": _backends([server]),
                "health": {
                    "metrics_scrape_s": 0.05,
                    "interval_s": 0.05,
                    "idle_interval_s": 0.05,
                    "idle_checks_per_s": 1000,
                },
            },
        )
        threads = [
            threading.Thread(
                target=stream_chat,
                args=(server.url, [{"role": "user", "content": "busy"}], 400),
            )
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        peak = {"running": 0.0, "waiting": 0.0}
        deadline = time.monotonic() + 30
        with httpx.Client(base_url=proxy.url, timeout=5) as http:
            while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
                [b] = http.get("/admin/backends").json()["backends"]
                for key in peak:
                    peak[key] = max(peak[key], b["load"][key] or 0.0)
                if peak["running"] >= 1 and peak["waiting"] >= 1:
                    break
                time.sleep(0.02)
        for t in threads:
            t.join(60)
        assert peak == {"running": 1.0, "waiting": 1.0}


@pytest.mark.parametrize("policy", ["prefix_aware", "round_robin"])
def test_repeated_system_prompt_lands_where_cached(
    pair: list[LlamaServer], proxy_server: Callable[..., ServerThread], policy: str
) -> None:
    """The engine is the referee: its own `cache_n` says whether routing found the warm slot.

    Each system prompt is sent twice with different user turns. prefix_aware must send the
    second one to the instance that prefilled the first (cache_n ~ the whole prefix, and the
    engines' cached-token counters show it); round robin alternates instances, so the second
    lands on the other, cold one.
    """
    proxy = proxy_server([s.url for s in pair], config={"backends": _backends(pair)}, policy=policy)
    before = [s.metrics() for s in pair]
    second_hits: list[bool] = []
    expected_cached = 0
    for _ in range(2):
        system = {"role": "system", "content": long_system_prompt(words=300)}  # ~570 tokens
        first = stream_chat(proxy.url, [system, {"role": "user", "content": "first turn"}])
        again = stream_chat(proxy.url, [system, {"role": "user", "content": "second turn"}])
        assert first.timings is not None and again.timings is not None and again.usage
        assert first.timings["cache_n"] < 32  # a fresh prompt is cold everywhere
        prompt_tokens = again.usage["prompt_tokens"]
        second_hits.append(again.timings["cache_n"] > prompt_tokens - 32)
        expected_cached += first.timings["cache_n"] + again.timings["cache_n"]
    after = [s.metrics() for s in pair]
    cached = sum(
        a["llamacpp:prompt_tokens_cached_total"] - b["llamacpp:prompt_tokens_cached_total"]
        for a, b in zip(after, before, strict=True)
    )
    assert cached == expected_cached  # the engines' counters tell the same story
    if policy == "prefix_aware":
        assert second_hits == [True, True]
        assert cached > 1000
    else:
        assert second_hits == [False, False]
        assert cached < 4 * 32
