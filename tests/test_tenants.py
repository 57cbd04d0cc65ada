"""Tenant budgets (proxy/tenants/): the GCRA arithmetic, the Redis script against it, budgets
that hold across replicas sharing a real Redis (killed or frozen mid-run: each replica its
share), and the real proxy's 429s as the official `openai` client sees them."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import re
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy.config import TenantsConfig
from proxy.routing.index import open_redis
from proxy.tenants.budgets import Budgets, Grant, Refusal
from proxy.tenants.gcra import ADMIT, CHARGE, PEEK, Limit, duration, headers, readings, step
from proxy.tenants.store import LocalBuckets, RedisBuckets
from tests.routing_support import HAVE_REDIS_SERVER, RedisProcess
from tests.support import ServerThread

REDIS_URL = "redis://127.0.0.1:6379/0"
MODEL = "test-model"


def tenants(**limits: Any) -> TenantsConfig:
    return TenantsConfig.model_validate({"default": limits})


# -- the arithmetic ------------------------------------------------------------------------------


def test_a_limit_per_minute_admits_its_burst_then_one_unit_per_interval() -> None:
    limit = Limit("t", "requests", 60)  # one a second, a minute's worth at once
    tats: list[float | None] = [None]
    now = 100.0
    admitted = 0
    for _ in range(70):
        ok, wait, _, store, _ = step(tats, [limit.interval_s], [1.0], ADMIT, now)
        if ok:
            tats, admitted = [store[0]], admitted + 1
    assert admitted == 60
    ok, wait, refused, _, after = step(tats, [limit.interval_s], [1.0], ADMIT, now)
    assert not ok and refused == 0 and wait == pytest.approx(1.0)
    ok, *_ = step(tats, [limit.interval_s], [1.0], ADMIT, now + 1.0)
    assert ok  # a second later, one more
    [r] = readings([limit], after, now)
    assert (r.remaining, r.reset_s) == (0, pytest.approx(60.0))


def test_a_charge_after_the_fact_is_a_debt_the_next_admissions_wait_out() -> None:
    interval = Limit("t", "output_tokens", 600).interval_s  # 0.1 s a token
    ok, _, _, store, _ = step([None], [interval], [0.0], ADMIT, 0.0)
    assert ok and store == [0.0]  # output: nothing to charge before the answer
    _, _, _, store, _ = step(store, [interval], [900.0], CHARGE, 0.0)  # 900 tokens streamed
    assert store[0] == pytest.approx(90.0)  # half a minute past the window
    ok, wait, *_ = step(store, [interval], [0.0], ADMIT, 0.0)
    assert not ok and wait == pytest.approx(30.1)  # until one token is free again
    _, _, _, store, _ = step(store, [interval], [-900.0], CHARGE, 0.0)  # an estimate undone
    assert store == [0.0]


def test_all_or_nothing_over_several_limits_and_the_longest_wait_wins() -> None:
    intervals = [1.0, 0.01]
    tats: list[float | None] = [59.0, 0.0]  # requests: one left; tokens: all
    ok, wait, refused, store, _ = step(tats, intervals, [1.0, 7000.0], ADMIT, 0.0)
    assert not ok and refused == 1 and wait == pytest.approx(10.0)
    assert store == [59.0, 0.0]  # nothing taken from the request limit either
    ok, _, _, store, _ = step(tats, intervals, [1.0, 100.0], PEEK, 0.0)
    assert store == [59.0, 0.0]


def test_reset_times_are_written_as_openai_writes_them() -> None:
    assert [duration(s) for s in (0, 0.0165, 1, 1.04, 59.95, 60, 90.5, 360)] == [
        "0s", "17ms", "1s", "1.1s", "1m0s", "1m0s", "1m30.5s", "6m0s",
    ]  # fmt: skip


def test_the_headers_name_the_tightest_request_and_token_limits() -> None:
    found = readings(
        [Limit("t", "requests", 100), Limit("t", "input_tokens", 1000), Limit("t", "tokens", 50)],
        [30.0, 0.0, 12.0],
        0.0,
    )
    assert dict(headers(found)) == {
        b"x-ratelimit-limit-requests": b"100",
        b"x-ratelimit-remaining-requests": b"50",
        b"x-ratelimit-reset-requests": b"30s",
        b"x-ratelimit-limit-tokens": b"50",  # 40 left of 50 is fewer than 1000 of 1000
        b"x-ratelimit-remaining-tokens": b"40",
        b"x-ratelimit-reset-tokens": b"12s",
    }


# -- Redis: the script is the arithmetic ---------------------------------------------------------


@pytest.fixture
async def redis() -> AsyncIterator[Any]:
    client = open_redis(REDIS_URL, timeout_s=1.0)
    prefix = f"wrtest-{uuid.uuid4().hex[:8]}"
    client.test_prefix = prefix
    yield client
    keys = [k async for k in client.scan_iter(match=f"{{{prefix}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def test_the_redis_script_decides_as_the_local_arithmetic(redis: Any) -> None:
    """Whole-unit costs on limits of one a second: the moments between calls (well under a
    second) move no decision and no count, so Redis's clock and a frozen one agree."""
    limits = [Limit("t", "requests", 60), Limit("t", "tokens", 60), Limit("t", "output_tokens", 60)]
    shared = RedisBuckets(redis, redis.test_prefix, "r1")
    local = LocalBuckets()
    rng = random.Random(7)
    for _ in range(120):
        mode = rng.choice([ADMIT, ADMIT, CHARGE, PEEK])
        costs = [float(rng.randint(-3 if mode == CHARGE else 0, 9)) for _ in limits]
        a = await shared.call(limits, costs, mode)
        b = local.call(limits, costs, mode, 1000.0)
        assert (a.ok, a.refused_by) == (b.ok, b.refused_by)
        assert [r.remaining for r in a.readings] == [r.remaining for r in b.readings]
        if not a.ok:
            assert a.wait_s == pytest.approx(b.wait_s, abs=0.5)


def budgets_for(redis: Any, replica: str, config: TenantsConfig, **kw: Any) -> Budgets:
    return Budgets(config, redis=redis, key_prefix=redis.test_prefix, replica=replica, **kw)


async def test_three_replicas_sharing_redis_admit_the_limit_between_them(redis: Any) -> None:
    """30 a minute (one each 2 s), 90 requests spread over three replicas whose own clocks
    are a second apart: 30 admitted in all, and each refusal says when to come back."""
    config = tenants(requests_per_minute=30)
    skews = (-1.0, 0.0, 1.0)
    replicas = [
        budgets_for(redis, f"r{i}", config, timeout_s=1.0, clock=lambda s=s: 1e9 + s)
        for i, s in enumerate(skews)
    ]
    results = await asyncio.gather(
        *(replicas[i % 3].admit("default", MODEL, b"{}") for i in range(90))
    )
    admitted = [r for r in results if isinstance(r, Grant)]
    refused = [r for r in results if isinstance(r, Refusal)]
    assert len(admitted) == 30 and len(refused) == 60
    assert all(r.kind == "requests" and 0 < (r.retry_after_s or 0) <= 2.0 for r in refused)
    assert {b.live_replicas for b in replicas} <= {1, 2, 3}
    await replicas[0].admit("default", MODEL, b"{}")
    assert replicas[0].live_replicas == 3


async def test_tokens_are_charged_as_estimated_then_settled_from_the_engines_usage(
    redis: Any,
) -> None:
    config = tenants(input_tokens_per_minute=1000, output_tokens_per_minute=600)
    b = budgets_for(redis, "r1", config, timeout_s=1.0)
    grant = await b.admit("default", MODEL, b"x" * 400)  # about 100 tokens
    assert isinstance(grant, Grant) and grant.input_estimate == 100
    seen = [0]
    b.streaming(grant, lambda: seen[0])
    seen[0] = 250
    await b.charge_live()  # the stream's output so far
    left = {r.limit.kind: r.remaining for r in (await b.peek("default")).readings}  # type: ignore[union-attr]
    assert left == {"input_tokens": 900, "output_tokens": 350}
    seen[0] = 400
    await b.settle(grant, input_tokens=40, output_tokens=None)  # usage without output: seen
    left = {r.limit.kind: r.remaining for r in (await b.peek("default")).readings}  # type: ignore[union-attr]
    assert left == {"input_tokens": 960, "output_tokens": 200}
    assert (b.stats["default"].input_tokens, b.stats["default"].output_tokens) == (40, 400)
    assert not b.live


async def test_a_request_larger_than_a_whole_minute_is_refused_without_retry_after(
    redis: Any,
) -> None:
    b = budgets_for(redis, "r1", tenants(input_tokens_per_minute=50), timeout_s=1.0)
    refusal = await b.admit("default", MODEL, b"x" * 400)
    assert isinstance(refusal, Refusal) and refusal.retry_after_s is None
    assert "Request too large" in refusal.message and "limit 50" in refusal.message


async def test_concurrency_cap_per_replica() -> None:
    b = Budgets(tenants(max_concurrent=2))
    grants = [await b.admit("default", MODEL, b"{}") for _ in range(3)]
    assert [type(g).__name__ for g in grants] == ["Grant", "Grant", "Refusal"]
    assert isinstance(grants[2], Refusal) and grants[2].kind == "concurrency"
    assert isinstance(grants[0], Grant)
    await b.settle(grants[0], None, 0)
    assert isinstance(await b.admit("default", MODEL, b"{}"), Grant)


# -- Redis away: each replica its share, no failure -----------------------------------------------


@pytest.fixture
def private(tmp_path: Path) -> Iterator[RedisProcess]:
    """A redis-server of this test's own, to kill or freeze."""
    if not HAVE_REDIS_SERVER:
        pytest.skip("redis-server binary not installed")
    server = RedisProcess(tmp_path).start()
    yield server
    server.stop()


@pytest.mark.e2e
@pytest.mark.redis
@pytest.mark.parametrize("failure", ["killed", "frozen"])
async def test_with_redis_away_each_replica_enforces_its_share_and_nothing_fails(
    private: RedisProcess, failure: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = tenants(requests_per_minute=30)
    clients = [open_redis(private.url, timeout_s=0.2) for _ in range(3)]
    replicas = [
        Budgets(config, redis=c, key_prefix="wr", replica=f"r{i}", timeout_s=0.2)
        for i, c in enumerate(clients)
    ]
    for b in replicas:
        assert isinstance(await b.admit("default", MODEL, b"{}"), Grant)
    await replicas[0].admit("default", MODEL, b"{}")
    assert all(b.shared for b in replicas)
    if failure == "killed":
        private.stop()
    else:  # Redis answers nothing for longer than the run
        private.client().execute_command("CLIENT", "PAUSE", "10000", "ALL")
    results = [await replicas[i % 3].admit("default", MODEL, b"{}") for i in range(60)]
    admitted = sum(isinstance(r, Grant) for r in results)
    # Each replica alone: a third of 30 (those that saw 3 live replicas), or a half or all
    # of it for those that saw fewer; never a failure, never more than the sum of shares.
    shares = sum(30 // b.live_replicas for b in replicas)
    assert admitted == shares
    assert not any(b.shared for b in replicas)
    assert "enforces its share" in caplog.text
    view = replicas[0].view()
    assert view["budgets"] == "local share" and view["redis_failures"] >= 1
    for c in clients:
        with contextlib.suppress(Exception):
            await c.aclose()


# -- the real proxy --------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow  # the client's retry waits out the budget's refill: ~5 s
def test_the_official_client_backs_off_on_429_and_its_retry_gets_through(
    fake_backends: Any, proxy_server: Callable[..., ServerThread]
) -> None:
    """An input budget of 1,200 tokens a minute (one each 50 ms): a few requests use it up;
    the next is refused with OpenAI's headers, and the client's own retry, after
    retry-after-ms, succeeds."""
    [(_, backend)] = fake_backends(1)
    prefix = f"wrtest-{uuid.uuid4().hex[:8]}"
    config = {
        "tenants": {"default": {"input_tokens_per_minute": 1200}},
        "redis": {"url": REDIS_URL, "key_prefix": prefix},
    }
    proxy = proxy_server([backend.url], config)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "y" * 1400}]}  # ~370
    statuses: list[int] = []
    first = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=10)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-tokens"] == "1200"
    assert 0 < int(first.headers["x-ratelimit-remaining-tokens"]) < 1200
    assert first.headers["x-ratelimit-reset-tokens"].endswith("s")
    while True:  # spend the rest of the minute's budget
        r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=10)
        if r.status_code != 200:
            break
    assert r.status_code == 429
    error = r.json()["error"]
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "tokens")
    assert "input tokens per minute" in error["message"] and "limit 1200" in error["message"]
    wait_ms = int(r.headers["retry-after-ms"])
    assert 0 < wait_ms <= 60_000 and int(r.headers["retry-after"]) == -(-wait_ms // 1000)
    assert int(r.headers["x-ratelimit-remaining-tokens"]) < 370  # less than one request

    hooks = {"response": [lambda resp: statuses.append(resp.status_code)]}
    with httpx.Client(event_hooks=hooks) as http:
        client = openai.OpenAI(
            base_url=proxy.url + "/v1", api_key="unused", max_retries=3, http_client=http
        )
        reply = client.chat.completions.create(model=MODEL, messages=body["messages"])
    assert reply.choices[0].message.content
    assert statuses[0] == 429 and statuses[-1] == 200  # refused, waited, admitted

    view = httpx.get(proxy.url + "/admin/tenants", timeout=10).json()
    assert view["budgets"] == "redis"
    default = view["tenants"]["default"]
    assert default["refused_here"]["tokens"] >= 2
    assert default["input_tokens_here"] > 0  # the engine's own counts, once settled
    [limit] = default["limits"]
    assert limit["limit"] == "input_tokens_per_minute" and limit["per_minute"] == 1200
    metrics = httpx.get(proxy.url + "/metrics", timeout=10).text
    refused = r'warmroute_tenant_requests_total\{[^}]*outcome="refused_tokens"[^}]*\} (\d+)'
    found = re.search(refused, metrics)
    assert found and int(found.group(1)) == default["refused_here"]["tokens"]
    assert re.search(r"warmroute_tenant_budgets_shared\{[^}]*\} 1", metrics)
    charged = r'warmroute_tenant_tokens_total\{[^}]*direction="input"[^}]*\} (\d+)'
    found = re.search(charged, metrics)
    assert found and int(found.group(1)) == default["input_tokens_here"]


@pytest.mark.e2e
def test_a_streamed_answer_is_charged_its_output_and_unlimited_tenants_see_no_headers(
    fake_backends: Any, proxy_server: Callable[..., ServerThread]
) -> None:
    [(_, backend)] = fake_backends(1)
    keys = [
        {"name": "team-a", "sha256": hashlib.sha256(b"key-a").hexdigest()},
        {"name": "team-b", "sha256": hashlib.sha256(b"key-b").hexdigest()},
    ]
    config = {
        "server": {"api_keys": keys},
        "tenants": {"keys": {"team-a": {"output_tokens_per_minute": 6000}}},
    }
    proxy = proxy_server([backend.url], config)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="key-a", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "chunks:12"}], stream=True
    )
    text = "".join((c.choices[0].delta.content or "") for c in stream if c.choices)
    assert text
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 6000
    other = openai.OpenAI(base_url=proxy.url + "/v1", api_key="key-b", max_retries=0)
    raw_b = other.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    assert "x-ratelimit-remaining-tokens" not in raw_b.headers  # team-b has no limits
    view = httpx.get(proxy.url + "/admin/tenants", timeout=10).json()
    assert view["budgets"] == "local"  # no Redis configured: this replica alone
    a = view["tenants"]["team-a"]
    assert a["output_tokens_here"] >= 12 and a["inflight_here"] == 0
    [limit] = a["limits"]
    # what was charged, less what came back since (100 tokens a second)
    assert 6000 - a["output_tokens_here"] <= limit["remaining"] < 6000


async def test_running_streams_of_one_tenant_are_charged_in_one_call() -> None:
    b = Budgets(tenants(output_tokens_per_minute=6000))
    grants = [await b.admit("default", MODEL, b"{}") for _ in range(3)]
    seen = [10, 20, 30]
    for g, i in zip(grants, range(3), strict=True):
        assert isinstance(g, Grant)
        b.streaming(g, lambda i=i: seen[i])
    calls: list[Any] = []
    real = b.local.call

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(args[1])
        return real(*args, **kw)

    b.local.call = counted  # type: ignore[method-assign]
    await b.charge_live()
    assert calls == [[60.0]]  # one charge of the three streams' 60 tokens
    assert b.stats["default"].output_tokens == 60
    b.local.forget_idle(b.clock() + 3600)  # an hour on, every bucket is full again
    assert b.local.tats == {}
