"""The retry policy: which failures are retried, where, after how long, and how many.

The one owner of retry decisions (the forwarder asks, the upstream client only reports typed
errors, the registry only keeps health). Rules:

- Only before the first byte reached the client: once a response has started, a failure ends
  the stream with an error event instead (proxy/forwarding/relay.py).
- A pooled connection the backend had closed (the keep-alive race) is retried at once on the
  *same* backend over a fresh connection: it says nothing about the backend's health.
- Anything else moves to the next backend of the routing ranking, after an exponential
  backoff with full jitter (U(0, min(max, base * 2^n))), so a fleet that is briefly sick is
  not hit by every client at the same instant.
- An overall deadline: no new attempt starts `deadline_s` after the request arrived, counted
  from its arrival (`Exchange.t0`) for every leg, fallback and retry of it.
- A two-leg prefill/decode request (proxy/forwarding/pdflow.py) comes back to the attempt loop
  after a failed leg with a `Resume`, and the policy decides its next attempt too. A decode leg
  that failed is retried like any attempt (elsewhere in the decode pool: max_attempts, backoff,
  budget, deadline). A prefill leg that failed falls back to the decode backend its plan chose,
  at once and outside max_attempts and the budget: that engine did not fail, and it gets the
  one request it was getting anyway, so nothing is added to a failing fleet's load; but not
  past the deadline.
- A retry budget (as Envoy's and Finagle's): retries may add at most `budget_ratio` of the
  requests of the last 10 s, plus `budget_min_per_s`; beyond it a failure is answered at once.
  When every backend is failing, retries would multiply the load on the fleet exactly when
  it can least take it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from proxy.config import RetryConfig
from proxy.types import FailureKind
from proxy.upstream.conn import retry_after_s
from proxy.upstream.pool import (
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamProtocolError,
)

if TYPE_CHECKING:
    from proxy.forwarding.ports import UpstreamResponseLike

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


class Retry(Exception):
    """This attempt failed before anything reached the client.

    kind: what the failure says of the backend (proxy.types.FailureKind): connect, reused,
    timeout, status, protocol, gone, cancelled, ... retry_after_s: a 429's Retry-After, in
    seconds (0: none given).
    """

    def __init__(
        self,
        reason: str,
        error_type: str,
        kind: FailureKind,
        status: int | None = None,
        retry_after_s: float = 0.0,
    ):
        super().__init__(reason)
        self.reason = reason
        self.error_type = error_type
        self.kind = kind
        self.status = status
        self.retry_after_s = retry_after_s


async def status_retry(upstream: UpstreamResponseLike) -> Retry:
    """A backend answered a retryable status (RETRYABLE_STATUS): the Retry, with its error's
    message (read briefly) and a 429's Retry-After; the response is released."""
    wait = 0.0
    if upstream.status == 429:
        for k, v in upstream.headers:
            if k == b"retry-after":
                wait = retry_after_s(v.decode("latin-1"))
                break
    try:
        detail = await _error_detail(upstream)
    finally:
        upstream.release()
    status = upstream.status
    return Retry(f"HTTP {status}{detail}", f"http_{status}", FailureKind.STATUS, status, wait)


async def _error_detail(upstream: UpstreamResponseLike) -> str:
    """' (the error's message)', or the body's start, or '' (a second at most)."""
    try:
        body = await asyncio.wait_for(upstream.read(2048), 1.0)
        message = orjson_error_message(body)
    except Exception:
        return ""
    if message:
        return f" ({message})"
    return f" ({body[:200].decode('utf-8', 'replace')})" if body else ""


def orjson_error_message(body: bytes) -> str | None:
    """The message of an OpenAI-style error body, if that is what `body` is."""
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        msg = data["error"].get("message")
        return msg if isinstance(msg, str) else None
    return None


def classify(e: BaseException) -> Retry:
    """The typed upstream failure of a request that was not answered, as a Retry."""
    text = describe(e)
    if isinstance(e, UpstreamConnectTimeout):
        return Retry(text, "connect_timeout", FailureKind.CONNECT_TIMEOUT)
    if isinstance(e, UpstreamConnectError):
        return Retry(text, "connect_error", FailureKind.CONNECT)
    if isinstance(e, UpstreamDisconnected):
        if e.reused:
            return Retry(text, "connection_reset", FailureKind.REUSED)
        return Retry(text, "connection_reset", FailureKind.PROTOCOL)
    if isinstance(e, UpstreamProtocolError):
        why = f"invalid response from the backend: {text}"
        return Retry(why, "protocol_error", FailureKind.PROTOCOL)
    if isinstance(e, TimeoutError):
        why = "no response headers within the first-byte timeout"
        return Retry(why, "timeout", FailureKind.TIMEOUT)
    if isinstance(e, UpstreamError):
        return Retry(text, "upstream_error", FailureKind.PROTOCOL)
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


@dataclass(frozen=True, slots=True)
class Resume:
    """A request back in the attempt loop after one of its legs failed
    (proxy/forwarding/pdflow.py)."""

    why: str  # that failure in a sentence, for the log and the client's error
    fallback: bool = False  # the flow's fallback to its decode backend, not a retry elsewhere


class RetryPolicy:
    """Decides, after each failed attempt, whether and where the request goes next."""

    def __init__(self, cfg: RetryConfig, rng: Callable[[], float] = random.random) -> None:
        self.cfg = cfg
        self.rng = rng
        self.budget = RetryBudget(cfg.budget_ratio, cfg.budget_min_per_s)
        self.exhausted = 0  # failures answered at once because the budget was spent

    def candidates(self, ranking: list[str]) -> list[str]:
        return ranking[: self.cfg.max_attempts]

    def deadline(self, arrival: float) -> float:
        """When the last new attempt may start: `deadline_s` after the request's arrival
        (Exchange.t0, on time.perf_counter's clock), whichever leg or retry it is."""
        return arrival + self.cfg.deadline_s

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
        stop = self._stop(tried, now, deadline)
        if stop:
            return None, stop
        if failure.kind == FailureKind.REUSED and tried.count(failed) == 1:
            # The keep-alive race: the same backend, a new connection, no wait, no budget.
            return NextAttempt(failed, 0.0, fresh=True), ""
        return self._elsewhere(ranking, tried, now, deadline)

    def resume(
        self,
        resume: Resume,
        first: str,
        ranking: list[str],
        tried: list[str],
        now: float,
        deadline: float,
    ) -> tuple[NextAttempt | None, str]:
        """Where a request coming back after a failed leg goes, or None and why not: its
        fallback to `first` (its decode backend) before the deadline, or a retry elsewhere in
        `ranking` as after any failure."""
        if now >= deadline:
            return None, self._late()
        if resume.fallback:
            return NextAttempt(first, 0.0, fresh=False), ""
        stop = self._stop(tried, now, deadline)
        if stop:
            return None, stop
        return self._elsewhere(ranking, tried, now, deadline)

    def _stop(self, tried: list[str], now: float, deadline: float) -> str:
        if len(tried) >= self.cfg.max_attempts:
            return f"{self.cfg.max_attempts} attempts made (retries.max_attempts)"
        if now >= deadline:
            return self._late()
        return ""

    def _late(self) -> str:
        return f"the retry deadline of {self.cfg.deadline_s:g}s passed"

    def _elsewhere(
        self, ranking: list[str], tried: list[str], now: float, deadline: float
    ) -> tuple[NextAttempt | None, str]:
        """The first backend of `ranking` not tried yet, after a backoff, from the budget."""
        remaining = [b for b in ranking if b not in tried]
        if not remaining:
            return None, "no other backend to try"
        if not self.budget.try_spend():
            self.exhausted += 1
            return None, "the retry budget is spent (the fleet is failing; not adding load)"
        retry_no = len(tried)
        delay = min(self.backoff_s(retry_no), max(0.0, deadline - now))
        return NextAttempt(remaining[0], delay, fresh=False), ""
