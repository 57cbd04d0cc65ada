"""Engine load signals and KV pool size reach routing from the engines' own /metrics."""

from __future__ import annotations

import time

import httpx
import pytest

from proxy.config import BackendConfig
from proxy.routing.types import EngineLoad
from proxy.sim import SimConfig, create_sim_app
from proxy.upstream.backends import Backend, parse_load, scrape_due
from tests.support import ServerThread, until

VLLM = """# HELP vllm:num_requests_waiting x
vllm:num_requests_waiting{model_name="m"} 3.0
vllm:num_requests_running{model_name="m"} 5.0
vllm:kv_cache_usage_perc{model_name="m"} 0.5
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="2000"} 1.0
"""


def test_vllm_gauges_and_pool_size_are_parsed():
    load = parse_load("vllm", VLLM, now=1.0)
    assert load is not None
    assert (load.waiting, load.running, load.kv_usage, load.kv_tokens) == (3.0, 5.0, 0.5, 32000)


def test_sglang_and_llamacpp_names():
    sg = parse_load("sglang", 'sglang:num_queue_reqs{a="b"} 4\nsglang:token_usage 0.25\n', 0)
    assert sg is not None and (sg.waiting, sg.kv_usage) == (4.0, 0.25)
    lc = parse_load("llamacpp", "llamacpp:requests_deferred 1\nllamacpp:requests_processing 2\n", 0)
    assert lc is not None and (lc.waiting, lc.running) == (1.0, 2.0)
    assert parse_load("openai", VLLM, 0) is None


@pytest.mark.e2e
def test_the_prefix_index_is_bounded_by_the_engines_kv_pool(proxy_server):
    sim = create_sim_app(SimConfig.from_preset("h100", kv_blocks=512, time_scale=50))
    with ServerThread(sim, **sim.uvicorn_kwargs()) as engine:
        proxy = proxy_server(
            [engine.url],
            config={
                "backends": [{"url": engine.url, "engine": "vllm"}],
                "health": {"metrics_scrape_s": 0.1, "interval_s": 0.2},
            },
        )
        name = engine.url.removeprefix("http://")
        deadline = time.monotonic() + 10
        while True:
            info = httpx.get(proxy.url + "/admin/routing").json()
            capacity = info["index"].get("capacity", {}).get(name)
            if capacity is not None:
                break
            assert time.monotonic() < deadline, info
            time.sleep(0.05)
        # 512 blocks x 16 tokens x ~4 chars / 64-char index blocks.
        assert capacity == 512 * 16 * 4 // 64
        load = httpx.get(proxy.url + "/admin/backends").json()["backends"][0]["load"]
        assert load["kv_usage"] is not None and load["waiting"] == 0
        # A routed request leaves its prompt in the router's prefill backlog for that engine.
        body = {
            "model": "sim-8b",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "x" * 4000}],
        }
        assert (
            httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=10).status_code == 200
        )
        routing = httpx.get(proxy.url + "/admin/routing").json()
        assert name in routing["backlog_tokens"] and routing["backlog_tokens"][name] >= 0


def test_a_sample_timestamp_is_not_read_as_its_value() -> None:
    text = (
        "vllm:num_requests_waiting 3 1700000000000\n"
        'vllm:num_requests_running{model_name="m"} 2 1700000000000\n'
        "vllm:kv_cache_usage_perc 0.5\n"
    )
    load = parse_load("vllm", text, now=1.0)
    assert load is not None
    assert (load.waiting, load.running, load.kv_usage) == (3.0, 2.0, 0.5)


def test_an_idle_engine_is_scraped_with_its_health_check_a_busy_one_between_them() -> None:
    b = Backend(BackendConfig(url="http://127.0.0.1:9"))
    seen = b.attached
    assert not scrape_due(b, seen, checked=False)  # idle: nothing to follow
    assert scrape_due(b, seen, checked=True)  # with its health check
    b.attach("r1")
    assert scrape_due(b, seen, checked=False)  # a request on it
    b.detach("r1")
    assert scrape_due(b, seen, checked=False)  # one was routed to it since the last scrape
    seen = b.attached
    assert not scrape_due(b, seen, checked=False)
    b.load = EngineLoad(waiting=0.0, running=2.0, scraped_at=1.0)  # other replicas' traffic
    assert scrape_due(b, seen, checked=False)
    b.load = EngineLoad(waiting=0.0, running=0.0, scraped_at=2.0)
    assert not scrape_due(b, seen, checked=False)


@pytest.mark.e2e
def test_an_idle_fleet_is_scraped_no_more_often_than_its_health_is_checked(proxy_server):
    """The background cost of idle engines: one scrape per health check, not one per scrape
    interval (here 20 scrape intervals fit in one health interval; the idle interval is
    brought down to it to count checks: tests/test_backends_idle.py has the idle cadence)."""
    hits = {"/health": 0, "/metrics": 0}

    async def engine(scope, receive, send):  # an idle vLLM: no requests waiting or running
        if scope["type"] != "http":
            return
        path = scope["path"]
        hits[path] = hits.get(path, 0) + 1
        body = b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n"
        if path == "/v1/models":
            body = b'{"data": [{"id": "test-model"}]}'
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    with ServerThread(engine) as e:
        proxy_server(
            [e.url],
            config={
                "backends": [{"url": e.url, "engine": "vllm"}],
                "health": {"metrics_scrape_s": 0.01, "interval_s": 0.2, "idle_interval_s": 0.2},
            },
        )
        until(lambda: hits["/health"] >= 2, "two health checks")
        base = (hits["/health"], hits["/metrics"])
        until(lambda: hits["/health"] >= base[0] + 3, "three more health checks")
        checks, scrapes = hits["/health"] - base[0], hits["/metrics"] - base[1]
        assert scrapes <= checks + 1, (checks, scrapes)
