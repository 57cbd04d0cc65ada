"""Each backend's effective prefix-cache size, learned from what its engine reports (pure).

Most engines never say how much prefix cache they have (llama.cpp, SGLang, any OpenAI-compatible
server, vLLM behind a gateway), and where they do (vLLM's `cache_config_info`) running
sequences share the pool, so the cache that survives between two requests is smaller and moves
with load. An index that believes a larger cache predicts hits the engine no longer has, and a
router that trusts it keeps prompts on backends that evicted them.

The ground truth arrives with every metered response: the engine's own `cached_tokens`. Each
one is compared with what the index predicted for that backend when the request was routed:

- **false hit** (the index predicted a cached prefix, the engine reported much less, and the
  prefix was recorded long enough before this request to have been prefilled): the engine
  evicted what the index still holds, so the index is too big. The estimate drops to a
  fraction (`shrink`, 93%) of what the index holds for that backend now: engines lose the odd
  prompt for reasons other than size (llama.cpp's slot choice, a burst of long sequences).
- **ghost hit** (the engine reported more than the index predicted, and the extra blocks are
  ones the index itself trimmed for lack of capacity): the engine holds more than the index
  believes; the estimate grows by the blocks the engine proved it kept, times `grow`.
- anything else agrees (or is not evidence: no `cached_tokens`, a prompt too short to tell).

Between the two the estimate settles where the index forgets a little before the engine does.
Replicas that share what they learn (proxy.routing.shared_placement) hand over each estimate
that moved on their own evidence (`take_moved`) and `adopt` the others': one estimate per
backend, moved by every replica's responses, as one proxy's would be by all of them.
A published pool size is the upper bound, never the estimate itself. Units are the index's
blocks (64 characters by default), so the estimate sizes the index directly; the engine's
tokens are compared as fractions of the prompt, which needs no tokenizer.

An engine whose cache is a few slots (llama.cpp: proxy.routing.slots) also has a floor: it
holds as many prompts as it has slots, and a miss caused by two requests of one prompt taking
both slots says nothing about its size, so no false hit takes the estimate below them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from proxy.routing.index import DEFAULT_CAPACITY_BLOCKS
from proxy.routing.slots import SlotFloor, SlotLayout


@dataclass(slots=True)
class Outcome:
    """One response's evidence about its backend's cache (index blocks unless stated)."""

    predicted_blocks: int  # the index's match for this backend when the request was routed
    prompt_blocks: int  # the prompt's length
    cached_fraction: float | None  # engine-reported cached_tokens / prompt_tokens (None: silent)
    occupancy: int  # blocks the index holds for this backend now
    ghost_blocks: int = 0  # leading blocks found in the index or among those it trimmed
    recorded_age_s: float | None = None  # how long before this request the match was recorded
    ttft_s: float | None = None  # this request's upstream time to first token


@dataclass(slots=True)
class CacheEstimate:
    """The learned capacity of one backend, and how well the index has been predicting it."""

    capacity: float
    upper: float  # the published pool size, or the configured default
    samples: int = 0  # responses that carried cached_tokens
    ignored: int = 0  # responses without it
    predicted_hits: int = 0
    false_hits: int = 0
    ghost_hits: int = 0
    adopted: int = 0  # times the estimate was taken from another replica's evidence
    predicted_ratio: float = 0.0  # EWMA of predicted cached share of the prompt
    actual_ratio: float = 0.0  # EWMA of the engine-reported cached share
    agreement: float = 1.0  # EWMA of "prediction and report agree"
    prompt_blocks: float = 0.0  # running mean of its prompts' length (a slot engine's floor)
    last_change: str = "initial"

    def as_dict(self) -> dict[str, Any]:
        return {
            "capacity_blocks": round(self.capacity),
            "upper_blocks": round(self.upper),
            "samples": self.samples,
            "ignored": self.ignored,
            "predicted_hits": self.predicted_hits,
            "false_hits": self.false_hits,
            "ghost_hits": self.ghost_hits,
            "adopted": self.adopted,
            "predicted_hit_ratio": round(self.predicted_ratio, 4),
            "actual_hit_ratio": round(self.actual_ratio, 4),
            "agreement": round(self.agreement, 4),
            "last_change": self.last_change,
        }


@dataclass
class CapacityLearner:
    """A CacheEstimate per backend, fed one Outcome per metered response."""

    default_blocks: int = DEFAULT_CAPACITY_BLOCKS
    shrink: float = 0.93  # a false hit leaves this share of what the index held
    grow: float = 1.5  # a ghost hit adds this multiple of the blocks the engine proved it kept
    min_blocks: int = 32  # never below this, nor below the prompt being observed
    min_predicted: int = 4  # predictions shorter than this say too little to act on
    tolerance: float = 0.25  # share of the prediction that engines' rounding may lose
    half_life: float = 32.0  # responses, for the ratio and agreement averages
    estimates: dict[str, CacheEstimate] = field(default_factory=dict)
    # Slot engines' floors (set_slots): the prompts their slots hold, whatever misses say.
    slot_floors: dict[str, SlotFloor] = field(default_factory=dict)
    slot_fill: float = 0.8  # placement's fill: the floor leaves it that share of headroom
    moved: set[str] = field(default_factory=set)  # moved on this replica's evidence, not taken
    # Told of a backend just before its capacity changes (the placement pins the free room it
    # computed from the old value: proxy.routing.placement_views.Room).
    listener: Callable[[str], None] | None = None

    def _moving(self, backend: str) -> None:
        if self.listener is not None:
            self.listener(backend)

    def estimate(self, backend: str) -> CacheEstimate:
        est = self.estimates.get(backend)
        if est is None:
            est = self.estimates[backend] = CacheEstimate(
                float(self.default_blocks), float(self.default_blocks)
            )
        return est

    def capacity(self, backend: str) -> int:
        """Index blocks to keep for `backend` now."""
        return round(self.estimate(backend).capacity)

    def measured(self, backend: str) -> bool:
        """Whether an engine report ever moved `backend`'s estimate (else it is a bound)."""
        est = self.estimates.get(backend)
        return est is not None and est.false_hits + est.ghost_hits + est.adopted > 0

    def take_moved(self) -> dict[str, float]:
        """Estimates that moved on this replica's evidence since the last call."""
        moved, self.moved = self.moved, set()
        return {b: self.estimates[b].capacity for b in sorted(moved) if b in self.estimates}

    def requeue(self, backends: Iterable[str]) -> None:
        """Moves taken but not delivered (the exchange failed): hand them over next time."""
        self.moved |= set(backends)

    def adopt(self, backend: str, blocks: float) -> bool:
        """Take another replica's estimate for `backend` (its evidence is as good as ours);
        returns whether ours changed. An estimate that moved here since the moves were last
        taken is newer and stays."""
        if backend in self.moved:
            return False
        est = self.estimate(backend)
        value = min(max(float(blocks), self._slot_floor(backend)), est.upper)
        if round(value) == round(est.capacity):
            return False
        self._moving(backend)
        est.capacity = value
        est.adopted += 1
        est.last_change = f"adopted from another replica: {value:.0f} blocks"
        return True

    def forget(self, backend: str) -> None:
        """`backend` left the fleet, or a new engine took its address: its estimate and any
        move not yet handed to the other replicas go (a new engine starts at the default,
        as any backend does before its first report)."""
        self._moving(backend)
        self.estimates.pop(backend, None)
        self.slot_floors.pop(backend, None)
        self.moved.discard(backend)

    def set_slots(self, backend: str, layout: SlotLayout, slot_blocks: int | None) -> bool:
        """The engine keeps `layout.slots` sequences of at most `slot_blocks` index blocks
        each (llama.cpp's /props or /slots): the estimate never goes below the prompts they
        hold. Returns whether the estimate moved (it rose to the floor)."""
        self.slot_floors[backend] = SlotFloor(layout, slot_blocks, self.slot_fill)
        return self._raise_to_floor(backend, 0)

    def _slot_floor(self, backend: str, prompt_blocks: int = 0) -> float:
        """One prompt (`prompt_blocks`, the one observed); a slot engine's slots' prompts, of
        the typical size here or of this one if longer."""
        sf = self.slot_floors.get(backend)
        low = float(max(self.min_blocks, prompt_blocks))
        if sf is None:
            return low
        typical = self.estimates[backend].prompt_blocks if backend in self.estimates else 0.0
        return max(low, sf.blocks(max(typical, float(prompt_blocks))))

    def _raise_to_floor(self, backend: str, prompt_blocks: int) -> bool:
        est = self.estimate(backend)
        floor = min(self._slot_floor(backend, prompt_blocks), est.upper)
        if est.capacity >= floor:
            return False
        self._moving(backend)
        est.capacity = floor
        slots = self.slot_floors[backend].layout.slots
        est.last_change = f"slots: {slots} prompts of {est.prompt_blocks:.0f} blocks"
        return True

    def set_upper(self, backend: str, blocks: int) -> None:
        """The engine published its pool size: a bound on the estimate, not the estimate.

        A backend without evidence yet starts at the bound (the best guess there is)."""
        est = self.estimate(backend)
        est.upper = float(max(blocks, self.min_blocks))
        if est.samples == 0 or est.capacity > est.upper:
            self._moving(backend)
            est.capacity = est.upper
            est.last_change = "published pool size"

    def observe(self, backend: str, o: Outcome) -> str | None:
        """Take one response into account; returns "shrink" or "grow" when the estimate moved."""
        est = self.estimate(backend)
        if o.cached_fraction is None or o.prompt_blocks <= 0:
            est.ignored += 1
            return None
        est.samples += 1
        frac = min(max(o.cached_fraction, 0.0), 1.0)
        actual = frac * o.prompt_blocks
        predicted = min(o.predicted_blocks, o.prompt_blocks)
        alpha = 1.0 - 0.5 ** (1.0 / self.half_life)
        est.predicted_ratio += alpha * (predicted / o.prompt_blocks - est.predicted_ratio)
        est.actual_ratio += alpha * (frac - est.actual_ratio)
        slack = max(2.0, self.tolerance * predicted)
        agree = abs(actual - predicted) <= slack
        est.agreement += alpha * (float(agree) - est.agreement)
        if est.prompt_blocks <= 0.0:
            est.prompt_blocks = float(o.prompt_blocks)
        est.prompt_blocks += 0.1 * (o.prompt_blocks - est.prompt_blocks)
        floor = self._slot_floor(backend, o.prompt_blocks)
        if predicted >= self.min_predicted:
            est.predicted_hits += 1
            if actual < predicted - slack and self._settled(o):
                est.false_hits += 1
                held = min(est.capacity, float(max(o.occupancy, 1)))
                self._moving(backend)
                est.capacity = min(max(floor, held * self.shrink), est.upper)
                est.last_change = (
                    f"shrink: predicted {predicted} blocks cached, engine reported {actual:.0f}"
                )
                self.moved.add(backend)
                return "shrink"
        proven = min(actual, float(o.ghost_blocks))
        if actual > predicted + slack and proven > predicted + slack:
            est.ghost_hits += 1
            before = est.capacity
            self._moving(backend)
            est.capacity = min(est.capacity + self.grow * (proven - predicted), est.upper)
            est.last_change = (
                f"grow: engine still held {proven - predicted:.0f} blocks the index had trimmed"
            )
            if est.capacity > before:
                self.moved.add(backend)
                return "grow"
            return None
        if backend in self.slot_floors and self._raise_to_floor(backend, o.prompt_blocks):
            return "grow"
        return None

    @staticmethod
    def _settled(o: Outcome) -> bool:
        """Whether the predicted prefix had time to be prefilled before this request.

        A prefix recorded moments ago may still be queued or prefilling on the engine for the
        request that brought it; a miss then says nothing about eviction. The earlier request
        needed about as long to its first token as this one did, so it is done once the record
        is older than this request's own TTFT."""
        if o.recorded_age_s is None:
            return True
        return o.recorded_age_s > (o.ttft_s or 0.0)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        out = {b: e.as_dict() for b, e in sorted(self.estimates.items())}
        for b, sf in self.slot_floors.items():
            if b in out:
                out[b]["slots"] = sf.as_dict(self.estimates[b].prompt_blocks)
        return out
