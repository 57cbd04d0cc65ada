"""Listens to one engine's KV events and keeps a view of its cache up to date (asyncio).

The I/O edge of the KV event path: a SUB socket on the engine's endpoint (and a DEALER on its
replay endpoint, if it has one) feeding decoded batches, in sequence order, to a pure sink
such as `KvCacheView`. Sequence numbers make a lost message visible, and the subscriber
repairs it from the engine's replay buffer:

- on connecting (ZeroMQ reports it), everything from 0 is replayed, so a subscriber that
  starts after the engine still learns what it stored, as far back as the buffer reaches;
- on a gap (a live seq past last + 1), the missing batches are replayed and applied in order
  before the one that revealed the gap;
- on reconnecting, the replay starts at the last batch applied: the same engine still has
  that very batch, anything else is a restarted engine (so is a live seq that goes back with a
  different payload). A restart clears the sink and replays the new engine from 0.

Batches sent while the SUB socket (re)joins are lost; the next live batch reveals the gap.
`exact` says the sink holds everything since a clean start (a replay that reached seq 0, or
an AllBlocksCleared); a gap the replay could not fill clears it, and so does, until the next
clean start, an event that could not be read (unknown or malformed) or a block the sink could
not place (a parent it never saw): either way the sink missed a change to the cache.

"Silent" means nothing arrived for `silent_after_s`. An idle engine is silent too (engines
publish only when their cache changes), so silence alone is no verdict: pair it with a
failed health check before dropping a view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from proxy.kvevents import wire

log = logging.getLogger("warmroute.kvevents")

RECENT = 4096  # digests of the last batches applied, to tell a repeat from a restart


class EventSink(Protocol):
    """Where decoded events go (`KvCacheView` is one)."""

    def apply(self, events: Iterable[wire.KVEvent]) -> int | None:
        """Apply events in order; may return how many blocks it could not place (a change
        to the cache it did not follow: the subscriber then stops claiming exactness)."""
        ...

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
        # Something since the last clean start was not followed (an unreadable event, a block
        # the sink could not place): no replay repairs that, only the next clean start does.
        self._lossy = False
        self.connected = False
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "received",  # live messages received
                "messages",  # batches applied (live and replayed)
                "events",  # events applied
                "skipped_events",  # unknown or malformed events left out of a batch
                "unplaced_blocks",  # blocks the sink could not place (a parent it never saw)
                "undecodable",  # messages that were not a KV event batch at all
                "duplicates",  # live batches already applied from a replay
                "gaps",  # live messages that came after a missing one
                "replays",  # replay requests sent
                "replayed",  # batches applied from a replay
                "unrepaired",  # replays that could not supply every missing batch
                "replay_timeouts",
                "connects",  # the SUB socket (re)connected to the engine
                "restarts",  # another engine (a restart) behind the endpoint
                "silences",  # times the publisher went quiet for silent_after_s
            ),
            0,
        )
        self._recent: OrderedDict[int, int] = OrderedDict()  # seq -> digest of its payload
        self._last_heard = clock()
        self._silent = False
        self._changed = asyncio.Condition()
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
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
        if self._sub is not None and self._monitor is not None:
            self._sub.disable_monitor()
        for sock in (self._monitor, self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._monitor = self._dealer = None
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

    @property
    def live(self) -> bool:
        """Listening, and the sink holds the engine's whole cache (`exact`)."""
        return self._task is not None and not self._task.done() and self.exact

    def stats(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "last_seq": self.last_seq,
            "exact": self.exact,
            "connected": self.connected,
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
        sub, monitor = self._sub, self._monitor
        assert sub is not None and monitor is not None
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            wait_s = self._last_heard + self.silent_after_s - self.clock()
            if self._silent or wait_s <= 0:
                wait_s = self.silent_after_s
            ready = dict(await poller.poll(max(1, round(wait_s * 1000))))
            try:
                if monitor in ready:
                    await self._on_monitor(parse_monitor_message(await monitor.recv_multipart()))
                if sub in ready:
                    frames = await sub.recv_multipart()
                    self.counts["received"] += 1
                    self._last_heard = self.clock()
                    if self._silent:
                        self._silent = False
                        log.info("KV events from %s: publishing again", self.endpoint)
                    await self.on_frames(frames)
            except Exception:
                log.exception("KV events from %s: could not apply a message", self.endpoint)
                self.exact = False
            if not ready and self.silent and not self._silent:
                self._silent = True
                self.counts["silences"] += 1
                log.warning("KV events from %s: silent for %gs", self.endpoint, self.silent_after_s)
            await self._notify()

    async def _on_monitor(self, event: Any) -> None:
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self.connected = False
            log.info("KV events from %s: disconnected", self.endpoint)
            return
        self.connected = True
        self.counts["connects"] += 1
        if self._dealer is None:
            if self.last_seq is not None:
                self.exact = False  # batches may have gone by while disconnected
            return
        if self.last_seq is None:
            await self._catch_up()
            return
        # Reconnected: does the engine behind the endpoint still have our last batch?
        last = self.last_seq
        items = await self._replay(last)
        if items is None:
            self._unrepaired(last + 1)
        elif items and items[0].seq == last and self._recent.get(last) == hash(items[0].payload):
            if not self._apply_replayed(items[1:], last + 1, None):
                self.exact = False
        else:
            self._restarted(items[0].seq if items else None)
            await self._catch_up()

    async def on_frames(self, frames: Sequence[bytes]) -> None:
        """Handle one live message (its frames as received)."""
        try:
            msg = wire.parse_live(frames)
        except wire.WireError as e:
            self.counts["undecodable"] += 1
            log.warning("KV events from %s: %s", self.endpoint, e)
            return
        if self.topic and msg.topic != self.topic and not msg.topic.startswith(self.topic + b"\0"):
            # A longer topic that only shares our prefix. SGLang's snapshot-capable publisher
            # appends b"\0sgl-kv-epoch=<id>" (and a snapshot marker) to the configured topic.
            return
        if self.last_seq is not None:
            if msg.seq <= self.last_seq:
                if self._recent.get(msg.seq) == hash(msg.payload):
                    self.counts["duplicates"] += 1  # already applied from a replay
                    return
                self._restarted(msg.seq)
            elif msg.seq > self.last_seq + 1:
                self.counts["gaps"] += 1
                await self._fill_gap(msg.seq)
        if self.last_seq is None and msg.seq > 0:
            await self._catch_up(upto=msg.seq)
        if self.last_seq is None:
            self.exact = msg.seq == 0
        self._apply(msg.seq, msg.payload)

    # --- applying -------------------------------------------------------------------------
    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self._recent[seq] = hash(payload)
        if len(self._recent) > RECENT:
            self._recent.popitem(last=False)
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
        unplaced = self.sink.apply(batch.events) or 0
        self.counts["unplaced_blocks"] += unplaced
        if any(isinstance(e, wire.AllBlocksCleared) for e in batch.events):
            self.exact = True  # everything from here on is known
            self._lossy = False
        if batch.skipped or unplaced:
            # The engine's cache changed in a way the sink did not see: until a clean start
            # (a cleared cache, a restart replayed from 0), routing must not trust it whole.
            if self.exact:
                log.warning(
                    "KV events from %s: batch %d had %d event(s) this proxy could not read "
                    "and %d block(s) it could not place; the view is no longer exact (routing "
                    "falls back to the index)",
                    self.endpoint, seq, batch.skipped, unplaced,
                )  # fmt: skip
            self.exact = False
            self._lossy = True

    def reset(self) -> None:
        """Another engine answers at the endpoint (the caller knows it restarted): the view
        is cleared and rebuilt from the new engine's replay, as when a restart is seen here
        first. The subscription stays; until the view is whole again it is not live."""
        self.sink.clear()
        self.last_seq = None
        self.exact = False
        self._lossy = False
        self._recent.clear()

    def _restarted(self, seq: int | None) -> None:
        self.counts["restarts"] += 1
        log.warning(
            "KV events from %s: batch %s after %s is another engine's; it restarted",
            self.endpoint, seq, self.last_seq,
        )  # fmt: skip
        self.reset()

    async def _catch_up(self, upto: int | None = None) -> None:
        """Replay the engine from seq 0 (up to `upto`, exclusive): what it did before us."""
        items = await self._replay(0)
        if items is None:
            self._unrepaired(0)
        else:
            self.exact = self._apply_replayed(items, 0, upto) and not self._lossy

    async def _fill_gap(self, upto: int) -> None:
        assert self.last_seq is not None
        last = self.last_seq
        # From our last batch on: if the engine's copy of it differs, it is another engine
        # that has already counted past us.
        items = await self._replay(last)
        if items and items[0].seq == last and self._recent.get(last) != hash(items[0].payload):
            self._restarted(upto)
            return
        if items is None:
            self._unrepaired(last + 1)
        elif not self._apply_replayed(items, last + 1, upto):
            self.exact = False

    def _apply_replayed(
        self, items: Sequence[wire.LiveMessage], start: int, upto: int | None
    ) -> bool:
        """Apply replayed batches start..upto-1 in order; True if none was missing."""
        expected, missing = start, False
        for item in items:
            if upto is not None and item.seq >= upto:
                break
            if item.seq < expected:
                continue
            missing |= item.seq > expected  # out of the buffer already: apply the rest anyway
            self._apply(item.seq, item.payload)
            self.counts["replayed"] += 1
            expected = item.seq + 1
        if missing or (upto is not None and expected != upto):
            self._unrepaired(start)
            return False
        return True

    def _unrepaired(self, start: int) -> None:
        self.counts["unrepaired"] += 1
        self.exact = False
        log.warning(
            "KV events from %s: batches from %d on could not all be replayed; the view may be "
            "stale",
            self.endpoint,
            start,
        )

    # --- replay socket --------------------------------------------------------------------
    async def _replay(self, start: int) -> list[wire.LiveMessage] | None:
        """The engine's buffered batches from `start` on; None without an answer."""
        dealer = self._dealer
        if dealer is None:
            return None
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
                return None
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
