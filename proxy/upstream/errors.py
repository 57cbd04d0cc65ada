"""The typed errors of an upstream exchange, and which of them may be retried elsewhere.

Apart from proxy/upstream/conn.py, which raises most of them, because conn.py is compiled
with mypyc (proxy.HOT_PATH) and mypyc cannot compile a subclass of TimeoutError.
"""

from __future__ import annotations


class UpstreamError(Exception):
    """Any failure of the upstream exchange other than a timeout."""


class UpstreamTimeout(TimeoutError):
    """A read deadline passed (a TimeoutError, so what catches those catches it)."""


class UpstreamFirstByteTimeout(UpstreamTimeout):
    """No response head and first body byte within the first-byte budget of the request."""


class UpstreamIdleTimeout(UpstreamTimeout):
    """The response had started: no progress within the idle budget (a complete event for a
    stream, the whole body for a read())."""


class UpstreamConnectError(UpstreamError):
    """The backend refused or could not be reached; nothing was sent."""


class UpstreamConnectTimeout(UpstreamConnectError):
    """No connection within the connect timeout (or no free slot under the host's cap)."""


class UpstreamDisconnected(UpstreamError):
    """The connection closed before any byte of a response arrived."""

    def __init__(self, message: str, reused: bool = False) -> None:
        super().__init__(message)
        self.reused = reused


class UpstreamPayloadError(UpstreamError):
    """The response broke off after it started."""


class UpstreamProtocolError(UpstreamPayloadError):
    """The response was not valid HTTP/1.1."""


class UpstreamHeadTooLarge(UpstreamProtocolError):
    """The response head was over MAX_HEAD_BYTES or had more than MAX_HEADERS fields: a
    protocol error like any invalid head (retried elsewhere when nothing reached the client)."""


class UpstreamResponseTooLarge(UpstreamError):
    """A whole body over the response's limit (read() without a limit); `limit` in bytes."""

    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


class UpstreamOverBudget(UpstreamResponseTooLarge):
    """A whole body refused because the bodies being held at once have taken the budget."""


# Errors that mean "this backend did not take the request": safe to retry elsewhere.
# Refused/unreachable marks the backend down for a while; a pooled connection the server had
# just closed (keep-alive race) says nothing about the backend's health.
REFUSED_ERRORS: tuple[type[BaseException], ...] = (UpstreamConnectError,)
CONNECT_ERRORS: tuple[type[BaseException], ...] = (UpstreamConnectError, UpstreamDisconnected)
# Errors while reading a response that has started.
READ_ERRORS: tuple[type[BaseException], ...] = (UpstreamError, UpstreamTimeout)
