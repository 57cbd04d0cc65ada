"""Request intake: the client's body, read within its limit (proxy.asgi.read_body), parsed
once, validated, and turned into an Exchange (what the backend will be sent, and what the
client asked for)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson

from proxy.errors import RequestError
from proxy.forwarding.exchange import STREAMABLE, Exchange
from proxy.forwarding.validate import validate
from proxy.redact import quote


def parse(
    api: str,
    raw: bytes,
    headers: dict[str, str],
    request_id: str,
    may_serve: Callable[[str], bool],
) -> Exchange:
    """One JSON parse and the checks a client must hear about as a 4xx."""
    t0 = time.perf_counter()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise RequestError(
            400, f"We could not parse the JSON body of your request ({e}).", code="invalid_json"
        ) from None
    validate(api, body)
    model = body["model"]
    if not may_serve(model):
        raise RequestError(
            404,
            f"The model `{quote(model)}` does not exist or is not served by any "
            "backend of this proxy. GET /v1/models lists the models served.",
            param="model",
            code="model_not_found",
        )
    stream = bool(body.get("stream", False)) and api in STREAMABLE
    ex = Exchange(api, request_id, t0, headers, body, raw, stream)
    if stream and api != "responses":
        opts = body.get("stream_options") or {}
        if not opts.get("include_usage"):
            # We need usage for TPOT and token metrics; the client gets exactly what it
            # asked for because the meter removes this one chunk again.
            ex.client_raw = raw
            if opts.get("continuous_usage_stats"):
                # vLLM honours it only with include_usage: the client, who did not set that,
                # would get usage on every chunk once we do. Ask for the final usage only.
                opts = {**opts, "continuous_usage_stats": False}
                body["stream_options"] = opts
            ex.raw = with_include_usage(raw, body)
            body["stream_options"] = {**opts, "include_usage": True}
            ex.strip_usage = True
    return ex


_INCLUDE_USAGE = b'"stream_options":{"include_usage":true},'


def with_include_usage(raw: bytes, body: dict[str, Any]) -> bytes:
    """The client's JSON with stream_options.include_usage set, as the backend gets it.

    Without a stream_options key (the usual request) the member is spliced in after the
    opening brace: the body's own bytes stay as they are and a large prompt is not encoded
    again (orjson.dumps of the whole body was the largest cost before the first byte).
    """
    if "stream_options" not in body:
        spliced = _first_member(raw, _INCLUDE_USAGE)
        if spliced is not None:
            return spliced
    opts = body.get("stream_options") or {}
    return orjson.dumps({**body, "stream_options": {**opts, "include_usage": True}})


def with_priority(raw: bytes, body: dict[str, Any], priority: int) -> bytes:
    """`raw` (the JSON object a backend is sent) with its `priority` set to `priority`: for
    an engine that orders its queue by it, the proxy's word replaces the client's. Spliced in
    after the opening brace unless the client sent one (then the object is encoded again)."""
    if "priority" not in body:
        spliced = _first_member(raw, b'"priority":%d,' % priority)
        if spliced is not None:
            return spliced
    return orjson.dumps({**orjson.loads(raw), "priority": priority})


def _first_member(raw: bytes, member: bytes) -> bytes | None:
    """`raw` (a non-empty JSON object) with `member` (`"key":value,`) spliced in after its
    opening brace, or None for an empty object."""
    i = raw.find(b"{")  # a JSON object: only whitespace can come before its brace
    if i >= 0 and raw[i + 1 :].lstrip()[:1] not in (b"}", b""):
        return raw[: i + 1] + member + raw[i + 1 :]
    return None


def too_large(size: int, limit: int) -> RequestError:
    """The 413 for a body over server.max_body_bytes (proxy.asgi.BodyTooLarge's numbers)."""
    return RequestError(
        413,
        f"Request body of {size} bytes exceeds this proxy's limit of {limit} "
        "bytes (server.max_body_bytes).",
        code="request_too_large",
    )
