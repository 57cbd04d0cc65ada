"""The edge: every HTTP request passes here first (raw ASGI, before any routing).

In order: a path sent percent-encoded is refused (Starlette routes on the decoded path, so
`/%61dmin/backends` would otherwise reach /admin); the API endpoints check the client's API
key (when keys are configured) and take an admission slot (proxy/admission/slots.py); /admin/* is
served only where server.admin_port / admin_token_sha256 say (proxy/edge/access.py); every other
response gets an `x-request-id`; unknown paths and wrong methods answer OpenAI-style JSON, and
a trailing slash is a 404, never a redirect built from the client's Host header.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from proxy.admission.slots import TICKET, Admission, Ticket
from proxy.asgi import JSON, ASGIApp, Message, Receive, Scope, Send, header, respond
from proxy.edge.access import AdminAccess, KeyRing, bearer
from proxy.edge.limits import APP_STATE_KEY, Connections, ConnLimits, default_max_connections
from proxy.errors import error_body
from proxy.redact import quote, sane_request_id
from proxy.tenants.tickets import PRIORITY_HEADER, TicketError, refusal, ticket_for
from proxy.types import CLIENT, TENANT

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from proxy.admission.backend_queue import BackendQueue
    from proxy.config import ServerConfig, TenantsConfig
    from proxy.telemetry import Telemetry

ADMIN_LISTENER_PATHS = ("/admin/", "/metrics", "/health", "/ready")
log = logging.getLogger("warmroute.edge")


class Edge:
    """Dispatches one HTTP request: API endpoints straight to their raw ASGI handlers, the
    rest (small endpoints, admin, 404s) to the Starlette app."""

    def __init__(
        self,
        server: ServerConfig,
        endpoints: Mapping[str, ASGIApp],
        inner: Starlette,
        telemetry: Telemetry | None = None,
        known_model: Callable[[str], bool] | None = None,
        tenants: TenantsConfig | None = None,
        admission: Admission | None = None,
        backend_queue: BackendQueue | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.backend_queue = backend_queue  # requests waiting for a backend below its bound
        self.inner = inner
        self.keys = KeyRing.from_hex([(k.name, k.sha256) for k in server.api_keys])
        self.isolate_tenants = server.isolate_tenants and bool(self.keys)
        self.admin = AdminAccess.from_settings(
            server.port, server.admin_port, server.admin_token_sha256
        )
        self.admission = admission or Admission(
            server.max_inflight, server.admission_queue, server.admission_timeout_s
        )
        # With keys, each request gets a ticket: its tenant's share and class in the queue.
        self.tenants = tenants
        max_connections = server.max_connections or default_max_connections()
        self.connections = Connections(
            ConnLimits(
                max_header_bytes=server.max_header_bytes,
                max_headers=server.max_headers,
                header_timeout_s=server.header_timeout_s,
                body_timeout_s=server.body_timeout_s,
                max_connections=max_connections,
                write_timeout_s=server.write_timeout_s,
            )
        )
        self.auth_refused = {"api": 0, "admin": 0}
        self.telemetry = telemetry  # API refusals are counted there (warmroute.requests.refused)
        self.client_requests: dict[str, int] = {}
        _json_errors(inner)
        if telemetry is not None:
            if known_model is not None:
                telemetry.bound_model_labels(known_model)
            if telemetry.enabled:
                _observe(self, telemetry)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind != "http":
            if kind == "lifespan" and isinstance(scope.get("state"), dict):
                scope["state"][APP_STATE_KEY] = self.connections  # read by proxy/edge/limits.py
            await self.inner(scope, receive, send)
            return
        if scope.get("raw_path", b"").find(b"%") >= 0:  # (not `in`: see StreamMeter._load)
            rid = [(b"x-request-id", _request_id(scope).encode())]
            message = "This proxy serves no percent-encoded paths."
            await _error(send, 404, message, "not_found", headers=rid)
            return
        admin = self.admin
        on_admin = admin.admin_port is not None and admin.on_admin_listener(scope.get("server"))
        if scope["method"] == "POST" and not on_admin:
            endpoint = self.endpoints.get(scope["path"])
            if endpoint is not None:
                admission = self.admission
                if self.keys or not admission.admit_now():
                    await self._api(endpoint, scope, receive, send)  # a key to check, or a wait
                    return
                # The usual case, without a coroutine of its own (one more frame that every
                # resumption of the request's task would pass through).
                try:
                    await endpoint(scope, receive, send)
                finally:
                    admission.leave()
                return
        await self._other(scope, receive, send, on_admin)

    async def _api(self, endpoint: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        client = None
        if self.keys:
            client = self._client(scope)
            if client is None:  # refusals carry the request id, as the endpoint's answers do
                self._refused(401, "invalid_api_key")
                await _refuse_key(_with_request_id(send, _request_id(scope)), scope)
                return
        ticket = Ticket()  # without keys: one tenant, the standard class (FIFO)
        if client is not None and self.tenants is not None:
            try:
                ticket = ticket_for(
                    self.tenants,
                    client,
                    header(scope, PRIORITY_HEADER.encode()),
                    header(scope, b"content-length"),
                )
            except TicketError as e:
                self._refused(e.status, e.code)
                await _error(
                    _with_request_id(send, _request_id(scope)), e.status, e.message, e.code
                )
                return
        admission = self.admission
        refused = await admission.enter(ticket)
        if refused is not None:
            await self._refuse_admission(refused, ticket, send, scope)
            return
        tokens = None
        if client is not None:
            tokens = (CLIENT.set(client), TENANT.set(client) if self.isolate_tenants else None)
        held = TICKET.set(ticket) if client is not None else None
        try:
            await endpoint(scope, receive, send)
        finally:
            admission.leave(ticket)
            if held is not None:
                TICKET.reset(held)
            if tokens is not None:
                CLIENT.reset(tokens[0])
                if tokens[1] is not None:
                    TENANT.reset(tokens[1])

    async def _refuse_admission(
        self, reason: str, ticket: Ticket, send: Send, scope: Scope
    ) -> None:
        status, code, type_, message = refusal(reason, self.admission, ticket)
        self._refused(status, code)
        if status == 429:
            log.info("request of %s refused (%s): %s", ticket.tenant, reason, message)
        wait = str(self.admission.retry_after_s).encode()
        await _error(
            _with_request_id(send, _request_id(scope)),
            status,
            message,
            code,
            type_,
            [(b"retry-after", wait)],
        )

    def _refused(self, status: int, code: str) -> None:
        if self.telemetry is not None:
            self.telemetry.refused(status, code)

    def _client(self, scope: Scope) -> str | None:
        client = self.keys.match(bearer(scope["headers"]))
        if client is None:
            self.auth_refused["api"] += 1
        else:
            self.client_requests[client] = self.client_requests.get(client, 0) + 1
        return client

    async def _other(self, scope: Scope, receive: Receive, send: Send, on_admin: bool) -> None:
        request_id = _request_id(scope)
        send = _with_request_id(send, request_id)
        path: str = scope["path"]
        tenant = None
        if path.startswith("/admin"):
            refusal = self.admin.refusal(on_admin, bearer(scope["headers"]))
            if refusal is not None:
                if refusal[0] == 401:
                    self.auth_refused["admin"] += 1
                await _error(send, refusal[0], refusal[1], refusal[2])
                return
            if path == "/admin/route/explain":  # explain as that key's tenant would be routed
                query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
                tenant = (query.get("client") or [None])[0] if self.isolate_tenants else None
        elif on_admin and not path.startswith(ADMIN_LISTENER_PATHS):
            await _error(
                send,
                404,
                "This is the admin listener: it serves /admin/*, /metrics, /health and /ready.",
                "not_found",
            )
            return
        elif path == "/v1/models" and self.keys and self._client(scope) is None:
            self._refused(401, "invalid_api_key")
            await _refuse_key(send, scope)
            return
        token = TENANT.set(tenant) if tenant else None
        try:
            await self.inner(scope, receive, send)
        finally:
            if token is not None:
                TENANT.reset(token)


def _request_id(scope: Scope) -> str:
    return sane_request_id(header(scope, b"x-request-id"))  # the API endpoints' rule too


def _with_request_id(send: Send, request_id: str) -> Send:
    rid = request_id.encode("ascii")

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            if not any(k.lower() == b"x-request-id" for k, _ in headers):
                headers.append((b"x-request-id", rid))
                message = {**message, "headers": headers}
        await send(message)

    return send_with_id


async def _error(
    send: Send,
    status: int,
    message: str,
    code: str,
    type_: str = "invalid_request_error",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    await respond(send, status, error_body(message, type_, None, code), JSON, headers or ())


async def _refuse_key(send: Send, scope: Scope) -> None:
    presented = bearer(scope["headers"]) is not None
    message = (
        "Incorrect API key provided."
        if presented
        else "You didn't provide an API key: send `Authorization: Bearer <key>`."
    )
    await _error(
        send,
        401,
        message,
        "invalid_api_key",
        headers=[(b"www-authenticate", b'Bearer realm="warmroute"')],
    )


def _json_errors(inner: Starlette) -> None:
    """404 and 405 as OpenAI-style JSON; no redirect to add or drop a trailing slash."""

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        if status == 405:
            message = f"Method {request.method} is not allowed for {quote(request.url.path)}."
            code = "method_not_allowed"
        elif status == 404:
            path = quote(request.url.path)
            message = f"Unknown path {path}: this proxy serves the OpenAI API at /v1."
            code = "not_found"
        else:
            message, code = str(exc.detail), None
        return Response(error_body(message, code=code), status, exc.headers, "application/json")

    inner.exception_handlers[HTTPException] = http_error
    inner.router.redirect_slashes = False


def _gauge(read: Callable[[], int]) -> Callable[[Any], list[Any]]:
    """An observable's callback: one value, read at collection."""
    from opentelemetry.metrics import Observation

    return lambda _options: [Observation(read())]


def _counts(table: Callable[[], dict[str, int]], key: str) -> Callable[[Any], list[Any]]:
    """An observable's callback: one value per key of `table`, labelled `key`."""
    from opentelemetry.metrics import Observation

    return lambda _options: [Observation(n, {key: k}) for k, n in dict(table()).items()]


def _observe(edge: Edge, telemetry: Telemetry) -> None:
    """The edge's counts as metrics: admission, connections, refused keys, clients."""
    meter = telemetry.meter_provider.get_meter("warmroute")
    _observe_admission(meter, edge.admission, edge.backend_queue)
    conns, gauge, counts = edge.connections, _gauge, _counts
    meter.create_observable_up_down_counter(
        "warmroute.connections.open",
        [gauge(lambda: conns.open)],
        unit="{connection}",
        description="Client connections open (server.max_connections bounds it).",
    )
    meter.create_observable_counter(
        "warmroute.connections.refused",
        [counts(lambda: conns.refused, "warmroute.reason")],
        unit="{connection}",
        description="Client connections closed by a limit (size, timeout, count), by reason.",
    )
    meter.create_observable_counter(
        "warmroute.auth.refused",
        [counts(lambda: edge.auth_refused, "warmroute.route")],
        unit="{request}",
        description="Requests refused for a missing or wrong API key or admin token.",
    )
    meter.create_observable_counter(
        "warmroute.client.requests",
        [counts(lambda: edge.client_requests, "warmroute.client")],
        unit="{request}",
        description="Requests by the name of the API key they presented (configured names only).",
    )


def _observe_admission(meter: Any, admission: Admission, queue: BackendQueue | None) -> None:
    """The waits' metrics: the admission's slots and queue, the wait for a backend."""
    from opentelemetry.metrics import Observation

    gauge, counts = _gauge, _counts
    meter.create_observable_up_down_counter(
        "warmroute.admission.inflight",
        [gauge(lambda: admission.inflight)],
        unit="{request}",
        description="Requests admitted and not yet finished (server.max_inflight bounds it).",
    )
    meter.create_observable_up_down_counter(
        "warmroute.admission.waiting",
        [gauge(lambda: admission.waiting)],
        unit="{request}",
        description="Requests waiting for an admission slot (server.admission_queue).",
    )
    meter.create_observable_counter(
        "warmroute.admission.rejected",
        [counts(lambda: admission.stats.rejected, "warmroute.reason")],
        unit="{request}",
        description="Requests refused with 503 + Retry-After, by reason.",
    )
    meter.create_observable_counter(
        "warmroute.admission.goodput",
        [
            lambda _options: [
                Observation(n, {"warmroute.priority": klass, "outcome": outcome})
                for (klass, outcome), n in list(admission.goodput.items())
            ]
        ],
        unit="{request}",
        description="Requests of a class with a TTFT target (tenants.ttft_targets_s): met it, "
        "missed it, or refused at once as unable to meet it (deadline).",
    )
    if queue is not None:
        meter.create_observable_up_down_counter(
            "warmroute.backend_queue.waiting",
            [gauge(lambda: len(queue.waiters))],
            unit="{request}",
            description="Requests waiting for a backend below its max_inflight.",
        )
        meter.create_observable_counter(
            "warmroute.backend_queue.requests",
            [counts(lambda: queue.stats, "outcome")],
            unit="{request}",
            description="Requests that found every backend at its max_inflight: waited, "
            "routed after waiting, or refused (queue_full, queue_timeout, shed_*).",
        )
