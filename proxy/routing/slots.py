"""Engines whose cache is a few slots, not a block pool: llama.cpp's `llama-server` (pure).

llama-server gives each of its `--parallel` slots one sequence's KV (`n_ctx` tokens per slot,
the total context divided among them). A slot keeps the last prompt it ran and nothing else: a
new request takes the idle slot whose prompt shares the longest prefix with it (above
`--slot-prompt-similarity`, 0.1 by default), else the least recently used idle slot, and that
slot's prompt is overwritten (tools/server/server-context.cpp, `get_available_slot`). So:

- the cache holds at most `slots` prompts, whatever their size up to `n_ctx` each: two slots
  of 4,096 tokens hold two prompts of 1,800 tokens, not four;
- a prompt is evicted by concurrency, not only by size: two requests of the same prompt at
  once occupy both slots, and the other prompt is gone although the cache is not "full".

A block-pool learner reads the second kind of miss as a smaller cache and shrinks below the
prompts the slots hold (issue 28: 197 blocks for two prompts of 114), and placement then
overflows a prompt and moves it. The slots are a floor instead: whatever the misses say, the
engine holds as many prompts as it has slots, between requests that do not collide.

The host prompt cache (`--cache-ram N` MiB, 8,192 by default; 0 disables it) saves a slot's
prompt to RAM when the slot is taken for another one, and loads the most similar saved prompt
back (server-task.cpp, `server_prompt_cache`). It holds at least the total context's tokens
and as many more as its RAM allows, so an engine with it on holds far more prompts than it has
slots. `/props` does not say whether it is on, nor its size: the learner finds it by evidence
(ghost hits grow the estimate above the slots' floor), and the floor is what it never falls
below.

What llama-server says (GET /props, served by default; GET /slots, on unless `--no-slots`):
`/props` → `total_slots` and `default_generation_settings.n_ctx` (per slot); `/slots` → one
object per slot with its `n_ctx` and `is_processing`. Either is enough.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """How many sequences an engine keeps at once, and how long each may be (tokens)."""

    slots: int
    ctx_tokens: int | None = None  # per slot; None when the engine did not say
    source: str = "props"  # "props", "slots", or "running" (inferred from busy slots seen)


def from_props(body: Any) -> SlotLayout | None:
    """llama-server's GET /props: `total_slots`, `default_generation_settings.n_ctx`."""
    if not isinstance(body, dict):
        return None
    slots = _positive(body.get("total_slots"))
    if slots is None:
        return None
    settings = body.get("default_generation_settings")
    ctx = _positive(settings.get("n_ctx")) if isinstance(settings, dict) else None
    return SlotLayout(slots, ctx, "props")


def from_slots(body: Any) -> SlotLayout | None:
    """llama-server's GET /slots: a list with one object (its `n_ctx`) per slot."""
    if not isinstance(body, list) or not body or not all(isinstance(s, dict) for s in body):
        return None
    sizes = [c for c in (_positive(s.get("n_ctx")) for s in body) if c is not None]
    return SlotLayout(len(body), min(sizes) if sizes else None, "slots")


def _positive(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return None
    return int(value) if value >= 1 else None


@dataclass(frozen=True, slots=True)
class SlotFloor:
    """The least an index may keep for a slot engine, in index blocks.

    `slots` prompts of the size typical of the backend's requests, each at most a slot long
    (`slot_blocks`), divided by `fill`: the share of a cache that placement lets its placed
    prompts take (proxy.routing.placement's `fill`, 0.8). A block-LRU index needs that headroom
    over the slots' prompts as well, for the suffixes of recent requests: the engine overwrote
    them with the next request of the same prompt, the index still holds them."""

    layout: SlotLayout
    slot_blocks: int | None  # a slot's n_ctx in index blocks (None: not told)
    fill: float = 0.8

    def blocks(self, prompt_blocks: float) -> float:
        """The floor for prompts of `prompt_blocks` blocks (0 before any was seen)."""
        per_slot = max(float(prompt_blocks), 0.0)
        if self.slot_blocks is not None:
            per_slot = min(per_slot, float(self.slot_blocks))
        return self.layout.slots * per_slot / self.fill

    def as_dict(self, prompt_blocks: float) -> dict[str, Any]:
        return {
            "slots": self.layout.slots,
            "slot_ctx_tokens": self.layout.ctx_tokens,
            "slot_blocks": self.slot_blocks,
            "source": self.layout.source,
            "floor_blocks": round(self.blocks(prompt_blocks)),
        }
