"""The shared index's feed: what lets a replica answer prefix lookups from its own copy.

Every batch a replica writes to the shared index (index_redis.py) is appended, by the same
script call, to one Redis stream as a single entry of two fields (the writer packs the batch
once, `pack_entry`; the record script reads its records from it and appends it as it came):
`v`, the format (FEED_VERSION), and `d`, the whole batch packed in one string, little-endian:
the writer's id (its length in one byte, then the id), its number for this call and the number
of records (4 bytes each), then per record its time (a score, an 8-byte double), the index of
its first block in the prompt, the length of the backend's ZSET key and of its blocks (4 bytes
each), the key, and the block hashes (8 bytes each). One field where format 1 had four a
record: a reader's client parses two strings an entry instead of dozens, and the reader finds
the writer, and skips its own entries, without reading the records. A replica of another format
(a rolling upgrade) cannot read these entries, nor this one its: each counts as unreadable, and
its copy answers no lookups (round trips to Redis, routing unchanged) until every replica
writes this format. (Replicas whose script builds the entry itself, as before the writer packed
it, write the same bytes: they read each other's entries.)

Each replica reads the stream and applies the other replicas' records to its copy, so the copy
holds what Redis holds, moments later, and a lookup needs no round trip. Its writes read too:
the record script returns the entries after the last one this replica read, and its reader
calls XREAD itself only after FEED_GATHER_S without such a write (an idle replica, or one
whose records were all written lately). Either read may bring entries the other applied
already; each entry is applied once, in the stream's order.

The copy is trusted to answer only while it is shown to agree with Redis: a replica compares
its lookups' answers from Redis with its copy's (and repairs the copy where Redis knows more)
until the last `WINDOW` comparisons found at most `TRUST_STALE` holders the copy lacked; then
it answers from the copy, still comparing one lookup in `CHECK_EVERY` in the background, and goes
back to round trips when more than `DISTRUST_STALE` of the window are stale, when a writer's
numbers skip (a batch lost, the stream trimmed past this reader), when an entry cannot be read,
or when Redis is away. A replica that joins late reads the stream's retained history first;
what was written before that is learned from the comparisons.

This module is pure: the entry format, the bookkeeping, and applying entries to the copy. The
reading is index_redis.py's.
"""

from __future__ import annotations

import struct
import uuid
from array import array
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

FEED_VERSION = 2  # (index_lua.py's record script writes it: change both)
# Entries the stream keeps (approximately: MAXLEN ~). A reader further behind than this loses
# entries, sees a writer's numbers skip, and goes back to round trips until the copy agrees again.
# Redis holds ~22 bytes a block in an entry: at most ~23 MB for 2,048 entries of a full write
# call's 512 blocks (a few MB in practice: a batch carries only the blocks not written lately).
FEED_MAXLEN = 2048
FEED_COUNT = 256  # entries a read takes at most
FEED_BLOCK_MS = 500  # a read waits this long for a new entry (below the client's socket timeout)
# After a read that found entries, the next waits this long first: the entries of every
# replica's next flush come in one read, not one each (a replica reads at most ~50 times a
# second, whatever the number of replicas), at the cost of the copy lagging by as much.
# (5 ms read nearly every flush of every replica: three replicas behind nginx spent 10-25%
# more CPU per request than at 20-25 ms, with the same hit ratio; docs/deployment.md.)
FEED_GATHER_S = 0.02
WINDOW = 64  # comparisons the trust is judged over
TRUST_STALE = 2  # the copy answers once at most this many of the window were stale...
DISTRUST_STALE = 8  # ... and stops when more than this many are
CHECK_EVERY = 64  # while trusted: one lookup in this many is compared, in the background


class Record(NamedTuple):
    backend: str
    ts: float  # the writer's time for it, a score (seconds since the index's SCORE_EPOCH)
    first: int  # index of its first block in the prompt (0: it starts the prompt)
    blocks: Sequence[int]


_VERSION = str(FEED_VERSION).encode()
_COUNTS = struct.Struct("<II")  # the writer's number for the call, records
_RECORD = struct.Struct("<dIII")  # time, first block, key length, blocks' length (bytes)


def pack_entry(
    writer: bytes, seq: int, records: Sequence[tuple[str | bytes, float, int, Sequence[int]]]
) -> bytes:
    """An entry's `d` field: the batch (records: ZSET key, time, first block, block hashes) as
    the writer sends it to the record script, which writes the records and appends this to
    the stream as it came (index_lua.py)."""
    parts = [bytes([len(writer)]), writer, _COUNTS.pack(seq, len(records))]
    pack = _RECORD.pack
    for key, ts, first, blocks in records:
        k = key.encode() if isinstance(key, str) else key
        packed = array("Q", blocks).tobytes()
        parts += [pack(ts, first, len(k), len(packed)), k, packed]
    return b"".join(parts)


def encode(
    writer: bytes, seq: int, records: Sequence[tuple[str | bytes, float, int, Sequence[int]]]
) -> dict[bytes, bytes]:
    """An entry's fields as a Redis client returns them; for tests and tools."""
    return {b"v": _VERSION, b"d": pack_entry(writer, seq, records)}


def decode(fields: Mapping[Any, Any], name_from: int) -> tuple[bytes, int, list[Record]]:
    """(writer, seq, records) of an entry's fields as a Redis client returns them (names and
    values as bytes); a record's backend is its key from `name_from` on. ValueError for
    anything that is not an entry of this format."""
    writer, seq, n, data, at = _head(fields)
    return writer, seq, _records(data, at, n, name_from)


def _head(fields: Mapping[Any, Any]) -> tuple[bytes, int, int, bytes, int]:
    """(writer, seq, records, the packed batch, where its first record starts)."""
    version = fields.get(b"v")
    if version != _VERSION:
        raise ValueError(f"feed entry of format {version!r}, not {FEED_VERSION}")
    data = fields.get(b"d")
    if not isinstance(data, bytes) or not data:
        raise ValueError("feed entry without its records")
    at = data[0] + 1
    writer = data[1:at]
    if not writer or len(data) < at + _COUNTS.size:
        raise ValueError("feed entry without a writer")
    seq, n = _COUNTS.unpack_from(data, at)
    return writer, seq, n, data, at + _COUNTS.size


def _records(data: bytes, at: int, n: int, name_from: int) -> list[Record]:
    records = []
    end, size, unpack = len(data), _RECORD.size, _RECORD.unpack_from
    for j in range(1, n + 1):
        if at + size > end:
            raise ValueError(f"feed entry's record {j} is cut short")
        ts, first, key_len, blocks_len = unpack(data, at)
        at += size + key_len
        if blocks_len % 8 or at + blocks_len > end:
            raise ValueError(f"feed entry's record {j} has no whole block hashes")
        blocks = array("Q")
        blocks.frombytes(data[at : at + blocks_len])
        key = data[at - key_len : at]
        records.append(Record(key[name_from:].decode(), ts, first, blocks))
        at += blocks_len
    if at != end:
        raise ValueError(f"feed entry has {end - at} bytes past its {n} records")
    return records


def new_writer_id() -> bytes:
    """This process's id in the feed: a restarted replica is a new writer, numbered from 1."""
    return uuid.uuid4().bytes


class Feed:
    """Where this replica stands with the feed: its own numbering as a writer, the last number
    seen of every other writer, and whether its copy may answer lookups."""

    def __init__(self, writer: bytes | None = None) -> None:
        self.writer = writer or new_writer_id()
        if len(self.writer) > 255:
            raise ValueError("a feed writer's id is at most 255 bytes")
        self.position: str | None = None  # the last stream entry read (None: not yet read)
        self._at: tuple[int, int] = (-1, -1)  # ... as numbers, to order the entries read
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
            "read_twice": 0,  # entries both a write's read and the reader's brought
            "gaps": 0,  # a writer's numbers skipped
            "malformed": 0,
            "comparisons": 0,
            "stale": 0,  # comparisons where Redis knew holders (or depth) the copy lacked
            "repaired_holders": 0,
            "ahead": 0,  # comparisons where the copy held more than Redis
            "trusted_times": 0,
            "distrusted_times": 0,
        }

    def read_from(self) -> str:
        """The first stream id the next read can find (XRANGE's start, inclusive); "" before
        the first read, which the reader makes (from the stream's oldest entry)."""
        return f"{self._at[0]}-{self._at[1] + 1}" if self.position is not None else ""

    def next_seq(self) -> int:
        self._sent += 1
        return self._sent

    def read(
        self, entry_id: str, fields: Mapping[Any, Any] | Sequence[Any], name_from: int
    ) -> list[Record]:
        """An entry read from the stream: the records to apply (none of this replica's own,
        nor of an entry read already: the reads that come with the writes and the reader's own
        may overlap, and each entry is applied once, in the stream's order). Fields as a
        mapping (XREAD's) or flat, names and values in turn (XRANGE's in a script)."""
        ms, _, sub = entry_id.partition("-")
        if not (ms.isdigit() and sub.isdigit()):
            self.counters["malformed"] += 1
            self.distrust(f"unreadable feed entry id {entry_id!r}")
            return []
        order = (int(ms), int(sub))
        if order <= self._at:
            self.counters["read_twice"] += 1
            return []
        self.position, self._at = entry_id, order
        if not isinstance(fields, Mapping):
            pairs = iter(fields)
            fields = dict(zip(pairs, pairs, strict=False))
        try:
            writer, seq, n, data, at = _head(fields)
            if writer == self.writer:  # (its records are not even read)
                self.counters["own_entries"] += 1
                return []
            records = _records(data, at, n, name_from)
        except (ValueError, TypeError, UnicodeDecodeError) as e:
            self.counters["malformed"] += 1
            self.distrust(f"unreadable feed entry {entry_id}: {e}")
            return []
        last = self._seen.get(writer)
        self._seen[writer] = seq
        if last is not None and seq != last + 1:
            self.counters["gaps"] += 1
            self.distrust(f"a writer's entries {last + 1}..{seq - 1} were not read")
        self.counters["entries"] += 1
        self.counters["records"] += len(records)
        return records

    def apply(
        self,
        entries: Sequence[Sequence[Any]],
        copy: Any,
        forgot_at: Mapping[str, float],
        now: float,
        oldest: float,
        name_from: int,
    ) -> int:
        """Entries read from the stream, (id, fields) each: the other replicas' records go into
        `copy` (a MemoryPrefixIndex) as of `now`, those older than `oldest` (a score) or made
        before this replica forgot their backend (`forgot_at`, scores) left out; returns the
        records applied."""
        applied = 0
        for entry_id, fields in entries:
            eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            for rec in self.read(eid, fields, name_from):
                gone = forgot_at.get(rec.backend)
                if gone is not None and rec.ts <= gone:
                    continue  # written before this replica forgot the backend
                if rec.ts >= oldest and rec.blocks:
                    # As of now, when this replica learns it: the writer's clock may differ
                    # from ours, and a copy out of time order is searched backend by backend.
                    copy.record_now(rec.backend, rec.blocks, now, first=rec.first)
                    applied += 1
        return applied

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
