"""The bench mock's engine: the prefix cache it keeps to itself and how it schedules prefill.

Two prefill models, chosen by EngineSettings.prefill_chunk_tokens:

  0 (the default)  serial, whole prompts: one prompt at a time holds the instance for its
                   uncached tokens / prefill_tokens_per_s; the others wait their turn (first
                   come first served, or by `priority` with priority scheduling).
  N > 0            steps, as vLLM's V1 scheduler runs them with chunked prefill: each step
                   computes at most N prompt tokens (vLLM's --max-num-batched-tokens) and takes
                   (its tokens) / prefill_tokens_per_s. The prompts already begun go first, in
                   the order they began, each as much as the budget left allows; the budget
                   still left goes to waiting prompts (first come first served, or by
                   `priority`), one prompt's first chunk after another. A prompt's first token
                   comes at the end of the step that computes its last one. With
                   preempt_prefill, a begun prompt has no precedence: every step takes the
                   unfinished prompts by (priority, arrival), so a higher-priority arrival
                   waits at most for the step running when it lands, and a lower-priority
                   prompt it passes keeps what it has computed and resumes after it. That is
                   not what vLLM does today (its V1 scheduler preempts only when KV blocks run
                   out), it is what preempting a running prefill would give.

Decode is not modelled here: it is free and parallel (backend.py paces the chunks).
StepScheduler is the pure core of the step model (no clock, no asyncio); MockEngine drives it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field

from proxy.bench.mock.cache import DEFAULT_BLOCK_TOKENS, PrefixCache

DEFAULT_PREFILL_TOKENS_PER_S = 20_000.0
# vLLM's --max-num-batched-tokens when `vllm serve` is not given one (vllm/engine/arg_utils.py):
# 2048, and 8192 on GPUs of 70 GiB or more other than the A100.
VLLM_BATCHED_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The knobs of one engine-mode instance (the CLI's --cache-* and timing flags)."""

    cache_tokens: int
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    chunk_interval_s: float = 0.0
    # Queued prefills go by the request's `priority` (lower first, then arrival), as vLLM's
    # --scheduling-policy priority orders its waiting queue; off, a priority other than 0 is
    # refused with vLLM's 400.
    priority_scheduling: bool = False
    # > 0: prefill in steps of at most this many tokens (see the module's docstring).
    prefill_chunk_tokens: int = 0
    # With steps: between them, a begun prompt may be passed by a higher-priority one.
    preempt_prefill: bool = False

    def __post_init__(self) -> None:
        if self.cache_tokens < 0 or self.block_tokens < 1:
            raise ValueError("cache_tokens must be >= 0 and block_tokens >= 1")
        if self.prefill_tokens_per_s <= 0 or self.chunk_interval_s < 0:
            raise ValueError("prefill_tokens_per_s must be > 0 and chunk_interval_s >= 0")
        if self.prefill_chunk_tokens < 0:
            raise ValueError("prefill_chunk_tokens must be >= 0 (0: whole prompts, serially)")
        if self.preempt_prefill and not (self.prefill_chunk_tokens and self.priority_scheduling):
            raise ValueError("preempt_prefill needs prefill_chunk_tokens and priority_scheduling")


@dataclass(eq=False, slots=True)
class Prefill:
    """One prompt's prefill, as the step scheduler sees it."""

    rank: int  # its priority (0 for all without priority scheduling): lower goes first
    arrival: int
    tokens: Sequence[Hashable]
    left: int = -1  # uncached tokens still to compute; -1 until its first step
    cached: int = 0
    gone: bool = False  # its client left
    done: asyncio.Future[int] | None = field(default=None, repr=False)


Step = list[tuple[Prefill, int]]  # the prompts a step computes, and how many tokens of each


class StepScheduler:
    """Which prompt tokens each step computes: vLLM V1's order (the prompts begun first, then
    the waiting ones), or with `preempt` every unfinished prompt by (priority, arrival)."""

    def __init__(self, budget: int, preempt: bool = False) -> None:
        if budget < 1:
            raise ValueError("a step computes at least one token")
        self.budget = budget
        self.preempt = preempt
        self.running: list[Prefill] = []  # begun and unfinished, in the order they began
        self._waiting: list[tuple[int, int, Prefill]] = []  # heap: rank, arrival
        self.queued = 0  # waiting, not begun

    def add(self, job: Prefill) -> None:
        heapq.heappush(self._waiting, (job.rank, job.arrival, job))
        self.queued += 1

    def remove(self, job: Prefill) -> None:
        """Its client left: it computes nothing more (a step already running still ends)."""
        if not job.gone and job.left < 0:
            self.queued -= 1
        job.gone = True

    def plan(self, begin: Callable[[Prefill], None]) -> Step:
        """The next step; `begin` is called on each prompt as it gets its first tokens (the
        cache is looked up then, as an engine's scheduler does) and sets its `left`."""
        running = [job for job in self.running if not job.gone]
        if self.preempt:  # nothing holds its place: all compete again
            for job in running:
                heapq.heappush(self._waiting, (job.rank, job.arrival, job))
            running = []
        budget, step = self.budget, []
        for job in running:
            if budget <= 0:
                break
            n = min(job.left, budget)
            step.append((job, n))
            budget -= n
        while self._waiting and budget > 0:
            job = heapq.heappop(self._waiting)[2]
            if job.gone:
                continue
            if job.left < 0:
                self.queued -= 1
                begin(job)
            n = min(job.left, budget)
            running.append(job)
            step.append((job, n))
            budget -= n
        self.running = running
        return step

    def unfinished(self) -> list[Prefill]:
        return [j for j in self.running + [e[2] for e in self._waiting] if not j.gone]

    def finish(self, step: Step) -> list[Prefill]:
        """The step ran: the prompts it completed, whose first token is due now."""
        done = []
        for job, n in step:
            job.left -= n
            if job.left <= 0 and not job.gone:
                done.append(job)
        self.running = [job for job in self.running if job.left > 0 and not job.gone]
        return done


class MockEngine:
    """One instance: its prefix cache and its prefill, serial or in steps (see above).
    `sleep` and `now` are the clock prefill runs on (tests pass a virtual one)."""

    def __init__(
        self,
        settings: EngineSettings,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.cache = PrefixCache(settings.cache_tokens, settings.block_tokens)
        self._busy = False  # a prefill holds the instance (serial)
        self._queue: list[tuple[int, int, asyncio.Future[None]]] = []  # heap: priority, arrival
        self._arrivals = itertools.count()
        self._waiting = 0  # queued for a serial prefill
        self._steps = StepScheduler(max(1, settings.prefill_chunk_tokens), settings.preempt_prefill)
        self._stepper: asyncio.Task[None] | None = None
        self._sleep = sleep
        self._now = now
        self.step_log: list[Step] | None = None  # a list: every step is appended to it
        self.running = 0  # requests streaming their answer
        self.generation_tokens = 0

    @property
    def waiting(self) -> int:
        """Requests queued for prefill, not begun."""
        return self._waiting + self._steps.queued

    async def prefill(self, tokens: Sequence[Hashable], priority: int = 0) -> int:
        """Wait for the prompt's turn and compute its uncached tokens; returns the cached
        tokens. The cache is looked up when its turn comes, as an engine's scheduler does, so
        a queued request finds what the one before it left."""
        rank = priority if self.settings.priority_scheduling else 0
        if self.settings.prefill_chunk_tokens:
            return await self._stepped(tokens, rank)
        if self._busy or self._queue:
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._queue, (rank, next(self._arrivals), turn))
            self._waiting += 1
            try:
                await turn  # handed the instance by the prefill before it
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._next()  # it was its turn: the next one's now (else _next skips it)
                raise
            finally:
                self._waiting -= 1
        else:
            self._busy = True
        try:
            cached = self.cache.admit(tokens)
            await self._sleep((len(tokens) - cached) / self.settings.prefill_tokens_per_s)
        finally:
            self._next()
        return cached

    def _next(self) -> None:
        """Hand the instance to the next queued prefill, or free it."""
        while self._queue:
            turn = heapq.heappop(self._queue)[2]
            if not turn.done():
                turn.set_result(None)
                return
        self._busy = False

    async def _stepped(self, tokens: Sequence[Hashable], rank: int) -> int:
        job = Prefill(rank, next(self._arrivals), tokens)
        job.done = asyncio.get_running_loop().create_future()
        self._steps.add(job)
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.create_task(self._run_steps())
        try:
            return await job.done
        except asyncio.CancelledError:
            self._steps.remove(job)
            raise

    def _begin(self, job: Prefill) -> None:
        job.cached = self.cache.admit(job.tokens)
        job.left = len(job.tokens) - job.cached

    async def _run_steps(self) -> None:
        """Run steps while any prompt is unfinished; a step's length is its tokens' time. A
        step that starts late (this process woke late: the host is busy) ends when it was due
        if it can, as a GPU does not wait for a late host between its own steps; so a prompt
        of k steps is not k wake-ups late."""
        due = self._now()  # when the step before ended, or should have
        try:
            while step := self._steps.plan(self._begin):
                if self.step_log is not None:
                    self.step_log.append(step)
                seconds = sum(n for _, n in step) / self.settings.prefill_tokens_per_s
                now = self._now()
                due = max(due, now - seconds) + seconds  # catch up by one step's length at most
                await self._sleep(due - now)
                for job in self._steps.finish(step):
                    if job.done is not None and not job.done.done():
                        job.done.set_result(job.cached)
        except Exception as e:  # no prompt is left waiting on a stepper that is gone
            for job in self._steps.unfinished():
                if job.done is not None and not job.done.done():
                    job.done.set_exception(e)
            raise

    def metrics_text(self) -> str:
        """Generic counters only: nothing here names or implies the cache's size."""
        s = self.cache.stats()
        rows = (
            ("mock_requests", "counter", "Requests prefilled.", s.requests),
            ("mock_prompt_tokens", "counter", "Prompt tokens received.", s.prompt_tokens),
            ("mock_cached_tokens", "counter", "Prompt tokens served from cache.", s.cached_tokens),
            ("mock_generation_tokens", "counter", "Tokens streamed.", self.generation_tokens),
            ("mock_requests_waiting", "gauge", "Requests queued for prefill.", self.waiting),
            ("mock_requests_running", "gauge", "Requests streaming.", self.running),
        )
        lines = []
        for name, kind, help_, value in rows:
            sample = f"{name}_total" if kind == "counter" else name
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{sample} {value}"]
        return "\n".join(lines) + "\n"
