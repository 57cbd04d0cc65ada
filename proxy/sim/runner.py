"""The asyncio driver: one task per engine steps the scheduler in (scaled) real time.

Each step sleeps the step's simulated duration divided by the time scale, then hands each
produced token to its sequence's queue. Sleeps aim at a deadline on a running budget rather
than a fixed delay, so event-loop jitter does not accumulate into a slower device; when the
loop falls far behind (a busy machine) the budget restarts instead of bursting to catch up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from proxy.kvevents.publisher import KvEventPublisher
from proxy.sim.config import SimConfig
from proxy.sim.engine import Output, Scheduler, Seq
from proxy.sim.metrics import EngineMetrics

MAX_LAG_S = 0.05  # behind the deadline by more than this: restart the budget, do not burst
LOG_SIZE = 1000
log = logging.getLogger("warmroute.sim")


@dataclass
class TokenEvent:
    text: str
    finish_reason: str | None
    stop_reason: str | None
    at: float  # wall clock (time.monotonic) when the token was produced
    num_output: int


class AsyncEngine:
    """Owns a Scheduler and its stepping task; `submit` returns the sequence's token queue."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.scheduler = Scheduler(cfg)
        self.metrics = EngineMetrics(cfg.model)
        self.queues: dict[str, tuple[asyncio.Queue[tuple[int, Any]], int]] = {}
        self.arrivals: dict[str, float] = {}
        self.first_token: dict[str, float] = {}
        self.last_token: dict[str, float] = {}
        self.aborted = 0
        self.log: deque[dict[str, Any]] = deque(maxlen=LOG_SIZE)
        self.started_at = time.monotonic()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.in_step = False
        self.dead: BaseException | None = None
        # Where the pool's KV events go, one batch per step (set by the server's startup).
        self.kv_events: KvEventPublisher | None = None

    # --- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self.started_at = time.monotonic()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- requests ---------------------------------------------------------------------
    def submit(
        self, seq: Seq, queue: asyncio.Queue[tuple[int, Any]] | None = None, index: int = 0
    ) -> asyncio.Queue[tuple[int, Any]]:
        """Queue `seq`; its tokens arrive on `queue` as (index, TokenEvent) pairs."""
        if self.dead is not None:
            raise RuntimeError(f"the simulated engine is dead: {self.dead!r}")
        self.start()
        self.scheduler.add(seq)
        q: asyncio.Queue[tuple[int, Any]] = queue if queue is not None else asyncio.Queue()
        self.queues[seq.seq_id] = (q, index)
        self.arrivals[seq.seq_id] = time.monotonic()
        self._wake.set()
        return q

    def abort(self, seq_id: str) -> bool:
        """Free the sequence's KV at once (client went away); True if it was still live."""
        seq = self.scheduler.abort(seq_id)
        if seq is None:
            return False
        self.aborted += 1
        self._retire(seq, time.monotonic())
        return True

    # --- the loop ---------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # Like vLLM's EngineDeadError: report unhealthy and release every waiting client.
            log.exception("simulated engine crashed")
            self.dead = e
            for q, index in self.queues.values():
                q.put_nowait((index, None))
            self.queues.clear()

    async def _loop(self) -> None:
        scale = self.cfg.time_scale
        anchor = time.monotonic()
        budget = 0.0  # simulated seconds since `anchor`
        while True:
            plan = self.scheduler.schedule()
            if plan is None:
                self._wake.clear()
                await self._wake.wait()
                anchor, budget = time.monotonic(), 0.0
                continue
            budget += plan.duration
            delay = anchor + budget / scale - time.monotonic()
            if delay < -MAX_LAG_S:
                anchor, budget = time.monotonic(), plan.duration
                delay = plan.duration / scale
            self.in_step = True
            try:
                await asyncio.sleep(max(0.0, delay))
            finally:
                self.in_step = False
            outputs = self.scheduler.complete(plan)
            self.flush_kv_events()
            now = time.monotonic()
            self.metrics.step(plan)
            for out in outputs:
                self._emit(out, now)

    def flush_kv_events(self) -> None:
        """Publish what the pool changed since the last flush as one batch (vLLM: per step)."""
        if self.kv_events is None or not self.scheduler.pool.records_events:
            return
        events = self.scheduler.pool.take_events()
        if events:
            self.kv_events.publish(events)

    def _emit(self, out: Output, now: float) -> None:
        seq = out.seq
        sid = seq.seq_id
        entry = self.queues.get(sid)
        if entry is None:
            return
        q, index = entry
        prev = self.last_token.get(sid)
        if prev is None:
            self.first_token[sid] = now
            self.metrics.ttft.observe(now - self.arrivals[sid])
            if seq.scheduled_at is not None and seq.first_token_at is not None:
                scale = self.cfg.time_scale  # simulated seconds, as a client's clock sees them
                self.metrics.queue_time.observe((seq.scheduled_at - seq.arrival) / scale)
                self.metrics.prefill_time.observe((seq.first_token_at - seq.scheduled_at) / scale)
        else:
            self.metrics.itl.observe(now - prev)
        self.last_token[sid] = now
        ev = TokenEvent(out.text, out.finish_reason, out.stop_reason, now, seq.num_output)
        q.put_nowait((index, ev))
        if out.finish_reason is not None:
            self._retire(seq, now)

    def _retire(self, seq: Seq, now: float) -> None:
        sid = seq.seq_id
        arrival = self.arrivals.pop(sid, now)
        first = self.first_token.pop(sid, None)
        self.last_token.pop(sid, None)
        self.queues.pop(sid, None)
        reason = seq.finish_reason or "abort"
        ttft = None if first is None else first - arrival
        self.metrics.finished(reason, now - arrival, ttft, seq.num_output)
        self.log.append(
            {
                "id": sid,
                "request_id": seq.request_id,
                "prompt_tokens": seq.num_prompt,
                "cached_tokens": max(0, seq.num_cached),
                "completion_tokens": seq.num_output,
                "finish_reason": reason,
                "preemptions": seq.preemptions,
                "e2e_s": round(now - arrival, 6),
                "ttft_s": None if ttft is None else round(ttft, 6),
            }
        )

    # --- views ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "model": self.cfg.model,
            "engine_id": self.cfg.engine_id,
            "role": self.cfg.role,
            "running": len(s.running),
            "waiting": len(s.waiting),
            "aborted": self.aborted,
            "kv_blocks_total": s.pool.num_blocks,
            "kv_blocks_free": s.pool.num_free,
            "kv_cache_usage": s.pool.usage,
            "prefix_cache_queries": s.prefix_queries,
            "prefix_cache_hits": s.prefix_hits,
            "prefix_cache_evictions": s.pool.evictions,
            "external_kv_tokens": s.external_tokens,
            "preemptions": s.preemptions,
            "steps": s.steps,
            "simulated_busy_s": s.busy_seconds,
            "prompt_tokens": s.prompt_tokens,
            "generation_tokens": s.generation_tokens,
            "requests": list(self.log),
        }
