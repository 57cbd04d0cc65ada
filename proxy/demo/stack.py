"""Start and stop a local stack (simulated engines, proxies) as child processes.

Used by `warmroute demo` and benchmarks. Every child runs in its own process group and is
killed on exit, error or Ctrl-C, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import IO

import httpx


class StackError(RuntimeError):
    pass


def free_ports(n: int) -> list[int]:
    """n free consecutive loopback ports (sim --instances needs that), from a random base so
    that concurrent runs on one machine do not race for the same ones, and below the kernel's
    ephemeral range where it can: a port found free there can be handed to some process's
    outgoing connection before the child binds it."""
    import random
    import socket

    low, high = 20000, _ephemeral_start()
    if high - low < 10 * n:
        high = 60000
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high - n)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return [base + i for i in range(n)]
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise StackError(f"no {n} consecutive free ports on 127.0.0.1")


def _ephemeral_start(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port the kernel hands out for outgoing connections (32768 on Linux)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class Stack:
    """Child processes owned by one `with` block."""

    def __init__(self, log_dir: str | None = None) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.log_dir = log_dir

    def __enter__(self) -> Stack:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()

    def spawn(
        self,
        name: str,
        args: Sequence[str],
        *,
        module: str = "proxy",
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """`python -m module args` (`warmroute args` by default); `env` replaces the
        environment. Another checkout's proxy runs in that checkout (`cwd`): `-m` puts the
        working directory before PYTHONPATH, so a tree there would win."""
        out: int | IO[bytes] = subprocess.DEVNULL
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}.log"), "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env=env,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: we can kill its whole tree
        )
        self.procs.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen[bytes], grace: float = 3.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = [(n, p) for n, p in self.procs if p is not proc]

    def stop_all(self) -> None:
        for _, proc in reversed(list(self.procs)):
            self.stop(proc)

    @staticmethod
    def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
        """Wait until GET url answers 200, or fail if the process died first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StackError(f"process for {url} exited with status {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=1.0).status_code == 200:
                    return
            time.sleep(0.1)
        raise StackError(f"{url} did not become ready within {timeout:.0f}s")

    def sims(self, n: int, extra: Sequence[str] = ()) -> list[str]:
        ports = free_ports(n)
        proc = self.spawn(
            "sim",
            [
                "sim",
                "--port",
                str(ports[0]),
                "--instances",
                str(n),
                "--log-level",
                "warning",
                *extra,
            ],
        )
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for u in urls:
            self.wait_http(u + "/health", proc)
        return urls

    def proxy(self, backends: Sequence[str], extra: Sequence[str] = ()) -> str:
        [port] = free_ports(1)
        args = ["serve", "--port", str(port), "--log-level", "warning"]
        for b in backends:
            args += ["--backend", b]
        proc = self.spawn(f"proxy-{port}", [*args, *extra])
        url = f"http://127.0.0.1:{port}"
        self.wait_http(url + "/ready", proc)
        return url
