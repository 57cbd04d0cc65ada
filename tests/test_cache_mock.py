"""The bench mock's engine mode: a prefix cache it keeps to itself, serial prefill, and the
zero-latency default left byte for byte as it was.

The cache model is pure, so its cases are byte strings (one token a byte); the engine is then
driven over real loopback HTTP with the official `openai` client.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from proxy.bench.mock import (
    EngineSettings,
    MockBackend,
    MockEngine,
    PrefixCache,
    build_parser,
    main,
    make_app,
    parse_schedule,
    render_prompt,
    resize_on_schedule,
    tokenize,
)
from proxy.upstream.backends import parse_load
from tests.support import ServerThread, eventually, free_port, stop_servers

SYSTEM = "You are a careful assistant who answers briefly and cites its sources. " * 12


# --- the pure cache model ------------------------------------------------------------------


def test_a_repeated_prompt_is_served_from_cache_except_its_last_token() -> None:
    cache = PrefixCache(capacity_tokens=1000, block_tokens=4)
    prompt = b"0123456789abcdefghij"  # 5 full blocks
    assert cache.admit(prompt) == 0
    assert cache.admit(prompt) == 19  # all 20 cached, but one token is always computed
    assert cache.admit(prompt + b"xy") == 20  # the partial block is never cached
    stats = cache.stats()
    assert (stats.requests, stats.prompt_tokens, stats.cached_tokens) == (3, 62, 39)
    assert stats.used_tokens == 20 and stats.evictions == 0


def test_the_cached_prefix_ends_at_the_first_block_that_differs() -> None:
    cache = PrefixCache(1000, block_tokens=4)
    cache.admit(b"aaaabbbbccccdddd")
    assert cache.lookup(b"aaaabbbXccccdddd") == 4  # later blocks hash their whole prefix
    assert cache.lookup(b"aaaabbbbccccZZZZ") == 12
    assert cache.lookup(b"Xaaabbbbccccdddd") == 0
    assert cache.lookup(b"aaaabbbbccccdddd") == 15


def test_the_least_recently_used_prompt_is_evicted_first() -> None:
    cache = PrefixCache(capacity_tokens=16, block_tokens=4)  # four blocks
    a, b, c = b"AAAAaaaa", b"BBBBbbbb", b"CCCCcccc"
    cache.admit(a)
    cache.admit(b)
    assert cache.admit(a) == 7  # a is now the most recently used
    cache.admit(c)
    assert (cache.lookup(a), cache.lookup(b), cache.lookup(c)) == (7, 0, 7)
    assert cache.stats().evictions == 2 and cache.used_tokens == 16


def test_a_prompt_loses_its_tail_before_its_head() -> None:
    cache = PrefixCache(capacity_tokens=16, block_tokens=4)
    long = b"0000111122223333"
    cache.admit(long)
    cache.admit(b"XXXXYYYY")  # needs two blocks: the long prompt's last two go
    assert cache.lookup(long) == 8
    small = PrefixCache(capacity_tokens=8, block_tokens=4)
    small.admit(long)  # longer than the whole cache: its head is what stays
    assert small.lookup(long) == 8


def test_resizing_evicts_the_least_recently_used_blocks_and_zero_forgets_everything() -> None:
    cache = PrefixCache(capacity_tokens=100, block_tokens=4)
    old, new = b"oldooldo", b"newnnewn"
    cache.admit(old)
    cache.admit(new)
    cache.resize(9)  # two blocks (a partial block of capacity holds nothing)
    assert cache.capacity_tokens == 9 and cache.used_tokens == 8
    assert (cache.lookup(old), cache.lookup(new)) == (0, 7)
    cache.resize(0)
    assert cache.used_tokens == 0 and cache.lookup(new) == 0 and cache.admit(new) == 0
    assert cache.stats().evictions == 4
    cache.resize(100)
    cache.admit(new)
    assert cache.lookup(new) == 7
    with pytest.raises(ValueError, match=">= 0"):
        cache.resize(-1)


def test_prompts_are_rendered_role_by_role_and_cut_into_three_character_tokens() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ]
    }
    assert render_prompt(body) == "<|system|>Be brief.<|user|>hi<|assistant|>"
    assert render_prompt({"prompt": "Once upon"}) == "Once upon"
    assert tokenize("abcdefg") == ["abc", "def", "g"]
    # Two chats with one system prompt share their leading tokens, whatever the user says.
    one = tokenize(render_prompt({"messages": [{"role": "system", "content": SYSTEM}]}))
    two = tokenize(render_prompt({"messages": [{"role": "system", "content": SYSTEM + "x"}]}))
    assert one[: len(SYSTEM) // 3] == two[: len(SYSTEM) // 3]


def test_a_schedule_reads_seconds_and_tokens_and_names_the_format_when_wrong() -> None:
    assert parse_schedule("120:6000, 60:2000") == [(60.0, 2000), (120.0, 6000)]
    with pytest.raises(ValueError, match="SECONDS:TOKENS"):
        parse_schedule("60=2000")
    with pytest.raises(ValueError, match="SECONDS:TOKENS"):
        parse_schedule("60:-1")


async def test_a_schedule_resizes_every_engine() -> None:
    engines = [MockEngine(EngineSettings(cache_tokens=4000)) for _ in range(2)]
    await resize_on_schedule(engines, [(0.0, 640)])
    assert [e.cache.capacity_tokens for e in engines] == [640, 640]


# --- the engine over HTTP -----------------------------------------------------------------


@pytest.fixture
def engine_server() -> Iterator[Callable[..., tuple[MockEngine, str]]]:
    started: list[ServerThread] = []

    def start(chunks: int = 4, **settings: Any) -> tuple[MockEngine, str]:
        engine = MockEngine(EngineSettings(**{"cache_tokens": 4000, **settings}))
        server = ServerThread(MockBackend(engine, chunks=chunks, model="mock-engine")).start()
        started.append(server)
        return engine, server.url

    yield start
    stop_servers(started)


@pytest.mark.e2e
async def test_openai_client_sees_cached_tokens_on_a_repeat_and_none_after_a_resize_to_zero(
    engine_server: Any,
) -> None:
    _, url = engine_server(prefill_tokens_per_s=1e6)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="mock")
    messages: Any = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]

    async def streamed() -> Any:
        usage, parts = None, []
        async with await client.chat.completions.create(
            model="mock-engine",
            messages=messages,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        ) as chunks:
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                usage = chunk.usage or usage
        assert "".join(parts) == "tok0 tok1 tok2 "
        return usage

    first = await streamed()
    second = await streamed()
    whole = await client.chat.completions.create(
        model="mock-engine", messages=messages, max_tokens=3
    )
    assert [m.id for m in (await client.models.list()).data] == ["mock-engine"]
    async with httpx.AsyncClient(base_url=url) as http:
        resized = (await http.post("/mock/cache", json={"tokens": 0})).json()
        after = await streamed()
        stats = (await http.get("/mock/cache")).json()
        refused = await http.post("/mock/cache", json={"tokens": -5})
    await client.close()

    prompt_tokens = len(tokenize(render_prompt({"messages": messages})))
    assert first.prompt_tokens == prompt_tokens and first.prompt_tokens_details.cached_tokens == 0
    cached = second.prompt_tokens_details.cached_tokens
    assert cached == prompt_tokens // 32 * 32 and cached > 0.9 * prompt_tokens
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens == cached
    assert whole.usage.completion_tokens == 3 and whole.choices[0].finish_reason == "length"
    assert resized["capacity_tokens"] == 0 and resized["used_tokens"] == 0
    assert after.prompt_tokens_details.cached_tokens == 0
    assert stats["requests"] == 4 and stats["cached_tokens"] == 2 * cached
    assert stats["prompt_tokens"] == 4 * prompt_tokens and stats["evictions"] > 0
    assert refused.status_code == 400 and "tokens" in refused.json()["error"]["message"]


@pytest.mark.e2e
async def test_the_engine_publishes_nothing_about_its_cache_size(engine_server: Any) -> None:
    _, url = engine_server(cache_tokens=4567)
    async with httpx.AsyncClient(base_url=url) as http:
        await http.post("/v1/completions", json={"prompt": SYSTEM, "max_tokens": 2})
        metrics = await http.get("/metrics")
        public = [await http.get(p) for p in ("/v1/models", "/health")]
    assert metrics.status_code == 200 and "mock_requests_total 1" in metrics.text
    assert "cache_config_info" not in metrics.text
    assert all("4567" not in r.text and "142" not in r.text for r in [metrics, *public])
    # What the proxy's scraper reads from it, taking it for a vLLM: nothing at all.
    assert parse_load("vllm", metrics.text, now=0.0) is None


@pytest.mark.e2e
async def test_prefill_is_serial_so_a_request_waits_behind_a_long_one(engine_server: Any) -> None:
    engine, url = engine_server(prefill_tokens_per_s=1000)
    finished: list[str] = []

    async def send(http: httpx.AsyncClient, name: str, chars: int) -> None:
        body = {"prompt": name + "x" * chars, "max_tokens": 1}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        finished.append(name)

    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        long = asyncio.create_task(send(http, "long", 3000))  # 1000 tokens: a second
        await eventually(lambda: engine.cache.requests == 1)  # it holds the engine now
        short = asyncio.create_task(send(http, "short", 3))
        await eventually(lambda: engine.waiting == 1)
        await asyncio.gather(long, short)
    assert finished == ["long", "short"] and engine.waiting == 0


@pytest.mark.e2e
async def test_a_bad_body_or_path_gets_an_openai_shaped_error(engine_server: Any) -> None:
    _, url = engine_server()
    async with httpx.AsyncClient(base_url=url) as http:
        bad = await http.post("/v1/chat/completions", content=b"{nope")
        wrong_method = await http.get("/v1/chat/completions")
        missing = await http.get("/v2/anything")
    assert [r.status_code for r in (bad, wrong_method, missing)] == [400, 405, 404]
    assert all(r.json()["error"]["message"] for r in (bad, wrong_method, missing))


# --- the zero-latency default and the command line ----------------------------------------


async def test_the_zero_latency_default_answers_byte_for_byte_as_before() -> None:
    sent: list[dict[str, Any]] = []
    body = [{"type": "http.request", "body": b'{"stream_options":{"include_usage":true}}'}]

    async def receive() -> dict[str, Any]:
        return body.pop(0)

    async def send(message: Any) -> None:
        sent.append(message)

    await make_app(2)({"type": "http", "method": "POST", "path": "/x"}, receive, send)
    head = b'data: {"id":"chatcmpl-mock","object":"chat.completion.chunk","created":0,'
    head += b'"model":"mock","choices":'
    assert sent == [
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        },
        {
            "type": "http.response.body",
            "body": head + b'[{"index":0,"delta":{"content":"tok0 "},"finish_reason":null}]}\n\n',
            "more_body": True,
        },
        {
            "type": "http.response.body",
            "body": head + b'[{"index":0,"delta":{"content":"tok1 "},"finish_reason":null}]}\n\n',
            "more_body": True,
        },
        {
            "type": "http.response.body",
            "body": head
            + b'[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
            + head
            + b'[],"usage":{"prompt_tokens":16,"completion_tokens":2,"total_tokens":18}}\n\n'
            + b"data: [DONE]\n\n",
        },
    ]


def test_help_teaches_the_engine_model_and_flags_need_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = build_parser().format_help()
    for needle in ("--cache-tokens", "POST /mock/cache", "3-character tokens", "examples:"):
        assert needle in text
    with pytest.raises(SystemExit) as exit_:
        main(["--prefill-tokens-per-s", "5"])
    assert exit_.value.code == 2 and "--cache-tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--chunk-interval-ms", "-1"])
    assert exit_.value.code == 2 and "--chunk-interval-ms" in capsys.readouterr().err


async def test_the_zero_latency_mock_paces_its_chunks_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--chunk-interval-ms without the engine model: the same bytes, one content chunk per
    write, the interval slept between content chunks (not before the first, nor the tail)."""
    events: list[Any] = []

    async def sleep(seconds: float) -> None:
        events.append(("sleep", seconds))

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}"}

    async def send(message: Any) -> None:
        events.append(message.get("body", b"")[:14] if "body" in message else message["type"])

    serve_module = sys.modules["proxy.bench.mock.serve"]  # (the package exports serve())
    monkeypatch.setattr(serve_module.asyncio, "sleep", sleep)
    await make_app(3, interval_s=0.02)(
        {"type": "http", "method": "POST", "path": "/x"}, receive, send
    )
    chunk = b'data: {"id":"c'
    assert events == [
        "http.response.start",
        chunk,
        ("sleep", 0.02),
        chunk,
        ("sleep", 0.02),
        chunk,
        chunk,  # the finish chunk and [DONE], in one write
    ]


def _start_mock(*args: str) -> tuple[subprocess.Popen[str], int, list[str]]:
    """Start the mock on two consecutive ports and read stderr up to its ready line. Another
    process may take port + 1 before the mock binds it: then it exits and we try again."""
    lines: list[str] = []
    for _ in range(3):
        port = free_port(2)
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.bench.mock", "--port", str(port), "--instances", "2",
             *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "engine(s) on" in line:
                return proc, port, lines
        proc.wait(timeout=10)
    raise AssertionError(f"the mock did not start: {lines}")


@pytest.mark.e2e
def test_the_command_serves_engines_on_consecutive_ports_until_sigterm() -> None:
    proc, port, lines = _start_mock("--cache-tokens", "3000", "--cache-tokens-schedule", "0:1000")
    try:
        assert any("capacity now 1000 tokens" in line for line in lines), lines
        assert f"http://127.0.0.1:{port}..{port + 1}" in lines[-1]
        stats = [httpx.get(f"http://127.0.0.1:{p}/mock/cache").json() for p in (port, port + 1)]
        assert [s["capacity_tokens"] for s in stats] == [1000, 1000]
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught
        assert proc.wait(timeout=10) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
