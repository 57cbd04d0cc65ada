"""The mock engine's pure parts: what it reads of a prompt and the prefix cache it keeps.

Deliberately not the proxy's units (3-character tokens, 32-token blocks, its own hash), so a
cache-aware router is judged on an engine it has no model of.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 3
DEFAULT_BLOCK_TOKENS = 32


def render_prompt(body: Mapping[str, Any]) -> str:
    """The text the engine reads: chat messages as `<|role|>content` in order, then the
    assistant's tag; or the completion prompt as sent."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = [
            f"<|{m.get('role', '')}|>{_content_text(m.get('content'))}"
            for m in messages
            if isinstance(m, Mapping)
        ]
        return "".join(parts) + "<|assistant|>"
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return "".join(str(p) for p in prompt)
    return str(prompt)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only the text ones reach this engine
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def tokenize(text: str) -> list[str]:
    """Three characters a token: deliberately not the proxy's unit, so that a router's match
    with this engine cannot come from sharing one."""
    return [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]


@dataclass(frozen=True, slots=True)
class CacheStats:
    """What GET /mock/cache answers; evictions count blocks."""

    capacity_tokens: int
    used_tokens: int
    block_tokens: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    evictions: int


class PrefixCache:
    """An LRU of chained block hashes holding at most `capacity_tokens` tokens; pure.

    Tokens are any hashable values (3-character strings from `tokenize`, ints, bytes). Only
    full blocks are cached, as in vLLM; a block's hash covers every token before it, so a
    cached block implies its whole prefix was the same.
    """

    def __init__(self, capacity_tokens: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.capacity_tokens = 0
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.evictions = 0
        self.resize(capacity_tokens)

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_tokens // self.block_tokens

    @property
    def used_tokens(self) -> int:
        return len(self._blocks) * self.block_tokens

    def block_hashes(self, tokens: Sequence[Hashable]) -> list[int]:
        """One chained hash per full block of `tokens`."""
        out: list[int] = []
        parent = 0
        size = self.block_tokens
        for start in range(0, len(tokens) - size + 1, size):
            parent = hash((parent, tuple(tokens[start : start + size])))
            out.append(parent)
        return out

    def lookup(self, tokens: Sequence[Hashable]) -> int:
        """Cached tokens a prompt would be served now, without touching the LRU."""
        return self._cached(tokens, self.block_hashes(tokens))

    def admit(self, tokens: Sequence[Hashable]) -> int:
        """Serve one prompt: return its cached tokens, then insert or touch all its blocks."""
        hashes = self.block_hashes(tokens)
        cached = self._cached(tokens, hashes)
        # Tail first, so the prompt's first block ends most recently used: under pressure a
        # prompt loses its tail before its head and keeps a usable prefix. Of a prompt longer
        # than the whole cache only the head that fits is kept.
        for h in reversed(hashes[: self.capacity_blocks]):
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                self._blocks[h] = None
        self._evict()
        self.requests += 1
        self.prompt_tokens += len(tokens)
        self.cached_tokens += cached
        return cached

    def resize(self, capacity_tokens: int) -> None:
        """Change the capacity; shrinking evicts the least recently used blocks at once."""
        if capacity_tokens < 0:
            raise ValueError(f"capacity must be >= 0 tokens, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self._evict()

    def stats(self) -> CacheStats:
        return CacheStats(
            capacity_tokens=self.capacity_tokens,
            used_tokens=self.used_tokens,
            block_tokens=self.block_tokens,
            requests=self.requests,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            evictions=self.evictions,
        )

    def _cached(self, tokens: Sequence[Hashable], hashes: Sequence[int]) -> int:
        hit = 0
        for h in hashes:
            if h not in self._blocks:
                break
            hit += 1
        # At least one token is computed, so a fully cached prompt still yields its logits.
        return max(0, min(hit * self.block_tokens, len(tokens) - 1))

    def _evict(self) -> None:
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
            self.evictions += 1


def parse_schedule(text: str) -> list[tuple[float, int]]:
    """`"60:2000,120:6000"` -> [(60.0, 2000), (120.0, 6000)]: seconds after start, tokens."""
    out: list[tuple[float, int]] = []
    for part in text.split(","):
        at, sep, tokens = part.strip().partition(":")
        try:
            entry = (float(at), int(tokens))
        except ValueError:
            entry = (-1.0, -1)
        if not sep or entry[0] < 0 or entry[1] < 0:
            raise ValueError(
                f"bad schedule entry {part.strip()!r}: use SECONDS:TOKENS, e.g. 60:2000,120:6000"
            )
        out.append(entry)
    return sorted(out)
