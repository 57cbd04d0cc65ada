"""Engines that order their queue by priority (vLLM's --scheduling-policy priority, SGLang's
--enable-priority-scheduling): the level the admission gives each request (its class, and
its tenant's standing), the body the engine gets, and the bench mock's priority queue, serial
or in chunked-prefill steps (on a virtual clock: every time asserted is the engine's own)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from proxy.admission.slots import Admission, Ticket
from proxy.bench.mock import EngineSettings, MockEngine, main
from proxy.forwarding.intake import with_priority
from tests.support import ServerThread, api_key


def test_the_level_is_the_class_and_one_more_for_a_tenant_over_its_share() -> None:
    admission = Admission(limit=8, queue=0, wait_s=1.0)
    flood = [Ticket("flood") for _ in range(3)]
    for t in flood:
        assert admission.admit_now(t)
    assert [t.level for t in flood] == [0, 0, 0]  # alone: the whole fleet is its share
    quiet = Ticket("quiet")
    assert admission.admit_now(quiet) and quiet.level == 0  # 1 of 4: under its half
    more = Ticket("flood")
    assert admission.admit_now(more) and more.level == 1  # 4 of 5: over its half
    heavy = Ticket("quiet", weight=4.0)
    assert admission.admit_now(heavy) and heavy.level == 0  # 2 of 6 with 4/5 of the weight
    live, batch = Ticket("ui", rank=0), Ticket("job", rank=2)
    assert admission.admit_now(live) and live.level == -2
    assert admission.admit_now(batch) and batch.level == 2


def test_the_priority_is_spliced_in_or_replaces_the_clients() -> None:
    raw = b'{"model":"m","messages":[]}'
    out = with_priority(raw, orjson.loads(raw), -1)
    assert out == b'{"priority":-1,"model":"m","messages":[]}'
    sent = b'{"model":"m","priority":-100}'  # a client may not put itself first
    assert orjson.loads(with_priority(sent, orjson.loads(sent), 1)) == {
        "model": "m",
        "priority": 1,
    }


async def test_the_mock_prefills_by_priority_lower_first_then_in_arrival_order() -> None:
    engine = MockEngine(EngineSettings(0, prefill_tokens_per_s=1e9, priority_scheduling=True))
    order: list[str] = []

    async def prefill(name: str, priority: int) -> None:
        await engine.prefill([name], priority)
        order.append(name)

    engine._busy = True  # as if a prefill were running
    tasks = [
        asyncio.create_task(prefill(n, p))
        for n, p in (("batch", 2), ("std-1", 0), ("live", -2), ("std-2", 0))
    ]
    for _ in range(3):
        await asyncio.sleep(0)
    assert engine.waiting == 4
    engine._next()  # the running prefill ends
    await asyncio.gather(*tasks)
    assert order == ["live", "std-1", "std-2", "batch"]
    assert not engine._busy and engine.waiting == 0


async def test_a_cancelled_turn_passes_the_engine_on() -> None:
    engine = MockEngine(EngineSettings(0, prefill_tokens_per_s=1e9, priority_scheduling=True))
    engine._busy = True
    gone = asyncio.create_task(engine.prefill(["a"], 0))
    kept = asyncio.create_task(engine.prefill(["b"], 1))
    await asyncio.sleep(0)
    engine._next()  # a's turn...
    gone.cancel()  # ...as its client leaves
    with pytest.raises(asyncio.CancelledError):
        await gone
    await kept  # b got the engine
    assert not engine._busy


@pytest.mark.e2e
@pytest.mark.parametrize("order", ["lower_first", "higher_first"])
def test_a_keyed_request_reaches_an_engine_with_its_priority_in_the_engines_sense(
    order: str, fake_backends: Any, proxy_server: Callable[..., ServerThread]
) -> None:
    [(app, backend)] = fake_backends(1)
    config = {
        "server": {"api_keys": [api_key("app"), api_key("batch-job")]},
        "tenants": {"keys": {"batch-job": {"priority": "batch"}}},
        "backends": [{"url": backend.url, "engine_priority": order}],
    }
    proxy = proxy_server([backend.url], config=config)
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
    for name in ("app", "batch-job"):
        r = httpx.post(
            proxy.url + "/v1/chat/completions",
            json={**body, "priority": -50},  # a client's own is replaced
            headers={"authorization": f"Bearer key-{name}"},
            timeout=10,
        )
        assert r.status_code == 200, r.text
    sign = 1 if order == "lower_first" else -1
    assert [r["body"]["priority"] for r in app.rec.requests] == [0, 2 * sign]


@pytest.mark.e2e
def test_without_engine_priority_the_body_goes_as_the_client_sent_it(
    fake_backends: Any, proxy_server: Callable[..., ServerThread]
) -> None:
    [(app, backend)] = fake_backends(1)
    proxy = proxy_server([backend.url], config={"server": {"api_keys": [api_key("app")]}})
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": "Bearer key-app"},
        timeout=10,
    )
    assert r.status_code == 200 and "priority" not in app.rec.requests[0]["body"]


@pytest.mark.e2e
def test_the_mock_refuses_a_priority_it_does_not_schedule_by_as_vllm_does(
    fake_backends: Any,
) -> None:
    [(_, backend)] = fake_backends(1, cache_tokens=1000)  # an engine, first come first served
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
    url = backend.url + "/v1/chat/completions"
    assert httpx.post(url, json={**body, "priority": 0}, timeout=10).status_code == 200
    r = httpx.post(url, json={**body, "priority": 3}, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "Got priority 3 but Priority scheduling is not enabled."
    )
    r = httpx.post(url, json={**body, "priority": "high"}, timeout=10)
    assert r.status_code == 400 and "valid integer" in r.json()["error"]["message"]


# -- prefill in steps (chunked prefill), on a virtual clock -----------------------------------
class VirtualClock:
    """The engine's clock: a sleep moves virtual time on at once. Arrivals are set at virtual
    times; one whose time falls within a prefill's sleep lands while it runs, and is queued
    before the engine plans what comes next, as a request landing mid-step is."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self._arrivals: list[tuple[float, Callable[[], None]]] = []

    def time(self) -> float:
        return self.now

    def at(self, when: float, start: Callable[[], None]) -> None:
        self._arrivals.append((when, start))

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)  # what the last step completed sees the time it completed at
        self.sleeps.append(seconds)
        due = [a for a in self._arrivals if a[0] < self.now + seconds]
        self._arrivals = [a for a in self._arrivals if a not in due]
        self.now += seconds
        for _, start in due:
            start()
        await asyncio.sleep(0)  # the arrivals queue their prompts


def prompt(name: str, tokens: int) -> list[str]:
    return [f"{name}{i}" for i in range(tokens)]


class Run:
    """Prompts sent to one engine at virtual times; when each got its first token."""

    def __init__(self, **settings: Any) -> None:
        self.clock = VirtualClock()
        rate = {"prefill_tokens_per_s": 1000.0, "priority_scheduling": True}
        settings = EngineSettings(0, **{**rate, **settings})
        self.engine = MockEngine(settings, self.clock.sleep, self.clock.time)
        self.engine.step_log = []
        self.first_token: dict[str, float] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def send(self, name: str, tokens: int, priority: int, at: float = 0.0) -> None:
        async def one() -> None:
            await self.engine.prefill(prompt(name, tokens), priority)
            self.first_token[name] = self.clock.now

        def start() -> None:
            self.tasks.append(asyncio.create_task(one()))

        if at:
            self.clock.at(at, start)
        else:
            start()

    async def finish(self) -> None:
        while not self.tasks or not all(t.done() for t in self.tasks):
            await asyncio.gather(*self.tasks)  # arrivals may add tasks while these run

    def steps(self) -> list[list[tuple[str, int]]]:
        """Each step as (prompt, tokens computed), the prompt named by its first token."""
        log = self.engine.step_log or []
        return [[(str(job.tokens[0])[:-1], n) for job, n in step] for step in log]


async def test_vllm_steps_finish_the_prompt_begun_before_a_higher_priority_arrival() -> None:
    # vLLM V1's order: a begun prompt continues first, whatever its priority; the waiting one
    # gets the budget it leaves (the flood's last 464 tokens leave 48).
    run = Run(prefill_chunk_tokens=512)
    run.send("flood", 2000, priority=2)
    run.send("quiet", 2000, priority=0, at=0.2)  # lands mid first step
    await run.finish()
    assert run.steps()[:5] == [
        [("flood", 512)],
        [("flood", 512)],
        [("flood", 512)],
        [("flood", 464), ("quiet", 48)],
        [("quiet", 512)],
    ]
    assert run.first_token == pytest.approx(
        {"flood": 2.048, "quiet": 4.0}
    )  # all of the flood, then its own


async def test_with_preemption_a_priority_0_arrival_waits_at_most_the_step_running() -> None:
    run = Run(prefill_chunk_tokens=512, preempt_prefill=True)
    run.send("flood", 2000, priority=2)
    run.send("quiet", 2000, priority=0, at=0.2)
    await run.finish()
    steps = run.steps()
    assert steps[:2] == [[("flood", 512)], [("quiet", 512)]]  # passed at the next step
    assert steps[4] == [("quiet", 464), ("flood", 48)]
    waited = run.first_token["quiet"] - 0.2 - 2.0  # less its own prefill
    assert waited <= 0.512 + 1e-9  # one step of the flood's, at most
    # The flood keeps what it computed: nothing is computed twice.
    assert sum(n for step in steps for _, n in step) == 4000
    assert run.first_token["flood"] == pytest.approx(4.0)


@pytest.mark.parametrize("preempt", [False, True])
async def test_equal_priorities_keep_arrival_order_in_steps(preempt: bool) -> None:
    run = Run(prefill_chunk_tokens=512, preempt_prefill=preempt)
    for i, at in enumerate((0.0, 0.1, 0.3)):
        run.send(f"p{i}", 1000, priority=1, at=at)
    await run.finish()
    assert sorted(run.first_token, key=run.first_token.__getitem__) == ["p0", "p1", "p2"]
    for step in run.steps():  # never a later arrival before an earlier one
        names = [name for name, _ in step]
        assert names == sorted(names)
    assert run.first_token == pytest.approx({"p0": 1.024, "p1": 2.048, "p2": 3.0})


async def test_without_chunks_a_priority_0_arrival_waits_for_the_whole_prefill_running() -> None:
    run = Run()  # prefill_chunk_tokens 0: serial, whole prompts, as before steps existed
    run.send("flood", 2000, priority=2)
    run.send("batch", 2000, priority=2, at=0.1)
    run.send("quiet", 2000, priority=0, at=0.2)
    await run.finish()
    assert run.clock.sleeps == pytest.approx([2.0, 2.0, 2.0])  # one sleep per prompt
    assert run.first_token == pytest.approx({"flood": 2.0, "quiet": 4.0, "batch": 6.0})
    assert run.engine.step_log == []  # no steps


async def test_a_prompt_cached_but_one_token_takes_one_tokens_step() -> None:
    clock = VirtualClock()
    settings = EngineSettings(4000, prefill_tokens_per_s=1000.0, prefill_chunk_tokens=512)
    engine = MockEngine(settings, clock.sleep, clock.time)
    tokens = prompt("sys", 640)  # 20 blocks of 32
    assert await engine.prefill(tokens) == 0
    assert await engine.prefill(tokens) == 639  # served all but one token
    assert clock.sleeps == pytest.approx([0.512, 0.128, 0.001])


async def test_a_prompt_whose_client_left_computes_nothing_more() -> None:
    clock = VirtualClock()
    settings = EngineSettings(0, prefill_tokens_per_s=1000.0, prefill_chunk_tokens=512)
    engine = MockEngine(settings, clock.sleep, clock.time)
    engine.step_log = []
    first = asyncio.create_task(engine.prefill(prompt("a", 1024)))
    gone = asyncio.create_task(engine.prefill(prompt("b", 1024)))
    await asyncio.sleep(0)  # both queued
    assert engine.waiting == 2
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    await first
    assert [[n for _, n in step] for step in engine.step_log] == [[512], [512]]
    assert engine.waiting == 0 and not engine._steps.running


@pytest.mark.parametrize(
    "argv",
    [
        ["--prefill-chunk-tokens", "512"],  # no engine
        ["--cache-tokens", "100", "--prefill-chunk-tokens", "-1"],
        ["--cache-tokens", "100", "--preempt-prefill", "--priority-scheduling"],  # no steps
        ["--cache-tokens", "100", "--preempt-prefill", "--prefill-chunk-tokens", "512"],
    ],
)
def test_the_mock_refuses_step_flags_that_cannot_apply(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


async def test_a_step_begun_late_ends_when_it_was_due() -> None:
    clock = VirtualClock()
    late = [0.0, 0.2, 0.7]  # how late the host wakes the engine for each step

    async def sleep(seconds: float) -> None:
        await clock.sleep(seconds)
        clock.now += late.pop(0) if late else 0.0

    settings = EngineSettings(0, prefill_tokens_per_s=1000.0, prefill_chunk_tokens=500)
    engine = MockEngine(settings, sleep, clock.time)
    await engine.prefill(prompt("a", 2000))
    # 0.2 s late: the next step is shortened by as much; 0.7 s: by one step's length at most.
    assert clock.sleeps == pytest.approx([0.5, 0.5, 0.3, 0.0])


def test_with_a_reserve_a_tenant_active_lately_keeps_the_flood_behind_it_at_the_engine() -> None:
    # The quiet tenant's request has ended; the flood's next, let in before the quiet one's
    # next arrives, must not share its level: it could still be queued at the engine then.
    admission = Admission(limit=8, queue=0, wait_s=1.0, reserve=2)
    flood = [Ticket("flood") for _ in range(3)]
    quiet = Ticket("quiet")
    for t in (*flood, quiet):
        assert admission.admit_now(t)
    admission.leave(quiet)
    later = Ticket("flood")
    assert admission.admit_now(later) and later.level == 1  # quiet sent within ACTIVE_S
    alone = Admission(limit=8, queue=0, wait_s=1.0)  # no reserve: only what runs counts
    for t in (Ticket("flood"), q := Ticket("quiet")):
        assert alone.admit_now(t)
    alone.leave(q)
    nxt = Ticket("flood")
    assert alone.admit_now(nxt) and nxt.level == 0
