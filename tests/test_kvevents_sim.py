"""`warmroute sim` publishes vLLM's KV events, and a subscriber's view follows its cache exactly.

The simulated engines run under uvicorn on loopback (in a thread, or as a `warmroute sim`
process); the subscriber listens on real ZeroMQ sockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
import xxhash

from proxy.cli import build_parser
from proxy.kvevents import wire
from proxy.kvevents.subscriber import KvEventSubscriber
from proxy.kvevents.view import KvCacheView
from proxy.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored
from proxy.routing.prefix import PrefixHasher, chain_tokens, seed
from proxy.sim import SimApp, SimConfig, create_sim_app, tokens
from proxy.sim.cli import config_from_args, engine_configs
from proxy.sim.kvcache import BlockPool, block_hashes
from tests.support import ServerThread, free_port

MODEL = "sim-8b"
BS = 16
SYSTEM = list(range(500, 548))  # three blocks every prompt shares


def endpoints(n: int) -> list[str]:
    """`n` distinct free loopback ports as tcp:// endpoints (held together while chosen)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in socks]


@contextlib.contextmanager
def sim(events: str, replay: str | None, **overrides: Any) -> Iterator[tuple[str, SimApp]]:
    cfg = SimConfig.from_preset(
        "h100",
        "8b",
        "bf16",
        time_scale=100,
        kv_blocks=32,
        kv_events_endpoint=events,
        kv_events_replay_endpoint=replay,
        **overrides,
    )
    app = create_sim_app(cfg)
    with ServerThread(app, **app.uvicorn_kwargs()) as server:
        yield server.url, app


def prompts(n: int) -> list[tuple[list[int], str | None]]:
    """Prompts that share a system prefix, some repeated, some salted: hits and evictions."""
    out: list[tuple[list[int], str | None]] = []
    for i in range(n):
        tail = list(range(10_000 * (i % 5), 10_000 * (i % 5) + 40 + 17 * (i % 5)))
        out.append((SYSTEM + tail, "tenant-a" if i % 4 == 3 else None))
    return out


async def complete(
    client: httpx.AsyncClient, url: str, ids: Sequence[int], salt: str | None
) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": list(ids), "max_tokens": 2}
    if salt:
        body["cache_salt"] = salt
    r = await client.post(url + "/v1/completions", json={**body, "ignore_eos": True})
    assert r.status_code == 200, r.text


async def synced(client: httpx.AsyncClient, url: str, sub: KvEventSubscriber) -> dict[str, Any]:
    """Wait until the subscriber applied every batch the engine published; its cache."""
    published = (await client.get(url + "/sim/stats")).json()["kv_events"]["next_seq"]
    async with asyncio.timeout(10):
        await sub.wait_until(lambda: sub.last_seq == published - 1)
    cache: dict[str, Any] = (await client.get(url + "/sim/kv-cache")).json()
    return cache


def held(ids: Sequence[int], salt: str | None, cache: set[int]) -> int:
    """Leading blocks of a prompt the sim holds, by its own hashes."""
    n = 0
    salt_seed = xxhash.xxh64_intdigest(salt.encode()) if salt else 0
    for h in block_hashes(ids, BS, salt_seed):
        if h not in cache:
            break
        n += 1
    return n


class Dropping(KvEventSubscriber):
    """Loses the first live message that arrives after it has applied one."""

    dropped: int | None = None

    async def on_frames(self, frames: Sequence[bytes]) -> None:
        if self.dropped is None and self.last_seq is not None:
            self.dropped = wire.unpack_seq(frames[1])
            return
        await super().on_frames(frames)


@pytest.mark.e2e
async def test_the_view_matches_the_sims_cache_block_for_block_evictions_included() -> None:
    events, replay = endpoints(2)
    view = KvCacheView(MODEL, BS)
    hasher = PrefixHasher(kv_block_tokens=BS)
    chat = [{"role": "user", "content": "Why do prefix caches need chained hashes? " * 4}]
    with sim(events, replay) as (url, app):
        sub = KvEventSubscriber(events, view, replay_endpoint=replay)
        async with httpx.AsyncClient() as client, sub:
            work = prompts(14)
            for ids, salt in work:
                await complete(client, url, ids, salt)
            r = await client.post(url + "/v1/chat/completions", json={"messages": chat})
            assert r.status_code == 200
            cache = await synced(client, url, sub)
            evictions = app.engine.stats()["prefix_cache_evictions"]
    hashes = set(cache["hashes"])
    assert view.engine_hashes() == hashes and len(view) == len(hashes)
    assert evictions > 0 and view.stats()["removed"] > 0 and view.stats()["orphans"] == 0
    for ids, salt in work:
        body = {"prompt": ids, **({"cache_salt": salt} if salt else {})}
        assert view.match(hasher.key(MODEL, "completions", body).blocks) == held(ids, salt, hashes)
    # Chat: the keys are the chain over the engine's own tokens (its template and tokenizer).
    chat_ids = tokens.tokenize(tokens.render_chat(chat))
    assert view.match(chain_tokens(seed(MODEL), chat_ids, BS, 100)) == len(chat_ids) // BS
    assert sub.exact and sub.counts["skipped_events"] == 0


@pytest.mark.e2e
async def test_a_message_lost_on_the_way_is_replayed_from_the_sim() -> None:
    events, replay = endpoints(2)
    view = KvCacheView(MODEL, BS)
    with sim(events, replay) as (url, _):
        sub = Dropping(events, view, replay_endpoint=replay)
        async with httpx.AsyncClient() as client, sub:
            for ids, salt in prompts(10):
                await complete(client, url, ids, salt)
            cache = await synced(client, url, sub)
    # Every batch applied exactly once, the lost one from the replay (after the gap it left,
    # or on the subscriber's connect-time resync when that came later).
    assert sub.dropped is not None and sub.counts["messages"] == sub.last_seq + 1
    assert sub.counts["replayed"] >= 1 and sub.counts["unrepaired"] == 0 and sub.exact
    assert view.engine_hashes() == set(cache["hashes"])


@pytest.mark.e2e
async def test_a_restarted_sim_clears_the_view() -> None:
    events, replay = endpoints(2)
    view = KvCacheView(MODEL, BS)
    sub = KvEventSubscriber(events, view, replay_endpoint=replay)
    async with httpx.AsyncClient() as client, sub:
        with sim(events, replay) as (url, _):
            for ids, salt in prompts(8):
                await complete(client, url, ids, salt)
            before = await synced(client, url, sub)
            assert view.engine_hashes() == set(before["hashes"])
        with sim(events, replay) as (url, _):
            fresh = list(range(90_000, 90_000 + 3 * BS + 5))
            await complete(client, url, fresh, None)
            async with asyncio.timeout(10):
                await sub.wait_until(lambda: sub.counts["restarts"] == 1)
            # A batch sent while the subscription was still on its way is lost; the next one
            # reveals the gap.
            await complete(client, url, fresh[: 2 * BS] + [7] * BS, None)
            after = await synced(client, url, sub)
    assert view.engine_hashes() == set(after["hashes"]) and len(view) == 4
    assert view.match(chain_tokens(seed(MODEL), fresh, BS, 10)) == 3
    assert not view.keys() & {
        k for ids, _ in prompts(8) for k in chain_tokens(seed(MODEL), ids, BS, 99)
    }
    assert sub.exact


@pytest.mark.e2e
async def test_resetting_the_prefix_cache_publishes_all_blocks_cleared() -> None:
    events, replay = endpoints(2)
    view = KvCacheView(MODEL, BS)
    with sim(events, replay) as (url, _):
        sub = KvEventSubscriber(events, view, replay_endpoint=replay)
        async with httpx.AsyncClient() as client, sub:
            for ids, salt in prompts(3):
                await complete(client, url, ids, salt)
            await synced(client, url, sub)
            assert len(view) > 0
            cleared = view.stats()["cleared"]
            assert (await client.post(url + "/reset_prefix_cache")).status_code == 200
            cache = await synced(client, url, sub)
    assert cache["hashes"] == [] and len(view) == 0 and view.stats()["cleared"] == cleared + 1


def test_the_pool_reports_a_requests_new_blocks_as_one_event_and_each_eviction_alone() -> None:
    pool = BlockPool(4, block_size=2, record_events=True)
    a, b, c = pool.allocate(3)
    assert pool.commit(a, 11, None, [1, 2], "salt")
    assert pool.commit(b, 12, 11, [3, 4])
    assert not pool.commit(c, 11, None, [1, 2])  # the same prefix computed twice: cached once
    assert pool.commit(c, 13, 12, [5, 6])
    pool.release([a, b, c])
    pool.allocate(4)  # reuses every block: the cached ones are evicted, a prompt's tail first
    assert pool.take_events() == [
        BlockStored(
            [11, 12, 13],
            None,
            [1, 2, 3, 4, 5, 6],
            2,
            medium="GPU",
            extra_keys=[("salt",), None, None],
            group_idx=0,
        ),
        BlockRemoved([13], medium="GPU", group_idx=0),
        BlockRemoved([12], medium="GPU", group_idx=0),
        BlockRemoved([11], medium="GPU", group_idx=0),
    ]
    assert pool.take_events() == []


def test_a_reset_names_what_it_dropped_unless_it_emptied_the_cache() -> None:
    pool = BlockPool(4, block_size=1, record_events=True)
    a, b = pool.allocate(2)
    pool.commit(a, 1, None, [1])
    pool.commit(b, 2, 1, [2])
    pool.release([b])  # a stays in use
    pool.take_events()
    pool.reset()
    assert pool.take_events() == [BlockRemoved([2], medium="GPU", group_idx=0)]
    pool.release([a])
    pool.reset()
    assert pool.take_events() == [AllBlocksCleared()]
    assert BlockPool(1).take_events() == []  # not recording: nothing kept


def test_kv_event_flags_come_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARMROUTE_SIM_KV_EVENTS_TOPIC", "kv@sim")
    args = build_parser().parse_args(
        [
            "sim",
            "--kv-events-endpoint",
            "tcp://*:5557",
            "--kv-events-replay-endpoint",
            "tcp://*:6557",
        ]
    )
    cfg = config_from_args(args)
    assert (cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint, cfg.kv_events_topic) == (
        "tcp://*:5557",
        "tcp://*:6557",
        "kv@sim",
    )
    assert config_from_args(build_parser().parse_args(["sim"])).kv_events_endpoint is None


def test_each_of_several_engines_publishes_on_its_own_ports() -> None:
    base = SimConfig(
        kv_events_endpoint="tcp://127.0.0.1:5557", kv_events_replay_endpoint="tcp://127.0.0.1:5600"
    )
    cfgs = engine_configs(base, 3)
    assert [c.kv_events_endpoint for c in cfgs] == [
        f"tcp://127.0.0.1:{p}" for p in (5557, 5558, 5559)
    ]
    assert [c.kv_events_replay_endpoint for c in cfgs][-1] == "tcp://127.0.0.1:5602"
    clash = SimConfig(
        kv_events_endpoint="tcp://127.0.0.1:5557", kv_events_replay_endpoint="tcp://127.0.0.1:5558"
    )
    with pytest.raises(ValueError, match="space the two ports"):
        engine_configs(clash, 2)
    with pytest.raises(ValueError, match="needs kv_events_endpoint"):
        SimConfig(kv_events_replay_endpoint="tcp://127.0.0.1:5600")


@pytest.mark.e2e
async def test_a_warmroute_sim_process_with_two_instances_publishes_for_each() -> None:
    port = free_port(6)  # HTTP, KV events, replay: two engines each
    events, replay = port + 2, port + 4
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "proxy", "sim", "--port", str(port), "--instances", "2"),
        *("--time-scale", "100", "--kv-events-endpoint", f"tcp://127.0.0.1:{events}"),
        *("--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "WARMROUTE_SIM_KV_BLOCKS": "64"},
    )
    try:
        assert proc.stdout is not None
        banner = await proc.stdout.readline()
        assert b"2 x sim-8b" in banner, banner + await proc.stdout.read()
        views = [KvCacheView(MODEL, BS), KvCacheView(MODEL, BS)]
        subs = [
            KvEventSubscriber(
                f"tcp://127.0.0.1:{events + i}",
                views[i],
                replay_endpoint=f"tcp://127.0.0.1:{replay + i}",
            )
            for i in range(2)
        ]
        async with httpx.AsyncClient() as client, subs[0], subs[1]:
            for i, sub in enumerate(subs):
                url = f"http://127.0.0.1:{port + i}"
                await complete(client, url, list(range(1000 * i, 1000 * i + 2 * BS + 1)), None)
                await synced(client, url, sub)
        assert [len(v) for v in views] == [2, 2] and views[0].keys().isdisjoint(views[1].keys())
        assert all(sub.exact for sub in subs)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
