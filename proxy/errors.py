"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import orjson

from proxy.sse import SSE_DONE, sse


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def sse_error_event(message: str, type_: str = "server_error", code: str | None = None) -> bytes:
    """A mid-stream error in the shape OpenAI's clients raise on, then a clean end of stream."""
    error = {"message": message, "type": type_, "param": None, "code": code}
    return sse({"error": error}) + SSE_DONE


class RequestError(Exception):
    """A client error detected before routing; carries the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)
