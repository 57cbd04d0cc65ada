"""The generic cell rate algorithm (GCRA) over per-minute limits, and what a client is told.

Why GCRA rather than a sliding window: one number per limit (the theoretical arrival time,
TAT), updated in one step, so a Redis script touches one key per limit whatever the traffic;
and a charge after the fact (output tokens as they stream, the engine's exact prompt count
replacing an estimate) just moves the TAT, which a window of timestamped entries cannot take
without an entry per charge. A limit of L per minute spends 60/L seconds of TAT per unit and
tolerates a TAT up to a minute ahead of now: a tenant idle for a minute has its whole
minute's budget at once, as OpenAI's per-minute limits behave, and never more.

The arithmetic here is the one the Redis script runs (store.py); tests hold them equal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

WINDOW_S = 60.0  # limits are per minute; the burst is one minute's worth

REQUESTS, INPUT, OUTPUT, TOKENS = "requests", "input_tokens", "output_tokens", "tokens"
KINDS = (REQUESTS, INPUT, OUTPUT, TOKENS)

ADMIT, CHARGE, PEEK = "admit", "charge", "peek"


@dataclass(frozen=True, slots=True)
class Limit:
    """One per-minute limit of one tenant, tenant-wide (`model` "") or for one model."""

    tenant: str
    kind: str  # one of KINDS
    per_minute: int
    model: str = ""
    interval_s: float = field(init=False, compare=False)  # seconds of TAT per unit
    key: str = field(init=False, compare=False)  # its bucket's name

    def __post_init__(self) -> None:
        object.__setattr__(self, "interval_s", WINDOW_S / self.per_minute)
        object.__setattr__(self, "key", f"{self.tenant}\x1f{self.model}\x1f{self.kind}")

    def named(self) -> str:
        where = f" for model `{self.model}`" if self.model else ""
        return f"{self.kind.replace('_', ' ')} per minute{where}"


@dataclass(frozen=True, slots=True)
class Reading:
    """A limit after a call: units left now, and seconds until the whole minute is back."""

    limit: Limit
    remaining: int
    reset_s: float


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one call did: admitted (or charged), or refused with how long to wait."""

    ok: bool
    wait_s: float  # refused: seconds until the request would fit (0 when ok)
    readings: tuple[Reading, ...]
    live_replicas: int = 1  # replicas that called within the last minute (Redis only)
    refused_by: Limit | None = None  # the limit that refused (the one with the longest wait)


def step(
    tats: Sequence[float | None],
    intervals: Sequence[float],
    costs: Sequence[float],
    mode: str,
    now: float,
) -> tuple[bool, float, int, list[float], list[float]]:
    """One call over several limits, all or nothing: (ok, wait_s, index of the limit that
    refused or -1, the TATs to store (those read when refused or peeking), each limit's
    TAT as it stands after the call).

    ADMIT refuses when any limit's TAT would pass now + WINDOW_S (a cost of 0 asks only that
    one unit be left: an output limit before any output is known); CHARGE always applies (a
    debt past the window delays the next admissions); PEEK reads."""
    new: list[float] = []
    base: list[float] = []
    ok, wait, refused = True, 0.0, -1
    for tat, interval, cost in zip(tats, intervals, costs, strict=True):
        t = now if tat is None or tat < now else tat
        n = t + cost * interval
        if n < now:
            n = now
        base.append(t)
        new.append(n)
        if mode == ADMIT:
            need = n if cost > 0 else t + interval
            if need - now > WINDOW_S:
                ok = False
                if need - WINDOW_S - now > wait or refused < 0:
                    wait, refused = need - WINDOW_S - now, len(new) - 1
    if mode == PEEK or not ok:
        return ok, wait, refused, base, base
    return ok, 0.0, -1, new, new


def readings(limits: Sequence[Limit], after: Sequence[float], now: float) -> tuple[Reading, ...]:
    """Each limit's units left and time to full, from its TAT after a call."""
    out = []
    for limit, tat in zip(limits, after, strict=True):
        ahead = tat - now if tat > now else 0.0
        left = math.floor((WINDOW_S - ahead) / limit.interval_s + 1e-9)
        out.append(Reading(limit, left if left > 0 else 0, ahead))
    return tuple(out)


def duration(seconds: float) -> str:
    """A reset time as OpenAI writes it: `17ms`, `1s`, `6m0s`, `1m30.5s`."""
    if seconds < 0.001:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    tenths = math.ceil(seconds * 10 - 1e-9)  # up to a tenth: never earlier than the truth
    minutes, rest = divmod(tenths, 600)
    text = f"{rest / 10:.1f}".removesuffix(".0") + "s"
    return f"{int(minutes)}m{text}" if minutes >= 1 else text


def headers(found: Sequence[Reading]) -> list[tuple[bytes, bytes]]:
    """OpenAI's x-ratelimit-* headers: the tightest request limit and the tightest token
    limit (input, output or both: the one with the fewest units left)."""
    out: list[tuple[bytes, bytes]] = []
    requests: Reading | None = None
    tokens: Reading | None = None
    for r in found:
        if r.limit.kind == REQUESTS:
            if requests is None or _tighter(r, requests):
                requests = r
        elif tokens is None or _tighter(r, tokens):
            tokens = r
    for names, chosen in ((_REQUEST_HEADERS, requests), (_TOKEN_HEADERS, tokens)):
        if chosen is not None:
            limit, remaining, reset = names
            out.append((limit, str(chosen.limit.per_minute).encode()))
            out.append((remaining, str(chosen.remaining).encode()))
            out.append((reset, duration(chosen.reset_s).encode()))
    return out


def _tighter(a: Reading, b: Reading) -> bool:
    """Fewer units left, or as few and longer until full."""
    return a.remaining < b.remaining or (a.remaining == b.remaining and a.reset_s > b.reset_s)


_REQUEST_HEADERS = tuple(
    f"x-ratelimit-{h}-requests".encode() for h in ("limit", "remaining", "reset")
)
_TOKEN_HEADERS = tuple(f"x-ratelimit-{h}-tokens".encode() for h in ("limit", "remaining", "reset"))
