"""The DNS fleet source (proxy/fleet/dns.py) against a real resolver: a private dnsmasq.

dnsmasq (tests/dnsmasq.py) re-reads its hosts directory on change, so engines join and leave
while the source runs; names that stop resolving get real NXDOMAINs, a silent socket a real
timeout. The source's waits go through a recording `sleep` that returns at once: the tests see
the delay each answer asked for (its TTL, clamped) without waiting it out, and wait on the
source's reports and attempts, never on the clock. The arithmetic itself (Schedule) and the
nameserver syntax are tested without DNS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from proxy.config import DiscoveryConfig
from proxy.fleet.dns import RETRY_CAP_S, DnsSource, Schedule, parse_nameserver
from proxy.fleet.members import Member
from tests.dnsmasq import DOMAIN, Dnsmasq, dnsmasq, ipv6_loopback

WITHIN_S = 10.0  # the bound on any wait for a condition: far above what any takes (ms)
e2e = pytest.mark.e2e


# --- the arithmetic and the syntax, no DNS --------------------------------------------------


def test_an_answer_is_asked_again_when_its_ttl_runs_out_within_the_bounds() -> None:
    s = Schedule(min_ttl_s=5.0, max_ttl_s=300.0)
    assert s.after_answer(60) == 60
    assert s.after_answer(0) == 5.0  # "don't cache" is no busy loop
    assert s.after_answer(86_400) == 300.0  # a day-long TTL does not hide a new engine for a day
    assert Schedule(0.05, 0.1).after_answer(1) == 0.1


def test_failures_back_off_from_a_second_to_the_cap_within_the_bounds() -> None:
    defaults = Schedule(5.0, 300.0)
    assert [defaults.after_failure(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert RETRY_CAP_S == 30
    # A small min_ttl_s starts the backoff there, and a small max_ttl_s caps it.
    fast = Schedule(0.05, 0.5)
    assert [fast.after_failure(n) for n in range(1, 7)] == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]
    # A large min_ttl_s raises the cap to it (never faster than a working name is asked)...
    assert Schedule(60.0, 600.0).after_failure(20) == 60.0
    # ... a small max_ttl_s lowers it (never slower than a working name is asked).
    assert Schedule(1.0, 10.0).after_failure(20) == 10.0
    assert Schedule(5.0, 300.0).after_failure(10_000) == 30  # no overflow


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("10.0.0.2", ("10.0.0.2", 53)),
        ("10.0.0.2:5353", ("10.0.0.2", 5353)),
        ("kube-dns.kube-system", ("kube-dns.kube-system", 53)),
        ("dns.local:5353", ("dns.local", 5353)),
        ("::1", ("::1", 53)),
        ("fd00::53", ("fd00::53", 53)),
        ("[::1]:5353", ("::1", 5353)),
        ("[fd00::53]", ("fd00::53", 53)),
    ],
)
def test_nameservers_are_host_or_host_port(text: str, parsed: tuple[str, int]) -> None:
    assert parse_nameserver(text) == parsed


@pytest.mark.parametrize("text", ["", ":53", "h:", "h:0", "h:65536", "h:dns", "[::1", "[::1]53"])
def test_a_malformed_nameserver_is_an_error_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match="nameserver"):
        parse_nameserver(text)


def test_a_source_is_named_after_its_name_and_needs_one() -> None:
    cfg = DiscoveryConfig(dns="vllm.fleet.test", port=8000)
    assert DnsSource(cfg).name == "dns:vllm.fleet.test"
    with pytest.raises(ValueError, match="nameserver"):
        DnsSource(cfg, ["10.0.0.1:x"])


# --- through dnsmasq ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dnsmasq]:
    """One dnsmasq for the module (each test its own names, in its own hosts file); on ::1 too
    where this machine has IPv6 loopback."""
    with dnsmasq(tmp_path_factory.mktemp("dnsmasq"), ipv6=ipv6_loopback()) as d:
        yield d


class Watch:
    """Runs a source; keeps each report (as backend keys) and each wait it asked for."""

    def __init__(self) -> None:
        self.reports: list[list[str]] = []
        self.delays: list[float] = []
        self.events: list[str] = []  # "report" / "sleep", in order
        self.task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    def report(self, members: Sequence[Member]) -> None:
        self.reports.append([m.key for m in members])
        self.events.append("report")
        self._changed.set()

    async def sleep(self, seconds: float) -> None:
        self.delays.append(seconds)
        self.events.append("sleep")
        self._changed.set()
        await asyncio.sleep(0.01)  # the next attempt, soon: the delay itself is asserted on

    @property
    def failures(self) -> int:
        """Attempts that ended in a wait with no report before it."""
        return sum(
            1
            for i, e in enumerate(self.events)
            if e == "sleep" and (i == 0 or self.events[i - 1] == "sleep")
        )

    @property
    def last(self) -> list[str]:
        return self.reports[-1] if self.reports else []

    async def until(self, predicate: Callable[[], bool], what: str) -> None:
        try:
            async with asyncio.timeout(WITHIN_S):
                while not predicate():
                    assert self.task is not None and not self.task.done(), self.task
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(
                f"{what}: not within {WITHIN_S} s; reports {self.reports}"
            ) from None


@contextlib.asynccontextmanager
async def watching(
    cfg: DiscoveryConfig, nameservers: Sequence[str], *, real_sleep: bool = False, **kw: Any
) -> AsyncIterator[Watch]:
    watch = Watch()
    if not real_sleep:
        kw["sleep"] = watch.sleep
    source = DnsSource(cfg, nameservers, **kw)
    watch.task = asyncio.create_task(source.run(watch.report))
    try:
        yield watch
    finally:
        watch.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            async with asyncio.timeout(WITHIN_S):  # cancellable at once, even mid-query
                await watch.task


def a_records(name: str, cfg: dict[str, Any] | None = None) -> DiscoveryConfig:
    return DiscoveryConfig.model_validate(
        {"dns": name, "port": 8000, "min_ttl_s": 0.05, "max_ttl_s": 10.0, **(cfg or {})}
    )


def fleet_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "warmroute.fleet" and r.levelno == level
    ]


@e2e
async def test_every_address_is_an_engine_and_engines_join_and_leave(server: Dnsmasq) -> None:
    name = f"grow.{DOMAIN}"
    server.hosts("grow", [("127.0.0.9", name), ("127.0.0.2", name)])
    async with watching(a_records(name, {"role": "decode"}), [server.nameserver]) as w:
        await w.until(lambda: bool(w.reports), "a first report")
        assert w.last == ["127.0.0.2:8000", "127.0.0.9:8000"]  # sorted, as on every replica
        server.hosts("grow", [("127.0.0.9", name), ("127.0.0.2", name), ("127.0.0.10", name)])
        await w.until(lambda: "127.0.0.10:8000" in w.last, "a new engine in the report")
        assert w.last == ["127.0.0.2:8000", "127.0.0.9:8000", "127.0.0.10:8000"]  # by address
        server.hosts("grow", [("127.0.0.10", name)])
        await w.until(lambda: w.last == ["127.0.0.10:8000"], "two engines gone from it")
    assert all(r for r in w.reports)  # never an empty report on the way


@e2e
async def test_members_carry_the_entrys_keys_at_the_address_found(server: Dnsmasq) -> None:
    name = f"keys.{DOMAIN}"
    server.hosts("keys", [("127.0.0.3", name)])
    cfg = a_records(name, {"role": "prefill", "engine": "vllm", "weight": 2.5, "scheme": "https"})
    found = await DnsSource(cfg, [server.nameserver]).resolve()
    [member] = found.members
    assert member.cfg.url == "https://127.0.0.3:8000"
    assert (member.cfg.role, member.cfg.engine, member.cfg.weight) == ("prefill", "vllm", 2.5)
    assert member.serving and found.ttl == 1  # dnsmasq's --local-ttl


@e2e
async def test_aaaa_records_are_engines_too(server: Dnsmasq) -> None:
    name = f"dual.{DOMAIN}"
    server.hosts("dual", [("::1", name), ("127.0.0.4", name), ("fd00::0:7", name)])
    async with watching(a_records(name), [server.nameserver]) as w:
        await w.until(lambda: bool(w.reports), "a first report")
    assert w.last == ["127.0.0.4:8000", "::1:8000", "fd00::7:8000"]  # IPv4 first, canonical


@e2e
async def test_an_ipv6_nameserver_is_asked(server: Dnsmasq) -> None:
    if "::1" not in server.listen:
        pytest.skip("no IPv6 loopback here (::1 cannot be bound)")
    name = f"six.{DOMAIN}"
    server.hosts("six", [("127.0.0.5", name)])
    async with watching(a_records(name), [server.nameserver6]) as w:
        await w.until(lambda: bool(w.reports), "a report through [::1]")
    assert w.last == ["127.0.0.5:8000"]


@e2e
async def test_a_name_that_stops_resolving_keeps_the_fleet_and_says_so_once(
    server: Dnsmasq, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="warmroute.fleet")
    name = f"gone.{DOMAIN}"
    server.hosts("gone", [("127.0.0.6", name), ("127.0.0.7", name)])
    async with watching(a_records(name), [server.nameserver]) as w:
        await w.until(lambda: bool(w.reports), "a first report")
        server.drop("gone")
        await w.until(lambda: w.failures >= 1, "a failed attempt")
        reported = len(w.reports)
        failed = w.failures
        await w.until(lambda: w.failures >= failed + 3, "three more failed attempts")
        assert len(w.reports) == reported  # nothing reported: the fleet keeps its two engines
        assert w.last == ["127.0.0.6:8000", "127.0.0.7:8000"]
        [warning] = fleet_lines(caplog, logging.WARNING)  # one line, not one per retry
        assert name in warning and "NXDOMAIN" in warning and "keeping the 2 engines" in warning
        assert fleet_lines(caplog, logging.INFO) == []
        # The retries back off: each failed attempt's wait at least the one before.
        retries = w.delays[-w.failures :]
        assert retries == sorted(retries) and retries[0] == 0.05  # starts at min_ttl_s here

        server.hosts("gone", [("127.0.0.7", name)])
        await w.until(lambda: len(w.reports) > reported, "a report once it resolves again")
        assert w.last == ["127.0.0.7:8000"]
        [recovered] = fleet_lines(caplog, logging.INFO)
        assert name in recovered and "resolves again" in recovered and "(engines: 1)" in recovered
        assert len(fleet_lines(caplog, logging.WARNING)) == 1


@e2e
async def test_a_name_that_never_resolved_starts_empty_then_joins(
    server: Dnsmasq, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="warmroute.fleet")
    name = f"late.{DOMAIN}"
    server.drop("late")
    async with watching(a_records(name), [server.nameserver]) as w:
        await w.until(lambda: w.failures >= 2, "two failed attempts")
        assert w.reports == []  # nothing: not even an empty set
        [warning] = fleet_lines(caplog, logging.WARNING)
        assert name in warning and "starts without its engines" in warning
        server.hosts("late", [("127.0.0.8", name)])
        await w.until(lambda: bool(w.reports), "a report once it resolves")
    assert w.reports[0] == ["127.0.0.8:8000"]
    assert len(fleet_lines(caplog, logging.INFO)) == 1


@e2e
async def test_a_refusing_server_is_a_failure(
    server: Dnsmasq, caplog: pytest.LogCaptureFixture
) -> None:
    name = "elsewhere.example.test"  # outside dnsmasq's domain, and it has no upstream: REFUSED
    async with watching(a_records(name), [server.nameserver]) as w:
        await w.until(lambda: w.failures >= 2, "two failed attempts")
    assert w.reports == []
    [warning] = fleet_lines(caplog, logging.WARNING)
    assert name in warning and "REFUSED" in warning


@e2e
async def test_a_nameserver_that_never_answers_costs_the_lifetime_not_the_task(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))  # receives every query, answers none
        port = silent.getsockname()[1]
        cfg = a_records(f"silent.{DOMAIN}")
        async with watching(cfg, [f"127.0.0.1:{port}"], lifetime_s=0.1) as w:
            await w.until(lambda: w.failures >= 2, "two timed-out attempts")
    assert w.reports == []
    [warning] = fleet_lines(caplog, logging.WARNING)
    assert "Timeout" in warning and "silent.fleet.test" in warning


@e2e
async def test_the_ttl_decides_when_to_ask_again_within_the_bounds(server: Dnsmasq) -> None:
    name = f"ttl.{DOMAIN}"
    server.hosts("ttl", [("127.0.0.11", name)])
    # dnsmasq's TTL is 1 s: kept within (0.05, 10), lowered to 0.1, raised to 2.
    for (low, high), wait in [((0.05, 10.0), 1.0), ((0.05, 0.1), 0.1), ((2.0, 10.0), 2.0)]:
        cfg = a_records(name, {"min_ttl_s": low, "max_ttl_s": high})
        async with watching(cfg, [server.nameserver]) as w:
            await w.until(lambda w=w: len(w.reports) >= 2, "two reports")
        assert w.failures == 0 and set(w.delays) == {wait}, (low, high, w.delays)


@e2e
async def test_a_one_second_ttl_clamped_small_is_really_asked_again(server: Dnsmasq) -> None:
    name = f"often.{DOMAIN}"
    server.hosts("often", [("127.0.0.12", name)])
    cfg = a_records(name, {"min_ttl_s": 0.02, "max_ttl_s": 0.05})
    async with watching(cfg, [server.nameserver], real_sleep=True) as w:  # asyncio.sleep
        await w.until(lambda: len(w.reports) >= 3, "three reports of a 1 s TTL clamped to 50 ms")
        server.hosts("often", [("127.0.0.13", name)])
        await w.until(lambda: w.last == ["127.0.0.13:8000"], "the change, without waiting 1 s")


# --- SRV ------------------------------------------------------------------------------------


def srv_records(name: str, **cfg: Any) -> DiscoveryConfig:
    return DiscoveryConfig.model_validate(
        {"dns": name, "srv": True, "min_ttl_s": 0.05, "max_ttl_s": 10.0, **cfg}
    )


@pytest.fixture
def srv_server(tmp_path: Path) -> Iterator[Dnsmasq]:
    """A dnsmasq of the test's own: SRV records change by restarting it (same port)."""
    with dnsmasq(tmp_path) as d:
        d.hosts(
            "targets",
            [
                ("127.0.0.21", f"e1.{DOMAIN}"),
                ("127.0.0.22", f"e2.{DOMAIN}"),
                ("127.0.0.29", f"e2.{DOMAIN}"),  # two addresses: still one engine (the lowest)
                ("::1", f"e3.{DOMAIN}"),  # IPv6 only
            ],
        )
        yield d


SRV = f"_engines._tcp.{DOMAIN}"


@e2e
async def test_every_srv_record_is_an_engine_at_its_port(srv_server: Dnsmasq) -> None:
    srv_server.start(
        [
            f"{SRV},e1.{DOMAIN},8001,0,10",
            f"{SRV},e1.{DOMAIN},8011,0,10",  # a second engine on the same host
            f"{SRV},e2.{DOMAIN},8002,1,90",
            f"{SRV},e3.{DOMAIN},8003",
            f"{SRV},stale.{DOMAIN},8004",  # a target that does not resolve: skipped
        ]
    )
    source = DnsSource(srv_records(SRV, weight=3.0), [srv_server.nameserver])
    found = await source.resolve()
    assert [m.key for m in found.members] == [
        "127.0.0.21:8001",
        "127.0.0.21:8011",
        "127.0.0.22:8002",
        "::1:8003",
    ]
    # Priority and weight are not used: every record is a member with the entry's weight.
    assert {m.cfg.weight for m in found.members} == {3.0}
    assert found.ttl == 1


@e2e
async def test_srv_records_join_and_leave(srv_server: Dnsmasq) -> None:
    srv_server.start([f"{SRV},e1.{DOMAIN},8001"])
    async with watching(srv_records(SRV), [srv_server.nameserver], lifetime_s=0.3) as w:
        await w.until(lambda: bool(w.reports), "a first report")
        assert w.last == ["127.0.0.21:8001"]
        srv_server.start([f"{SRV},e1.{DOMAIN},8001", f"{SRV},e2.{DOMAIN},8002"])
        await w.until(lambda: len(w.last) == 2, "the new record's engine")
        assert w.last == ["127.0.0.21:8001", "127.0.0.22:8002"]
        srv_server.start([f"{SRV},e2.{DOMAIN},8002"])
        await w.until(lambda: w.last == ["127.0.0.22:8002"], "the removed record's engine gone")


@e2e
async def test_a_srv_target_without_glue_is_looked_up(srv_server: Dnsmasq) -> None:
    # A target that is an alias: dnsmasq sends the CNAME along but no address under the
    # target's own name, so the source asks for the target's A/AAAA itself.
    srv_server.start([f"{SRV},alias.{DOMAIN},8005"], extra=[f"--cname=alias.{DOMAIN},e1.{DOMAIN}"])
    found = await DnsSource(srv_records(SRV), [srv_server.nameserver]).resolve()
    assert [m.key for m in found.members] == ["127.0.0.21:8005"]


@e2e
async def test_srv_records_whose_targets_all_fail_keep_the_fleet(
    srv_server: Dnsmasq, caplog: pytest.LogCaptureFixture
) -> None:
    srv_server.start([f"{SRV},e1.{DOMAIN},8001"])
    async with watching(srv_records(SRV), [srv_server.nameserver], lifetime_s=0.3) as w:
        await w.until(lambda: bool(w.reports), "a first report")
        srv_server.drop("targets")  # the SRV record stays, its target's address goes
        await w.until(lambda: w.failures >= 2, "two failed attempts")
        assert w.reports[-1] == ["127.0.0.21:8001"]
    [warning] = fleet_lines(caplog, logging.WARNING)
    assert "no SRV target" in warning and SRV in warning


@e2e
async def test_a_srv_name_that_is_gone_keeps_the_fleet(
    srv_server: Dnsmasq, caplog: pytest.LogCaptureFixture
) -> None:
    srv_server.start([f"{SRV},e1.{DOMAIN},8001"])
    async with watching(srv_records(SRV), [srv_server.nameserver], lifetime_s=0.3) as w:
        await w.until(lambda: bool(w.reports), "a first report")
        srv_server.start([])  # no SRV record at all now: NXDOMAIN
        await w.until(lambda: w.failures >= 2, "two failed attempts")
        assert w.last == ["127.0.0.21:8001"]
    [warning] = fleet_lines(caplog, logging.WARNING)
    assert SRV in warning


@e2e
async def test_a_nameserver_given_by_name_is_looked_up(server: Dnsmasq) -> None:
    name = f"byname.{DOMAIN}"
    server.hosts("byname", [("127.0.0.14", name)])
    found = await DnsSource(a_records(name), [f"localhost:{server.port}"]).resolve()
    assert [m.key for m in found.members] == ["127.0.0.14:8000"]
