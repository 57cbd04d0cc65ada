"""The hot path: a raw ASGI endpoint that validates, routes and streams one request.

The pipeline, each stage in its own module:

    intake (intake.py)       body within its limit, one JSON parse, validation -> Exchange
    route  (RequestRouting)  the ranking of backends for this request
    attempt (attempts.py)    one leg: one request to one backend, up to its response head;
                             the prefill/decode flows (pdflow.py) are this step's variant
    retry  (retry.py)        after a failed attempt: where next, after how long, or stop
    relay  (relay.py)        the response to the client, metered, event-aligned

The endpoint gets its collaborators (`Forwarding`) instead of the app's state: an upstream
client, the fleet's health, the routing facade and the telemetry recorder, so it runs against
an in-memory fake upstream in tests.

Raw ASGI on purpose (the measured costs are in docs/architecture.md): no BaseHTTPMiddleware,
no StreamingResponse, one JSON parse of the request, whole upstream reads forwarded as they
arrive, and a task watching for the client's disconnect so the upstream is closed at once (the
engine frees its KV cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proxy.admission.backend_queue import all_at_bound
from proxy.admission.slots import TICKET, quiet, served
from proxy.asgi import (
    BodyTooLarge,
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    Watch,
    disconnect_watch,
    headers_of,
    read_body,
)
from proxy.config import Config
from proxy.errors import RequestError, error_body
from proxy.forwarding.attempts import Attempts, fail
from proxy.forwarding.budget_gate import through_budgets
from proxy.forwarding.exchange import API_PATHS, Exchange
from proxy.forwarding.intake import parse, too_large, with_include_usage
from proxy.forwarding.relay import Relay, internal_error, respond
from proxy.forwarding.retry import RetryPolicy
from proxy.forwarding.state import Fleet, Recorder, RequestRouting, UpstreamClient, start_record
from proxy.redact import quote, sane_request_id
from proxy.routing.types import Decision, PromptUnreadable, RouteContext

if TYPE_CHECKING:
    from proxy.fleet.reconciler import Reconciler as Membership
    from proxy.forwarding.pdflow import PdFlows
    from proxy.telemetry import RequestRecord
    from proxy.tenants.budgets import Budgets

__all__ = ["API_PATHS", "Forwarding", "ProxyEndpoint", "with_include_usage"]

log = logging.getLogger("warmroute.forward")


@dataclass
class Forwarding:
    """What the forwarder needs, and nothing more."""

    config: Config
    fleet: Fleet
    upstream: UpstreamClient
    steering: RequestRouting
    recorder: Recorder
    retry: RetryPolicy
    pd: PdFlows | None = None  # disagg.mode on or auto
    open_requests: int = 0
    # The fleet's membership (proxy/fleet/reconciler.py): its epoch, and whether it is
    # changing now, go on every request's span.
    membership: Membership | None = None
    budgets: Budgets | None = None  # the tenants' limits (proxy/tenants/), when any is set


class ProxyEndpoint:
    """POST /v1/<api>: one instance per API, sharing the app's collaborators."""

    def __init__(self, fw: Forwarding, api: str) -> None:
        self.fw = fw
        self.api = api
        self.path = API_PATHS[api]
        self.relay = Relay(
            api, fw.steering, fw.config.timeouts.idle_s, fw.config.server.debug_headers, fw.fleet
        )
        self.attempts = Attempts(fw, self.path, self.relay)
        self.pd = fw.pd  # the prefill/decode flows (pdflow.py); None when disagg is off

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = headers_of(scope)
        # sanitised once, here: the response, logs, spans and the backend get this one
        request_id = sane_request_id(headers.get("x-request-id"))
        fw = self.fw
        fw.open_requests += 1
        try:
            if scope["method"] != "POST":
                await respond(
                    send,
                    405,
                    error_body(f"Use POST for {self.path}.", code="method_not_allowed"),
                    request_id,
                    ((b"allow", b"POST"),),
                )
                return
            coding = headers.get("content-encoding")
            if coding and coding.strip().lower() != "identity":
                await _refuse_coded(send, request_id, coding)
                return
            limit = fw.config.server.max_body_bytes
            try:
                raw = await read_body(receive, limit, headers.get("content-length"))
                ex = parse(self.api, raw, headers, request_id, fw.fleet.may_serve)
            except ClientDisconnected:
                return
            except (RequestError, BodyTooLarge) as exc:
                e = exc if isinstance(exc, RequestError) else too_large(exc.size, exc.limit)
                log.info("request %s rejected (%d %s): %s", request_id, e.status, e.code, e.message)
                fw.recorder.refused(e.status, e.code or "invalid_request")
                await respond(send, e.status, e.body(), request_id)
                return
            client = scope.get("client")
            watch = disconnect_watch(scope, receive)
            if fw.budgets is None:
                await self._handle(ex, client, watch, send)
            else:
                handle = functools.partial(self._handle, ex, client, watch)
                await through_budgets(fw.budgets, ex, send, handle, fw.recorder.refused)
            served(ex.facts)  # the admission's fair share counts the engine's tokens
        finally:
            fw.open_requests -= 1

    # -- routing and attempts -------------------------------------------------------------
    async def _handle(self, ex: Exchange, client: Any, watch: Watch, send: Send) -> None:
        """The request's straight path: route, then attempts (or the P/D flow) to the end."""
        fw = self.fw
        decision = await self._route(ex, send)
        if decision is None:
            return
        ex.client = (client[0], client[1]) if client else None
        fw.recorder.observe_routing(decision.policy, decision.reason, decision.decision_s)
        fw.retry.budget.request()
        record = start_record(fw.recorder, ex)
        record.set_decision(decision)
        if fw.membership is not None and ex.ctx is not None:
            record.set_fleet(fw.membership.epoch, fw.membership.changing(ex.ctx.now))
        if not decision.ranking and not self._may_wait(decision):
            await self._refuse_unranked(ex, send, record, decision.filtered_out)
            return
        try:
            await self._run(ex, record, watch, send)
        finally:
            fw.steering.finished(ex.decision)

    async def _route(self, ex: Exchange, send: Send) -> Decision | None:
        """The routing decision (kept on the exchange with its context), or None: routing
        could not read the request, and the client got a 400."""
        ctx = RouteContext(
            request_id=ex.request_id,
            model=ex.body["model"],
            api=self.api,
            body=ex.body,
            headers=ex.headers,
            now=time.monotonic(),
            session_key=ex.headers.get("x-session-id") or ex.body.get("user"),
            quiet=quiet(),
        )
        try:
            decision = await self.fw.steering.route(ctx)
        except PromptUnreadable as e:
            why = quote(str(e))
            log.info("request %s rejected (400): routing could not read it: %s", ex.request_id, why)
            await respond(
                send,
                400,
                error_body(f"The request could not be read: {why}.", code="invalid_request"),
                ex.request_id,
            )
            return None
        ex.decision = decision
        ex.ctx = ctx
        return decision

    async def _refuse_unranked(
        self,
        ex: Exchange,
        send: Send,
        record: RequestRecord,
        reasons: Mapping[str, str],
        waited_s: float = 0.0,
    ) -> None:
        """No backend may take the request: 429 when every one is at its in-flight bound
        (overload: the client may come back in a moment), else 503."""
        # a filter's reason may quote the client's model (plugins/model_filter.py)
        why = "; ".join(f"{k}: {quote(v)}" for k, v in reasons.items()) or "none configured"
        model = quote(ex.body["model"])
        if all_at_bound(reasons):
            waited = f" (waited {waited_s:.1f} s for one to free)" if waited_s else ""
            message = (
                f"Every backend for model `{model}` is at its in-flight bound ({why}){waited}; "
                "retry after a short wait."
            )
            retry_after = ((b"retry-after", b"1"),)
            await fail(ex, send, record, 429, message, "backends_at_capacity", retry_after)
            return
        message = f"No backend can serve model `{model}` right now ({why})."
        await fail(ex, send, record, 503, message, "no_backend")

    def _may_wait(self, decision: Decision) -> bool:
        """Whether a request no backend may take now may wait for one (every backend was at
        its in-flight bound, and the proxy keeps a queue for that)."""
        return self.fw.steering.waiting is not None and all_at_bound(decision.filtered_out)

    async def _backend_freed(self, ex: Exchange, record: RequestRecord, send: Send) -> bool:
        """Every backend is at its in-flight bound: wait in the fair order for one of them
        to free a slot (proxy/admission/backend_queue.py) and route again. False: none freed in time
        (or the queue was full), and the client got the 429."""
        queue = self.fw.steering.waiting
        assert queue is not None and ex.decision is not None

        async def again() -> Decision:
            routed = await self._route(ex, send)
            assert routed is not None  # it was read once: routing reads it again
            record.set_decision(routed)
            return routed

        ticket = TICKET.get()
        decision, waiter = await queue.route_when_freed(ticket, ex.decision, again, ex.request_id)
        if ticket is not None:  # (the doctor counts it as waiting for a slot)
            ticket.backend_wait_s = waiter.waited_s
        if waiter.routed:
            record.set_attribute("warmroute.backend_wait_s", round(waiter.waited_s, 6))
            return True
        await self._refuse_unranked(ex, send, record, decision.filtered_out, waiter.waited_s)
        return False

    async def _run(self, ex: Exchange, record: RequestRecord, watch: Watch, send: Send) -> None:
        """The attempts (or the P/D flow) under one disconnect watch, to an answer, an error
        the client is told, or a cut (the client left, shutdown) that ends the record. A
        request whose every backend is at its bound waits for one here, where the client's
        leaving is watched."""
        # One watch for the whole request: `send()` does not report a departed client, and an
        # engine must hear of the abort even while it is still queueing or prefilling.
        task = asyncio.current_task()
        assert task is not None
        ex.task = task
        unwatch = watch(functools.partial(_client_left, ex, task))
        try:
            assert ex.decision is not None
            if not ex.decision.ranking:
                if not await self._backend_freed(ex, record, send):
                    return
            ranking = ex.decision.ranking
            if self.pd is None:
                await self.attempts.run(ex, ranking, ranking[0], record, send)
            else:  # the P/D flows: a variant of the attempt step, on this endpoint's attempts
                await self.pd.run(self.attempts, ex, ranking, record, send)
        except asyncio.CancelledError:
            task.uncancel()
            await self._cancelled(ex, record, send)
        except Exception as e:
            # A bug or an unexpected failure must neither hang the client nor leak the span.
            log.exception("request %s: unexpected %s", ex.request_id, type(e).__name__)
            if not ex.started_response:
                await respond(send, 500, internal_error(e), ex.request_id)
            record.finish(None, status=500, error_type=type(e).__name__)
        finally:
            unwatch()

    async def _cancelled(self, ex: Exchange, record: RequestRecord, send: Send) -> None:
        """The request's task was cancelled: the client left, or the server is shutting down."""
        if ex.client_gone:  # our own cancel (the client left while we awaited the backend)
            log.info(
                "request %s: client disconnected before the first byte; upstream closed",
                ex.request_id,
            )
            record.finish(None, status=499, error_type="cancelled")
        elif not ex.started_response:
            # The server is shutting down past its grace period (a started stream was
            # already ended with an error event by the relay): a clean answer, no traceback.
            log.warning("request %s: cut at shutdown before the first byte", ex.request_id)
            with contextlib.suppress(Exception):
                await respond(
                    send,
                    503,
                    error_body(
                        "The proxy is shutting down; retry the request.",
                        "server_error",
                        None,
                        "shutting_down",
                    ),
                    ex.request_id,
                    ((b"retry-after", b"1"),),
                )
            record.finish(None, status=503, error_type="shutdown")


def _client_left(ex: Exchange, task: asyncio.Task[Any]) -> None:
    """The client's http.disconnect: close the upstream socket so the engine aborts at once."""
    ex.client_gone = True
    if ex.upstream is not None:
        ex.upstream.close()  # the pending read fails; the forwarder sees client_gone
    else:
        task.cancel()  # still connecting or awaiting headers: abandon that await


async def _refuse_coded(send: Send, request_id: str, coding: str) -> None:
    """415 for a request body with a Content-Encoding: the proxy reads the JSON (to validate
    and route it) and sends the backend what it read, so a coded body is neither readable here
    nor forwarded as it came; Accept-Encoding says what is taken (RFC 9110 15.5.16)."""
    log.info("request %s rejected (415): Content-Encoding %r", request_id, coding[:64])
    message = (
        f"Request bodies with Content-Encoding {coding[:64]!r} are not supported by this proxy: "
        "send the JSON uncompressed."
    )
    body = error_body(message, code="unsupported_content_encoding")
    await respond(send, 415, body, request_id, ((b"accept-encoding", b"identity"),))
