"""How many slots a llama.cpp engine runs, asked of it (GET /props, else GET /slots) or, where
it answers neither, inferred from the most requests it was seen running at once.

The registry asks once per engine (again after a restart) and hands a layout that changed to
routing (proxy.routing.slots explains what routing does with it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import httpx

from proxy.routing.slots import SlotLayout, from_props, from_slots

if TYPE_CHECKING:
    from proxy.upstream.control import Answer

# Where a llama-server says it, and how each answer reads.
SOURCES: tuple[tuple[str, Callable[[Any], SlotLayout | None]], ...] = (
    ("/props", from_props),
    ("/slots", from_slots),
)


async def ask(get: Callable[[str], Awaitable[httpx.Response | Answer]]) -> SlotLayout | None:
    """The layout the engine publishes (`get` fetches one of its paths), or None."""
    for path, parse in SOURCES:
        try:
            r = await get(path)
            if r.status_code != 200:
                continue
            layout = parse(r.json())
        except (httpx.HTTPError, ValueError):
            continue
        if layout is not None:
            return layout
    return None


def inferred(known: SlotLayout | None, running: float | None) -> SlotLayout | None:
    """A new layout from the busy slots seen now (`running`, llamacpp:requests_processing),
    where the engine told none: it has at least as many slots as it ever ran requests at
    once. None when that says nothing new."""
    if running is None or running != running or running < 1:
        return None
    n = int(running)
    if known is not None and (known.source != "running" or known.slots >= n):
        return None
    return SlotLayout(n, None, "running")
