"""Redis for routing tests: the shared server (unique key prefix per test) and private servers.

Private servers (started here on a free port) are the ones a test may kill, pause, restart or
turn into a one-node cluster or a Sentinel setup; the shared server on 6379 is never disturbed.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import redis

from tests.support import free_port

SHARED_URL = "redis://127.0.0.1:6379/0"
HAVE_REDIS_SERVER = shutil.which("redis-server") is not None


def unique_prefix(tag: str = "t") -> str:
    return f"wrtest-{tag}-{uuid.uuid4().hex[:10]}"


def delete_prefix(prefix: str, url: str = SHARED_URL) -> None:
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


class RedisProcess:
    """A private redis-server on a free port that a test may stop and start again."""

    def __init__(self, workdir: Path, *extra: str, config_file: Path | None = None) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.extra = extra
        self.config_file = config_file  # Sentinel insists on a config file, first on the line
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def sentinel(cls, workdir: Path, master_port: int, service: str) -> RedisProcess:
        conf = workdir / "sentinel.conf"
        conf.write_text(f"sentinel monitor {service} 127.0.0.1 {master_port} 1\n")
        return cls(workdir, "--sentinel", config_file=conf)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        args = ["redis-server"] + ([str(self.config_file)] if self.config_file else [])
        args += ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir)]
        if not self.config_file:
            args += ["--save", "", "--appendonly", "no"]
        args += self.extra
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on {self.port} did not start") from None
                time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


async def until(predicate: Callable[[], bool], within_s: float = 5.0) -> None:
    """Wait for a condition that no event announces (e.g. another process's state)."""
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.01)
