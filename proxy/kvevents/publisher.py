"""A KV event publisher that speaks vLLM's protocol: PUB for live batches, ROUTER for replay.

Each `publish` is one message with the next sequence number, also kept in a bounded buffer;
a subscriber that saw a gap asks the replay socket for everything from a sequence number on
(wire.py has the frames). `warmroute sim --kv-events-endpoint` publishes through this.

Unlike vLLM, which connects rather than binds to an endpoint without a wildcard, this
publisher always binds: it is the engine side, and subscribers come and go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import zmq
import zmq.asyncio

from proxy.kvevents import wire

log = logging.getLogger("warmroute.kvevents")

DEFAULT_BUFFER_STEPS = 10_000  # vLLM's default replay buffer, in batches
DEFAULT_HWM = 100_000  # vLLM's default PUB high-water mark, in messages


class KvEventPublisher:
    """Publishes `KVEvent` batches on `endpoint` (and serves replays on `replay_endpoint`).

    async with KvEventPublisher("tcp://127.0.0.1:5557", replay_endpoint=...) as pub:
        pub.publish([BlockStored(...)])
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        hwm: int = DEFAULT_HWM,
        layout: wire.Layout = wire.Layout.MAP,
        data_parallel_rank: int | None = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError("buffer_steps must be >= 1")
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.layout = layout
        self.data_parallel_rank = data_parallel_rank
        self.clock = clock
        self._hwm = hwm
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next = 0
        self._ctx: zmq.Context[Any] | None = None
        self._pub: zmq.Socket[Any] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.replays_served = 0

    @property
    def endpoint(self) -> str:
        """The bound endpoint (a port of 0 is resolved once started)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._replay_endpoint

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry (batches published so far)."""
        return self._next

    async def start(self) -> None:
        """Bind both sockets; raises zmq.ZMQError naming the endpoint if one is taken."""
        ctx: zmq.Context[Any] = zmq.Context()
        self._ctx = ctx
        try:
            self._pub = ctx.socket(zmq.PUB)
            self._pub.set_hwm(self._hwm)
            self._endpoint = _bind(self._pub, self._endpoint)
            if self._replay_endpoint is not None:
                router = zmq.asyncio.Context.shadow(ctx.underlying).socket(zmq.ROUTER)
                self._router = router
                # Room for a whole replay and its end marker, as vLLM sizes it.
                router.setsockopt(zmq.SNDHWM, 2 * (self._buffer.maxlen or 0) + 2)
                self._replay_endpoint = _bind(router, self._replay_endpoint)
                self._task = asyncio.create_task(self._serve_replays(), name="kv-events-replay")
        except BaseException:
            await self.close()
            raise

    def publish(self, events: Sequence[wire.KVEvent], ts: float | None = None) -> int:
        """Send one batch now (never blocks; a subscriber past the HWM loses it). Its seq."""
        if self._pub is None:
            raise RuntimeError("the KV event publisher is not started")
        batch = wire.EventBatch(
            self.clock() if ts is None else ts, list(events), self.data_parallel_rank
        )
        payload = wire.encode_batch(batch, self.layout)
        seq = self._next
        self._next += 1
        self._buffer.append((seq, payload))
        self._pub.send_multipart(wire.live_frames(self.topic, seq, payload), flags=zmq.NOBLOCK)
        return seq

    async def _serve_replays(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                log.warning("ignoring a replay request of %d frames (want 3)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            # A snapshot: publishing goes on while the replay is sent.
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    reply = wire.replay_reply(self.topic, seq, payload)
                    await router.send_multipart([client, *reply])
            await router.send_multipart([client, *wire.replay_end()])
            self.replays_served += 1

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def stats(self) -> dict[str, Any]:
        return {
            "endpoint": self._endpoint,
            "replay_endpoint": self._replay_endpoint,
            "topic": self.topic.decode(),
            "next_seq": self._next,
            "buffered": len(self._buffer),
            "replays_served": self.replays_served,
        }

    async def __aenter__(self) -> KvEventPublisher:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


def offset_endpoint(endpoint: str | None, offset: int) -> str | None:
    """`endpoint` with its TCP port moved up by `offset` (port 0 stays 0: the OS picks).

    How `--instances N` gives each simulated engine its own sockets, as vLLM offsets its
    endpoints by the data-parallel rank."""
    if endpoint is None or offset == 0:
        return endpoint
    base, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        raise ValueError(f"{endpoint!r}: several engines need tcp://HOST:PORT endpoints")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + offset}"


def _bind(sock: zmq.Socket[Any], endpoint: str) -> str:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise zmq.ZMQError(e.errno, f"cannot bind KV events to {endpoint}: {e.strerror}") from None
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else str(bound)
