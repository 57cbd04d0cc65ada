"""The hot path: a raw ASGI endpoint that validates, routes and streams one request.

Raw ASGI on purpose (the measured costs are in docs/architecture.md): no BaseHTTPMiddleware,
no StreamingResponse, one JSON parse of the request, whole upstream reads forwarded as they
arrive, and a task watching for the client's disconnect so the upstream is closed at once (the
engine frees its KV cache).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson

from proxy.errors import RequestError, error_body, sse_error_event
from proxy.meter import StreamMeter, meter_json
from proxy.routing.types import Decision, RouteContext
from proxy.upstream import (
    CONNECT_ERRORS,
    NOT_FORWARDED_DOWNSTREAM_B,
    NOT_FORWARDED_UPSTREAM,
    READ_ERRORS,
    REFUSED_ERRORS,
    UpstreamResponse,
)
from proxy.validate import validate

if TYPE_CHECKING:
    from proxy.app import AppState
    from proxy.backends import Backend
    from proxy.telemetry import RequestRecord

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("warmroute.forward")

API_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
}
STREAMABLE = frozenset({"chat", "completions", "responses"})
JSON_HEADERS = [(b"content-type", b"application/json")]
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


class _Retry(Exception):
    """This attempt failed before anything reached the client: try the next backend."""

    def __init__(
        self, reason: str, error_type: str, status: int | None = None, connect: bool = False
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error_type = error_type
        self.status = status
        self.connect = connect


@dataclass
class Exchange:
    """Everything about one client request as it moves through the proxy."""

    api: str
    request_id: str
    t0: float
    headers: dict[str, str]
    body: dict[str, Any]
    raw: bytes  # what we send upstream (the client's bytes unless we had to change them)
    stream: bool
    strip_usage: bool = False
    client_raw: bytes = b""  # the client's own bytes, for backends we must not inject into
    decision: Decision | None = None
    attempts: list[str] = field(default_factory=list)
    client_gone: bool = False
    upstream: UpstreamResponse | None = None  # the live upstream response, if any
    ctx: RouteContext | None = None
    started_response: bool = False


class ProxyEndpoint:
    """POST /v1/<api>: one instance per API, sharing the app's state."""

    def __init__(self, state: AppState, api: str) -> None:
        self.state = state
        self.api = api
        self.path = API_PATHS[api]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id") or os.urandom(16).hex()  # uuid4().hex: 3x the CPU
        state = self.state
        state.open_requests += 1
        try:
            if scope["method"] != "POST":
                await _respond(
                    send,
                    405,
                    error_body(f"Use POST for {self.path}.", code="method_not_allowed"),
                    request_id,
                )
                return
            try:
                raw = await self._read_body(headers, receive)
                if raw is None:  # client left while sending
                    return
                ex = self._parse(raw, headers, request_id)
            except RequestError as e:
                log.info("request %s rejected (%d %s): %s", request_id, e.status, e.code, e.message)
                await _respond(send, e.status, e.body(), request_id)
                return
            await self._handle(ex, receive, send)
        finally:
            state.open_requests -= 1

    # -- request intake -------------------------------------------------------------------
    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes | None:
        limit = self.state.config.server.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _parse(self, raw: bytes, headers: dict[str, str], request_id: str) -> Exchange:
        t0 = time.perf_counter()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise RequestError(
                400, f"We could not parse the JSON body of your request ({e}).", code="invalid_json"
            ) from None
        validate(self.api, body)
        model = body["model"]
        if not self.state.registry.may_serve(model):
            raise RequestError(
                404,
                f"The model `{model}` does not exist or is not served by any "
                "backend of this proxy. GET /v1/models lists the models served.",
                param="model",
                code="model_not_found",
            )
        stream = bool(body.get("stream", False)) and self.api in STREAMABLE
        ex = Exchange(self.api, request_id, t0, headers, body, raw, stream)
        if stream and self.api != "responses":
            opts = body.get("stream_options") or {}
            if not opts.get("include_usage"):
                # We need usage for TPOT and token metrics; the client gets exactly what it
                # asked for because the meter removes this one chunk again.
                ex.client_raw = raw
                ex.raw = with_include_usage(raw, body)
                body["stream_options"] = {**opts, "include_usage": True}
                ex.strip_usage = True
        return ex

    # -- routing and attempts -------------------------------------------------------------
    async def _handle(self, ex: Exchange, receive: Receive, send: Send) -> None:
        state = self.state
        ctx = RouteContext(
            request_id=ex.request_id,
            model=ex.body["model"],
            api=self.api,
            body=ex.body,
            headers=ex.headers,
            now=time.monotonic(),
            session_key=ex.headers.get("x-session-id") or ex.body.get("user"),
        )
        decision = await state.router.route(ctx, state.views())
        ex.decision = decision
        ex.ctx = ctx
        state.telemetry.observe_routing(decision.policy, decision.reason, decision.decision_s)
        record = state.start_record(ex)
        record.set_decision(decision)
        ranking = decision.ranking[: state.config.retries.max_attempts]
        if not ranking:
            why = (
                "; ".join(f"{k}: {v}" for k, v in decision.filtered_out.items())
                or "none configured"
            )
            await self._fail(
                ex,
                send,
                record,
                503,
                f"No backend can serve model `{ex.body['model']}` right now ({why}).",
                "no_backend",
            )
            return
        # One watcher for the whole request: `send()` does not report a departed client, and
        # an engine must hear of the abort even while it is still queueing or prefilling.
        task = asyncio.current_task()
        assert task is not None
        watcher = task.get_loop().create_task(_watch_disconnect(receive, ex, task))
        try:
            await self._attempts(ex, ranking, record, receive, send)
        except asyncio.CancelledError:
            if not ex.client_gone:
                raise
            task.uncancel()  # our own cancel (the client left while we awaited the backend)
            log.info(
                "request %s: client disconnected before the first byte; upstream closed",
                ex.request_id,
            )
            record.finish(None, status=499, error_type="cancelled")
        except Exception as e:
            # A bug or an unexpected failure must neither hang the client nor leak the span.
            log.exception("request %s: unexpected %s", ex.request_id, type(e).__name__)
            if not ex.started_response:
                await _respond(
                    send,
                    500,
                    error_body(f"Internal proxy error ({type(e).__name__}).", "server_error"),
                    ex.request_id,
                )
            record.finish(None, status=500, error_type=type(e).__name__)
        finally:
            watcher.cancel()

    async def _attempts(
        self,
        ex: Exchange,
        ranking: list[str],
        record: RequestRecord,
        receive: Receive,
        send: Send,
    ) -> None:
        state = self.state
        failures: list[str] = []
        for attempt_no, name in enumerate(ranking, start=1):
            if ex.client_gone:
                break
            backend = state.registry[name]
            try:
                await self._attempt(ex, backend, attempt_no, record, receive, send)
                return
            except _Retry as r:
                failures.append(f"{backend.name}: {r.reason}")
                state.registry.mark_failure(backend, r.reason, connect=r.connect)
                log.warning(
                    "request %s attempt %d on %s failed before the first byte: %s%s",
                    ex.request_id,
                    attempt_no,
                    backend.name,
                    r.reason,
                    "; retrying" if attempt_no < len(ranking) else "",
                )
        if ex.client_gone:
            record.finish(None, status=499, error_type="cancelled")
            return
        await self._fail(
            ex,
            send,
            record,
            503,
            "All backends failed before responding: " + "; ".join(failures) + ".",
            "backends_unavailable",
        )

    async def _fail(
        self, ex: Exchange, send: Send, record: RequestRecord, status: int, message: str, code: str
    ) -> None:
        log.error("request %s failed: %s", ex.request_id, message)
        await _respond(send, status, error_body(message, "server_error", None, code), ex.request_id)
        record.finish(None, status=status, error_type=code)

    @staticmethod
    def _body_for(ex: Exchange, backend: Backend) -> bytes:
        return ex.client_raw if ex.strip_usage and _keeps_own_usage(backend) else ex.raw

    def _upstream_headers(self, ex: Exchange, backend: Backend) -> dict[str, str]:
        out = {k: v for k, v in ex.headers.items() if k not in NOT_FORWARDED_UPSTREAM}
        out["content-type"] = "application/json"
        out["accept-encoding"] = "identity"  # the meter reads the bytes; no compression
        out["x-request-id"] = ex.request_id
        if backend.api_key:
            out["authorization"] = f"Bearer {backend.api_key}"
        return out

    def _response_headers(
        self, ex: Exchange, backend: Backend, upstream: UpstreamResponse
    ) -> list[tuple[bytes, bytes]]:
        out = [
            (k, v)
            for k, v in upstream.headers
            if k not in NOT_FORWARDED_DOWNSTREAM_B and k != b"x-request-id"
        ]
        out.append((b"x-request-id", ex.request_id.encode("latin-1")))
        out.append((b"x-warmroute-backend", backend.name.encode("latin-1")))
        if self.state.config.server.debug_headers and ex.decision is not None:
            out.append((b"x-warmroute-route", orjson.dumps(ex.decision.as_dict())))
        return out

    async def _attempt(
        self,
        ex: Exchange,
        backend: Backend,
        attempt_no: int,
        record: RequestRecord,
        receive: Receive,
        send: Send,
    ) -> None:
        state = self.state
        headers = self._upstream_headers(ex, backend)
        attempt = record.attempt(
            backend=backend.name, address=backend.host, port=backend.port, attempt=attempt_no
        )
        attempt.inject_headers(headers)
        ex.attempts.append(backend.name)
        state.inflight_changed(backend, +1)
        try:
            t_sent = time.perf_counter()
            try:
                upstream = await state.upstream.post(
                    state.upstream.url(backend.url, self.path),
                    self._body_for(ex, backend),
                    headers,
                    partial(_sent, state, ex, backend.name),
                )
            except CONNECT_ERRORS as e:
                refused = isinstance(e, REFUSED_ERRORS)
                raise _Retry(_describe(e), "connect_error", connect=refused) from None
            except TimeoutError:
                raise _Retry(
                    "no response headers within the first-byte timeout", "timeout"
                ) from None
            ex.upstream = upstream
            try:
                if upstream.status in RETRYABLE_STATUS:
                    detail = await _read_error_detail(upstream)
                    raise _Retry(
                        f"HTTP {upstream.status}{detail}",
                        f"http_{upstream.status}",
                        upstream.status,
                    )
                state.registry.mark_success(backend)
                if ex.stream and upstream.status == 200:
                    await self._stream(ex, backend, upstream, t_sent, record, receive, send)
                else:
                    await self._whole(ex, backend, upstream, record, send)
            finally:
                ex.upstream = None
                upstream.release()
        except _Retry as r:
            attempt.fail(r.error_type, r.status)
            raise
        finally:
            state.inflight_changed(backend, -1)

    # -- response relay -------------------------------------------------------------------
    async def _whole(
        self,
        ex: Exchange,
        backend: Backend,
        upstream: UpstreamResponse,
        record: RequestRecord,
        send: Send,
    ) -> None:
        try:
            payload = await upstream.read()
        except READ_ERRORS as e:
            raise _Retry(f"response body broke off: {_describe(e)}", "body_error") from None
        await send(
            {
                "type": "http.response.start",
                "status": upstream.status,
                "headers": [
                    *self._response_headers(ex, backend, upstream),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        ex.started_response = True
        await send({"type": "http.response.body", "body": payload})
        facts = None
        if upstream.status == 200 and self.api != "embeddings":
            facts = meter_json(self.api, payload, t0=ex.t0, now=time.perf_counter())
            self.state.observe_response(backend, facts, ex.ctx)
        record.finish(
            facts,
            status=upstream.status,
            error_type=None if upstream.status < 400 else f"http_{upstream.status}",
            backend=backend.name,
        )

    async def _stream(
        self,
        ex: Exchange,
        backend: Backend,
        upstream: UpstreamResponse,
        t_sent: float,
        record: RequestRecord,
        receive: Receive,
        send: Send,
    ) -> None:
        state = self.state
        strip = ex.strip_usage and not _keeps_own_usage(backend)
        meter = StreamMeter(self.api, t0=ex.t0, strip_usage=strip)  # type: ignore[arg-type]
        meter.upstream_sent(t_sent)
        content = upstream
        # The first read decides between "retry elsewhere" and "committed to this backend".
        try:
            data = await content.readany()
        except READ_ERRORS as e:
            kind = "timeout" if isinstance(e, TimeoutError) else "stream_error"
            raise _Retry(f"no first byte: {_describe(e)}", kind) from None
        if not data:
            raise _Retry("the backend closed the stream before sending anything", "empty_stream")
        state.upstream.set_read_timeout(upstream, state.config.timeouts.idle_s)

        error: str | None = None
        reason = ""
        await send(
            {
                "type": "http.response.start",
                "status": upstream.status,
                "headers": self._response_headers(ex, backend, upstream),
            }
        )
        ex.started_response = True
        perf = time.perf_counter
        first = True
        while data:
            received = perf()
            if first and meter.passes_through(data):
                # The first read goes out before it is metered when metering cannot change
                # it (the usual case): the meter's parse of the first event stays off the
                # client's TTFT. Later reads are metered first: the check costs more CPU per
                # read than the order saves.
                first = False
                await send({"type": "http.response.body", "body": data, "more_body": True})
                sent = perf()
                meter.feed(data, received)
                meter.mark_sent(sent)
            else:
                first = False
                data = meter.feed(data, received)
                if data:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    meter.mark_sent(perf())
            try:
                data = await content.readany()
            except READ_ERRORS as e:
                if ex.client_gone:
                    break
                timed_out = isinstance(e, TimeoutError)
                error = "idle_timeout" if timed_out else "upstream_stream_error"
                reason = (
                    f"no data from {backend.name} for {state.config.timeouts.idle_s:g}s"
                    if timed_out
                    else f"{backend.name} broke off the stream: {_describe(e)}"
                )
                log.warning(
                    "request %s: %s after the first byte; ending the stream with an error event",
                    ex.request_id,
                    reason,
                )
                break
        # A client that hangs up right after the last event got everything: not a cancel.
        cancelled = ex.client_gone and not meter.completed
        tail, facts = meter.finish(perf(), error=error, cancelled=cancelled)
        state.observe_stream(backend, facts, ex.ctx)
        if facts.error and not error:
            error = facts.error
        if not ex.client_gone:
            if error in ("idle_timeout", "upstream_stream_error"):
                tail += sse_error_event(reason, "server_error", error)
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        elif cancelled:
            log.info(
                "request %s: client disconnected mid-stream; closed the upstream on %s",
                ex.request_id,
                backend.name,
            )
        record.finish(
            facts,
            status=499 if cancelled else upstream.status,
            error_type="cancelled" if cancelled else error,
            backend=backend.name,
        )


_INCLUDE_USAGE = b'"stream_options":{"include_usage":true},'


def with_include_usage(raw: bytes, body: dict[str, Any]) -> bytes:
    """The client's JSON with stream_options.include_usage set, as the backend gets it.

    Without a stream_options key (the usual request) the member is spliced in after the
    opening brace: the body's own bytes stay as they are and a large prompt is not encoded
    again (orjson.dumps of the whole body was the largest cost before the first byte).
    """
    if "stream_options" not in body:
        i = raw.find(b"{")  # a JSON object: only whitespace can come before its brace
        if i >= 0 and raw[i + 1 :].lstrip()[:1] not in (b"}", b""):
            return raw[: i + 1] + _INCLUDE_USAGE + raw[i + 1 :]
    opts = body.get("stream_options") or {}
    return orjson.dumps({**body, "stream_options": {**opts, "include_usage": True}})


def _sent(state: AppState, ex: Exchange, backend: str) -> None:
    """The request is on the wire to `backend`: note its prefix there (the engine caches it
    where the request lands, which a retry may have moved) while the backend works on it."""
    if ex.ctx is not None:
        state.router.record(ex.ctx, backend)


def _keeps_own_usage(backend: Backend) -> bool:
    """llama.cpp moves its `timings` onto the usage chunk when include_usage is set, so
    stripping that chunk would take them from the client: send such engines the client's
    own request instead (the meter still reads usage from the finish chunk if present)."""
    return backend.cfg.engine == "llamacpp"


async def _watch_disconnect(receive: Receive, ex: Exchange, task: asyncio.Task[Any]) -> None:
    """Wait for http.disconnect; then close the upstream socket so the engine aborts at once."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            ex.client_gone = True
            if ex.upstream is not None:
                ex.upstream.close()  # the pending read fails; the forwarder sees client_gone
            else:
                task.cancel()  # still connecting or awaiting headers: abandon that await
            return


async def _read_error_detail(upstream: UpstreamResponse) -> str:
    try:
        body = await asyncio.wait_for(upstream.read(2048), 1.0)
        message = orjson.loads(body).get("error", {}).get("message") if body else None
        return (
            f" ({message})"
            if message
            else f" ({body[:200].decode('utf-8', 'replace')})"
            if body
            else ""
        )
    except Exception:
        return ""


def _describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) < 300 else text[:300] + "..."


def _too_large(size: int, limit: int) -> RequestError:
    return RequestError(
        413,
        f"Request body of {size} bytes exceeds this proxy's limit of {limit} "
        "bytes (server.max_body_bytes).",
        code="request_too_large",
    )


async def _respond(send: Send, status: int, body: bytes, request_id: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                *JSON_HEADERS,
                (b"content-length", str(len(body)).encode()),
                (b"x-request-id", request_id.encode("latin-1")),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
