"""One backend's prefix cache, exactly, as warmroute's own block keys (pure, no I/O).

An engine names its blocks with hashes seeded by something private (vLLM: a random or
configured NONE_HASH seed, sha256 or xxhash), so they cannot be compared with the keys the
proxy computes for a request. But every `BlockStored` carries the blocks' token ids and its
parent's hash, so the view recomputes each block's key the proxy's way:
``key(block) = chain_tokens(key(parent), tokens of the block)``, where a block without a parent
chains from `seed(model, salt)`, and a parent is found through the engine-hash -> key map this
view keeps. Blocks of one event chain one after another, so the keys are exactly those of
`chain_tokens(seed, prompt_ids)` for the whole prompt (tests/test_kvevents_view.py proves it).

What the key cannot express is skipped and counted rather than guessed: blocks whose engine
hash also covers images, audio or prompt embeddings (extra keys other than a LoRA name or the
first block's cache salt), blocks of another KV cache group (hybrid models) or tier (`medium`
other than the GPU), events of another block size, and children of a parent the view never saw.
A LoRA adapter's blocks chain from `seed(lora_name)`, as a request naming that adapter as its
model would.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from proxy.kvevents.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from proxy.routing.prefix import chain_tokens, seed

log = logging.getLogger("warmroute.kvevents")

GPU = "GPU"


class KvCacheView:
    """The blocks one engine holds, keyed as `PrefixHasher` keys a token-id prompt."""

    def __init__(self, model: str, block_tokens: int) -> None:
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        self.model = model
        self.block_tokens = block_tokens
        self._by_engine: dict[BlockHash, int] = {}  # engine hash -> our key
        self._refs: dict[int, int] = {}  # our key -> engine hashes naming it
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "stored",  # blocks added
                "removed",  # blocks dropped by BlockRemoved
                "cleared",  # AllBlocksCleared applied
                "orphans",  # blocks whose parent the view does not hold
                "unknown_removals",  # BlockRemoved of a hash the view does not hold
                "unkeyable",  # blocks whose engine hash covers more than tokens
                "other_group",  # another KV cache group (hybrid models)
                "other_medium",  # another tier (CPU, storage)
                "other_block_size",  # blocks of a size this view does not key
            ),
            0,
        )

    # --- events ---------------------------------------------------------------------------
    def apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                self._remove(event)
            elif isinstance(event, AllBlocksCleared):
                self.clear()
                self.counts["cleared"] += 1

    def clear(self) -> None:
        self._by_engine.clear()
        self._refs.clear()

    def _store(self, event: BlockStored) -> None:
        n = len(event.block_hashes)
        if not self._ours(event.medium, event.group_idx, n):
            return
        if event.block_size != self.block_tokens:
            self.counts["other_block_size"] += n
            log.debug("KV event of %d-token blocks ignored", event.block_size)
            return
        n = min(n, len(event.token_ids) // self.block_tokens)
        lora = event.lora_name
        if lora is None and event.lora_id is not None:
            self.counts["unkeyable"] += n  # an old vLLM: the adapter's name is not on the wire
            return
        extra = event.extra_keys or ()
        if event.parent_block_hash is None:
            keyable, salt = _salt(extra[0] if extra else None, lora)
            if not keyable:
                self.counts["unkeyable"] += n
                return
            parent = seed(lora or self.model, salt)
        else:
            found = self._by_engine.get(event.parent_block_hash)
            if found is None:
                self.counts["orphans"] += n
                return
            parent = found
        # Blocks up to the first that an extra key (image, embedding) makes unkeyable.
        first_extra = 1 if event.parent_block_hash is None else 0
        usable = n
        for i in range(first_extra, min(n, len(extra))):
            if not _only_lora(extra[i], lora):
                usable = i
                break
        self.counts["unkeyable"] += n - usable
        keys = chain_tokens(parent, event.token_ids, self.block_tokens, usable)
        for engine_hash, key in zip(event.block_hashes, keys, strict=False):
            old = self._by_engine.get(engine_hash)
            if old == key:
                continue  # announced again (vLLM re-announces reused prefixes)
            if old is not None:
                self._unref(old)
            self._by_engine[engine_hash] = key
            self._refs[key] = self._refs.get(key, 0) + 1
            self.counts["stored"] += 1

    def _remove(self, event: BlockRemoved) -> None:
        if not self._ours(event.medium, event.group_idx, len(event.block_hashes)):
            return
        for engine_hash in event.block_hashes:
            key = self._by_engine.pop(engine_hash, None)
            if key is None:
                self.counts["unknown_removals"] += 1
            else:
                self._unref(key)
                self.counts["removed"] += 1

    def _ours(self, medium: str | None, group: int | None, n: int) -> bool:
        if medium not in (None, GPU):
            self.counts["other_medium"] += n
            return False
        if group not in (None, 0):
            self.counts["other_group"] += n
            return False
        return True

    def _unref(self, key: int) -> None:
        left = self._refs[key] - 1
        if left:
            self._refs[key] = left
        else:
            del self._refs[key]

    # --- queries ----------------------------------------------------------------------------
    def match(self, blocks: Sequence[int]) -> int:
        """Leading blocks of `blocks` held: the prefix the engine would find in its cache.

        The same answer as the prefix index's lookup. The scan stops at the first missing
        block, as the engine's own lookup does: a later block without its predecessors is
        useless to it, and here presence need not be monotone along the chain."""
        n = 0
        for key in blocks:
            if key not in self._refs:
                break
            n += 1
        return n

    def __contains__(self, key: object) -> bool:
        return key in self._refs

    def __len__(self) -> int:
        return len(self._refs)

    def keys(self) -> frozenset[int]:
        return frozenset(self._refs)

    def engine_hashes(self) -> frozenset[BlockHash]:
        return frozenset(self._by_engine)

    def stats(self) -> dict[str, Any]:
        return {"blocks": len(self._refs), **self.counts}


def _only_lora(keys: Any, lora: str | None) -> bool:
    """True when a block's extra keys are nothing but the LoRA name the seed already covers."""
    return keys is None or (lora is not None and tuple(keys) == (lora,))


def _salt(keys: Any, lora: str | None) -> tuple[bool, str | None]:
    """(keyable, cache salt) of a first block from its extra keys.

    vLLM lists a first block's extra keys as LoRA name, (image id, offset) pairs, cache salt,
    prompt-embedding digests (bytes); only a lone string after the LoRA name is a salt."""
    rest = list(keys or ())
    if lora is not None and rest[:1] == [lora]:
        rest = rest[1:]
    if not rest:
        return True, None
    if len(rest) == 1 and isinstance(rest[0], str):
        return True, rest[0] or None
    return False, None
