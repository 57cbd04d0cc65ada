"""The small endpoints: models, health, readiness, metrics and admin views."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

if TYPE_CHECKING:
    from proxy.app import AppState


def _json(data: object, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status, media_type="application/json")


def routes(state: AppState) -> list[Route]:
    async def models(request: Request) -> Response:
        return _json({"object": "list", "data": state.registry.model_list()})

    async def health(request: Request) -> Response:
        return _json({"status": "ok"})

    async def ready(request: Request) -> Response:
        ok = state.registry.any_ready()
        return _json({"ready": ok, "backends": _backends()}, 200 if ok else 503)

    def _backends() -> list[dict[str, object]]:
        return [
            {
                "name": b.name,
                "url": b.url,
                "engine": b.cfg.engine,
                "role": b.cfg.role,
                "healthy": b.healthy,
                "inflight": b.inflight,
                "models": sorted(b.models) if b.models is not None else None,
                "last_error": b.last_error,
                "load": {
                    "waiting": b.load.waiting,
                    "running": b.load.running,
                    "kv_usage": b.load.kv_usage,
                },
            }
            for b in state.registry.backends.values()
        ]

    async def metrics(request: Request) -> Response:
        body, content_type = state.telemetry.prometheus_text()
        return Response(body, 200, headers={"content-type": content_type})

    async def backends(request: Request) -> Response:
        return _json({"backends": _backends(), "policy": state.router.policy.name})

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/admin/backends", backends, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
