"""Real servers on loopback for tests: any ASGI app under uvicorn in a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import inspect
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from proxy.asgi import serve_lifespan
from proxy.demo.stack import free_ports

__all__ = [
    "SHUTDOWN_POLL_S",
    "ServerThread",
    "WakeableServer",
    "api_key",
    "eventually",
    "free_port",
    "load_script",
    "metric",
    "process",
    "readme_first_command",
    "serve_lifespan",
    "serving",
    "stop_servers",
    "until",
]

ROOT = Path(__file__).resolve().parents[1]


def api_key(name: str) -> dict[str, str]:
    """A `server.api_keys` entry named `name`, whose bearer token is `key-<name>`."""
    return {"name": name, "sha256": hashlib.sha256(f"key-{name}".encode()).hexdigest()}


def metric(url: str, sample: str, **labels: str) -> float | None:
    """The value of the `sample` series (the exposition's name: `warmroute_x_total`) whose
    labels include `labels`, in the proxy's GET /metrics at `url`; None when there is none."""
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and labels.items() <= s.labels.items():
                return float(s.value)
    return None


def load_script(path: str, name: str) -> Any:
    """A script under deploy/ (not a package) as a module, loaded once by its path. Registered
    before it runs: dataclasses look their module up in sys.modules while the class body runs."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def readme_first_command() -> str:
    """The README's first ```bash block: the command a newcomer runs first (its "Two commands"
    section), as the tests that check or run it read it."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"```bash\n(.*?)\n```", text, re.S)
    assert found, "README.md has no ```bash block"
    return found.group(1)


def until(
    predicate: Callable[[], object], what: str = "the condition", within_s: float = 15.0
) -> None:
    """Poll state that another thread or process owns and nothing announces (a server's
    view, read over HTTP), bounded: AssertionError naming `what` after `within_s`."""
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within_s:g} s waiting for {what}")
        time.sleep(0.02)


async def eventually(
    check: Callable[[], object | Awaitable[object]],
    what: str = "the condition",
    within_s: float = 15.0,
) -> Any:
    """until() on an event loop: `check` may be sync or async; returns its first truthy value."""
    deadline = time.monotonic() + within_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within_s:g} s waiting for {what}")
        await asyncio.sleep(0.02)


# socketserver's serve_forever(poll_interval) looks for a shutdown() between waits of this
# long: its default, 0.5 s, is what each stop of such a server cost. Threads started with
# `target=server.serve_forever, args=(SHUTDOWN_POLL_S,)` stop within 20 ms.
SHUTDOWN_POLL_S = 0.02


def free_port(consecutive: int = 1) -> int:
    """A free loopback port; with consecutive=n, the first of n free ones in a row (for
    `--instances n`, which binds --port, --port + 1, ...)."""
    if consecutive > 1:
        return free_ports(consecutive)[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WakeableServer(uvicorn.Server):
    """uvicorn's server, whose main loop also wakes when `wake` is set: stop() is noticed at
    once instead of at the next of its 0.1 s ticks (the suite stops servers by the hundred).
    The ticks, what each does and the shutdown after the loop are uvicorn's own."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.wake = asyncio.Event()  # bound to the server's loop at its first wait

    async def main_loop(self) -> None:
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), 0.1)
            should_exit = await self.on_tick(counter)


class ServerThread:
    """Runs `app` with uvicorn on 127.0.0.1:<port> in a thread; `url` is its base URL."""

    def __init__(self, app: Any, port: int | None = None, **uvicorn_kwargs: Any) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kwargs: dict[str, Any] = {"log_level": "warning", "lifespan": "on", "loop": "asyncio"}
        kwargs.update(uvicorn_kwargs)
        self.config = uvicorn.Config(app, host="127.0.0.1", port=self.port, **kwargs)
        self.server = WakeableServer(self.config)
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

    def request_stop(self) -> None:
        """Ask the server to shut down (uvicorn's graceful shutdown), without waiting."""
        self.server.should_exit = True
        loop = self.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed: it has stopped
                loop.call_soon_threadsafe(self.server.wake.set)

    def stop(self, timeout: float = 10.0) -> None:
        self.request_stop()
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_servers(servers: list[ServerThread], timeout: float = 10.0) -> None:
    """Stop every server, all shutting down at once (each one's shutdown waits ~0.1 s)."""
    for s in servers:
        s.request_stop()
    for s in servers:
        s.thread.join(timeout)


@contextlib.contextmanager
def serving(app: Any, **kwargs: Any) -> Iterator[ServerThread]:
    with ServerThread(app, **kwargs) as server:
        yield server


@contextlib.contextmanager
def process(args: list[str], *, ready: str | list[str], timeout_s: float = 20.0) -> Iterator[None]:
    """A child process (stdout and stderr discarded) that is up once every `ready` URL answers
    200; stopped with SIGTERM (then SIGKILL after 10 s) on the way out."""
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for url in [ready] if isinstance(ready, str) else ready:
            deadline = time.monotonic() + timeout_s
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url, timeout=1).status_code == 200:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"{url} not ready (exit code {proc.poll()})")
                time.sleep(0.1)  # another process: nothing to wait on but its answer
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


class _StandInFlow:
    write_paused = False


class _StandInEvent:
    def __init__(self) -> None:
        self.is_set = False

    def set(self) -> None:
        self.is_set = True


class StandInCycle:
    """What proxy.asgi's stream writers (stream_head, body_part, body_writer) read and set of
    uvicorn's httptools request-response cycle: a request not answered yet, on a connection
    kept alive; what they write collects in `writes`."""

    def __init__(self) -> None:
        self.response_started = False
        self.response_complete = False
        self.waiting_for_100_continue = True
        self.chunked_encoding: bool | None = None
        self.disconnected = False
        self.access_log = False
        self.keep_alive = True
        self.default_headers = [(b"date", b"Sun, 06 Dec 2026 07:00:00 GMT"), (b"server", b"u")]
        self.scope = {"method": "POST"}
        self.flow = _StandInFlow()
        self.message_event = _StandInEvent()
        self.writes: list[bytes] = []
        self.transport = self
        self.closed = False
        self.told = 0  # the protocol's on_response_complete

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def on_response(self) -> None:
        self.told += 1

    async def send(self, message: Any) -> None:  # pragma: no cover - never awaited here
        raise AssertionError


StandInCycle.__module__ = "uvicorn.protocols.http.httptools_impl"  # the writers check it
