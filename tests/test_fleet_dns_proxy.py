"""The whole proxy following a fleet through DNS: a real dnsmasq on loopback answering for a
name whose A records the test rewrites, mock engines on 127.0.0.11-13 (one port), and the real
proxy under uvicorn routing to whatever the name lists."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import uvicorn

from proxy.bench.mock import MockBackend
from proxy.config import Config
from proxy.server.app import create_app
from tests.dnsmasq import DOMAIN, Dnsmasq, dnsmasq
from tests.routing_support import SHARED_URL, delete_prefix, unique_prefix
from tests.support import ServerThread, WakeableServer, free_port, stop_servers, until

pytestmark = pytest.mark.e2e
MODEL = "test-model"
NAME = f"vllm.{DOMAIN}"
ENGINES = ("127.0.0.11", "127.0.0.12", "127.0.0.13")


class HostServer(ServerThread):
    """ServerThread on another loopback address than 127.0.0.1."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        super().__init__(app, port=port)
        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning", loop="asyncio")
        self.server = WakeableServer(self.config)
        self.url = f"http://{host}:{port}"


@pytest.fixture
def engines() -> Iterator[tuple[int, dict[str, MockBackend]]]:
    port = free_port()
    apps = {ip: MockBackend(chunks=3, models=(MODEL,), name=ip, record=True) for ip in ENGINES}
    servers = [HostServer(app, ip, port).start() for ip, app in apps.items()]
    yield port, apps
    stop_servers(servers)


@pytest.fixture
def resolver(tmp_path: Path) -> Iterator[Dnsmasq]:
    with dnsmasq(tmp_path) as d:
        yield d


def test_the_proxy_follows_the_names_records_and_keeps_its_fleet_when_it_stops_resolving(
    engines: tuple[int, dict[str, MockBackend]],
    resolver: Dnsmasq,
    caplog: pytest.LogCaptureFixture,
) -> None:
    port, apps = engines
    resolver.hosts("fleet", [(ENGINES[0], NAME), (ENGINES[1], NAME)])
    cfg = Config.model_validate(
        {
            "server": {"port": free_port()},
            "backends": [
                {"dns": NAME, "port": port, "models": [MODEL], "min_ttl_s": 0.05, "max_ttl_s": 0.2}
            ],
            "fleet": {"nameservers": [resolver.nameserver]},
            "routing": {"policy": "round_robin"},
        }
    )
    cfg = cfg.model_copy(
        update={"server": cfg.server.model_copy(update={"admin_port": cfg.server.port})}
    )
    app = create_app(cfg)
    caplog.set_level(logging.INFO, logger="warmroute.fleet")
    with ServerThread(app, port=cfg.server.port) as proxy:

        def fleet() -> dict[str, tuple[str, str]]:
            view = httpx.get(proxy.url + "/admin/backends").json()["backends"]
            return {b["name"]: (b["state"], b["source"]) for b in view}

        def serving() -> set[str]:
            return {n for n, (state, _) in fleet().items() if state == "serving"}

        a, b, c = (f"{ip}:{port}" for ip in ENGINES)
        until(lambda: serving() == {a, b}, "the two listed engines")
        assert fleet()[a][1] == f"dns:{NAME}"
        for _ in range(4):
            r = httpx.post(
                proxy.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert r.status_code == 200
        assert len(apps[ENGINES[0]].rec.requests) == len(apps[ENGINES[1]].rec.requests) == 2

        resolver.hosts("fleet", [(ip, NAME) for ip in ENGINES])  # scale out
        until(lambda: serving() == {a, b, c}, "the third engine to join")
        resolver.hosts("fleet", [(ENGINES[1], NAME), (ENGINES[2], NAME)])  # a pod goes
        until(lambda: set(fleet()) == {b, c}, "the first engine to leave")

        resolver.drop("fleet")  # the name stops resolving: NXDOMAIN
        until(
            lambda: any("keeping the 2 engines" in r.getMessage() for r in caplog.records),
            "the warning",
        )
        assert serving() == {b, c}  # the fleet is kept
        resolver.hosts("fleet", [(ENGINES[1], NAME), (ENGINES[2], NAME)])
        until(
            lambda: any("resolves again" in r.getMessage() for r in caplog.records),
            "the recovery line",
        )
        warnings = [
            r for r in caplog.records if r.levelno == logging.WARNING and NAME in r.getMessage()
        ]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert serving() == {b, c}


@pytest.mark.redis
def test_two_replicas_sharing_redis_follow_one_name_and_delete_a_departed_engines_keys_once(
    engines: tuple[int, dict[str, MockBackend]], resolver: Dnsmasq
) -> None:
    """Both replicas watch the same name and see the same leave; the engine's shared index keys
    are deleted by one of them (the other finds the departure's guard and skips)."""
    port, apps = engines
    resolver.hosts("fleet", [(ENGINES[0], NAME), (ENGINES[1], NAME)])
    kp = unique_prefix("dnsreplicas")
    a, b, _ = (f"{ip}:{port}" for ip in ENGINES)

    def replica() -> ServerThread:
        own = free_port()
        cfg = Config.model_validate(
            {
                "server": {"port": own, "admin_port": own},
                "backends": [
                    {
                        "dns": NAME,
                        "port": port,
                        "models": [MODEL],
                        "min_ttl_s": 0.05,
                        "max_ttl_s": 0.2,
                    }
                ],
                "fleet": {"nameservers": [resolver.nameserver]},
                "redis": {"url": SHARED_URL, "key_prefix": kp},
            }
        )
        return ServerThread(create_app(cfg), port=own)

    def serving(proxy: ServerThread) -> set[str]:
        view = httpx.get(proxy.url + "/admin/backends").json()["backends"]
        return {x["name"] for x in view if x["state"] == "serving"}

    def keys_for(name: str) -> list[str]:
        client = redis.Redis.from_url(SHARED_URL)
        try:
            found = (k.decode() for k in client.scan_iter(match=f"*{kp}*", count=1000))
            return [k for k in found if k.endswith(f":{name}") and "!departed" not in k]
        finally:
            client.close()

    def departures(proxies: list[ServerThread]) -> list[dict[str, int]]:
        return [httpx.get(p.url + "/admin/routing").json()["index"]["departures"] for p in proxies]

    try:
        with replica() as one, replica() as two:
            for proxy in (one, two):
                until(lambda proxy=proxy: serving(proxy) == {a, b}, "both engines on both")
            for i in range(16):  # distinct prompts through each replica: homes on both engines
                r = httpx.post(
                    (one, two)[i % 2].url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": f"q{i} " * 80}]},
                )
                assert r.status_code == 200, r.text
            until(lambda: keys_for(a) and keys_for(b), "both engines' index keys in Redis")
            assert apps[ENGINES[0]].rec.requests and apps[ENGINES[1]].rec.requests

            resolver.hosts("fleet", [(ENGINES[1], NAME)])  # a's pod goes
            for proxy in (one, two):
                until(lambda proxy=proxy: serving(proxy) == {b}, "the leave on both replicas")
            until(
                lambda: sum(d["deleted"] + d["skipped"] for d in departures([one, two])) == 2,
                "both replicas to settle the departure",
            )
            assert sorted(d["deleted"] for d in departures([one, two])) == [0, 1]
            assert keys_for(a) == []
            assert keys_for(b)  # the engine that stays keeps what the fleet knows of it
    finally:
        delete_prefix(kp)
