"""Real servers on loopback for tests: any ASGI app under uvicorn in a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerThread:
    """Runs `app` with uvicorn on 127.0.0.1:<port> in a thread; `url` is its base URL."""

    def __init__(self, app: Any, port: int | None = None, **uvicorn_kwargs: Any) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kwargs: dict[str, Any] = {"log_level": "warning", "lifespan": "on", "loop": "asyncio"}
        kwargs.update(uvicorn_kwargs)
        self.config = uvicorn.Config(app, host="127.0.0.1", port=self.port, **kwargs)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def start(self, timeout: float = 10.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serving(app: Any, **kwargs: Any) -> Iterator[ServerThread]:
    with ServerThread(app, **kwargs) as server:
        yield server


async def serve_lifespan(receive: Any, send: Any) -> None:
    """Answer an ASGI lifespan scope for a test app that owns no resources."""
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
