"""One completion request to the simulated engine: its sequences, and how their tokens
become vLLM's OpenAI JSON, whole or streamed (with the stall and cut faults mid-stream).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.asgi import SSE_DONE, Send, end_stream, sse, start_stream, stream_chunk
from proxy.sim.config import SimConfig
from proxy.sim.engine import Seq
from proxy.sim.errors import StreamCut
from proxy.sim.runner import AsyncEngine, TokenEvent


class Host(Protocol):
    """What a completion uses of the engine's app."""

    cfg: SimConfig
    engine: AsyncEngine
    rng: random.Random
    counts: dict[str, int]

    @property
    def scale(self) -> float: ...


@dataclass
class Job:
    """One prompt of a request and the parameters of its sequences."""

    prompt_ids: list[int]
    seqs: list[Seq] = field(default_factory=list)


class Completion:
    """One completion request's sequences and how their tokens become OpenAI JSON."""

    def __init__(
        self,
        app: Host,
        chat: bool,
        rid: str,
        jobs: list[Job],
        n: int,
        events: asyncio.Queue[tuple[int, TokenEvent | None]],
        include_usage: bool,
        continuous_usage: bool,
    ) -> None:
        self.app = app
        self.chat = chat
        self.rid = rid
        self.jobs = jobs
        self.n = n
        self.events = events
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.created = int(time.time())
        self.model = app.cfg.model
        self.texts = [""] * (len(jobs) * n)
        self.finish: list[tuple[str, str | None] | None] = [None] * (len(jobs) * n)
        self.completion_tokens = 0

    def abort_all(self) -> None:
        for job in self.jobs:
            for seq in job.seqs:
                self.app.engine.abort(seq.seq_id)

    def client_gone(self) -> None:
        self.abort_all()
        self.events.put_nowait((-1, None))

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(j.prompt_ids) for j in self.jobs)
        cached = 0
        for job in self.jobs:
            cached += max(0, job.seqs[0].num_cached)
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def next_event(self) -> tuple[int, TokenEvent] | None:
        """The next token of any choice; None when the client went away."""
        index, ev = await self.events.get()
        return None if ev is None else (index, ev)

    def _record(self, index: int, ev: TokenEvent) -> None:
        self.completion_tokens += 1
        self.texts[index] += ev.text
        if ev.finish_reason is not None:
            self.finish[index] = (ev.finish_reason, ev.stop_reason)

    async def collect(self) -> dict[str, Any]:
        while any(f is None for f in self.finish):
            got = await self.next_event()
            if got is None:
                return {}
            self._record(*got)
        choices = []
        for i, text in enumerate(self.texts):
            reason, stop_reason = self.finish[i] or ("abort", None)
            if self.chat:
                choice: dict[str, Any] = {
                    "index": i,
                    "message": {"role": "assistant", "content": text, "tool_calls": []},
                }
            else:
                choice = {"index": i, "text": text}
            choice.update(logprobs=None, finish_reason=reason, stop_reason=stop_reason)
            choices.append(choice)
        return {
            "id": self.rid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
            "kv_transfer_params": None,
        }

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            obj["usage"] = usage
        return sse(obj)

    async def stream(self, send: Send, on_done: Callable[[int], None] | None = None) -> None:
        app, faults = self.app, self.app.cfg.faults
        stall = faults.stall_s > 0 and app.rng.random() < faults.stall_rate
        cut = faults.cut_rate > 0 and app.rng.random() < faults.cut_rate
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
        ]
        await start_stream(send, 200, headers)

        async def write(data: bytes) -> None:
            await stream_chunk(send, data)

        if self.chat:
            for i in range(len(self.texts)):
                delta = {"role": "assistant", "content": ""}
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                await write(self._chunk([choice], self._usage_if_continuous()))
        sent = 0
        while any(f is None for f in self.finish):
            got = await self.next_event()
            if got is None:
                return
            index, ev = got
            self._record(index, ev)
            if not ev.text and ev.finish_reason is None:
                continue
            if self.chat:
                choice = {"index": index, "delta": {"content": ev.text}, "logprobs": None}
            else:
                choice = {"index": index, "text": ev.text, "logprobs": None}
            choice["finish_reason"] = ev.finish_reason
            if ev.finish_reason is not None or not self.chat:
                choice["stop_reason"] = ev.stop_reason
            await write(self._chunk([choice], self._usage_if_continuous()))
            sent += 1
            if cut and sent >= faults.cut_after:
                app.counts["cuts"] += 1
                self.abort_all()
                raise StreamCut("injected fault: stream cut")
            if stall and sent == faults.stall_after:
                app.counts["stalls"] += 1
                await asyncio.sleep(faults.stall_s / app.scale)
        if on_done is not None:
            on_done(len(self.jobs[0].prompt_ids))
        if self.include_usage:
            await write(self._chunk([], self.usage()))
        await write(SSE_DONE)
        await end_stream(send)

    def _usage_if_continuous(self) -> dict[str, Any] | None:
        return self.usage() if self.include_usage and self.continuous_usage else None
