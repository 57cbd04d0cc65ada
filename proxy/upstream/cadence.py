"""When a backend's background work is due: its health checks and load scrapes, in
proportion to need (pure; the registry's poll loop in proxy/upstream/backends.py runs them)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol

from proxy.config import HealthConfig
from proxy.routing.types import EngineLoad


class Backend(Protocol):
    """What the cadence reads of a backend (proxy.upstream.backends.Backend)."""

    @property
    def attached(self) -> int: ...  # requests routed to it, ever

    @property
    def streams(self) -> Collection[Any]: ...  # its requests open now

    @property
    def load(self) -> EngineLoad: ...  # its last scrape


__all__ = ["check_interval", "has_work", "scrape_due"]


def has_work(b: Backend, seen: int) -> bool:
    """Whether `b` has traffic: a request routed to it since the last scrape (`seen`: its
    `attached` count then), one on it now, or requests on it at the last scrape (an engine
    busy with other replicas' traffic says so)."""
    if b.attached != seen or b.streams:
        return True
    return bool(b.load.waiting) or bool(b.load.running)


def scrape_due(b: Backend, seen: int, checked: bool) -> bool:
    """Whether a poll round scrapes `b`'s load: always with its health check, and between
    health checks only while it has work (has_work). An idle engine costs one health check
    and one scrape per idle interval, so the background cost of a fleet grows with its busy
    engines, not with every engine (deploy/perf/idle_cpu.py)."""
    return checked or has_work(b, seen)


def check_interval(
    h: HealthConfig, *, healthy: bool, busy: bool, ejected: bool, idle_backends: int
) -> float:
    """Seconds from a backend's last health check to its next: proportional to need.

    Unhealthy: as often as the scrape interval allows (to see it come back; it gets no
    request until then). With traffic (has_work) or an open breaker: `interval_s`. Idle and
    healthy: `idle_interval_s` (never more often than `interval_s`), stretched to
    `idle_backends / idle_checks_per_s` so the idle checks of a whole fleet cost at most that
    many a second however many engines idle (Envoy's no_traffic_interval, with a fleet-wide
    cap). A request routed to an idle backend wakes its poll task: it is busy from then on.
    """
    if not healthy:
        return min(h.interval_s, h.metrics_scrape_s)
    if busy or ejected:
        return h.interval_s
    return max(h.interval_s, h.idle_interval_s, idle_backends / h.idle_checks_per_s)
