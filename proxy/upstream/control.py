"""The proxy's background requests to its backends over its own HTTP/1.1 connections.

Health checks, model lists and metric and slot scrapes are small GETs, a few a second per
busy engine (proxy/upstream/backends.py). Through httpx each cost ~0.7 ms of CPU on a kept-alive
connection and ~1 ms on a new one on the machine that measured it, more than a proxied request's
whole cost: with one busy engine a proxy spent ~0.8 M instructions a second on its checks
alone, and a fleet of busy engines scales that with its size. Sent over a connection pool like
the forwarder's (its own instance: a check never waits for, or takes, a request's connection)
a GET costs a fifth of that or less (deploy/perf/control_get.py; docs/hot-path.md, round 10).

`ControlClient.get` answers as httpx does, so the registry's checks, scrapes and the slot scrape
read it as before: an `Answer` (the part of `httpx.Response` they read: `status_code`, `content`,
`text`, `json()`, `raise_for_status()`, which raises httpx's own error) or an `httpx.HTTPError`.
Building an `httpx.Response` for every answer was ~40% of a GET's CPU. A pooled connection the
server closed under the request (the engines' keep-alive is 5 s, a busy engine's check interval
too) is retried once at once on a new connection, as httpx's callers did.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any

import httpx

from proxy.config import TimeoutsConfig
from proxy.upstream.errors import (
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamDisconnected,
    UpstreamError,
)
from proxy.upstream.pool import Target, Upstream


class Answer:
    """An answer to a background GET, read as an `httpx.Response` is."""

    __slots__ = ("content", "request", "status_code")

    def __init__(self, status_code: int, content: bytes, request: httpx.Request) -> None:
        self.status_code = status_code
        self.content = content
        self.request = request

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")  # (httpx's default without a charset)

    def json(self) -> Any:
        return json.loads(self.content)

    def raise_for_status(self) -> Answer:
        """Itself for a 2xx; else httpx's HTTPStatusError, as httpx.Response raises it."""
        if 200 <= self.status_code < 300:
            return self
        httpx.Response(
            self.status_code, content=self.content, request=self.request
        ).raise_for_status()
        return self  # (unreached: every other status raises)


# The most of one answer read (a vLLM's /metrics with many LoRA adapters is a few hundred kB)
MAX_CONTROL_BYTES = 16 * 1024 * 1024


class ControlClient:
    """GETs to the backends within a deadline, on pooled connections of their own."""

    def __init__(self, timeouts: TimeoutsConfig, ssl_context: ssl.SSLContext | None = None):
        self._pool = Upstream(
            timeouts, max_per_host=2, ssl_context=ssl_context, max_response_bytes=MAX_CONTROL_BYTES
        )
        # per URL: its parsed target, and the httpx request its answers name (parsing a URL
        # in httpx costs as much as the rest of an answer's object)
        self._targets: dict[str, tuple[Target, httpx.Request]] = {}

    async def start(self) -> None:
        await self._pool.start()

    async def close(self) -> None:
        await self._pool.close()
        self._targets.clear()

    def forget(self, base_url: str) -> None:
        """A backend left: its idle connections close, its parsed URLs go."""
        self._pool.forget_backend(base_url)
        base = base_url.rstrip("/")
        for url in [u for u in self._targets if u == base or u.startswith(base + "/")]:
            del self._targets[url]  # (not another port's: :800 is no prefix of :8000/...)

    async def get(
        self, url: str, headers: dict[str, str] | None = None, limit_s: float = 5.0
    ) -> Answer:
        """The answer to a GET of `url`, read whole within `limit_s` seconds."""
        known = self._targets.get(url)
        if known is None:
            known = self._targets[url] = (Target(url, "GET"), httpx.Request("GET", url))
        target, request = known
        try:
            async with asyncio.timeout(limit_s):
                try:
                    status, content = await self._once(target, headers or {}, fresh=False)
                except UpstreamDisconnected as e:
                    if not e.reused:
                        raise
                    status, content = await self._once(target, headers or {}, fresh=True)
        except UpstreamConnectTimeout as e:
            raise httpx.ConnectTimeout(str(e), request=request) from e
        except TimeoutError as e:  # the deadline, or the pool's first-byte or idle one
            raise httpx.ReadTimeout(f"no whole answer within {limit_s:g}s", request=request) from e
        except UpstreamConnectError as e:
            raise httpx.ConnectError(str(e), request=request) from e
        except UpstreamDisconnected as e:
            raise httpx.RemoteProtocolError(str(e), request=request) from e
        except (UpstreamError, OSError) as e:
            raise httpx.ReadError(f"{type(e).__name__}: {e}", request=request) from e
        return Answer(status, content, request)

    async def _once(
        self, target: Target, headers: dict[str, str], fresh: bool
    ) -> tuple[int, bytes]:
        response = await self._pool.post(target, b"", headers, fresh=fresh)
        try:
            return response.status, await response.read()
        finally:
            response.release()
