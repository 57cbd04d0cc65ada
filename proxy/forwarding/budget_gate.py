"""The budgets at the front of a request: refuse it (OpenAI's 429, with when to come back),
or let it through with its x-ratelimit-* headers and charge what it was served at its end."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from proxy import asgi
from proxy.errors import error_body
from proxy.tenants.budgets import DEFAULT_TENANT, Budgets, Refusal
from proxy.types import CLIENT

if TYPE_CHECKING:
    from proxy.asgi import Send
    from proxy.forwarding.exchange import Exchange


async def through_budgets(
    budgets: Budgets,
    ex: Exchange,
    send: Send,
    handle: Callable[[Send], Awaitable[None]],
    refused: Callable[[int, str], None],
) -> None:
    """Admit `ex` against its tenant's budgets, run `handle` (the answer carries the
    x-ratelimit-* headers: Exchange.response_headers), then settle what was served (also
    when `handle` raises)."""
    tenant = CLIENT.get() or DEFAULT_TENANT
    verdict = await budgets.admit(tenant, ex.body["model"], ex.raw)
    if isinstance(verdict, Refusal):
        refused(429, "rate_limit_exceeded")
        await refuse(send, ex.request_id, verdict)
        return
    grant = verdict
    budgets.streaming(grant, lambda: ex.output_events() if ex.output_events is not None else 0)
    ex.response_headers = tuple(grant.headers)
    try:
        await handle(send)
    finally:
        facts = ex.facts
        await budgets.settle(
            grant,
            None if facts is None else facts.input_tokens,
            None if facts is None else facts.output_tokens,
        )


async def refuse(send: Send, request_id: str, refusal: Refusal) -> None:
    """429 in OpenAI's shape: `rate_limit_exceeded`, its type `requests`, `tokens` or
    `concurrency`, Retry-After (whole seconds) and retry-after-ms (what OpenAI's Python
    client reads first)."""
    extra = [(b"x-request-id", request_id.encode("latin-1")), *refusal.headers]
    if refusal.retry_after_s is not None:
        wait = max(refusal.retry_after_s, 0.001)
        extra.append((b"retry-after", str(max(1, math.ceil(wait))).encode()))
        extra.append((b"retry-after-ms", str(math.ceil(wait * 1000)).encode()))
    body = error_body(refusal.message, refusal.kind, None, "rate_limit_exceeded")
    await asgi.respond(send, 429, body, asgi.JSON, extra)
