"""The Redis half of the shared prefix index: the two scripts it runs (one lookup per request,
one write per batch of records), as Redis executes them, and how their arguments are packed
and their replies read. proxy/routing/index_redis.py calls them and keeps the local copy; the
key layout is described in proxy/routing/index.py."""

from __future__ import annotations

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


# Writes a batch of records in one call. KEYS: the backend ZSET of each record (all under one
# hash tag: one slot), then the head sets of the records that start at block 0. ARGV[1..5]:
# score step per block, key TTL (ms), oldest score to keep, number of records, head set TTL
# (ms); then per record: packed block hashes, record time, index of its first block in the
# prompt, capacity, KEYS index of its head set (0: none). Later blocks get slightly older
# scores so that trimming by rank drops a prompt's tail first. Scores are formatted with
# %.17g: Lua's default number-to-string keeps 14 digits, too few. After the records, optionally
# (the feed, index_feed.py): the writer's id, the feed's length to keep and the writer's number
# for this call; the call's records are then appended, in this same call, as one entry of the
# stream that is the last of KEYS (the blocks sent once, not packed again by the writer), in
# index_feed.py's format 2: fields v (2) and d (the batch, packed with Lua's struct library).
# Then, optionally, the id to read the stream from and how many entries at most: the writer
# reads the feed with its write (a call it makes anyway), and its reader need not.
# Returns, flat, each written ZSET's key and the blocks it holds after trimming (what every
# replica recorded there); when asked to read, then the entries read, as XRANGE returns them.
RECORD_LUA = """
local step, ttl, oldest = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local records, head_ttl = tonumber(ARGV[4]), ARGV[5]
local caps = {}
for j = 1, records do
  local base = 5 + (j - 1) * 5
  local blob, ts, first = ARGV[base + 1], tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  caps[KEYS[j]] = tonumber(ARGV[base + 4])
  local args = {}
  for i = 1, math.floor(#blob / 8) do
    args[#args + 1] = string.format('%.17g', ts - (first + i - 1) * step)
    args[#args + 1] = string.sub(blob, (i - 1) * 8 + 1, i * 8)
    if #args >= 512 then
      redis.call('ZADD', KEYS[j], unpack(args))
      args = {}
    end
  end
  if #args > 0 then redis.call('ZADD', KEYS[j], unpack(args)) end
  local head = tonumber(ARGV[base + 5])
  if head > 0 then
    redis.call('SADD', KEYS[head], KEYS[j])
    redis.call('PEXPIRE', KEYS[head], head_ttl)
  end
end
local at = 5 + records * 5
local writer = ARGV[at + 1]
if writer and #writer > 0 then
  local seq = tonumber(ARGV[at + 3])
  local d = {struct.pack('<B', #writer), writer, struct.pack('<I4I4', seq, records)}
  for j = 1, records do
    local base = 5 + (j - 1) * 5
    local blob = ARGV[base + 1]
    local ts, first = tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
    d[#d + 1] = struct.pack('<dI4I4I4', ts, first, #KEYS[j], #blob)
    d[#d + 1] = KEYS[j]
    d[#d + 1] = blob
  end
  redis.call('XADD', KEYS[#KEYS], 'MAXLEN', '~', ARGV[at + 2], '*', 'v', '2', 'd', table.concat(d))
  redis.call('PEXPIRE', KEYS[#KEYS], head_ttl)
end
local held = {}
for key, cap in pairs(caps) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', oldest)
  redis.call('ZREMRANGEBYRANK', key, 0, -cap - 1)
  redis.call('PEXPIRE', key, ttl)
  held[#held + 1] = key
  held[#held + 1] = redis.call('ZCARD', key)
end
local from = ARGV[at + 4]
if from and #from > 0 then
  held[#held + 1] = redis.call('XRANGE', KEYS[#KEYS], from, '+', 'COUNT', ARGV[at + 5])
end
return held
"""


RECORDS_PER_CALL = 64  # one call runs atomically in Redis: keep each one short
# ... and in blocks: a call writing ten prompts of 250 blocks held Redis for ~1.8 ms, and every
# lookup (each request's) that came in meanwhile waited for it. 512 blocks is ~0.3 ms.
BLOCKS_PER_CALL = 512


def pack_blocks(blocks: Sequence[int]) -> bytes:
    return array("Q", blocks).tobytes()


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
