"""vLLM's KV cache events on the wire (pure: bytes in, events out, and back).

What vLLM sends, read from the source of vLLM 0.33.0 (`vllm/distributed/kv_events.py` in the
PyPI wheel) and the upstream pull requests that changed it; docs/kv-events.md says the same in
more words:

- A message on the PUB socket is three frames: `topic` (UTF-8, may be empty), the sequence
  number as 8 bytes big-endian (0, 1, 2, ... per publisher), and the msgpack payload.
- The payload is one `KVEventBatch`, always a msgpack array `[ts, events, data_parallel_rank]`
  (msgspec `array_like=True`; ts is `time.time()` as a float64; the publisher fills the rank in,
  and msgspec's `omit_defaults` never shortens an array-like struct, so a None rank is a nil).
- Each event is a msgspec tagged struct. Since vllm-project/vllm#42892 an event is a msgpack
  *map* whose first key is `"type"` (the class name) followed by the fields in declaration
  order, those equal to their default (None) left out. Before it, an event was a positional
  *array* `[tag, field, ...]` of every field, nil or not (older versions had fewer). Both are
  `Layout.MAP` and `Layout.ARRAY` here; decoding accepts either.
- `BlockStored`: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name (always present, may be nil), then extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window, locality, ownership, session_id, lookahead_token_ids (left out
  when None). `BlockRemoved`: block_hashes, medium, then group_idx, locality, ownership.
  `AllBlocksCleared`: no fields. Block hashes are 32-byte sha256 digests (msgpack bin) by
  default, or uint64 ints with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1; SGLang, which ported
  this module, sends signed 64-bit ints (accepted too).
- Replay (ROUTER socket): a DEALER sends `[b"", start_seq]` (8 bytes big-endian); the reply is
  one message `[b"", topic, seq, payload]` per buffered batch with seq >= start, then the end
  marker `[b"", b"", -1 as 8 signed bytes, b""]`. Before vllm-project/vllm#45177 the replies
  had no topic frame (`[b"", seq, payload]`, end `[b"", -1, b""]`); both are parsed.

Decoding never trusts the sender: an unknown tag or a malformed event is skipped with a log
line and counted, extra trailing fields (array) or unknown keys (map) are ignored, and only a
payload that is not a batch at all raises `WireError`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

log = logging.getLogger("warmroute.kvevents")

BlockHash = int | bytes
SEQ_BYTES = 8
END_SEQ = -1  # the replay's end marker, sent as 8 bytes of 0xFF
_UINT64 = (1 << 64) - 1
_INT64_MIN = -(1 << 63)


class WireError(ValueError):
    """A message that is not a KV event message at all (wrong frames, not a batch)."""


class Layout(enum.Enum):
    """How the events inside a batch are encoded."""

    MAP = "map"  # vLLM since vllm-project/vllm#42892: {"type": tag, field: value, ...}
    ARRAY = "array"  # vLLM before it: [tag, value, ...] by position


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks the engine now caches: `block_hashes[i]` holds
    `token_ids[i * block_size : (i + 1) * block_size]`; the first block's parent is
    `parent_block_hash` (None: the first block of a prompt)."""

    block_hashes: Sequence[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Sequence[Any] | None = None  # per block: None or a tuple (LoRA name, salt, ...)
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: Sequence[Sequence[int]] | None = None
    cache_salt: str | None = None  # SGLang's own field (vLLM puts the salt in extra_keys)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted (their hashes no longer hit)."""

    block_hashes: Sequence[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (reset, or a fresh start)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One message's payload: the events of one engine step."""

    ts: float
    events: Sequence[KVEvent]
    data_parallel_rank: int | None = None
    skipped: int = field(default=0, compare=False)  # events dropped while decoding


# Field order per tag, as declared in vLLM; the first `required` are always on the wire.
_FIELDS: dict[type, tuple[tuple[str, ...], int]] = {
    BlockStored: (
        (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window",
            "locality",
            "ownership",
            "session_id",
            "lookahead_token_ids",
        ),
        7,
    ),
    BlockRemoved: (("block_hashes", "medium", "group_idx", "locality", "ownership"), 2),
    AllBlocksCleared: ((), 0),
}
# Fields an event cannot be understood without; older vLLMs lacked medium and lora_name.
_NEEDED = {BlockStored: 4, BlockRemoved: 1, AllBlocksCleared: 0}
_BY_TAG: dict[str, type] = {cls.__name__: cls for cls in _FIELDS}
_ENCODER = msgspec.msgpack.Encoder()


# --- payloads -------------------------------------------------------------------------------


def encode_batch(batch: EventBatch, layout: Layout = Layout.MAP) -> bytes:
    """The payload vLLM would send for `batch` (byte for byte, in the chosen layout)."""
    events = [msgspec.Raw(_event_bytes(e, layout)) for e in batch.events]
    return _ENCODER.encode([float(batch.ts), events, batch.data_parallel_rank])


def _event_bytes(event: KVEvent, layout: Layout) -> bytes:
    names, required = _FIELDS[type(event)]
    tag = type(event).__name__
    values = [getattr(event, n) for n in names]
    if layout is Layout.ARRAY:
        return _ENCODER.encode([tag, *values])  # omit_defaults does not shorten array-likes
    parts = [_ENCODER.encode("type"), _ENCODER.encode(tag)]
    for i, (name, value) in enumerate(zip(names, values, strict=True)):
        if i < required or value is not None:
            parts += (_ENCODER.encode(name), _ENCODER.encode(value))
    # msgspec sizes a struct's map header for every field it could write (tag included), so
    # BlockStored (16) always gets a map16 header even when fewer than 16 entries follow.
    return _map_header(len(parts) // 2, len(names) + 1) + b"".join(parts)


def _map_header(count: int, most: int) -> bytes:
    if most <= 15:
        return bytes([0x80 | count])
    if most <= 0xFFFF:
        return b"\xde" + count.to_bytes(2, "big")
    return b"\xdf" + count.to_bytes(4, "big")


def decode_batch(payload: bytes) -> EventBatch:
    """Events of one payload; unknown or malformed events are skipped (logged, counted)."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise WireError(f"payload is not msgpack: {e}") from None
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "events" in raw:
        ts, events, rank = raw.get("ts"), raw["events"], raw.get("data_parallel_rank")
    else:
        raise WireError(f"payload is not an event batch: {type(raw).__name__}")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise WireError("event batch needs a numeric ts and a list of events")
    out: list[KVEvent] = []
    skipped = 0
    for item in events:
        event = _event_from_wire(item)
        if event is None:
            skipped += 1
        else:
            out.append(event)
    return EventBatch(float(ts), out, rank if isinstance(rank, int) else None, skipped)


def _event_from_wire(item: Any) -> KVEvent | None:
    if isinstance(item, list) and item:
        tag, fields = item[0], None
    elif isinstance(item, dict):
        tag, fields = item.get("type"), item
    else:
        log.warning("skipping a KV event that is neither an array nor a map: %.80r", item)
        return None
    cls = _BY_TAG.get(tag) if isinstance(tag, str) else None
    if cls is None:
        log.warning("skipping a KV event of unknown type %.80r", tag)
        return None
    names = _FIELDS[cls][0]
    if fields is None:  # positional; anything past the fields we know is ignored
        values = dict(zip(names, item[1:], strict=False))
    else:
        values = {n: fields[n] for n in names if n in fields}
    try:
        if cls is BlockStored:
            values["cache_salt"] = _sglang_salt(values, fields)
        return _checked(cls, values, names[: _NEEDED[cls]])
    except (TypeError, ValueError) as e:
        log.warning("skipping a malformed %s event: %s", tag, e)
        return None


def _sglang_salt(values: dict[str, Any], fields: dict[str, Any] | None) -> str | None:
    """SGLang's cache salt, wherever its version put it: a `cache_salt` key of the map (since
    sgl-project/sglang#37482), or a `{"cache_salt": ...}` metadata map, which the array
    layout of #30827 appends after `medium` (vLLM's `lora_name` slot) and a later branch past
    vLLM's fields. Such a map is taken out of the positional values it landed in."""
    meta: Any = None
    if fields is None:
        for name in [n for n, v in values.items() if isinstance(v, dict)]:
            meta = values.pop(name)
    else:
        meta = fields.get("metadata")
        if "cache_salt" in fields:
            meta = {"cache_salt": fields["cache_salt"]}
    salt = meta.get("cache_salt") if isinstance(meta, dict) else None
    if not isinstance(salt, str | None):
        raise TypeError("cache_salt must be a string or nil")
    return salt


def _checked(cls: type, values: dict[str, Any], required: Sequence[str]) -> KVEvent:
    missing = [n for n in required if n not in values]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    if cls is AllBlocksCleared:
        return AllBlocksCleared()
    hashes = values["block_hashes"]
    if not isinstance(hashes, list) or not all(_is_hash(h) for h in hashes):
        raise ValueError("block_hashes must be a list of ints or bytes")
    for name in ("medium", "lora_name", "kv_cache_spec_kind", "locality", "ownership"):
        if not isinstance(values.get(name), str | None):
            raise TypeError(f"{name} must be a string or nil")
    for name in ("lora_id", "group_idx", "kv_cache_spec_sliding_window"):
        if not _is_int_or_none(values.get(name)):
            raise TypeError(f"{name} must be an integer or nil")
    if cls is BlockRemoved:
        return BlockRemoved(**values)
    parent, tokens, size = values["parent_block_hash"], values["token_ids"], values["block_size"]
    if parent is not None and not _is_hash(parent):
        raise TypeError("parent_block_hash must be an int, bytes or nil")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise TypeError("token_ids must be a list of integers")
    if type(size) is not int or size <= 0:
        raise ValueError("block_size must be a positive integer")
    extra = values.get("extra_keys")
    if extra is not None:
        if not isinstance(extra, list) or not all(isinstance(k, list | None) for k in extra):
            raise TypeError("extra_keys must be a list of arrays or nils")
        values["extra_keys"] = [None if k is None else tuple(k) for k in extra]
    if not isinstance(values.get("session_id"), str | None):
        raise TypeError("session_id must be a string or nil")
    if not isinstance(values.get("lookahead_token_ids"), list | None):
        raise TypeError("lookahead_token_ids must be a list or nil")
    return BlockStored(**values)


def _is_hash(value: Any) -> bool:
    """bytes (vLLM's sha256 digests), or a 64-bit integer: unsigned (vLLM's int hashes) or
    signed (SGLang's, most of them negative). A hash is only ever compared with the same
    engine's, so either reading names the same block."""
    return isinstance(value, bytes) or (type(value) is int and _INT64_MIN <= value <= _UINT64)


def _is_int_or_none(value: Any) -> bool:
    return value is None or type(value) is int


# --- frames ---------------------------------------------------------------------------------


def pack_seq(seq: int) -> bytes:
    """A sequence number as vLLM sends it (8 bytes big-endian; -1 is the replay end marker)."""
    return seq.to_bytes(SEQ_BYTES, "big", signed=seq < 0)


def unpack_seq(data: bytes) -> int:
    if len(data) != SEQ_BYTES:
        raise WireError(f"a sequence number is {SEQ_BYTES} bytes, got {len(data)}")
    value = int.from_bytes(data, "big")
    return END_SEQ if value == _UINT64 else value


class LiveMessage(NamedTuple):
    topic: bytes
    seq: int
    payload: bytes


def live_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The frames of one PUB message."""
    return [topic, pack_seq(seq), payload]


def parse_live(frames: Sequence[bytes]) -> LiveMessage:
    if len(frames) != 3:
        raise WireError(f"a KV event message has 3 frames (topic, seq, payload), got {len(frames)}")
    return LiveMessage(bytes(frames[0]), unpack_seq(frames[1]), bytes(frames[2]))


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to the replay socket (the ROUTER sees [identity, b"", seq])."""
    return [b"", pack_seq(start_seq)]


def replay_reply(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One replayed batch as the ROUTER sends it after the client's identity frame."""
    return [b"", topic, pack_seq(seq), payload]


def replay_end() -> list[bytes]:
    return [b"", b"", pack_seq(END_SEQ), b""]


def parse_replay_reply(frames: Sequence[bytes]) -> LiveMessage | None:
    """One replayed batch, or None for the end marker (either vLLM's old or new framing)."""
    parts = list(frames[1:]) if frames and frames[0] == b"" else list(frames)
    if len(parts) == 3:
        topic, seq_bytes, payload = parts
    elif len(parts) == 2:
        topic, (seq_bytes, payload) = b"", parts
    else:
        raise WireError(f"a replay reply has 2 or 3 frames after the delimiter, got {len(parts)}")
    seq = unpack_seq(seq_bytes)
    if seq == END_SEQ:
        return None
    return LiveMessage(bytes(topic), seq, bytes(payload))
