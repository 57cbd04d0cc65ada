"""Streaming OpenAI backends for benchmarks: zero-latency by default, a small engine on demand.

Zero latency (the default): `python -m proxy.bench.mock --port 9101 --instances 2 --chunks 64`
serves chat completions that stream N content chunks (one write each) with no model time at
all, so any latency or CPU a proxy adds in front of it is the proxy's.

Engine mode (--cache-tokens N): every instance becomes a small engine with a prefix cache that
it never publishes, modelled apart from `warmroute sim` and from the proxy's prefix index, so a
cache-aware router is judged on an engine it has no model of:

  tokens   the prompt (chat messages as <|role|>content in order, or the completion prompt)
           cut into 3-character tokens: not the proxy's 4 characters or 64-character blocks
  cache    chained hashes of blocks of --cache-block-tokens tokens (default 32), in an LRU
           holding at most N tokens per instance. A request is served the longest run of leading
           blocks it finds, never the whole prompt (one token is always computed, as in
           vLLM); then every block of its prompt is inserted or touched, tail first, so that
           eviction takes a prompt's tail before its head (vLLM frees blocks that way too)
  prefill  serial: one request at a time holds the instance for
           uncached tokens / --prefill-tokens-per-s seconds (queued requests wait for it)
  decode   free and parallel: min(--chunks, max_tokens) content chunks, --chunk-interval-ms
           apart, after a role chunk
  usage    prompt_tokens (its own tokens), completion_tokens and
           prompt_tokens_details.cached_tokens, streamed (stream_options.include_usage) or not

It publishes no capacity: /metrics holds generic mock_* counters only (no
vllm:cache_config_info), /v1/models lists --model, /health answers 200. The capacity can change
mid-run: POST /mock/cache {"tokens": N} resizes one instance's cache (evicting least recently
used blocks), GET /mock/cache returns its stats as JSON (capacity_tokens, used_tokens,
requests, prompt_tokens, cached_tokens, evictions in blocks), and --cache-tokens-schedule
resizes every instance at set times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import orjson
import uvicorn

from proxy.asgi import (
    SSE,
    SSE_DONE,
    Receive,
    Scope,
    Send,
    read_body,
    respond,
    send_json,
    serve_lifespan,
    sse,
    start_stream,
    stream_chunk,
)

CHARS_PER_TOKEN = 3
DEFAULT_BLOCK_TOKENS = 32
DEFAULT_PREFILL_TOKENS_PER_S = 20_000.0

EPILOG = """\
examples:
  # zero-latency streams, to measure what a proxy adds (ports 9101, 9102)
  python -m proxy.bench.mock --port 9101 --instances 2 --chunks 64

  # four engines (ports 9301-9304) caching 6000 tokens each, prefilling 20k tokens/s
  python -m proxy.bench.mock --port 9301 --instances 4 --cache-tokens 6000 --chunks 16

  # the static-affinity bound a cache-aware router is judged against: prompt i on engine i mod 4
  warmroute bench --direct http://127.0.0.1:9301 --direct http://127.0.0.1:9302 \\
      --direct http://127.0.0.1:9303 --direct http://127.0.0.1:9304 --direct-affinity system \\
      --workload shared-prefix --prefixes 8 --system-chars 8000 --zipf 0 \\
      --requests 400 --concurrency 32

  # shrink one engine's cache mid-run and read its stats
  curl -s 127.0.0.1:9301/mock/cache -d '{"tokens": 2000}'
  curl -s 127.0.0.1:9301/mock/cache

  # every engine drops to 2000 tokens after 60 s and returns to 6000 after 120 s
  python -m proxy.bench.mock --port 9301 --instances 4 --cache-tokens 6000 \\
      --cache-tokens-schedule 60:2000,120:6000

Sizes: the bench's --system-chars 8000 is ~2700 tokens here (3 characters each), ~84 blocks.
"""


def make_app(chunks: int = 64, model: str = "mock") -> Callable[..., Awaitable[None]]:
    event = sse
    base = {"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0, "model": model}
    body_chunks = [
        event(
            {
                **base,
                "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}],
            }
        )
        for i in range(chunks)
    ]
    final = event({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    usage = event(
        {
            **base,
            "choices": [],
            "usage": {
                "prompt_tokens": 16,
                "completion_tokens": chunks,
                "total_tokens": 16 + chunks,
            },
        }
    )
    models = orjson.dumps({"object": "list", "data": [{"id": model, "object": "model"}]})
    head = ((b"content-type", b"text/event-stream"),)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":
            await respond(send, 200, models)
            return
        raw = await read_body(receive)
        await start_stream(send, 200, head)
        for c in body_chunks:
            await stream_chunk(send, c)
        tail = final + (usage if b"include_usage" in raw else b"") + SSE_DONE
        await send({"type": "http.response.body", "body": tail})

    return app


# --- engine mode: the pure cache model --------------------------------------------------


def render_prompt(body: Mapping[str, Any]) -> str:
    """The text the engine reads: chat messages as `<|role|>content` in order, then the
    assistant's tag; or the completion prompt as sent."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = [
            f"<|{m.get('role', '')}|>{_content_text(m.get('content'))}"
            for m in messages
            if isinstance(m, Mapping)
        ]
        return "".join(parts) + "<|assistant|>"
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return "".join(str(p) for p in prompt)
    return str(prompt)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only the text ones reach this engine
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def tokenize(text: str) -> list[str]:
    """Three characters a token: deliberately not the proxy's unit, so that a router's match
    with this engine cannot come from sharing one."""
    return [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]


@dataclass(frozen=True, slots=True)
class CacheStats:
    """What GET /mock/cache answers; evictions count blocks."""

    capacity_tokens: int
    used_tokens: int
    block_tokens: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    evictions: int


class PrefixCache:
    """An LRU of chained block hashes holding at most `capacity_tokens` tokens; pure.

    Tokens are any hashable values (3-character strings from `tokenize`, ints, bytes). Only
    full blocks are cached, as in vLLM; a block's hash covers every token before it, so a
    cached block implies its whole prefix was the same.
    """

    def __init__(self, capacity_tokens: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.capacity_tokens = 0
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.evictions = 0
        self.resize(capacity_tokens)

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_tokens // self.block_tokens

    @property
    def used_tokens(self) -> int:
        return len(self._blocks) * self.block_tokens

    def block_hashes(self, tokens: Sequence[Hashable]) -> list[int]:
        """One chained hash per full block of `tokens`."""
        out: list[int] = []
        parent = 0
        size = self.block_tokens
        for start in range(0, len(tokens) - size + 1, size):
            parent = hash((parent, tuple(tokens[start : start + size])))
            out.append(parent)
        return out

    def lookup(self, tokens: Sequence[Hashable]) -> int:
        """Cached tokens a prompt would be served now, without touching the LRU."""
        return self._cached(tokens, self.block_hashes(tokens))

    def admit(self, tokens: Sequence[Hashable]) -> int:
        """Serve one prompt: return its cached tokens, then insert or touch all its blocks."""
        hashes = self.block_hashes(tokens)
        cached = self._cached(tokens, hashes)
        # Tail first, so the prompt's first block ends most recently used: under pressure a
        # prompt loses its tail before its head and keeps a usable prefix. Of a prompt longer
        # than the whole cache only the head that fits is kept.
        for h in reversed(hashes[: self.capacity_blocks]):
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                self._blocks[h] = None
        self._evict()
        self.requests += 1
        self.prompt_tokens += len(tokens)
        self.cached_tokens += cached
        return cached

    def resize(self, capacity_tokens: int) -> None:
        """Change the capacity; shrinking evicts the least recently used blocks at once."""
        if capacity_tokens < 0:
            raise ValueError(f"capacity must be >= 0 tokens, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self._evict()

    def stats(self) -> CacheStats:
        return CacheStats(
            capacity_tokens=self.capacity_tokens,
            used_tokens=self.used_tokens,
            block_tokens=self.block_tokens,
            requests=self.requests,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            evictions=self.evictions,
        )

    def _cached(self, tokens: Sequence[Hashable], hashes: Sequence[int]) -> int:
        hit = 0
        for h in hashes:
            if h not in self._blocks:
                break
            hit += 1
        # At least one token is computed, so a fully cached prompt still yields its logits.
        return max(0, min(hit * self.block_tokens, len(tokens) - 1))

    def _evict(self) -> None:
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
            self.evictions += 1


def parse_schedule(text: str) -> list[tuple[float, int]]:
    """`"60:2000,120:6000"` -> [(60.0, 2000), (120.0, 6000)]: seconds after start, tokens."""
    out: list[tuple[float, int]] = []
    for part in text.split(","):
        at, sep, tokens = part.strip().partition(":")
        try:
            entry = (float(at), int(tokens))
        except ValueError:
            entry = (-1.0, -1)
        if not sep or entry[0] < 0 or entry[1] < 0:
            raise ValueError(
                f"bad schedule entry {part.strip()!r}: use SECONDS:TOKENS, e.g. 60:2000,120:6000"
            )
        out.append(entry)
    return sorted(out)


# --- engine mode: the ASGI shell ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The knobs of one engine-mode instance (the CLI's --cache-* and timing flags)."""

    cache_tokens: int
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    chunk_interval_s: float = 0.0

    def __post_init__(self) -> None:
        if self.cache_tokens < 0 or self.block_tokens < 1:
            raise ValueError("cache_tokens must be >= 0 and block_tokens >= 1")
        if self.prefill_tokens_per_s <= 0 or self.chunk_interval_s < 0:
            raise ValueError("prefill_tokens_per_s must be > 0 and chunk_interval_s >= 0")


class MockEngine:
    """One instance: its prefix cache and the lock that makes prefill serial."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.cache = PrefixCache(settings.cache_tokens, settings.block_tokens)
        self._prefill = asyncio.Lock()
        self.waiting = 0  # requests queued for prefill
        self.running = 0  # requests streaming their answer
        self.generation_tokens = 0

    async def prefill(self, tokens: Sequence[Hashable]) -> int:
        """Wait for the engine, then hold it while the uncached tokens are computed; returns
        the cached tokens. The cache is looked up when the request's turn comes, as an
        engine's scheduler does, so a queued request finds what the one before it left."""
        self.waiting += 1
        try:
            await self._prefill.acquire()
        finally:
            self.waiting -= 1
        try:
            cached = self.cache.admit(tokens)
            await asyncio.sleep((len(tokens) - cached) / self.settings.prefill_tokens_per_s)
        finally:
            self._prefill.release()
        return cached

    def metrics_text(self) -> str:
        """Generic counters only: nothing here names or implies the cache's size."""
        s = self.cache.stats()
        rows = (
            ("mock_requests", "counter", "Requests prefilled.", s.requests),
            ("mock_prompt_tokens", "counter", "Prompt tokens received.", s.prompt_tokens),
            ("mock_cached_tokens", "counter", "Prompt tokens served from cache.", s.cached_tokens),
            ("mock_generation_tokens", "counter", "Tokens streamed.", self.generation_tokens),
            ("mock_requests_waiting", "gauge", "Requests queued for prefill.", self.waiting),
            ("mock_requests_running", "gauge", "Requests streaming.", self.running),
        )
        lines = []
        for name, kind, help_, value in rows:
            sample = f"{name}_total" if kind == "counter" else name
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{sample} {value}"]
        return "\n".join(lines) + "\n"


class EngineApp:
    """The ASGI shell around a MockEngine: OpenAI chat and completions (streamed or not),
    /v1/models, /health, /metrics and /mock/cache."""

    def __init__(self, engine: MockEngine, chunks: int = 64, model: str = "mock") -> None:
        self.engine = engine
        self.chunks = chunks
        self.model = model
        self._ids = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"].rstrip("/")
        if path in ("/v1/chat/completions", "/v1/completions"):
            if method != "POST":
                await _error(send, 405, f"use POST for {path}")
                return
            await self._complete(await read_body(receive), send, path.endswith("chat/completions"))
        elif path == "/v1/models":
            data = [{"id": self.model, "object": "model", "owned_by": "warmroute-mock"}]
            await send_json(send, 200, {"object": "list", "data": data})
        elif path == "/health":
            await respond(send, 200, b"", b"text/plain")
        elif path == "/metrics":
            text = self.engine.metrics_text().encode()
            await respond(send, 200, text, b"text/plain; version=0.0.4")
        elif path == "/mock/cache":
            if method == "POST":
                await self._resize(await read_body(receive), send)
            else:
                await send_json(send, 200, asdict(self.engine.cache.stats()))
        else:
            await _error(send, 404, f"no route {path}")

    async def _resize(self, raw: bytes, send: Send) -> None:
        try:
            tokens = orjson.loads(raw).get("tokens")
        except (orjson.JSONDecodeError, AttributeError):
            tokens = None
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            await _error(send, 400, 'send a JSON object {"tokens": N} with N >= 0')
            return
        self.engine.cache.resize(tokens)
        await send_json(send, 200, asdict(self.engine.cache.stats()))

    async def _complete(self, raw: bytes, send: Send, chat: bool) -> None:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            await _error(send, 400, "the request body must be a JSON object")
            return
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        limit = limit if isinstance(limit, int) and limit > 0 else None
        n_out = min(self.chunks, limit) if limit else self.chunks
        finish = "length" if limit is not None and n_out >= limit else "stop"
        self._ids += 1
        answer = _Answer(
            f"{'chatcmpl' if chat else 'cmpl'}-mock{self._ids}", self.model, chat, int(time.time())
        )
        tokens = tokenize(render_prompt(body))
        streaming = bool(body.get("stream"))
        if streaming:  # headers at once, as an engine's HTTP layer sends them
            await start_stream(send, 200, SSE)
        cached = await self.engine.prefill(tokens)
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": n_out,
            "total_tokens": len(tokens) + n_out,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        interval = self.engine.settings.chunk_interval_s
        self.engine.running += 1
        try:
            if not streaming:
                if interval and n_out > 1:
                    await asyncio.sleep(interval * (n_out - 1))
                self.engine.generation_tokens += n_out
                text = "".join(f"tok{i} " for i in range(n_out))
                await send_json(send, 200, answer.whole(text, finish, usage))
                return
            if chat:
                await _event(send, answer.chunk({"role": "assistant", "content": ""}, None))
            for i in range(n_out):
                if i and interval:
                    await asyncio.sleep(interval)
                await _event(send, answer.chunk({"content": f"tok{i} "}, None))
                self.engine.generation_tokens += 1
            tail = sse(answer.chunk({}, finish))
            options = body.get("stream_options")
            if isinstance(options, dict) and options.get("include_usage"):
                tail += sse({**answer.head(), "choices": [], "usage": usage})
            await send({"type": "http.response.body", "body": tail + SSE_DONE})
        finally:
            self.engine.running -= 1


@dataclass(frozen=True, slots=True)
class _Answer:
    """Renders one response's chunks in the OpenAI shapes (chat or text completion)."""

    id: str
    model: str
    chat: bool
    created: int

    def head(self) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, delta: dict[str, str], finish: str | None) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {
                "index": 0,
                "text": delta.get("content", ""),
                "logprobs": None,
                "finish_reason": finish,
            }
        return {**self.head(), "choices": [choice]}

    def whole(self, text: str, finish: str, usage: dict[str, Any]) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion"
            message = {"role": "assistant", "content": text}
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        else:
            kind = "text_completion"
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self.head(), "object": kind, "choices": [choice], "usage": usage}


async def _event(send: Send, obj: Any) -> None:
    await stream_chunk(send, sse(obj))


async def _error(send: Send, status: int, message: str) -> None:
    kind = "invalid_request_error" if status < 500 else "server_error"
    await send_json(send, status, {"error": {"message": message, "type": kind, "code": status}})


# --- serving ------------------------------------------------------------------------------


async def resize_on_schedule(
    engines: Sequence[MockEngine], schedule: Sequence[tuple[float, int]]
) -> None:
    """Resize every engine's cache at each (seconds after start, tokens) of the schedule."""
    start = time.monotonic()
    for at, tokens in schedule:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        for engine in engines:
            engine.cache.resize(tokens)
        print(f"mock: t={at:g}s cache capacity now {tokens} tokens", file=sys.stderr, flush=True)


async def serve(
    port: int,
    instances: int,
    chunks: int,
    *,
    model: str = "mock",
    engine: EngineSettings | None = None,
    schedule: Sequence[tuple[float, int]] = (),
) -> None:
    engines = [MockEngine(engine) for _ in range(instances)] if engine else []
    apps: list[Callable[..., Awaitable[None]]] = [EngineApp(e, chunks, model) for e in engines]
    if not engine:
        apps = [make_app(chunks, model) for _ in range(instances)]
    servers = [
        _Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=port + i,
                log_level="warning",
                access_log=False,
                lifespan="off",
            )
        )
        for i, app in enumerate(apps)
    ]
    helpers = [asyncio.create_task(resize_on_schedule(engines, schedule))] if schedule else []
    if engine:
        helpers.append(asyncio.create_task(_announce(servers, engine, port)))
    try:
        await asyncio.gather(*(s.serve() for s in servers))
    finally:
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)


class _Server(uvicorn.Server):
    """uvicorn's server with an event set once it listens."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.listening.set()


async def _announce(servers: Sequence[_Server], engine: EngineSettings, port: int) -> None:
    """One line on stderr once every instance listens: what runs where (scripts wait on it)."""
    for server in servers:
        await server.listening.wait()
    last = port + len(servers) - 1
    print(
        f"mock: {len(servers)} engine(s) on http://127.0.0.1:{port}..{last}, "
        f"{engine.cache_tokens}-token prefix cache each ({engine.block_tokens}-token blocks), "
        f"prefill {engine.prefill_tokens_per_s:g} tokens/s; GET/POST /mock/cache",
        file=sys.stderr,
        flush=True,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m proxy.bench.mock",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--port", type=int, default=9101, help="port of the first instance")
    p.add_argument("--instances", type=int, default=1, help="servers on consecutive ports")
    p.add_argument("--chunks", type=int, default=64, help="content chunks per response")
    p.add_argument("--model", default="mock", help="model name /v1/models lists (default mock)")
    g = p.add_argument_group("engine mode (off unless --cache-tokens > 0)")
    g.add_argument(
        "--cache-tokens",
        type=int,
        default=0,
        metavar="N",
        help="prefix cache per instance, in the mock's 3-character tokens; > 0 turns the engine "
        "model on (default 0: zero-latency streams)",
    )
    g.add_argument(
        "--cache-block-tokens",
        type=int,
        default=None,
        metavar="B",
        help=f"tokens per cached block (default {DEFAULT_BLOCK_TOKENS})",
    )
    g.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=None,
        metavar="R",
        help=f"serial prefill speed of uncached tokens (default {DEFAULT_PREFILL_TOKENS_PER_S:g})",
    )
    g.add_argument(
        "--chunk-interval-ms",
        type=float,
        default=None,
        metavar="MS",
        help="gap between streamed chunks (default 0)",
    )
    g.add_argument(
        "--cache-tokens-schedule",
        default=None,
        metavar="S:N,...",
        help="resize every instance's cache to N tokens S seconds after start, e.g. "
        "60:2000,120:6000",
    )
    return p


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def main(argv: Sequence[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    if args.instances < 1 or args.chunks < 1:
        p.error("--instances and --chunks must be >= 1")
    if args.cache_tokens < 0:
        p.error("--cache-tokens must be >= 0 (0: zero-latency streams, no engine model)")
    engine_flags = {
        "--cache-block-tokens": args.cache_block_tokens,
        "--prefill-tokens-per-s": args.prefill_tokens_per_s,
        "--chunk-interval-ms": args.chunk_interval_ms,
        "--cache-tokens-schedule": args.cache_tokens_schedule,
    }
    given = [flag for flag, value in engine_flags.items() if value is not None]
    engine: EngineSettings | None = None
    schedule: list[tuple[float, int]] = []
    if args.cache_tokens == 0 and given:
        p.error(f"{', '.join(given)} only apply to the engine model: add --cache-tokens N > 0")
    if args.cache_block_tokens is not None and args.cache_block_tokens < 1:
        p.error("--cache-block-tokens must be >= 1")
    if args.prefill_tokens_per_s is not None and args.prefill_tokens_per_s <= 0:
        p.error("--prefill-tokens-per-s must be > 0")
    if args.chunk_interval_ms is not None and args.chunk_interval_ms < 0:
        p.error("--chunk-interval-ms must be >= 0")
    if args.cache_tokens > 0:
        try:
            engine = EngineSettings(
                cache_tokens=args.cache_tokens,
                block_tokens=_or(args.cache_block_tokens, DEFAULT_BLOCK_TOKENS),
                prefill_tokens_per_s=_or(args.prefill_tokens_per_s, DEFAULT_PREFILL_TOKENS_PER_S),
                chunk_interval_s=_or(args.chunk_interval_ms, 0.0) / 1000,
            )
            if args.cache_tokens_schedule:
                schedule = parse_schedule(args.cache_tokens_schedule)
        except ValueError as e:
            p.error(str(e))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(
            serve(
                args.port,
                args.instances,
                args.chunks,
                model=args.model,
                engine=engine,
                schedule=schedule,
            )
        )


if __name__ == "__main__":
    main()
