"""A small, scriptable OpenAI-compatible backend for proxy tests (a real server on loopback).

Behaviour is chosen per request by the prompt text / model, so one server covers many cases:
  "fail500"      -> HTTP 500 before any byte
  "cut:N"        -> stream N content chunks, then drop the connection
  "stall:N"      -> stream N content chunks, then stop sending (keep the connection open)
  "slowstart:S"  -> wait S seconds before the response headers
  "chunks:N"     -> N content chunks (default 5), "delay:S" seconds apart (default 0)
It records every request (headers, body) and every client disconnect it observes.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Any

import orjson

from tests.support import serve_lifespan


class Recorder:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.disconnects: list[float] = []
        self.disconnected = threading.Event()
        self.completed = 0


def _opt(text: str, key: str, default: float) -> float:
    m = re.search(rf"{key}:([0-9.]+)", text)
    return float(m.group(1)) if m else default


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return " ".join(str(m.get("content", "")) for m in body["messages"])
    return str(body.get("prompt", body.get("input", "")))


def words(n: int) -> list[str]:
    vocab = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    return [f"{vocab[i % len(vocab)]}{i} " for i in range(n)]


class FakeBackend:
    def __init__(self, name: str = "fake", models: tuple[str, ...] = ("test-model",)) -> None:
        self.name = name
        self.models = models
        self.rec = Recorder()
        self.caches = False  # True: report cached_tokens like an engine with prefix caching
        self.seen: list[str] = []  # prompts served, for cached_tokens

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await serve_lifespan(receive, send)
        path = scope["path"]
        if scope["method"] == "GET":
            if path == "/v1/models":
                data = [{"id": m, "object": "model", "owned_by": self.name} for m in self.models]
                return await self._json(send, 200, {"object": "list", "data": data})
            if path in ("/health", "/metrics"):
                return await self._json(send, 200, {})
            return await self._json(send, 404, {"error": {"message": "not found"}})
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        body = orjson.loads(raw)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.rec.requests.append({"path": path, "headers": headers, "body": body, "raw": raw})
        text = _prompt_text(body)
        if "fail500" in text:
            return await self._json(send, 500, {"error": {"message": "engine exploded"}})
        gone = asyncio.Event()

        async def watch() -> None:
            # Like an engine: notice a departed client even while still "prefilling".
            while (await receive())["type"] != "http.disconnect":
                pass
            self.rec.disconnects.append(time.monotonic())
            self.rec.disconnected.set()
            gone.set()

        watcher = asyncio.ensure_future(watch())
        try:
            await self._serve(send, path, body, text, gone)
        finally:
            watcher.cancel()

    async def _serve(
        self, send: Any, path: str, body: dict[str, Any], text: str, gone: asyncio.Event
    ) -> None:
        if "slowstart" in text:
            try:
                await asyncio.wait_for(gone.wait(), _opt(text, "slowstart", 0))
                return
            except TimeoutError:
                pass
        if path.endswith("/embeddings"):
            return await self._json(
                send,
                200,
                {
                    "object": "list",
                    "model": body["model"],
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
                    "usage": {"prompt_tokens": 3, "total_tokens": 3},
                },
            )
        n = int(_opt(text, "chunks", 5))
        if body.get("stream"):
            await self._stream(send, path, body, text, n, gone)
        else:
            await self._whole(send, path, body, n)

    async def _json(
        self, send: Any, status: int, data: Any, extra: list[Any] | None = None
    ) -> None:
        payload = orjson.dumps(data)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    *(extra or []),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    def _usage(self, body: dict[str, Any], n: int) -> dict[str, Any]:
        text = _prompt_text(body)
        prompt_tokens = max(1, len(text) // 4)
        # With `caches`, an engine with an unbounded prefix cache: the longest prefix shared
        # with any prompt served before (the last 64), in 4-character tokens, never the whole
        # prompt. Without, an engine with prefix caching off.
        cached = 0
        if self.caches:
            shared = max((_common(text, seen) for seen in self.seen), default=0)
            self.seen.append(text)
            del self.seen[:-64]
            cached = min(shared // 4, prompt_tokens - 1)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def _whole(self, send: Any, path: str, body: dict[str, Any], n: int) -> None:
        text = "".join(words(n))
        if path.endswith("/chat/completions"):
            data = {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "created": 1,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "length",
                        "message": {"role": "assistant", "content": text},
                    }
                ],
                "usage": self._usage(body, n),
            }
        else:
            data = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": 1,
                "model": body["model"],
                "choices": [
                    {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
                ],
                "usage": self._usage(body, n),
            }
        self.rec.completed += 1
        await self._json(
            send, 200, data, [(b"x-backend", self.name.encode()), (b"connection", b"keep-alive")]
        )

    async def _stream(
        self, send: Any, path: str, body: dict[str, Any], text: str, n: int, gone: asyncio.Event
    ) -> None:
        chat = path.endswith("/chat/completions")
        delay = _opt(text, "delay", 0)
        cut = int(_opt(text, "cut", -1))
        stall = int(_opt(text, "stall", -1))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"x-backend", self.name.encode()),
                ],
            }
        )

        def event(obj: Any) -> bytes:
            return b"data: " + orjson.dumps(obj) + b"\n\n"

        base = {
            "id": "chatcmpl-fake" if chat else "cmpl-fake",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1,
            "model": body["model"],
        }
        if chat:
            await send(
                {
                    "type": "http.response.body",
                    "more_body": True,
                    "body": event(
                        {
                            **base,
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None,
                                }
                            ],
                        }
                    ),
                }
            )
        for i, w in enumerate(words(n)):
            if i == cut:
                raise ConnectionAbortedError  # drop the connection mid-stream
            if i == stall:
                await gone.wait()
                return
            if delay:
                try:
                    await asyncio.wait_for(gone.wait(), delay)
                    return
                except TimeoutError:
                    pass
            if gone.is_set():
                return
            choice = (
                {"index": 0, "delta": {"content": w}, "finish_reason": None}
                if chat
                else {"index": 0, "text": w, "finish_reason": None, "logprobs": None}
            )
            await send(
                {
                    "type": "http.response.body",
                    "body": event({**base, "choices": [choice]}),
                    "more_body": True,
                }
            )
        final = (
            {"index": 0, "delta": {}, "finish_reason": "length"}
            if chat
            else {"index": 0, "text": "", "finish_reason": "length", "logprobs": None}
        )
        out = event({**base, "choices": [final]})
        if (body.get("stream_options") or {}).get("include_usage"):
            out += event({**base, "choices": [], "usage": self._usage(body, n)})
        out += b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": out, "more_body": False})
        self.rec.completed += 1


def _common(a: str, b: str) -> int:
    """Characters the two strings share from the start."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
