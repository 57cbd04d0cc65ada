"""The prefix index: memory and Redis stores agree, one round trip, bounded, survives outages."""

from __future__ import annotations

import asyncio
import random
import struct
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
from redis.asyncio.connection import Connection
from redis.crc import key_slot

from proxy.routing import index_lua
from proxy.routing.blockmap import KEEPS_KEY_OBJECTS
from proxy.routing.index import (
    TIMEOUTS_TO_OUTAGE,
    MemoryPrefixIndex,
    RedisPrefixIndex,
    TimeoutStreak,
    _sentinel_parts,
    capacity_blocks_from_tokens,
    open_redis,
)
from proxy.routing.index_lua import BLOCKS_PER_CALL
from tests.routing_support import (
    HAVE_REDIS_SERVER,
    SHARED_URL,
    RedisProcess,
    delete_prefix,
    unique_prefix,
    until,
)
from tests.support import free_port

BACKENDS = [f"b{i}" for i in range(8)]


@pytest.fixture
def prefix() -> Iterator[str]:
    kp = unique_prefix("idx")
    yield kp
    delete_prefix(kp)


@pytest.fixture
async def shared(prefix: str) -> AsyncIterator[RedisPrefixIndex]:
    index = RedisPrefixIndex(open_redis(SHARED_URL), key_prefix=prefix, owns_client=True)
    await index.start()
    yield index
    await index.close()


@pytest.fixture
def private(tmp_path: Path) -> Iterator[RedisProcess]:
    if not HAVE_REDIS_SERVER:
        pytest.skip("redis-server binary not installed")
    server = RedisProcess(tmp_path).start()
    yield server
    server.stop()


def prompts(seed: int, n: int = 30) -> list[list[int]]:
    """Prompts as block chains: a few shared system prompts, each with its own tails."""
    rng = random.Random(seed)
    systems = [[rng.getrandbits(64) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    return [
        rng.choice(systems) + [rng.getrandbits(64) for _ in range(rng.randint(0, 30))]
        for _ in range(n)
    ]


@pytest.mark.redis
async def test_memory_and_redis_lookups_agree(shared: RedisPrefixIndex) -> None:
    memory = MemoryPrefixIndex()
    rng = random.Random(7)
    chains = prompts(1)
    for chain in chains:
        backend = rng.choice(BACKENDS)
        memory.record(backend, chain)
        shared.record(backend, chain)
    await shared.flush()
    for chain in [*chains, *prompts(2)]:
        for length in (1, len(chain) // 2, len(chain)):
            probe = chain[: max(length, 1)]
            assert await shared.lookup(probe, BACKENDS) == await memory.lookup(probe, BACKENDS)


def test_a_batch_of_records_goes_in_calls_short_in_records_and_in_blocks() -> None:
    """One script call runs atomically: a lookup that comes in meanwhile waits for it."""
    sizes = [300, 300, 100, 700, 10, 10, 2000] + [1] * 100
    batch = [(f"b{i}", list(range(n)), 0.0, 0) for i, n in enumerate(sizes)]
    calls = list(index_lua.record_calls(batch))
    assert [start for start, _ in calls] == [0, 1, 3, 4, 6, 7, 71]
    assert [r for _, chunk in calls for r in chunk] == batch  # each record once, in order
    for _, chunk in calls:
        assert len(chunk) <= index_lua.RECORDS_PER_CALL
        assert len(chunk) == 1 or sum(len(b) for _, b, _, _ in chunk) <= BLOCKS_PER_CALL


def test_a_calls_keys_name_each_zset_once_then_the_head_sets() -> None:
    """The record script's KEYS and per-record table (index_lua.py): a backend written by two
    records of a call is one KEY; head sets follow the ZSETs; a continuation has none."""
    rows = [("z:b0", "h:1", 100), ("z:b1", "h:2", 200), ("z:b0", "", 100), ("z:b1", "h:1", 200)]
    keys, table = index_lua.record_keys(rows)
    assert keys == ["z:b0", "z:b1", "h:1", "h:2"]
    assert struct.unpack("<12I", table) == (1, 100, 3, 2, 200, 4, 1, 100, 0, 2, 200, 3)


@pytest.mark.redis
async def test_records_larger_than_a_call_are_all_written(
    shared: RedisPrefixIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    script = shared._record_script

    async def counted(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        return await script(*args, **kwargs)

    monkeypatch.setattr(shared, "_record_script", counted)
    chains = [[(k << 20) + i for i in range(BLOCKS_PER_CALL // 2 + 7)] for k in range(1, 9)]
    for k, chain in enumerate(chains):
        shared.record(BACKENDS[k], chain)
    await shared.flush()
    assert calls == 8  # no two of them fit one call
    for k, chain in enumerate(chains):
        assert await shared.lookup(chain, BACKENDS[:8]) == {
            b: len(chain) if b == BACKENDS[k] else 0 for b in BACKENDS[:8]
        }


@pytest.mark.redis
async def test_longest_match_is_the_shared_prefix_length(shared: RedisPrefixIndex) -> None:
    stored = list(range(1, 101))
    shared.record("b0", stored)
    await shared.flush()
    probe = stored[:37] + [10_000 + i for i in range(50)]
    assert await shared.lookup(probe, ["b0", "b1"]) == {"b0": 37, "b1": 0}


@pytest.mark.redis
async def test_lookup_of_all_backends_is_one_round_trip(
    shared: RedisPrefixIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared.record("b3", list(range(1, 300)))
    await shared.flush()
    await shared.lookup([1, 2], BACKENDS)  # the connection is open and the script cached
    sent: list[object] = []
    original = Connection.send_packed_command

    async def counting(self: Connection, command: object, check_health: bool = True) -> None:
        sent.append(command)
        await original(self, command, check_health)

    monkeypatch.setattr(Connection, "send_packed_command", counting)
    found = await shared.lookup(list(range(1, 300)), BACKENDS)
    assert found["b3"] == 299
    # (The feed's reader re-arms its blocking XREAD on a connection of its own whenever it
    # wakes: under load one of those can fall in this window. It is not the lookup's.)
    packed = [c if isinstance(c, bytes) else b"".join(c) for c in sent]  # type: ignore[call-overload]
    lookups = [c for c in packed if b"XREAD" not in c]
    assert len(lookups) == 1


def test_all_keys_of_an_index_hash_to_one_cluster_slot() -> None:
    index = RedisPrefixIndex(redis.asyncio.Redis(), key_prefix="wr")
    keys = [index.key(b) for b in ["a", "b", "gpu-7:8000", "{odd}"]]
    keys += [index.head_key(7), index.feed_key()]
    assert all(k.startswith("wr:") for k in keys)
    assert len({key_slot(k.encode()) for k in keys}) == 1


@pytest.mark.redis
async def test_capacity_bound_holds_and_evicts_oldest_prompts_tails_first(
    shared: RedisPrefixIndex,
) -> None:
    shared.set_capacity("b0", 50)
    assert shared.info()["capacity"] == {"b0": 50}  # what /admin/routing shows
    chains = [[1000 * p + i for i in range(1, 21)] for p in range(10)]  # 10 prompts x 20 blocks
    for chain in chains:
        shared.record("b0", chain)
    await shared.flush()
    client = redis.Redis.from_url(SHARED_URL)
    assert client.zcard(shared.key("b0")) == 50
    assert 0 < client.pttl(shared.key("b0")) <= shared.ttl_s * 1000
    client.close()
    assert shared.local.size("b0") == 50
    for idx in (shared, shared.local):
        found = [(await idx.lookup(c, ["b0"]))["b0"] for c in chains]
        assert found[-2:] == [20, 20]  # the newest prompts are whole
        assert found[0] == 0  # the oldest is gone
        partial = [f for f in found if 0 < f < 20]
        # Where a prompt was cut, its head survived (tails go first), so the match is a prefix.
        assert all(f >= 1 for f in partial)


def test_memory_index_ages_entries_out_after_ttl() -> None:
    now = [0.0]
    index = MemoryPrefixIndex(ttl_s=10, clock=lambda: now[0])
    index.record("a", [1, 2, 3])
    now[0] = 5
    index.record("a", [1, 2])
    now[0] = 12
    assert index.lookup_now([1, 2, 3], ["a"]) == {"a": 2}
    now[0] = 16
    assert index.lookup_now([1, 2, 3], ["a"]) == {"a": 0}


def test_a_block_several_backends_hold_is_counted_and_one_object_in_dicts() -> None:
    """Each request hashes its prompt into int objects of its own. Where the index's maps are
    dicts (the pure install), it keeps one object per shared block (memory_bounds.py: 86 -> 59
    B a (block, backend) entry); the C maps keep no key objects at all."""
    index = MemoryPrefixIndex(capacity_blocks=4, clock=lambda: 0.0)

    def hashed() -> list[int]:
        return [int(str(10**18 + i)) for i in range(3)]  # new objects at every call

    for name in ("a", "b", "c"):
        index.record_now(name, hashed())
    a, b, c = (list(index._lru[name]) for name in "abc")
    if KEEPS_KEY_OBJECTS:
        assert all(b[i] is c[i] and a[i] is not b[i] for i in range(3))
    assert index.info()["shared_blocks"] == 3
    index.record_now("b", hashed(), now=5.0)  # touched again: still the shared object
    if KEEPS_KEY_OBJECTS:
        assert all(x is y for x, y in zip(index._lru["b"], c, strict=True))
    assert index.lookup_now(hashed(), ["a", "b", "c"]) == {"a": 3, "b": 3, "c": 3}
    index.forget("b")
    assert index.info()["shared_blocks"] == 3  # "a" and "c" hold them
    index.forget("c")
    assert index.info()["shared_blocks"] == 0  # "a" alone
    index.record_now("c", hashed())
    index.record_now("a", [7, 8, 9, 10])  # trims "a"'s three: "c" alone holds them now
    assert index.info()["shared_blocks"] == 0 and index.lookup_now(hashed(), ["a"]) == {"a": 0}
    assert index.lookup_now(hashed(), ["a", "c"]) == {"a": 0, "c": 3}
    index.record_now("a", hashed(), now=6.0)
    assert index.info()["shared_blocks"] == 3 and index.info()["distinct_blocks"] == 4


def test_capacity_from_engine_kv_pool() -> None:
    # 8192 GPU blocks of 16 tokens ≈ 131k tokens ≈ 524k chars ≈ 8192 blocks of 64 chars.
    assert capacity_blocks_from_tokens(8192 * 16, 64) == 8192


@pytest.mark.e2e
@pytest.mark.redis
async def test_redis_killed_mid_run_falls_back_within_the_timeout_and_recovers(
    private: RedisProcess,
) -> None:
    index = RedisPrefixIndex(
        open_redis(private.url),
        key_prefix="wr",
        timeout_s=0.05,
        owns_client=True,
        reconnect_min_s=0.02,
        reconnect_max_s=0.1,
    )
    await index.start()
    try:
        index.record("b0", [1, 2, 3, 4])
        await index.flush()
        assert await index.lookup([1, 2, 3, 4], ["b0", "b1"]) == {"b0": 4, "b1": 0}

        private.stop()
        start = time.perf_counter()
        found = await index.lookup([1, 2, 3, 4], ["b0", "b1"])
        assert time.perf_counter() - start < 0.2
        assert found == {"b0": 4, "b1": 0}  # answered by the warm local copy
        assert index.mode == "memory-fallback"
        index.record("b1", [1, 2, 9])  # recorded during the outage

        private.start()  # same port, empty: a restarted Redis without persistence
        await asyncio.wait_for(index.wait_shared(), 5)
        await index.flush()
        assert index.mode == "redis"
        info = index.info()
        assert info["outages"] == 1 and info["reconnects"] == 1
        assert info["reseeded_backends"] == 2
        # Another replica, with its own client, sees what this one knew before the restart and
        # what it recorded during the outage.
        peer = RedisPrefixIndex(open_redis(private.url), key_prefix="wr", owns_client=True)
        assert await peer.lookup([1, 2, 3, 4], ["b0", "b1"]) == {"b0": 4, "b1": 2}
        assert await peer.lookup([1, 2, 9], ["b0", "b1"]) == {"b0": 2, "b1": 3}
        await peer.close()
    finally:
        await index.close()


@pytest.mark.e2e
@pytest.mark.redis
async def test_a_frozen_redis_costs_a_request_at_most_the_timeout_and_falls_back_after_a_few(
    private: RedisProcess,
) -> None:
    index = RedisPrefixIndex(
        open_redis(private.url),
        key_prefix="wr",
        timeout_s=0.05,
        owns_client=True,
        reconnect_min_s=0.02,
        reconnect_max_s=0.05,
    )
    await index.start()
    admin = private.client()
    try:
        index.record("b0", [5, 6])
        await index.flush()
        admin.execute_command("CLIENT", "PAUSE", "1000", "ALL")
        # One timeout may be this process being slow; TIMEOUTS_TO_OUTAGE in a row, each on a
        # lookup started after the previous one timed out, is Redis not answering.
        for _ in range(TIMEOUTS_TO_OUTAGE):
            assert index.mode == "redis"
            start = time.perf_counter()
            found = await index.lookup([5, 6], ["b0"])
            assert time.perf_counter() - start < 0.15
            assert found == {"b0": 2}  # answered by the warm local copy
        assert index.mode == "memory-fallback"
        # Later requests do not wait at all while Redis is down: the lookup finishes on its
        # first step, without suspending once (no clock needed to say so).
        later = index.lookup([5, 6], ["b0"])
        with pytest.raises(StopIteration) as answered:
            later.send(None)
        assert answered.value.value == {"b0": 2}
        await asyncio.wait_for(index.wait_shared(), 5)  # the pause ends; sharing resumes
        assert await index.lookup([5, 6], ["b0"]) == {"b0": 2}
        info = index.info()
        assert info["lookup_timeouts"] == TIMEOUTS_TO_OUTAGE and info["outages"] == 1
    finally:
        admin.close()
        await index.close()


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _lookups(
    index: RedisPrefixIndex, stop: asyncio.Event, answers: list[dict[str, int]]
) -> None:
    """One request stream: lookups back to back, yielding to the loop between them."""
    while not stop.is_set():
        answers.append(await index.lookup([1, 2, 3, 4], ["b0", "b1"]))
        await asyncio.sleep(0)


@pytest.mark.e2e
@pytest.mark.redis
async def test_a_restarted_redis_under_concurrent_lookups_is_one_outage_and_one_reconnect(
    private: RedisProcess,
) -> None:
    # A lookup timeout well above any scheduling hiccup: this test is about the pooled
    # connections to the killed server, not about timeouts.
    index = RedisPrefixIndex(
        open_redis(private.url),
        key_prefix="wr",
        timeout_s=0.5,
        owns_client=True,
        reconnect_min_s=0.02,
        reconnect_max_s=0.1,
    )
    await index.start()
    answers: list[dict[str, int]] = []
    stop = asyncio.Event()
    admin = private.client()
    try:
        index.record("b0", [1, 2, 3, 4])
        await index.flush()
        # A burst grows the pool to 32 connections; traffic then settles to 4 streams, so most
        # pooled connections sit idle, each a socket to the server about to be killed.
        burst = [asyncio.create_task(_lookups(index, stop, answers)) for _ in range(32)]
        await until(lambda: len(answers) >= 500)
        stop.set()
        await asyncio.gather(*burst)
        assert len(admin.client_list()) > 32
        admin.close()
        stop = asyncio.Event()
        workers = [asyncio.create_task(_lookups(index, stop, answers)) for _ in range(4)]
        await until(lambda: len(answers) >= 700)
        private.stop()
        await until(lambda: index.mode == "memory-fallback")
        private.start()  # on the same port, as a supervisor restarts it
        await asyncio.wait_for(index.wait_shared(), 5)
        # Traffic rises again: the pool hands out every connection it holds (it is LIFO, so
        # four streams alone would keep reusing the same few).
        after = len(answers)
        workers += [asyncio.create_task(_lookups(index, stop, answers)) for _ in range(28)]
        await until(lambda: len(answers) >= after + 2000, within_s=30)
        stop.set()
        await asyncio.gather(*workers)
        info = index.info()
        assert (info["outages"], info["reconnects"]) == (1, 1), info
        assert index.mode == "redis"
        # Every lookup was answered, from Redis or from the local copy, and none was wrong.
        assert all(a == {"b0": 4, "b1": 0} for a in answers)
    finally:
        stop.set()
        admin.close()
        await index.close()


@pytest.mark.e2e
@pytest.mark.redis
async def test_connections_to_redis_stay_within_the_pool_bound_however_many_lookups_run(
    private: RedisProcess,
) -> None:
    # redis-py's default pool opens a connection per call in flight: 64 request streams would
    # hold 64. The bounded pool makes the 65th call wait for one of 8, within its own timeout
    # (generous: a busy 2-core box once kept one waiting past 0.5 s, which is not the point).
    index = RedisPrefixIndex(
        open_redis(private.url, max_connections=8), key_prefix="wr", timeout_s=5.0, owns_client=True
    )
    await index.start()
    answers: list[dict[str, int]] = []
    stop = asyncio.Event()
    admin = private.client()
    try:
        index.record("b0", [1, 2, 3, 4])
        await index.flush()
        workers = [asyncio.create_task(_lookups(index, stop, answers)) for _ in range(64)]
        await until(lambda: len(answers) >= 2000, within_s=30)
        peak = len(admin.client_list()) - 1  # less the admin connection itself
        stop.set()
        await asyncio.gather(*workers)
        assert 1 <= peak <= 8
        info = index.info()
        assert info["outages"] == 0 and info["fallback_lookups"] == 0, info
        assert all(a == {"b0": 4, "b1": 0} for a in answers)
    finally:
        stop.set()
        admin.close()
        await index.close()


@pytest.mark.e2e
@pytest.mark.redis
async def test_event_loop_stalls_with_a_healthy_redis_declare_no_outage(
    private: RedisProcess,
) -> None:
    # Round trips every lookup: a copy trusted to answer would never time out.
    index = RedisPrefixIndex(
        open_redis(private.url),
        key_prefix="wr",
        timeout_s=0.05,
        owns_client=True,
        local_lookups=False,
    )
    await index.start()
    stop = asyncio.Event()
    answers: list[dict[str, int]] = []
    try:
        index.record("b0", [1, 2, 3, 4])
        await index.flush()
        workers = [asyncio.create_task(_lookups(index, stop, answers)) for _ in range(16)]
        # Stall until the stalls have timed out more lookups than an outage takes (whether a
        # lookup in flight over a stall times out or reads its answer first depends on the
        # order the loop runs its callbacks in after it: count, do not assume; bounded).
        for stalls in range(1, 201):
            seen = len(answers)
            await until(lambda seen=seen: len(answers) >= seen + 50)
            # CPU load as the event loop feels it: nothing else runs for longer than the
            # lookup timeout, so lookups in flight time out although Redis answered.
            _busy(0.12)
            if stalls >= 12 and index.info()["lookup_timeouts"] >= TIMEOUTS_TO_OUTAGE:
                break
        stop.set()
        await asyncio.gather(*workers)
        info = index.info()
        assert info["lookup_timeouts"] >= TIMEOUTS_TO_OUTAGE, (stalls, info)
        # ... and none of them made an outage: lookups in flight together count as one.
        assert info["outages"] == 0 and index.mode == "redis"
        assert all(a == {"b0": 4, "b1": 0} for a in answers)
    finally:
        stop.set()
        await index.close()


def test_timeouts_of_lookups_in_flight_together_count_as_one() -> None:
    streak = TimeoutStreak(limit=3)
    tickets = [streak.start() for _ in range(10)]  # in flight when the loop stalled
    assert not any(streak.timed_out(t) for t in tickets)
    assert not streak.timed_out(streak.start())  # the next round: two in a row
    assert streak.timed_out(streak.start())  # three in a row: Redis is not answering


def test_an_answer_between_timeouts_restarts_the_count() -> None:
    streak = TimeoutStreak(limit=3)
    for _ in range(5):
        assert not streak.timed_out(streak.start())
        assert not streak.timed_out(streak.start())
        streak.start()
        streak.answered()
    streak.reset()
    assert not streak.timed_out(streak.start())


async def test_unreachable_redis_at_startup_does_not_stop_routing() -> None:
    index = RedisPrefixIndex(
        open_redis("redis://127.0.0.1:1/0"), key_prefix="wr", timeout_s=0.05, owns_client=True
    )
    await index.start()
    index.record("b0", [1, 2])
    assert index.mode == "memory-fallback"
    assert await index.lookup([1, 2], ["b0"]) == {"b0": 2}
    await index.close()


@pytest.mark.e2e
@pytest.mark.redis
async def test_works_against_a_redis_cluster(tmp_path: Path) -> None:
    if not HAVE_REDIS_SERVER:
        pytest.skip("redis-server binary not installed")
    # The cluster bus port defaults to port + 10000, past 65535 for high ephemeral ports.
    bus = ("--cluster-port", str(free_port()))
    conf = ("--cluster-config-file", str(tmp_path / "nodes.conf"))
    server = RedisProcess(tmp_path, "--cluster-enabled", "yes", *conf, *bus).start()
    try:
        admin = server.client()
        admin.execute_command("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
        await until(lambda: b"cluster_state:ok" in admin.execute_command("CLUSTER", "INFO"))
        admin.close()
        index = RedisPrefixIndex(
            open_redis(server.url, cluster=True), key_prefix="wr", owns_client=True
        )
        await index.start()
        index.record("b0", [1, 2, 3])
        index.record("b1", [1, 2])
        await index.flush()
        assert await index.lookup([1, 2, 3], ["b0", "b1", "b2"]) == {"b0": 3, "b1": 2, "b2": 0}
        assert index.mode == "redis"
        # Another replica reads the feed there too (the stream is in the index's slot).
        peer = RedisPrefixIndex(
            open_redis(server.url, cluster=True), key_prefix="wr", owns_client=True
        )
        assert await peer.pull_feed() == 2
        assert peer.local.holders_now([1, 2, 3], ["b0", "b1"]) == {"b0": 3, "b1": 2}
        await peer.close()
        await index.close()
    finally:
        server.stop()


@pytest.fixture
def sentinel(tmp_path: Path, private: RedisProcess) -> Iterator[RedisProcess]:
    workdir = tmp_path / "sentinel"
    workdir.mkdir()
    server = RedisProcess.sentinel(workdir, private.port, "wrmaster").start()
    yield server
    server.stop()


@pytest.mark.e2e
@pytest.mark.redis
async def test_works_through_redis_sentinel(sentinel: RedisProcess) -> None:
    probe = sentinel.client()
    await until(lambda: bool(probe.execute_command("SENTINEL", "MASTERS")))
    probe.close()
    url = f"redis+sentinel://127.0.0.1:{sentinel.port}/wrmaster/0"
    index = RedisPrefixIndex(open_redis(url), key_prefix="wr", owns_client=True)
    await index.start()
    index.record("b0", [7, 8])
    await index.flush()
    assert await index.lookup([7, 8], ["b0"]) == {"b0": 2}
    assert index.mode == "redis"
    await index.close()


def test_sentinel_url_names_hosts_service_db_and_credentials() -> None:
    hosts, service, db, auth = _sentinel_parts(
        "redis+sentinel://:s3cret@h1:26379,h2:26380/mymaster/2?sentinel_password=x"
    )
    assert hosts == [("h1", 26379), ("h2", 26380)]
    assert (service, db) == ("mymaster", 2)
    assert auth == {"password": "s3cret", "sentinel_password": "x"}
    with pytest.raises(ValueError, match="service name"):
        _sentinel_parts("redis+sentinel://h1:26379")


def test_the_index_reports_its_blocks_and_the_bytes_its_tables_take() -> None:
    """What /metrics shows as warmroute.prefix.blocks and warmroute.prefix.index.memory: the
    tables' bytes as tracemalloc counts them (deploy/perf/memory_bounds.py), within 10%."""
    import gc
    import tracemalloc

    rng = random.Random(4)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = MemoryPrefixIndex(capacity_blocks=2048, clock=lambda: 0.0)
    prompts = [[rng.getrandbits(64) for _ in range(16)] for _ in range(400)]
    for i, prompt in enumerate(prompts):
        index.record_now(f"b{i % 4}", prompt, now=float(i))
        index.record_now("b4", prompt[:8], now=float(i))  # a backend sharing their heads
    del prompts, prompt  # what the requests hashed: the index keeps what it needs of it
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    blocks = index.occupancies()
    assert blocks == {**{f"b{i}": 1600 for i in range(4)}, "b4": 2048}
    assert blocks == {b: index.occupancy(b) for b in blocks}
    assert 0.9 * held < index.memory() < 1.1 * held, (index.memory(), held)
    assert index.info()["memory_bytes"] == index.memory()
    full = index.memory()
    index.forget("b4")
    assert "b4" not in index.occupancies() and index.memory() < full
