"""The admin API's fleet verbs (served only where /admin is: proxy/edge/access.py).

    POST   /admin/backends               {"url": ..., "engine": ..., ...}: add (joining)
    POST   /admin/backends/{name}/drain  no new requests until resumed; streams finish
    POST   /admin/backends/{name}/resume serving again
    DELETE /admin/backends/{name}        drain, then remove (backends the admin added)

A change applies to the replica it is sent to; replicas that must agree follow one source
(the config file, DNS, Kubernetes) instead.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import orjson
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.config import BackendConfig, ConfigError, describe_errors
from proxy.errors import error_body
from proxy.fleet.reconciler import AdminError

if TYPE_CHECKING:
    from proxy.fleet.reconciler import Reconciler

log = logging.getLogger("warmroute.fleet")
MAX_BODY = 64 * 1024  # one backend's keys


def _error(status: int, message: str, code: str, param: str | None = None) -> Response:
    return Response(
        error_body(message, code=code, param=param), status, media_type="application/json"
    )


def _ok(data: object, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status, media_type="application/json")


def routes(fleet: Reconciler) -> list[Route]:
    async def add(request: Request) -> Response:
        raw = await request.body()
        if len(raw) > MAX_BODY:
            return _error(413, f"A backend's keys fit in {MAX_BODY} bytes.", "request_too_large")
        try:
            data = orjson.loads(raw)
            if not isinstance(data, dict):
                raise ConfigError('the body must be a JSON object such as {"url": "http://..."}')
            cfg = BackendConfig.model_validate(data)
        except orjson.JSONDecodeError as e:
            return _error(400, f"invalid JSON: {e}", "invalid_json")
        except ConfigError as e:
            return _error(400, str(e), "invalid_backend")
        except (ValidationError, ValueError) as e:
            text = describe_errors(e) if isinstance(e, ValidationError) else str(e)
            return _error(400, f"invalid backend: {text}", "invalid_backend")
        try:
            change = fleet.admin_add(cfg)
        except AdminError as e:
            return _error(e.status, e.message, "conflict")
        log.info("admin: backend %s added (%s)", cfg.key, change.kind if change else "unchanged")
        b = fleet.registry.get(cfg.key)
        state = b.state if b is not None else "joining"
        return _ok({"name": cfg.key, "state": state, "source": "admin"}, 201)

    def verb(action: str) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            name = request.path_params["name"]
            try:
                if action == "drain":
                    fleet.admin_drain(name)
                elif action == "resume":
                    fleet.admin_resume(name)
                else:
                    fleet.admin_remove(name)
            except AdminError as e:
                code = "backend_not_found" if e.status == 404 else "conflict"
                return _error(e.status, e.message, code)
            log.info("admin: backend %s %s", name, {"remove": "removed"}.get(action, action + "ed"))
            b = fleet.registry.get(name)
            return _ok({"name": name, "state": b.state if b is not None else "gone"}, 202)

        return endpoint

    return [
        Route("/admin/backends", add, methods=["POST"]),
        Route("/admin/backends/{name}/drain", verb("drain"), methods=["POST"]),
        Route("/admin/backends/{name}/resume", verb("resume"), methods=["POST"]),
        Route("/admin/backends/{name}", verb("remove"), methods=["DELETE"]),
    ]
