"""The mock OpenAI backend: one ASGI app for the bench, the cache benchmarks and the tests.

MockBackend answers chat and text completions (streamed or whole), embeddings, /v1/models,
/health and /metrics. What it does per request comes from three optional parts:

  engine   a MockEngine (engine.py): the prefix cache it keeps to itself (cache.py) and its
           prefill, serial or in steps, plus /mock/cache to read or resize that cache.
           Without one, prompts cost nothing and nothing is cached.
  script   a function from the request to a Reply: an HTTP error before any byte, a slow
           start, the first token's delay, the gap between chunks, a dropped connection, an
           error event or a stall mid-stream, the chunk count, the cached tokens.
           `prompt_directives` reads them from the prompt's text ("fail500 cut:3 chunks:10
           ..."), so one server covers many cases.
  record   a Recorder: every request (path, headers, body) and every client disconnect seen
           before the response ended, for tests to assert on.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from proxy.asgi import (
    SSE,
    SSE_DONE,
    Receive,
    Scope,
    Send,
    headers_of,
    read_body,
    respond,
    send_json,
    serve_lifespan,
    sse,
    start_stream,
    stream_chunk,
    watch_disconnect,
)
from proxy.bench.mock.cache import render_prompt, tokenize
from proxy.bench.mock.engine import MockEngine

# /v1/responses is answered in the text-completion shape: enough for a proxy that forwards
# bytes, not a model of the Responses API's events.
COMPLETIONS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MID_STREAM_ERROR = sse(
    {
        "error": {
            "message": "injected failure: KV cache exhausted",
            "type": "server_error",
            "code": 500,
        }
    }
)


# -- scripting and recording ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Reply:
    """How one request is answered; every field at its default is a plain, prompt answer."""

    status: int = 200  # anything else: that HTTP error, before any byte of a response
    chunks: int | None = None  # content chunks (None: the backend's, capped by max_tokens)
    head_after_s: float = 0.0  # a slow start: silence before the response head
    first_token_s: float = 0.0  # silence after the role chunk, before the first content
    interval_s: float | None = None  # between content chunks (None: the engine's, or 0)
    cut_after: int | None = None  # drop the connection after this many content chunks
    error_after: int | None = None  # an OpenAI error event and [DONE] after this many
    stall_after: int | None = None  # send nothing more after this many, until the client left
    cached_fraction: float | None = None  # report this share of the prompt as cached


@dataclass(frozen=True, slots=True)
class Request:
    """What a script sees of one request."""

    path: str
    body: dict[str, Any]
    text: str  # the prompt as the engine reads it (render_prompt)
    headers: dict[str, str]


Script = Callable[[Request], Reply]


def _number(text: str, key: str) -> float | None:
    m = re.search(rf"{key}:([0-9.]+)", text)
    return float(m.group(1)) if m else None


def prompt_directives(request: Request) -> Reply:
    """The reply the prompt asks for, by words in its text:

    fail500      HTTP 500 before any byte        slowstart:S  S seconds before the head
    chunks:N     N content chunks (default 5)    delay:S      S seconds before each chunk
    cut:N        drop the connection after N     stall:N      stop after N chunks
    """
    text = request.text
    cut, stall = _number(text, "cut"), _number(text, "stall")
    delay = _number(text, "delay") or 0.0
    return Reply(
        status=500 if "fail500" in text else 200,
        chunks=int(_number(text, "chunks") or 5),
        head_after_s=_number(text, "slowstart") or 0.0,
        first_token_s=delay,  # before every chunk, the first one too
        interval_s=delay,
        cut_after=None if cut is None else int(cut),
        stall_after=None if stall is None else int(stall),
    )


@dataclass
class Recorder:
    """What a backend saw; the disconnect event is a threading.Event so that a test on
    another thread than the server's can wait on it."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    disconnects: list[float] = field(default_factory=list)  # time.monotonic() of each
    disconnected: threading.Event = field(default_factory=threading.Event)
    completed: int = 0  # responses sent to their end


def prompt_tokens(body: Mapping[str, Any]) -> int:
    """The prompt tokens the backend reports for a request body (its 3-character tokens)."""
    return len(tokenize(render_prompt(body)))


# -- the app ----------------------------------------------------------------------------------
class MockBackend:
    """The ASGI app; see the module's docstring for `engine`, `script` and `record`."""

    def __init__(
        self,
        engine: MockEngine | None = None,
        chunks: int = 64,
        model: str = "mock",
        *,
        models: Sequence[str] = (),
        name: str = "warmroute-mock",
        script: Script | None = None,
        record: bool = False,
    ) -> None:
        self.engine = engine
        self.chunks = chunks
        self.models = tuple(models) or (model,)
        self.model = self.models[0]
        self.name = name
        self.script = script
        self.rec: Recorder | None = Recorder() if record else None
        self.created = int(time.time())
        self._head = ((b"x-backend", name.encode()),)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"].rstrip("/")
        if path in COMPLETIONS or path == "/v1/embeddings":
            if method != "POST":
                await _error(send, 405, f"use POST for {path}")
                return
            await self._answer(scope, path, await read_body(receive), receive, send)
        elif path == "/v1/models":
            data = [{"id": m, "object": "model", "owned_by": self.name} for m in self.models]
            await send_json(send, 200, {"object": "list", "data": data})
        elif path == "/health":
            await respond(send, 200, b"", b"text/plain")
        elif path == "/metrics":
            text = self.engine.metrics_text() if self.engine else ""
            await respond(send, 200, text.encode(), b"text/plain; version=0.0.4")
        elif path == "/mock/cache" and self.engine is not None:
            if method == "POST":
                await self._resize(self.engine, await read_body(receive), send)
            else:
                await send_json(send, 200, asdict(self.engine.cache.stats()))
        else:
            await _error(send, 404, f"no route {path}")

    async def _resize(self, engine: MockEngine, raw: bytes, send: Send) -> None:
        try:
            tokens = orjson.loads(raw).get("tokens")
        except (orjson.JSONDecodeError, AttributeError):
            tokens = None
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            await _error(send, 400, 'send a JSON object {"tokens": N} with N >= 0')
            return
        engine.cache.resize(tokens)
        await send_json(send, 200, asdict(engine.cache.stats()))

    async def _answer(
        self, scope: Scope, path: str, raw: bytes, receive: Receive, send: Send
    ) -> None:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            await _error(send, 400, "the request body must be a JSON object")
            return
        if self.rec is not None:
            headers = headers_of(scope)
            self.rec.requests.append({"path": path, "headers": headers, "body": body, "raw": raw})
        if self.script is None:
            reply = Reply()
        else:
            text = render_prompt(body)
            reply = self.script(Request(path, body, text, headers_of(scope)))
        if reply.status != 200:
            await _error(send, reply.status, "injected failure: the engine exploded")
            return
        exchange = _Exchange(self, body, path, reply)
        # Like an engine: notice a departed client even while still queued or prefilling.
        watcher = asyncio.create_task(watch_disconnect(receive, exchange.client_left))
        try:
            await exchange.run(send)
        finally:
            watcher.cancel()


class _Exchange:
    """One request's answer."""

    def __init__(self, app: MockBackend, body: dict[str, Any], path: str, reply: Reply) -> None:
        self.app = app
        self.body = body
        self.path = path
        self.reply = reply
        self.gone = asyncio.Event()
        self.complete = False

    def client_left(self) -> None:
        self.gone.set()
        rec = self.app.rec
        if rec is not None and not self.complete:  # uvicorn also says so once a response ends
            rec.disconnects.append(time.monotonic())
            rec.disconnected.set()

    async def _quiet(self, seconds: float) -> bool:
        """Wait `seconds`; True when the client left meanwhile."""
        if seconds <= 0:
            return self.gone.is_set()
        try:
            await asyncio.wait_for(self.gone.wait(), seconds)
        except TimeoutError:
            return False
        return True

    async def run(self, send: Send) -> None:
        app, body, reply = self.app, self.body, self.reply
        if await self._quiet(reply.head_after_s):
            return
        if self.path == "/v1/embeddings":
            await send_json(send, 200, _embedding(body), app._head)
            self._done()
            return
        chat = self.path.endswith("chat/completions")
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        limit = limit if isinstance(limit, int) and limit > 0 else None
        n_out = reply.chunks
        if n_out is None:
            n_out = min(app.chunks, limit) if limit else app.chunks
        # A scripted count ends the answer as max_tokens would.
        finish = "length" if reply.chunks is not None or (limit and n_out >= limit) else "stop"
        # The same request gets the same bytes back, whichever way it came (tests compare).
        kind = "chatcmpl" if chat else "cmpl"
        answer = _Answer(f"{kind}-{app.name}", str(body.get("model", app.model)), chat, app.created)
        tokens = tokenize(render_prompt(body))
        streaming = bool(body.get("stream"))
        engine = app.engine
        priority = body.get("priority", 0)
        if engine is not None and priority:
            if not isinstance(priority, int) or isinstance(priority, bool):
                await _error(send, 400, "priority: Input should be a valid integer")
                self._done()
                return
            if not engine.settings.priority_scheduling:  # vLLM's words, and its status
                message = f"Got priority {priority} but Priority scheduling is not enabled."
                await _error(send, 400, message)
                self._done()
                return
        if streaming:  # headers at once, as an engine's HTTP layer sends them
            await start_stream(send, 200, (*SSE, *app._head))
        cached = 0 if engine is None else await engine.prefill(tokens, priority)
        if reply.cached_fraction is not None:
            cached = int(len(tokens) * reply.cached_fraction)
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": n_out,
            "total_tokens": len(tokens) + n_out,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        interval = reply.interval_s
        if interval is None:
            interval = engine.settings.chunk_interval_s if engine else 0.0
        if engine is not None:
            engine.running += 1
        try:
            if not streaming:
                if await self._quiet(reply.first_token_s + interval * max(n_out - 1, 0)):
                    return
                text = "".join(f"tok{i} " for i in range(n_out))
                self._count(n_out)
                await send_json(send, 200, answer.whole(text, finish, usage), app._head)
                self._done()
                return
            await self._stream(send, answer, n_out, finish, usage, interval)
        finally:
            if engine is not None:
                engine.running -= 1

    async def _stream(
        self,
        send: Send,
        answer: _Answer,
        n_out: int,
        finish: str,
        usage: dict[str, Any],
        interval: float,
    ) -> None:
        reply = self.reply
        if answer.chat:
            await _event(send, answer.chunk({"role": "assistant", "content": ""}, None))
        if await self._quiet(reply.first_token_s):
            return
        for i in range(n_out):
            if i == reply.cut_after:
                raise ConnectionAbortedError("injected fault: connection dropped mid-stream")
            if i == reply.error_after:  # as an engine reports a failure once streaming
                await send({"type": "http.response.body", "body": MID_STREAM_ERROR + SSE_DONE})
                self._done()
                return
            if i == reply.stall_after:
                await self.gone.wait()
                return
            if i and await self._quiet(interval):
                return
            await _event(send, answer.chunk({"content": f"tok{i} "}, None))
            self._count(1)
        tail = sse(answer.chunk({}, finish))
        options = self.body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            tail += sse({**answer.head(), "choices": [], "usage": usage})
        await send({"type": "http.response.body", "body": tail + SSE_DONE})
        self._done()

    def _count(self, tokens: int) -> None:
        if self.app.engine is not None:
            self.app.engine.generation_tokens += tokens

    def _done(self) -> None:
        # Set before anything can run: the watcher wakes when uvicorn ends the response.
        self.complete = True
        if self.app.rec is not None:
            self.app.rec.completed += 1


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


def _embedding(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "object": "list",
        "model": body.get("model"),
        "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
        "usage": {"prompt_tokens": 3, "total_tokens": 3},
    }


async def _event(send: Send, obj: Any) -> None:
    await stream_chunk(send, sse(obj))


async def _error(send: Send, status: int, message: str) -> None:
    kind = "invalid_request_error" if status < 500 else "server_error"
    await send_json(send, status, {"error": {"message": message, "type": kind, "code": status}})
