"""The small endpoints: models, health, readiness, metrics and admin views."""

from __future__ import annotations

import platform
import time
from typing import TYPE_CHECKING

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy import __version__, hot_path
from proxy.asgi import BodyTooLarge, read_body
from proxy.edge.access import AdminAccess, bearer
from proxy.errors import RequestError, error_body
from proxy.forwarding.intake import too_large
from proxy.forwarding.validate import PROMPT_FIELD, validate
from proxy.redact import redact_text, redact_url
from proxy.routing.types import PromptUnreadable, RouteContext

if TYPE_CHECKING:
    from proxy.forwarding.state import AppState


def _json(data: object, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status, media_type="application/json")


def routes(state: AppState) -> list[Route]:
    return Handlers(state).routes()


class Handlers:
    """The small endpoints beside the API paths: model list, health, readiness, metrics and
    the admin views (operators only: proxy/edge/access.py decides who sees what)."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        server = state.config.server
        self.admin = AdminAccess.from_settings(
            server.port, server.admin_port, server.admin_token_sha256
        )

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/admin/backends", self.backends, methods=["GET"]),
            Route("/admin/route/explain", self.explain, methods=["POST"]),
            Route("/admin/routing", self.routing_info, methods=["GET"]),
            Route("/admin/disagg", self.disagg, methods=["GET"]),
            Route("/admin/build", self.build, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]

    async def models(self, request: Request) -> Response:
        return _json({"object": "list", "data": self.state.registry.model_list()})

    async def health(self, request: Request) -> Response:
        return _json({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        # Each backend's health, named only to a caller /admin/* would answer here (the admin
        # listener, or the serving port when it serves /admin): a backend's name is its
        # host:port unless configured, and the serving port shows no addresses.
        ok = self.state.registry.any_ready()
        now = time.monotonic()
        scope = request.scope
        on_admin = self.admin.on_admin_listener(scope.get("server"))
        named = self.admin.refusal(on_admin, bearer(scope["headers"])) is None
        up: list[dict[str, object]] = []
        for b in self.state.registry.backends.values():
            entry: dict[str, object] = {"name": b.name} if named else {}
            entry["up"] = b.is_up(now)
            entry["circuit"] = b.breaker.info(now)["state"] if b.breaker else None
            up.append(entry)
        return _json({"ready": ok, "backends": up}, 200 if ok else 503)

    def _backends(self) -> list[dict[str, object]]:
        now = time.monotonic()
        return [
            {
                "name": b.name,
                "url": redact_url(b.url),
                # who listed it (config, admin, dns:NAME, kubernetes:NS/SVC) and its place in
                # the fleet's lifecycle: joining, serving, draining, drained
                "source": b.source,
                "state": b.state,
                "state_for_s": round(now - b.since, 1),
                "requests_here": len(b.streams),  # on this replica, now
                "engine": b.cfg.engine,
                "role": b.cfg.role,
                "weight": b.cfg.weight,
                "healthy": b.healthy,
                "up": b.is_up(time.monotonic()),
                "inflight": self.state.routing.board.get(b.name),  # all replicas' open requests
                "models": sorted(b.models) if b.models is not None else None,
                "adapters": dict(sorted(b.adapters.items())),  # LoRA adapter -> its base model
                "last_error": redact_text(b.last_error) if b.last_error else None,
                # passive health: outlier ejection (closed / open / half_open)
                "circuit": b.breaker.info(time.monotonic()) if b.breaker else None,
                "load": {
                    "waiting": b.load.waiting,
                    "running": b.load.running,
                    "kv_usage": b.load.kv_usage,
                },
            }
            for b in self.state.registry.backends.values()
        ]

    async def metrics(self, request: Request) -> Response:
        body, content_type = self.state.telemetry.prometheus_text()
        return Response(body, 200, headers={"content-type": content_type})

    async def explain(self, request: Request) -> Response:
        """Dry-run routing for a request body: candidates, matches, scores, the winner."""
        api = request.query_params.get("api", "chat")
        if api not in PROMPT_FIELD:
            return _json(
                {
                    "error": {
                        "message": f"api must be one of {sorted(PROMPT_FIELD)}",
                        "type": "invalid_request_error",
                        "param": "api",
                        "code": "invalid_value",
                    }
                },
                400,
            )
        try:  # within server.max_body_bytes, as the API paths read theirs
            limit = self.state.config.server.max_body_bytes
            raw = await read_body(request.receive, limit, request.headers.get("content-length"))
            body = orjson.loads(raw)
            validate(api, body)
        except BodyTooLarge as e:
            return Response(too_large(e.size, e.limit).body(), 413, media_type="application/json")
        except orjson.JSONDecodeError as e:
            return Response(
                error_body(f"invalid JSON: {e}", code="invalid_json"),
                400,
                media_type="application/json",
            )
        except RequestError as e:
            return Response(e.body(), e.status, media_type="application/json")
        ctx = RouteContext(
            request_id="explain",
            model=body["model"],
            api=api,
            body=body,
            headers={k.lower(): v for k, v in request.headers.items()},
            now=time.monotonic(),
            session_key=request.headers.get("x-session-id") or body.get("user"),
        )
        try:
            decision = await self.state.router.route(ctx, self.state.views(), record=False)
        except PromptUnreadable as e:
            return Response(
                error_body(f"The request could not be read: {e}.", code="invalid_request"),
                400,
                media_type="application/json",
            )
        out = decision.as_dict()
        out["candidates"] = [
            {
                "name": v.name,
                "healthy": v.healthy,
                "inflight": v.inflight,
                "waiting": v.load.waiting,
                "kv_usage": v.load.kv_usage,
                "prefill_tokens_per_s": v.prefill_tokens_per_s,
            }
            for v in self.state.views()
        ]
        return _json(out)

    async def routing_info(self, request: Request) -> Response:
        info = self.state.routing.info()
        forwarding = self.state.forwarding
        if forwarding is not None:  # slot engines' waits (routing/slot_turns.py)
            info["slot_turns"] = forwarding.steering.turns.info()
        return _json(info)

    async def build(self, request: Request) -> Response:
        """What runs: the version, the interpreter, and whether the per-chunk hot path is
        the compiled one (proxy.HOT_PATH; setup.py) or pure Python, and why."""
        return _json(
            {
                "version": __version__,
                "python": platform.python_version(),
                "hot_path": hot_path(),
            }
        )

    async def disagg(self, request: Request) -> Response:
        """The prefill/decode decider: mode, active, pools, its window's inputs, why."""
        pd = self.state.forwarding.pd if self.state.forwarding is not None else None
        if pd is None:
            from proxy.disagg.controller import state_when_off  # loaded only if asked, as when on

            return _json(state_when_off(self.state.config.disagg, time.perf_counter()))
        return _json(pd.state())

    async def backends(self, request: Request) -> Response:
        now = time.monotonic()
        gone = [
            {
                "name": b.name,
                "url": redact_url(b.url),
                "source": b.source,
                "state": "gone",
                "gone_for_s": round(now - b.since, 1),
            }
            for b in reversed(self.state.registry.gone)
        ]
        fleet = self.state.fleet.info() if self.state.fleet is not None else None
        return _json(
            {
                "backends": self._backends(),
                "gone": gone,  # the last departures, newest first
                "fleet": fleet,
                "policy": self.state.router.policy.name,
            }
        )
