"""KV event messages, byte for byte as vLLM sends them (see docs/kv-events.md).

The recorded batches below were written by hand, one msgpack item at a time, from the layout
read in vLLM 0.33.0's `vllm/distributed/kv_events.py`; encoding the decoded events must give
the same bytes back."""

from __future__ import annotations

import logging

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.kvevents import wire
from proxy.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, Layout

HASH_A = bytes.fromhex("ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb")
HASH_B = bytes.fromhex("3e23e8160039594a33894f6564e1b1348bbd7a0088d42c4acb73eeaed59c009d")
TOKENS = [151644, 872, 198, 9064, 374, 279, 6722, 315]

# vLLM >= #42892 (0.26 on): events are tagged maps; sha256 block hashes are msgpack bin 32.
RECORDED_VLLM_BATCH = b"".join(
    (
        b"\x93",  # KVEventBatch, array_like: [ts, events, data_parallel_rank]
        b"\xcb\x41\xda\x55\x6e\x40\x20\x00\x00",  # ts = 1767225600.5 (float64)
        b"\x93",  # three events
        b"\xde\x00\x0a",  # BlockStored: map16 (sized for its 16 possible keys), 10 entries
        b"\xa4type\xabBlockStored",
        b"\xacblock_hashes\x92\xc4\x20" + HASH_A + b"\xc4\x20" + HASH_B,
        b"\xb1parent_block_hash\xc0",
        b"\xa9token_ids\x98",
        b"\xce\x00\x02\x50\x5c\xcd\x03\x68\xcc\xc6\xcd\x23\x68",  # 151644 872 198 9064
        b"\xcd\x01\x76\xcd\x01\x17\xcd\x1a\x42\xcd\x01\x3b",  # 374 279 6722 315
        b"\xaablock_size\x04",
        b"\xa7lora_id\xc0",
        b"\xa6medium\xa3GPU",
        b"\xa9lora_name\xc0",
        b"\xaaextra_keys\x92\xc0\xc0",
        b"\xa9group_idx\x00",
        b"\x84",  # BlockRemoved: fixmap, 4 entries
        b"\xa4type\xacBlockRemoved",
        b"\xacblock_hashes\x91\xc4\x20" + HASH_B,
        b"\xa6medium\xa3GPU",
        b"\xa9group_idx\x00",
        b"\x81\xa4type\xb0AllBlocksCleared",
        b"\x00",  # data_parallel_rank
    )
)
RECORDED_EVENTS: list[wire.KVEvent] = [
    BlockStored(
        [HASH_A, HASH_B], None, TOKENS, 4, medium="GPU", extra_keys=[None, None], group_idx=0
    ),
    BlockRemoved([HASH_B], medium="GPU", group_idx=0),
    AllBlocksCleared(),
]

# vLLM before #42892 (here the 0.10-era field list): events are positional arrays; uint64
# hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).
RECORDED_LEGACY_BATCH = b"".join(
    (
        b"\x93\xcb\x41\xda\x55\x6e\x40\x20\x00\x00\x92",
        b"\x97\xabBlockStored",  # [tag, hashes, parent, tokens, size, lora_id, medium]
        b"\x91\xcf\xda\xb8\x9b\xaa\x7b\x58\x57\xc0",  # [15760518052499183552]
        b"\xc0",
        b"\x94\xce\x00\x02\x50\x5c\xcd\x03\x68\xcc\xc6\xcd\x23\x68",
        b"\x04\xc0\xa3GPU",
        b"\x93\xacBlockRemoved\x91\xcf\xda\xb8\x9b\xaa\x7b\x58\x57\xc0\xa3GPU",
        b"\x00",
    )
)


def test_a_recorded_vllm_batch_decodes_to_its_events() -> None:
    batch = wire.decode_batch(RECORDED_VLLM_BATCH)
    assert batch.ts == 1767225600.5 and batch.data_parallel_rank == 0
    assert batch.events == RECORDED_EVENTS and batch.skipped == 0


def test_encoding_those_events_gives_vllms_bytes_back() -> None:
    batch = EventBatch(1767225600.5, RECORDED_EVENTS, 0)
    assert wire.encode_batch(batch) == RECORDED_VLLM_BATCH


def test_a_recorded_array_layout_batch_from_an_older_vllm_decodes() -> None:
    batch = wire.decode_batch(RECORDED_LEGACY_BATCH)
    h = 15760518052499183552
    assert batch.events == [
        BlockStored([h], None, TOKENS[:4], 4, medium="GPU"),
        BlockRemoved([h], medium="GPU"),
    ]


def test_the_array_layout_writes_every_field_like_msgspec_array_like_structs() -> None:
    event = BlockRemoved([7], medium="GPU")
    payload = wire.encode_batch(EventBatch(1.0, [event], None), Layout.ARRAY)
    assert msgspec.msgpack.decode(payload) == [
        1.0,
        [["BlockRemoved", [7], "GPU", None, None, None]],
        None,
    ]


hashes = st.lists(
    st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=32, max_size=32)),
    min_size=1,
    max_size=4,
)
maybe_str = st.none() | st.text(max_size=8)
maybe_int = st.none() | st.integers(0, 1000)
stored = st.builds(
    BlockStored,
    block_hashes=hashes,
    parent_block_hash=st.none() | st.integers(0, 2**64 - 1) | st.binary(min_size=32, max_size=32),
    token_ids=st.lists(st.integers(0, 2**31), max_size=64),
    block_size=st.integers(1, 64),
    lora_id=maybe_int,
    medium=maybe_str,
    lora_name=maybe_str,
    extra_keys=st.none() | st.lists(st.none() | st.tuples(st.text(max_size=5)), max_size=3),
    group_idx=maybe_int,
    kv_cache_spec_kind=maybe_str,
    kv_cache_spec_sliding_window=maybe_int,
    locality=maybe_str,
    ownership=maybe_str,
    session_id=maybe_str,
    lookahead_token_ids=st.none() | st.lists(st.lists(st.integers(0, 99), max_size=3), max_size=3),
)
removed = st.builds(
    BlockRemoved, hashes, medium=maybe_str, group_idx=maybe_int, locality=maybe_str,
    ownership=maybe_str,
)  # fmt: skip
events = st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=5)


@given(events, st.floats(0, 4e9), st.none() | st.integers(0, 8), st.sampled_from(Layout))
def test_every_event_type_survives_a_round_trip_in_both_layouts(
    evs: list[wire.KVEvent], ts: float, rank: int | None, layout: Layout
) -> None:
    batch = EventBatch(ts, evs, rank)
    assert wire.decode_batch(wire.encode_batch(batch, layout)) == batch


def _payload(*events: object) -> bytes:
    return msgspec.msgpack.encode([2.0, list(events), 0])


def test_an_unknown_event_type_is_skipped_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "warmroute.kvevents")
    payload = _payload(
        {"type": "BlockPromoted", "block_hashes": [1]},
        ["BlockTouched", [1]],
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
    )
    batch = wire.decode_batch(payload)
    assert batch.events == [BlockRemoved([1], medium="GPU")] and batch.skipped == 2
    assert "BlockPromoted" in caplog.text and "BlockTouched" in caplog.text


def test_a_malformed_event_is_skipped_and_the_rest_of_the_batch_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "warmroute.kvevents")
    payload = _payload(
        {"type": "BlockStored", "block_hashes": [1]},  # no tokens, no size
        ["BlockStored", ["not a hash"], None, [1], 1, None, "GPU"],
        17,
        ["AllBlocksCleared"],
    )
    batch = wire.decode_batch(payload)
    assert batch.events == [AllBlocksCleared()] and batch.skipped == 3
    assert "missing" in caplog.text


def test_fields_a_newer_vllm_adds_are_ignored_in_both_layouts() -> None:
    new_map = {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU", "tier_v9": [1, 2]}
    new_array = ["BlockRemoved", [9], "GPU", 0, None, None, "a field from the future", 42]
    batch = wire.decode_batch(_payload(new_map, new_array))
    assert batch.events == [BlockRemoved([9], medium="GPU"), BlockRemoved([9], "GPU", 0)]


def test_a_batch_encoded_as_a_map_decodes_too() -> None:
    payload = msgspec.msgpack.encode({"ts": 3.0, "events": [["AllBlocksCleared"]]})
    assert wire.decode_batch(payload) == EventBatch(3.0, [AllBlocksCleared()], None)


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode("hello"), b"\x91\x01"])
def test_a_payload_that_is_no_batch_raises_a_wire_error(payload: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.decode_batch(payload)


def test_sequence_numbers_are_eight_bytes_big_endian_and_minus_one_ends_a_replay() -> None:
    assert wire.pack_seq(1) == b"\x00" * 7 + b"\x01"
    assert wire.pack_seq(wire.END_SEQ) == b"\xff" * 8
    assert wire.unpack_seq(b"\xff" * 8) == wire.END_SEQ
    assert wire.unpack_seq(wire.pack_seq(2**40)) == 2**40
    with pytest.raises(wire.WireError):
        wire.unpack_seq(b"\x01")


def test_a_live_message_is_topic_seq_and_payload() -> None:
    frames = wire.live_frames(b"kv@pod@model", 5, b"\x90")
    assert frames == [b"kv@pod@model", b"\x00" * 7 + b"\x05", b"\x90"]
    assert wire.parse_live(frames) == (b"kv@pod@model", 5, b"\x90")
    with pytest.raises(wire.WireError):
        wire.parse_live(frames[1:])


def test_replay_replies_parse_with_and_without_vllms_later_topic_frame() -> None:
    new = wire.replay_reply(b"t", 3, b"p")
    assert new == [b"", b"t", wire.pack_seq(3), b"p"]
    assert wire.parse_replay_reply(new) == (b"t", 3, b"p")
    assert wire.parse_replay_reply([b"", wire.pack_seq(3), b"p"]) == (b"", 3, b"p")
    assert wire.parse_replay_reply(wire.replay_end()) is None
    assert wire.parse_replay_reply([b"", wire.pack_seq(wire.END_SEQ), b""]) is None
    assert wire.replay_request(7) == [b"", wire.pack_seq(7)]


def test_signed_64_bit_hashes_as_sglang_sends_them_are_blocks_not_malformed_events() -> None:
    low, high = -(1 << 63), (1 << 64) - 1
    payload = _payload(
        {
            "type": "BlockStored",
            "block_hashes": [-5, low, high],
            "parent_block_hash": -7,
            "token_ids": list(range(12)),
            "block_size": 4,
        },
        {"type": "BlockRemoved", "block_hashes": [-5]},
    )
    batch = wire.decode_batch(payload)
    assert batch.skipped == 0
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [-5, low, high]
    assert stored.parent_block_hash == -7 and removed == BlockRemoved([-5])
