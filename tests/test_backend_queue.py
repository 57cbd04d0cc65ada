"""The queue of requests whose every backend is at its in-flight bound
(proxy/admission/backend_queue.py):
a freed slot wakes the waiter the fair order puts first among those the backend could serve."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from proxy.admission.backend_queue import BackendQueue
from proxy.admission.slots import QUEUE_FULL, QUEUE_TIMEOUT, SHED_FAIR, SHED_PRIORITY, Ticket
from proxy.routing.types import Decision, Dropped, Verdict
from tests.support import metric, until

FAR = 1e9  # a deadline that does not come


def _ticket(tenant: str, cost: float = 100.0, rank: int = 1, weight: float = 1.0) -> Ticket:
    return Ticket(tenant=tenant, cost=cost, rank=rank, weight=weight)


async def _settled() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_freed_slot_goes_to_the_best_class_then_the_tenant_served_least() -> None:
    """The flood has two waiting before the quiet tenant's one arrives: the quiet one is
    tagged at the queue's virtual time, where the flood's first is, and before its second."""
    queue = BackendQueue(size=8, wait_s=5.0, recheck_s=FAR)
    arrivals = [
        ("flood 1", _ticket("flood")),
        ("flood 2", _ticket("flood")),
        ("quiet", _ticket("quiet")),
        ("batch", _ticket("batch", rank=2)),
        ("interactive", _ticket("ui", rank=0)),
    ]
    order: list[str] = []

    async def wait(name: str, ticket: Ticket) -> None:
        waiter = queue.waiter(ticket)
        assert await waiter.wait(["a"], FAR)
        order.append(name)

    tasks = []
    for name, t in arrivals:
        tasks.append(asyncio.create_task(wait(name, t)))
        await _settled()
    assert len(queue.waiters) == 5
    for _ in arrivals:
        queue.freed("a")
        await _settled()
    assert order == ["interactive", "flood 1", "quiet", "flood 2", "batch"]
    await asyncio.gather(*tasks)


async def test_tags_are_in_tokens_over_weight_and_time_moves_with_who_got_a_backend() -> None:
    queue = BackendQueue(size=8, wait_s=5.0, recheck_s=FAR)
    big = [queue.waiter(_ticket("big", cost=1000.0)) for _ in range(2)]
    heavy = [queue.waiter(_ticket("heavy", cost=1000.0, weight=4.0)) for _ in range(2)]
    assert [w.key[1] for w in big] == [0.0, 1000.0]
    assert [w.key[1] for w in heavy] == [0.0, 250.0]  # its weight: four times the share
    decision = Decision("p", [], "r", filtered_out={"a": Dropped(Verdict.AT_BOUND, "full")})
    routed = Decision("p", ["a"], "r")

    async def again() -> Decision:
        return routed

    task = asyncio.create_task(queue.route_when_freed(_ticket("late", cost=10.0), decision, again))
    await _settled()
    queue.virtual = 500.0  # as if waiters up to a start of 500 had been served
    queue.freed("a")
    _, waiter = await task
    assert waiter.routed and waiter.key[1] == 0.0  # tagged before: it keeps its place
    assert queue.virtual == 500.0  # the time never goes back
    assert queue.waiter(_ticket("new")).key[1] == 500.0  # a newcomer banks nothing


async def test_a_slot_wakes_only_a_waiter_that_backend_could_serve() -> None:
    queue = BackendQueue(size=8, wait_s=5.0, recheck_s=FAR)
    first = asyncio.create_task(queue.waiter(_ticket("x")).wait(["a"], FAR))
    second = asyncio.create_task(queue.waiter(_ticket("y")).wait(["b"], FAR))
    await _settled()
    queue.freed("b")  # x waits for a only: y goes, though x is first in the fair order
    await _settled()
    assert second.done() and not first.done()
    queue.freed("c")  # nobody waits for c: nothing happens
    await _settled()
    assert not first.done()
    queue.freed("a")
    assert await first


async def test_without_tenants_it_is_first_come_first_served() -> None:
    queue = BackendQueue(size=8, wait_s=5.0, recheck_s=FAR)
    order: list[int] = []

    async def wait(i: int) -> None:
        assert await queue.waiter(None).wait(["a"], FAR)
        order.append(i)

    tasks = [asyncio.create_task(wait(i)) for i in range(3)]
    await _settled()
    for _ in range(3):
        queue.freed("a")
        await _settled()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2] and not queue.finish


async def test_a_waiter_that_lost_its_slot_waits_again_in_the_place_it_had() -> None:
    queue = BackendQueue(size=2, wait_s=5.0, recheck_s=FAR)
    early, late = queue.waiter(_ticket("e")), queue.waiter(_ticket("e"))  # starts 0, 100
    first = asyncio.create_task(early.wait(["a"], FAR))
    second = asyncio.create_task(late.wait(["a"], FAR))
    await _settled()
    queue.freed("a")
    assert await first  # routed again, and a newcomer had taken the slot: it waits again
    third = asyncio.create_task(queue.waiter(_ticket("e")).wait(["a"], FAR))  # 200
    await _settled()  # the queue is full again (late, the newcomer)
    again = asyncio.create_task(early.wait(["a"], FAR))  # a place kept is kept
    fourth = asyncio.create_task(queue.waiter(_ticket("e")).wait(["a"], FAR))  # 300
    await _settled()
    assert fourth.done() and fourth.result() is False  # a new one going last: refused
    assert [w.key[1] for w in queue.waiters] == [0.0, 100.0, 200.0]
    queue.freed("a")
    await _settled()
    assert again.done() and again.result() is True and not third.done()
    queue.freed("a")
    queue.freed("a")
    assert await second and await third
    assert queue.stats[QUEUE_FULL] == 1 and queue.stats["waited"] == 3


async def test_a_full_queue_sheds_its_last_waiter_for_a_newcomer_that_goes_before_it() -> None:
    queue = BackendQueue(size=2, wait_s=5.0, recheck_s=FAR)
    flood = [queue.waiter(_ticket("flood")) for _ in range(3)]  # starts 0, 100, 200
    waits = [asyncio.create_task(w.wait(["a"], FAR)) for w in flood[1:]]
    await _settled()
    quiet = queue.waiter(_ticket("quiet"))  # start 0
    quiet_wait = asyncio.create_task(quiet.wait(["a"], FAR))
    await _settled()
    assert waits[1].done() and waits[1].result() is False and flood[2].outcome == SHED_FAIR
    batch = queue.waiter(_ticket("batch", rank=2))  # would go last: refused
    assert not await batch.wait(["a"], FAR) and batch.outcome == QUEUE_FULL
    live = queue.waiter(_ticket("ui", rank=0))
    live_wait = asyncio.create_task(live.wait(["a"], FAR))
    await _settled()
    assert waits[0].done() and flood[1].outcome == SHED_PRIORITY  # (flood's 100 was last)
    assert [w.key[:2] for w in queue.waiters] == [(0, 0.0), (1, 0.0)]
    queue.freed("a")
    queue.freed("a")
    assert await live_wait and await quiet_wait
    assert queue.stats[SHED_FAIR] == 1 and queue.stats[SHED_PRIORITY] == 1


async def test_a_waiter_woken_as_its_client_leaves_hands_the_slot_to_the_next() -> None:
    queue = BackendQueue(size=8, wait_s=5.0, recheck_s=FAR)
    leaving = asyncio.create_task(queue.waiter(_ticket("x")).wait(["a"], FAR))
    staying = asyncio.create_task(queue.waiter(_ticket("y")).wait(["a"], FAR))
    await _settled()
    queue.freed("a")  # wakes x...
    leaving.cancel()  # ...whose client is gone before it routes
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert await staying  # the slot went on to y
    assert not queue.waiters


async def test_past_its_deadline_a_waiter_is_told_no_and_its_time_is_counted() -> None:
    queue = BackendQueue(size=8, wait_s=0.02, recheck_s=FAR)
    waiter = queue.waiter(None)
    deadline = asyncio.get_running_loop().time() + queue.wait_s
    assert await waiter.wait(["a"], deadline)  # the deadline ends the wait: route again
    assert not await waiter.wait(["a"], deadline)  # then: no more waiting
    assert waiter.outcome == QUEUE_TIMEOUT and queue.stats[QUEUE_TIMEOUT] == 1
    assert waiter.waited_s >= 0.02 and not queue.waiters


async def test_a_waiter_routes_again_at_each_recheck_without_being_woken() -> None:
    # (peers' releases and a changed fleet are seen only by routing again)
    queue = BackendQueue(size=8, wait_s=5.0, recheck_s=0.01)
    waiter = queue.waiter(None)
    assert await waiter.wait(["a"], FAR)
    assert not queue.waiters and waiter.outcome is None


@pytest.mark.e2e
def test_through_the_proxy_a_request_waits_for_the_busy_backend_and_metrics_say_so(
    fake_backends: Any, proxy_server: Callable[..., Any]
) -> None:
    [(app, backend)] = fake_backends(1)
    config = {
        "backends": [{"url": backend.url, "max_inflight": 1}],
        "server": {"admission_timeout_s": 120},  # it waits for the release, however slow
    }
    proxy = proxy_server([backend.url], config=config)
    held = orjson.dumps(
        {
            "model": "test-model",
            "stream": True,
            "messages": [{"role": "user", "content": "delay:30"}],
        }
    )
    host, port = proxy.url.removeprefix("http://").split(":")
    answer: list[httpx.Response] = []
    with socket.create_connection((host, int(port))) as first:  # in flight until closed
        first.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(held), held)
        )
        until(lambda: len(app.rec.requests) == 1, "the first request on the backend")
        body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
        second = threading.Thread(
            target=lambda: answer.append(
                httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=60)
            )
        )
        second.start()
        until(lambda: metric(proxy.url, "warmroute_backend_queue_waiting") == 1.0, "a waiter")
    second.join(60)  # the first request's client left: its slot went to the waiter
    assert answer and answer[0].status_code == 200
    assert metric(proxy.url, "warmroute_backend_queue_requests_total", outcome="routed") == 1.0
    assert metric(proxy.url, "warmroute_backend_queue_waiting") == 0.0


async def test_admin_tenants_counts_each_tenants_requests_waiting_for_a_backend() -> None:
    from proxy.admission.slots import Admission
    from proxy.tenants.http import describe

    queue = BackendQueue(size=8, wait_s=5.0, recheck_s=FAR)
    waits = [asyncio.create_task(queue.waiter(_ticket(t)).wait(["a"], FAR)) for t in "aab"]
    await _settled()
    view = await describe(None, Admission(4, 4, 1.0), ("a", "b", "c"), queue)
    assert [view["tenants"][t]["queue"]["backend_waiting"] for t in "abc"] == [2, 1, 0]
    for _ in waits:
        queue.freed("a")
    await asyncio.gather(*waits)
