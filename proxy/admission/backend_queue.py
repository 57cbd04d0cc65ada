"""Requests whose every backend is at its in-flight bound, waiting for one to free a slot.

The admission queue (proxy/admission/slots.py) bounds what the whole proxy works on; a backend's own
`max_inflight` bounds what one engine is sent. When every backend that could serve a request
is at its bound, the request waits here rather than being refused at once: at most `size`
requests wait, each at most `wait_s` (the admission queue's limits), and one that cannot wait
is refused as before (429 `backends_at_capacity`, Retry-After). A newcomer that finds the
queue full takes the place of the last waiter if it goes before it in the fair order (that
one is refused: SHED_PRIORITY, SHED_FAIR), as in the admission queue.

A slot freed on a backend goes to the waiter that the fair order puts first among those that
backend could serve: the best class, then the earliest start tag, then the first to wait. The
tags are this queue's own start-time fair queuing over tenants, in tokens (the cost the
admission gave the request's ticket, over its tenant's weight; docs/tenants.md): a request
is tagged when it first waits here, and the queue's virtual time is the start of the last
waiter that got a backend. (The admission's tags would not do: with slots free there, its
virtual time runs ahead with every request let in, and a quiet tenant's tag with it.)

The woken request routes again; if a newcomer took the slot in between, it waits again in
the place it had. The other replicas' releases are seen only when their counts are synced,
and the fleet can change under a waiter (a backend joins, a bound is raised): every waiter
routes again at least every `recheck_s` for those.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field

from proxy.admission.slots import QUEUE_FULL, QUEUE_TIMEOUT, SHED_FAIR, SHED_PRIORITY, Ticket
from proxy.routing.types import Decision, Verdict, verdict_of

log = logging.getLogger("warmroute.backend_queue")

RECHECK_S = 0.25  # a waiter routes again at least this often (peers' releases, fleet changes)


def all_at_bound(reasons: Mapping[str, str]) -> bool:
    """Whether every backend routing set aside (`Decision.filtered_out`) was at its in-flight
    bound: overload, which passes, rather than an outage."""
    return bool(reasons) and all(verdict_of(v) is Verdict.AT_BOUND for v in reasons.values())


@dataclass(slots=True, eq=False)
class Waiter:
    """One request's place in the queue, kept across its waits (created by BackendQueue)."""

    queue: BackendQueue
    key: tuple[int, float, int]  # class rank, start tag, arrival: the fair order
    tenant: str | None = None  # tagged (None: first come first served)
    size: float = 0.0  # its finish tag less its start: tokens over its tenant's weight
    names: frozenset[str] = frozenset()  # the backends it waits for
    woken: asyncio.Future[str] | None = None
    waited: bool = False  # it has had a place in the queue
    routed: bool = False  # woken, it found a backend
    waited_s: float = 0.0
    outcome: str | None = field(default=None)  # the last wait's refusal, if any

    async def wait(self, names: Collection[str], deadline: float) -> bool:
        """Wait for one of `names` to free a slot, or for the recheck: True to route again,
        False when it may not wait (the queue is full, or `deadline`, loop time, passed)."""
        return await self.queue._wait(self, names, deadline)


class BackendQueue:
    """The requests waiting for a backend below its bound (the event loop's thread only)."""

    def __init__(self, size: int, wait_s: float, recheck_s: float = RECHECK_S) -> None:
        self.size = size
        self.wait_s = wait_s
        self.recheck_s = recheck_s
        self.waiters: list[Waiter] = []  # in the fair order
        self._arrivals = itertools.count()
        self.virtual = 0.0  # the start tag of the last waiter that got a backend
        self.finish: dict[str, float] = {}  # each tenant's last finish tag here
        self.stats = {
            "waited": 0,
            "routed": 0,
            QUEUE_FULL: 0,
            QUEUE_TIMEOUT: 0,
            SHED_PRIORITY: 0,
            SHED_FAIR: 0,
        }

    def waiter(self, ticket: Ticket | None) -> Waiter:
        """A place for the request of `ticket`, tagged (None: no tenants, first come first
        served)."""
        if ticket is None:
            return Waiter(self, (1, 0.0, next(self._arrivals)))
        last = self.finish.get(ticket.tenant, 0.0)
        start = last if last > self.virtual else self.virtual
        size = max(ticket.cost, 1.0) / ticket.weight
        self.finish[ticket.tenant] = start + size
        key = (ticket.rank, start, next(self._arrivals))
        return Waiter(self, key, tenant=ticket.tenant, size=size)

    def freed(self, backend: str) -> None:
        """A request on `backend` ended: wake the first waiter it could serve."""
        for i, w in enumerate(self.waiters):
            if backend in w.names:
                del self.waiters[i]
                assert w.woken is not None
                w.woken.set_result(backend)
                return

    async def route_when_freed(
        self,
        ticket: Ticket | None,
        decision: Decision,
        route: Callable[[], Awaitable[Decision]],
        request_id: str = "",
    ) -> tuple[Decision, Waiter]:
        """`decision` found every backend at its bound: wait for one of them to free a slot
        and `route` again, until a decision ranks a backend (the waiter's `routed`), or the
        request may not wait longer (its `outcome` says why) or is no longer refused for
        load alone. The last decision, and the waiter (its time in `waited_s`)."""
        waiter = self.waiter(ticket)
        deadline = asyncio.get_running_loop().time() + self.wait_s
        while all_at_bound(decision.filtered_out):
            if not await waiter.wait(decision.filtered_out.keys(), deadline):
                break
            decision = await route()
            if decision.ranking:
                waiter.routed = True
                self.stats["routed"] += 1
                if waiter.key[1] > self.virtual:
                    self.virtual = waiter.key[1]
                return decision, waiter
        if waiter.waited:
            log.info(
                "request %s: every backend stayed at its in-flight bound for %.2f s (%s)",
                request_id,
                waiter.waited_s,
                waiter.outcome or "no longer for load alone",
            )
        return decision, waiter

    async def _wait(self, w: Waiter, names: Collection[str], deadline: float) -> bool:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not w.waited and len(self.waiters) >= self.size and not self._shed_for(w):
            w.outcome = QUEUE_FULL  # (a place kept is kept: only a newcomer is refused)
            self.stats[QUEUE_FULL] += 1
            self._untag(w)
            return False
        if now >= deadline:
            w.outcome = QUEUE_TIMEOUT
            self.stats[QUEUE_TIMEOUT] += 1
            return False
        if not w.waited:
            w.waited = True
            self.stats["waited"] += 1
        w.names = frozenset(names)
        w.woken = loop.create_future()
        self._insert(w)
        try:
            async with asyncio.timeout(min(deadline - now, self.recheck_s)):
                if not await w.woken:  # shed: its place went to a request before it
                    return False
        except TimeoutError:
            self._drop(w)  # the recheck (or the deadline: the next wait says so)
        except BaseException:  # cancelled (the client left): a slot it was given goes on
            self._drop(w)
            if w.woken.done() and not w.woken.cancelled() and w.woken.result():
                self.freed(w.woken.result())
            raise
        finally:
            w.waited_s += loop.time() - now
        return True

    def _shed_for(self, w: Waiter) -> bool:
        """The queue is full: the last waiter gives its place to newcomer `w` if `w` goes
        before it (a better class, or a tenant further below its share); False: `w` would
        go last."""
        last = self.waiters[-1] if self.waiters else None
        if last is None or last.key <= w.key:
            return False
        self.waiters.pop()
        last.outcome = SHED_PRIORITY if last.key[0] > w.key[0] else SHED_FAIR
        self.stats[last.outcome] += 1
        self._untag(last)
        assert last.woken is not None
        last.woken.set_result("")
        return True

    def _untag(self, w: Waiter) -> None:
        """`w` will not be served: if it was its tenant's last, the tenant's finish goes back
        to where it was."""
        if w.tenant is not None and self.finish.get(w.tenant) == w.key[1] + w.size:
            self.finish[w.tenant] = w.key[1]

    def _insert(self, w: Waiter) -> None:
        waiters = self.waiters
        i = len(waiters)
        while i and waiters[i - 1].key > w.key:
            i -= 1
        waiters.insert(i, w)

    def _drop(self, w: Waiter) -> None:
        try:
            self.waiters.remove(w)
        except ValueError:  # freed() took it already
            pass
