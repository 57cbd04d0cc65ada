"""Listens to one engine's KV events and keeps a view of its cache up to date (asyncio).

The I/O edge of the KV event path: a SUB socket on the engine's endpoint (and a DEALER on its
replay endpoint, if it has one) feeding decoded batches to a pure sink such as `KvCacheView`.
Sequence numbers make a lost message visible, and the subscriber repairs it:

- a gap (seq jumps past last + 1): ask the replay socket for everything from last + 1 and apply
  the missing batches in order before the one that revealed the gap;
- the first message, or a restart (the sink is cleared): ask for everything from 0, so a
  subscriber that joins late still learns what the engine stored before it listened. A
  restart shows as a sequence number not above the last one, or, when the new engine has
  already counted past it, as a replay whose copy of the last batch applied differs;
- what the replay cannot supply (no replay socket, batches already out of the buffer) leaves
  the view `exact = False` until the engine says AllBlocksCleared or a catch-up from 0 works.

"Silent" means nothing arrived for `silent_after_s`. An idle engine is silent too (engines
publish only when their cache changes), so silence alone is no verdict: pair it with a
failed health check before dropping a view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Protocol

import zmq
import zmq.asyncio

from proxy.kvevents import wire

log = logging.getLogger("warmroute.kvevents")


class EventSink(Protocol):
    """Where decoded events go (`KvCacheView` is one)."""

    def apply(self, events: Iterable[wire.KVEvent]) -> None: ...

    def clear(self) -> None: ...


class KvEventSubscriber:
    """Subscribes to `endpoint` and applies every batch to `sink`, in sequence order.

    async with KvEventSubscriber("tcp://127.0.0.1:5557", view, replay_endpoint=...) as sub:
        async with asyncio.timeout(5):
            await sub.wait_until(lambda: sub.last_seq == 41)
    """

    def __init__(
        self,
        endpoint: str,
        sink: EventSink,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        silent_after_s: float = 10.0,
        replay_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if silent_after_s <= 0 or replay_timeout_s <= 0:
            raise ValueError("silent_after_s and replay_timeout_s must be positive")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.sink = sink
        self.topic = topic.encode()
        self.silent_after_s = silent_after_s
        self.replay_timeout_s = replay_timeout_s
        self.clock = clock
        self.last_seq: int | None = None
        self.exact = False  # the sink holds everything the engine published since a clean start
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "messages",  # batches applied (live and replayed)
                "events",  # events applied
                "skipped_events",  # unknown or malformed events left out of a batch
                "undecodable",  # messages that were not a KV event batch at all
                "gaps",  # live messages that came after a missing one
                "replays",  # replay requests sent
                "replayed",  # batches applied from a replay
                "unrepaired",  # gaps (or catch-ups) the replay could not fill completely
                "replay_timeouts",
                "restarts",  # the sequence began again: the engine restarted
                "silences",  # times the publisher went quiet for silent_after_s
            ),
            0,
        )
        self._last_digest: int | None = None  # of the last payload applied
        self._last_heard = clock()
        self._silent = False
        self._changed = asyncio.Condition()
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sub.connect(self.endpoint)
        if self.replay_endpoint is not None:
            self._dealer = self._new_dealer()
        self._last_heard = self.clock()
        self._task = asyncio.create_task(self._run(), name=f"kv-events {self.endpoint}")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> KvEventSubscriber:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # --- state ----------------------------------------------------------------------------
    @property
    def silent(self) -> bool:
        """Nothing arrived for `silent_after_s` (an idle engine is silent too)."""
        return self.clock() - self._last_heard >= self.silent_after_s

    def stats(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "last_seq": self.last_seq,
            "exact": self.exact,
            "silent": self.silent,
            **self.counts,
        }

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds, checked after every message and state change.

        Bound it with `asyncio.timeout(...)`: an engine that never publishes never wakes it."""
        async with self._changed:
            await self._changed.wait_for(predicate)

    # --- the loop -------------------------------------------------------------------------
    async def _run(self) -> None:
        sub = self._sub
        assert sub is not None
        while True:
            wait_s = self._last_heard + self.silent_after_s - self.clock()
            if self._silent or wait_s <= 0:
                wait_s = self.silent_after_s
            if not await sub.poll(max(1, round(wait_s * 1000))):
                if self.silent and not self._silent:
                    self._silent = True
                    self.counts["silences"] += 1
                    log.warning(
                        "KV events from %s: silent for %gs", self.endpoint, self.silent_after_s
                    )
                    await self._notify()
                continue
            frames = await sub.recv_multipart()
            self._last_heard = self.clock()
            if self._silent:
                self._silent = False
                log.info("KV events from %s: publishing again", self.endpoint)
            try:
                await self.on_frames(frames)
            except Exception:
                log.exception("KV events from %s: a message could not be applied", self.endpoint)
                self.exact = False
            await self._notify()

    async def on_frames(self, frames: Sequence[bytes]) -> None:
        """Handle one live message (its frames as received)."""
        try:
            msg = wire.parse_live(frames)
        except wire.WireError as e:
            self.counts["undecodable"] += 1
            log.warning("KV events from %s: %s", self.endpoint, e)
            return
        if self.topic and msg.topic != self.topic:
            return  # a longer topic that only shares our prefix
        if self.last_seq is not None:
            if msg.seq <= self.last_seq:
                self._restarted(msg.seq)
            elif msg.seq > self.last_seq + 1:
                self.counts["gaps"] += 1
                filled = await self._fill(self.last_seq + 1, msg.seq)
                if filled is None:
                    self._restarted(msg.seq)
                elif not filled:
                    self.exact = False
        if self.last_seq is None:
            self.exact = msg.seq == 0 or await self._fill(0, msg.seq) is True
        self._apply(msg.seq, msg.payload)

    def _restarted(self, seq: int) -> None:
        self.counts["restarts"] += 1
        log.warning(
            "KV events from %s: batch %d after %s, the engine restarted", self.endpoint, seq,
            self.last_seq,
        )  # fmt: skip
        self.sink.clear()
        self.last_seq = None

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self._last_digest = hash(payload)
        self.counts["messages"] += 1
        try:
            batch = wire.decode_batch(payload)
        except wire.WireError as e:
            self.counts["undecodable"] += 1
            self.exact = False
            log.warning("KV events from %s: batch %d skipped: %s", self.endpoint, seq, e)
            return
        self.counts["skipped_events"] += batch.skipped
        self.counts["events"] += len(batch.events)
        self.sink.apply(batch.events)
        if any(isinstance(e, wire.AllBlocksCleared) for e in batch.events):
            self.exact = True  # everything from here on is known

    async def _fill(self, start: int, upto: int) -> bool | None:
        """Apply the batches start..upto-1 from the replay socket; True if none was missing.

        After a gap the replay starts one batch early: if the publisher's copy of the last
        batch applied differs, it is another engine that counted past us (None)."""
        check = start > 0 and self._last_digest is not None
        items = await self._replay(start - 1 if check else start)
        if check and items and items[0].seq == start - 1:
            if hash(items[0].payload) != self._last_digest:
                return None
            items = items[1:]
        expected, missing = start, False
        for item in items:
            if item.seq >= upto:
                break
            if item.seq < expected:
                continue
            missing |= item.seq > expected  # out of the buffer already: apply the rest anyway
            self._apply(item.seq, item.payload)
            self.counts["replayed"] += 1
            expected = item.seq + 1
        complete = not missing and expected == upto
        if not complete:
            self.counts["unrepaired"] += 1
            log.warning(
                "KV events from %s: batches %d..%d could not be replayed; the view may be stale",
                self.endpoint,
                start,
                upto - 1,
            )
        return complete

    async def _replay(self, start: int) -> list[wire.LiveMessage]:
        dealer = self._dealer
        if dealer is None:
            return []
        self.counts["replays"] += 1
        await dealer.send_multipart(wire.replay_request(start))
        out: list[wire.LiveMessage] = []
        while True:
            if not await dealer.poll(round(self.replay_timeout_s * 1000)):
                # A late answer would be taken for the next replay's: start a fresh socket.
                self.counts["replay_timeouts"] += 1
                log.warning("KV events: no replay from %s", self.replay_endpoint)
                dealer.close(linger=0)
                self._dealer = self._new_dealer()
                return out
            try:
                msg = wire.parse_replay_reply(await dealer.recv_multipart())
            except wire.WireError as e:
                log.warning("KV events: bad replay reply from %s: %s", self.replay_endpoint, e)
                continue
            if msg is None:
                return out
            out.append(msg)

    def _new_dealer(self) -> zmq.asyncio.Socket:
        assert self._ctx is not None and self.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, 0)  # a whole replay may arrive before we read it
        dealer.connect(self.replay_endpoint)
        return dealer

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
