"""Active checks proportional to need: an idle healthy engine is checked at the idle interval
(stretched by the fleet-wide cap), one with traffic at the health interval, and a request
sent to an idle one brings it back at once (proxy/upstream/backends.py check_interval, _poll)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import httpx
import pytest

from proxy.bench.mock import MockBackend
from proxy.config import BackendConfig, HealthConfig, load_config
from proxy.routing.types import EngineLoad
from proxy.upstream import backends
from proxy.upstream.backends import Backend, BackendRegistry, check_interval, has_work
from tests.support import ServerThread, eventually, until

H = HealthConfig()  # interval 5 s, idle 60 s, 1 idle check a second, scrapes every 2 s


def interval(
    healthy: bool = True,
    busy: bool = False,
    ejected: bool = False,
    idle: int = 1,
    h: HealthConfig = H,
) -> float:
    return check_interval(h, healthy=healthy, busy=busy, ejected=ejected, idle_backends=idle)


def test_an_idle_healthy_backend_waits_the_idle_interval_one_with_work_the_health_one() -> None:
    assert interval() == 60.0
    assert interval(busy=True) == 5.0
    assert interval(ejected=True) == 5.0  # its breaker is open: watched, though idle
    assert interval(healthy=False) == 2.0  # to see it come back: as often as scrapes
    assert interval(healthy=False, busy=True, ejected=True) == 2.0


def test_the_fleet_wide_cap_stretches_the_idle_interval_and_nothing_else() -> None:
    assert interval(idle=60) == 60.0  # 60 engines at 1 a second: 60 s, the floor
    assert interval(idle=256) == 256.0
    four = HealthConfig(idle_checks_per_s=4)
    assert interval(idle=240, h=four) == 60.0
    assert interval(idle=1024, h=four) == 256.0  # 1,024 idle engines cost what 240 do
    assert interval(busy=True, idle=1024) == 5.0
    assert interval(ejected=True, idle=1024) == 5.0
    assert interval(healthy=False, idle=1024) == 2.0


def test_an_idle_interval_below_the_health_interval_is_the_health_interval() -> None:
    h = HealthConfig(interval_s=120, idle_interval_s=60)  # a fleet that set interval_s high
    assert check_interval(h, healthy=True, busy=False, ejected=False, idle_backends=1) == 120


@pytest.mark.parametrize(
    "key", ["idle_interval_s", "idle_checks_per_s", "interval_s", "models_refresh_s"]
)
def test_the_intervals_and_the_cap_are_positive(key: str) -> None:
    with pytest.raises(ValueError, match=key):
        HealthConfig.model_validate({key: 0})


def test_traffic_is_a_request_since_the_last_scrape_one_on_it_or_load_reported() -> None:
    b = Backend(BackendConfig(url="http://127.0.0.1:9"))
    seen = b.attached
    assert not has_work(b, seen)
    b.attach("r1")
    assert has_work(b, seen) and b._wake.is_set()  # what wakes an idle backend's task
    b.detach("r1")
    assert has_work(b, seen)  # routed since the last scrape
    assert not has_work(b, b.attached)
    b.load = EngineLoad(waiting=1.0, running=0.0, scraped_at=1.0)  # other replicas' traffic
    assert has_work(b, b.attached)


async def test_idle_backends_are_counted_kept_apart_and_forgotten_with_their_record() -> None:
    """Membership through the registry: the idle count (the fleet-wide cap's) follows adds
    and removals, and a backend set back to joining (resumed while unhealthy) wakes its task,
    which joins it again, instead of sleeping out its idle interval."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(200, text="vllm:num_requests_running 0\n")

    urls = [f"http://127.0.0.1:{p}#engine=vllm" for p in (1, 2)]
    env = {
        "WARMROUTE_HEALTH__IDLE_INTERVAL_S": "3600",
        "WARMROUTE_HEALTH__METRICS_SCRAPE_S": "0.01",
    }
    cfg = load_config(flags={"backends": urls}, env=env)
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        registry = BackendRegistry(cfg, http)
        joined: list[str] = []
        registry.on_serving = lambda b: joined.append(b.name)
        await registry.start()
        try:
            both = {"127.0.0.1:1", "127.0.0.1:2"}
            await eventually(lambda: registry._idle == both, "both backends idle")
            b = registry["127.0.0.1:1"]
            b.healthy = False  # as the reconciler finds it on resume
            b.set_state("joining")
            await eventually(lambda: joined == ["127.0.0.1:1"], "joined again")
            assert b.state == "serving" and b.healthy
            await eventually(lambda: registry._idle == both, "idle again")
            registry.add(BackendConfig(url="http://127.0.0.1:3", engine="vllm"), "admin")
            await eventually(lambda: len(registry._idle) == 3, "the added backend idle")
            registry.remove("127.0.0.1:2")
            assert registry._idle == {"127.0.0.1:1", "127.0.0.1:3"}
        finally:
            await registry.close()
        assert not registry._idle and not registry._tasks


class Engine:
    """A mock vLLM that counts the GETs it answers per path and reports `running` requests in
    its /metrics as the test sets them (an engine busy with other replicas' traffic)."""

    def __init__(self, model: str, running: int = 0) -> None:
        self.app = MockBackend(chunks=2, model=model)
        self.running = running
        self.gets: Counter[str] = Counter()
        self.idle_scrapes = 0  # /metrics answered with nothing running
        self.lock = threading.Lock()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            path = scope["path"]
            with self.lock:
                self.gets[path] += 1
                if path == "/metrics" and not self.running:
                    self.idle_scrapes += 1
            if path == "/metrics":
                body = f"vllm:num_requests_running {self.running}\nvllm:num_requests_waiting 0\n"
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": body.encode()})
                return
        await self.app(scope, receive, send)

    def checks(self) -> int:
        with self.lock:
            return self.gets["/health"]


@pytest.mark.e2e
def test_an_idle_engine_is_left_alone_until_a_request_brings_it_back(
    proxy_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines behind one proxy: `busy` reports work (other replicas' traffic) and is
    checked at the health interval, which is the clock here; `idle` reports none and, with an
    idle interval of an hour, is not checked again while `busy` is checked 20 times. A
    request for its model brings it back to the health interval at once; once it reports no
    work again, it is left alone again."""
    monkeypatch.setattr(backends, "JITTER", lambda: 1.0)  # first checks at their interval's end
    busy, idle = Engine("busy-model", running=1), Engine("idle-model")
    with ServerThread(busy) as b, ServerThread(idle) as i:
        proxy = proxy_server(
            [b.url, i.url],
            config={
                "backends": [
                    {"url": b.url, "engine": "vllm", "models": ["busy-model"]},
                    {"url": i.url, "engine": "vllm", "models": ["idle-model"]},
                ],
                "health": {"interval_s": 0.05, "metrics_scrape_s": 0.05, "idle_interval_s": 3600},
            },
        )

        def quiet_for_20_busy_checks() -> None:
            """`idle` gets no check while `busy` gets 20 (its last scrape said it is idle: the
            round that scraped it is over, and its task sleeps)."""
            before, clock = idle.checks(), busy.checks()
            until(lambda: busy.checks() >= clock + 20, "20 health checks of the busy engine")
            assert idle.checks() == before, (idle.gets, busy.gets)

        until(lambda: idle.idle_scrapes >= 1, "the idle engine's first scrape")
        quiet_for_20_busy_checks()

        idle.running = 1  # from the request on: an engine working on it says so
        r = httpx.post(
            proxy.url + "/v1/chat/completions",
            json={"model": "idle-model", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert r.status_code == 200, r.text
        at_request = idle.checks()
        # Ten checks within what the idle interval allows once an hour: the health interval.
        until(lambda: idle.checks() >= at_request + 10, "the busy cadence on the idle engine")

        scrapes = idle.idle_scrapes
        idle.running = 0  # done: the next scrape says so and it goes back to the idle cadence
        until(lambda: idle.idle_scrapes > scrapes, "a scrape of the engine, idle again")
        quiet_for_20_busy_checks()
