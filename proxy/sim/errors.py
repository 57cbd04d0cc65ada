"""The simulated engine's errors: vLLM's error bodies, and the stream cut on purpose."""

from __future__ import annotations

from typing import Any

import orjson

ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class HTTPError(Exception):
    """An answer of `status` with vLLM's error body, raised before any response byte."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class StreamCut(Exception):
    """Raised on purpose after the response started: the server drops the connection."""


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    err: dict[str, Any] = {"message": message, "type": ERROR_TYPES.get(status, "Error")}
    err.update(param=param, code=status)
    return orjson.dumps({"error": err})
