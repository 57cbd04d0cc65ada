"""The shared index's feed: what lets a replica answer prefix lookups from its own copy.

Every batch a replica writes to the shared index (index_redis.py) is appended, in the same
script call, to one Redis stream as a single entry: the writer's id and sequence number, then
each record (backend, time, index of its first block in the prompt, packed block hashes). Each
replica reads the stream and applies the other replicas' records to its copy, so the copy holds
what Redis holds, moments later, and a lookup needs no round trip.

The copy is trusted to answer only while it is shown to agree with Redis: a replica compares
its lookups' answers from Redis with its copy's (and repairs the copy where Redis knows more)
until the last `WINDOW` comparisons found at most `TRUST_STALE` holders the copy lacked; then
it answers from the copy, still comparing one lookup in `CHECK_EVERY` in the background, and goes
back to round trips when more than `DISTRUST_STALE` of the window are stale, when a writer's
numbers skip (a batch lost, the stream trimmed past this reader), when an entry cannot be read,
or when Redis is away. A replica that joins late reads the stream's retained history first;
what was written before that is learned from the comparisons.

This module is pure: the entry format and the bookkeeping. The reading is index_redis.py's.
"""

from __future__ import annotations

import struct
import uuid
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

FEED_VERSION = 1
# Entries the stream keeps (approximately: MAXLEN ~). A reader further behind than this loses
# entries, sees a writer's numbers skip, and goes back to round trips until the copy agrees again.
FEED_MAXLEN = 8192
FEED_COUNT = 256  # entries a read takes at most
FEED_BLOCK_MS = 500  # a read waits this long for a new entry (below the client's socket timeout)
WINDOW = 64  # comparisons the trust is judged over
TRUST_STALE = 2  # the copy answers once at most this many of the window were stale...
DISTRUST_STALE = 8  # ... and stops when more than this many are
CHECK_EVERY = 64  # while trusted: one lookup in this many is compared, in the background

_HEADER = struct.Struct("<B16sQ")  # version, writer id, writer's sequence number
_RECORD = struct.Struct("<HdII")  # backend name's length, time (score), first block, blocks


class Record(NamedTuple):
    backend: str
    ts: float  # the writer's time for it, a score (seconds since the index's SCORE_EPOCH)
    first: int  # index of its first block in the prompt (0: it starts the prompt)
    blocks: Sequence[int]


def encode(writer: bytes, seq: int, records: Iterable[tuple[str, bytes, float, int]]) -> bytes:
    """One feed entry: (backend, packed blocks, time, first) per record, after the header."""
    parts = [_HEADER.pack(FEED_VERSION, writer, seq)]
    for backend, packed, ts, first in records:
        name = backend.encode()
        parts.append(_RECORD.pack(len(name), ts, first, len(packed) // 8))
        parts.append(name)
        parts.append(packed)
    return b"".join(parts)


def decode(payload: bytes) -> tuple[bytes, int, list[Record]]:
    """(writer, seq, records) of an entry; ValueError for anything that is not one."""
    if len(payload) < _HEADER.size:
        raise ValueError("feed entry shorter than its header")
    version, writer, seq = _HEADER.unpack_from(payload)
    if version != FEED_VERSION:
        raise ValueError(f"feed entry of version {version}, not {FEED_VERSION}")
    view = memoryview(payload)
    at, end, records = _HEADER.size, len(payload), []
    while at < end:
        if at + _RECORD.size > end:
            raise ValueError("feed entry cut inside a record's header")
        n_name, ts, first, n = _RECORD.unpack_from(payload, at)
        at += _RECORD.size
        stop = at + n_name + 8 * n
        if stop > end:
            raise ValueError("feed entry cut inside a record")
        name = bytes(view[at : at + n_name]).decode()
        blocks = array("Q")
        blocks.frombytes(view[at + n_name : stop])
        records.append(Record(name, ts, first, blocks))
        at = stop
    return writer, seq, records


def new_writer_id() -> bytes:
    """This process's id in the feed: a restarted replica is a new writer, numbered from 1."""
    return uuid.uuid4().bytes


class Feed:
    """Where this replica stands with the feed: its own numbering as a writer, the last number
    seen of every other writer, and whether its copy may answer lookups."""

    def __init__(self, writer: bytes | None = None) -> None:
        self.writer = writer or new_writer_id()
        self.position: str | None = None  # the last stream entry read (None: not yet read)
        self._sent = 0
        self._seen: dict[bytes, int] = {}  # writer -> its last sequence number read
        self._window: deque[bool] = deque(maxlen=WINDOW)  # True: that comparison found stale
        self._stale_in_window = 0
        self._until_check = CHECK_EVERY
        self.trusted = False
        self.why = "not yet compared with Redis"
        self.counters = {
            "entries": 0,  # other writers' entries applied
            "records": 0,
            "own_entries": 0,
            "gaps": 0,  # a writer's numbers skipped
            "malformed": 0,
            "comparisons": 0,
            "stale": 0,  # comparisons where Redis knew holders (or depth) the copy lacked
            "repaired_holders": 0,
            "ahead": 0,  # comparisons where the copy held more than Redis
            "trusted_times": 0,
            "distrusted_times": 0,
        }

    def next_seq(self) -> int:
        self._sent += 1
        return self._sent

    def read(self, entry_id: str, payload: Any) -> list[Record]:
        """An entry read from the stream: the records to apply (none of this replica's own)."""
        self.position = entry_id
        try:
            writer, seq, records = decode(bytes(payload))
        except (ValueError, TypeError, UnicodeDecodeError) as e:
            self.counters["malformed"] += 1
            self.distrust(f"unreadable feed entry {entry_id}: {e}")
            return []
        if writer == self.writer:
            self.counters["own_entries"] += 1
            return []
        last = self._seen.get(writer)
        self._seen[writer] = seq
        if last is not None and seq != last + 1:
            self.counters["gaps"] += 1
            self.distrust(f"a writer's entries {last + 1}..{seq - 1} were not read")
        self.counters["entries"] += 1
        self.counters["records"] += len(records)
        return records

    def compared(self, stale: int, ahead: int) -> bool:
        """A lookup answered by Redis and by the copy: `stale` holders the copy lacked or held
        shallower (now repaired), `ahead` holders it held deeper. True when that changed
        whether the copy answers lookups (`why` says how)."""
        c = self.counters
        c["comparisons"] += 1
        c["repaired_holders"] += stale
        if ahead:
            c["ahead"] += 1
        window = self._window
        if len(window) == window.maxlen and window[0]:
            self._stale_in_window -= 1
        window.append(stale > 0)
        if stale:
            c["stale"] += 1
            self._stale_in_window += 1
        if self.trusted:
            if self._stale_in_window > DISTRUST_STALE:
                return self.distrust(
                    f"{self._stale_in_window} of the last {len(window)} checks found holders "
                    "the copy lacked"
                )
        elif len(window) == window.maxlen and self._stale_in_window <= TRUST_STALE:
            self.trusted = True
            agreed = len(window) - self._stale_in_window
            self.why = f"agreed with Redis in {agreed} of the last {len(window)} lookups"
            c["trusted_times"] += 1
            return True
        return False

    def check_due(self) -> bool:
        """While trusted: whether this lookup is one to compare (one in CHECK_EVERY)."""
        self._until_check -= 1
        if self._until_check > 0:
            return False
        self._until_check = CHECK_EVERY
        return True

    def distrust(self, why: str) -> bool:
        """Back to round trips until the copy agrees again. True when it was trusted."""
        was = self.trusted
        self.trusted = False
        self.why = why
        self._window.clear()
        self._stale_in_window = 0
        if was:
            self.counters["distrusted_times"] += 1
        return was

    def info(self) -> dict[str, Any]:
        return {
            "answers_lookups": self.trusted,
            "why": self.why,
            "position": self.position,
            "writers_seen": len(self._seen),
            "stale_in_window": self._stale_in_window,
            **self.counters,
        }
