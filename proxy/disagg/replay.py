"""Replay finished request records through a Window (and a Decider) in time order.

A recorded run (a bench RunResult's requests, the virtual fleet's results) becomes the
sequence of events the forwarder would have fed: started at `start`, first token at
`start + ttft`, finished at `start + e2e`. The decider is evaluated every `evaluate_s` of the
run's clock, so a recording shows when `auto` would have switched and why. Uncached tokens come
from the engine's own report (prompt - cached), where the live proxy predicts them from its
prefix index.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from proxy.disagg.decider import Decider, Decision
from proxy.disagg.pools import BackendState
from proxy.disagg.window import RequestFacts, Window, itl_quantiles


class Record(Protocol):
    """The fields of a finished request replay reads (bench's RequestResult has them)."""

    @property
    def index(self) -> int: ...
    @property
    def target(self) -> str: ...
    @property
    def start(self) -> float: ...
    @property
    def ok(self) -> bool: ...
    @property
    def ttft(self) -> float | None: ...
    @property
    def e2e(self) -> float | None: ...
    @property
    def itl(self) -> list[float]: ...
    @property
    def prompt_tokens(self) -> int | None: ...
    @property
    def cached_tokens(self) -> int | None: ...
    @property
    def output_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Evaluation:
    at: float
    decision: Decision


def facts_of(r: Record) -> RequestFacts:
    prompt = r.prompt_tokens or 0
    q = itl_quantiles(r.itl)
    start = r.start
    first = start + r.ttft if r.ttft is not None else None
    end = start + (r.e2e if r.e2e is not None else (r.ttft or 0.0))
    return RequestFacts(
        request_id=str(r.index),
        backend=r.target,
        arrival=start,
        prompt_tokens=prompt,
        uncached_tokens=max(0, prompt - (r.cached_tokens or 0)),
        output_tokens=r.output_tokens,
        finished_at=end,
        first_token_at=first,
        itl_p50_s=q[0] if q else None,
        itl_p99_s=q[1] if q else None,
        ok=r.ok,
    )


def replay(
    records: Iterable[Record],
    window: Window,
    decider: Decider | None = None,
    backends: Sequence[BackendState] | Callable[[float], Sequence[BackendState]] = (),
    evaluate_s: float = 5.0,
) -> list[Evaluation]:
    """Feed `records` through `window` in time order; evaluate `decider` every `evaluate_s`.

    `backends` is the fleet (or a function of time, to script an outage). Returns every
    evaluation, first to last, and a final one at the end of the recording.
    """
    events: list[tuple[float, int, int, RequestFacts]] = []
    for seq, r in enumerate(records):
        f = facts_of(r)
        events.append((f.arrival, 0, seq, f))
        if f.first_token_at is not None:
            events.append((f.first_token_at, 1, seq, f))
        events.append((f.finished_at, 2, seq, f))
    heapq.heapify(events)
    out: list[Evaluation] = []
    next_eval = events[0][0] + evaluate_s if events else 0.0

    def fleet(at: float) -> Sequence[BackendState]:
        return backends(at) if callable(backends) else backends

    def evaluate(at: float) -> None:
        if decider is not None:
            out.append(Evaluation(at, decider.update(window.snapshot(at, fleet(at)))))

    last = 0.0
    while events:
        at, kind, _, f = heapq.heappop(events)
        while at >= next_eval:
            evaluate(next_eval)
            next_eval += evaluate_s
        last = at
        if kind == 0:
            window.started(f.request_id, f.backend, at, f.uncached_tokens)
        elif kind == 1:
            window.first_token(f.request_id, at)
        else:
            window.finished(f)
    evaluate(last)
    return out
