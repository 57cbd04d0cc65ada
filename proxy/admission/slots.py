"""Admission: a bound on the requests the proxy works on at once, with a short queue that is
fair among tenants.

Past `limit` requests in flight, a new one waits in a queue of at most `queue` requests for at
most `wait_s`; one that finds the queue full, or waits too long, is refused at once (503 with
Retry-After, in OpenAI's error shape) rather than left hanging or piled onto the backends. A
finished request hands its slot straight to the next waiter.

Who goes next is decided by priority class, then by start-time fair queuing over tenants
(Goyal et al., SIGCOMM 1996), charged in tokens (docs/tenants.md):

- a higher class (interactive before standard before batch) always goes first;
- within a class, each request is tagged when it arrives: its start is the later of the
  queue's virtual time (the start of the request last let in) and its tenant's last finish;
  its finish is that start plus its cost in tokens (the prompt's estimate and the output its
  tenant's requests usually get) over its tenant's weight. The smallest start goes first, so
  a tenant that sends little finds its request at the front, a tenant alone gets every slot,
  and tenants flooding together get slots in their weights' ratio. When a request ends, what
  it really cost (the engine's usage) corrects its tenant's last finish;
- within a tenant, first come first served.

When the queue is full, a newcomer that would go before someone waiting takes that one's
place: the waiter of the lowest class with the latest start is shed, with an error of its own
(SHED_PRIORITY: a lower class; SHED_FAIR: a tenant that asked for more than its share). A
newcomer that would go last is refused: OVER_SHARE when other tenants are served or wait
(its tenant is the one over its share), QUEUE_FULL when it is alone. Without tickets (no API
keys: one tenant) the queue is FIFO, as before.

A queue that does not preempt makes even the first in line wait for a slot to free. With a
`reserve`, the last `reserve` free slots go only to a tenant running fewer than its weight's
share of the slots, while another tenant is active (a request running, or one sent in the
last ACTIVE_S): a tenant over its share waits for them even while they are free, so a quiet
tenant's request finds one at once. Alone, a tenant still gets every slot.

A slot is not all a quiet request waits for: an engine that has begun a prompt finishes it
before one that arrives later, whatever its priority (vLLM's scheduler). With
`reserve_prefills` R, while another tenant is active, the requests let in over their tenant's
share (those the engine ranks after the others') may be at most (engines - R) prompts being
prefilled at once, counted from their admission to their first token (`prefilled()`): at least
R engines are then never prefilling such a prompt, and routing sends a quiet tenant's cold
prompt to the engine with the least prefill ahead of it (`quiet()`).
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
SHED_PRIORITY = "shed_priority"  # a waiter of a lower class gave its place to a higher one
SHED_FAIR = "shed_fair"  # a waiter of a tenant over its share gave its place to another
OVER_SHARE = "over_share"  # the queue is full and this tenant has asked for more than others
DEADLINE = "deadline"  # its predicted wait and TTFT would pass its class's TTFT target
MET, MISSED = "met", "missed"  # a request of a class with a target, by its TTFT
SMOOTHING = 0.1  # of the moving averages of a slot's hold time and of TTFT once admitted

# Priority classes, best first: their rank is their position.
CLASSES = ("interactive", "standard", "batch")
STANDARD = 1
EXPECTED_OUTPUT = 256.0  # tokens a tenant's request is expected to produce, before any is seen
OUTPUT_WEIGHT = 0.2  # how fast a tenant's expected output follows what it was served
ACTIVE_S = 5.0  # a tenant that sent a request this recently counts in the shares of slots


@dataclass(slots=True, eq=False)
class Ticket:
    """One request in the admission's eyes: whose, how urgent, how dear (in tokens)."""

    tenant: str = ""
    weight: float = 1.0
    rank: int = STANDARD  # its class's position in CLASSES
    prompt_tokens: float = 0.0  # estimated at the edge (the body's length / 4)
    cost: float = 0.0  # tokens it was tagged with (prompt and expected output)
    start: float = 0.0  # its start tag, in tokens per unit of weight
    served: tuple[int | None, int | None] | None = None  # the engine's (input, output)
    ttft_s: float | None = None  # its TTFT from admission to the first token (served())
    waited_s: float = 0.0  # in the queue
    backend_wait_s: float = 0.0  # for a backend below its bound (proxy/admission/backend_queue.py)
    admitted_at: float = 0.0  # loop time
    waiter: asyncio.Future[str | None] | None = None
    owner: Admission | None = None  # the admission that let it in, when it keeps prefills
    # For engines that order their queue by a priority (lower first): its class (interactive
    # -2, standard 0, batch 2), plus 1 when its tenant ran more than its weight's share of
    # the requests running as it was let in (set then).
    level: int = 0
    # Counted among the prompts over their share being prefilled (reserve_prefills): by
    # this admission, until its first token or its end.
    prefilling: Admission | None = None


# The ticket of the request the current task serves (set by the edge): the request path
# notes what was served on it (served()), which corrects its tenant's tags.
TICKET: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar(
    "warmroute_ticket", default=None
)


def prefilled() -> None:
    """The current request's first token came: its prompt is prefilled, and no longer counts
    against the prefills kept free (reserve_prefills)."""
    ticket = TICKET.get()
    if ticket is not None and ticket.prefilling is not None:
        ticket.prefilling.prefilled(ticket)


def quiet() -> bool:
    """Whether the current request is let in within its tenant's share while a tenant over
    its share is prefilling: the request whose cold prompt routing sends where its prefill
    starts soonest (reserve_prefills)."""
    ticket = TICKET.get()
    if ticket is None or ticket.level & 1:
        return False
    owner = ticket.owner
    return owner is not None and owner.prefilling_over > 0


def served(facts: Any) -> None:
    """The current request was served `facts` (StreamFacts, or None): its tokens."""
    ticket = TICKET.get()
    if ticket is not None and facts is not None:
        ticket.served = (facts.input_tokens, facts.output_tokens)
        ticket.ttft_s = facts.ttft_s


@dataclass
class AdmissionStats:
    admitted: int = 0
    queued: int = 0  # admitted after waiting
    # the shed and over-share reasons appear once they happen (only with tenants)
    rejected: dict[str, int] = field(default_factory=lambda: {QUEUE_FULL: 0, QUEUE_TIMEOUT: 0})

    def reject(self, reason: str) -> str:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        return reason


class Admission:
    """The global in-flight bound (one per process; the event loop's thread only)."""

    def __init__(
        self,
        limit: int,
        queue: int,
        wait_s: float,
        targets: dict[int, float] | None = None,
        reserve: int = 0,
        reserve_prefills: int = 0,
        engines: Callable[[], int] | None = None,
    ) -> None:
        if (
            limit < 1
            or queue < 0
            or wait_s < 0
            or not 0 <= reserve < limit
            or reserve_prefills < 0
            or (reserve_prefills and engines is None)
        ):
            raise ValueError(
                "admission needs limit >= 1, queue >= 0, wait_s >= 0, 0 <= reserve < limit "
                "and reserve_prefills >= 0 (with the engines counted)"
            )
        self.limit = limit
        # The last `reserve` free slots go only to tenants running less than their share
        # while others are active (_may_take): a quiet tenant finds a slot free.
        self.reserve = reserve
        # And `reserve_prefills` engines are kept from prefilling the prompts of tenants
        # over their share (`engines`: how many the fleet routes to now).
        self.reserve_prefills = reserve_prefills
        self.engines = engines
        self.prefilling_over = 0  # prompts let in over their share, not yet prefilled
        self.gated = bool(reserve or reserve_prefills)  # _may_take decides who goes
        self.seen: dict[str, float] = {}  # tenant -> when it was last tagged (with a reserve)
        self.queue = queue
        self.wait_s = wait_s
        # TTFT targets by class rank: a waiting request that cannot meet its target is
        # refused at once (DEADLINE), and those that can are counted met or missed.
        self.targets = targets or {}
        self.hold_s: float | None = None  # moving average of how long a slot is held
        self.ttft_s: dict[int, float] = {}  # moving average of TTFT once admitted, by class
        self.goodput: dict[tuple[str, str], int] = {}  # (class, met | missed | refused)
        self.inflight = 0
        self.stats = AdmissionStats()
        self.waiting = 0
        # rank -> tenant -> its waiting tickets, in arrival (and start tag) order
        self._queues: dict[int, dict[str, deque[Ticket]]] = {}
        self.virtual = 0.0  # the start tag of the last ticket let in
        self.finish: dict[str, float] = {}  # each tenant's last finish tag
        self.expected_output: dict[str, float] = {}  # per tenant, from what it was served
        self.running: dict[str, int] = {}  # admitted and not finished, per tenant
        self.weights: dict[str, float] = {}  # each tenant's, as its last ticket said

    @property
    def retry_after_s(self) -> int:
        """What a refused client is told to wait (whole seconds, at least 1)."""
        return max(1, math.ceil(self.wait_s))

    def admit_now(self, ticket: Ticket | None = None) -> bool:
        """Take a slot if one is free and nobody waits for one (else enter() queues)."""
        if (
            self.inflight < self.limit
            and not self.waiting
            and (ticket is None or not self.gated or self._may_take(ticket))
        ):
            self.inflight += 1
            self.stats.admitted += 1
            if ticket is not None:
                self._tag(ticket)
                self._let_in(ticket)
            return True
        return False

    async def enter(self, ticket: Ticket | None = None) -> str | None:
        """Take a slot: None once admitted, else why not (QUEUE_FULL, QUEUE_TIMEOUT,
        OVER_SHARE, DEADLINE, or shed from the queue: SHED_PRIORITY, SHED_FAIR). Give the
        same `ticket` to leave(): it is counted running until then."""
        ticket = ticket or Ticket()
        if self.admit_now(ticket):
            return None
        self._tag(ticket)
        if self.gated and self._first_to_go(ticket):  # a slot kept free, for it
            self.inflight += 1
            self.stats.admitted += 1
            self._let_in(ticket)
            return None
        if ticket.rank in self.targets and self._hopeless(ticket):
            self._untag(ticket)
            self._count(ticket.rank, DEADLINE)
            return self.stats.reject(DEADLINE)
        if self.waiting >= self.queue:
            refused = self._make_room(ticket)
            if refused is not None:
                self._untag(ticket)
                return self.stats.reject(refused)
        loop = asyncio.get_running_loop()
        queued_at = loop.time()
        waiter: asyncio.Future[str | None] = loop.create_future()
        ticket.waiter = waiter
        self._queues.setdefault(ticket.rank, {}).setdefault(ticket.tenant, deque()).append(ticket)
        self.waiting += 1
        try:
            async with asyncio.timeout(self.wait_s):
                outcome = await waiter
        except TimeoutError:
            if not (waiter.done() and not waiter.cancelled()):
                self._forget(ticket)
                return self.stats.reject(QUEUE_TIMEOUT)
            outcome = waiter.result()  # handed a slot (or shed) as the time ran out
        except BaseException:  # cancelled while waiting: a slot handed over goes on
            self._forget(ticket)
            if waiter.done() and not waiter.cancelled() and waiter.result() is None:
                self.leave(ticket)
            raise
        if outcome is not None:  # shed: its place went to a request before it
            return self.stats.reject(outcome)
        # _fill() let us in: inflight counts us already
        ticket.waited_s = loop.time() - queued_at
        self.stats.admitted += 1
        self.stats.queued += 1
        return None

    def leave(self, ticket: Ticket | None = None) -> None:
        """Give the slot back, to the next waiter if one is waiting (by class, then the
        earliest start tag, then first come)."""
        if ticket is not None:
            self._settle(ticket)
        self.inflight -= 1
        if self.waiting:
            self._fill()

    def _fill(self) -> None:
        """Let waiters in, in order, while a slot is free: with slots or prefills kept, the
        first in order that may take one (a tenant held back does not hold up the others)."""
        while self.waiting and self.inflight < self.limit:
            found = self._head_of(self._may_take if self.gated else None)
            if found is None:
                return
            nxt = self._take(*found)
            if nxt.waiter is not None and not nxt.waiter.done():
                self.inflight += 1
                self._let_in(nxt)
                nxt.waiter.set_result(None)

    # -- slots kept for the tenants below their share -----------------------------------------
    def _may_take(self, ticket: Ticket) -> bool:
        """Whether `ticket` may take a free slot: more than the reserve are free, or its
        tenant runs fewer than its weight's share of the slots among the tenants active (a
        request running, or one sent in the last ACTIVE_S), or it is the only one active;
        and, keeping prefills, it would not be one prefill too many over its share."""
        slots = self.limit - self.inflight > self.reserve
        if slots and not (self.reserve_prefills and self.prefilling_over):
            return True
        me = ticket.tenant
        horizon = time.monotonic() - ACTIVE_S
        total = ticket.weight
        others = False
        weights = self.weights
        for tenant, at in self.seen.items():
            if tenant != me and (at >= horizon or tenant in self.running):
                total += weights[tenant]
                others = True
        if not others:
            return True
        if not slots and self.running.get(me, 0) >= self.limit * ticket.weight / total:
            return False
        if self.reserve_prefills and self.prefilling_over:
            assert self.engines is not None
            room = self.engines() - self.reserve_prefills
            if self.prefilling_over >= (room if room > 1 else 1) and self._over_share(ticket):
                return False
        return True

    def _over_share(self, ticket: Ticket) -> bool:
        """Whether `ticket`, let in now, would run more than its tenant's weight's share of
        the requests running (among the tenants running or, keeping slots or prefills,
        active lately): the engine ranks it after the others' (its level + 1)."""
        running = self.running
        weights = self.weights
        mine = running.get(ticket.tenant, 0) + 1
        everyone = sum(running.values()) + 1
        active = sum(weights.get(t, 1.0) for t in running)
        if ticket.tenant not in running:
            active += ticket.weight
        if self.seen:
            horizon = time.monotonic() - ACTIVE_S
            for tenant, at in self.seen.items():
                if at >= horizon and tenant not in running and tenant != ticket.tenant:
                    active += weights.get(tenant, 1.0)
        return active > ticket.weight and mine * active > everyone * ticket.weight

    def prefilled(self, ticket: Ticket) -> None:
        """`ticket`'s prompt has been prefilled (its first token, or its end): one prefill
        over a share fewer, and a waiter kept back by them may go."""
        if ticket.prefilling is self:
            ticket.prefilling = None
            self.prefilling_over -= 1
            if self.waiting:
                self._fill()

    def _first_to_go(self, ticket: Ticket) -> bool:
        """A slot is free (kept by the reserve from the waiters), no waiter goes before
        `ticket`, and it may take the slot."""
        if self.inflight >= self.limit:
            return False
        found = self._head_of(self._may_take) if self.waiting else None
        if found is not None:
            head = found[0][found[1]][0]
            if (head.rank, head.start) < (ticket.rank, ticket.start):
                return False
        return self._may_take(ticket)

    # -- the fair order ---------------------------------------------------------------------
    def _tag(self, ticket: Ticket) -> None:
        tenant = ticket.tenant
        self.weights[tenant] = ticket.weight
        if self.gated:
            self.seen[tenant] = time.monotonic()
        ticket.cost = ticket.prompt_tokens + self.expected_output.get(tenant, EXPECTED_OUTPUT)
        last = self.finish.get(tenant, 0.0)
        ticket.start = last if last > self.virtual else self.virtual
        self.finish[tenant] = ticket.start + ticket.cost / ticket.weight

    def _untag(self, ticket: Ticket) -> None:
        """`ticket` will not be served (refused, shed, gone): if it was its tenant's last,
        the tenant's finish goes back to where it was."""
        if self.finish.get(ticket.tenant) == ticket.start + ticket.cost / ticket.weight:
            self.finish[ticket.tenant] = ticket.start

    def _let_in(self, ticket: Ticket) -> None:
        if ticket.start > self.virtual:
            self.virtual = ticket.start
        running = self.running
        ticket.level = 2 * (ticket.rank - STANDARD)
        # Over its share of what runs: after the others' at the engine (with a reserve, a
        # tenant active lately counts, as for the slots).
        others = len(running) > 1 or (bool(running) and ticket.tenant not in running)
        if (others or self.seen) and self._over_share(ticket):
            ticket.level += 1
        running[ticket.tenant] = running.get(ticket.tenant, 0) + 1
        if self.reserve_prefills:
            ticket.owner = self
            if ticket.level & 1:
                ticket.prefilling = self
                self.prefilling_over += 1
        if self.targets:
            ticket.admitted_at = asyncio.get_running_loop().time()

    # -- deadlines --------------------------------------------------------------------------
    def _hopeless(self, ticket: Ticket) -> bool:
        """Whether `ticket`, which must wait, would pass its class's TTFT target: the
        waiters that go before it, each freeing one of `limit` slots a hold time apart,
        then the TTFT its class gets once admitted (nothing refused before both are known)."""
        hold, after = self.hold_s, self.ttft_s.get(ticket.rank)
        if hold is None or after is None:
            return False
        ahead = 0
        for rank, queues in self._queues.items():
            if rank < ticket.rank:
                ahead += sum(map(len, queues.values()))
            elif rank == ticket.rank:
                for q in queues.values():
                    ahead += sum(1 for t in q if t.start <= ticket.start)
        wait = (ahead + 1) * hold / self.limit
        return wait + after > self.targets[ticket.rank]

    def _count(self, rank: int, outcome: str) -> None:
        key = (CLASSES[rank], outcome)
        self.goodput[key] = self.goodput.get(key, 0) + 1

    def _measure(self, ticket: Ticket) -> None:
        """A request of a class with a target ended: its hold time and TTFT feed the
        predictions, and it met its target or missed it (goodput, vLLM's definition: the
        requests that met their service-level objective)."""
        held = asyncio.get_running_loop().time() - ticket.admitted_at
        self.hold_s = (
            held if self.hold_s is None else self.hold_s + SMOOTHING * (held - self.hold_s)
        )
        if ticket.ttft_s is None:
            return
        rank = ticket.rank
        before = self.ttft_s.get(rank)
        after = ticket.ttft_s
        self.ttft_s[rank] = after if before is None else before + SMOOTHING * (after - before)
        target = self.targets.get(rank)
        if target is not None:
            self._count(rank, MET if ticket.waited_s + after <= target else MISSED)

    def _head_of(
        self, eligible: Callable[[Ticket], bool] | None = None
    ) -> tuple[dict[str, deque[Ticket]], str] | None:
        """Where the next ticket waits: its class's queues, and its tenant; with `eligible`,
        the next whose tenant's first waiter it passes (None: no such waiter)."""
        for rank in sorted(self._queues):
            queues = self._queues[rank]
            if not queues:
                continue
            if eligible is None:
                if len(queues) == 1:
                    return queues, next(iter(queues))
                return queues, min(queues, key=lambda t: queues[t][0].start)
            for tenant in sorted(queues, key=lambda t: queues[t][0].start):
                if eligible(queues[tenant][0]):
                    return queues, tenant
        if eligible is None:
            raise AssertionError("admission: waiting > 0 with every queue empty")
        return None

    def _take(self, queues: dict[str, deque[Ticket]], tenant: str) -> Ticket:
        """Take `tenant`'s first waiting ticket out of `queues`."""
        mine = queues[tenant]
        ticket = mine.popleft()
        if not mine:
            del queues[tenant]
        self.waiting -= 1
        return ticket

    def _make_room(self, ticket: Ticket) -> str | None:
        """The queue is full: shed the waiter `ticket` should go before, or say why
        `ticket` is refused."""
        worst = max((r for r, q in self._queues.items() if q), default=None)
        if worst is None:
            return QUEUE_FULL  # no queue at all (admission_queue: 0)
        queues = self._queues[worst]
        victim_tenant = max(queues, key=lambda t: queues[t][-1].start)
        victims = queues[victim_tenant]
        victim = victims[-1]  # the latest start of the lowest class
        if worst > ticket.rank:
            reason = SHED_PRIORITY
        elif worst == ticket.rank and victim.start > ticket.start:
            reason = SHED_FAIR
        else:  # it would go last: over its share if another tenant is served or waits
            me = ticket.tenant
            others = any(t != me for t in self.running) or any(
                t != me for q in self._queues.values() for t in q
            )
            return OVER_SHARE if others else QUEUE_FULL
        victims.pop()
        if not victims:
            del queues[victim_tenant]
        self.waiting -= 1
        self._untag(victim)
        assert victim.waiter is not None
        victim.waiter.set_result(reason)
        return None

    def _settle(self, ticket: Ticket) -> None:
        """The request ended: its tenant's tags take what it really cost."""
        if ticket.prefilling is self:  # ended before its first token
            ticket.prefilling = None
            self.prefilling_over -= 1
        tenant = ticket.tenant
        left = self.running.get(tenant, 0) - 1
        if left > 0:
            self.running[tenant] = left
        else:
            self.running.pop(tenant, None)
        if self.targets and ticket.admitted_at:
            self._measure(ticket)
        if ticket.served is None:
            return
        prompt, output = ticket.served
        real = (ticket.prompt_tokens if prompt is None else prompt) + (output or 0)
        self.finish[tenant] = self.finish.get(tenant, 0.0) + (real - ticket.cost) / ticket.weight
        if output is not None:
            mean = self.expected_output.get(tenant, EXPECTED_OUTPUT)
            self.expected_output[tenant] = mean + OUTPUT_WEIGHT * (output - mean)

    def _forget(self, ticket: Ticket) -> None:
        queues = self._queues.get(ticket.rank, {})
        mine = queues.get(ticket.tenant)
        if mine is None:
            return
        try:
            mine.remove(ticket)
        except ValueError:  # leave() or _make_room() took it already
            return
        self.waiting -= 1
        if not mine:
            del queues[ticket.tenant]
        self._untag(ticket)

    def shares(self) -> dict[str, dict[str, Any]]:
        """Each tenant's place in the queue (for /admin/tenants): waiting, running, and how
        far its last finish tag is ahead of the queue's virtual time (tokens per unit of
        weight asked for beyond what the others had: the larger, the later it goes)."""
        out: dict[str, dict[str, Any]] = {}
        for tenant in {*self.finish, *self.running}:
            waiting = sum(len(q.get(tenant, ())) for q in self._queues.values())
            ahead = self.finish.get(tenant, 0.0) - self.virtual
            out[tenant] = {
                "waiting": waiting,
                "running": self.running.get(tenant, 0),
                "ahead_tokens_per_weight": round(ahead if ahead > 0 else 0.0, 1),
            }
        return out
