"""Slot engines: a second request of a prompt waits its turn on the slot that holds it.

A llama.cpp engine keeps one prompt per slot (routing/slots.py). When a request of prompt A
arrives while another request of A runs there, the slot holding A is busy: the engine gives
the newcomer an idle slot, which holds another prompt B, and prefills A there from nothing,
overwriting B. One such collision costs two cold prefills: A's now, and B's at B's next
request. Two clients asking the hottest prompt at once collide often (issue 28's bench: 16
false hits in 85 requests on one engine), whoever routes, a static affinity included.

Waiting for the running request of A to finish costs the rest of that request; sending now
costs a whole cold prefill of A. So the newcomer waits, at most `factor` times the cold
prefill its prompt would take there (its characters over the engine's learned prefill rate),
and goes the moment the running request of A ends: A's slot is then idle and the engine gives
it that slot, warm. Past the limit it goes anyway (a long generation ahead of it), as it
would have without waiting. Waiters of one prompt on one engine go one at a time, in arrival
order; a request whose prompt is not running there does not wait.

Whether a collision is cold is measured, per engine: llama-server's host prompt cache
(`--cache-ram`, on by default) loads a prompt back from RAM into the slot it is given, and
saves the one it overwrites, so there a collision costs little and waiting would only add the
wait. Each request sent while a request of its prompt ran there (before the evidence, or
past a wait's limit) is a collision, and the share of its prompt the engine reported cached
says which kind of engine this is: an engine waits only once its collisions came back mostly
cold (COLD_BELOW, over an average of the last few). Until its first collisions it does not.

Only engines that said they keep slots (llama.cpp's /props or /slots) are concerned: a block
pool (vLLM, SGLang) shares one prompt's cached blocks among concurrent requests. The count is
this replica's own requests: replicas do not see each other's (each keeps its own turns).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

log = logging.getLogger("warmroute.routing.slot_turns")

Key = tuple[str, int]  # (backend, prompt head)

COLD_BELOW = 0.5  # collisions cached less than this share of their prompt, on average: cold
EVIDENCE_WEIGHT = 0.25  # each collision's weight in an engine's average (the last few count)
# While an engine waits, one request in this many that would wait goes at once: a collision
# on purpose, so the evidence stays current (a host cache's first collisions are cold, before
# it holds the prompt; later ones come back warm, and the waits stop).
PROBE_EVERY = 8


class Turn(NamedTuple):
    """A request's place on its engine: what `leave` needs when it is over."""

    key: Key
    collided: bool  # sent while a request of its prompt ran there


@dataclass(slots=True)
class SlotTurns:
    """Requests running per (slot engine, prompt head), those waiting for one to end, and
    each engine's collisions as measured."""

    factor: float = 1.0  # a wait's limit in cold prefills of the waiting prompt (0: never wait)
    max_wait_s: float = 30.0  # ... and never more than this
    running: dict[Key, int] = field(default_factory=dict)
    waiting: dict[Key, deque[asyncio.Future[None]]] = field(default_factory=dict)
    # backend -> average cached share of its collisions' prompts (absent: none measured)
    collisions: dict[str, float] = field(default_factory=dict)
    asked: dict[str, int] = field(default_factory=dict)  # backend -> would-be waits (probes)
    counters: dict[str, float] = field(
        default_factory=lambda: {
            "waits": 0,
            "turns": 0,
            "timeouts": 0,
            "collisions": 0,
            "probes": 0,
            "waited_s": 0.0,
        }
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

    def cold(self, backend: str) -> bool:
        """Whether `backend`'s collisions came back cold (no host cache saved them)."""
        seen = self.collisions.get(backend)
        return seen is not None and seen < COLD_BELOW

    def waits_on(self, backend: str) -> bool:
        """Whether a request whose prompt runs on `backend` waits: its collisions were cold,
        and this is not the one in PROBE_EVERY that goes at once to measure them again."""
        if not self.cold(backend):
            return False
        asked = self.asked[backend] = self.asked.get(backend, 0) + 1
        if asked % PROBE_EVERY == 0:
            self.counters["probes"] += 1
            return False
        return True

    async def take(self, key: Key, limit_s: float) -> tuple[Turn, float]:
        """Run a request of `key`'s prompt there: at once if none runs (or `limit_s` is 0),
        else after the running one ends or `limit_s` passes. Returns its turn, for `leave`
        once it is over (cancelled or not), and the seconds waited."""
        if limit_s <= 0 or not self.busy(key):
            return self._run(key), 0.0
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
            mine = Turn(key, False)
        except TimeoutError:
            self._withdraw(key, turn)
            if turn.done() and not turn.cancelled():  # handed over as the limit passed
                self.counters["turns"] += 1
                mine = Turn(key, False)
            else:
                self.counters["timeouts"] += 1
                mine = self._run(key)
        except BaseException:
            # Cancelled (the client left): give up the place, and a turn handed over meanwhile.
            self._withdraw(key, turn)
            if turn.done() and not turn.cancelled():
                self.leave(Turn(key, False))
            raise
        waited = loop.time() - started
        self.counters["waited_s"] += waited
        return mine, waited

    def _run(self, key: Key) -> Turn:
        running = self.running.get(key, 0)
        self.running[key] = running + 1
        if running:
            self.counters["collisions"] += 1
        return Turn(key, running > 0)

    def leave(self, turn: Turn, cached_share: float | None = None) -> None:
        """A request is over there, `cached_share` of its prompt served from the engine's
        cache (None: not reported): the first waiter of its prompt, if any, runs now."""
        key = turn.key
        if turn.collided and cached_share is not None:
            self._judge(key[0], cached_share)
        left = self.running.get(key, 0) - 1
        queue = self.waiting.get(key)
        while queue:
            waiter = queue.popleft()
            if not waiter.done():
                waiter.set_result(None)
                left += 1  # (the waiter's from now: no newcomer goes before it)
                break
        if queue is not None and not queue:
            del self.waiting[key]
        if left > 0:
            self.running[key] = left
        else:
            self.running.pop(key, None)

    def _judge(self, backend: str, cached_share: float) -> None:
        """One collision's cached share into `backend`'s average; says so when that turns
        its waits on or off."""
        was = self.cold(backend)
        seen = self.collisions.get(backend)
        share = 0.0 if cached_share < 0.0 else 1.0 if cached_share > 1.0 else cached_share
        self.collisions[backend] = (
            share if seen is None else seen + EVIDENCE_WEIGHT * (share - seen)
        )
        now = self.cold(backend)
        if now != was:
            log.info(
                "slot engine %s: its collisions come back %.0f%% cached on average: %s",
                backend,
                self.collisions[backend] * 100,
                "a request whose prompt runs there now waits for it (no host prompt cache)"
                if now
                else "requests no longer wait for a running one (its prompts come back warm)",
            )

    def forget(self, backend: str) -> None:
        """`backend` restarted or left: its collisions say nothing of what runs there now."""
        self.collisions.pop(backend, None)
        self.asked.pop(backend, None)

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
            # per engine: the average cached share of its collisions, and whether it waits
            "engines": {
                b: {"collision_cached_share": round(s, 3), "waits": s < COLD_BELOW}
                for b, s in self.collisions.items()
            },
        }
