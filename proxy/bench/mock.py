"""A zero-latency OpenAI streaming backend, to measure the proxy's own cost.

`python -m proxy.bench.mock --port 9101 --instances 2 --chunks 64` serves chat completions
that stream N content chunks (one write each) with no model time at all, so any latency or
CPU a proxy adds in front of it is the proxy's.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
import uvicorn

Message = MutableMapping[str, Any]


def make_app(chunks: int = 64, model: str = "mock") -> Callable[..., Awaitable[None]]:
    def event(obj: Any) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"

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
    sse = [(b"content-type", b"text/event-stream")]

    async def app(
        scope: Message,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": models})
            return
        raw = b""
        while True:
            m = await receive()
            raw += m.get("body", b"")
            if not m.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": sse})
        for c in body_chunks:
            await send({"type": "http.response.body", "body": c, "more_body": True})
        tail = final + (usage if b"include_usage" in raw else b"") + b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": tail})

    return app


async def serve(port: int, instances: int, chunks: int) -> None:
    servers = [
        uvicorn.Server(
            uvicorn.Config(
                make_app(chunks),
                host="127.0.0.1",
                port=port + i,
                log_level="warning",
                access_log=False,
                lifespan="off",
            )
        )
        for i in range(instances)
    ]
    await asyncio.gather(*(s.serve() for s in servers))


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m proxy.bench.mock",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--port", type=int, default=9101)
    p.add_argument("--instances", type=int, default=1, help="servers on consecutive ports")
    p.add_argument("--chunks", type=int, default=64, help="content chunks per response")
    args = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.port, args.instances, args.chunks))


if __name__ == "__main__":
    main()
