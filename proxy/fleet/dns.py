"""A fleet that follows a DNS name: every address it resolves to is one engine.

Why DNS: it is what every platform already publishes (a Kubernetes headless Service, Consul,
Nomad, a cloud's private zone, a hand-kept zone file), so a fleet can grow and shrink without
the proxy's config file changing. `DnsSource` asks the name again when its answer's TTL runs out
(clamped to the entry's `min_ttl_s`..`max_ttl_s`) and reports the whole set each time
(members.py: level-triggered); the reconciler turns the difference into joins and leaves.

- Without `srv`: every A and every AAAA record is one engine, at (address, `port`).
- With `srv: true`: every SRV record is one engine, at (its target's address, its port). The
  target's address comes from the answer's additional section when the server put it there
  (most do), else from A/AAAA lookups of the target. The backend is addressed by IP, so its
  key is ip:port, as for plain A/AAAA. A target with several addresses is still one engine: it
  gets its lowest IPv4 address (or its lowest IPv6 address if it has none), so the choice is the
  same on every replica. SRV priority and weight are not used: every record is a member with the
  entry's own `weight`. CoreDNS (Kubernetes) writes a weight of 100/N on every record, so a
  weight taken from it would change on every member at each join and leave, an `update` for the
  whole fleet that says nothing about the engines; the router balances by load anyway.
  A record whose target is "." ("decidedly not available", RFC 2782) or whose port is 0 is no
  engine; a target that does not resolve (NXDOMAIN, no address) is skipped, the others kept.

Failure (NXDOMAIN, no answer, a timeout, a server failure or refusal, no nameserver at all)
reports nothing, so the fleet keeps the last set this source reported, or stays empty for it if
it never resolved (members.py: a control-plane blip must never empty the fleet). One warning
line when the name starts failing, one info line when it resolves again; the retries between
are debug lines, and come with backoff (`Schedule.after_failure`).

Names are asked as written, made absolute: no search list (resolv.conf's `search`/`ndots`),
which could answer for another name than the one configured. Write it in full
(vllm.default.svc.cluster.local). Every query is bounded (`lifetime_s`): a nameserver that
never answers costs a few seconds, then the attempt counts as failed, and the task stays
cancellable throughout.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver
from dns.rdtypes.IN.A import A
from dns.rdtypes.IN.AAAA import AAAA
from dns.rdtypes.IN.SRV import SRV

from proxy.config import DiscoveryConfig, parse_nameserver
from proxy.fleet.members import Member, Report

log = logging.getLogger("warmroute.fleet")

# One query's whole budget, every nameserver and retry included. A resolver answers on loopback
# or a LAN in milliseconds; a few seconds is many lost packets' worth, and short enough that a
# dead resolver only delays the next attempt, never hangs the source.
LIFETIME_S = 3.0
# Retries after a failure start here and double to the cap. 1 s: a resolver restarting or a
# zone being reloaded is back within seconds, and a first retry that soon costs one packet.
RETRY_START_S = 1.0
# ... and stop growing here: an outage that lasts is still noticed over within half a minute,
# at one query per 30 s, which no resolver notices. Bounded by the entry's min/max TTL (below).
RETRY_CAP_S = 30.0
# The failures an attempt may raise: DNS errors (NXDOMAIN, NoAnswer, NoNameservers, timeouts,
# no resolv.conf), socket errors (no route, a nameserver's name that does not resolve), and the
# whole attempt's own bound.
FAILURES = (dns.exception.DNSException, OSError, TimeoutError)

Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Schedule:
    """When to ask again (pure: seconds in, seconds out).

    After an answer: its TTL, clamped to [min_ttl_s, max_ttl_s] (a TTL of 0, which dnsmasq and
    some service registries send to say "don't cache", must not become a busy loop; a day-long
    TTL must not hide a new engine for a day).

    After the n-th failure in a row: RETRY_START_S * 2**(n-1), capped at RETRY_CAP_S. Both are
    held within the entry's bounds: the start never exceeds min_ttl_s (an entry that asks
    often, e.g. min_ttl_s 0.05 in tests, retries as often), and the cap is RETRY_CAP_S clamped to
    [min_ttl_s, max_ttl_s] (never slower than a working name would be asked at most, never faster
    than at least). Defaults (5 s, 300 s): 1, 2, 4, 8, 16, 30, 30... seconds. No jitter: the
    proxy's replicas start at different times, and one query per replica is no herd."""

    min_ttl_s: float
    max_ttl_s: float

    @classmethod
    def of(cls, cfg: DiscoveryConfig) -> Schedule:
        return cls(cfg.min_ttl_s, cfg.max_ttl_s)

    def after_answer(self, ttl: float) -> float:
        return min(max(ttl, self.min_ttl_s), self.max_ttl_s)

    def after_failure(self, failures: int) -> float:
        start = min(RETRY_START_S, self.min_ttl_s)
        cap = min(max(RETRY_CAP_S, self.min_ttl_s), self.max_ttl_s)
        doublings = min(max(failures, 1) - 1, 64)  # 2**64 * anything is past any cap
        return min(start * 2.0**doublings, cap)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Resolution:
    """One successful resolution: the whole set, and how long it holds (its smallest TTL)."""

    members: list[Member]
    ttl: float


class _NoAddress(dns.exception.DNSException):
    """SRV records whose targets none resolve: as good as no answer (keep the fleet)."""


def _sort_key(host: str, port: int) -> tuple[int, int, int]:
    ip = ipaddress.ip_address(host)
    return ip.version, int(ip), port


class DnsSource:
    """The engines behind `cfg.dns` (members.Source): see the module's docstring.

    `nameservers`: "host" or "host:port" entries (fleet.nameservers); empty: the system's
    (/etc/resolv.conf, read at each attempt, so a fixed file is picked up). `lifetime_s` bounds
    each query; `sleep` is how the source waits between attempts (tests pass one that records
    the delays asked for)."""

    def __init__(
        self,
        cfg: DiscoveryConfig,
        nameservers: Sequence[str] = (),
        *,
        lifetime_s: float = LIFETIME_S,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if cfg.dns is None:
            raise ValueError("DnsSource needs a discovered fleet with `dns:`")
        self.cfg = cfg
        self.name = cfg.source
        self.qname = dns.name.from_text(cfg.dns)  # absolute: see the module's docstring
        self.nameservers = [parse_nameserver(n) for n in nameservers]  # bad entries fail here
        self.lifetime_s = lifetime_s
        self.schedule = Schedule.of(cfg)
        self._sleep = sleep

    async def run(self, report: Report) -> None:
        """Resolve, report, wait; until cancelled. A failure reports nothing (members.py)."""
        failures = 0
        reported: int | None = None  # engines in the last report; None: never resolved yet
        while True:
            try:
                found = await self.resolve()
            except FAILURES as e:
                failures += 1
                delay = self.schedule.after_failure(failures)
                if failures == 1:
                    kept = (
                        "the fleet starts without its engines"
                        if reported is None
                        else f"keeping the {reported} engines it last listed"
                    )
                    log.warning(
                        "fleet source %s: %s did not resolve (%s); %s, retrying with backoff",
                        self.name,
                        self.cfg.dns,
                        _describe(e),
                        kept,
                    )
                else:  # the warning above said it once; each retry is only worth a debug line
                    log.debug("fleet source %s: still failing (%s)", self.name, _describe(e))
            else:
                if failures:
                    log.info(
                        "fleet source %s: %s resolves again after %d failed attempts (engines: %d)",
                        self.name,
                        self.cfg.dns,
                        failures,
                        len(found.members),
                    )
                failures = 0
                report(found.members)
                reported = len(found.members)
                delay = self.schedule.after_answer(found.ttl)
            await self._sleep(delay)

    async def resolve(self) -> Resolution:
        """One resolution of the name; raises one of FAILURES when it cannot tell."""
        # Each query has its own lifetime; this bounds the attempt as a whole (the nameservers'
        # own names, then the SRV query and its targets' lookups, which run at once).
        async with asyncio.timeout(3 * self.lifetime_s):
            resolver = await self._resolver()
            if self.cfg.srv:
                return await self._srv(resolver)
            assert self.cfg.port is not None  # config.py: dns without srv requires port
            addresses, ttl = await self._addresses(resolver, self.qname)
            members = {(ip, self.cfg.port) for ip in addresses}
            return Resolution(self._members(members), ttl)

    async def _resolver(self) -> dns.asyncresolver.Resolver:
        if not self.nameservers:
            # The system's: resolv.conf's nameservers (and its timeout options, which the
            # bounds below override); NoResolverConfiguration when it lists none: a failure.
            resolver = dns.asyncresolver.Resolver(configure=True)
        else:
            resolver = dns.asyncresolver.Resolver(configure=False)
            servers: list[str | dns.nameserver.Nameserver] = []
            loop = asyncio.get_running_loop()
            for host, port in self.nameservers:
                if _is_ip(host):
                    servers.append(dns.nameserver.Do53Nameserver(host, port))
                    continue
                # A nameserver given by name (a Service's name): looked up by the system, at
                # every attempt, so the source follows it if it moves.
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
                for info in infos:
                    servers.append(dns.nameserver.Do53Nameserver(str(info[4][0]), port))
            resolver.nameservers = servers
        resolver.lifetime = self.lifetime_s
        resolver.timeout = self.lifetime_s / 3  # so each nameserver can be asked more than once
        resolver.cache = None  # ask the server every time: the TTL is what decides when
        return resolver

    async def _addresses(
        self, resolver: dns.asyncresolver.Resolver, name: dns.name.Name
    ) -> tuple[list[str], float]:
        """Every A and AAAA address of `name`, and the smaller TTL of the two answers. A name
        with only one family answers NoAnswer for the other: that is no failure. Any other
        error for either family is one (it could be hiding half the fleet)."""
        results = await asyncio.gather(
            resolver.resolve(name, dns.rdatatype.A, search=False),
            resolver.resolve(name, dns.rdatatype.AAAA, search=False),
            return_exceptions=True,
        )
        addresses: list[str] = []
        ttls: list[float] = []
        no_answer: BaseException | None = None
        for result in results:
            if isinstance(result, dns.resolver.NoAnswer):
                no_answer = no_answer or result
            elif isinstance(result, BaseException):
                raise result
            else:
                ttls.append(result.chaining_result.minimum_ttl)
                addresses += [_address(rd) for rd in result if isinstance(rd, A | AAAA)]
        if not ttls:
            assert no_answer is not None
            raise no_answer
        return addresses, min(ttls)

    async def _srv(self, resolver: dns.asyncresolver.Resolver) -> Resolution:
        answer = await resolver.resolve(self.qname, dns.rdatatype.SRV, search=False)
        ttl = float(answer.chaining_result.minimum_ttl)
        records = [rd for rd in answer if isinstance(rd, SRV)]
        engines = [rd for rd in records if rd.port and rd.target != dns.name.root]
        if not engines:  # only "." or port 0: the service says it has no engines
            return Resolution([], ttl)
        # Addresses the server sent along (the additional section), by name, with their TTL.
        glue: dict[dns.name.Name, tuple[list[str], float]] = {}
        for rrset in answer.response.additional:
            if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                found, was_ttl = glue.get(rrset.name, ([], float(rrset.ttl)))
                found += [_address(rd) for rd in rrset if isinstance(rd, A | AAAA)]
                glue[rrset.name] = found, min(was_ttl, float(rrset.ttl))
        missing = sorted({rd.target for rd in engines} - glue.keys())
        looked_up = await asyncio.gather(
            *(self._addresses(resolver, target) for target in missing), return_exceptions=True
        )
        for target, result in zip(missing, looked_up, strict=True):
            if isinstance(result, dns.resolver.NXDOMAIN | dns.resolver.NoAnswer):
                # A record left behind by an engine that is gone: that engine is not listed.
                log.debug("fleet source %s: SRV target %s has no address", self.name, target)
            elif isinstance(result, BaseException):
                raise result  # a timeout, a server failure: the whole answer is in doubt
            else:
                glue[target] = result
        members: set[tuple[str, int]] = set()
        for rd in engines:
            if rd.target not in glue or not glue[rd.target][0]:
                continue
            addresses, target_ttl = glue[rd.target]
            ttl = min(ttl, target_ttl)
            first = min(addresses, key=lambda a: _sort_key(a, 0))  # IPv4 first, then lowest
            members.add((first, int(rd.port)))
        if not members:
            raise _NoAddress(f"no SRV target of {self.cfg.dns} has an address")
        return Resolution(self._members(members), ttl)

    def _members(self, found: set[tuple[str, int]]) -> list[Member]:
        # Sorted, so that every replica reports the same list in the same order.
        ordered = sorted(found, key=lambda hp: _sort_key(*hp))
        return [Member(self.cfg.member(host, port)) for host, port in ordered]


def _address(rd: A | AAAA) -> str:
    # The canonical text (compressed IPv6), so one engine always has one key.
    return str(ipaddress.ip_address(rd.address))


def _describe(e: BaseException) -> str:
    text = str(e) or "no answer within the attempt's time bound"
    if len(text) > 300:  # a LifetimeTimeout lists every server's every try
        text = text[:297] + "..."
    return f"{type(e).__name__}: {text}"
