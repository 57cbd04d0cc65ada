"""Every series the Grafana dashboard and the alerting rules query is in a real /metrics after
traffic.

The stack in miniature: three simulated engines listed by URL alone (so their engine is
detected), one of which answers every request with a 500 (so retries and upstream errors are
counted), the proxy taking them in turn, streamed chat requests through it; then the proxy's
and the engines' GET /metrics, as Prometheus scrapes them. A number on a dashboard that
nothing measures fails here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proxy.config import load_config
from proxy.server.app import create_app
from proxy.server.serve import NoDelayHttpToolsProtocol
from proxy.sim.config import Faults, SimConfig
from proxy.sim.server import create_sim_app
from tests.support import ServerThread, free_port

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy/grafana/dashboards/warmroute.json"
# The collector's re-exposed copy (deploy/otel-collector/config.yaml, namespace: otlp) carries
# the same names behind this prefix.
COLLECTOR_PREFIX = "otlp_"


# PromQL's words that are not metric names (functions and aggregations are followed by `(`).
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool"}
PROMQL_WORDS |= {"offset", "and", "or", "unless", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Every metric name in a PromQL expression, with or without a selector or a range:
    what is left once strings, `{...}`, `[...]`, `by (...)` clauses, functions and keywords
    are taken out."""
    bare = re.sub(
        r'"[^"]*"|\{[^}]*\}|\[[^\]]*\]|\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)',
        " ",
        expr,
    )
    names = re.findall(r"(?<![\w.:])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()", bare)
    return {n for n in names if n.lower() not in PROMQL_WORDS}


def test_metric_names_are_found_bare_as_well_as_with_a_selector() -> None:
    expr = (
        "sum by (server_address) (warmroute_backend_inflight) / ignoring(x) "
        'histogram_quantile(0.99, rate(foo_bucket{le!="+Inf"}[5m] offset 1m)) > bool 1e3'
    )
    assert metric_names(expr) == {"warmroute_backend_inflight", "foo_bucket"}


def dashboard_metrics() -> set[str]:
    """Metric names in the dashboard's queries, and the template variables'
    label_values(name, label)."""
    d = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    names = {m for e in exprs for m in metric_names(e)}
    for var in d.get("templating", {}).get("list", []):
        query = var.get("definition") or var.get("query", {}).get("query", "")
        names |= set(re.findall(r"label_values\(\s*([a-zA-Z_:][\w:]*)", query))
    return {n.removeprefix(COLLECTOR_PREFIX) for n in names}


ALERTS = ROOT / "deploy/prometheus/alerts.yml"
# Exposed only while the doctor has a finding: tests/test_doctor_report.py seeds one and reads
# it from /metrics.
ONLY_WITH_A_FINDING = {"warmroute_doctor_findings"}


def alert_metrics() -> set[str]:
    """warmroute's metric names in the alerting rules' expressions (label names in `by (...)`
    and selectors `{...}` left out)."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    exprs = [r["expr"] for g in groups for r in g["rules"]]
    bare = [re.sub(r"by\s*\([^)]*\)|\{[^}]*\}", " ", e) for e in exprs]
    return {m for e in bare for m in re.findall(r"\bwarmroute_\w+", e)}


def exposed(text: str) -> set[str]:
    return {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"
    }


@pytest.mark.e2e
def test_every_metric_a_dashboard_panel_queries_is_exposed_after_traffic() -> None:
    used = dashboard_metrics()
    assert len(used) >= 15 and any(m.startswith("vllm:") for m in used)
    alerts = alert_metrics()
    assert len(alerts) >= 4
    used |= alerts - ONLY_WITH_A_FINDING

    def sim(**faults: float) -> Any:
        cfg = SimConfig.from_preset("h100", kv_blocks=512, time_scale=20, faults=Faults(**faults))
        return create_sim_app(cfg)

    engines = [sim(), sim(), sim(error_rate=1.0)]
    key = "sk-dashboard"
    auth = {"authorization": f"Bearer {key}"}
    with contextlib.ExitStack() as stack:
        a, b, c = (stack.enter_context(ServerThread(e, **e.uvicorn_kwargs())) for e in engines)
        port = free_port()
        config = load_config(
            flags={
                "backends": [a.url, b.url, c.url],
                "policy": "round_robin",
                "port": port,
                "admin_port": port,
            },
            env={
                "WARMROUTE_HEALTH__METRICS_SCRAPE_S": "0.1",
                "WARMROUTE_SERVER__API_KEYS": f"team:{hashlib.sha256(key.encode()).hexdigest()}",
            },
        )
        with ServerThread(create_app(config), port=port, http=NoDelayHttpToolsProtocol) as proxy:
            system = "You answer questions about the warmroute deployment. " * 40
            with httpx.Client(base_url=proxy.url, timeout=30, headers=auth) as client:
                # refused by the proxy itself: the error panels count it too
                unkeyed = {"model": "sim-8b", "messages": [{"role": "user", "content": "hi"}]}
                r = httpx.post(proxy.url + "/v1/chat/completions", json=unkeyed, timeout=10)
                assert r.status_code == 401
                unknown = {**unkeyed, "model": "no-such-model"}
                assert client.post("/v1/chat/completions", json=unknown).status_code == 404
                for i in range(12):
                    body = {
                        "model": "sim-8b",
                        "stream": True,
                        "max_tokens": 8,
                        "messages": [
                            {"role": "system", "content": system},
                            {"role": "user", "content": f"question {i}"},
                        ],
                    }
                    with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        assert r.status_code == 200
                        assert "[DONE]" in "".join(r.iter_text())
                texts = [client.get("/metrics").text] + [
                    httpx.get(s.url + "/metrics", timeout=10).text for s in (a, b)
                ]
    assert re.search(
        r'warmroute_requests_refused_total\{[^}]*error_type="invalid_api_key"[^}]*\} 1\.0', texts[0]
    )
    assert re.search(
        r'warmroute_requests_refused_total\{[^}]*error_type="model_not_found"[^}]*\} 1\.0', texts[0]
    )
    have = set().union(*(exposed(t) for t in texts))
    missing = sorted(used - have)
    assert not missing, f"the dashboard or an alert queries series nothing exposes: {missing}"


def _targets() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    d = json.loads(DASHBOARD.read_text())
    return [(p, t) for p in d["panels"] for t in p.get("targets", [])]


def test_every_by_backend_query_groups_by_address_and_port() -> None:
    """Two engines on one host (compose's sim:8001 and sim:8002) are two lines: wherever a
    query groups, filters or labels by server_address, it does so by server_port too (the
    warmroute_backend label is the backend's name, host:port unless named: one label)."""
    grouped = 0
    for panel, target in _targets():
        expr, where = target["expr"], f"panel {panel['title']!r}: {target['expr']}"
        for labels in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            names = {n.strip() for n in labels.split(",")}
            if "server_address" in names:
                assert "server_port" in names, where
                grouped += 1
        for selector in re.findall(r"\{([^}]*)\}", expr):
            if "server_address" in selector:
                assert 'server_port=~"$port"' in selector, where
        legend = target.get("legendFormat", "")
        if "{{server_address}}" in legend:
            assert "{{server_port}}" in legend, where
    assert grouped >= 1  # the TTFT-by-backend panel, at least
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    port = variables["port"]["definition"]
    assert "server_port" in port and 'server_address=~"$backend"' in port  # chained to $backend
    assert variables["port"]["allValue"] == ".*"  # All also matches refusals without a backend


def test_refusals_reach_the_error_panels() -> None:
    """Requests the proxy refused itself (401, 404, 503 overloaded) have no backend: both
    error panels add warmroute_requests_refused_total, and the backend filters' All value
    matches series without server_address (429 and 503 no_backend, recorded after routing)."""
    by_title = {p["title"]: [t["expr"] for t in p.get("targets", [])] for p, _ in _targets()}
    for title in ("Requests / s by outcome", "Error ratio"):
        assert any("warmroute_requests_refused_total" in e for e in by_title[title]), title
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    assert all(v.get("allValue") == ".*" for v in variables)


def test_exemplar_overlays_say_they_need_the_compose_collector() -> None:
    panels = {p["title"]: p for p, t in _targets() if t.get("exemplar")}
    assert len(panels) == 4
    for title, panel in panels.items():
        text = panel.get("description", "").lower()
        assert "compose" in text and "collector" in text and "empty" in text, title
