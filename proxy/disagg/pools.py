"""Which engines form the prefill-heavy and the decode-heavy pool, and where a request goes.

Pure: backends, demand and the request's numbers in, a plan out.

`plan_pools` splits the healthy backends: `prefill`-role ones are always in the prefill pool,
`decode`-role ones in the decode pool, and `mixed` ones are shared out by measured demand. The
prefill pool gets as many engines as the prefill demand needs at `target_utilization` (uncached
prompt tokens per second / one engine's measured prefill rate), at least one; the decode pool
everything else, because decode is the latency-sensitive phase (every extra stream in a batch
stretches every stream's ITL) and must still hold the decoding streams. A split neither pool
could carry is reported as infeasible, with the reason.

`classify` sorts one request for the pool split: prefill-heavy when its uncached prompt on the
chosen backend is at least the threshold and its expected output is short next to it;
decode-heavy otherwise (chat streams: short uncached prompts, long outputs). `plan_request`
turns that into what the forwarder does: one leg in a pool, or two legs (prefill, then decode)
with a KV transfer, which the threshold alone decides.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from proxy.disagg.legs import PdFlow

Role = Literal["mixed", "prefill", "decode"]
RequestClass = Literal["prefill", "decode"]
# Without a measured prefill rate, the share of mixed backends the prefill pool starts with.
DEFAULT_PREFILL_SHARE = 0.25
SHRINK_SLACK = 0.25  # the prefill pool gives an engine back only when it needs 1.25 fewer


@dataclass(frozen=True, slots=True)
class BackendState:
    """What pool planning needs to know about one backend."""

    name: str
    role: str = "mixed"  # mixed | prefill | decode
    healthy: bool = True
    inflight: int = 0
    flow: PdFlow | None = None  # the KV-transfer flow its engine speaks (legs.flow_for)


@dataclass(frozen=True, slots=True)
class PoolSplit:
    """Two disjoint pools of backend names, or an empty split with the reason it failed."""

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    reason: str = ""
    prefill_engines_needed: float | None = None  # fractional engines the demand needs
    decode_engines_needed: float | None = None

    @property
    def feasible(self) -> bool:
        return bool(self.prefill) and bool(self.decode)

    def pool_of(self, name: str) -> str | None:
        if name in self.prefill:
            return "prefill"
        if name in self.decode:
            return "decode"
        return None

    def as_dict(self) -> dict[str, Any]:
        return {
            "prefill": list(self.prefill),
            "decode": list(self.decode),
            "feasible": self.feasible,
            "reason": self.reason,
            "prefill_engines_needed": _r(self.prefill_engines_needed),
            "decode_engines_needed": _r(self.decode_engines_needed),
        }


@dataclass(frozen=True, slots=True)
class Demand:
    """Measured load the pools must carry (WindowStats has each of these)."""

    prefill_tokens_per_s: float = 0.0  # uncached prompt tokens per second
    prefill_rate_per_engine: float | None = None  # tokens/s one engine prefills; None: unknown
    mean_streams: float = 0.0  # decoding streams in flight on average


def plan_pools(
    backends: Iterable[BackendState],
    demand: Demand,
    *,
    max_streams_per_engine: int = 256,
    target_utilization: float = 0.8,
    previous: PoolSplit | None = None,
) -> PoolSplit:
    """Split the healthy backends into a prefill-heavy and a decode-heavy pool.

    `previous` keeps the split stable: mixed backends stay in the pool they were in, and the
    prefill pool shrinks only when its demand fell by more than an engine and a quarter.
    """
    healthy = [b for b in backends if b.healthy]
    fixed_p = [b for b in healthy if b.role == "prefill"]
    fixed_d = [b for b in healthy if b.role == "decode"]
    mixed = [b for b in healthy if b.role not in ("prefill", "decode")]
    n = len(healthy)
    need_d = demand.mean_streams / max_streams_per_engine
    rate = demand.prefill_rate_per_engine
    need_p = (
        demand.prefill_tokens_per_s / (rate * target_utilization) if rate and rate > 0 else None
    )
    if n < 2:
        return PoolSplit(
            reason=f"{n} healthy backend{'s' if n != 1 else ''}: a split needs at least two",
            prefill_engines_needed=need_p,
            decode_engines_needed=need_d,
        )

    want_p = _prefill_count(need_p, len(fixed_p), len(mixed), previous)
    take = max(0, min(len(mixed), want_p - len(fixed_p)))
    if not fixed_d:
        take = min(take, len(mixed) - 1)  # the decode pool needs one engine at least
    before = set(previous.prefill) if previous else set()
    # Mixed engines that were prefill before stay so; then the ones with the fewest requests
    # in flight (the fewest streams to keep decoding beside new long prefills); then by name.
    order = sorted(mixed, key=lambda b: (b.name not in before, b.inflight, b.name))
    to_prefill = {b.name for b in order[:take]}
    prefill = tuple(sorted([b.name for b in fixed_p] + list(to_prefill)))
    decode = tuple(sorted(b.name for b in fixed_d + mixed if b.name not in to_prefill))
    return PoolSplit(prefill, decode, _why(prefill, decode, need_p, need_d, n), need_p, need_d)


def _prefill_count(need_p: float | None, fixed: int, mixed: int, previous: PoolSplit | None) -> int:
    if need_p is None:
        return max(fixed, 1, round(mixed * DEFAULT_PREFILL_SHARE))
    want = max(1, math.ceil(need_p - 1e-9))
    if previous is not None and previous.feasible:
        had = len(previous.prefill)
        if want < had and need_p > had - 1 - SHRINK_SLACK:
            want = had  # a little less demand: keep the engine (moving one costs its cache)
    return max(want, fixed)


def _why(
    prefill: tuple[str, ...], decode: tuple[str, ...], need_p: float | None, need_d: float, n: int
) -> str:
    if not prefill:
        return "no healthy backend can take the prefill pool"
    if not decode:
        return "no healthy backend is left for the decode pool"
    if need_p is not None and need_p > len(prefill):
        return (
            f"the prefill demand needs {need_p:.1f} engines at the target utilization, "
            f"but only {len(prefill)} of {n} can be spared from decoding"
        )
    if need_d > len(decode):
        return (
            f"the decoding streams need {need_d:.1f} engines, "
            f"but the decode pool would have {len(decode)}"
        )
    return (
        f"{len(prefill)} of {n} healthy backends for prefill-heavy requests, "
        f"{len(decode)} for decoding"
    )


def split_carries_demand(split: PoolSplit) -> bool:
    """Whether each pool has the engines its measured demand needs."""
    if not split.feasible:
        return False
    if split.prefill_engines_needed is not None and split.prefill_engines_needed > len(
        split.prefill
    ):
        return False
    return not (
        split.decode_engines_needed is not None and split.decode_engines_needed > len(split.decode)
    )


# --- one request ------------------------------------------------------------------------------


def classify(
    uncached_tokens: int,
    expected_output: float | None,
    threshold_tokens: int,
    output_ratio: float = 0.25,
) -> RequestClass:
    """Prefill-heavy: a long uncached prompt with an output short next to it; else decode-heavy.

    An unknown output length does not stop a long prompt from counting as prefill-heavy: its
    prefill is what stalls the streams around it.
    """
    if uncached_tokens < threshold_tokens:
        return "decode"
    if expected_output is not None and expected_output > uncached_tokens * output_ratio:
        return "decode"
    return "prefill"


def uncached_tokens(
    prompt_chars: int, matched_blocks: int, block_chars: int, chars_per_token: float = 4.0
) -> int:
    """A prompt's uncached tokens on one backend from the prefix index's view of it.

    `matched_blocks` is the backend's match (`RouteContext.matched_blocks[name]`); the index
    counts in characters, so tokens are estimated at `chars_per_token`.
    """
    uncached_chars = max(0, prompt_chars - matched_blocks * block_chars)
    return math.ceil(uncached_chars / chars_per_token)


def requested_output(body: Mapping[str, Any]) -> int | None:
    """The output cap the client asked for (max_completion_tokens, else max_tokens)."""
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


@dataclass
class OutputHistory:
    """Typical output length by prompt size, learned from finished requests (an EWMA per
    power-of-two bucket of prompt tokens), for requests that do not cap their output."""

    alpha: float = 0.1
    means: dict[int, float] = field(default_factory=dict)

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        b = _bucket(prompt_tokens)
        old = self.means.get(b)
        self.means[b] = output_tokens if old is None else old + self.alpha * (output_tokens - old)

    def expected(self, prompt_tokens: int, cap: int | None = None) -> float | None:
        """The learned mean for this prompt size, no more than the client's cap."""
        mean = self.means.get(_bucket(prompt_tokens))
        if mean is None:
            return None if cap is None else float(cap)
        return mean if cap is None else min(mean, float(cap))


def _bucket(tokens: int) -> int:
    return max(0, int(tokens).bit_length())


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """What the forwarder does with one request."""

    legs: Literal["one", "two"]  # one: a whole request; two: prefill leg, then decode leg
    candidates: tuple[str, ...]  # the one leg's backends, or the decode leg's; () = all
    prefill_candidates: tuple[str, ...] = ()  # the prefill leg's backends (two legs only)
    flow: PdFlow | None = None  # two legs: vllm (sequential) or sglang (concurrent)
    request_class: RequestClass = "decode"
    reason: str = ""


def plan_request(
    split: PoolSplit | None,
    backends: Sequence[BackendState],
    request_class: RequestClass,
    *,
    long_prompt: bool | None = None,
    kv_transfer: bool = True,
) -> RequestPlan:
    """Where one request goes while the split is `split` (None: disaggregation inactive).

    Two legs when the prefill pool has `prefill`-role engines and the decode pool `decode`-role
    engines speaking the same KV-transfer flow, the API has such a flow (`kv_transfer`: chat and
    completions) and the uncached prompt is at least the threshold (`long_prompt`; None: as
    `request_class` says). The threshold alone decides there: moved over the link, a long
    prompt stalls no decode engine, whatever its output. Otherwise one leg: decode-heavy
    requests on the decode pool, prefill-heavy ones on the prefill-heavy pool (the pool split,
    which needs no transfer and works with every engine).
    """
    if split is None or not split.feasible:
        return RequestPlan("one", (), request_class=request_class, reason="no split active")
    long = request_class == "prefill" if long_prompt is None else long_prompt
    if kv_transfer and long:
        pair = _kv_pair(split, backends)
        if pair is not None:
            flow, prefill, decode = pair
            return RequestPlan(
                "two",
                decode,
                prefill,
                flow,
                "prefill",
                f"long prompt: {flow} KV transfer from the prefill pool to the decode pool",
            )
    if request_class == "decode":
        return RequestPlan(
            "one", split.decode, request_class="decode", reason="decode-heavy: decode pool"
        )
    return RequestPlan(
        "one",
        split.prefill,
        request_class="prefill",
        reason="prefill-heavy: prefill pool (no KV transfer for it, so the whole request)",
    )


def _kv_pair(
    split: PoolSplit, backends: Sequence[BackendState]
) -> tuple[PdFlow, tuple[str, ...], tuple[str, ...]] | None:
    """The first flow with a `prefill`-role engine in the prefill pool and a `decode`-role one
    in the decode pool: (flow, those prefill engines, those decode engines)."""
    by_name = {b.name: b for b in backends}
    flows: tuple[PdFlow, ...] = ("vllm", "sglang")
    for flow in flows:
        p = tuple(
            n
            for n in split.prefill
            if (b := by_name.get(n)) and b.role == "prefill" and b.flow == flow
        )
        d = tuple(
            n
            for n in split.decode
            if (b := by_name.get(n)) and b.role == "decode" and b.flow == flow
        )
        if p and d:
            return flow, p, d
    return None


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
