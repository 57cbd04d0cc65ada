"""The doctor's report as machines read it: the JSON schema (tests/schemas/, documented in
docs/doctor.md) holds for Report.as_dict() and for a live GET /admin/doctor, the findings
metric carries a seeded pathology, and `warmroute doctor` prints the live report."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from proxy.bench.workloads import make_workload
from proxy.cli import main
from proxy.config import load_config
from proxy.doctor import FINDING_IDS, SCHEMA, diagnose
from proxy.doctor.model import TenantRequest
from proxy.doctor.report import MEASUREMENT_KEYS
from proxy.doctor.virtual import VirtualRecorder
from proxy.harness.virtual import run_virtual
from proxy.server.app import create_app
from proxy.server.serve import NoDelayHttpToolsProtocol
from proxy.sim.config import SimConfig
from proxy.sim.server import create_sim_app
from tests.support import ServerThread, free_port
from tests.test_doctor_diagnose import gauges, healthy_requests, interference, req, window

SCHEMA_FILE = Path(__file__).resolve().parent / "schemas" / "doctor-report.schema.json"
VALIDATOR = jsonschema.Draft202012Validator(json.loads(SCHEMA_FILE.read_text()))
TOKEN = "doctor-admin-token"


def errors(doc: Any) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(doc)
    ]


def test_the_schema_is_valid_and_names_what_the_code_emits() -> None:
    schema = VALIDATOR.schema
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["properties"]["schema"]["const"] == SCHEMA
    assert schema["$defs"]["finding_id"]["enum"] == list(FINDING_IDS)
    measurements = schema["$defs"]["backend"]["properties"]["measurements"]
    assert measurements["required"] == list(MEASUREMENT_KEYS)
    per_finding = [
        c["if"]["properties"]["id"]["const"] for c in schema["$defs"]["finding"]["allOf"]
    ]
    assert per_finding == list(FINDING_IDS)


def crowded_tenants() -> list[TenantRequest]:
    """A flood with most of the tokens, two others waiting 0.3 s for their slots."""
    flood = [TenantRequest(i * 0.1, "flood", 0.9, 4000) for i in range(30)]
    return flood + [TenantRequest(i * 0.5, f"quiet-{i % 2}", 0.3, 500) for i in range(10)]


def every_finding() -> dict[str, Any]:
    """One report holding every finding: one backend each from hand-built windows, and the
    admission queue's from a flood of keyed requests."""
    from proxy.doctor.hardware import declared
    from tests.test_doctor_diagnose import sequential

    h100, cpu = declared("h100", "8b"), declared("cpu-ddr5", "8b")
    assert h100 is not None and cpu is not None
    slow = [req(i * 0.5, upstream=0.8) for i in range(25)]
    windows = [
        window(slow, gauges=gauges(waiting=6, kv_usage=0.99, queue_s=0.7, prefill_s=0.1)),
        window(slow, gauges=gauges(waiting=3, queue_s=0.6, prefill_s=0.2)),
        window(
            [
                req(
                    i,
                    upstream=0.45,
                    input_tokens=4000,
                    cached=100,
                    predicted=0,
                    seen=4000,
                    prefill_s=0.39,
                )
                for i in range(20)
            ],
            engine="llamacpp",
        ),
        window(
            [
                req(
                    i,
                    upstream=0.04,
                    input_tokens=4000,
                    cached=500,
                    predicted=3000,
                    seen=3000,
                    prefill_s=0.035,
                )
                for i in range(20)
            ],
            engine="llamacpp",
        ),
        window(
            interference(),
            engine="llamacpp",
            disagg={"mode": "auto", "active": False, "reason": "too little traffic"},
        ),
        window(sequential(lambda c: 0.005 + 1e-7 * c, range(10_000, 100_001, 10_000))),
        window(
            sequential(lambda c: 3 * h100.step_s(c), [100, 120, 140, 160, 180], 40), hardware=h100
        ),
        window(
            sequential(lambda c: 1.1 * cpu.step_s(c), [100, 120, 140, 160, 180], 40), hardware=cpu
        ),
    ]
    for i, w in enumerate(windows):
        w.backend = f"10.0.0.{i + 1}:8000"
    report = diagnose(
        windows,
        window_s=300.0,
        generated_at="2025-06-01T12:00:00+00:00",
        tenants=crowded_tenants(),
    )
    assert [f.id for f in report.findings] == list(FINDING_IDS)
    return report.as_dict()


def test_every_finding_and_every_empty_case_validates() -> None:
    assert errors(every_finding()) == []
    assert errors(diagnose([]).as_dict()) == []
    empty = window([])
    one = window([req(0.0)], engine="openai")
    assert errors(diagnose([empty, one], window_s=60.0).as_dict()) == []
    quiet = window(healthy_requests(), engine="openai")
    assert errors(diagnose([quiet]).as_dict()) == []


async def test_a_virtual_fleets_report_validates() -> None:
    wl = make_workload("chat-docs", seed=3, num_prefixes=2, system_chars=2000)
    recorder = VirtualRecorder(policy="prefix_aware")
    await run_virtual(
        wl,
        policy="prefix_aware",
        sim=SimConfig.from_preset("l40s", kv_blocks=6000, seed=3),
        engines=2,
        requests=80,
        concurrency=8,
        on_finish=recorder.finished,
    )
    doc = diagnose(recorder.windows(), window_s=None).as_dict()
    assert doc["backends"] and errors(doc) == []


@pytest.mark.parametrize(
    ("break_it", "where"),
    [
        (lambda d: d["backends"][0]["measurements"].pop("itl_p99_s"), "measurements"),
        (lambda d: d["findings"][0].update(id="slow_model"), "findings/0/id"),
        (lambda d: d["findings"][4]["evidence"].pop("advised_chunk_tokens"), "findings/4"),
        (lambda d: d.update(healthy=True), "findings"),
        (lambda d: d["backends"][0].update(engine="tgi"), "backends/0/engine"),
        (lambda d: d["findings"][1].update(severity="info"), "findings/1/severity"),
        (lambda d: d["backends"][0]["measurements"].update(kv_usage_max=1.5), "kv_usage_max"),
        (lambda d: d.update(schema="warmroute.doctor/v2"), "schema"),
    ],
)
def test_the_schema_rejects_a_report_that_breaks_it(break_it: Any, where: str) -> None:
    doc = copy.deepcopy(every_finding())
    break_it(doc)
    found = errors(doc)
    assert found and any(where in e for e in found), found


# -- live: the proxy in front of a simulated engine with its prefix cache off -------------------


@contextlib.contextmanager
def caching_off_fleet() -> Iterator[tuple[str, str]]:
    """(proxy URL, engine URL): one simulated vLLM engine that keeps no prefix, behind the
    proxy with an admin token (so /admin is served on its port to holders of the token)."""
    cfg = SimConfig.from_preset(
        "l40s", kv_blocks=4000, enable_prefix_caching=False, time_scale=2, seed=1
    )
    engine = create_sim_app(cfg)
    with ServerThread(engine, **engine.uvicorn_kwargs()) as sim:
        port = free_port()
        config = load_config(
            flags={"backends": [sim.url], "policy": "prefix_aware", "port": port},
            env={
                "WARMROUTE_SERVER__ADMIN_TOKEN_SHA256": hashlib.sha256(TOKEN.encode()).hexdigest(),
                "WARMROUTE_HEALTH__METRICS_SCRAPE_S": "0.1",
            },
        )
        with ServerThread(create_app(config), port=port, http=NoDelayHttpToolsProtocol) as proxy:
            yield proxy.url, sim.url


async def repeated_long_prompts(url: str, n: int = 24, concurrency: int = 4) -> None:
    """Streamed chats over two ~4,000-token system prompts, `concurrency` at a time."""
    systems = [f"System prompt {k}. " + "You answer about the fleet. " * 560 for k in range(2)]

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": "sim-8b",
            "stream": True,
            "max_tokens": 8,
            "messages": [
                {"role": "system", "content": systems[i % 2]},
                {"role": "user", "content": f"question {i}"},
            ],
        }
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert "[DONE]" in "".join([t async for t in r.aiter_text()])

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for k in range(0, n, concurrency):
            await asyncio.gather(*(one(client, i) for i in range(k, min(k + concurrency, n))))


@pytest.mark.e2e
@pytest.mark.slow
def test_the_live_report_names_a_seeded_pathology_in_json_in_metrics_and_in_the_cli(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    auth = {"authorization": f"Bearer {TOKEN}"}
    with caching_off_fleet() as (url, engine):
        asyncio.run(repeated_long_prompts(url))
        assert httpx.get(url + "/admin/doctor").status_code == 401  # admin needs the token
        r = httpx.get(url + "/admin/doctor", headers=auth, timeout=30)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        doc = r.json()
        assert errors(doc) == []
        assert doc["window_s"] == 300 and doc["healthy"] is False
        (backend,) = doc["backends"]
        assert backend["engine"] == "vllm" and backend["requests"] == 24
        assert backend["measurements"]["split_source"] == "engine histograms"
        (f,) = doc["findings"]
        assert f["id"] == "prefill_bound_ttft" and f["evidence"]["engine_caches_nothing"] is True
        assert f["backend"] == backend["backend"] == engine.removeprefix("http://")

        bad = httpx.get(url + "/admin/doctor", params={"window_s": "0"}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "window_s"
        nan = httpx.get(url + "/admin/doctor", params={"window_s": "soon"}, headers=auth)
        assert nan.status_code == 400
        short = httpx.get(url + "/admin/doctor", params={"window_s": "0.001"}, headers=auth)
        assert short.status_code == 200 and short.json()["backends"][0]["requests"] == 0

        metrics = httpx.get(url + "/metrics").text
        series = [ln for ln in metrics.splitlines() if ln.startswith("warmroute_doctor_findings{")]
        assert len(series) == 1, series
        assert 'warmroute_doctor_finding="prefill_bound_ttft"' in series[0]
        assert f'warmroute_doctor_severity="{f["severity"]}"' in series[0]
        assert series[0].endswith(" 1.0")

        out, err = io.StringIO(), io.StringIO()
        monkeypatch.setattr("sys.stdout", out)
        monkeypatch.setattr("sys.stderr", err)
        assert main(["doctor", "--url", url, "--token", TOKEN, "--color", "never"]) == 0
        text = out.getvalue()
        assert f"warmroute doctor: {url}, last 300 s; 1 backend(s), 1 finding(s)" in text
        assert f"{f['severity'].upper()} prefill_bound_ttft" in text
        assert "enable prefix caching" in text
        assert main(["doctor", "--url", url]) == 1
        assert "needs the admin token" in err.getvalue()
