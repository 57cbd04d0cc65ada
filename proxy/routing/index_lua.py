"""The Redis half of the shared prefix index: the two scripts it runs (one lookup per request,
one write per batch of records), as Redis executes them, and how their arguments are packed
and their replies read. proxy/routing/index_redis.py calls them and keeps the local copy; the
key layout is described in proxy/routing/index.py."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

# KEYS[1]: the set of backend ZSETs that recorded the prompt's first block (its "head" set,
# written with each record that starts at block 0). ARGV[1]: the prompt's block hashes, 8 bytes
# each, packed into one string (one argument instead of hundreds); ARGV[2]: oldest score still
# valid; ARGV[3]: a depth to try first (0: none); ARGV[4]: where the backend's name starts in a
# member's key. Returns, flat, (backend, longest present prefix) for each member holding the
# first block, found by binary search (see MemoryPrefixIndex); members whose ZSET no longer
# holds it (trimmed, expired, forgotten) leave the set. The work follows the holders, not the
# fleet. A hot prompt has hundreds of holders that mostly hold the same depth (its shared
# part): the depth most held at the last lookup of this head, tried first, settles each of
# those in two reads (the first block's own is then implied) instead of a search's nine.
# The member ZSETs share the head set's hash tag: one Cluster slot, like every key of an index.
LOOKUP_LUA = """
local blob = ARGV[1]
local oldest = tonumber(ARGV[2])
local hint = tonumber(ARGV[3]) or 0
local cut = tonumber(ARGV[4]) or 1
local n = math.floor(#blob / 8)
local out = {}
if n == 0 then return out end
local first = string.sub(blob, 1, 8)
local function present(key, i)
  local s = redis.call('ZSCORE', key, string.sub(blob, (i - 1) * 8 + 1, i * 8))
  return s and tonumber(s) >= oldest
end
for _, key in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local lo, hi = 0, n
  if hint > 1 and hint <= n and present(key, hint) then
    lo = hint  -- (and so the first block, recorded with it and never older)
    if hint < n and not present(key, hint + 1) then hi = hint end
  else
    local s = redis.call('ZSCORE', key, first)
    if not s then
      redis.call('SREM', KEYS[1], key)
    elseif tonumber(s) >= oldest then
      lo = 1
      if hint > 1 and hint <= n then hi = hint - 1 end
    end
  end
  if lo > 0 then
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if present(key, mid) then lo = mid else hi = mid - 1 end
    end
    out[#out + 1] = string.sub(key, cut)
    out[#out + 1] = lo
  end
end
return out
"""


# Writes a batch of records in one call. KEYS: each backend ZSET the batch writes (once, however
# many of its records it holds), then the head sets of the records that start at block 0, then
# the feed's stream (index_feed.py). ARGV[1..4]: score step per block, key TTL (ms), oldest
# score to keep, head set TTL (ms). ARGV[5]: the whole batch, packed as a feed entry (format 2,
# index_feed.py: the writer's id, its number for this call, the records, each its time, the
# index of its first block in the prompt, its ZSET key and its block hashes). ARGV[6]: per record
# three little-endian 4-byte numbers: the KEYS index of its ZSET, its capacity in blocks, and
# the KEYS index of its head set (0: none). The batch arrives as one string where it was five
# arguments a record: the client encodes three arguments, not dozens, and the feed's entry is
# ARGV[5] itself, appended as it came. Later blocks get slightly older scores, so trimming by
# rank drops a prompt's tail first; scores are formatted with %.17g (Lua's default keeps 14
# digits, too few). ARGV[7]: the feed's length to keep. Then, optionally, the id to read the
# stream from and how many entries at most (ARGV[8], ARGV[9]): the writer reads the feed with
# its write (a call it makes anyway), and its reader need not.
# Returns, flat, each written ZSET's key and the blocks it holds after trimming (what every
# replica recorded there); when asked to read, then the entries read, as XRANGE returns them.
RECORD_LUA = """
local step, ttl, oldest, head_ttl = tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4]
local d, meta = ARGV[5], ARGV[6]
local pos = string.byte(d, 1) + 2
local _, records
_, records, pos = struct.unpack('<I4I4', d, pos)
local caps = {}
for j = 1, records do
  local ts, first, key_len, blob_len
  ts, first, key_len, blob_len, pos = struct.unpack('<dI4I4I4', d, pos)
  local at = pos + key_len
  pos = at + blob_len
  local k, cap, head = struct.unpack('<I4I4I4', meta, (j - 1) * 12 + 1)
  local key = KEYS[k]
  caps[key] = cap
  local args = {}
  for i = 0, math.floor(blob_len / 8) - 1 do
    args[#args + 1] = string.format('%.17g', ts - (first + i) * step)
    args[#args + 1] = string.sub(d, at + i * 8, at + i * 8 + 7)
    if #args >= 512 then
      redis.call('ZADD', key, unpack(args))
      args = {}
    end
  end
  if #args > 0 then redis.call('ZADD', key, unpack(args)) end
  if head > 0 then
    redis.call('SADD', KEYS[head], key)
    redis.call('PEXPIRE', KEYS[head], head_ttl)
  end
end
redis.call('XADD', KEYS[#KEYS], 'MAXLEN', '~', ARGV[7], '*', 'v', '2', 'd', d)
redis.call('PEXPIRE', KEYS[#KEYS], head_ttl)
local held = {}
for key, cap in pairs(caps) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', oldest)
  redis.call('ZREMRANGEBYRANK', key, 0, -cap - 1)
  redis.call('PEXPIRE', key, ttl)
  held[#held + 1] = key
  held[#held + 1] = redis.call('ZCARD', key)
end
local from = ARGV[8]
if from and #from > 0 then
  held[#held + 1] = redis.call('XRANGE', KEYS[#KEYS], from, '+', 'COUNT', ARGV[9])
end
return held
"""


RECORDS_PER_CALL = 64  # one call runs atomically in Redis: keep each one short
# ... and in blocks: a call writing ten prompts of 250 blocks held Redis for ~1.8 ms, and every
# lookup (each request's) that came in meanwhile waited for it. 512 blocks is ~0.3 ms.
BLOCKS_PER_CALL = 512


def pack_blocks(blocks: Sequence[int]) -> bytes:
    return array("Q", blocks).tobytes()


def record_keys(rows: Sequence[tuple[str, str, int]]) -> tuple[list[str], bytes]:
    """Per record of a call (its ZSET key, its head set's key or "", its capacity): the call's
    KEYS but the feed's (each ZSET once, then each head set once) and ARGV[6], the table of
    each record's KEYS indexes (from 1; a head set's 0: none) and capacity."""
    zsets: dict[str, int] = {}
    for key, _, _ in rows:
        zsets.setdefault(key, len(zsets) + 1)
    heads: dict[str, int] = {}
    table: list[int] = []
    for key, head, cap in rows:
        at = heads.setdefault(head, len(zsets) + len(heads) + 1) if head else 0
        table += (zsets[key], cap, at)
    return [*zsets, *heads], struct.pack(f"<{len(table)}I", *table)


def reply_pairs(flat: Sequence[Any] | None, cut: int = 0) -> Iterator[tuple[str, int]]:
    """A script's flat (name, count, name, count, ...) reply as pairs, each name from `cut` on
    (0: whole, as the lookup sends backend names; the writer's reply names whole keys)."""
    pairs = iter(flat or ())
    for key, n in zip(pairs, pairs, strict=True):
        yield (key.decode() if isinstance(key, bytes) else str(key))[cut:], int(n)


def record_calls(
    batch: list[tuple[str, Sequence[int], float, int]],
) -> Iterator[tuple[int, list[tuple[str, Sequence[int], float, int]]]]:
    """The batch in script calls of at most RECORDS_PER_CALL records and, past the first
    record, BLOCKS_PER_CALL blocks; with each call's first position in the batch."""
    start, blocks = 0, 0
    for i, (_, recorded, _, _) in enumerate(batch):
        if i > start and (
            i - start >= RECORDS_PER_CALL or blocks + len(recorded) > BLOCKS_PER_CALL
        ):
            yield start, batch[start:i]
            start, blocks = i, 0
        blocks += len(recorded)
    if start < len(batch):
        yield start, batch[start:]
