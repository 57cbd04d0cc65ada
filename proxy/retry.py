"""The retry policy: which failures are retried, where, after how long, and how many.

The one owner of retry decisions (the forwarder asks, the upstream client only reports typed
errors, the registry only keeps health). Rules:

- Only before the first byte reached the client: once a response has started, a failure ends
  the stream with an error event instead (proxy/relay.py).
- A pooled connection the backend had closed (the keep-alive race) is retried at once on the
  *same* backend over a fresh connection: it says nothing about the backend's health.
- Anything else moves to the next backend of the routing ranking, after an exponential
  backoff with full jitter (U(0, min(max, base * 2^n))), so a fleet that is briefly sick is
  not hit by every client at the same instant.
- An overall deadline: no new attempt starts `deadline_s` after the request arrived.
- A retry budget (as Envoy's and Finagle's): retries may add at most `budget_ratio` of the
  requests of the last 10 s, plus `budget_min_per_s`; beyond it a failure is answered at once.
  When every backend is failing, retries would multiply the load on the fleet exactly when
  it can least take it.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from proxy.config import RetryConfig
from proxy.upstream import (
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamProtocolError,
)

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
# Failure kinds (Retry.kind) that count against a backend's passive health.
EJECTING_KINDS = frozenset({"connect", "connect_timeout", "timeout", "status", "protocol"})


class Retry(Exception):
    """This attempt failed before anything reached the client.

    kind: connect (refused/unreachable), connect_timeout, reused (a pooled connection the
    backend had closed), timeout (no response head or first byte in time), status (a
    retryable HTTP status), protocol (not valid HTTP), stream (the body broke off or was
    empty before its first byte).
    """

    def __init__(self, reason: str, error_type: str, kind: str, status: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.error_type = error_type
        self.kind = kind
        self.status = status


def classify(e: BaseException) -> Retry:
    """The typed upstream failure of a request that was not answered, as a Retry."""
    text = describe(e)
    if isinstance(e, UpstreamConnectTimeout):
        return Retry(text, "connect_timeout", "connect_timeout")
    if isinstance(e, UpstreamConnectError):
        return Retry(text, "connect_error", "connect")
    if isinstance(e, UpstreamDisconnected):
        if e.reused:
            return Retry(text, "connection_reset", "reused")
        return Retry(text, "connection_reset", "protocol")
    if isinstance(e, UpstreamProtocolError):
        return Retry(f"invalid response from the backend: {text}", "protocol_error", "protocol")
    if isinstance(e, TimeoutError):
        return Retry("no response headers within the first-byte timeout", "timeout", "timeout")
    if isinstance(e, UpstreamError):
        return Retry(text, "upstream_error", "protocol")
    raise TypeError(f"not an upstream failure: {e!r}")


def describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) < 300 else text[:300] + "..."


class RetryBudget:
    """Retries allowed: ratio x requests seen in the last `window_s`, plus a floor rate."""

    __slots__ = ("_clock", "_requests", "_retries", "min_per_s", "ratio", "window_s")

    def __init__(
        self,
        ratio: float,
        min_per_s: float,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ratio = ratio
        self.min_per_s = min_per_s
        self.window_s = window_s
        self._clock = clock
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def _trim(self, now: float) -> None:
        edge = now - self.window_s
        for q in (self._requests, self._retries):
            while q and q[0] < edge:
                q.popleft()

    def request(self) -> None:
        """A request arrived (called once per request, retries or not)."""
        now = self._clock()
        self._requests.append(now)
        if len(self._requests) > 4096:  # bounded even at very high rates
            self._trim(now)

    def try_spend(self) -> bool:
        """Take one retry from the budget; False when it is spent."""
        now = self._clock()
        self._trim(now)
        allowed = self.ratio * len(self._requests) + self.min_per_s * self.window_s
        if len(self._retries) + 1 > allowed:
            return False
        self._retries.append(now)
        return True

    def info(self) -> dict[str, float]:
        self._trim(self._clock())
        return {
            "requests": len(self._requests),
            "retries": len(self._retries),
            "ratio": self.ratio,
            "min_per_s": self.min_per_s,
        }


@dataclass
class NextAttempt:
    backend: str
    delay_s: float
    fresh: bool  # open a new connection (the pooled one was closed under us)


class RetryPolicy:
    """Decides, after each failed attempt, whether and where the request goes next."""

    def __init__(self, cfg: RetryConfig, rng: Callable[[], float] = random.random) -> None:
        self.cfg = cfg
        self.rng = rng
        self.budget = RetryBudget(cfg.budget_ratio, cfg.budget_min_per_s)
        self.exhausted = 0  # failures answered at once because the budget was spent

    def candidates(self, ranking: list[str]) -> list[str]:
        return ranking[: self.cfg.max_attempts]

    def deadline(self, start: float) -> float:
        return start + self.cfg.deadline_s

    def backoff_s(self, retry_no: int) -> float:
        """Full jitter: uniform in [0, min(max, base * 2^(n-1))] for the n-th retry."""
        cap = min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * (2 ** (retry_no - 1)))
        return cap * self.rng()

    def next(
        self,
        failure: Retry,
        failed: str,
        ranking: list[str],
        tried: list[str],
        now: float,
        deadline: float,
    ) -> tuple[NextAttempt | None, str]:
        """Where to try next after `failed` failed, or None and why not."""
        if len(tried) >= self.cfg.max_attempts:
            return None, f"{self.cfg.max_attempts} attempts made (retries.max_attempts)"
        if now >= deadline:
            return None, f"the retry deadline of {self.cfg.deadline_s:g}s passed"
        if failure.kind == "reused" and tried.count(failed) == 1:
            # The keep-alive race: the same backend, a new connection, no wait, no budget.
            return NextAttempt(failed, 0.0, fresh=True), ""
        remaining = [b for b in ranking if b not in tried]
        if not remaining:
            return None, "no other backend to try"
        if not self.budget.try_spend():
            self.exhausted += 1
            return None, "the retry budget is spent (the fleet is failing; not adding load)"
        retry_no = len(tried)
        delay = min(self.backoff_s(retry_no), max(0.0, deadline - now))
        return NextAttempt(remaining[0], delay, fresh=False), ""
