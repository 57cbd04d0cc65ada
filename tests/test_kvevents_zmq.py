"""The publisher and the subscriber over real ZeroMQ sockets on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterable, Sequence

import msgspec
import pytest
import zmq
import zmq.asyncio

from proxy.kvevents import wire
from proxy.kvevents.publisher import KvEventPublisher, offset_endpoint
from proxy.kvevents.subscriber import KvEventSubscriber
from proxy.kvevents.view import KvCacheView
from proxy.kvevents.wire import AllBlocksCleared, BlockStored
from proxy.routing.prefix import chain_tokens, seed
from tests.support import free_port

ANY_PORT = "tcp://127.0.0.1:0"


class Recorder:
    """A sink that keeps every batch it is given."""

    def __init__(self) -> None:
        self.batches: list[list[wire.KVEvent]] = []
        self.clears = 0

    def apply(self, events: Iterable[wire.KVEvent]) -> None:
        self.batches.append(list(events))

    def clear(self) -> None:
        self.clears += 1


class Dropping(KvEventSubscriber):
    """A subscriber that loses the live messages with the given sequence numbers."""

    def __init__(self, *args: object, drop: Sequence[int], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.drop = set(drop)

    async def on_frames(self, frames: Sequence[bytes]) -> None:
        seq = wire.unpack_seq(frames[1])
        if seq in self.drop:
            self.drop.discard(seq)
            return
        await super().on_frames(frames)


async def until(sub: KvEventSubscriber, predicate: Callable[[], bool], within: float = 10) -> None:
    async with asyncio.timeout(within):
        await sub.wait_until(predicate)


async def joined(pub: KvEventPublisher, sub: KvEventSubscriber) -> None:
    """Publish empty batches until they arrive live (a SUB misses what precedes its join)."""
    for _ in range(500):
        if await _arrives(pub, sub):
            return
    raise AssertionError("the subscriber never received a live message")


async def _arrives(pub: KvEventPublisher, sub: KvEventSubscriber) -> bool:
    received = sub.counts["received"]
    seq = pub.publish([])
    try:
        async with asyncio.timeout(0.02):
            await sub.wait_until(lambda: sub.counts["received"] > received and sub.last_seq == seq)
    except TimeoutError:
        return False
    return True


def stored(n: int, at: int = 0) -> BlockStored:
    return BlockStored([at + i for i in range(n)], at - 1 if at else None, list(range(4 * n)), 4)


async def test_batches_arrive_in_order_and_a_late_subscriber_catches_up_by_replay() -> None:
    async with KvEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT) as pub:
        early = [pub.publish([AllBlocksCleared()]), pub.publish([stored(2)])]
        sink = Recorder()
        sub = KvEventSubscriber(pub.endpoint, sink, replay_endpoint=pub.replay_endpoint)
        async with sub:
            await joined(pub, sub)
            pub.publish([stored(1, at=9)])
            await until(sub, lambda: sub.last_seq == pub.next_seq - 1)
    assert early == [0, 1]
    assert sink.batches[:2] == [[AllBlocksCleared()], [stored(2)]]
    assert sink.batches[-1] == [stored(1, at=9)]
    assert len(sink.batches) == pub.next_seq and sub.exact
    assert sub.counts["replays"] == 1 and sub.counts["replayed"] >= 2


async def test_a_subscriber_learns_an_idle_engines_cache_as_soon_as_it_connects() -> None:
    async with KvEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT) as pub:
        pub.publish([AllBlocksCleared()])
        pub.publish([prompt(1000, 2)])
        view = KvCacheView("m", 4)
        async with KvEventSubscriber(
            pub.endpoint, view, replay_endpoint=pub.replay_endpoint
        ) as sub:
            await until(sub, lambda: sub.last_seq == 1)
            assert view.keys() == keys(1000, 2) and sub.exact and sub.counts["connects"] == 1
            # The replay came over its own socket: the SUB's subscription may not have reached
            # the publisher yet, and a batch sent before it does is lost until the next one
            # shows the gap. Wait until batches arrive live before the one this test checks.
            await joined(pub, sub)
            last = pub.publish([prompt(2000, 1)])
            await until(sub, lambda: sub.last_seq == last)
    assert view.keys() == keys(1000, 2) | keys(2000, 1)
    # every batch applied once: live copies of the replayed ones were not applied again
    assert sub.counts["restarts"] == 0 and sub.counts["messages"] == pub.next_seq


async def test_a_dropped_message_is_repaired_by_replay() -> None:
    async with KvEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT) as pub:
        sink = Recorder()
        sub = Dropping(pub.endpoint, sink, replay_endpoint=pub.replay_endpoint, drop=[])
        async with sub:
            await joined(pub, sub)
            lost = pub.next_seq
            sub.drop.add(lost)
            pub.publish([stored(1, at=100)])
            pub.publish([stored(1, at=200)])
            await until(sub, lambda: sub.last_seq == lost + 1)
    assert sink.batches[-2:] == [[stored(1, at=100)], [stored(1, at=200)]]
    assert sub.counts["gaps"] == 1 and sub.counts["unrepaired"] == 0 and sub.exact


async def test_a_gap_the_replay_cannot_fill_leaves_the_view_inexact() -> None:
    silent_router = f"tcp://127.0.0.1:{free_port()}"  # nothing answers there
    async with KvEventPublisher(ANY_PORT) as pub:
        sink = Recorder()
        sub = Dropping(
            pub.endpoint, sink, replay_endpoint=silent_router, replay_timeout_s=0.1, drop=[]
        )
        async with sub:
            await joined(pub, sub)
            pub.publish([AllBlocksCleared()])
            await until(sub, lambda: sub.exact)
            before = dict(sub.counts)
            sub.drop.add(pub.next_seq)
            pub.publish([stored(1)])
            pub.publish([stored(1, at=5)])
            await until(sub, lambda: sub.last_seq == pub.next_seq - 1)
    assert not sub.exact
    assert sub.counts["unrepaired"] - before["unrepaired"] == 1
    assert sub.counts["replay_timeouts"] - before["replay_timeouts"] == 1


def loopback_endpoints(n: int) -> list[str]:
    """`n` distinct free loopback ports (held together while chosen, so never the same one)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in socks]


def prompt(first_token: int, blocks: int) -> BlockStored:
    """A prompt's first `blocks` blocks of 4 tokens (hashes: the token ids, for brevity)."""
    ids = list(range(first_token, first_token + 4 * blocks))
    return BlockStored(ids[::4], None, ids, 4)


def keys(first_token: int, blocks: int) -> set[int]:
    ids = list(range(first_token, first_token + 4 * blocks))
    return set(chain_tokens(seed("m"), ids, 4, blocks))


@pytest.mark.parametrize("batches_before_restart", [40, 1])
async def test_a_restarted_publisher_clears_the_view(batches_before_restart: int) -> None:
    """Whether the new engine's numbers restart below ours or have already counted past them."""
    endpoint, replay = loopback_endpoints(2)
    view = KvCacheView("m", 4)
    sub = KvEventSubscriber(endpoint, view, replay_endpoint=replay)
    async with sub:
        async with KvEventPublisher(endpoint, replay_endpoint=replay) as first:
            first.publish([AllBlocksCleared(), prompt(1000, 3)])
            await joined(first, sub)
            for _ in range(batches_before_restart):
                first.publish([])
            await until(sub, lambda: sub.last_seq == first.next_seq - 1)
            assert view.keys() == keys(1000, 3)
        async with KvEventPublisher(endpoint, replay_endpoint=replay) as second:
            second.publish([AllBlocksCleared(), prompt(2000, 2)])
            for _ in range(5):
                second.publish([])
            await joined(second, sub)
            await until(sub, lambda: sub.counts["restarts"] == 1)
    assert view.keys() == keys(2000, 2)
    assert sub.exact


async def test_a_silent_publisher_is_reported_silent_until_it_speaks_again() -> None:
    async with KvEventPublisher(ANY_PORT) as pub:
        sub = KvEventSubscriber(pub.endpoint, Recorder(), silent_after_s=0.2)
        async with sub:
            await joined(pub, sub)
            await until(sub, lambda: sub.silent)
            assert sub.counts["silences"] == 1 and sub.stats()["silent"]
            await joined(pub, sub)
            assert not sub.silent


async def test_only_the_exact_topic_is_applied() -> None:
    async with (
        KvEventPublisher(ANY_PORT, topic="kv-events") as other,
        KvEventPublisher(ANY_PORT, topic="kv") as ours,
    ):
        sink = Recorder()
        sub = KvEventSubscriber(ours.endpoint, sink, topic="kv")
        sub_other = KvEventSubscriber(other.endpoint, Recorder(), topic="kv")  # prefix matches
        async with sub, sub_other:
            await joined(ours, sub)
            other.publish([AllBlocksCleared()])
            ours.publish([stored(1)])
            await until(sub, lambda: sub.last_seq == ours.next_seq - 1)
        assert sub_other.last_seq is None
    assert sink.batches[-1] == [stored(1)]


async def test_the_replay_socket_answers_a_raw_dealer_in_vllms_frames() -> None:
    async with KvEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT, topic="t") as pub:
        payloads = []
        for i in range(3):
            pub.publish([stored(1, at=i)], ts=float(i))
            payloads.append(wire.encode_batch(wire.EventBatch(float(i), [stored(1, at=i)], 0)))
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        try:
            assert pub.replay_endpoint is not None
            dealer.connect(pub.replay_endpoint)
            await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
            replies = []
            async with asyncio.timeout(5):
                while True:
                    frames = await dealer.recv_multipart()
                    replies.append(frames)
                    if frames[2] == b"\xff" * 8:
                        break
        finally:
            dealer.close(linger=0)
            ctx.term()
    assert replies == [
        [b"", b"t", (1).to_bytes(8, "big"), payloads[1]],
        [b"", b"t", (2).to_bytes(8, "big"), payloads[2]],
        [b"", b"", b"\xff" * 8, b""],
    ]
    assert pub.replays_served == 1


async def test_binding_a_taken_endpoint_names_it() -> None:
    async with KvEventPublisher(ANY_PORT) as pub:
        with pytest.raises(zmq.ZMQError, match="cannot bind KV events to"):
            await KvEventPublisher(pub.endpoint).start()


def test_several_engines_offset_their_ports_like_vllms_data_parallel_ranks() -> None:
    assert offset_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://127.0.0.1:0", 3) == "tcp://127.0.0.1:0"
    assert offset_endpoint(None, 1) is None
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        offset_endpoint("ipc:///tmp/kv", 1)


async def test_an_event_the_proxy_could_not_read_makes_the_view_inexact_until_a_clean_start() -> (
    None
):
    sink = Recorder()
    sub = KvEventSubscriber("tcp://127.0.0.1:9", sink)  # fed frames here, never started
    clear = wire.encode_batch(wire.EventBatch(1.0, [AllBlocksCleared()]))
    await sub.on_frames(wire.live_frames(b"", 0, clear))
    assert sub.exact
    unreadable = msgspec.msgpack.encode(
        [2.0, [{"type": "BlockStored", "block_hashes": ["x"]}, ["AllBlocksCleared"]], None]
    )  # a clear is read, but after it a change the view did not see
    await sub.on_frames(wire.live_frames(b"", 1, unreadable))
    assert not sub.exact and sub.counts["skipped_events"] == 1
    await sub.on_frames(
        wire.live_frames(b"", 2, wire.encode_batch(wire.EventBatch(3.0, [stored(1)])))
    )
    assert not sub.exact  # still: nothing has repaired it
    await sub.on_frames(wire.live_frames(b"", 3, clear))
    assert sub.exact  # the engine cleared its cache: everything from here on is known
