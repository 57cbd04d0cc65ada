"""Slot engines: a second request of a prompt waits its turn on the slot that holds it.

A llama.cpp engine keeps one prompt per slot (routing/slots.py). When a request of prompt A
arrives while another request of A runs there, the slot holding A is busy: the engine gives
the newcomer an idle slot, which holds another prompt B, and prefills A there from nothing,
overwriting B. One collision costs two cold prefills: A's now, and B's at B's next request.
Two clients asking the hottest prompt at once collide often (issue 28's bench: 16 false hits
in 85 requests on one engine), whoever routes, a static affinity included.

Waiting for the running request of A to finish costs the rest of that request; sending now
costs a whole cold prefill of A. So the newcomer waits, at most `factor` times the cold
prefill its prompt would take there (its characters over the engine's learned prefill rate),
and goes the moment the running request of A ends: then A's slot is idle and the engine
gives it that slot, warm. Past the limit it goes anyway (a long generation ahead of it), as
it would have without waiting. Waiters of one prompt on one engine go one at a time, in
arrival order; a request whose prompt is not running there does not wait.

Only engines that said they keep slots (llama.cpp's /props or /slots) are concerned: a block
pool (vLLM, SGLang) shares one prompt's cached blocks among concurrent requests. The count is
this replica's own requests: replicas do not see each other's (each keeps its own turns).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

Key = tuple[str, int]  # (backend, prompt head)


@dataclass(slots=True)
class SlotTurns:
    """Requests running per (slot engine, prompt head), and those waiting for one to end."""

    factor: float = 1.0  # a wait's limit in cold prefills of the waiting prompt (0: never wait)
    max_wait_s: float = 30.0  # ... and never more than this
    running: dict[Key, int] = field(default_factory=dict)
    waiting: dict[Key, deque[asyncio.Future[None]]] = field(default_factory=dict)
    counters: dict[str, float] = field(
        default_factory=lambda: {"waits": 0, "turns": 0, "timeouts": 0, "waited_s": 0.0}
    )

    def limit_s(self, prompt_tokens: float, tokens_per_s: float) -> float:
        """How long a prompt of `prompt_tokens` may wait on an engine prefilling
        `tokens_per_s`: `factor` cold prefills of it, at most max_wait_s."""
        if self.factor <= 0 or prompt_tokens <= 0 or tokens_per_s <= 0:
            return 0.0
        wait = self.factor * prompt_tokens / tokens_per_s
        return wait if wait < self.max_wait_s else self.max_wait_s

    def busy(self, key: Key) -> bool:
        return self.running.get(key, 0) > 0 or bool(self.waiting.get(key))

    async def take(self, key: Key, limit_s: float) -> float:
        """Run a request of `key`'s prompt there: at once if none runs (or `limit_s` is 0),
        else after the running one ends or `limit_s` passes. Returns the seconds waited.
        Every take is matched by one `leave`, cancelled or not."""
        if limit_s <= 0 or not self.busy(key):
            self.running[key] = self.running.get(key, 0) + 1
            return 0.0
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        queue = self.waiting.setdefault(key, deque())
        queue.append(turn)
        self.counters["waits"] += 1
        started = loop.time()
        try:
            async with asyncio.timeout(limit_s):
                await turn
            self.counters["turns"] += 1  # (leave counted it as running, handing it over)
        except TimeoutError:
            self._withdraw(key, turn)
            if turn.done() and not turn.cancelled():  # handed over as the limit passed
                self.counters["turns"] += 1
            else:
                self.counters["timeouts"] += 1
                self.running[key] = self.running.get(key, 0) + 1
        except BaseException:
            # Cancelled (the client left): give up the place, and a turn handed over meanwhile.
            self._withdraw(key, turn)
            if turn.done() and not turn.cancelled():
                self.leave(key)
            raise
        waited = loop.time() - started
        self.counters["waited_s"] += waited
        return waited

    def leave(self, key: Key) -> None:
        """A request of `key`'s prompt there is over: the first waiter, if any, runs now."""
        left = self.running.get(key, 0) - 1
        queue = self.waiting.get(key)
        while queue:
            turn = queue.popleft()
            if not turn.done():
                turn.set_result(None)
                left += 1  # (the waiter's from now: no newcomer goes before it)
                break
        if queue is not None and not queue:
            del self.waiting[key]
        if left > 0:
            self.running[key] = left
        else:
            self.running.pop(key, None)

    def _withdraw(self, key: Key, turn: asyncio.Future[None]) -> None:
        queue = self.waiting.get(key)
        if queue is None:
            return
        try:
            queue.remove(turn)
        except ValueError:
            pass
        if not queue:
            del self.waiting[key]

    def info(self) -> dict[str, Any]:
        """For /admin/routing: the limit's terms, what waited, and what waits now."""
        return {
            "factor": self.factor,
            "max_wait_s": self.max_wait_s,
            **{k: round(v, 3) if isinstance(v, float) else v for k, v in self.counters.items()},
            "running": sum(self.running.values()),
            "waiting": sum(len(q) for q in self.waiting.values()),
        }
