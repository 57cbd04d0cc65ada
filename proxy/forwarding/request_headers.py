"""What a backend is sent besides the body: the client's headers, less hop-by-hop ones and
credentials meant for the proxy, plus the proxy's own and the forwarding chain.

Built once per attempt (the P/D flows' legs included), on the request side of the path: the
relay owns only what goes back to the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.forwarding.exchange import Exchange
from proxy.upstream.pool import NOT_FORWARDED_UPSTREAM

if TYPE_CHECKING:
    from proxy.upstream.backends import Backend

__all__ = ["NOT_UPSTREAM", "upstream_headers"]

# Never forwarded upstream besides the hop-by-hop set: credentials meant for the proxy (in
# any of the usual spellings), and Expect (the proxy has the whole body already).
NOT_UPSTREAM = NOT_FORWARDED_UPSTREAM | {
    "api-key",
    "x-goog-api-key",
    "anthropic-api-key",
    "x-auth-token",
    "expect",
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-request-id",
}


def upstream_headers(
    ex: Exchange, backend: Backend, client: tuple[str, int] | None = None
) -> dict[str, str]:
    """The headers a backend gets: the client's, less hop-by-hop, credentials and the names
    its Connection header lists (RFC 9110 7.6.1), plus ours and the forwarding chain."""
    headers = ex.headers
    drop = NOT_UPSTREAM
    named = headers.get("connection")
    if named:
        drop = drop | {n.strip().lower() for n in named.split(",")}
    out = {k: v for k, v in headers.items() if k not in drop}
    out["content-type"] = "application/json"
    out["accept-encoding"] = "identity"  # the meter reads the bytes; no compression
    out["x-request-id"] = ex.request_id
    if client is not None:
        prior = headers.get("x-forwarded-for")
        out["x-forwarded-for"] = f"{prior}, {client[0]}" if prior else client[0]
        fwd = headers.get("forwarded")
        host = client[0] if ":" not in client[0] else f'"[{client[0]}]"'
        out["forwarded"] = f"{fwd}, for={host}" if fwd else f"for={host}"
    elif "x-forwarded-for" in headers:
        out["x-forwarded-for"] = headers["x-forwarded-for"]
    if backend.api_key:
        out["authorization"] = f"Bearer {backend.api_key}"
    return out
