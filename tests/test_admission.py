"""Admission (proxy/admission/slots.py): a bound on requests in flight with a short FIFO queue, and
past it a 503 `overloaded` with Retry-After in OpenAI's error shape, counted in metrics."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.admission.slots import QUEUE_FULL, QUEUE_TIMEOUT, Admission
from tests.support import ServerThread, until

MODEL = "test-model"


def admitted_at_once(admission: Admission) -> str | None:
    """enter() when it must not wait: it finishes on its first step, without suspending."""
    step = admission.enter()
    with pytest.raises(StopIteration) as done:
        step.send(None)
    return done.value.value


# -- the pure parts, on the event loop ----------------------------------------------------------


def test_it_refuses_bad_settings() -> None:
    for args in ((0, 1, 1.0), (1, -1, 1.0), (1, 1, -0.5)):
        with pytest.raises(ValueError, match="admission needs"):
            Admission(*args)


def test_up_to_the_limit_requests_are_admitted_without_waiting() -> None:
    admission = Admission(limit=3, queue=0, wait_s=1.0)
    assert [admitted_at_once(admission) for _ in range(3)] == [None, None, None]
    assert admission.inflight == 3 and admission.stats.admitted == 3
    admission.leave()
    assert admission.inflight == 2


def test_with_the_queue_full_a_request_is_refused_at_once() -> None:
    admission = Admission(limit=1, queue=0, wait_s=10.0)
    assert admitted_at_once(admission) is None
    assert admitted_at_once(admission) == QUEUE_FULL  # no queue: no waiting at all
    assert admission.stats.rejected == {QUEUE_FULL: 1, QUEUE_TIMEOUT: 0}
    assert admission.inflight == 1 and admission.waiting == 0


async def test_a_free_slot_is_taken_without_awaiting_and_a_full_one_left_to_the_queue() -> None:
    admission = Admission(limit=1, queue=2, wait_s=10.0)
    assert admission.admit_now() and admission.inflight == 1  # what the edge tries first
    assert not admission.admit_now() and admission.stats.admitted == 1  # full: enter() queues
    waiter = asyncio.create_task(admission.enter())
    await asyncio.sleep(0)
    admission.leave()  # the slot goes to the waiter, not to a newcomer
    assert not admission.admit_now()
    assert await waiter is None and admission.inflight == 1
    admission.leave()
    assert admission.admit_now() and admission.stats.admitted == 3


async def test_a_full_queue_refuses_the_next_request_while_the_queued_ones_wait() -> None:
    admission = Admission(limit=1, queue=2, wait_s=10.0)
    assert await admission.enter() is None
    waiters = [asyncio.create_task(admission.enter()) for _ in range(2)]
    await asyncio.sleep(0)  # both reach the queue
    assert admission.waiting == 2
    assert await admission.enter() == QUEUE_FULL
    for _ in waiters:
        admission.leave()
    assert await asyncio.gather(*waiters) == [None, None]
    assert admission.inflight == 1  # the slot went from hand to hand, never back to the pool
    assert (admission.stats.admitted, admission.stats.queued) == (3, 2)


async def test_a_queued_request_is_refused_when_its_wait_runs_out() -> None:
    admission = Admission(limit=1, queue=4, wait_s=0.01)
    assert await admission.enter() is None
    assert await admission.enter() == QUEUE_TIMEOUT
    assert admission.waiting == 0  # it left the queue
    assert admission.stats.rejected[QUEUE_TIMEOUT] == 1
    admission.leave()
    assert admission.inflight == 0  # nobody waits: the slot goes back


async def test_a_finished_request_hands_its_slot_to_the_oldest_waiter() -> None:
    admission = Admission(limit=1, queue=3, wait_s=10.0)
    assert await admission.enter() is None
    order: list[int] = []

    async def request(i: int) -> None:
        assert await admission.enter() is None
        order.append(i)

    tasks = []
    for i in range(3):
        tasks.append(asyncio.create_task(request(i)))
        await asyncio.sleep(0)  # queued in this order
    for _ in range(3):
        admission.leave()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert admission.inflight == 1


async def test_a_cancelled_waiter_leaves_the_queue_and_takes_no_slot() -> None:
    admission = Admission(limit=1, queue=2, wait_s=10.0)
    assert await admission.enter() is None
    gone = asyncio.create_task(admission.enter())
    stays = asyncio.create_task(admission.enter())
    await asyncio.sleep(0)
    gone.cancel()  # the client hung up while queued
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert admission.waiting == 1
    admission.leave()
    assert await stays is None  # the slot skipped the cancelled waiter
    assert admission.inflight == 1 and admission.stats.admitted == 2


async def test_a_slot_handed_to_a_waiter_cancelled_at_that_moment_goes_on() -> None:
    admission = Admission(limit=1, queue=2, wait_s=10.0)
    assert await admission.enter() is None
    first = asyncio.create_task(admission.enter())
    second = asyncio.create_task(admission.enter())
    await asyncio.sleep(0)
    admission.leave()  # the slot is handed to `first`...
    first.cancel()  # ...which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await second is None  # the slot was passed on, not lost
    admission.leave()
    assert admission.inflight == 0 and admission.waiting == 0


def test_retry_after_is_whole_seconds_and_at_least_one() -> None:
    assert Admission(1, 0, 0.0).retry_after_s == 1
    assert Admission(1, 0, 0.2).retry_after_s == 1
    assert Admission(1, 0, 2.5).retry_after_s == 3


# -- a real proxy: 503 overloaded for the official client, and the metrics -----------------------


@pytest.fixture
def held_stream() -> Iterator[Callable[[str], threading.Event]]:
    """Open a streaming request through the proxy that the backend never finishes
    (`stall:1`), holding an admission slot; returns once its first chunk is in."""
    stops: list[threading.Event] = []
    threads: list[threading.Thread] = []

    def hold(url: str) -> threading.Event:
        got_chunk, stop = threading.Event(), threading.Event()
        body = {
            "model": MODEL,
            "stream": True,
            "messages": [{"role": "user", "content": "stall:1"}],
        }

        def run() -> None:
            with (
                httpx.Client(timeout=30) as http,
                http.stream("POST", url + "/v1/chat/completions", json=body) as r,
            ):
                assert r.status_code == 200
                for _ in r.iter_raw():
                    got_chunk.set()
                    if stop.wait(30):
                        return

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
        stops.append(stop)
        assert got_chunk.wait(30), "the held stream never started"
        return stop

    yield hold
    for stop in stops:
        stop.set()
    for thread in threads:
        thread.join(10)


def admission_metrics(url: str) -> dict[str, float]:
    """warmroute.admission.* from /metrics: {"inflight": n, "waiting": n, "rejected.queue_full":
    n, ...}."""
    out = {}
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("warmroute_admission_"):
                name = sample.name.removeprefix("warmroute_admission_").removesuffix("_total")
                reason = sample.labels.get("warmroute_reason")
                out[f"{name}.{reason}" if reason else name] = sample.value
    return out


@pytest.mark.e2e
def test_past_the_inflight_bound_the_official_client_gets_503_overloaded_with_retry_after(
    fake_backends: Any,
    proxy_server: Callable[..., ServerThread],
    held_stream: Callable[[str], threading.Event],
) -> None:
    [(_, backend)] = fake_backends(1)
    server = {"max_inflight": 1, "admission_queue": 1, "admission_timeout_s": 2}
    proxy = proxy_server([backend.url], {"server": server})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": "hi"}]
    errors: list[openai.APIStatusError] = []

    def request() -> None:
        try:
            client.chat.completions.create(model=MODEL, messages=messages)
        except openai.APIStatusError as e:
            errors.append(e)

    release = held_stream(proxy.url)  # the one slot, held
    queued = threading.Thread(target=request, daemon=True)
    queued.start()
    until(lambda: admission_metrics(proxy.url)["waiting"] == 1)
    request()  # the queue's one place is taken: refused at once
    queued.join(10)  # the queued one's wait runs out: refused too
    assert len(errors) == 2
    for error in errors:
        assert isinstance(error, openai.InternalServerError)
        assert error.status_code == 503 and error.code == "overloaded"
        assert error.type == "server_error"
        assert error.response.headers["retry-after"] == "2"  # server.admission_timeout_s
        assert "server.max_inflight" in error.message
        assert set(error.response.json()["error"]) == {"message", "type", "param", "code"}
        assert len(error.response.headers["x-request-id"]) == 32  # a refusal is traceable too
    metrics = admission_metrics(proxy.url)
    assert (metrics["inflight"], metrics["waiting"]) == (1, 0)

    release.set()  # the stream ends: its slot comes back
    reply = client.chat.completions.create(model=MODEL, messages=messages)
    assert reply.choices[0].message.content
    metrics = admission_metrics(proxy.url)
    assert (metrics["rejected.queue_full"], metrics["rejected.queue_timeout"]) == (1, 1)


@pytest.mark.e2e
def test_with_no_queue_an_overloaded_proxy_refuses_at_once_and_counts_it(
    fake_backends: Any,
    proxy_server: Callable[..., ServerThread],
    held_stream: Callable[[str], threading.Event],
) -> None:
    [(_, backend)] = fake_backends(1)
    server = {"max_inflight": 1, "admission_queue": 0, "admission_timeout_s": 30}
    proxy = proxy_server([backend.url], {"server": server})
    release = held_stream(proxy.url)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(3):
        r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        assert r.headers["retry-after"] == "30"
    mine = httpx.post(
        proxy.url + "/v1/chat/completions", json=body, headers={"x-request-id": "r-1"}, timeout=10
    )
    assert mine.status_code == 503 and mine.headers["x-request-id"] == "r-1"
    metrics = admission_metrics(proxy.url)
    assert (metrics["rejected.queue_full"], metrics["inflight"]) == (4, 1)
    text = httpx.get(proxy.url + "/metrics", timeout=10).text  # and on the error panels' metric
    assert re.search(
        r'warmroute_requests_refused_total\{[^}]*error_type="overloaded"[^}]*\} 4\.0', text
    )
    release.set()
