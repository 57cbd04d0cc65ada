"""The doctor in the running proxy: its collector wired to the app's hooks, GET /admin/doctor,
and the warmroute.doctor.findings gauge.

`routes(state)` is the one call the app makes: it attaches a Doctor to the telemetry's
per-request hook and metric readers and returns the endpoint's Route. `state` is typed by what
is read of it (DoctorState), not by the app's class, so the doctor imports nothing of the app.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.admission.slots import TICKET
from proxy.doctor import hardware
from proxy.doctor.collector import DEFAULT_WINDOW_S, BackendInfo, Collector, Load
from proxy.doctor.diagnose import Thresholds, diagnose
from proxy.doctor.model import COUNTERS, Report
from proxy.types import CLIENT

log = logging.getLogger("warmroute.doctor")
FINDINGS_STALE_S = 15.0  # the metric's findings are recomputed at most this often


class DoctorState(Protocol):
    """What the doctor reads of the app's state."""

    config: Any  # .listed (BackendConfig: key, engine, device, params, dtype), .routing
    registry: Any  # .backends: name -> Backend (its scraped .load)
    telemetry: Any  # Telemetry: on_finish(), read_findings()
    routing: Any  # Routing: .router.capacity.snapshot()
    # and, when present, .forwarding.pd.state(): the disaggregation decider's view


def engine_counters(load: Load) -> Mapping[str, float]:
    """The cumulative engine counters a scrape carried (EngineLoad.counters), if any."""
    counters = getattr(load, "counters", None) or {}
    return {k: v for k, v in counters.items() if k in COUNTERS}


def backend_infos(config: Any) -> list[BackendInfo]:
    # Backends that join later are added as they join (backend_info, app.AppLifecycle).
    return [backend_info(b) for b in config.listed]


def backend_info(b: Any) -> BackendInfo:
    """What the doctor knows of a backend's config (BackendConfig): engine, declared hardware."""
    hw = hardware.declared(
        getattr(b, "device", None), getattr(b, "params", None), getattr(b, "dtype", "bf16")
    )
    return BackendInfo(b.key, b.engine, hw)


class Doctor:
    """A collector and the diagnosis over it; the findings gauge reads the last report."""

    def __init__(self, collector: Collector, thresholds: Thresholds | None = None) -> None:
        self.collector = collector
        self.thresholds = thresholds or Thresholds()
        self._last: tuple[float, list[tuple[str, str, str]]] = (-FINDINGS_STALE_S, [])
        self._refreshing = threading.Lock()

    def report(self, window_s: float | None = None) -> Report:
        span = window_s if window_s is not None else self.collector.window_s
        report = diagnose(
            self.collector.windows(span),
            self.thresholds,
            window_s=span,
            generated_at=datetime.now(UTC).isoformat(timespec="seconds"),
            tenants=self.collector.tenant_requests(span),
        )
        if window_s is None or window_s == self.collector.window_s:
            found = [(f.id, f.backend, f.severity) for f in report.findings]
            self._last = (time.monotonic(), found)
        return report

    def finished(
        self, model: str, backend: str, facts: Any, error: Any, decision: Any, t0: float
    ) -> None:
        """The telemetry hook: never lets a doctor bug fail a request's bookkeeping."""
        try:
            self.collector.finished(model, backend, facts, error, decision, t0)
            ticket, tenant = TICKET.get(), CLIENT.get()  # set by the edge for keyed requests
            if ticket is not None and tenant is not None:
                tokens = 0
                if facts is not None:
                    tokens = (facts.input_tokens or 0) + (facts.output_tokens or 0)
                waited = ticket.waited_s + ticket.backend_wait_s  # for a slot, either kind
                self.collector.tenant_finished(t0, tenant, waited, tokens)
        except Exception:
            log.exception("doctor: could not record a finished request")

    def current(self) -> list[tuple[str, str, str]]:
        """(finding id, backend, severity) for the metric: the last report's findings, with a
        fresh report started in a thread when they are stale (a scrape never waits for it)."""
        at, findings = self._last
        if time.monotonic() - at > FINDINGS_STALE_S and self._refreshing.acquire(blocking=False):
            threading.Thread(target=self._refresh, name="doctor-refresh", daemon=True).start()
        return findings

    def _refresh(self) -> None:
        try:
            self.report()
        except Exception:
            log.exception("doctor: the findings metric could not be refreshed")
        finally:
            self._refreshing.release()


def install(state: DoctorState, window_s: float = DEFAULT_WINDOW_S) -> Doctor:
    """A Doctor fed by `state`'s telemetry hook and reading its registry's gauges."""
    registry = state.registry

    def load(name: str) -> Load | None:
        backend = registry.backends.get(name)
        return None if backend is None else backend.load

    def engine(name: str) -> str | None:
        backend = registry.backends.get(name)
        return None if backend is None else backend.cfg.engine

    collector = Collector(
        backend_infos(state.config),
        loads=load,
        counters=engine_counters,
        engines=engine,
        window_s=window_s,
    )
    collector.policy = state.config.routing.policy
    capacity = getattr(getattr(state.routing, "router", None), "capacity", None)
    if capacity is not None:
        collector.cache = capacity.snapshot
    pd = getattr(getattr(state, "forwarding", None), "pd", None)  # disagg.mode on or auto
    if pd is not None:
        collector.disagg = pd.state
    doctor = Doctor(collector)
    state.telemetry.on_finish(doctor.finished)
    state.telemetry.read_findings(doctor.current)
    return doctor


def _window_param(request: Request) -> float | None:
    text = request.query_params.get("window_s")
    if text is None:
        return None
    value = float(text)  # ValueError: answered as a 400 by the endpoint
    if not value > 0:
        raise ValueError(text)
    return value


def routes(state: DoctorState, doctor: Doctor | None = None) -> list[Route]:
    """GET /admin/doctor (the report's JSON; ?window_s= picks the span, default 300 s)."""
    doctor = doctor or install(state)

    async def endpoint(request: Request) -> Response:
        try:
            window_s = _window_param(request)
        except ValueError:
            body = {
                "error": {
                    "message": "window_s must be a number of seconds above 0, e.g. ?window_s=60",
                    "type": "invalid_request_error",
                    "param": "window_s",
                    "code": "invalid_value",
                }
            }
            return Response(orjson.dumps(body), 400, media_type="application/json")
        # The diagnosis walks every gap of the window: off the event loop.
        report = await asyncio.to_thread(doctor.report, window_s)
        return Response(orjson.dumps(report.as_dict()), 200, media_type="application/json")

    return [Route("/admin/doctor", endpoint, methods=["GET"])]
