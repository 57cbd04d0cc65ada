"""A private dnsmasq on loopback, for tests of the DNS fleet source (proxy/fleet/dns.py).

It answers for DOMAIN only (--local: any other name in it is NXDOMAIN, names outside it are
REFUSED: it has no upstream), from hosts files in its own directory, which it watches with
inotify (--hostsdir): writing or deleting a file there changes its answers at once, no restart,
no signal. Records carry a TTL of 1 s (--local-ttl). SRV records come from its command line
(--srv-host), so changing them takes a restart (same port). It never reads the system's files
(--conf-file=/dev/null, --no-resolv, --no-hosts) and binds only the loopback addresses asked.

The Debian package is dnsmasq-base (the binary only, no service); .ci/run installs it. Outside CI
a missing binary skips the tests that need it; in CI (CI set) it fails them.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shutil
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import dns.exception
import dns.message
import dns.query
import pytest

from tests.support import free_port

DOMAIN = "fleet.test"
READY = f"ready.{DOMAIN}"  # always present: the instance is up once it answers for it


def binary() -> str:
    """The dnsmasq binary, or skip (fail in CI) saying how to install it."""
    found = shutil.which("dnsmasq") or (
        "/usr/sbin/dnsmasq" if os.access("/usr/sbin/dnsmasq", os.X_OK) else None
    )
    if found:
        return found
    why = "the `dnsmasq` binary is not installed (apt-get install dnsmasq-base)"
    if os.environ.get("CI"):
        pytest.fail(f"{why}; .ci/run should have installed it")
    pytest.skip(why)


def ipv6_loopback() -> bool:
    """Whether ::1 can be bound here (some containers have no IPv6 at all)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


class Dnsmasq:
    """One dnsmasq process; `nameserver` is its address as fleet.nameservers writes it."""

    def __init__(self, workdir: Path, *, ipv6: bool = False) -> None:
        self.binary = binary()
        self.workdir = workdir
        self.hostsdir = workdir / "hosts"
        self.hostsdir.mkdir(parents=True, exist_ok=True)
        self.listen = ["127.0.0.1", "::1"] if ipv6 else ["127.0.0.1"]
        self.log = workdir / "dnsmasq.log"
        self.port = 0
        self.srv: list[str] = []
        self.extra: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.hosts("ready", [("127.0.0.1", READY)])

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def nameserver6(self) -> str:
        return f"[::1]:{self.port}"

    def hosts(self, file: str, entries: Iterable[tuple[str, str]]) -> None:
        """Make file `file` of the hosts directory hold exactly these (address, name) lines.
        Written beside the directory, then renamed into it: dnsmasq sees one complete file."""
        staged = self.workdir / f"{file}.staged"
        staged.write_text("".join(f"{ip} {name}\n" for ip, name in entries))
        os.replace(staged, self.hostsdir / file)

    def drop(self, file: str) -> None:
        """Delete a hosts file: its names stop resolving (NXDOMAIN)."""
        (self.hostsdir / file).unlink(missing_ok=True)

    def start(self, srv: Sequence[str] = (), extra: Sequence[str] = ()) -> Dnsmasq:
        """Start (or restart, on the same port), with these --srv-host values and any other
        options (`extra`, e.g. --cname=alias,target)."""
        self.stop()
        self.srv = list(srv)
        self.extra = list(extra)
        for _ in range(3):  # a port taken between free_port() and dnsmasq's bind: another
            self.port = self.port or free_port()
            with self.log.open("ab") as log:
                self.proc = subprocess.Popen(self._args(), stdout=subprocess.DEVNULL, stderr=log)
            if self._ready():
                return self
            self.stop()
            self.port = 0
        raise AssertionError(f"dnsmasq did not start: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def _args(self) -> list[str]:
        # As root, dnsmasq would drop to an unprivileged user that cannot read pytest's
        # tmp_path (mode 0700); as anyone else it changes no user. Either way: stay who we are.
        user = pwd.getpwuid(os.getuid()).pw_name
        group = grp.getgrgid(os.getgid()).gr_name
        return [
            self.binary,
            "--no-daemon",
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            f"--pid-file={self.workdir / 'dnsmasq.pid'}",
            f"--user={user}",
            f"--group={group}",
            "--no-resolv",
            "--no-hosts",
            "--bind-interfaces",
            *(f"--listen-address={a}" for a in self.listen),
            f"--port={self.port}",
            f"--hostsdir={self.hostsdir}",
            "--local-ttl=1",
            f"--local=/{DOMAIN}/",
            "--log-facility=-",
            *(f"--srv-host={s}" for s in self.srv),
            *self.extra,
        ]

    def _ready(self, within_s: float = 10.0) -> bool:
        """Up once it answers for READY (UDP: nothing to wait on but its answer; each query
        waits up to 50 ms for it); False when the process exited (its port was taken)."""
        query = dns.message.make_query(READY, "A")
        deadline = time.monotonic() + within_s
        while self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(dns.exception.DNSException, OSError):
                reply = dns.query.udp(query, "127.0.0.1", timeout=0.05, port=self.port)
                if reply.answer:
                    return True
            if time.monotonic() > deadline:
                raise AssertionError(f"dnsmasq not answering: {self.log.read_text()[-2000:]}")
        return False


@contextlib.contextmanager
def dnsmasq(workdir: Path, *, ipv6: bool = False, srv: Sequence[str] = ()) -> Iterator[Dnsmasq]:
    server = Dnsmasq(workdir, ipv6=ipv6).start(srv)
    try:
        yield server
    finally:
        server.stop()
