"""The shared index's feed: replicas answer lookups from their own copy once it agrees with
Redis, learn each other's writes through one stream, and go back to round trips when it may
not (a lost entry, an unreadable one, an outage, too many disagreements)."""

from __future__ import annotations

import struct
from array import array
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from proxy.routing import index_feed
from proxy.routing.index import RedisPrefixIndex, open_redis
from proxy.routing.index_feed import CHECK_EVERY, WINDOW, Feed, decode, encode
from tests.routing_support import SHARED_URL, delete_prefix, unique_prefix, until

FLEET = ("b0", "b1", "b2", "b3")
PROMPT = [11, 12, 13, 14, 15, 16]
OTHER = [21, 22, 23, 24]


def _packed(blocks: list[int]) -> bytes:
    return array("Q", blocks).tobytes()


KEY = "wr:{wr:pfx}:"  # a backend's ZSET key is this and its name


def _entry(writer: bytes, seq: int, records: list[tuple[str, float, int, list[int]]]) -> dict:
    """An entry's fields as the record script writes them and redis-py reads them back."""
    return encode(
        writer, seq, [(KEY + name, ts, first, blocks) for name, ts, first, blocks in records]
    )


def test_an_entry_reads_back_as_written() -> None:
    writer = b"w" * 16
    fields = _entry(writer, 7, [("b0", 12.5, 0, [1, 2**64 - 1]), ("é", 3.0, 4, [])])
    assert set(fields) == {b"v", b"d"}  # one string for the whole batch
    got_writer, seq, records = decode(fields, len(KEY))
    assert (got_writer, seq) == (writer, 7)
    assert [(r.backend, r.ts, r.first, list(r.blocks)) for r in records] == [
        ("b0", 12.5, 0, [1, 2**64 - 1]),
        ("é", 3.0, 4, []),
    ]


def _broken() -> list[dict]:
    good = _entry(b"w" * 16, 1, [("b0", 1.0, 0, [1, 2])])
    d = good[b"d"]
    head = 1 + 16 + 8  # the writer's length and id, its number and the records'
    v1 = {b"v": b"1", b"w": b"w" * 16, b"s": b"1", b"n": b"1", b"k1": (KEY + "b0").encode()}
    v1 |= {b"t1": b"1.0", b"f1": b"0", b"b1": _packed([1, 2])}  # (an older replica's)
    one_byte_more = struct.pack("<dIII", 1.0, 0, len(KEY) + 2, 17)
    return [
        {},
        v1,
        {**good, b"v": b"1"},
        {b"v": b"2"},
        {**good, b"d": b"\x00" + d[17:]},  # no writer
        {**good, b"d": d[:head]},  # its record missing
        {**good, b"d": d[:-1]},  # cut short
        {**good, b"d": d + b"\x00"},  # past its records
        {**good, b"d": d[:head] + one_byte_more + (KEY + "b0").encode() + b"\x01" * 17},
    ]


@pytest.mark.parametrize("fields", _broken())
def test_an_entry_not_of_this_format_is_refused(fields: dict) -> None:
    with pytest.raises(ValueError):
        decode(fields, len(KEY))


def test_an_unreadable_or_skipped_entry_withdraws_the_copys_trust() -> None:
    feed, other = Feed(), b"o" * 16
    _trust(feed)
    assert feed.read("1-0", {b"v": b"1"}, len(KEY)) == [] and not feed.trusted
    assert feed.counters["malformed"] == 1 and "unreadable" in feed.why
    _trust(feed)
    assert len(feed.read("2-0", _entry(other, 1, [("b0", 1.0, 0, [1])]), len(KEY))) == 1
    assert feed.trusted  # a writer's first entry: nothing to compare its number with
    feed.read("3-0", _entry(other, 3, []), len(KEY))  # 2 never arrived
    assert not feed.trusted and feed.counters["gaps"] == 1
    # Its own entries are not applied again (the copy took them when recorded).
    own = _entry(feed.writer, feed.next_seq(), [("b0", 1.0, 0, [1])])
    assert feed.read("4-0", own, len(KEY)) == []
    assert feed.counters["own_entries"] == 1 and feed.position == "4-0"


def test_trust_follows_the_comparisons_over_a_window() -> None:
    feed = Feed()
    for _ in range(WINDOW - 1):
        assert not feed.compared(0, 0)
    assert feed.compared(0, 0) and feed.trusted  # a full window that agreed
    flips = [feed.compared(1, 0) for _ in range(index_feed.DISTRUST_STALE + 1)]
    assert flips[-1] and not any(flips[:-1]) and not feed.trusted
    # Distrusted, the window starts again: stale answers past TRUST_STALE keep it distrusted.
    for _ in range(WINDOW):
        feed.compared(1 if _ < index_feed.TRUST_STALE + 1 else 0, 0)
    assert not feed.trusted
    feed.compared(0, 0)  # the oldest stale answer leaves the window
    assert feed.trusted
    checks = [feed.check_due() for _ in range(3 * CHECK_EVERY)]
    assert sum(checks) == 3 and checks[CHECK_EVERY - 1]


def _trust(feed: Feed) -> None:
    for _ in range(WINDOW):
        feed.compared(0, 0)
    assert feed.trusted


@pytest.fixture
def prefix() -> Iterator[str]:
    kp = unique_prefix("feed")
    yield kp
    delete_prefix(kp)


@pytest.fixture
async def pair(prefix: str) -> AsyncIterator[tuple[RedisPrefixIndex, RedisPrefixIndex]]:
    """Two replicas' indexes on one key prefix, their background tasks not started: each
    flush and feed read is the test's (no timing in it)."""
    a = RedisPrefixIndex(open_redis(SHARED_URL), key_prefix=prefix, owns_client=True)
    b = RedisPrefixIndex(open_redis(SHARED_URL), key_prefix=prefix, owns_client=True)
    yield a, b
    await a.close()
    await b.close()


async def _lookups_until_trusted(index: RedisPrefixIndex) -> None:
    for _ in range(WINDOW):
        await index.holders(PROMPT, FLEET)
    assert index.feed.trusted, index.info()["feed"]


@pytest.mark.redis
async def test_a_replica_answers_from_its_copy_what_another_wrote(
    pair: tuple[RedisPrefixIndex, RedisPrefixIndex],
) -> None:
    a, b = pair
    a.record("b0", PROMPT)
    await a.flush()
    assert await b.pull_feed() == 1  # the first read takes the stream's history
    assert b.local.holders_now(PROMPT, FLEET) == {"b0": 6}
    await _lookups_until_trusted(b)
    assert b.counters["lookups"] == WINDOW and b.info()["feed"]["stale"] == 0
    # From now on: no round trip, and the other replica's new writes are there once read.
    a.record("b2", OTHER)
    a.record("b1", PROMPT[:3])
    await a.flush()
    assert await b.holders(OTHER, FLEET) == {}  # not read yet
    assert await b.pull_feed() == 2
    assert await b.holders(OTHER, FLEET) == {"b2": 4}
    assert await b.holders(PROMPT, FLEET) == {"b0": 6, "b1": 3}
    assert b.counters["lookups"] == WINDOW and b.counters["copy_lookups"] == 3
    assert await a.pull_feed() == 0  # a replica's own entries are not applied again
    assert a.feed.counters["own_entries"] == 2  # both its flushes


@pytest.mark.redis
async def test_what_redis_knows_and_the_copy_missed_is_learned_from_the_lookup(
    pair: tuple[RedisPrefixIndex, RedisPrefixIndex], prefix: str
) -> None:
    a, b = pair
    a.record("b3", PROMPT)
    await a.flush()
    redis.Redis.from_url(SHARED_URL).delete(a.feed_key())  # as if trimmed before b read it
    assert await b.pull_feed() == 0
    assert await b.holders(PROMPT, FLEET) == {"b3": 6}  # Redis's answer...
    assert b.local.holders_now(PROMPT, FLEET) == {"b3": 6}  # ... taught to the copy
    feed = b.info()["feed"]
    assert (feed["stale"], feed["repaired_holders"], feed["answers_lookups"]) == (1, 1, False)


@pytest.mark.redis
async def test_a_lost_entry_sends_lookups_back_to_redis(
    pair: tuple[RedisPrefixIndex, RedisPrefixIndex],
) -> None:
    a, b = pair
    a.record("b0", PROMPT)
    await a.flush()
    await b.pull_feed()
    await _lookups_until_trusted(b)
    a.feed.next_seq()  # a batch numbered but never appended: b cannot know what it held
    a.record("b1", OTHER)
    await a.flush()
    await b.pull_feed()
    assert not b.feed.trusted and b.feed.counters["gaps"] == 1
    before = b.counters["lookups"]
    assert await b.holders(PROMPT, FLEET) == {"b0": 6}
    assert b.counters["lookups"] == before + 1  # a round trip again


@pytest.mark.redis
async def test_the_feed_is_off_with_local_lookups_false(prefix: str) -> None:
    a = RedisPrefixIndex(
        open_redis(SHARED_URL), key_prefix=prefix, owns_client=True, local_lookups=False
    )
    try:
        a.record("b0", PROMPT)
        await a.flush()
        for _ in range(WINDOW + 1):
            assert await a.holders(PROMPT, FLEET) == {"b0": 6}
        assert a.counters["lookups"] == WINDOW + 1 and not a.feed.trusted
        assert a.info()["feed"]["comparisons"] == 0
    finally:
        await a.close()


@pytest.fixture
async def started(
    pair: tuple[RedisPrefixIndex, RedisPrefixIndex],
) -> tuple[RedisPrefixIndex, RedisPrefixIndex]:
    """The pair with their background tasks running, b's copy answering what a wrote."""
    a, b = pair
    await a.start()
    await b.start()
    a.record("b0", PROMPT)
    await a.flush()
    await until(lambda: b.local.occupancy("b0") == len(PROMPT))  # read by b's feed reader
    await _lookups_until_trusted(b)
    return a, b


@pytest.mark.redis
async def test_started_replicas_read_each_others_writes_in_the_background(
    started: tuple[RedisPrefixIndex, RedisPrefixIndex],
) -> None:
    a, b = started
    b.record("b1", OTHER)
    await b.flush()
    await until(lambda: a.local.occupancy("b1") == len(OTHER))
    assert b.info()["feed"]["entries"] >= 1 and a.info()["feed"]["entries"] >= 1


async def test_an_outage_withdraws_the_copys_trust() -> None:
    index = RedisPrefixIndex(redis.asyncio.Redis(port=1), key_prefix="wr", reconnect_min_s=60)
    _trust(index.feed)
    index._went_down(ConnectionError("refused"))
    assert not index.feed.trusted and "unavailable" in index.feed.why
    await index.close()


@pytest.mark.redis
async def test_with_the_feed_the_learners_evidence_holds_every_replicas_records(
    pair: tuple[RedisPrefixIndex, RedisPrefixIndex],
) -> None:
    """The copy holds the other replicas' records once read: occupancy counts them, and a
    match on one is dated when this replica learned of it (not "just now", unknown)."""
    a, b = pair
    theirs, ours = list(range(1, 51)), list(range(1000, 1005))
    a.record("x", theirs)
    await a.flush()
    b.record("x", ours)
    await b.flush()
    before = b.now()
    await b.pull_feed()
    after = b.now()
    assert b.local.occupancy("x") == 55 and b.occupancy("x") == 55
    seen = b.probe("x", theirs, 50).last_seen
    assert seen is not None and before <= seen <= after


@pytest.mark.redis
async def test_a_trusted_copy_is_still_checked_in_the_background_and_repaired(
    started: tuple[RedisPrefixIndex, RedisPrefixIndex],
) -> None:
    _, b = started
    b.local.forget("b0")  # the copy lost what Redis holds (as a missed entry would)
    before = b.feed.counters["comparisons"]
    for _ in range(CHECK_EVERY):
        assert await b.holders(PROMPT, FLEET) == {}  # answered from the copy, at once
    await until(lambda: b.feed.counters["comparisons"] > before)  # the one check came back
    assert b.feed.counters["stale"] == 1 and b.feed.trusted
    assert await b.holders(PROMPT, FLEET) == {"b0": 6}  # repaired by it
    assert b.counters["lookups"] == WINDOW  # no lookup waited on Redis


@pytest.mark.redis
async def test_a_forgotten_backends_records_in_flight_do_not_bring_it_back(
    pair: tuple[RedisPrefixIndex, RedisPrefixIndex],
) -> None:
    a, b = pair
    a.record("gone", PROMPT)
    await a.flush()
    b.forget("gone")  # it left the fleet; a's batch for it is still unread here
    await b.pull_feed()
    assert b.local.occupancy("gone") == 0
    a.record("gone", OTHER)  # the address rejoined: records made since count again
    await a.flush()
    await b.pull_feed()
    assert b.local.occupancy("gone") == len(OTHER)


@pytest.mark.redis
async def test_the_record_scripts_entry_is_the_batch_exactly(
    pair: tuple[RedisPrefixIndex, RedisPrefixIndex],
) -> None:
    a, b = pair
    a.record("b0", PROMPT)
    a.record("é", OTHER)
    a.record("b0", [*PROMPT, 2**64 - 1])  # only its last block is new
    sent = [(name, ts, first, list(blocks)) for name, blocks, ts, first in a._pending]
    await a.flush()
    [(_, fields)] = redis.Redis.from_url(SHARED_URL).xrange(a.feed_key())
    writer, seq, records = decode(fields, b._name_at - 1)
    assert (writer, seq) == (a.feed.writer, 1)
    assert [(r.backend, r.ts, r.first, list(r.blocks)) for r in records] == sent
    assert sent[2][2:] == (6, [2**64 - 1])


def test_an_entry_read_twice_is_applied_once() -> None:
    feed, other = Feed(), b"o" * 16
    assert feed.read_from() == ""  # the reader reads first, from the stream's oldest entry
    entry = _entry(other, 1, [("b0", 1.0, 0, [1])])
    assert len(feed.read("5-3", entry, len(KEY))) == 1 and feed.read_from() == "5-4"
    flat = [x for pair in entry.items() for x in pair]  # as XRANGE returns it in a script
    assert feed.read("5-3", flat, len(KEY)) == [] and feed.read("4-9", entry, len(KEY)) == []
    assert feed.counters["read_twice"] == 2 and feed.counters["gaps"] == 0
    assert len(feed.read("6-0", _entry(other, 2, [("b1", 2.0, 0, [2])]), len(KEY))) == 1
    assert feed.position == "6-0" and feed.counters["entries"] == 2
    assert feed.read("7", entry, len(KEY)) == [] and feed.counters["malformed"] == 1


@pytest.mark.redis
async def test_a_write_reads_the_feed_with_it(
    pair: tuple[RedisPrefixIndex, RedisPrefixIndex],
) -> None:
    a, b = pair
    b.reads_with_writes = True  # (as start() sets it when its reader runs)
    b.record("b1", OTHER)
    await b.flush()  # not read yet: the reader's first read takes the history
    assert b.counters["writes_read"] == 0 and await b.pull_feed() == 0
    a.record("b0", PROMPT)
    await a.flush()
    b.record("b2", OTHER)
    await b.flush()  # a's entry comes back with b's write, then b's own
    assert b.counters["writes_read"] == 1
    assert b.local.holders_now(PROMPT, FLEET) == {"b0": 6}
    assert b.feed.counters["entries"] == 1 and b.feed.counters["own_entries"] == 2
    assert await b.pull_feed() == 0 and b.feed.counters["read_twice"] == 0


@pytest.mark.redis
async def test_a_prompts_continuation_waits_for_company_and_its_start_does_not(
    prefix: str,
) -> None:
    index = RedisPrefixIndex(open_redis(SHARED_URL), key_prefix=prefix, owns_client=True)
    index.tail_wait_s = 3600.0  # a continuation alone would wait the whole test out
    await index.start()
    client = redis.Redis.from_url(SHARED_URL)
    try:
        index.record("b0", PROMPT)  # a start: written within FLUSH_INTERVAL_S
        await until(lambda: client.xlen(index.feed_key()) == 1)
        index.record("b0", [*PROMPT, 17])  # its continuation: block 17 only, waiting...
        index.record("b1", OTHER)  # ... until another prompt's start is written
        await until(lambda: client.xlen(index.feed_key()) == 2)
        [first, second] = [f for _, f in client.xrange(index.feed_key())]
        assert [len(decode(f, index._name_at - 1)[2]) for f in (first, second)] == [1, 2]
        [(_, _, records)] = [decode(second, index._name_at - 1)]
        assert [(r.backend, r.first, list(r.blocks)) for r in records] == [
            ("b0", 6, [17]),
            ("b1", 0, OTHER),
        ]
    finally:
        await index.close()
