"""Passive health per backend: outlier ejection with a circuit breaker (pure, time injected).

closed     requests flow; consecutive failures (5xx, timeouts, resets, invalid responses) are
           counted and any success clears the count. At `consecutive_failures` the backend
           is ejected. A refused or unreachable connection ejects at once: the next request
           would fail the same way.
open       no requests until the ejection ends; the n-th ejection in a row lasts
           ejection_s * 2^(n-1) (at most max_ejection_s), so a backend that keeps failing is
           tried less and less often.
half_open  one probe request may go; its success closes the breaker (and forgets the
           ejections), its failure opens it again for longer. A probe that ends without a
           verdict (a 429, a keep-alive race, the client leaving before the answer) lets the
           next probe go; one that reports nothing at all (cancelled on a path that does not
           say so) is presumed lost once it has kept requests off for as long as the ejection
           before it. Either way the breaker never stays half-open with nobody probing.

An active health check that succeeds moves an open breaker to half-open only when the
ejection came from refused connections (the engine is back); a backend that answers its health
endpoint but fails requests stays ejected until a probe request succeeds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.config import OutlierConfig
from proxy.types import FailureKind

log = logging.getLogger("warmroute.outlier")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
# A refused connection ejects at once; these count towards consecutive_failures; any other
# kind (overloaded, reused, too_large, gone, cancelled) says nothing about the backend.
IMMEDIATE_KINDS = frozenset({FailureKind.CONNECT})
COUNTED_KINDS = frozenset(
    {
        FailureKind.CONNECT,
        FailureKind.CONNECT_TIMEOUT,
        FailureKind.TIMEOUT,
        FailureKind.STATUS,
        FailureKind.PROTOCOL,
    }
)


@dataclass
class Breaker:
    cfg: OutlierConfig
    first_ejection_s: float | None = None  # a refused connection's ejection (retries cooldown)
    state: str = CLOSED
    consecutive: int = 0
    ejections: int = 0
    open_until: float = 0.0
    probe_out: bool = False
    held_since: float | None = None  # the first request kept off by the probe in flight
    ejected_s: float = 0.0  # the length of the last ejection: how long a probe may stay out
    lost_probes: int = 0
    last_kind: FailureKind | None = None
    name: str = ""  # the backend's, for the log
    # Told when it ejects the backend (the registry marks the backend's view changed; the
    # ViewCache reads a breaker that is not closed at every read, as time may reopen it).
    watch: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def allows(self, now: float) -> bool:
        """May a request be routed here now?"""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            if now < self.open_until:
                return False
            self._half_open()
        if not self.probe_out:
            return True
        if self.held_since is None:
            self.held_since = now
            return False
        if now - self.held_since < self.ejected_s:
            return False
        # The probe's request ended somewhere that reported neither a verdict nor its end:
        # waiting on it would keep a backend that may be fine out of rotation forever.
        self.lost_probes += 1
        log.warning(
            "backend %s: a half-open probe gave no verdict within %.1fs (the ejection before "
            "it); letting another probe go",
            self.name,
            self.ejected_s,
        )
        self._half_open()
        return True

    def on_attempt(self) -> None:
        """A request was sent: in half-open it is the probe, and no other may follow yet."""
        if self.state == HALF_OPEN:
            self.probe_out = True
            self.held_since = None

    def failure(self, kind: FailureKind, now: float) -> bool:
        """Count a failed attempt; True when this one ejected the backend.

        A kind that says nothing about the backend (overloaded, reused, cancelled) is no
        verdict: in half-open the probe is released, so the next request probes instead.
        """
        if kind not in COUNTED_KINDS:
            if self.probe_out:
                self._half_open()
            return False
        self.last_kind = kind
        self.consecutive += 1
        if self.state == HALF_OPEN or (
            self.state == CLOSED
            and (kind in IMMEDIATE_KINDS or self.consecutive >= self.cfg.consecutive_failures)
        ):
            self._eject(now, kind)
            return True
        return False

    def success(self) -> None:
        self.consecutive = 0
        if self.state != CLOSED:
            self.state = CLOSED
            self.ejections = 0
            self.probe_out = False
            self.held_since = None

    def health_ok(self, now: float) -> None:
        """The active health check passed: a refused-connection ejection may end early."""
        if self.state == OPEN and self.last_kind in IMMEDIATE_KINDS:
            self._half_open()

    def _half_open(self) -> None:
        self.state = HALF_OPEN
        self.probe_out = False
        self.held_since = None

    def _eject(self, now: float, kind: FailureKind) -> None:
        self.ejections += 1
        base = self.cfg.ejection_s
        if kind in IMMEDIATE_KINDS and self.first_ejection_s is not None:
            base = self.first_ejection_s
        self.ejected_s = min(self.cfg.max_ejection_s, base * 2 ** (self.ejections - 1))
        self.open_until = now + self.ejected_s
        self.state = OPEN
        self.probe_out = False
        self.held_since = None
        if self.watch is not None:
            self.watch()

    def info(self, now: float) -> dict[str, object]:
        return {
            "state": self.state
            if not (self.state == OPEN and now >= self.open_until)
            else HALF_OPEN,
            "consecutive_failures": self.consecutive,
            "ejections": self.ejections,
            "ejected_for_s": round(max(0.0, self.open_until - now), 3)
            if self.state == OPEN
            else 0.0,
            "probe_out": self.probe_out,
            "lost_probes": self.lost_probes,
            "last_failure_kind": self.last_kind,
        }
