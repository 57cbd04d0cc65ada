"""A request's ticket for the admission queue (its tenant, weight, class and estimated
prompt), and what a client is told when the queue refuses or sheds it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.admission.slots import (
    CLASSES,
    DEADLINE,
    OVER_SHARE,
    QUEUE_FULL,
    QUEUE_TIMEOUT,
    SHED_FAIR,
    SHED_PRIORITY,
    Admission,
    Ticket,
)
from proxy.tenants.budgets import estimate_tokens

if TYPE_CHECKING:
    from proxy.config import TenantsConfig

PRIORITY_HEADER = "x-warmroute-priority"


class TicketError(Exception):
    """A request's priority header that cannot be honoured: (status, code, message)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def ticket_for(
    config: TenantsConfig, tenant: str, priority: str | None, content_length: str | None
) -> Ticket:
    """The ticket of a request of `tenant` asking for class `priority` (its header, if
    any); raises TicketError for a class that does not exist or that it may not take."""
    cfg = config.keys.get(tenant, config.default)
    rank = CLASSES.index(cfg.priority)
    if priority is not None:
        wanted = priority.strip().lower()
        if wanted not in CLASSES:
            raise TicketError(
                400,
                "invalid_priority",
                f"{PRIORITY_HEADER} must be one of {', '.join(CLASSES)} (got {priority[:32]!r}).",
            )
        asked = CLASSES.index(wanted)
        if asked < rank and not cfg.priority_header:
            raise TicketError(
                403,
                "priority_not_allowed",
                f"This API key's requests are `{cfg.priority}` at most; it may lower their "
                f"class with {PRIORITY_HEADER} but not raise it (tenants: priority_header).",
            )
        rank = asked
    prompt = 0.0
    if content_length is not None and content_length.isdigit():
        prompt = estimate_tokens(int(content_length))
    return Ticket(tenant=tenant, weight=cfg.weight, rank=rank, prompt_tokens=prompt)


def refusal(reason: str, admission: Admission, ticket: Ticket | None) -> tuple[int, str, str, str]:
    """(status, code, error type, message) for a request the admission queue refused."""
    wait = admission.retry_after_s
    if reason in (QUEUE_FULL, QUEUE_TIMEOUT):
        return (
            503,
            "overloaded",
            "server_error",
            f"This proxy is at its limit of {admission.limit} requests in flight and "
            f"{admission.queue} waiting (server.max_inflight, server.admission_queue); "
            f"retry after {wait} s.",
        )
    klass = CLASSES[ticket.rank] if ticket is not None else "standard"
    if reason == DEADLINE and ticket is not None:
        target = admission.targets[ticket.rank]
        return (
            503,
            "deadline_unreachable",
            "server_error",
            f"This request would not get its first token within its class's TTFT target "
            f"(`{klass}`: {target:g} s, tenants.ttft_targets_s) with the requests waiting "
            f"before it, so it was refused at once; retry after {wait} s.",
        )
    if reason == SHED_PRIORITY:
        return (
            503,
            "overloaded_low_priority",
            "server_error",
            f"This proxy is overloaded and gave this request's place in its queue to a "
            f"request of a higher class (this one is `{klass}`); retry after {wait} s.",
        )
    assert reason in (SHED_FAIR, OVER_SHARE), reason
    tenant = ticket.tenant if ticket is not None else "default"
    what = "lost its place" if reason == SHED_FAIR else "was not queued"
    return (
        429,
        "fair_share_exceeded",
        "requests",
        f"This proxy is overloaded and `{tenant}` has been served more than the other "
        f"tenants waiting: its request {what}, to make room for theirs. Retry after {wait} s.",
    )
