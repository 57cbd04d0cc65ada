"""The pure core of the simulated engine: a vLLM-V1-like scheduler and its step physics.

No I/O and no wall clock: `schedule()` forms the next batch and says how long the step takes
on the simulated device; `complete(plan)` applies it and returns the tokens it produced. The
asyncio driver (runner.py) sleeps between the two; tests call `step()` and read `now`.

Each step (continuous batching, chunked prefill):
  1. running sequences first: a decoding one needs 1 token, a partly prefilled one the rest of
     its prompt; all share a budget of `max_num_batched_tokens`;
  2. then waiting ones, FCFS, while the budget, `max_num_seqs` and the KV pool allow; their
     cached prefix blocks are revived instead of recomputed;
  3. the step costs max(bytes / bandwidth, FLOPs / compute) + overhead, with bytes = weights
     + the KV of every scheduled sequence and FLOPs = 2 x params x tokens + attention.
A running sequence that needs a new block when the pool is full preempts the newest running
one, which recomputes later (the mid-stream stall of a full KV pool; docs/physics.md).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from proxy.sim import tokens
from proxy.sim.config import SimConfig
from proxy.sim.kvcache import BlockPool, block_hashes

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Seq:
    """One output sequence (a request with n=3 is three of these)."""

    seq_id: str
    prompt_ids: list[int]
    max_tokens: int
    seed: int = 0
    eos_at: int | None = None  # output length at which the model says EOS; None: ignore_eos
    stop: tuple[str, ...] = ()
    external_tokens: int = 0  # prompt tokens whose KV arrives from a prefill engine
    cache_salt: int = 0
    cache_salt_text: str = ""  # the request's cache_salt as sent (KV events carry it)
    lora_name: str = ""  # the LoRA adapter it runs under ("": the base model)
    lora_id: int | None = None
    request_id: str = ""

    hashes: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    last_blocks: list[int] = field(default_factory=list)  # its KV blocks when it finished
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_computed: int = 0
    num_cached: int = -1  # prompt tokens not prefilled here (prefix hit + external); -1: unset
    num_committed: int = 0  # prompt blocks published to the prefix cache
    state: str = WAITING
    finish_reason: str | None = None
    stop_reason: str | None = None
    preemptions: int = 0
    # Simulated clock readings (seconds): for tests of the physics without a wall clock.
    arrival: float = 0.0
    scheduled_at: float | None = None  # first left the waiting queue (vLLM's queue time ends)
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)


@dataclass
class StepPlan:
    entries: list[tuple[Seq, int]]  # (sequence, tokens computed for it this step)
    duration: float  # simulated seconds
    prefill_tokens: int
    decode_tokens: int
    flops: float
    bytes_read: float


@dataclass
class Output:
    """What one step produced for one sequence: a token's text, maybe the end."""

    seq: Seq
    text: str
    finish_reason: str | None
    stop_reason: str | None = None


def step_duration(cfg: SimConfig, work: Iterable[tuple[int, int]]) -> tuple[float, float, float]:
    """(seconds, FLOPs, bytes) of one forward pass over `work` = [(new tokens, context before)].

    Roofline: a step is bound by whichever of weight+KV reads or matmul+attention FLOPs takes
    longer. Attention of a chunk of c new tokens over p earlier ones costs
    4 x layers x hidden x c x (p + c/2) (QK^T and AV, causal), the quadratic prefill term.
    """
    m = cfg.layout
    new_total = 0
    attn = 0.0
    kv_tokens = 0
    for new, ctx in work:
        new_total += new
        attn += 4.0 * m.num_layers * m.hidden_size * new * (ctx + new / 2.0)
        kv_tokens += ctx + new
    flops = 2.0 * m.params * new_total + attn
    nbytes = cfg.weight_bytes + kv_tokens * cfg.kv_bytes_per_token
    seconds = max(nbytes / cfg.bandwidth, flops / cfg.effective_flops) + cfg.step_overhead_s
    return seconds, flops, nbytes


def prefill_seconds(cfg: SimConfig, prompt_tokens: int, cached_tokens: int = 0) -> float:
    """Time to prefill a lone prompt in chunks, as the scheduler would (excluding queueing)."""
    total, done = 0.0, cached_tokens
    while done < prompt_tokens:
        chunk = prompt_tokens - done
        if cfg.enable_chunked_prefill:
            chunk = min(chunk, cfg.max_num_batched_tokens)
        total += step_duration(cfg, [(chunk, done)])[0]
        done += chunk
    return total


def kv_transfer_seconds(cfg: SimConfig, num_tokens: int) -> float:
    """Simulated time to pull `num_tokens` of KV from a prefill engine over the P/D link."""
    return cfg.kv_transfer_latency_s + num_tokens * cfg.kv_bytes_per_token / (
        cfg.kv_transfer_gbs * 1e9
    )


class Scheduler:
    """Continuous batching over a fixed KV pool with a prefix cache. Time is simulated."""

    def __init__(self, cfg: SimConfig, record_kv_events: bool | None = None) -> None:
        self.cfg = cfg
        if record_kv_events is None:
            record_kv_events = cfg.kv_events_endpoint is not None
        self.pool = BlockPool(
            cfg.num_kv_blocks, cfg.enable_prefix_caching, cfg.block_size, record_kv_events
        )
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.seqs: dict[str, Seq] = {}
        self.now = 0.0
        self.steps = 0
        self.busy_seconds = 0.0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        self.external_tokens = 0  # prompt tokens whose KV came over the P/D link
        self.preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    # --- requests -------------------------------------------------------------------
    def add(self, seq: Seq) -> None:
        bs = self.cfg.block_size
        if seq.num_prompt + 1 > self.pool.num_blocks * bs:
            raise ValueError(
                f"the prompt needs {math.ceil((seq.num_prompt + 1) / bs)} KV blocks, "
                f"the pool has {self.pool.num_blocks}"
            )
        if seq.seq_id in self.seqs:
            raise ValueError(f"duplicate sequence id {seq.seq_id!r}")
        seq.hashes = block_hashes(seq.prompt_ids, bs, seq.cache_salt)
        seq.arrival = self.now
        seq.state = WAITING
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: str) -> Seq | None:
        """Stop a sequence now and free its KV; None when it had already finished."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            return None
        if seq.state == WAITING:
            self.waiting.remove(seq)
        elif seq.state == RUNNING:
            self.running.remove(seq)
        self._finish(seq, "abort")
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step ---------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        cfg, bs = self.cfg, self.cfg.block_size
        budget = cfg.max_num_batched_tokens
        entries: list[tuple[Seq, int]] = []
        scheduled: set[int] = set()
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            want = seq.num_tokens - seq.num_computed
            n = min(want, budget) if cfg.enable_chunked_prefill else want
            if n > budget and entries:
                i += 1
                continue
            need = math.ceil((seq.num_computed + n) / bs) - len(seq.blocks)
            while need > self.pool.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.state != RUNNING:
                break
            if need > 0:
                seq.blocks += self.pool.allocate(need)
            entries.append((seq, n))
            scheduled.add(id(seq))
            budget -= n
            i += 1

        # Like vLLM, admit nothing new in a step that had to preempt: the pool is too tight.
        while not preempted and self.waiting and budget > 0:
            if len(self.running) >= cfg.max_num_seqs:
                break
            seq = self.waiting[0]
            limit = (seq.num_tokens - 1) // bs  # at least one token is always computed
            hit = self.pool.longest_hit(seq.hashes[:limit])
            computed = len(hit) * bs
            external = min(seq.external_tokens, seq.num_tokens - 1)
            computed = max(computed, external)
            want = seq.num_tokens - computed
            n = min(want, budget) if cfg.enable_chunked_prefill else want
            if n > budget and entries:
                break
            need = math.ceil((computed + n) / bs) - len(hit)
            if not self.pool.can_allocate(need, hit):
                break
            self.waiting.popleft()
            self.pool.touch(hit)
            seq.blocks = list(hit) + self.pool.allocate(need)
            seq.num_computed = computed
            seq.num_committed = len(hit)
            if seq.num_cached < 0:
                seq.scheduled_at = self.now
                seq.num_cached = computed
                self.prefix_queries += seq.num_prompt
                self.prefix_hits += len(hit) * bs
                self.external_tokens += max(0, external - len(hit) * bs)
            seq.external_tokens = 0  # a recompute after preemption cannot fetch it again
            self._commit_blocks(seq)
            seq.state = RUNNING
            self.running.append(seq)
            entries.append((seq, n))
            budget -= n

        if not entries:
            return None
        work = [(n, s.num_computed) for s, n in entries]
        seconds, flops, nbytes = step_duration(cfg, work)
        prefill = sum(n for s, n in entries if s.num_computed + n <= s.num_prompt or n > 1)
        return StepPlan(
            entries, seconds, prefill, sum(n for _, n in entries) - prefill, flops, nbytes
        )

    def complete(self, plan: StepPlan) -> list[Output]:
        self.now += plan.duration
        self.steps += 1
        self.busy_seconds += plan.duration
        outputs: list[Output] = []
        for seq, n in plan.entries:
            if seq.state != RUNNING:
                continue  # aborted while the step ran
            seq.num_computed += n
            self._commit_blocks(seq)
            if seq.num_computed < seq.num_tokens:
                continue  # a prefill chunk that did not reach the end of the prompt
            outputs.append(self._sample(seq))
        return outputs

    def step(self) -> tuple[StepPlan | None, list[Output]]:
        plan = self.schedule()
        if plan is None:
            return None, []
        return plan, self.complete(plan)

    def run_until_idle(self, max_steps: int = 1_000_000) -> list[StepPlan]:
        plans = []
        for _ in range(max_steps):
            plan, _ = self.step()
            if plan is None:
                break
            plans.append(plan)
        return plans

    # --- internals --------------------------------------------------------------------
    def _sample(self, seq: Seq) -> Output:
        pos = seq.num_output
        tid, text = tokens.output_token(seq.seed, pos)
        seq.output_ids.append(tid)
        self.generation_tokens += 1
        if seq.first_token_at is None:
            seq.first_token_at = self.now
            self.prompt_tokens += seq.num_prompt
        finish: str | None = None
        stop_reason: str | None = None
        if seq.eos_at is not None and seq.num_output >= seq.eos_at:
            text, finish = "", "stop"  # the EOS token itself has no text
        elif seq.stop:
            joined = seq.text + text
            start = max(0, len(seq.text) - max(len(s) for s in seq.stop) + 1)
            found = [(joined.find(s, start), s) for s in seq.stop]
            found = [(i, s) for i, s in found if i >= 0]
            if found:
                idx, stop_reason = min(found)
                text = joined[len(seq.text) : idx] if idx > len(seq.text) else ""
                finish = "stop"
        if finish is None and seq.num_output >= seq.max_tokens:
            finish = "length"
        seq.text += text
        if finish is not None:
            seq.stop_reason = stop_reason
            self.running.remove(seq)
            self._finish(seq, finish)
        return Output(seq, text, finish, stop_reason)

    def _commit_blocks(self, seq: Seq) -> None:
        bs = self.cfg.block_size
        full = min(seq.num_computed // bs, len(seq.hashes))
        pool = self.pool
        for i in range(seq.num_committed, full):
            if pool.records_events:
                parent = seq.hashes[i - 1] if i else None
                tokens = seq.prompt_ids[i * bs : (i + 1) * bs]
                salt = seq.cache_salt_text if i == 0 else ""
                lora = (seq.lora_name, seq.lora_id) if seq.lora_name else None
                pool.commit(seq.blocks[i], seq.hashes[i], parent, tokens, salt, lora)
            else:
                pool.commit(seq.blocks[i], seq.hashes[i])
        seq.num_committed = max(seq.num_committed, full)

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.pool.release(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.num_committed = 0
        seq.state = WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Seq, reason: str) -> None:
        self.pool.release(seq.blocks)
        seq.last_blocks = seq.blocks
        seq.blocks = []
        seq.state = FINISHED
        seq.finish_reason = seq.finish_reason or reason
        seq.finished_at = self.now
        self.seqs.pop(seq.seq_id, None)


def make_seq(
    cfg: SimConfig,
    seq_id: str,
    prompt_ids: Sequence[int],
    max_tokens: int,
    *,
    index: int = 0,
    seed: int | None = None,
    ignore_eos: bool = False,
    stop: Sequence[str] = (),
    external_tokens: int = 0,
    cache_salt: int = 0,
    cache_salt_text: str = "",
    lora_name: str = "",
    lora_id: int | None = None,
) -> Seq:
    """A sequence with its deterministic output words and natural (EOS) length."""
    s = tokens.request_seed(prompt_ids, index, seed, cfg.seed)
    eos = (
        None
        if ignore_eos
        else tokens.natural_length(s, cfg.min_output_tokens, cfg.max_output_tokens)
    )
    return Seq(
        seq_id=seq_id,
        prompt_ids=list(prompt_ids),
        max_tokens=max_tokens,
        seed=s,
        eos_at=eos,
        stop=tuple(x for x in stop if x),
        external_tokens=external_tokens,
        cache_salt=cache_salt,
        cache_salt_text=cache_salt_text,
        lora_name=lora_name,
        lora_id=lora_id,
    )
