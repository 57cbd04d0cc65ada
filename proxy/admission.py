"""Admission: a bound on the requests the proxy works on at once, with a short queue.

Past `limit` requests in flight, a new one waits in a FIFO queue of at most `queue` requests
for at most `wait_s`; one that finds the queue full, or waits too long, is refused at once
(503 with Retry-After, in OpenAI's error shape) rather than left hanging or piled onto the
backends. A finished request hands its slot straight to the oldest waiter.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"


@dataclass
class AdmissionStats:
    admitted: int = 0
    queued: int = 0  # admitted after waiting
    rejected: dict[str, int] = field(default_factory=lambda: {QUEUE_FULL: 0, QUEUE_TIMEOUT: 0})


class Admission:
    """The global in-flight bound (one per process; the event loop's thread only)."""

    def __init__(self, limit: int, queue: int, wait_s: float) -> None:
        if limit < 1 or queue < 0 or wait_s < 0:
            raise ValueError("admission needs limit >= 1, queue >= 0 and wait_s >= 0")
        self.limit = limit
        self.queue = queue
        self.wait_s = wait_s
        self.inflight = 0
        self.stats = AdmissionStats()
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def retry_after_s(self) -> int:
        """What a refused client is told to wait (whole seconds, at least 1)."""
        return max(1, math.ceil(self.wait_s))

    def admit_now(self) -> bool:
        """Take a slot if one is free and nobody waits for one (else enter() queues)."""
        if self.inflight < self.limit and not self._waiters:
            self.inflight += 1
            self.stats.admitted += 1
            return True
        return False

    async def enter(self) -> str | None:
        """Take a slot: None once admitted, else why not (QUEUE_FULL, QUEUE_TIMEOUT)."""
        if self.admit_now():
            return None
        if len(self._waiters) >= self.queue:
            self.stats.rejected[QUEUE_FULL] += 1
            return QUEUE_FULL
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.wait_s):
                await waiter
        except TimeoutError:
            if not (waiter.done() and not waiter.cancelled()):
                self._forget(waiter)
                self.stats.rejected[QUEUE_TIMEOUT] += 1
                return QUEUE_TIMEOUT
            # a slot was handed over as the time ran out: take it
        except BaseException:  # cancelled while waiting: a slot handed over goes on
            self._forget(waiter)
            if waiter.done() and not waiter.cancelled():
                self.leave()
            raise
        # leave() handed its slot over: inflight was not decremented for us
        self.stats.admitted += 1
        self.stats.queued += 1
        return None

    def leave(self) -> None:
        """Give the slot back, to the oldest waiter if one is still waiting."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.inflight -= 1

    def _forget(self, waiter: asyncio.Future[None]) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:  # leave() popped it already
            pass
