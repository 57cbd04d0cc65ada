"""The engine (and role) of a backend without YAML: said in its URL, or read off its /metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from proxy.config import ConfigError, load_config
from proxy.engines import engine_from_metrics, parse_backend_url, split_backend_list
from proxy.sim.config import SimConfig
from proxy.sim.server import create_sim_app
from proxy.upstream.backends import BackendRegistry
from tests.support import ServerThread


def test_a_backend_list_splits_at_each_new_url_and_keeps_commas_inside_options() -> None:
    assert split_backend_list("http://a:1, http://b:2") == ["http://a:1", "http://b:2"]
    assert split_backend_list("http://a:1#engine=vllm,role=prefill,https://b:2#engine=sglang") == [
        "http://a:1#engine=vllm,role=prefill",
        "https://b:2#engine=sglang",
    ]


def test_url_options_are_key_value_pairs_with_known_keys() -> None:
    assert parse_backend_url("http://h:8000#engine=vllm,role=decode,name=gpu-1,weight=2") == {
        "url": "http://h:8000",
        "engine": "vllm",
        "role": "decode",
        "name": "gpu-1",
        "weight": "2",
    }
    assert parse_backend_url("http://h:8000") == {"url": "http://h:8000"}
    for bad in ("http://h:8000#vllm", "http://h:8000#gpu=2", "http://h:8000#engine="):
        with pytest.raises(ValueError, match="key=value separated by commas"):
            parse_backend_url(bad)


def test_an_sglang_prefill_engines_bootstrap_port_can_be_said_in_its_url() -> None:
    url = "http://p:30000#engine=sglang,role=prefill,bootstrap_port=8998"
    assert parse_backend_url(url)["bootstrap_port"] == 8998
    [p] = load_config(flags={"backends": [url]}, env={}).backends
    assert (p.engine, p.role, p.bootstrap_port) == ("sglang", "prefill", 8998)
    env = {"WARMROUTE_BACKENDS": url + ",http://d:30000#engine=sglang,role=decode"}
    assert [b.bootstrap_port for b in load_config(env=env).backends] == [8998, None]


@pytest.mark.parametrize("bad", ["x", "0", "65536", "-1", "89.5", "²", "0x22"])
def test_a_bootstrap_port_that_is_not_a_port_names_the_option_and_its_range(bad: str) -> None:
    url = f"http://p:30000#bootstrap_port={bad}"
    with pytest.raises(ValueError, match="bootstrap_port is the SGLang prefill engine's"):
        parse_backend_url(url)
    with pytest.raises(ConfigError, match=r"backends\.0.*from 1 to 65535"):
        load_config(flags={"backends": [url]}, env={})


def test_env_flags_and_yaml_all_take_the_url_form(tmp_path: Path) -> None:
    env = {"WARMROUTE_BACKENDS": "http://a:8000#engine=vllm,role=prefill,http://b:8000"}
    a, b = load_config(env=env).backends
    assert (a.url, a.engine, a.role) == ("http://a:8000", "vllm", "prefill")
    assert (b.url, b.engine, b.role) == ("http://b:8000", "auto", "mixed")  # detected later
    [c] = load_config(flags={"backends": ["http://c:1#engine=llamacpp,name=cpu"]}, env={}).backends
    assert (c.engine, c.key) == ("llamacpp", "cpu")
    file = tmp_path / "w.yaml"
    file.write_text("backends:\n  - url: http://d:1#engine=sglang\n")
    assert load_config(file, env={}).backends[0].engine == "sglang"


def test_a_wrong_url_option_names_the_backend_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"backends\.0.*key=value"):
        load_config(flags={"backends": ["http://a:1#engine"]}, env={})
    with pytest.raises(ConfigError, match=r"backends\.0\.engine"):
        load_config(flags={"backends": ["http://a:1#engine=tgi"]}, env={})
    file = tmp_path / "w.yaml"
    file.write_text("backends:\n  - {url: 'http://d:1#engine=sglang', engine: vllm}\n")
    with pytest.raises(ConfigError, match="engine given both in the URL and as a key"):
        load_config(file, env={})


VLLM = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
"""


def test_an_engine_is_known_by_its_metric_names() -> None:
    assert engine_from_metrics(VLLM) == "vllm"
    assert engine_from_metrics('sglang:num_queue_reqs{model_name="m"} 1\n') == "sglang"
    assert engine_from_metrics("llamacpp:requests_processing 0\n") == "llamacpp"
    assert engine_from_metrics("process_cpu_seconds_total 1.5\n") is None
    assert engine_from_metrics("# HELP vllm:x only a comment\n") is None
    assert engine_from_metrics("") is None


def _registry(url: str, transport: httpx.AsyncBaseTransport | None = None) -> BackendRegistry:
    config = load_config(flags={"backends": [url]}, env={})
    return BackendRegistry(config, httpx.AsyncClient(transport=transport))


@pytest.mark.parametrize(
    ("answer", "engine"),
    [
        (httpx.Response(200, text=VLLM), "vllm"),
        (httpx.Response(200, text="up 1\n"), "openai"),  # metrics, none of an engine's
        (httpx.Response(404, text="not found"), "openai"),  # a plain OpenAI-compatible server
        (httpx.Response(503, text="loading"), "auto"),  # an engine still starting: ask again
    ],
)
async def test_a_backend_of_unsaid_engine_is_settled_by_its_metrics(
    answer: httpx.Response, engine: str
) -> None:
    registry = _registry("http://gpu:8000", httpx.MockTransport(lambda request: answer))
    [backend] = registry.backends.values()
    await registry._scrape(backend)
    assert backend.cfg.engine == engine


async def test_an_unreachable_backend_stays_undetected() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    registry = _registry("http://gpu:8000", httpx.MockTransport(refuse))
    [backend] = registry.backends.values()
    await registry._scrape(backend)
    assert backend.cfg.engine == "auto"


@pytest.mark.e2e
async def test_a_simulated_engine_is_detected_as_vllm_and_its_gauges_scraped() -> None:
    """What the compose stack relies on: sims listed by URL alone get their gauges scraped."""
    sim = create_sim_app(SimConfig.from_preset("h100", kv_blocks=256, time_scale=10))
    with ServerThread(sim, **sim.uvicorn_kwargs()) as server:
        config = load_config(
            flags={"backends": [server.url]}, env={"WARMROUTE_HEALTH__METRICS_SCRAPE_S": "0.05"}
        )
        async with httpx.AsyncClient() as http:
            registry = BackendRegistry(config, http)
            scraped = asyncio.Event()  # the sim publishes its KV pool: the gauges were read
            registry.on_kv_capacity = lambda name, tokens: scraped.set()
            await registry.start()
            try:
                [backend] = registry.backends.values()
                await asyncio.wait_for(scraped.wait(), 10)
            finally:
                await registry.close()
    assert backend.cfg.engine == "vllm"
    assert backend.load.running is not None and backend.load.kv_usage is not None
