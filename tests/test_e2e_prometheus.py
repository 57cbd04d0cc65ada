"""A real Prometheus scrapes the proxy's /metrics; PromQL over the TTFT histogram is right.

The Debian package `prometheus` provides the server (.ci/run installs it). Outside CI a missing
binary skips this test with the reason; in CI (CI set) it fails, so the check cannot silently
vanish.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.config import Config
from proxy.server.app import create_app
from tests.support import ServerThread, free_port

pytestmark = [pytest.mark.prometheus, pytest.mark.e2e, pytest.mark.slow]

MODEL = "test-model"
DEADLINE_S = 30.0
# Requests of known TTFT in two buckets of the semconv boundaries, (0.1, 0.25] and (0.25, 0.5]:
# the backend's delay puts a floor under each TTFT just above a bucket's lower bound, which
# leaves the most room for a busy machine's delays below its upper bound. The median (rank 10
# of 20) is in the first bucket, the 90th percentile (rank 18) in the second.
FAST_S, FAST_N = 0.11, 12
SLOW_S, SLOW_N = 0.27, 8


def _prometheus_binary() -> str:
    found = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None
    )
    if found:
        return found
    why = "the `prometheus` binary is not installed (apt-get install prometheus)"
    if os.environ.get("CI"):
        pytest.fail(f"{why}; .ci/run should have installed it")
    pytest.skip(why)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[str], str]]:
    """prometheus(target "host:port") -> its base URL, scraping target's /metrics every 1 s."""
    binary = _prometheus_binary()
    procs: list[subprocess.Popen[bytes]] = []
    log = tmp_path / "prometheus.log"

    def start(target: str) -> str:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n"
            "  scrape_interval: 1s\n"
            "  scrape_timeout: 1s\n"
            "scrape_configs:\n"
            "  - job_name: warmroute\n"
            "    metrics_path: /metrics\n"
            "    static_configs:\n"
            f"      - targets: ['{target}']\n"
        )
        port = free_port()
        with log.open("wb") as out:
            procs.append(
                subprocess.Popen(
                    [
                        binary,
                        f"--config.file={config}",
                        f"--storage.tsdb.path={tmp_path / 'data'}",
                        f"--web.listen-address=127.0.0.1:{port}",
                        "--log.level=warn",
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + DEADLINE_S
        while True:
            if procs[-1].poll() is not None:
                raise AssertionError(f"prometheus exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready: {log.read_text()[-2000:]}"
            time.sleep(0.05)

    try:
        yield start
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def query(prom: str, promql: str) -> list[dict[str, Any]]:
    r = httpx.get(prom + "/api/v1/query", params={"query": promql}, timeout=5)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def scalar(prom: str, promql: str) -> float | None:
    result = query(prom, promql)
    return float(result[0]["value"][1]) if result else None


def wait_for(prom: str, promql: str, want: Callable[[float], bool]) -> float:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        v = scalar(prom, promql)
        if v is not None and want(v):
            return v
        assert time.monotonic() < deadline, f"{promql} = {v} after {DEADLINE_S}s"
        time.sleep(0.1)


def chat_stream(http: httpx.Client, slowstart: float) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"slowstart:{slowstart} chunks:2"}],
        "stream": True,
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")


def test_promql_histogram_quantile_over_the_scraped_ttft_histogram(
    fake_backends: Any, prometheus: Callable[[str], str]
) -> None:
    [(_, backend)] = fake_backends(1)
    cfg = Config.model_validate({"backends": [{"url": backend.url}]})
    with ServerThread(create_app(cfg)) as p, httpx.Client(base_url=p.url, timeout=30) as http:
        # One quick request so the series exist before the measured ones: rate() needs a
        # baseline sample (Prometheus does not assume a new series started at zero).
        chat_stream(http, 0)
        text = http.get("/metrics").text
        m = re.search(r"^# TYPE (\w*time_to_first_token\w*) histogram$", text, re.M)
        assert m, "no TTFT histogram in /metrics"
        ttft = m.group(1)
        assert ttft == "gen_ai_server_time_to_first_token_seconds"

        prom = prometheus(f"127.0.0.1:{p.port}")
        wait_for(prom, 'up{job="warmroute"}', lambda v: v == 1)
        wait_for(prom, f"sum({ttft}_count)", lambda v: v == 1)

        delays = [FAST_S] * FAST_N + [SLOW_S] * SLOW_N
        # A few at a time: the clients share this process (and its GIL) with the proxy.
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda s: chat_stream(http, s), delays))
        n = len(delays) + 1
        wait_for(prom, f"sum({ttft}_count)", lambda v: v == n)

        # The buckets as Prometheus stored them: exactly where the requests fell.
        cumulative = {
            r["metric"]["le"]: float(r["value"][1])
            for r in query(prom, f"sum by (le) ({ttft}_bucket)")
        }
        assert cumulative["0.1"] == 1  # the warm-up only
        assert cumulative["0.25"] == 1 + FAST_N
        assert cumulative["0.5"] == cumulative["+Inf"] == n
        mean = scalar(prom, f"sum({ttft}_sum) / sum({ttft}_count)")
        true_mean = (FAST_S * FAST_N + SLOW_S * SLOW_N) / n
        assert mean is not None and true_mean <= mean < true_mean + 0.1

        # The dashboard's query: quantiles of the rate over the window (warm-up excluded).
        def q(phi: float, over: str) -> float:
            v = scalar(prom, f"histogram_quantile({phi}, sum by (le) ({over}))")
            assert v is not None
            return v

        rate = f"rate({ttft}_bucket[1m])"
        p50, p90 = q(0.5, rate), q(0.9, rate)
        raw_p50 = q(0.5, f"{ttft}_bucket")
        print(f"\nPromQL TTFT p50 {p50:.3f} s, p90 {p90:.3f} s (raw buckets p50 {raw_p50:.3f} s)")
        # Linear interpolation inside the bucket holding the true median (0.11 s): with 12 of
        # 20 there, rank 10 sits at 0.1 + 0.15 * 10/12 = 0.225; rate()'s extrapolation may
        # shift it a little, never out of the bucket.
        assert 0.1 < p50 <= 0.25
        assert p50 == pytest.approx(0.225, abs=0.02)
        assert 0.25 < p90 <= 0.5  # the true p90 (0.27 s) is in (0.25, 0.5]
        assert 0.1 < raw_p50 <= 0.25
