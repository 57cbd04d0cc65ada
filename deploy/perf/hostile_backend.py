"""A hostile OpenAI-style backend: each request answered well, or with one seeded fault.

    python deploy/perf/hostile_backend.py --port 8001 --seed 1 --good 0.7

A small asyncio HTTP/1.1 server on raw sockets (no framework to tidy up what it sends), run as
its own process by `deploy/perf/soak.py --hostile` and by tests/test_soak_hostile.py. Every POST
to /v1/chat/completions draws from a seeded random.Random: with probability --good a
well-behaved answer (a streamed SSE answer with a role chunk, one chunk per token, the finish
reason on the last and a usage chunk; or a non-streamed chat.completion JSON with usage), else
one of FAULTS below (by weight, among those that apply to a streamed or a non-streamed request).
A request header `x-hostile-fault: NAME` (or `good`) picks the answer instead of the draw.

What each fault is, and the clean error a client of a proxy whose only backend this is gets
(FAULTS[name].expect, checked by tests/test_soak_hostile.py; soak.py's causes: `http STATUS
CODE`, or `stream CODE` for the error event that ends a stream). With other backends, a fault
answered before the first body byte (a bad head, a 429 or 5xx, a slow head, a non-streamed
body that breaks off) is retried there and may end well.

    huge_json         200 JSON, chunked, 100-200 MB generated as it is sent (never held)
                      -> 502 upstream_response_too_large
    over_cap_json     200 JSON whose Content-Length is just past --cap-bytes
                      -> 502 upstream_response_too_large
    huge_head         a response head of 2-6 MB (20-60 fields of 100 kB)
                      -> 503 backends_unavailable
    many_fields       a response head of 101-3000 small fields (under 64 KiB in all)
                      -> 503 backends_unavailable
    html              200 text/html, an HTML page -> 502 upstream_invalid_response
    html_mislabelled  the page labelled application/json -> 502 upstream_invalid_response;
                      labelled text/event-stream (streamed) -> stream incomplete_stream
    bad_utf8          bytes that are not UTF-8 in the JSON answer -> 502
                      upstream_invalid_response; in an SSE event -> stream upstream_invalid_response
    rate_limited      429, Retry-After 1-3 s, an OpenAI error body -> 429 backends_rate_limited
    error_type        400/404/422 (or 500/503) with an error body whose `type` is new each time
                      -> the 4xx as sent (code hostile_error); a 5xx -> 503 backends_unavailable
    error_event       a stream that ends in an error event whose `type` is new each time
                      -> stream hostile_error; non-streamed, a 200 whose JSON object is that
                      error -> 502 upstream_invalid_response
    trickle_head      the response head, a byte every --trickle-s -> 503 backends_unavailable
    trickle_events    a stream that starts, then one event a byte every --trickle-s
                      -> stream idle_timeout
    trickle_json      a JSON answer's body, a byte every --trickle-s -> 503 backends_unavailable
    cut_stream        a stream that breaks off mid-event (FIN or RST)
                      -> stream upstream_stream_error
    cut_json          a JSON answer cut short of its Content-Length -> 503 backends_unavailable

The new `type`s (error_type, error_event) are what the proxy's metric labels must not take in
without bound (proxy/telemetry/labels.py).

GET /health and /v1/models answer as an engine's would; GET /sim/stats says what was served
({"running": requests being answered, "waiting": 0, "counts": {answer: n}}, the shape
soak.Engine.stats reads). Connections are kept alive after good answers, 429s and error
bodies, for 5 s idle (as uvicorn does); every other fault closes its connection. No answer
takes longer than --max-request-s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

MODEL = "sim-8b"
MIB = 1 << 20
FILLER = b"a" * MIB  # the body of the huge answers: the same bytes, sent again and again
FILLER_CHUNK = b"%x\r\n%s\r\n" % (MIB, FILLER)
JSON_PREFIX = (
    b'{"id":"chatcmpl-huge","object":"chat.completion","model":"sim-8b",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"'
)
JSON_SUFFIX = b'"},"finish_reason":"stop"}]}'
HTML = (
    b"<!DOCTYPE html>\n<html><head><title>502 Bad Gateway</title></head>\n\n"
    b"<body><h1>Bad Gateway</h1>\n\n<p>The upstream server is down for maintenance.</p>\n\n"
    b"</body></html>\n"
)
SSE_TYPE = b"text/event-stream; charset=utf-8"
KEEPALIVE_S = 5.0


class Exchange:
    """One request and the connection its answer goes out on."""

    def __init__(
        self,
        writer: asyncio.StreamWriter,
        body: dict[str, Any],
        rng: random.Random,
        args: argparse.Namespace,
    ) -> None:
        self.writer, self.rng, self.args = writer, rng, args
        self.stream = bool(body.get("stream"))
        self.usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 64)
        self.rid = f"chatcmpl-{rng.getrandbits(64):016x}"

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def head(self, status: bytes, ctype: bytes, length: int | None = None) -> None:
        """A response head: Content-Length `length`, or chunked when None."""
        size = b"transfer-encoding: chunked" if length is None else b"content-length: %d" % length
        await self.write(b"HTTP/1.1 %s\r\ncontent-type: %s\r\n%s\r\n\r\n" % (status, ctype, size))

    async def chunk(self, data: bytes) -> None:
        await self.write(b"%x\r\n%s\r\n" % (len(data), data))

    async def trickle(self, data: bytes, chunked: bool) -> None:
        for i in range(len(data)):
            byte = data[i : i + 1]
            await self.write(b"1\r\n%s\r\n" % byte if chunked else byte)
            await asyncio.sleep(self.args.trickle_s)

    def tokens(self) -> int:
        return self.rng.randint(1, max(1, self.max_tokens))

    def sse(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        obj: dict[str, Any] = {"id": self.rid, "object": "chat.completion.chunk"}
        obj.update(created=int(time.time()), model=MODEL, choices=choices)
        if usage is not None:
            obj["usage"] = usage
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def role_event(self) -> bytes:
        delta = {"role": "assistant", "content": ""}
        return self.sse([{"index": 0, "delta": delta, "finish_reason": None}])

    def token_event(self, text: str, finish: str | None = None) -> bytes:
        return self.sse([{"index": 0, "delta": {"content": text}, "finish_reason": finish}])

    def completion(self, n: int) -> dict[str, Any]:
        message = {"role": "assistant", "content": " ".join(["tok"] * n)}
        return {
            "id": self.rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
            "usage": _usage(n),
        }


def _usage(n: int) -> dict[str, int]:
    return {"prompt_tokens": 16, "completion_tokens": n, "total_tokens": 16 + n}


# -- well-behaved answers -------------------------------------------------------------------
async def good(x: Exchange) -> bool:
    n = x.tokens()
    if not x.stream:
        body = orjson.dumps(x.completion(n))
        await x.head(b"200 OK", b"application/json", len(body))
        await x.write(body)
        return True
    await x.head(b"200 OK", SSE_TYPE)
    await x.chunk(x.role_event())
    for i in range(n):
        await x.chunk(x.token_event("tok ", "length" if i == n - 1 else None))
        if x.args.token_s:
            await asyncio.sleep(x.args.token_s)
    if x.usage:
        await x.chunk(x.sse([], _usage(n)))
    await x.chunk(b"data: [DONE]\n\n")
    await x.write(b"0\r\n\r\n")
    return True


# -- the faults (each returns whether the connection may be kept alive) ---------------------
async def huge_json(x: Exchange) -> bool:
    total = x.rng.randint(100, 200) * MIB
    await x.head(b"200 OK", b"application/json")
    await x.chunk(JSON_PREFIX)
    for _ in range(total // MIB):
        await x.write(FILLER_CHUNK)
    await x.chunk(JSON_SUFFIX)
    await x.write(b"0\r\n\r\n")
    return False


async def over_cap_json(x: Exchange) -> bool:
    length = x.args.cap_bytes + x.rng.randint(1, 64 * 1024)
    await x.head(b"200 OK", b"application/json", length)
    await x.write(JSON_PREFIX)
    left = length - len(JSON_PREFIX) - len(JSON_SUFFIX)
    view = memoryview(FILLER)
    while left > 0:
        piece = view[: min(left, MIB)]
        x.writer.write(piece)
        await x.writer.drain()
        left -= len(piece)
    await x.write(JSON_SUFFIX)
    return False


def _ctype(x: Exchange) -> bytes:
    return SSE_TYPE if x.stream else b"application/json"


async def huge_head(x: Exchange) -> bool:
    value = b"h" * 100_000
    await x.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\n" % _ctype(x))
    for i in range(x.rng.randint(20, 60)):
        await x.write(b"x-hostile-%d: %s\r\n" % (i, value))
    await x.write(b"content-length: 2\r\n\r\n{}")
    return False


async def many_fields(x: Exchange) -> bool:
    fields = b"".join(b"x-f%d: v\r\n" % i for i in range(x.rng.randint(101, 3000)))
    body = orjson.dumps(x.completion(4)) if not x.stream else x.token_event("tok ", "stop")
    head = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n" % (_ctype(x), len(body))
    await x.write(head + fields + b"\r\n" + body)
    return False


async def html(x: Exchange) -> bool:
    await x.head(b"200 OK", b"text/html; charset=utf-8", len(HTML))
    await x.write(HTML)
    return False


async def html_mislabelled(x: Exchange) -> bool:
    await x.head(b"200 OK", _ctype(x), len(HTML))
    await x.write(HTML)
    return False


async def bad_utf8(x: Exchange) -> bool:
    bad = b"\xff\xfe\xc3(tok \xed\xa0\x80"  # not UTF-8: stray bytes, a cut pair, a surrogate
    if not x.stream:
        body = orjson.dumps(x.completion(3)).replace(b"tok tok", b"tok " + bad, 1)
        await x.head(b"200 OK", b"application/json", len(body))
        await x.write(body)
        return False
    await x.head(b"200 OK", SSE_TYPE)
    await x.chunk(x.role_event())
    for _ in range(x.rng.randint(1, 3)):
        await x.chunk(x.token_event("tok "))
    await x.chunk(x.token_event("BAD").replace(b"BAD", bad))
    await x.chunk(x.token_event("tok ", "stop"))
    await x.chunk(x.sse([], _usage(99)) + b"data: [DONE]\n\n")
    await x.write(b"0\r\n\r\n")
    return False


def _error(message: str, kind: str, code: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "code": code}})


async def rate_limited(x: Exchange) -> bool:
    body = _error("Rate limit reached", "rate_limit_error", "rate_limit_exceeded")
    after = x.rng.randint(1, 3)
    await x.write(
        b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
        b"retry-after: %d\r\ncontent-length: %d\r\n\r\n%s" % (after, len(body), body)
    )
    return True


async def error_type(x: Exchange) -> bool:
    status = x.rng.choice([b"400 Bad Request", b"404 Not Found", b"422 Unprocessable Entity"])
    if x.rng.random() < 0.4:
        status = x.rng.choice([b"500 Internal Server Error", b"503 Service Unavailable"])
    kind = f"hostile_{x.rng.getrandbits(48):012x}"  # a new metric label value, if let through
    body = _error(f"injected error of type {kind}", kind, "hostile_error")
    await x.head(status, b"application/json", len(body))
    await x.write(body)
    return True


async def error_event(x: Exchange) -> bool:
    """A stream that starts, then ends in an error event (as vLLM ends one), of a new type."""
    kind = f"hostile_{x.rng.getrandbits(48):012x}"
    event = b"data: " + _error(f"injected error event of type {kind}", kind, "hostile_error")
    if not x.stream:  # a 200 whose JSON object is an error
        await x.head(b"200 OK", b"application/json", len(event) - 6)
        await x.write(event[6:])
        return True
    await x.head(b"200 OK", SSE_TYPE)
    await x.chunk(x.role_event())
    for _ in range(x.rng.randint(0, 3)):
        await x.chunk(x.token_event("tok "))
    await x.chunk(event + b"\n\ndata: [DONE]\n\n")
    await x.write(b"0\r\n\r\n")
    return True


async def trickle_head(x: Exchange) -> bool:
    body = orjson.dumps(x.completion(4))
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    await x.trickle(head % len(body), chunked=False)
    await x.write(body)
    return False


async def trickle_events(x: Exchange) -> bool:
    await x.head(b"200 OK", SSE_TYPE)
    await x.chunk(x.role_event() + x.token_event("tok "))
    await x.trickle(x.token_event("tok " * 120), chunked=True)  # ~650 bytes, one event
    await x.chunk(x.token_event("tok ", "stop") + x.sse([], _usage(122)) + b"data: [DONE]\n\n")
    await x.write(b"0\r\n\r\n")
    return False


async def trickle_json(x: Exchange) -> bool:
    body = orjson.dumps(x.completion(120))
    await x.head(b"200 OK", b"application/json", len(body))
    await x.trickle(body, chunked=False)
    return False


async def cut_stream(x: Exchange) -> bool:
    await x.head(b"200 OK", SSE_TYPE)
    await x.chunk(x.role_event())
    for _ in range(x.rng.randint(1, 5)):
        await x.chunk(x.token_event("tok "))
    event = x.token_event("tok ")
    await x.chunk(event[: len(event) // 2])
    if x.rng.random() < 0.5:
        x.writer.transport.abort()  # RST
    return False


async def cut_json(x: Exchange) -> bool:
    body = orjson.dumps(x.completion(x.tokens()))
    await x.head(b"200 OK", b"application/json", len(body))
    await x.write(body[: len(body) // 2])
    if x.rng.random() < 0.5:
        x.writer.transport.abort()
    return False


@dataclass(frozen=True, slots=True)
class Fault:
    run: Callable[[Exchange], Awaitable[bool]]
    kinds: tuple[str, ...]  # the requests it is drawn for: "stream", "json" (non-streamed)
    weight: float
    # what the client gets through a proxy whose only backend this is: soak.py's causes
    expect: tuple[str, ...]
    expect_stream: tuple[str, ...] = ()  # for a streamed request, where that differs


BOTH, JSON, STREAM = ("stream", "json"), ("json",), ("stream",)
TOO_LARGE = ("http 502 upstream_response_too_large",)
INVALID = ("http 502 upstream_invalid_response",)
ALL_FAILED = ("http 503 backends_unavailable",)  # failed before the first byte: retried
FAULTS: dict[str, Fault] = {
    "huge_json": Fault(huge_json, JSON, 0.5, TOO_LARGE),
    "over_cap_json": Fault(over_cap_json, JSON, 1, TOO_LARGE),
    "huge_head": Fault(huge_head, BOTH, 1, ALL_FAILED),
    "many_fields": Fault(many_fields, BOTH, 1, ALL_FAILED),
    "html": Fault(html, BOTH, 1, INVALID),
    "html_mislabelled": Fault(html_mislabelled, BOTH, 1, INVALID, ("stream incomplete_stream",)),
    "bad_utf8": Fault(bad_utf8, BOTH, 1, INVALID, ("stream upstream_invalid_response",)),
    "rate_limited": Fault(rate_limited, BOTH, 1, ("http 429 backends_rate_limited",)),
    "error_type": Fault(
        error_type, BOTH, 2, tuple(f"http {s} hostile_error" for s in (400, 404, 422)) + ALL_FAILED
    ),
    "error_event": Fault(error_event, BOTH, 2, INVALID, ("stream hostile_error",)),
    "trickle_head": Fault(trickle_head, BOTH, 0.5, ALL_FAILED),
    "trickle_events": Fault(trickle_events, STREAM, 0.5, ("stream idle_timeout",)),
    "trickle_json": Fault(trickle_json, JSON, 0.5, ALL_FAILED),
    "cut_stream": Fault(cut_stream, STREAM, 1, ("stream upstream_stream_error",)),
    "cut_json": Fault(cut_json, JSON, 1, ALL_FAILED),
}


# -- the server -----------------------------------------------------------------------------
class Backend:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.counts: Counter[str] = Counter()
        self.running = 0

    def pick(self, wanted: str | None, stream: bool) -> str:
        if wanted:
            return wanted
        if self.rng.random() < self.args.good:
            return "good"
        kind = "stream" if stream else "json"
        names = [n for n, f in FAULTS.items() if kind in f.kinds]
        return self.rng.choices(names, [FAULTS[n].weight for n in names])[0]

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                async with asyncio.timeout(KEEPALIVE_S):
                    head = await reader.readuntil(b"\r\n\r\n")
                if not await self.request(head, reader, writer):
                    break
        except (OSError, EOFError, TimeoutError, ValueError, asyncio.LimitOverrunError):
            pass  # the peer went (the proxy gave up on a fault), or a keep-alive timed out
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def request(
        self, raw: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; whether the connection may take another."""
        line, *fields = raw.decode("latin-1").split("\r\n")
        method, path, _ = line.split(" ", 2)
        headers = dict(f.lower().split(": ", 1) for f in fields if ": " in f)
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        if method == "GET":
            await self.get(path, writer)
            return True
        try:
            req = orjson.loads(body)
        except orjson.JSONDecodeError:
            req = {}
        x = Exchange(writer, req, self.rng, self.args)
        name = self.pick(headers.get("x-hostile-fault"), x.stream)
        run = good if name == "good" else FAULTS[name].run
        self.counts[name] += 1
        self.running += 1
        try:
            async with asyncio.timeout(self.args.max_request_s):
                return await run(x)
        finally:
            self.running -= 1

    async def get(self, path: str, writer: asyncio.StreamWriter) -> None:
        if path == "/v1/models":
            body = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        elif path == "/sim/stats":
            stats = {"running": self.running, "waiting": 0, "counts": dict(self.counts)}
            body = orjson.dumps(stats)
        elif path == "/health":
            body = b"{}"
        else:
            body = _error("not found", "not_found_error", "not_found")
        status = b"404 Not Found" if body.startswith(b'{"error"') else b"200 OK"
        writer.write(
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (status, len(body), body)
        )
        await writer.drain()


async def serve(args: argparse.Namespace) -> None:
    backend = Backend(args)
    server = await asyncio.start_server(
        backend.connection, args.host, args.port, limit=1 << 20, backlog=1024
    )
    async with server:
        await server.serve_forever()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--good", type=float, default=0.7, help="share of good answers (0.7)")
    p.add_argument(
        "--cap-bytes",
        type=int,
        default=64 * MIB,
        help="the proxy's upstream.max_response_bytes: over_cap_json goes just past it (64 MiB)",
    )
    p.add_argument("--trickle-s", type=float, default=0.2, help="seconds per trickled byte")
    p.add_argument("--token-s", type=float, default=0.002, help="seconds between good tokens")
    p.add_argument("--max-request-s", type=float, default=120.0, help="longest any answer runs")
    return p


def main() -> None:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(build_parser().parse_args()))


if __name__ == "__main__":
    main()
