"""A stand-in for the Kubernetes API server's EndpointSlice list and watch, on loopback.

It speaks what proxy/fleet/kube.py reads, as kube-apiserver does over HTTP/1.1: a GET of
/apis/discovery.k8s.io/v1/namespaces/NS/endpointslices answered with an EndpointSliceList,
the same GET with ?watch=1 answered with a chunked stream of newline-delimited watch events
(`{"type": "ADDED", "object": {...}}`), failures as `Status` objects with their HTTP status.
The JSON is recorded from a cluster (tests/data/kube/). Every request is recorded (path, query,
headers) and answered by the next step of a script, so a test says what the server does and
asserts what the client asked; `down()` stops listening (the client's connects are refused)
and `up()` listens again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from tests.support import free_port

DATA = Path(__file__).resolve().parent / "data" / "kube"


def recorded(name: str) -> Any:
    """A recorded response (tests/data/kube/NAME.json)."""
    return json.loads((DATA / f"{name}.json").read_text())


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-cased names


@dataclass
class Reply:
    """A whole response: a JSON body with its status (200: a list; else a Status)."""

    body: Any
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)  # more response headers
    hook: Callable[[], None] | None = None  # run as it is answered (before the response)
    down: bool = False  # then stop listening, as an API server going away


@dataclass
class Watch:
    """A watch stream: these events, one JSON line each, then the end of the stream (`end`:
    "close", the last chunk as the API server ends a watch on its timeoutSeconds; "drop", the
    connection cut mid-stream; "hold", kept open until the server stops)."""

    events: list[Any] = field(default_factory=list)
    end: str = "close"
    hook: Callable[[], None] | None = None
    down: bool = False


Step = Reply | Watch


class KubeAPI:
    """The fake API server: `script` answers requests in order; past its end, watches hold."""

    def __init__(self, script: list[Step], on_request: Callable[[], None] = lambda: None):
        self.script: deque[Step] = deque(script)
        self.requests: list[Request] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._on_request = on_request
        self._server: asyncio.Server | None = None
        self._stopping = asyncio.Event()
        self._writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> KubeAPI:
        await self.up()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stopping.set()
        self.down()
        for w in list(self._writers):
            w.close()

    async def up(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    def down(self) -> None:
        """Stop listening (open connections go on): connects are refused until up()."""
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line, *fields = head.decode("latin-1").split("\r\n")
            method, target, _ = line.split(" ", 2)
            headers = {}
            for f in fields:
                if ":" in f:
                    name, _, value = f.partition(":")
                    headers[name.strip().lower()] = value.strip()
            parts = urlsplit(target)
            query = dict(parse_qsl(parts.query, keep_blank_values=True))
            self.requests.append(Request(method, parts.path, query, headers))
            step = self.script.popleft() if self.script else Watch(end="hold")
            if step.hook is not None:
                step.hook()
            if step.down:
                self.down()
            if isinstance(step, Reply):
                await self._reply(writer, step)
            else:
                await self._watch(writer, step)
            self._on_request()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        finally:
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, step: Reply) -> None:
        body = json.dumps(step.body).encode()
        reason = HTTPStatus(step.status).phrase
        more = "".join(f"{k}: {v}\r\n" for k, v in step.headers.items())
        writer.write(
            f"HTTP/1.1 {step.status} {reason}\r\nContent-Type: application/json\r\n{more}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()

    async def _watch(self, writer: asyncio.StreamWriter, step: Watch) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        for event in step.events:
            chunk = json.dumps(event).encode() + b"\n"
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await writer.drain()
        if step.end == "hold":
            self._on_request()  # the watch is open: a test may go on
            await self._stopping.wait()
        elif step.end == "close":
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        # "drop": closed without the last chunk, as a connection cut mid-stream
