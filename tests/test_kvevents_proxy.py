"""The proxy routes on the engines' own KV events where they publish them, and on the learned
index where they do not (or their event stream is not current)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proxy.sim import SimConfig, create_sim_app
from tests.support import ServerThread, eventually, free_port, process
from tests.test_kvevents_sim import SYSTEM, endpoints

pytestmark = pytest.mark.e2e

MODEL = "sim-8b"


@contextlib.contextmanager
def publishing_sim(events: str, replay: str) -> Iterator[str]:
    cfg = SimConfig.from_preset(
        "h100", "8b", "bf16", time_scale=100, kv_blocks=64,
        kv_events_endpoint=events, kv_events_replay_endpoint=replay,
    )  # fmt: skip
    app = create_sim_app(cfg)
    with ServerThread(app, **app.uvicorn_kwargs()) as server:
        yield server.url


@contextlib.contextmanager
def proxy(tmp: Path, backends: list[dict[str, Any]]) -> Iterator[str]:
    port = free_port()
    config = tmp / "warmroute.yaml"
    routing = {"plugins": {"prefix": {"kv_block_tokens": 16}}}
    config.write_text(
        yaml.safe_dump({"backends": backends, "routing": routing, "health": {"interval_s": 0.5}})
    )
    args = [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(port)]
    args += ["--admin-port", str(port)]  # /admin on the (loopback) serving port
    with process(args, ready=f"http://127.0.0.1:{port}/ready"):
        yield f"http://127.0.0.1:{port}"


def body(tail: int) -> dict[str, Any]:
    """A completions request whose prompt is token ids: keyed by the engine's own blocks."""
    ids = SYSTEM + list(range(20_000 + 100 * tail, 20_000 + 100 * tail + 40))
    return {"model": MODEL, "prompt": ids, "max_tokens": 2}


async def test_routing_reads_publishing_engines_from_their_events_and_others_from_the_index(
    tmp_path: Path,
) -> None:
    (ev_a, rp_a, ev_b, rp_b, nobody) = endpoints(5)
    with publishing_sim(ev_a, rp_a) as a, publishing_sim(ev_b, rp_b) as b:
        backends = [
            {"url": a, "engine": "vllm", "models": [MODEL],
             "kv_events": {"endpoint": ev_a, "replay_endpoint": rp_a}},
            {"url": b, "engine": "vllm", "models": [MODEL],
             "kv_events": {"endpoint": ev_b, "replay_endpoint": rp_b}},
            # Configured, but nothing publishes there: the learned index stands in, visibly.
            {"url": b, "name": "silent", "engine": "vllm", "models": [MODEL],
             "kv_events": {"endpoint": nobody}},
        ]  # fmt: skip
        with proxy(tmp_path, backends) as url:
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:

                async def live() -> dict[str, Any] | None:
                    cache = (await client.get("/admin/routing")).json()["cache"]
                    events = cache.get("kv_events", {})
                    names = {k for k, v in events.items() if v["live"]}
                    return events if len(names) == 2 else None

                events = await eventually(live, "live events")
                assert not events["silent"]["live"]
                served = []
                for i in range(6):
                    r = await client.post("/v1/completions", json=body(i))
                    assert r.status_code == 200, r.text
                    served.append(r.headers["x-warmroute-backend"])
                assert set(served) <= {"silent", *events}

                async def explained() -> dict[str, Any] | None:
                    d = (
                        await client.post("/admin/route/explain?api=completions", json=body(99))
                    ).json()
                    # Once the events of the requests above have arrived, some engine reports
                    # the prompt's shared blocks.
                    held = [v for n, v in d["matched_blocks"].items() if n != "silent"]
                    return d if max(held) >= len(SYSTEM) // 16 else None

                d = await eventually(explained, "an explained decision")
                sources = d["match_source"]
                assert sources["silent"] == "index", sources
                assert all(v == "kv_events" for n, v in sources.items() if n != "silent"), sources
