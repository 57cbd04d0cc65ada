"""The prefix index in Redis, shared by proxy replicas (see proxy/routing/index.py).

When Redis counts as down: see redis_connect.TimeoutStreak. How a replica answers lookups from
its own copy of the shared index, without a round trip: index_feed.py. The scripts and their
arguments' packing: index_lua.py.

Size: the lookups, the writer, the feed's reader and the outage handling share the pending
records, the local copy and the up/down state; apart, each would reach into the others' state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from proxy.routing.departures import DELETE_ONCE_LUA, Departures, guard_key
from proxy.routing.index_feed import (
    FEED_BLOCK_MS,
    FEED_COUNT,
    FEED_GATHER_S,
    FEED_MAXLEN,
    Feed,
    pack_entry,
)
from proxy.routing.index_lua import (
    LOOKUP_LUA,
    RECORD_LUA,
    pack_blocks,
    record_calls,
    record_keys,
    reply_pairs,
)
from proxy.routing.index_memory import (
    DEFAULT_CAPACITY_BLOCKS,
    DEFAULT_TTL_S,
    MemoryPrefixIndex,
    Probe,
)
from proxy.routing.redis_connect import (
    REDIS_DOWN_ERRORS,
    TIMEOUT_ERRORS,
    TIMEOUTS_TO_OUTAGE,
    TimeoutStreak,
    _reraise_if_cancelled,
    drop_idle_connections,
    stop_task,
)

log = logging.getLogger("warmroute.routing.index")

# Scores are seconds since this epoch, not since 1970: near 6e7 a double still resolves 1e-8 s,
# fine enough to give each block of a prompt its own, slightly older, score (see _flush).
SCORE_EPOCH = 1_700_000_000.0
BLOCK_STEP_S = 1e-7
DEPTHS_KEPT = 4096  # heads whose last common depth a lookup tries first
HEAD_TTL_MARGIN_S = 60.0  # a head set outlives its members' scores by this (clocks differ)
# A record waits this long for others to share its write (unless flush_items are pending). Not
# longer: a replica that looks a prompt up in Redis before the record arrives routes it as if
# no backend held it (20 ms split a prompt over two backends in 4 runs of 12 of
# tests/test_e2e_routing.py's three-proxy test; 5 ms in none).
FLUSH_INTERVAL_S = 0.005
# ... unless every record pending continues a prompt whose start is in Redis (written or read
# here within refresh_s): another replica's lookup finds that prompt's holder without them.
# They wait this much longer (20 ms in all, as often as the feed is read), for company.
TAIL_WAIT_S = 0.015


class RedisPrefixIndex:
    """The prefix index in Redis, shared by proxy replicas, with a warm local fallback."""

    def __init__(
        self,
        client: Any,
        key_prefix: str = "warmroute",
        timeout_s: float = 0.05,
        capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        ttl_s: float = DEFAULT_TTL_S,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        flush_items: int = 64,
        max_pending: int = 10_000,
        refresh_s: float = 2.0,
        reconnect_min_s: float = 0.1,
        reconnect_max_s: float = 5.0,
        owns_client: bool = False,
        timeouts_to_outage: int = TIMEOUTS_TO_OUTAGE,
        clock: Callable[[], float] = time.time,
        local_lookups: bool = True,
    ) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self.default_capacity = capacity_blocks
        self.flush_interval_s = flush_interval_s
        self.flush_items = flush_items
        self.reconnect_min_s = reconnect_min_s
        self.reconnect_max_s = reconnect_max_s
        self.owns_client = owns_client
        # Wall-clock scores: replicas on different hosts must agree on what "old" means (a
        # harness in virtual time passes its own `clock`, on the wall clock's epoch). The local
        # copy's clock is the one every score and age here is read from.
        self.local = MemoryPrefixIndex(capacity_blocks, ttl_s, clock=clock)
        self._capacity: dict[str, int] = {}
        self.refresh_s = refresh_s
        # (backend, blocks, time, index of the first block): only the part not written lately.
        self._pending: deque[tuple[str, Sequence[int], float, int]] = deque(maxlen=max_pending)
        self._script = client.register_script(LOOKUP_LUA)
        self._depths: OrderedDict[int, int] = OrderedDict()  # head block -> depth to try first
        self._name_at = len(self.key("")) + 1  # (Lua's strings count from 1)
        self._held: dict[str, int] = {}  # backend -> blocks its shared ZSET held at the last write
        self._record_script = client.register_script(RECORD_LUA)
        self._delete_once = client.register_script(DELETE_ONCE_LUA)
        # Backends forgotten here whose shared keys are still to be deleted (departures.py).
        self.departures = Departures()
        self._timeouts = TimeoutStreak(timeouts_to_outage)
        self._up = True
        self._up_event = asyncio.Event()
        self._up_event.set()
        self._closed = False
        self._wake = asyncio.Event()
        self._hurry = asyncio.Event()  # a pending record (or departure) others must see soon
        self.tail_wait_s = TAIL_WAIT_S
        self._flusher: asyncio.Task[None] | None = None
        self._reconnector: asyncio.Task[None] | None = None
        # Every replica writes the feed; one with local_lookups reads it into `local`, which
        # then holds every replica's records and answers lookups once shown to agree with Redis.
        self.feed = Feed()
        self.local_lookups = local_lookups
        self._reader: asyncio.Task[None] | None = None
        self.reads_with_writes = False  # each write reads the feed too (writes_read; start())
        self._checking: asyncio.Task[None] | None = None
        # Backend -> when this replica forgot it (a score): the feed's older records for it,
        # still in flight from other replicas, must not bring it back into the copy.
        self._forgot_at: dict[str, float] = {}
        self.counters = dict.fromkeys(
            "lookups fallback_lookups lookup_errors lookup_timeouts records writes write_errors "
            "dropped_records outages reconnects reseeded_backends writes_read "
            "copy_lookups".split(),  # (answered from the local copy, Redis up: index_feed.py)
            0,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        return "redis" if self._up else "memory-fallback"

    async def start(self) -> None:
        # Load the scripts now so the first lookup is one round trip, not NOSCRIPT + load + call.
        try:
            async with asyncio.timeout(self._slow_s):
                await self._load_scripts()
        except REDIS_DOWN_ERRORS as e:
            self._went_down(e)  # start anyway: a Redis outage must not stop the proxy
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_loop(), name="prefix-index-flush")
        if self.local_lookups and self._reader is None:
            self._reader = asyncio.create_task(self._read_loop(), name="prefix-index-feed")
            self.reads_with_writes = True

    @property
    def _slow_s(self) -> float:
        """The bound on background calls, which no request waits on."""
        return max(self.timeout_s * 20, 1.0)

    async def _load_scripts(self) -> None:
        await self.client.script_load(LOOKUP_LUA)
        await self.client.script_load(RECORD_LUA)

    async def wait_shared(self) -> None:
        """Return once lookups go to Redis (for readiness checks and tests)."""
        await self._up_event.wait()

    async def close(self) -> None:
        self._closed = True
        with contextlib.suppress(*REDIS_DOWN_ERRORS):
            await asyncio.wait_for(self._flush(), max(self.timeout_s * 10, 0.5))
        for task in (self._flusher, self._reconnector, self._reader, self._checking):
            if task is not None:
                await stop_task(task)
        if self.owns_client:
            with contextlib.suppress(*REDIS_DOWN_ERRORS):
                await self.client.aclose()

    def key(self, backend: str) -> str:
        kp = self.key_prefix
        return f"{kp}:{{{kp}:pfx}}:{backend}"

    def feed_key(self) -> str:
        """The stream every replica's writes are appended to (index_feed.py)."""
        kp = self.key_prefix
        return f"{kp}:{{{kp}:pfx}}!feed"

    # -- hot path ----------------------------------------------------------------------------

    async def lookup(self, blocks: Sequence[int], backends: Sequence[str]) -> dict[str, int]:
        found = dict.fromkeys(backends, 0)
        found.update(await self.holders(blocks, backends))
        return found

    async def holders(self, blocks: Sequence[int], backends: Collection[str]) -> dict[str, int]:
        """One script call: the backends that recorded the prompt's first block, checked
        and measured in their ZSETs (the reply follows the holders, not the fleet)."""
        if not blocks or not backends:
            return {}
        if not self._up:
            self.counters["fallback_lookups"] += 1
            return self.local.holders_now(blocks, backends)
        feed = self.feed
        if feed.trusted:
            self.counters["copy_lookups"] += 1
            found = self.local.holders_now(blocks, backends)
            if feed.check_due() and self._reader is not None:
                self._check_later(blocks, backends)
            return found
        self.counters["lookups"] += 1
        ticket = self._timeouts.start()
        try:
            async with asyncio.timeout(self.timeout_s):
                out = await self._ask(blocks, backends)
        except REDIS_DOWN_ERRORS as e:
            _reraise_if_cancelled()
            self.counters["lookup_errors"] += 1
            if isinstance(e, TIMEOUT_ERRORS):
                self.counters["lookup_timeouts"] += 1
                if self._timeouts.timed_out(ticket):
                    self._went_down(e)
            else:
                self._went_down(e)
            self.counters["fallback_lookups"] += 1
            return self.local.holders_now(blocks, backends)
        self._timeouts.answered()
        if out:
            self._note_depth(blocks[0], out)
        if self.local_lookups:
            self._compare(blocks, backends, out)
        return out

    def _compare(
        self, blocks: Sequence[int], backends: Collection[str], shared: dict[str, int]
    ) -> None:
        """Redis's answer against the copy's, for the feed's trust; where Redis knows a holder
        (or a depth) the copy lacks, the copy learns it now, as of now."""
        mine = self.local.holders_now(blocks, backends)
        stale = ahead = 0
        now = self.local.clock()
        for name, depth in shared.items():
            if mine.get(name, 0) < depth:
                stale += 1
                self.local.record_now(name, blocks[:depth], now)
        for name, depth in mine.items():
            if shared.get(name, 0) < depth:
                ahead += 1
        if self.feed.compared(stale, ahead):
            if self.feed.trusted:
                log.info("prefix index: lookups answered from the local copy (%s)", self.feed.why)
            else:
                log.warning("prefix index: lookups go to Redis again: %s", self.feed.why)

    def _check_later(self, blocks: Sequence[int], backends: Collection[str]) -> None:
        """While the copy answers: compare this lookup with Redis in the background (one at a
        time; a request never waits on it)."""
        if self._checking is not None and not self._checking.done():
            return
        self._checking = asyncio.create_task(self._check(blocks, frozenset(backends)))

    async def _check(self, blocks: Sequence[int], backends: Collection[str]) -> None:
        try:
            async with asyncio.timeout(self._slow_s):
                shared = await self._ask(blocks, backends)
        except REDIS_DOWN_ERRORS:
            _reraise_if_cancelled()
            return  # the writer and the feed's reader tell an outage; a check only compares
        if self._up and self.feed.trusted:
            self._compare(blocks, backends, shared)

    async def _ask(self, blocks: Sequence[int], backends: Collection[str]) -> dict[str, int]:
        """The lookup script's answer: the backends of `backends` holding the prompt's first
        block, with the depth each holds (one round trip; the caller bounds its time)."""
        oldest = self.local.clock() - SCORE_EPOCH - self.ttl_s
        hint = self._depths.get(blocks[0], 0)
        args = [pack_blocks(blocks), repr(oldest), hint, self._name_at]
        found = await self._script(keys=[self.head_key(blocks[0])], args=args)
        return {name: n for name, n in reply_pairs(found) if name in backends}

    def _note_depth(self, head: int, held: Mapping[str, int]) -> None:
        """The depth most holders of `head` hold, tried first at its next lookup."""
        depths = self._depths
        depths[head] = Counter(held.values()).most_common(1)[0][0]
        depths.move_to_end(head)
        if len(depths) > DEPTHS_KEPT:
            depths.popitem(last=False)

    def head_key(self, block: int) -> str:
        """The set of backend ZSETs that recorded `block` as a prompt's first block."""
        kp = self.key_prefix
        return f"{kp}:{{{kp}:pfx}}!head:{block & 0xFFFFFFFFFFFFFFFF:016x}"

    def record(self, backend: str, blocks: Sequence[int]) -> None:
        if not blocks:
            return
        self.counters["records"] += 1
        now = self.local.clock()
        # A popular prefix is recorded on every request; rewriting its hundreds of blocks each
        # time is what made Redis (and our event loop) slow. Blocks this replica wrote less than
        # refresh_s ago are skipped: their Redis score lags by at most refresh_s, which is far
        # below any useful LRU resolution.
        skip = self.local.fresh_prefix(backend, blocks, now - self.refresh_s)
        # The local copy is always current, so a fallback starts warm.
        self.local.record_now(backend, blocks, now)
        if skip >= len(blocks):
            return
        if len(self._pending) == self._pending.maxlen:
            self.counters["dropped_records"] += 1  # deque drops the oldest on append
        self._pending.append((backend, blocks[skip:], now - SCORE_EPOCH, skip))
        if skip == 0 or len(self._pending) >= self.flush_items:
            self._hurry.set()  # (a prompt's start: the others must find it soon)
        self._wake.set()

    def set_capacity(self, backend: str, blocks: int) -> None:
        self._capacity[backend] = max(1, int(blocks))
        self.local.set_capacity(backend, blocks)

    def forget(self, backend: str, departure: str = "") -> None:
        """Forget `backend` here at once (the local copy, its capacity, its records not yet
        written); its shared key is deleted by the background writer, once across replicas
        (`departure`: a token every replica shares for this change, see departures.py)."""
        self.local.forget(backend)
        now = self.local.clock() - SCORE_EPOCH
        self._forgot_at[backend] = now
        for name in [n for n, at in self._forgot_at.items() if at < now - self.ttl_s]:
            del self._forgot_at[name]
        self._capacity.pop(backend, None)
        self._held.pop(backend, None)
        if any(r[0] == backend for r in self._pending):
            kept = [r for r in self._pending if r[0] != backend]
            self._pending.clear()
            self._pending.extend(kept)
        self.departures.add(backend, departure)
        self._hurry.set()
        self._wake.set()

    async def purge(self) -> None:
        """Delete the shared keys of the backends forgotten so far (the writer does it in the
        background; for the reconciler and tests). Redis down: they wait for the reconnect."""
        with contextlib.suppress(*REDIS_DOWN_ERRORS):
            await self._purge()

    async def _purge(self) -> None:
        if not self.departures or not self._up:
            return
        tag = f"{self.key_prefix}:{{{self.key_prefix}:pfx}}"
        ttl_ms = int(self.departures.guard_s * 1000)

        async def delete(backend: str, departure: str) -> bool:
            keys = [guard_key(tag, backend, departure), self.key(backend)]
            return int(await self._delete_once(keys=keys, args=[ttl_ms])) >= 0

        try:
            async with asyncio.timeout(self._slow_s):
                await self.departures.run(delete)
        except REDIS_DOWN_ERRORS as e:
            _reraise_if_cancelled()
            self._went_down(e)
            raise

    def probe(self, backend: str, blocks: Sequence[int], matched: int) -> Probe:
        """The local copy's probe (it holds what this replica recorded, in wall-clock times as
        Redis does). A match this replica never recorded there was another replica's: when,
        it cannot tell, so it is taken as just now. A miss on it is then no evidence that the
        engine evicted it (it may be prefilling still, for the replica that sent it): behind a
        round robin, such misses right after a placement change shrank the learned caches."""
        found = self.local.probe(backend, blocks, matched)
        if found.last_seen is None and matched > 0:
            return Probe(self.local.clock(), found.ghost_blocks)
        return found

    def fresh_prefix(self, backend: str, blocks: Sequence[int], since: float) -> int:
        """The local copy's: what this replica sent there lately (other replicas' records
        carry no time of their own here)."""
        return self.local.fresh_prefix(backend, blocks, since)

    def now(self) -> float:
        return self.local.clock()

    def occupancy(self, backend: str) -> int:
        """Blocks held for `backend` in the shared index, as of this replica's last write
        there (every replica's records; the local copy holds only this replica's, which
        behind a round robin of N is about 1/N of them), or the local copy's if larger."""
        local = self.local.occupancy(backend)
        shared = self._held.get(backend)
        return local if shared is None or shared < local else shared

    def occupancies(self) -> dict[str, int]:
        """occupancy() of every backend either the copy or this replica's writes know."""
        held = dict(self._held)  # one C call: a metrics reader's thread may be reading
        out = self.local.occupancies()
        for backend, shared in held.items():
            if shared > out.get(backend, 0):
                out[backend] = shared
        return out

    def memory(self) -> int:
        return self.local.memory()

    # -- background --------------------------------------------------------------------------

    async def flush(self) -> None:
        """Write everything recorded so far (for shutdown and for tests)."""
        await self._flush()

    async def pull_feed(self, block_ms: int | None = None) -> int:
        """Read the feed once (waiting up to `block_ms` for an entry; None: not at all) and
        apply the other replicas' records to the local copy; returns the records applied.
        A first read starts at the stream's oldest entry: a replica that joins late catches up
        on the history Redis keeps (FEED_MAXLEN entries), skipping what is past the TTL."""
        key = self.feed_key()
        reply = await self.client.xread(
            {key: self.feed.position or "0-0"}, count=FEED_COUNT, block=block_ms
        )
        return self._apply([e for _, entries in reply or () for e in entries])

    def _apply(self, entries: Sequence[Sequence[Any]]) -> int:
        """Entries read from the feed, (id, fields): the others' records go into the copy."""
        trusted, now = self.feed.trusted, self.local.clock()
        oldest = now - SCORE_EPOCH - self.ttl_s
        applied = self.feed.apply(
            entries, self.local, self._forgot_at, now, oldest, self._name_at - 1
        )
        if trusted and not self.feed.trusted:
            log.warning("prefix index: lookups go to Redis again: %s", self.feed.why)
        return applied

    async def _read_loop(self) -> None:
        delay = self.reconnect_min_s
        while not self._closed:
            if not self._up:
                await self._up_event.wait()
                continue
            try:
                position = self.feed.position
                await self.pull_feed(FEED_BLOCK_MS)
                delay = self.reconnect_min_s
                seen = -1
                while self.feed.position != position and seen != self.counters["writes_read"]:
                    seen = self.counters["writes_read"]  # (again while the writes read the feed)
                    await asyncio.sleep(FEED_GATHER_S)
            except REDIS_DOWN_ERRORS as e:
                _reraise_if_cancelled()
                if self.feed.distrust(f"feed read failed ({type(e).__name__}: {e})"):
                    log.warning(
                        "prefix index: feed read failed (%s: %s); lookups go to Redis "
                        "until the copy agrees with it again",
                        type(e).__name__,
                        e,
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.reconnect_max_s)

    async def _flush_loop(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            if len(self._pending) < self.flush_items:
                await asyncio.sleep(self.flush_interval_s)  # let a batch gather
            if not self._hurry.is_set():  # only prompts' continuations
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.tail_wait_s):
                        await self._hurry.wait()
            self._hurry.clear()
            if self._up:
                try:
                    await self._flush()
                except REDIS_DOWN_ERRORS:
                    _reraise_if_cancelled()

    async def _flush(self) -> None:
        # Departed backends' keys first: a record made after the forget (the address rejoined)
        # must survive the deletion.
        await self._purge()
        if not self._pending or not self._up:
            return
        batch = list(self._pending)
        self._pending.clear()
        # Redis unpacks and scores the blocks, so this loop (which shares the event loop with
        # every request) costs O(1) per record, not O(blocks). No pipeline: Cluster clients
        # refuse scripts in pipelines, and one call already carries up to RECORDS_PER_CALL.
        now = self.local.clock() - SCORE_EPOCH
        ttl_ms = int(self.ttl_s * 1000)
        head_ttl_ms = int((self.ttl_s + HEAD_TTL_MARGIN_S) * 1000)
        head = [repr(BLOCK_STEP_S), ttl_ms, repr(now - self.ttl_s), head_ttl_ms]
        done = 0
        try:
            # Writes wait up to _slow_s, so a timeout here is not a busy loop's hiccup.
            async with asyncio.timeout(self._slow_s):
                for i, chunk in record_calls(batch):
                    keys, packed = self._record_call(chunk)
                    args = [*head, *packed, FEED_MAXLEN]
                    # The call also reads what the others appended since this replica's last
                    # read: it is made anyway, and the reader's own call is then saved.
                    start = self.feed.read_from() if self.reads_with_writes else ""
                    if start:
                        args += [start, FEED_COUNT]
                    held = await self._record_script(keys=keys, args=args)
                    done = i + len(chunk)
                    if start:
                        self.counters["writes_read"] += 1
                        self._apply(held.pop())
                    self._held.update(reply_pairs(held, self._name_at - 1))
            self.counters["writes"] += 1
        except REDIS_DOWN_ERRORS as e:
            self.counters["write_errors"] += 1
            # Keep what was not written for after the reconnect (bounded: the deque drops the
            # oldest).
            self._pending.extendleft(reversed(batch[done:]))
            self._went_down(e)
            raise

    def _record_call(
        self, chunk: Sequence[tuple[str, Sequence[int], float, int]]
    ) -> tuple[list[str], tuple[bytes, bytes]]:
        """One record-script call's KEYS and its two packed arguments (index_lua.py); the
        same call appends the batch to the feed, so the other replicas' copies learn exactly
        what Redis now holds, in the order Redis wrote it."""
        caps, default = self._capacity, self.default_capacity
        rows = [
            (self.key(b), self.head_key(blocks[0]) if first == 0 else "", caps.get(b, default))
            for b, blocks, _, first in chunk
        ]
        keys, table = record_keys(rows)
        records = [
            (key, ts, first, blocks)
            for (key, _, _), (_, blocks, ts, first) in zip(rows, chunk, strict=True)
        ]
        entry = pack_entry(self.feed.writer, self.feed.next_seq(), records)
        return [*keys, self.feed_key()], (entry, table)

    def _went_down(self, err: BaseException) -> None:
        if self._closed:
            return
        self.feed.distrust(f"Redis was unavailable ({type(err).__name__})")
        if self._up:
            self._up = False
            self._up_event.clear()
            self.counters["outages"] += 1
            log.warning(
                "prefix index: Redis unavailable (%s: %s); routing from the local index "
                "until it answers again",
                type(err).__name__,
                err,
            )
        if self._reconnector is None or self._reconnector.done():
            self._reconnector = asyncio.create_task(self._reconnect(), name="prefix-index-redis")

    async def _reconnect(self) -> None:
        delay = self.reconnect_min_s
        while not self._closed:
            await asyncio.sleep(delay)
            try:
                async with asyncio.timeout(self._slow_s):
                    # A ping over a fresh connection proves nothing about the stale ones still
                    # pooled; drop them first, or the first lookups after the reconnect fail.
                    await drop_idle_connections(self.client)
                    await self.client.ping()
                    # A restarted Redis has lost the scripts: load them once here rather than
                    # in every concurrent lookup (NOSCRIPT, load, retry) on the hot path.
                    await self._load_scripts()
            except REDIS_DOWN_ERRORS:
                _reraise_if_cancelled()
                delay = min(delay * 2, self.reconnect_max_s)
                continue
            with contextlib.suppress(*REDIS_DOWN_ERRORS):
                await self._reseed()
            self._timeouts.reset()
            self._up = True
            self._up_event.set()
            self.counters["reconnects"] += 1
            log.warning("prefix index: Redis is back; routing from the shared index again")
            self._hurry.set()
            self._wake.set()  # write what was recorded during the outage
            return

    async def _reseed(self) -> None:
        """After an outage, refill backends whose keys Redis lost (a restart without persistence)
        from the local copy, so the shared index does not start cold. Each replica adds what it
        knows; a key that survived the outage is left alone."""
        backends = list(self.local.backends())
        if not backends:
            return
        pipe = self.client.pipeline(transaction=False)
        for backend in backends:
            pipe.exists(self.key(backend))
        async with asyncio.timeout(self._slow_s):
            exists = await pipe.execute()
        lost = [b for b, n in zip(backends, exists, strict=True) if not n]
        ttl_ms = int(self.ttl_s * 1000)
        head_ttl_ms = int((self.ttl_s + HEAD_TTL_MARGIN_S) * 1000)
        pipe = self.client.pipeline(transaction=False)
        for backend in lost:
            members = {pack_blocks([h]): ts - SCORE_EPOCH for h, ts in self.local.entries(backend)}
            if members:
                pipe.zadd(self.key(backend), members)
                pipe.pexpire(self.key(backend), ttl_ms)
            for h in self.local.heads(backend):  # so lookups find them again
                pipe.sadd(self.head_key(h), self.key(backend))
                pipe.pexpire(self.head_key(h), head_ttl_ms)
        if lost:
            async with asyncio.timeout(max(self.timeout_s * 40, 2.0)):
                await pipe.execute()
            self.counters["reseeded_backends"] += len(lost)

    def info(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "pending": len(self._pending),
            **self.counters,
            "departures": self.departures.info(),
            # Learned from the engines' KV pools (see set_capacity); others use the default.
            "capacity": dict(self._capacity),
            "default_capacity": self.default_capacity,
            "feed": {"read": self.local_lookups, **self.feed.info()},
            "memory_bytes": self.local.memory(),  # the copy's tables
        }
