"""Pooled keep-alive upstream connections (aiohttp: ~4x less CPU per chunk than httpx here).

PERF-NOTES.md: the upstream client dominates the proxy's CPU, so the streaming path uses
aiohttp directly; httpx remains the client for health checks, discovery and scraping.
"""

from __future__ import annotations

import aiohttp
from yarl import URL

from proxy.config import TimeoutsConfig

# Hop-by-hop headers (RFC 9110 7.6.1) and ones we set ourselves: never copied across.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
NOT_FORWARDED_UPSTREAM = HOP_BY_HOP | {
    "host",
    "content-length",
    "authorization",
    "accept-encoding",
    "cookie",
    "x-api-key",
}
NOT_FORWARDED_DOWNSTREAM = HOP_BY_HOP | {"content-length", "date", "server"}

# Errors that mean "this backend did not take the request": safe to retry elsewhere.
# Refused/unreachable marks the backend down for a while; a pooled connection the server had
# just closed (keep-alive race) says nothing about the backend's health.
REFUSED_ERRORS = (aiohttp.ClientConnectorError,)
CONNECT_ERRORS = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
)


class Upstream:
    """One aiohttp session (a connection pool per backend host) for the whole app."""

    def __init__(self, timeouts: TimeoutsConfig) -> None:
        self.timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[tuple[str, str], URL] = {}

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,  # concurrency is the backends' business; don't queue in the proxy
            # Below the engines' own idle timeout (uvicorn, hence vLLM, and llama.cpp: 5 s), so
            # the pool never hands out a connection the server is closing.
            keepalive_timeout=4,
            ttl_dns_cache=300,
            enable_cleanup_closed=True,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            # sock_read starts as the first-byte budget; the forwarder lowers it to the idle
            # budget once the first byte has arrived.
            timeout=aiohttp.ClientTimeout(
                total=None,
                sock_connect=self.timeouts.connect_s,
                sock_read=self.timeouts.first_byte_s,
            ),
            auto_decompress=False,  # we ask for identity; never re-encode what we forward
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            raise_for_status=False,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def url(self, base: str, path: str) -> URL:
        """A parsed URL per (backend, endpoint), built once: parsing costs ~10 µs a request."""
        key = (base, path)
        url = self._urls.get(key)
        if url is None:
            url = self._urls[key] = URL(base + path)
        return url

    async def post(self, url: URL, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        assert self._session is not None, "Upstream.start() was not awaited"
        return await self._session.post(url, data=body, headers=headers)

    @staticmethod
    def set_read_timeout(resp: aiohttp.ClientResponse, seconds: float) -> None:
        """Switch a live response from the first-byte budget to the idle budget."""
        conn = resp.connection
        if conn is not None and conn.protocol is not None:
            conn.protocol.read_timeout = seconds
            conn.protocol.start_timeout()
