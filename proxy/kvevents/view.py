"""One backend's prefix cache, exactly, as warmroute's own block keys (pure, no I/O).

An engine names its blocks with hashes seeded by something private (vLLM: a random or
configured NONE_HASH seed, sha256 or xxhash; SGLang: a sha256 chain cut to a signed 64-bit
int), so they cannot be compared with the keys the proxy computes for a request. But every
`BlockStored` carries the blocks' token ids and its parent's hash, so the view recomputes each
block's key the proxy's way: ``key(block) = chain_tokens(key(parent), tokens of the block)``,
where a block without a parent chains from `seed(model, salt)`, and a parent is found through
the engine-hash -> page map this view keeps. Blocks of one event chain one after another, so
the keys are exactly those of `chain_tokens(seed, prompt_ids)` for the whole prompt
(tests/test_kvevents_view.py proves it).

The engine's block (its "page") need not be the view's block: SGLang's page is 1 token on CUDA
by default. Each page carries the tokens after the view's last whole block through it (its
tail), and the view's blocks it completes; a view block is held while the page that completes
it is (an engine drops a prefix from its end, and a lookup stops at the first missing block).

Tiers: an engine that offloads KV (vLLM's offloading connector and LMCache, SGLang's HiCache)
announces the same hash again with a slower `medium` ("CPU", "CPU_PINNED", "DISK", ...), and
removes it per medium. The view keeps which tiers hold each page; `match` is the GPU depth (no
transfer needed), `match_tiers` the depth reachable through each slower tier.

What the key cannot express is skipped and counted rather than guessed: blocks whose engine
hash also covers images, audio or prompt embeddings (extra keys other than a LoRA name or the
first block's cache salt) and the blocks after them, blocks of another KV cache group (hybrid
models), and children of a parent the view never saw (`orphans`: a store it missed). A LoRA
adapter's blocks chain from `seed(lora_name)`, as a request naming that adapter as its model
would. `apply` returns how many blocks it could not place (orphans): the caller stops trusting
the view as exact until a clean start.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.kvevents.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from proxy.routing.prefix import chain_tokens, seed

log = logging.getLogger("warmroute.kvevents")

GPU = "GPU"
# The tiers, fastest first (RouteContext.tier_blocks and the predicted-TTFT scorer use the
# names of the slower ones).
TIERS = (GPU, "CPU", "DISK", "REMOTE")
_CPU, _DISK, _REMOTE = 1, 2, 3
# How engines name a medium, upper-cased: vLLM "GPU" and its offloading connector's "CPU";
# SGLang's StorageMedium "GPU", "CPU_PINNED", "DISK", "EXTERNAL" (L4: Mooncake and the like);
# vLLM's "STORAGE"/file-system and object tiers. Anything else counts as the slowest tier.
_MEDIUMS = {
    "GPU": 0, "CUDA": 0, "HBM": 0, "DEVICE": 0,
    "CPU": _CPU, "CPU_PINNED": _CPU, "HOST": _CPU, "DRAM": _CPU, "LOCALCPUBACKEND": _CPU,
    "DISK": _DISK, "STORAGE": _DISK, "SSD": _DISK, "NVME": _DISK, "FS": _DISK, "FILE": _DISK,
    "LOCALDISKBACKEND": _DISK,
    "EXTERNAL": _REMOTE, "REMOTE": _REMOTE, "OBJ": _REMOTE,
}  # fmt: skip
# Dynamo's tag before a cache salt in `extra_keys` (one SGLang branch sends it there too).
SALT_TAG = "dynamo-cache-salt:"


def tier_of(medium: str | None) -> int:
    """The tier (index into TIERS) of an engine's medium name; None is the GPU."""
    if medium is None:
        return 0
    name = medium.strip().upper()
    found = _MEDIUMS.get(name)
    if found is None:
        found = _MEDIUMS.get(name.split(":", 1)[0], _REMOTE)  # "cuda:0"
    return found


_State = tuple[int, tuple[int, ...]]  # the chain's last whole block's key, and the tokens after


@dataclass(slots=True)
class _Page:
    """One engine block: the view's blocks it completes, and where the chain stands after it
    (`base` None: unkeyable, and so is every block after it)."""

    keys: tuple[int, ...]
    base: int | None
    tail: tuple[int, ...]
    tiers: int = 0  # bit i: held in TIERS[i]


class KvCacheView:
    """The blocks one engine holds, keyed as `PrefixHasher` keys a token-id prompt."""

    def __init__(self, model: str, block_tokens: int) -> None:
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        self.model = model
        self.block_tokens = block_tokens
        self._pages: dict[BlockHash, _Page] = {}  # engine hash -> what it holds
        self._refs: tuple[dict[int, int], ...] = tuple({} for _ in TIERS)  # per tier: key -> pages
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "stored",  # engine blocks added (a tier's copy of a block counts once more)
                "removed",  # engine blocks dropped by BlockRemoved (per tier)
                "cleared",  # AllBlocksCleared applied
                "orphans",  # blocks whose parent the view never saw (a missed store)
                "unknown_removals",  # BlockRemoved of a hash (or tier) the view does not hold
                "unkeyable",  # blocks whose engine hash covers more than tokens, and their children
                "other_group",  # another KV cache group (hybrid models)
                "other_medium",  # blocks in a slower tier (kept, and matched by match_tiers)
            ),
            0,
        )

    # --- events ---------------------------------------------------------------------------
    def apply(self, events: Iterable[KVEvent]) -> int:
        """Apply events in order; returns the blocks it could not place (orphans)."""
        before = self.counts["orphans"]
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                self._remove(event)
            elif isinstance(event, AllBlocksCleared):
                self.clear()
                self.counts["cleared"] += 1
        return self.counts["orphans"] - before

    def clear(self) -> None:
        """Everything goes, every tier (an engine's reset and a restart drop them all)."""
        self._pages.clear()
        for refs in self._refs:
            refs.clear()

    def _store(self, event: BlockStored) -> None:
        size = event.block_size
        n = min(len(event.block_hashes), len(event.token_ids) // size)
        if event.group_idx not in (None, 0):
            self.counts["other_group"] += n
            return
        tier = tier_of(event.medium)
        if tier:
            self.counts["other_medium"] += n
        placed, state = self._start(event, n)
        if not placed:
            return
        lora, extra = event.lora_name, event.extra_keys or ()
        first_extra = 1 if event.parent_block_hash is None else 0
        usable = 0 if state is None else n  # pages up to the first an extra key makes unkeyable
        for i in range(first_extra, min(usable, len(extra))):
            if not _only_lora(extra[i], lora):
                usable = i  # an image or an embedding: this block and all after it
                break
        for i, page in enumerate(self._keyed_pages(event, usable, state)):
            self._put(event.block_hashes[i], page, tier)
        for i in range(usable, n):
            self.counts["unkeyable"] += 1
            self._put(event.block_hashes[i], _Page((), None, ()), tier)

    def _keyed_pages(self, event: BlockStored, n: int, state: _State | None) -> list[_Page]:
        """The first n pages of an event, chained from `state`."""
        if state is None or not n:
            return []
        size, tokens, width = event.block_size, event.token_ids, self.block_tokens
        base, tail = state
        if not tail and size % width == 0:  # whole blocks per page (vLLM): one chain call
            per = size // width
            keys = chain_tokens(base, tokens[: n * size], width, n * per)
            if per == 1:
                return [_Page((k,), k, ()) for k in keys]
            return [_Page(tuple(keys[i * per : (i + 1) * per]), keys[(i + 1) * per - 1], ())
                    for i in range(n)]  # fmt: skip
        pages = []
        for i in range(n):
            buf = (*tail, *tokens[i * size : (i + 1) * size])
            whole = len(buf) // width
            done = tuple(chain_tokens(base, buf, width, whole)) if whole else ()
            base, tail = (done[-1] if done else base), buf[whole * width :]
            pages.append(_Page(done, base, tail))
        return pages

    def _start(self, event: BlockStored, n: int) -> tuple[bool, _State | None]:
        """Whether the parent is known, and where the event's chain starts (None: unkeyable)."""
        if event.parent_block_hash is not None:
            parent = self._pages.get(event.parent_block_hash)
            if parent is None:
                self.counts["orphans"] += n
                log.debug("KV event with an unknown parent: %d block(s) left out", n)
                return False, None
            return True, None if parent.base is None else (parent.base, parent.tail)
        lora = event.lora_name
        if lora is None and event.lora_id is not None:
            return True, None  # an old vLLM: the adapter's name is not on the wire
        extra = event.extra_keys or ()
        keyable, salt = _salt(extra[0] if extra else None, lora, event.cache_salt)
        if not keyable:
            return True, None
        return True, (seed(lora or self.model, salt), ())

    def _put(self, engine_hash: BlockHash, page: _Page, tier: int) -> None:
        bit = 1 << tier
        old = self._pages.get(engine_hash)
        if old is None:  # the common case, inline
            page.tiers = bit
            self._pages[engine_hash] = page
            refs = self._refs[tier]
            for key in page.keys:
                refs[key] = refs.get(key, 0) + 1
            self.counts["stored"] += 1
            return
        if (old.keys, old.base, old.tail) == (page.keys, page.base, page.tail):
            if old.tiers & bit:
                return  # announced again (vLLM re-announces reused prefixes)
            old.tiers |= bit  # the same block, now in one more tier
            self._ref(old.keys, tier, 1)
            self.counts["stored"] += 1
            return
        # The hash names other tokens now.
        for t in range(len(TIERS)):
            if old.tiers & (1 << t):
                self._ref(old.keys, t, -1)
        del self._pages[engine_hash]
        self._put(engine_hash, page, tier)

    def _remove(self, event: BlockRemoved) -> None:
        if event.group_idx not in (None, 0):
            self.counts["other_group"] += len(event.block_hashes)
            return
        tier = tier_of(event.medium)
        bit = 1 << tier
        for engine_hash in event.block_hashes:
            page = self._pages.get(engine_hash)
            if page is None or not page.tiers & bit:
                self.counts["unknown_removals"] += 1
                continue
            page.tiers &= ~bit
            self._ref(page.keys, tier, -1)
            if not page.tiers:
                del self._pages[engine_hash]
            self.counts["removed"] += 1

    def _ref(self, keys: Sequence[int], tier: int, delta: int) -> None:
        refs = self._refs[tier]
        for key in keys:
            left = refs.get(key, 0) + delta
            if left > 0:
                refs[key] = left
            else:
                refs.pop(key, None)

    # --- queries ----------------------------------------------------------------------------
    def match(self, blocks: Sequence[int]) -> int:
        """Leading blocks of `blocks` held on the GPU: the prefix the engine would find in its
        cache without a transfer.

        The same answer as the prefix index's lookup. The scan stops at the first missing
        block, as the engine's own lookup does: a later block without its predecessors is
        useless to it, and here presence need not be monotone along the chain."""
        gpu = self._refs[0]
        n = 0
        for key in blocks:
            if key not in gpu:
                break
            n += 1
        return n

    def match_tiers(self, blocks: Sequence[int]) -> tuple[int, ...]:
        """For each tier of TIERS, the leading blocks each held in that tier or a faster one:
        (GPU depth, depth reachable through CPU, through disk, through a remote pool)."""
        refs = self._refs
        reach = [0] * len(TIERS)
        if not any(refs[1:]):
            n = self.match(blocks)
            return (n,) * len(TIERS)
        worst = 0
        for i, key in enumerate(blocks):
            best = next((t for t, held in enumerate(refs) if key in held), None)
            if best is None:
                break
            worst = max(worst, best)
            for t in range(worst, len(TIERS)):
                reach[t] = i + 1
        return tuple(reach)

    def __contains__(self, key: object) -> bool:
        return key in self._refs[0]

    def __len__(self) -> int:
        return len(self._refs[0])

    def keys(self) -> frozenset[int]:
        """The view's blocks held on the GPU."""
        return frozenset(self._refs[0])

    def engine_hashes(self) -> frozenset[BlockHash]:
        """The engine blocks held on the GPU (keyable or not)."""
        return frozenset(h for h, page in self._pages.items() if page.tiers & 1)

    def stats(self) -> dict[str, Any]:
        tiers = {name: len(refs) for name, refs in zip(TIERS, self._refs, strict=True) if refs}
        return {"blocks": len(self._refs[0]), "tiers": tiers, **self.counts}


def _only_lora(keys: Any, lora: str | None) -> bool:
    """True when a block's extra keys are nothing but the LoRA name the seed already covers."""
    return keys is None or (lora is not None and tuple(keys) == (lora,))


def _salt(keys: Any, lora: str | None, cache_salt: str | None) -> tuple[bool, str | None]:
    """(keyable, cache salt) of a first block from its extra keys and the event's own salt.

    vLLM lists a first block's extra keys as LoRA name, (image id, offset) pairs, cache salt,
    prompt-embedding digests (bytes); only a lone string after the LoRA name is a salt.
    SGLang sends the salt as a field of its own (`cache_salt`), and one branch also in
    `extra_keys` with Dynamo's tag before it: that copy is the same salt, not another key."""
    rest = list(keys or ())
    if lora is not None and rest[:1] == [lora]:
        rest = rest[1:]
    if cache_salt is not None:
        rest = [k for k in rest if k not in (cache_salt, SALT_TAG + cache_salt)]
        return (not rest), cache_salt or None
    if not rest:
        return True, None
    if len(rest) == 1 and isinstance(rest[0], str):
        salt = rest[0].removeprefix(SALT_TAG)
        return True, salt or None
    return False, None
