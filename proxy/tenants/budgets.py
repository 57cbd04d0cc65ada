"""Per request: which limits apply, admit or refuse, then charge what was served.

A request is charged at admission one request and its estimated prompt tokens (its body's
bytes / CHARS_PER_TOKEN: JSON and roles included, so it overestimates a little); output
limits ask only that one unit be left. While it streams, its output is charged every
`tenants.charge_every_s` (the meter's output events, one token each for the engines we
front); at its end the engine's own usage settles both counts (the prompt's exact tokens
replace the estimate; without usage the estimate and the counted events stand).

A tenant's `max_concurrent` counts its requests on every replica through Redis, one lease per
request (leases.py); without Redis, this replica's.

Redis holds the budgets for every replica. When a call fails or takes longer than
redis.timeout_s, this replica enforces its share (each limit divided by the replicas live at
the last call that reached Redis) in memory, logs it once, reports it on /admin/tenants and as
a metric, and tries Redis again after RETRY_REDIS_S. No request fails because Redis did.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from proxy.tenants.gcra import (
    ADMIT,
    CHARGE,
    INPUT,
    OUTPUT,
    PEEK,
    REQUESTS,
    TOKENS,
    WINDOW_S,
    Limit,
    Outcome,
    headers,
)
from proxy.tenants.leases import LEASE_S, RedisLeases
from proxy.tenants.store import LocalBuckets, RedisBuckets

if TYPE_CHECKING:
    from proxy.config import BudgetLimits, TenantsConfig

log = logging.getLogger("warmroute.tenants")

DEFAULT_TENANT = "default"  # the one tenant when API keys are off
CHARS_PER_TOKEN = 4
RETRY_REDIS_S = 1.0  # after a failed call, Redis is tried again this much later


def estimate_tokens(body_bytes: int) -> int:
    """A request's prompt tokens before the engine counts them: its body's length / 4 (the
    budgets charge this at admission; the admission queue tags a request with it)."""
    return max(1, math.ceil(body_bytes / CHARS_PER_TOKEN))


@dataclass(slots=True, eq=False)  # by identity: the running ones are kept in a set
class Grant:
    """An admitted request: what it was charged, and the headers its response carries."""

    tenant: str
    limits: tuple[Limit, ...]
    input_estimate: int
    headers: list[tuple[bytes, bytes]]
    concurrent: bool  # holds one of its tenant's max_concurrent slots
    lease: tuple[str, str] | None = None  # (the cap's key, its lease) in Redis, to release
    output_charged: int = 0
    output_seen: Callable[[], int] | None = None  # the live stream's output events so far


@dataclass(slots=True)
class Refusal:
    """A refused request: OpenAI's 429 for a rate limit, with when to come back."""

    tenant: str
    message: str
    kind: str  # "requests", "tokens" or "concurrency": the error's `type`
    retry_after_s: float | None  # None: waiting will not help (larger than the limit)
    headers: list[tuple[bytes, bytes]]


@dataclass
class TenantStats:
    admitted: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # by kind
    input_tokens: int = 0
    output_tokens: int = 0
    inflight: int = 0
    last: Outcome | None = None


class Budgets:
    """The tenants' limits for one replica."""

    def __init__(
        self,
        config: TenantsConfig,
        *,
        redis: Any | None = None,
        key_prefix: str = "warmroute",
        replica: str = "replica",
        timeout_s: float = 0.05,
        clock: Callable[[], float] = time.time,
        tenants: tuple[str, ...] = (DEFAULT_TENANT,),
    ) -> None:
        self.config = config
        self.tenants = tenants  # the API keys' names, or the one default tenant
        self.redis = None if redis is None else RedisBuckets(redis, key_prefix, replica)
        self.leases = None if redis is None else RedisLeases(redis, key_prefix, replica)
        self.held: dict[str, set[str]] = {}  # this replica's leases in Redis, by cap key
        self.lease_s = LEASE_S
        self._renew_at = 0.0
        self.local = LocalBuckets()
        self.timeout_s = timeout_s
        self.clock = clock
        self.live_replicas = 1  # at the last call that reached Redis
        self.redis_down_until = 0.0  # local shares until then (a failed call)
        self.redis_failures = 0
        self.stats: dict[str, TenantStats] = {}
        self.live: set[Grant] = set()
        self._limits: dict[tuple[str, str], tuple[tuple[Limit, ...], int | None]] = {}

    # -- which limits -----------------------------------------------------------------------
    def limits_for(self, tenant: str, model: str) -> tuple[tuple[Limit, ...], int | None]:
        """The limits on `tenant`'s requests for `model`, and its concurrency cap."""
        found = self._limits.get((tenant, model))
        if found is None:
            cfg = self.config.keys.get(tenant, self.config.default)
            limits = _limits(tenant, "", cfg)
            per_model = cfg.models.get(model)
            if per_model is not None:
                limits += _limits(tenant, model, per_model)
            caps = [c for c in (cfg.max_concurrent, per_model and per_model.max_concurrent) if c]
            found = (tuple(limits), min(caps) if caps else None)
            if len(self._limits) < 4096:  # tenants are configured; models are the fleet's
                self._limits[(tenant, model)] = found
        return found

    @property
    def shared(self) -> bool:
        """Whether the budgets are held in Redis now (False: this replica's share)."""
        return self.redis is not None and self.clock() >= self.redis_down_until

    # -- a request ----------------------------------------------------------------------------
    async def admit(self, tenant: str, model: str, raw: bytes) -> Grant | Refusal:
        limits, cap = self.limits_for(tenant, model)
        stats = self.stats.setdefault(tenant, TenantStats())
        estimate = estimate_tokens(len(raw))
        lease = None
        if cap is not None:
            slot = await self._take_slot(tenant, cap, stats)
            if isinstance(slot, Refusal):
                return self._refuse(stats, slot)
            lease = slot
        try:
            charged = await self._charge_admission(tenant, limits, estimate, stats)
        except BaseException:  # cancelled (the client left): no renewal, the lease expires
            if lease is not None:
                self._drop_held(lease)
            raise
        if isinstance(charged, Refusal):
            if lease is not None:
                await self._release(lease)
            return self._refuse(stats, charged)
        stats.admitted += 1
        concurrent = cap is not None
        if concurrent:
            stats.inflight += 1
        found = headers(charged.readings) if charged is not None else []
        return Grant(tenant, limits, estimate, found, concurrent, lease)

    async def _charge_admission(
        self, tenant: str, limits: tuple[Limit, ...], estimate: int, stats: TenantStats
    ) -> Outcome | Refusal | None:
        """Charge the request's admission to its limits (one call; None: it has none), or say
        why not."""
        costs = [_admission_cost(lim.kind, estimate) for lim in limits]
        too_big = [lim for lim, c in zip(limits, costs, strict=True) if c > lim.per_minute]
        if too_big:
            lim = too_big[0]
            message = (
                f"Request too large for `{tenant}` on {lim.named()}: limit {lim.per_minute}, "
                f"requested about {estimate}. Send a smaller prompt."
            )
            return Refusal(tenant, message, "tokens", None, [])
        if not limits:
            return None
        outcome = await self._call(limits, costs, ADMIT)
        stats.last = outcome
        if not outcome.ok:
            by = outcome.refused_by
            assert by is not None
            message = (
                f"Rate limit reached for `{tenant}` on {by.named()}: limit "
                f"{by.per_minute}. Please try again in {outcome.wait_s:.3g}s."
            )
            kind = "requests" if by.kind == REQUESTS else "tokens"
            return Refusal(tenant, message, kind, outcome.wait_s, headers(outcome.readings))
        stats.input_tokens += estimate
        return outcome

    async def _take_slot(
        self, tenant: str, cap: int, stats: TenantStats
    ) -> tuple[str, str] | Refusal | None:
        """One of `tenant`'s `cap` slots: a lease in Redis, counted over every replica (its key
        and name), or this replica's count while Redis is away or not configured (None)."""
        now = self.clock()
        if self.leases is not None and now >= self.redis_down_until:
            key, member = self.leases.key(tenant), self.leases.member()
            try:
                async with asyncio.timeout(self.timeout_s):
                    taken, held, live = await self.leases.take(key, cap, member, self.lease_s)
            except Exception as e:  # away, frozen, refusing: this replica's share
                self._redis_failed(now, e)
            else:
                self.live_replicas = live
                if taken:
                    self.held.setdefault(key, set()).add(member)
                    return key, member
                return _too_many(tenant, cap, f"{held} in flight across the replicas")
        if self.leases is None:
            limit, where = cap, "in flight here"
        else:
            limit = max(1, cap // max(1, self.live_replicas))
            where = f"this replica's share while Redis is away: {limit}"
        if stats.inflight >= limit:
            return _too_many(tenant, cap, f"{stats.inflight} {where}")
        return None

    async def _release(self, lease: tuple[str, str]) -> None:
        """Give the slot back (a release that fails leaves the lease to expire)."""
        key, member = self._drop_held(lease)
        if self.leases is None or self.clock() < self.redis_down_until:
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.leases.release(key, member)
        except Exception as e:
            self._redis_failed(self.clock(), e)

    def _drop_held(self, lease: tuple[str, str]) -> tuple[str, str]:
        """Stop renewing `lease` (what is not renewed expires within lease_s)."""
        key, member = lease
        members = self.held.get(key)
        if members is not None:
            members.discard(member)
            if not members:
                del self.held[key]
        return lease

    async def renew_leases(self) -> None:
        """Renew this replica's leases (due every lease_s / 3): one call for all of them."""
        now = self.clock()
        if self.leases is None or not self.held or now < self._renew_at:
            return
        self._renew_at = now + self.lease_s / 3
        if now < self.redis_down_until:
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.leases.renew(self.held, self.lease_s)
        except Exception as e:
            self._redis_failed(now, e)

    async def release_all(self) -> None:
        """At shutdown: this replica's slots back to the others at once, not in lease_s."""
        for key, members in list(self.held.items()):
            for member in list(members):
                await self._release((key, member))

    def streaming(self, grant: Grant, output_seen: Callable[[], int]) -> None:
        """`grant`'s response streams: its output is charged as it goes (charge_live)."""
        if any(lim.kind in (OUTPUT, TOKENS) for lim in grant.limits):
            grant.output_seen = output_seen
            self.live.add(grant)

    async def settle(
        self, grant: Grant, input_tokens: int | None, output_tokens: int | None
    ) -> None:
        """The request is over: charge what the engine said it served (or what was seen)."""
        self.live.discard(grant)
        stats = self.stats.setdefault(grant.tenant, TenantStats())
        if grant.concurrent:
            stats.inflight -= 1
        if grant.lease is not None:
            await self._release(grant.lease)
            grant.lease = None
        if output_tokens is None:
            output_tokens = grant.output_seen() if grant.output_seen is not None else 0
        more_in = 0 if input_tokens is None else input_tokens - grant.input_estimate
        more_out = output_tokens - grant.output_charged
        grant.output_charged = output_tokens
        stats.input_tokens += more_in
        stats.output_tokens += more_out
        await self._charge(grant, more_in, more_out)

    async def charge_live(self) -> None:
        """Charge the running streams' output since their last charge: one call for all the
        streams under the same limits (a tenant's, for one model), not one per stream."""
        owed: dict[tuple[Limit, ...], tuple[Grant, int]] = {}
        for grant in list(self.live):
            seen = grant.output_seen() if grant.output_seen is not None else 0
            more = seen - grant.output_charged
            if more > 0:
                grant.output_charged = seen
                self.stats.setdefault(grant.tenant, TenantStats()).output_tokens += more
                first, total = owed.get(grant.limits, (grant, 0))
                owed[grant.limits] = (first, total + more)
        for grant, more in owed.values():
            await self._charge(grant, 0, more)

    async def run_charging(self) -> None:
        """charge_live every tenants.charge_every_s, until cancelled."""
        while True:
            await asyncio.sleep(self.config.charge_every_s)
            try:
                await self.charge_live()
                await self.renew_leases()
                self.local.forget_idle(self.clock())  # buckets full again hold nothing
            except Exception:  # never let the charger die: budgets would stop counting
                log.exception("charging running streams failed")

    async def _charge(self, grant: Grant, more_in: int, more_out: int) -> None:
        costs = [_charge_cost(lim.kind, more_in, more_out) for lim in grant.limits]
        picked = [(lim, c) for lim, c in zip(grant.limits, costs, strict=True) if c]
        if picked:
            await self._call([p[0] for p in picked], [p[1] for p in picked], CHARGE)

    async def peek(self, tenant: str, model: str = "") -> Outcome | None:
        """`tenant`'s budgets now, charging nothing (for /admin/tenants)."""
        limits, _ = self.limits_for(tenant, model)
        return await self._call(limits, [0.0] * len(limits), PEEK) if limits else None

    # -- Redis or this replica's share ----------------------------------------------------------
    async def _call(self, limits: Any, costs: Any, mode: str) -> Outcome:
        now = self.clock()
        if self.redis is not None and now >= self.redis_down_until:
            try:
                async with asyncio.timeout(self.timeout_s):
                    outcome = await self.redis.call(limits, costs, mode)
            except Exception as e:  # away, frozen, refusing: this replica's share
                self._redis_failed(now, e)
            else:
                if mode == ADMIT:
                    self.live_replicas = outcome.live_replicas
                return outcome
        share = self.live_replicas if self.redis is not None else 1
        return self.local.call(limits, costs, mode, now, share)

    def _redis_failed(self, now: float, e: BaseException) -> None:
        if now >= self.redis_down_until:
            log.warning(
                "tenant budgets: Redis did not answer (%s); this replica enforces its share "
                "(each limit / %d live replicas) until it does; retrying in %.0f s",
                type(e).__name__ if not str(e) else f"{type(e).__name__}: {e}",
                self.live_replicas,
                RETRY_REDIS_S,
            )
        self.redis_failures += 1
        self.redis_down_until = now + RETRY_REDIS_S

    def _refuse(self, stats: TenantStats, refusal: Refusal) -> Refusal:
        stats.refused[refusal.kind] = stats.refused.get(refusal.kind, 0) + 1
        log.info("tenant %s refused (%s): %s", refusal.tenant, refusal.kind, refusal.message)
        return refusal

    def view(self) -> dict[str, Any]:
        """What /admin/tenants shows of this replica (budgets left: `peek`)."""
        return {
            "budgets": "redis" if self.shared else ("local share" if self.redis else "local"),
            "live_replicas": self.live_replicas,
            "redis_failures": self.redis_failures,
            # max_concurrent: counted over every replica (leases in Redis), or here
            "concurrency": "redis" if self.leases is not None and self.shared else "local",
            "leases_held_here": sum(len(m) for m in self.held.values()),
            "window_s": WINDOW_S,
        }


def _too_many(tenant: str, cap: int, now_held: str) -> Refusal:
    message = (
        f"Too many requests in flight for `{tenant}`: its limit is {cap} at once "
        f"(tenants: max_concurrent; {now_held}). Retry when one has finished."
    )
    return Refusal(tenant, message, "concurrency", 1.0, [])


def _limits(tenant: str, model: str, cfg: BudgetLimits) -> list[Limit]:
    per_minute = (
        (REQUESTS, cfg.requests_per_minute),
        (INPUT, cfg.input_tokens_per_minute),
        (OUTPUT, cfg.output_tokens_per_minute),
        (TOKENS, cfg.tokens_per_minute),
    )
    return [Limit(tenant, kind, n, model) for kind, n in per_minute if n is not None]


def _admission_cost(kind: str, estimate: int) -> float:
    if kind == REQUESTS:
        return 1.0
    if kind in (INPUT, TOKENS):
        return float(estimate)
    return 0.0  # output: one unit must be left, nothing is known yet


def _charge_cost(kind: str, more_in: int, more_out: int) -> float:
    if kind == INPUT:
        return float(more_in)
    if kind == OUTPUT:
        return float(more_out)
    if kind == TOKENS:
        return float(more_in + more_out)
    return 0.0
