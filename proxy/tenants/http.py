"""GET /admin/tenants (served only where /admin is: proxy/edge/access.py), and the tenants'
metrics: what each tenant was admitted, refused and charged here, and its budgets left."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

if TYPE_CHECKING:
    from proxy.admission.backend_queue import BackendQueue
    from proxy.admission.slots import Admission
    from proxy.telemetry import Telemetry
    from proxy.tenants.budgets import Budgets


def routes(
    budgets: Budgets | None,
    admission: Admission,
    tenants: tuple[str, ...],
    backend_queue: BackendQueue | None = None,
) -> list[Route]:
    async def view(request: Request) -> Response:
        found = await describe(budgets, admission, tenants, backend_queue)
        return Response(orjson.dumps(found), media_type="application/json")

    return [Route("/admin/tenants", view, methods=["GET"])]


async def describe(
    budgets: Budgets | None,
    admission: Admission,
    tenants: tuple[str, ...],
    backend_queue: BackendQueue | None = None,
) -> dict[str, Any]:
    """Each tenant's limits with what is left of them now (across replicas when Redis holds
    them), what this replica admitted, refused and charged, and its place in the admission
    queue (waiting, running, how far ahead of the others it has asked: who goes last), and
    its requests waiting for a backend at its bound."""
    out: dict[str, Any] = {**(budgets.view() if budgets else {"budgets": "none"}), "tenants": {}}
    shares = admission.shares()
    if admission.reserve_prefills:
        out["prefills"] = {
            "engines_kept": admission.reserve_prefills,
            "over_share_prefilling": admission.prefilling_over,
        }
    for_backend = Counter(w.tenant for w in backend_queue.waiters) if backend_queue else {}
    for tenant in tenants:
        queue = shares.get(tenant, {"waiting": 0, "running": 0, "ahead_tokens_per_weight": 0.0})
        entry: dict[str, Any] = {"queue": {**queue, "backend_waiting": for_backend.get(tenant, 0)}}
        if budgets is not None:
            entry.update(await _budgets_of(budgets, tenant))
        out["tenants"][tenant] = entry
    return out


async def _budgets_of(budgets: Budgets, tenant: str) -> dict[str, Any]:
    _, cap = budgets.limits_for(tenant, "")
    models = budgets.config.keys.get(tenant, budgets.config.default).models
    found = []
    for model in ["", *models]:
        outcome = await budgets.peek(tenant, model)
        for r in outcome.readings if outcome is not None else ():
            if r.limit.model == model:
                found.append(
                    {
                        "limit": r.limit.kind + "_per_minute",
                        "model": model or None,
                        "per_minute": r.limit.per_minute,
                        "remaining": r.remaining,
                        "full_in_s": round(r.reset_s, 3),
                    }
                )
    stats = budgets.stats.get(tenant)
    return {
        "limits": found,
        "max_concurrent": cap,
        "inflight_here": stats.inflight if stats else 0,
        "admitted_here": stats.admitted if stats else 0,
        "refused_here": dict(stats.refused) if stats else {},
        "input_tokens_here": stats.input_tokens if stats else 0,
        "output_tokens_here": stats.output_tokens if stats else 0,
    }


def observe(budgets: Budgets, telemetry: Telemetry) -> None:
    """The tenants' counts as metrics (tenants are configured: bounded labels)."""
    from opentelemetry.metrics import Observation

    meter = telemetry.meter_provider.get_meter("warmroute")

    def requests(_options: Any) -> list[Observation]:
        out = []
        for tenant, s in list(budgets.stats.items()):
            out.append(Observation(s.admitted, {"warmroute.client": tenant, "outcome": "ok"}))
            for kind, n in s.refused.items():
                attrs = {"warmroute.client": tenant, "outcome": f"refused_{kind}"}
                out.append(Observation(n, attrs))
        return out

    def tokens(_options: Any) -> list[Observation]:
        out = []
        for tenant, s in list(budgets.stats.items()):
            for direction, n in (("input", s.input_tokens), ("output", s.output_tokens)):
                attrs = {"warmroute.client": tenant, "direction": direction}
                out.append(Observation(n, attrs))
        return out

    meter.create_observable_counter(
        "warmroute.tenant.requests",
        [requests],
        unit="{request}",
        description="Requests per tenant: admitted, or refused by a budget (429), by kind.",
    )
    meter.create_observable_counter(
        "warmroute.tenant.tokens",
        [tokens],
        unit="{token}",
        description="Tokens charged to each tenant's budgets by this replica, in and out.",
    )
    meter.create_observable_up_down_counter(
        "warmroute.tenant.budgets_shared",
        [lambda _o: [Observation(1 if budgets.shared else 0)]],
        description="1 while the budgets are held in Redis for every replica; 0 while this "
        "replica enforces its share alone (Redis away, or not configured).",
    )
