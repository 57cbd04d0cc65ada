"""The admission queue among tenants (proxy/admission/slots.py): by class, then start-time fair
queuing over tenants (tags in tokens per unit of weight), then first come; a full queue
sheds the waiter a newcomer should go before. Then the real proxy: a tenant flooding one
slot, another's request served first, the flooder's excess refused with 429 and Retry-After."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from proxy.admission.slots import (
    ACTIVE_S,
    OVER_SHARE,
    QUEUE_FULL,
    SHED_FAIR,
    SHED_PRIORITY,
    Admission,
    Ticket,
)
from proxy.config import ConfigError, load_config
from tests.support import ServerThread, api_key, metric, until

MODEL = "test-model"


async def served_order(admission: Admission, tickets: list[Ticket]) -> list[str]:
    """Queue `tickets` in this order behind one held slot, then free the slot once per
    ticket: the tenants in the order they got it (their ticket's tenant, rank as a
    suffix when not standard)."""
    order: list[str] = []

    async def request(t: Ticket) -> None:
        assert await admission.enter(t) is None
        order.append(t.tenant)

    tasks = []
    for t in tickets:
        tasks.append(asyncio.create_task(request(t)))
        await asyncio.sleep(0)  # queued in this order
    for _ in tickets:
        admission.leave()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return order


def held(queue: int = 100) -> Admission:
    admission = Admission(limit=1, queue=queue, wait_s=30.0)
    assert admission.admit_now()
    return admission


async def test_two_tenants_flooding_alternate_and_each_keeps_its_own_order() -> None:
    admission = held()
    tickets = [Ticket("a", prompt_tokens=100) for _ in range(6)]
    tickets += [Ticket("b", prompt_tokens=100) for _ in range(6)]
    order = await served_order(admission, tickets)
    assert order == ["a", "b"] * 6  # not six of a first: a queued first, b is served less


async def test_weights_share_the_slots_in_their_ratio() -> None:
    admission = held()
    tickets = [Ticket("a", weight=3.0, prompt_tokens=100) for _ in range(12)]
    tickets += [Ticket("b", weight=1.0, prompt_tokens=100) for _ in range(12)]
    order = await served_order(admission, tickets)
    assert order[:16].count("a") == 12 and order[:16].count("b") == 4


async def test_a_tenant_alone_gets_every_slot_first_come_first_served() -> None:
    admission = held()
    tickets = [Ticket("a", prompt_tokens=p) for p in (5, 500, 50)]
    assert await served_order(admission, tickets) == ["a", "a", "a"]
    assert admission.finish["a"] == pytest.approx(5 + 500 + 50 + 3 * 256)


async def test_a_tenant_back_from_idle_banks_nothing() -> None:
    """b was idle while a was served 40 requests: its first request goes first (it starts
    at the queue's virtual time), then the two alternate; it is not 40 requests ahead."""
    admission = held()
    await served_order(admission, [Ticket("a", prompt_tokens=100) for _ in range(40)])
    tickets = [Ticket("a", prompt_tokens=100) for _ in range(4)]
    tickets += [Ticket("b", prompt_tokens=100) for _ in range(4)]
    order = await served_order(admission, tickets)
    assert order == ["b", "a", "b", "a", "b", "a", "b", "a"]


async def test_what_was_served_corrects_the_estimate() -> None:
    admission = Admission(limit=2, queue=10, wait_s=30.0)
    big, small = Ticket("a", prompt_tokens=10), Ticket("b", prompt_tokens=10)
    assert await admission.enter(big) is None and await admission.enter(small) is None
    big.served = (10, 5000)  # a's answer was long
    small.served = (10, 3)
    admission.leave(big)
    admission.leave(small)
    assert admission.finish["a"] == pytest.approx(5010)
    assert admission.finish["b"] == pytest.approx(13)
    assert admission.expected_output["a"] > admission.expected_output["b"]
    assert admission.running == {} and admission.inflight == 0


async def test_a_higher_class_goes_first_whatever_its_tenant_was_served() -> None:
    admission = held()
    tickets = [Ticket("batch", rank=2), Ticket("std", rank=1), Ticket("live", rank=0)]
    assert await served_order(admission, tickets) == ["live", "std", "batch"]


async def test_reserved_slots_wait_for_the_tenant_below_its_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """limit 4, reserve 1: alone, a flooding tenant takes all four; once another tenant is
    active, it keeps to three while over its share (2 of 4), and the quiet tenant finds the
    fourth free though the flood waits for it; quiet for ACTIVE_S, it is the flood's again."""
    clock = [1000.0]
    monkeypatch.setattr("proxy.admission.slots.time.monotonic", lambda: clock[0])
    admission = Admission(limit=4, queue=10, wait_s=30.0, reserve=1)
    flood = [Ticket("flood", prompt_tokens=100) for _ in range(4)]
    for t in flood:
        assert admission.admit_now(t)  # alone: every slot
    admission.leave(flood.pop())
    quiet = Ticket("quiet", prompt_tokens=100)
    assert admission.admit_now(quiet)  # quiet takes the slot: it is active now
    admission.leave(quiet)
    clock[0] += 1.0
    waiting = asyncio.create_task(admission.enter(Ticket("flood", prompt_tokens=100)))
    await asyncio.sleep(0)
    assert admission.inflight == 3 and admission.waiting == 1  # the fourth is kept
    again = Ticket("quiet", prompt_tokens=100)
    assert await admission.enter(again) is None  # at once, though the flood waits
    assert admission.inflight == 4 and admission.waiting == 1
    admission.leave(again)  # freed: kept again, not handed to the flood over its share
    assert admission.inflight == 3 and not waiting.done()
    clock[0] += ACTIVE_S + 1.0  # quiet has gone quiet: the next slot freed fills both
    admission.leave(flood.pop())
    assert await waiting is None
    assert admission.inflight == 3 and admission.waiting == 0
    assert admission.admit_now(Ticket("flood", prompt_tokens=100))
    assert admission.inflight == 4


def test_a_reserve_as_large_as_the_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="reserve < limit"):
        Admission(limit=2, queue=1, wait_s=1.0, reserve=2)
    env = {"WARMROUTE_SERVER__MAX_INFLIGHT": "8", "WARMROUTE_TENANTS__RESERVE_SLOTS": "8"}
    with pytest.raises(ConfigError, match=r"tenants\.reserve_slots: 8 would keep every one"):
        load_config(flags={"backends": ["http://127.0.0.1:9"]}, env=env)


async def test_a_full_queue_sheds_the_lowest_class_then_the_tenant_over_its_share() -> None:
    admission = held(queue=2)
    admission.finish["a"] = 1000.0  # a has asked for more than b
    waiting = [asyncio.create_task(admission.enter(Ticket("a", rank=r))) for r in (1, 2)]
    await asyncio.sleep(0)
    assert admission.waiting == 2
    # A standard request arrives: the batch waiter gives its place.
    newcomer = asyncio.create_task(admission.enter(Ticket("b", rank=1)))
    await asyncio.sleep(0)
    assert await waiting[1] == SHED_PRIORITY and admission.waiting == 2
    # Another standard one of b, served less than a: a's waiter gives its place.
    second = asyncio.create_task(admission.enter(Ticket("b", rank=1)))
    await asyncio.sleep(0)
    assert await waiting[0] == SHED_FAIR
    # a, the most served, finds the queue full of b's: refused, and told it is its share.
    assert await admission.enter(Ticket("a", rank=1)) == OVER_SHARE
    # b alone in the queue and full: its own newcomer is simply refused.
    assert await admission.enter(Ticket("b", rank=1)) == QUEUE_FULL
    assert admission.stats.rejected[SHED_PRIORITY] == 1
    assert admission.stats.rejected[SHED_FAIR] == 1
    for _ in range(2):  # the held slot goes to b's first, its slot to b's second
        admission.leave()
    assert await newcomer is None and await second is None
    assert admission.waiting == 0 and admission.inflight == 1


# -- the real proxy ----------------------------------------------------------------------------


@pytest.mark.e2e
def test_a_flooding_tenant_gives_way_and_its_excess_is_refused_with_429(
    fake_backends: Any, proxy_server: Callable[..., ServerThread]
) -> None:
    """One slot, a queue of three. The flooder holds the slot and fills the queue; a quiet
    tenant's request takes the place of the flooder's newest (429 fair_share_exceeded with
    Retry-After) and is served next, before the flooder's older waiters."""
    [(app, backend)] = fake_backends(1)
    config = {
        "server": {
            "api_keys": [api_key("flood"), api_key("quiet")],
            "max_inflight": 1,
            "admission_queue": 3,
            "admission_timeout_s": 30,
        },
        "tenants": {"keys": {"quiet": {"weight": 2.0}}},
    }
    proxy = proxy_server([backend.url], config)
    url = proxy.url + "/v1/chat/completions"
    finished: list[str] = []
    statuses: dict[str, int] = {}
    headers: dict[str, httpx.Headers] = {}
    lock = threading.Lock()
    got_chunk, release = threading.Event(), threading.Event()

    def hold() -> None:
        body = {
            "model": MODEL,
            "stream": True,
            "messages": [{"role": "user", "content": "stall:1"}],
        }
        auth = {"authorization": "Bearer key-flood"}
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", url, json=body, headers=auth) as r,
        ):
            for _ in r.iter_raw():
                got_chunk.set()
                release.wait(60)
                return

    def send(tenant: str, label: str) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": label}]}
        r = httpx.post(
            url, json=body, headers={"authorization": f"Bearer key-{tenant}"}, timeout=60
        )
        with lock:
            statuses[label] = r.status_code
            headers[label] = r.headers
            if r.status_code == 200:
                finished.append(label)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert got_chunk.wait(30)
    threads = []
    for i in range(3):
        t = threading.Thread(target=send, args=("flood", f"flood-{i}"), daemon=True)
        t.start()
        threads.append(t)
        until(lambda i=i: metric(proxy.url, "warmroute_admission_waiting") == i + 1)
    quiet = threading.Thread(target=send, args=("quiet", "quiet"), daemon=True)
    quiet.start()
    until(lambda: "flood-2" in statuses)  # the flooder's newest gave its place
    assert statuses["flood-2"] == 429
    assert headers["flood-2"]["retry-after"] == "30"
    release.set()
    for t in [*threads, quiet]:
        t.join(60)
    holder.join(60)
    assert sorted(finished) == ["flood-0", "flood-1", "quiet"]
    # In the order the backend saw them: the quiet one first, before the flooder's older
    # waiters (the slot is one: each went in once the one before had finished).
    seen = [r["body"]["messages"][0]["content"] for r in app.rec.requests]
    assert seen == ["stall:1", "quiet", "flood-0", "flood-1"]
    view = httpx.get(proxy.url + "/admin/tenants", timeout=10).json()
    assert view["budgets"] == "none"
    assert view["tenants"]["quiet"]["queue"]["running"] == 0
    assert view["tenants"]["flood"]["queue"]["waiting"] == 0
    assert view["tenants"]["flood"]["queue"]["ahead_tokens_per_weight"] >= 0
    assert view["tenants"]["flood"]["queue"]["backend_waiting"] == 0


@pytest.mark.e2e
def test_a_priority_header_may_lower_a_class_but_not_raise_it_unless_allowed(
    fake_backends: Any, proxy_server: Callable[..., ServerThread]
) -> None:
    [(_, backend)] = fake_backends(1)
    config = {
        "server": {"api_keys": [api_key("app"), api_key("ops")]},
        "tenants": {"keys": {"ops": {"priority": "batch", "priority_header": True}}},
    }
    proxy = proxy_server([backend.url], config)
    url = proxy.url + "/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

    def post(tenant: str, priority: str) -> httpx.Response:
        auth = {"authorization": f"Bearer key-{tenant}", "x-warmroute-priority": priority}
        return httpx.post(url, json=body, headers=auth, timeout=10)

    assert post("app", "batch").status_code == 200  # lowering: always
    r = post("app", "interactive")
    assert r.status_code == 403 and r.json()["error"]["code"] == "priority_not_allowed"
    r = post("app", "urgent")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_priority"
    assert "interactive, standard, batch" in r.json()["error"]["message"]
    assert post("ops", "interactive").status_code == 200  # allowed to raise


@pytest.mark.e2e
def test_goodput_counts_keyed_streams_against_their_class_target(
    fake_backends: Any, proxy_server: Callable[..., ServerThread]
) -> None:
    """A standard target of a minute: every streamed answer of the fake backend meets it,
    and the metric says so per class."""
    [(_, backend)] = fake_backends(1)
    config = {
        "server": {"api_keys": [api_key("app")]},
        "tenants": {"ttft_targets_s": {"standard": 60.0}},
    }
    proxy = proxy_server([backend.url], config)
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    auth = {"authorization": "Bearer key-app"}
    for _ in range(3):
        r = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=auth, timeout=10)
        assert r.status_code == 200

    def met() -> float:
        text = httpx.get(proxy.url + "/metrics", timeout=10).text
        pattern = r'warmroute_admission_goodput_total\{[^}]*outcome="met"[^}]*\} (\S+)'
        found = re.search(pattern, text)
        return float(found.group(1)) if found else 0.0

    until(lambda: met() == 3, "three met targets on /metrics")
    text = httpx.get(proxy.url + "/metrics", timeout=10).text
    assert 'warmroute_priority="standard"' in text and 'outcome="missed"' not in text


# -- deadlines -----------------------------------------------------------------------------------


async def test_a_request_that_cannot_meet_its_class_target_is_refused_at_once() -> None:
    """A slot is held ~0.5 s and a standard request's TTFT once admitted is ~0.3 s: behind
    no one it would start at ~0.8 s (within 1 s), behind one at ~1.3 s (refused at once)."""
    admission = Admission(limit=1, queue=10, wait_s=30.0, targets={1: 1.0})
    assert admission.admit_now()
    first = asyncio.create_task(admission.enter(Ticket("a")))  # nothing measured yet: queued
    await asyncio.sleep(0)
    assert admission.waiting == 1
    admission.hold_s, admission.ttft_s[1] = 0.5, 0.3
    assert await admission.enter(Ticket("b")) == "deadline"  # behind `first`: 1.3 s
    assert admission.goodput == {("standard", "deadline"): 1}
    # a batch request has no target: it waits
    batch = asyncio.create_task(admission.enter(Ticket("b", rank=2)))
    await asyncio.sleep(0)
    assert admission.waiting == 2
    admission.leave()
    assert await first is None
    admission.leave()
    assert await batch is None


async def test_goodput_counts_who_met_the_target_and_feeds_the_prediction() -> None:
    admission = Admission(limit=2, queue=10, wait_s=30.0, targets={0: 0.5})
    fast, slow = Ticket("a", rank=0), Ticket("a", rank=0)
    assert await admission.enter(fast) is None and await admission.enter(slow) is None
    fast.ttft_s, slow.ttft_s = 0.2, 0.9
    admission.leave(fast)
    admission.leave(slow)
    assert admission.goodput == {("interactive", "met"): 1, ("interactive", "missed"): 1}
    assert admission.ttft_s[0] == pytest.approx(0.2 + 0.1 * (0.9 - 0.2))
    assert admission.hold_s is not None and admission.hold_s >= 0


def test_a_deadline_refusal_names_the_class_and_its_target() -> None:
    from proxy.tenants.tickets import refusal

    admission = Admission(1, 1, 5.0, targets={0: 2.0})
    status, code, _, message = refusal("deadline", admission, Ticket("a", rank=0))
    assert (status, code) == (503, "deadline_unreachable")
    assert "`interactive`: 2 s" in message and "retry after 5 s" in message


async def test_without_keys_the_queue_is_first_come_and_counts_nothing_twice() -> None:
    """What the edge does without API keys: a ticket of the one tenant for each request that
    has to queue, given back when it ends; nobody stays counted as running."""
    admission = held()
    tickets = [Ticket() for _ in range(5)]
    order: list[int] = []

    async def request(i: int) -> None:
        assert await admission.enter(tickets[i]) is None
        order.append(i)
        await asyncio.sleep(0)
        admission.leave(tickets[i])

    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(request(i)))
        await asyncio.sleep(0)
    admission.leave()  # the held slot
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    assert admission.running == {} and admission.inflight == 0 and admission.waiting == 0
