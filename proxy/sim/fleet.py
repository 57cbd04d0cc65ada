"""Several simulated engines served by uvicorn in one process and one event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from types import TracebackType

import uvicorn

from proxy.sim.config import SimConfig
from proxy.sim.server import SimApp, create_sim_app


class SimFleet:
    """N engines on `host`:`ports` (0 picks a free port); `urls` once started.

    async with SimFleet([cfg1, cfg2], "127.0.0.1", [0, 0]) as fleet:
        print(fleet.urls)
    """

    def __init__(
        self,
        cfgs: Sequence[SimConfig],
        host: str = "127.0.0.1",
        ports: Sequence[int] | None = None,
        log_level: str = "warning",
    ) -> None:
        ports = list(ports) if ports is not None else [0] * len(cfgs)
        if len(ports) != len(cfgs):
            raise ValueError(f"{len(cfgs)} engines need {len(cfgs)} ports, got {len(ports)}")
        self.host = host
        self.apps: list[SimApp] = [create_sim_app(c) for c in cfgs]
        self.servers = [
            uvicorn.Server(
                uvicorn.Config(
                    app,
                    host=host,
                    port=port,
                    log_level=log_level,
                    access_log=False,
                    lifespan="on",
                    timeout_graceful_shutdown=1,
                    **app.uvicorn_kwargs(),
                )
            )
            for app, port in zip(self.apps, ports, strict=True)
        ]
        self._tasks: list[asyncio.Task[None]] = []
        self._ports = list(ports)

    @property
    def ports(self) -> list[int]:
        """The ports bound (known once started; 0 asks the OS for a free one)."""
        return list(self._ports)

    @property
    def urls(self) -> list[str]:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return [f"http://{host}:{p}" for p in self.ports]

    async def start(self) -> None:
        """Returns once every engine listens; raises if one could not start (port in use)."""
        for server in self.servers:
            # Not Server.serve(): it swaps process signal handlers, which N servers in one
            # loop would restore in the wrong order. The caller owns signals.
            serve = getattr(server, "_serve", server.serve)
            self._tasks.append(asyncio.create_task(serve()))
        while not all(s.started for s in self.servers):
            for task in self._tasks:
                if task.done():
                    await self.stop()
                    raise RuntimeError("a simulated engine failed to start (port in use?)")
            await asyncio.sleep(0.01)
        self._ports = [int(s.servers[0].sockets[0].getsockname()[1]) for s in self.servers]

    async def stop(self) -> None:
        for server in self.servers:
            server.should_exit = True
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, SystemExit, Exception):
                await task
        self._tasks = []

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def serve(
    cfgs: Sequence[SimConfig],
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    *,
    ready: asyncio.Event | None = None,
    log_level: str = "warning",
) -> None:
    """Run the engines until cancelled; `ready` is set once all of them listen."""
    fleet = SimFleet(cfgs, host, ports, log_level)
    await fleet.start()
    try:
        if ready is not None:
            ready.set()
        await asyncio.Event().wait()
    finally:
        await asyncio.shield(fleet.stop())
