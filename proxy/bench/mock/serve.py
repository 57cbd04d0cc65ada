"""`python -m proxy.bench.mock`: OpenAI backends for benchmarks, zero-latency by default, a
small engine on demand.

Zero latency (the default): `python -m proxy.bench.mock --port 9101 --instances 2 --chunks 64`
serves chat completions that stream N content chunks (one write each) with no model time at
all, so any latency or CPU a proxy adds in front of it is the proxy's. --chunk-interval-ms
paces the content chunks (each its own read at the proxy, as an engine's tokens arrive) with
no other model time: what a proxy spends per streamed chunk.

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
           uncached tokens / --prefill-tokens-per-s seconds (queued requests wait for it, in
           arrival order; with --priority-scheduling by the request's `priority`, lower
           first, as vLLM's --scheduling-policy priority; without it a `priority` other than 0
           is refused with vLLM's 400). With --prefill-chunk-tokens N, in steps as vLLM's V1
           scheduler runs chunked prefill: each step computes at most N prompt tokens
           (vLLM's --max-num-batched-tokens; `vllm serve` defaults to 2048, 8192 on GPUs of
           70 GiB or more but the A100) and lasts their time; the prompts begun continue
           first, the budget left goes to waiting ones by arrival or `priority`. vLLM does not
           preempt a begun prompt for a higher-priority arrival; --preempt-prefill models an
           engine that does, between steps (every unfinished prompt by priority, then arrival)
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
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
import uvicorn

from proxy.asgi import (
    SSE_DONE,
    Receive,
    Scope,
    Send,
    read_body,
    respond,
    sse,
    start_stream,
    stream_chunk,
)
from proxy.bench.mock.backend import MockBackend
from proxy.bench.mock.cache import DEFAULT_BLOCK_TOKENS, parse_schedule
from proxy.bench.mock.engine import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    VLLM_BATCHED_TOKENS,
    EngineSettings,
    MockEngine,
)
from proxy.heap import freeze_startup_heap

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


def make_app(
    chunks: int = 64, model: str = "mock", interval_s: float = 0.0
) -> Callable[..., Awaitable[None]]:
    """Zero latency: every byte of the answer made once, so that any latency or CPU a proxy
    adds in front of it is the proxy's (docs/benchmarks.md's overhead numbers were measured
    on it). `interval_s` paces the content chunks as an engine's decode would (each chunk its
    own read at the proxy), with no other model time."""
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
        if interval_s:
            for i, c in enumerate(body_chunks):
                if i:
                    await asyncio.sleep(interval_s)
                await stream_chunk(send, c)
        else:
            for c in body_chunks:
                await stream_chunk(send, c)
        tail = final + (usage if b"include_usage" in raw else b"") + SSE_DONE
        await send({"type": "http.response.body", "body": tail})

    return app


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
    interval_s: float = 0.0,
) -> None:
    engines = [MockEngine(engine) for _ in range(instances)] if engine else []
    apps: list[Callable[..., Awaitable[None]]] = [MockBackend(e, chunks, model) for e in engines]
    if not engine:
        apps = [make_app(chunks, model, interval_s) for _ in range(instances)]
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
    # Built: its startup heap out of every full collection's scan, which paused every engine's
    # streams at once (12-23 ms, once or twice in a run of 8,000 requests) and read as the
    # latency of whatever is measured in front of it.
    freeze_startup_heap()
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
        f"prefill {engine.prefill_tokens_per_s:g} tokens/s{_steps(engine)}; GET/POST /mock/cache",
        file=sys.stderr,
        flush=True,
    )


def _steps(engine: EngineSettings) -> str:
    if not engine.prefill_chunk_tokens:
        return ""
    preempt = ", preempting by priority" if engine.preempt_prefill else ""
    return f" in steps of {engine.prefill_chunk_tokens} tokens{preempt}"


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
    p.add_argument(
        "--chunk-interval-ms",
        type=float,
        default=None,
        metavar="MS",
        help="gap between content chunks, as an engine decodes (default 0: all at once); "
        "with the engine model too",
    )
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
        "--priority-scheduling",
        action="store_true",
        help="queued prefills go by the request's `priority` field, lower first (vLLM's "
        "--scheduling-policy priority)",
    )
    g.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=None,
        metavar="N",
        help="prefill in steps of at most N prompt tokens, the prompts begun first, as vLLM's "
        f"chunked prefill (its --max-num-batched-tokens: {VLLM_BATCHED_TOKENS} by default, "
        "8192 on GPUs of 70 GiB or more but the A100); default 0: whole prompts, serially",
    )
    g.add_argument(
        "--preempt-prefill",
        action="store_true",
        help="with --prefill-chunk-tokens and --priority-scheduling: between steps a "
        "higher-priority prompt passes a begun one, which keeps its tokens (vLLM does not)",
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
        "--cache-tokens-schedule": args.cache_tokens_schedule,
        "--priority-scheduling": args.priority_scheduling or None,
        "--prefill-chunk-tokens": args.prefill_chunk_tokens,
        "--preempt-prefill": args.preempt_prefill or None,
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
    if args.preempt_prefill and not (args.prefill_chunk_tokens and args.priority_scheduling):
        p.error("--preempt-prefill needs --prefill-chunk-tokens N > 0 and --priority-scheduling")
    if args.chunk_interval_ms is not None and args.chunk_interval_ms < 0:
        p.error("--chunk-interval-ms must be >= 0")
    if args.cache_tokens > 0:
        try:
            engine = EngineSettings(
                cache_tokens=args.cache_tokens,
                block_tokens=_or(args.cache_block_tokens, DEFAULT_BLOCK_TOKENS),
                prefill_tokens_per_s=_or(args.prefill_tokens_per_s, DEFAULT_PREFILL_TOKENS_PER_S),
                chunk_interval_s=_or(args.chunk_interval_ms, 0.0) / 1000,
                priority_scheduling=args.priority_scheduling,
                prefill_chunk_tokens=_or(args.prefill_chunk_tokens, 0),
                preempt_prefill=args.preempt_prefill,
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
                interval_s=_or(args.chunk_interval_ms, 0.0) / 1000,
            )
        )


if __name__ == "__main__":
    main()
