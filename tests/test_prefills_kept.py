"""Engines kept from prefilling a flood's prompts (tenants.reserve_prefills): an engine finishes
a prompt it has begun before one that arrives later, whatever its priority (vLLM's scheduler),
so while another tenant is active the prompts let in over their tenant's share may be at most
(engines - R) between admission and first token, and a quiet tenant's cold prompt goes to the
engine with the least prefill ahead of it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from plugins.bounded_load_picker import BoundedLoadPicker
from proxy.admission.slots import TICKET, Admission, Ticket, prefilled, quiet
from proxy.config import load_config
from proxy.routing.types import RouteContext
from tests.support import api_key, eventually
from tests.test_router import view

MODEL = "test-model"


def kept(reserve_prefills: int = 1, engines: int = 4, limit: int = 12) -> Admission:
    return Admission(
        limit=limit,
        queue=10,
        wait_s=30.0,
        reserve_prefills=reserve_prefills,
        engines=lambda: engines,
    )


async def test_a_flood_over_its_share_keeps_to_engines_less_r_prefills_while_others_active() -> (
    None
):
    admission = kept()
    alone = [Ticket("flood") for _ in range(6)]
    for t in alone:
        assert admission.admit_now(t)  # alone: no share to be over, nothing counted
    assert admission.prefilling_over == 0 and all(t.level == 0 for t in alone)
    first = Ticket("quiet")
    assert admission.admit_now(first) and first.level == 0  # within its share
    over = [Ticket("flood") for _ in range(3)]
    for t in over:
        assert admission.admit_now(t) and t.level == 1  # over its share: after quiet's
    assert admission.prefilling_over == 3  # 4 engines less 1 kept
    fourth = asyncio.create_task(admission.enter(Ticket("flood")))
    await asyncio.sleep(0)
    assert admission.inflight == 10 and admission.waiting == 1  # slots free, yet it waits
    second = Ticket("quiet")
    assert await admission.enter(second) is None  # the quiet tenant goes at once
    assert admission.prefilling_over == 3
    with_ticket(over[0], prefilled)  # a first token: one prefill over the share fewer
    assert await fourth is None and admission.prefilling_over == 3
    admission.leave(over[1])  # ended before its first token: counted no more
    assert admission.prefilling_over == 2
    with_ticket(over[1], prefilled)  # (its end settled it: nothing twice)
    assert admission.prefilling_over == 2
    assert admission.admit_now(Ticket("flood"))


async def test_the_prefills_kept_apply_only_while_another_tenant_is_active(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [1000.0]
    monkeypatch.setattr("proxy.admission.slots.time.monotonic", lambda: clock[0])
    admission = kept(engines=2)  # 2 engines less 1: one prefill over the share at a time
    q = Ticket("quiet")
    assert admission.admit_now(q)
    a, b = Ticket("flood"), Ticket("flood")
    assert admission.admit_now(a)  # 1 of 2 running: not over its share
    assert admission.admit_now(b) and b.level == 1 and admission.prefilling_over == 1
    admission.leave(q)
    waiting = asyncio.create_task(admission.enter(Ticket("flood")))
    await asyncio.sleep(0)
    assert admission.waiting == 1  # quiet sent within ACTIVE_S: still counted active
    clock[0] += 60.0
    with_ticket(b, prefilled)  # the next event finds the quiet tenant gone quiet
    assert await waiting is None


async def test_a_waiter_held_back_does_not_hold_up_a_tenant_within_its_share() -> None:
    """The flood's waiter comes first in the fair order (the quiet tenant asked for more
    tokens lately) but may not start another prefill: a quiet request goes past it, at once
    while a slot is free, and from the queue when one frees, instead of waiting behind it
    until a prefill ends."""
    admission = kept(engines=2, limit=4)  # one prefill over the share at a time
    q, f1, f2 = Ticket("quiet"), Ticket("flood"), Ticket("flood")
    for t in (q, f1, f2):
        assert admission.admit_now(t)
    assert f2.level == 1 and admission.prefilling_over == 1
    held = asyncio.create_task(admission.enter(Ticket("flood", prompt_tokens=10)))
    await asyncio.sleep(0)
    admission.finish["quiet"] = admission.finish["flood"] + 1e6  # its tags far ahead
    assert await admission.enter(Ticket("quiet", prompt_tokens=10)) is None  # past it
    assert admission.inflight == admission.limit
    queued = asyncio.create_task(admission.enter(Ticket("quiet", prompt_tokens=10)))
    await asyncio.sleep(0)
    assert admission.waiting == 2 and not queued.done()
    admission.leave(q)  # a slot frees: the quiet request, behind the flood's, takes it
    assert await queued is None and not held.done()
    with_ticket(f2, prefilled)  # a prefill ended, but no slot is free
    assert not held.done()
    admission.leave(f1)
    assert await held is None


def test_a_quiet_tenants_request_is_quiet_only_while_a_flood_prefills_over_its_share() -> None:
    admission = kept(engines=2)
    q, f1, f2 = Ticket("quiet"), Ticket("flood"), Ticket("flood")
    for t in (q, f1, f2):
        assert admission.admit_now(t)
    assert with_ticket(q, quiet) and not with_ticket(f2, quiet)
    with_ticket(f2, prefilled)
    assert not with_ticket(q, quiet)  # no prompt over a share being prefilled: route as ever
    assert not with_ticket(Ticket("x"), quiet)  # let in by no admission keeping prefills
    assert not quiet()  # no ticket at all (no API keys)


def test_without_prefills_kept_nothing_is_counted_or_owned() -> None:
    admission = Admission(limit=4, queue=0, wait_s=1.0)
    tickets = [Ticket("quiet"), Ticket("flood"), Ticket("flood"), Ticket("flood")]
    for t in tickets:
        assert admission.admit_now(t)
    assert tickets[-1].level == 1 and admission.prefilling_over == 0
    assert all(t.owner is None and t.prefilling is None for t in tickets)


def test_prefills_kept_need_the_engines_counted_and_are_configured_under_tenants() -> None:
    with pytest.raises(ValueError, match="reserve_prefills"):
        Admission(limit=2, queue=0, wait_s=1.0, reserve_prefills=1)
    cfg = load_config(env={"WARMROUTE_TENANTS__RESERVE_PREFILLS": "1"})
    assert cfg.tenants.reserve_prefills == 1


def context(quiet: bool) -> RouteContext:
    ctx = RouteContext("r1", "m", "chat", {}, {}, 0.0, quiet=quiet)
    ctx.prefix_blocks = list(range(1, 9))
    ctx.prompt_chars, ctx.block_chars = 8 * 64, 64
    ctx.matched_blocks = {}
    return ctx


def test_a_quiet_cold_prompt_goes_where_its_prefill_starts_soonest() -> None:
    picker = BoundedLoadPicker(placement=False)
    backlog = {"a": 2000.0, "b": 1500.0, "c": 0.0, "d": 2000.0}
    views = [view(n, 1, backlog_tokens=t) for n, t in backlog.items()]
    order, reason = picker.pick(context(quiet=True), views, {})
    assert order[0] == "c" and reason.startswith("quiet tenant's cold prompt")
    assert order[1] == "b"  # then the next least
    order, reason = picker.pick(context(quiet=False), views, {})
    assert reason.startswith("cold prefix")  # the flood's, or anyone's when none floods


def test_a_quiet_prompt_that_is_cached_somewhere_stays_with_its_cache() -> None:
    picker = BoundedLoadPicker(placement=False)
    views = [view(n, 1, backlog_tokens=t) for n, t in {"a": 2000.0, "b": 0.0}.items()]
    ctx = context(quiet=True)
    ctx.matched_blocks = {"a": 8, "b": 0}
    order, reason = picker.pick(ctx, views, {"a": 1.0, "b": 0.0})
    assert order[0] == "a" and "quiet" not in reason


def with_ticket(ticket: Ticket, call: Any) -> Any:
    """`call()` as the request `ticket` admitted would make it (TICKET set, as the edge does)."""
    held = TICKET.set(ticket)
    try:
        return call()
    finally:
        TICKET.reset(held)


FILLER = " ".join(f"word{i}" for i in range(400))  # ~2,800 characters: a cold prompt of blocks


@pytest.mark.e2e
async def test_through_the_proxy_a_quiet_prompt_finds_the_engine_the_flood_is_not_prefilling(
    fake_backends: Any, proxy_server: Any
) -> None:
    """Three engines, one kept: the flood, over its share once the quiet tenant is active,
    has two prompts in prefill (their first token 30 s away) and the rest wait though slots
    are free; the quiet tenant's cold prompt goes to the engine with none."""
    backends = [server.url for _, server in fake_backends(3)]
    config = {
        "server": {
            "api_keys": [api_key("flood"), api_key("quiet")],
            "max_inflight": 12,
            "admission_queue": 8,
            "admission_timeout_s": 60,
            "debug_headers": True,
        },
        "tenants": {"reserve_prefills": 1},
    }
    proxy = proxy_server(backends, config)
    url = proxy.url + "/v1/chat/completions"

    def body(content: str, stream: bool = False) -> dict[str, Any]:
        messages = [{"role": "user", "content": content}]
        return {"model": MODEL, "stream": stream, "messages": messages}

    def auth(tenant: str) -> dict[str, str]:
        return {"authorization": f"Bearer key-{tenant}"}

    async with httpx.AsyncClient(timeout=60) as http:
        first = await http.post(url, json=body(f"quiet first {FILLER}"), headers=auth("quiet"))
        assert first.status_code == 200  # the quiet tenant is active now

        async def flood(i: int) -> None:
            content = f"flood {i} slowstart:30 {FILLER}"
            async with http.stream("POST", url, json=body(content, True), headers=auth("flood")):
                pass

        floods = [asyncio.create_task(flood(i)) for i in range(4)]
        try:

            async def held_back() -> bool:
                seen = (await http.get(proxy.url + "/admin/tenants")).json()
                waiting = seen["tenants"]["flood"]["queue"]["waiting"]
                return seen["prefills"]["over_share_prefilling"] == 2 and waiting == 2

            await eventually(held_back, "two of the flood's prompts prefilling, two held back")
            routing = (await http.get(proxy.url + "/admin/routing")).json()
            busy = {b for b, tokens in routing["backlog_tokens"].items() if tokens > 0}
            assert 1 <= len(busy) <= 2
            r = await http.post(url, json=body(f"quiet second {FILLER}"), headers=auth("quiet"))
            assert r.status_code == 200
            reason = json.loads(r.headers["x-warmroute-route"])["reason"]
            assert reason.startswith("quiet tenant's cold prompt"), reason
            assert r.headers["x-warmroute-backend"] not in busy
        finally:
            for task in floods:
                task.cancel()
            await asyncio.gather(*floods, return_exceptions=True)
