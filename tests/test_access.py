"""Who may call what: client API keys, where /admin is served, path hygiene, request ids, and
no planted secret in any view, log line, span or `--check` output."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.config import Config, load_config
from proxy.edge.access import AdminAccess, KeyRing, bearer
from proxy.redact import SafeFormatter, escape_control, redact_text, redact_url, redacted_config
from proxy.routing.prefix import PrefixHasher
from proxy.server.app import create_app
from proxy.server.serve import NoDelayHttpToolsProtocol, listen_socket
from proxy.telemetry import Telemetry
from proxy.types import TENANT
from tests.support import free_port, until

SECRET = "pl4nted-S3CRET-value"  # planted everywhere a credential can be; must never show
KEY_A, KEY_B, ADMIN = "sk-tenant-a-" + SECRET, "sk-tenant-b-0001", "admin-" + SECRET
MODEL = "test-model"
API = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": MODEL, "prompt": "hi"},
    "/v1/embeddings": {"model": MODEL, "input": "hi"},
    "/v1/responses": {"model": MODEL, "input": "hi"},
}
# The admin routes there are now; the tests cover every one the app serves (admin_routes).
ADMIN_ROUTES = frozenset(
    {
        ("GET", "/admin/backends"),
        ("GET", "/admin/routing"),
        ("POST", "/admin/route/explain"),
        ("GET", "/admin/doctor"),
        ("GET", "/admin/disagg"),
        ("POST", "/admin/backends"),
        ("POST", "/admin/backends/127.0.0.1:1/drain"),
        ("POST", "/admin/backends/127.0.0.1:1/resume"),
        ("DELETE", "/admin/backends/127.0.0.1:1"),
    }
)


def admin_routes(app: Any) -> list[tuple[str, str]]:
    """Every /admin route the app serves, with its method: one added later is covered too."""
    found = sorted(
        (method, route.path.replace("{name}", "127.0.0.1:1"))  # a backend's name
        for route in app.inner.routes
        if getattr(route, "path", "").startswith("/admin")
        for method in sorted(route.methods - {"HEAD"})
    )
    assert ADMIN_ROUTES <= set(found), found
    return found


def sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


# -- pure parts ---------------------------------------------------------------------------------


def test_a_key_matches_only_its_own_digest_and_yields_its_name() -> None:
    ring = KeyRing.from_hex([("a", sha(KEY_A)), ("b", sha(KEY_B))])
    assert ring.match(KEY_A) == "a"
    assert ring.match(KEY_B) == "b"
    assert ring.match(KEY_A + "x") is None
    assert ring.match("") is None
    assert ring.match(None) is None


def test_bearer_reads_only_a_bearer_authorization_header() -> None:
    assert bearer([(b"authorization", b"Bearer abc ")]) == "abc"
    assert bearer([(b"authorization", b"bearer abc")]) == "abc"
    assert bearer([(b"authorization", b"Basic abc")]) is None
    assert bearer([(b"authorization", b"Bearer ")]) is None
    assert bearer([(b"x-api-key", b"abc")]) is None


def test_admin_is_off_the_serving_port_unless_configured() -> None:
    off = AdminAccess.from_settings(8080, None, None)
    assert off.mode == "off" and off.refusal(False, None)[0] == 404  # type: ignore[index]
    listener = AdminAccess.from_settings(8080, 8081, None)
    assert listener.on_admin_listener(("127.0.0.1", 8081))
    assert not listener.on_admin_listener(("127.0.0.1", 8080))
    assert listener.refusal(False, None)[0] == 404  # type: ignore[index]
    assert listener.refusal(True, None) is None
    token = AdminAccess.from_settings(8080, None, sha(ADMIN))
    assert token.mode == "serving"
    assert token.refusal(False, None)[0] == 401  # type: ignore[index]
    assert token.refusal(False, "wrong")[0] == 401  # type: ignore[index]
    assert token.refusal(False, ADMIN) is None


def test_credentials_are_masked_in_urls_and_text() -> None:
    assert redact_url(f"http://user:{SECRET}@10.0.0.5:8000") == "http://***@10.0.0.5:8000"
    assert redact_url(f"redis://:{SECRET}@h:6379/0") == "redis://***@h:6379/0"
    assert redact_url(f"http://h:1/v1?key={SECRET}") == "http://h:1/v1?***"
    assert redact_url("http://10.0.0.5:8000") == "http://10.0.0.5:8000"
    text = f"GET 'https://u:{SECRET}@h/v1/models' failed; redis://{SECRET}@r:1 too"
    assert SECRET not in redact_text(text)


def test_the_printed_config_masks_every_url_whatever_key_holds_it() -> None:
    config = Config.model_validate(
        {
            "backends": [
                {
                    "url": f"http://u:{SECRET}@10.0.0.5:8000",
                    "kv_events": {"endpoint": f"tcp://u:{SECRET}@10.0.0.5:5557"},
                }
            ],
            "redis": {"url": f"redis://:{SECRET}@r:6379/0"},
            "telemetry": {"otlp_endpoint": f"https://u:{SECRET}@collector:4318/v1?token={SECRET}"},
            "routing": {"plugins": {"any": {"note": f"see http://u:{SECRET}@wiki/x"}}},
        }
    )
    shown = json.dumps(redacted_config(config.model_dump(mode="json")))
    assert SECRET not in shown
    assert '"otlp_endpoint": "https://***@collector:4318/v1?***"' in shown
    assert shown.count("***@") == 5


def test_log_messages_cannot_forge_lines_and_carry_no_credentials() -> None:
    fmt = SafeFormatter("%(levelname)s %(message)s")
    record = logging.LogRecord(
        "warmroute", logging.INFO, __file__, 1, "model %s from %s", None, None
    )
    record.args = ("m\nERROR forged line\x1b[31m", f"http://u:{SECRET}@h:1")
    line = fmt.format(record)
    assert "\n" not in line and "\x1b" not in line and SECRET not in line
    assert "\\nERROR forged line\\x1b" in line
    assert escape_control("tab\tstays") == "tab\tstays"


def test_the_tenant_salts_the_prefix_hash_as_cache_salt_does() -> None:
    hasher = PrefixHasher()
    body = {"model": MODEL, "messages": [{"role": "system", "content": "s" * 400}]}
    plain = hasher.key(MODEL, "chat", body).blocks
    token = TENANT.set("tenant-a")
    try:
        a = hasher.key(MODEL, "chat", body).blocks
    finally:
        TENANT.reset(token)
    token = TENANT.set("tenant-b")
    try:
        b = hasher.key(MODEL, "chat", body).blocks
    finally:
        TENANT.reset(token)
    salted = hasher.key(MODEL, "chat", {**body, "cache_salt": "x"}).blocks
    assert len({plain[0], a[0], b[0], salted[0]}) == 4
    assert hasher.key(MODEL, "chat", body).blocks == plain  # the context does not leak


# -- a real proxy on loopback, serving and admin sockets ----------------------------------------


class Proxy:
    """The app under uvicorn with the production protocol, on its serving socket and (when
    server.admin_port is its own) the admin socket, like `warmroute serve`."""

    def __init__(self, config: dict[str, Any], *, admin_listener: bool = False) -> None:
        self.port = free_port()
        self.admin_port = free_port() if admin_listener else None
        server = {"port": self.port, **config.pop("server", {})}
        if admin_listener:
            server["admin_port"] = self.admin_port
        self.config = Config.model_validate({"server": server, **config})
        self.spans = InMemorySpanExporter()
        self.tel = Telemetry(
            self.config.telemetry,
            span_exporter=self.spans,
            metric_readers=[InMemoryMetricReader()],
        )
        self.app = create_app(self.config, telemetry=self.tel)
        sockets = [listen_socket("127.0.0.1", self.port)]
        if self.admin_port:
            sockets.append(listen_socket("127.0.0.1", self.admin_port))
        uv = uvicorn.Config(
            self.app, http=NoDelayHttpToolsProtocol, log_level="warning", loop="asyncio"
        )
        self.server = uvicorn.Server(uv)
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=sockets)), daemon=True
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}" if self.admin_port else self.url

    def __enter__(self) -> Proxy:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def backend(fake_backends: Any) -> str:
    [(_, server)] = fake_backends(1)
    return str(server.url)


def keyed(backend: str, **server: Any) -> dict[str, Any]:
    return {
        "backends": [{"url": backend, "models": [MODEL]}],
        "server": {
            "api_keys": [{"name": "tenant-a", "sha256": sha(KEY_A)},
                         {"name": "tenant-b", "sha256": sha(KEY_B)}],
            **server,
        },
    }  # fmt: skip


@pytest.mark.e2e
def test_every_api_route_refuses_without_its_key_and_serves_with_it(backend: str) -> None:
    with Proxy(keyed(backend)) as proxy, httpx.Client(base_url=proxy.url, timeout=10) as http:
        for path in API:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY_A}):
                r = http.post(path, json=BODIES[path], headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert r.headers["www-authenticate"].startswith("Bearer")
                assert len(r.headers["x-request-id"]) == 32  # refusals are traceable too
            r = http.post(path, json=BODIES[path], headers={"authorization": f"Bearer {KEY_A}"})
            assert r.status_code == 200, (path, r.text)
        assert http.get("/v1/models").status_code == 401
        ok = http.get("/v1/models", headers={"authorization": f"Bearer {KEY_B}"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL
        for open_path in ("/health", "/ready", "/metrics"):  # probes and scrapes need no key
            assert http.get(open_path).status_code == 200, open_path
        metrics = http.get("/metrics").text
        assert 'warmroute_client="tenant-a"' in metrics and "warmroute_auth_refused" in metrics


@pytest.mark.e2e
def test_admin_refuses_on_the_serving_port_unless_configured(backend: str) -> None:
    config = {"backends": [{"url": backend, "models": [MODEL]}]}
    with Proxy(dict(config)) as proxy:
        for method, path in admin_routes(proxy.app):
            r = httpx.request(method, proxy.url + path, json=BODIES[API[0]])
            assert r.status_code == 404, path
            assert "server.admin_port" in r.json()["error"]["message"]
        # decoded paths are what Starlette routes on: an encoded one must not slip past
        for sneaky in ("/%61dmin/backends", "/admin%2Fbackends", "/%2561dmin/backends"):
            r = httpx.get(proxy.url + sneaky)
            assert r.status_code == 404 and "backends" not in r.json(), sneaky

    with Proxy({**config, "server": {"admin_token_sha256": sha(ADMIN)}}) as proxy:
        for method, path in admin_routes(proxy.app):
            url, body = proxy.url + path, BODIES[API[0]]
            assert httpx.request(method, url, json=body).status_code == 401, path
            bad = httpx.request(method, url, json=body, headers={"authorization": "Bearer x"})
            assert bad.status_code == 401, path
            good = {"authorization": f"Bearer {ADMIN}"}
            r = httpx.request(method, url, json=body, headers=good)
            if path.startswith("/admin/backends") and method != "GET":
                # let in: the fleet verb itself answers (a chat body is no backend; no such name)
                code = r.json()["error"]["code"]
                assert code in ("invalid_backend", "backend_not_found"), (path, r.text)
            else:
                assert r.status_code == 200, (path, r.text)


@pytest.mark.e2e
def test_the_admin_listener_serves_admin_and_the_serving_port_does_not(backend: str) -> None:
    config = {"backends": [{"url": backend, "models": [MODEL]}]}
    with Proxy(config, admin_listener=True) as proxy:
        assert httpx.get(proxy.url + "/admin/backends").status_code == 404
        assert httpx.get(proxy.admin_url + "/admin/backends").status_code == 200
        explain = httpx.post(proxy.admin_url + "/admin/route/explain", json=BODIES[API[0]])
        assert explain.status_code == 200 and explain.json()["winner"]
        # the admin listener is not a second way into the API
        r = httpx.post(proxy.admin_url + API[0], json=BODIES[API[0]])
        assert r.status_code == 404
        assert httpx.post(proxy.url + API[0], json=BODIES[API[0]]).status_code == 200
        for path in ("/health", "/ready", "/metrics"):
            assert httpx.get(proxy.admin_url + path).status_code == 200


@pytest.mark.e2e
def test_explain_sees_a_tenants_prompts_only_as_that_tenant(backend: str) -> None:
    system = "You are a careful assistant. " * 40
    body = {"model": MODEL, "messages": [{"role": "system", "content": system}]}
    with Proxy(keyed(backend), admin_listener=True) as proxy:
        r = httpx.post(proxy.url + API[0], json=body, headers={"authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 200

        def matched(client: str | None) -> int:
            query = f"?client={client}" if client else ""
            explained = httpx.post(f"{proxy.admin_url}/admin/route/explain{query}", json=body)
            return max(explained.json()["matched_blocks"].values(), default=0)

        deadline = time.monotonic() + 10  # the index records once the request is on its way
        while matched("tenant-a") == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert matched("tenant-b") == 0
        assert matched(None) == 0


@pytest.mark.e2e
def test_unknown_paths_and_methods_answer_openai_json_and_never_redirect(backend: str) -> None:
    config = {"backends": [{"url": backend, "models": [MODEL]}]}
    with Proxy(config) as proxy, httpx.Client(base_url=proxy.url) as http:
        r = http.get("/v1/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert r.json()["error"]["code"] == "method_not_allowed"
        for path in ("/nope", "/v1/models/", "/v1/chat/completions/", "/health/"):
            r = http.get(path, headers={"host": "evil.example"})
            assert r.status_code == 404, path
            assert "location" not in r.headers and r.json()["error"]["code"] == "not_found"
        assert http.post("/v1/chat/completions/", json=BODIES[API[0]]).status_code == 404
        for path in ("/health", "/ready", "/metrics", "/v1/models", "/nope"):
            assert len(http.get(path).headers["x-request-id"]) == 32, path
            mine = http.get(path, headers={"x-request-id": "trace-me-1"})
            assert mine.headers["x-request-id"] == "trace-me-1", path


@pytest.mark.e2e
def test_unknown_model_names_share_one_metric_label(
    fake_backends: Any, closed_port_url: str
) -> None:
    [(_, server)] = fake_backends(1)
    # One backend's model list is unknown (down at startup): any name gets past intake.
    config = {"backends": [{"url": server.url}, {"url": closed_port_url}]}
    with Proxy(config) as proxy:
        for i in range(5):
            body = {**BODIES[API[0]], "model": f"made-up-{i}"}
            assert httpx.post(proxy.url + API[0], json=body).status_code in (404, 503)
        assert httpx.post(proxy.url + API[0], json=BODIES[API[0]]).status_code == 200
        text = httpx.get(proxy.url + "/metrics").text
    assert "made-up-" not in text
    assert 'gen_ai_request_model="other"' in text
    assert f'gen_ai_request_model="{MODEL}"' in text


@pytest.mark.e2e
def test_a_planted_secret_never_shows_in_views_logs_spans_or_check(
    fake_backends: Any, caplog: pytest.LogCaptureFixture, tmp_path: Any
) -> None:
    [(_, server)] = fake_backends(1)
    url = server.url.replace("http://", f"http://user:{SECRET}@")
    redis = f"redis://:{SECRET}@127.0.0.1:1/0"
    config = {
        **keyed("http://unused"),
        "backends": [
            {"url": url, "models": [MODEL]},
            {"url": f"http://u:{SECRET}@127.0.0.1:1", "models": [MODEL]},
        ],
        "server": {**keyed("x")["server"], "admin_token_sha256": sha(ADMIN)},
        "telemetry": {"capture_content": False},
    }
    seen: list[str] = []
    caplog.set_level(logging.DEBUG)
    with Proxy(config) as proxy, httpx.Client(base_url=proxy.url, timeout=10) as http:
        auth = {"authorization": f"Bearer {KEY_A}"}
        admin = {"authorization": f"Bearer {ADMIN}"}
        for path in API:
            seen.append(http.post(path, json=BODIES[path], headers=auth).text)
        forged = {**BODIES[API[0]], "model": "x\nforged"}
        seen.append(http.post(API[0], json=forged, headers=auth).text)
        for path in ("/ready", "/metrics", "/health", "/v1/models"):
            seen.append(http.get(path, headers=auth).text)
        for method, path in admin_routes(proxy.app):
            r = http.request(method, path, json=BODIES[API[0]], headers=admin)
            verb = path.startswith("/admin/backends") and method != "GET"  # answers an error
            assert r.status_code == 200 or verb, (path, r.text)
            seen.append(r.text)
        ready = http.get("/ready").json()
        assert all(set(b) <= {"name", "up", "circuit"} for b in ready["backends"])
        spans = [
            json.dumps(dict(s.attributes or {})) + s.name for s in proxy.spans.get_finished_spans()
        ]
        assert any("tenant-a" in s for s in spans)  # the key's name, never the key
    seen += spans
    formatter = SafeFormatter("%(name)s %(message)s")
    lines = [formatter.format(r) for r in caplog.records]
    one_line = [line for r, line in zip(caplog.records, lines, strict=True) if not r.exc_info]
    assert any("forged" in line for line in one_line)  # the 404's log line, on one line
    assert not any("\n" in line for line in one_line)
    seen += lines
    check = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--check", "--backend", url, "--redis", redis],
        capture_output=True, text=True, timeout=60, env={
            "PATH": "/usr/bin:/bin",
            "WARMROUTE_TELEMETRY__OTLP_ENDPOINT": f"http://u:{SECRET}@127.0.0.1:4318",
        },
    )  # fmt: skip
    assert check.returncode == 0, check.stderr
    seen += [check.stdout, check.stderr]
    for text in seen:
        for secret in (SECRET, KEY_A, ADMIN):
            assert secret not in text, text[:300]
    assert "***@" in check.stdout


@pytest.mark.e2e
def test_check_refuses_a_redis_url_that_is_not_one() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--check", "--backend", "http://127.0.0.1:9",
         "--redis", "notaurl"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    assert "redis.url: must be a Redis URL" in r.stderr and "Traceback" not in r.stderr


def test_admin_on_a_public_serving_port_needs_a_token() -> None:
    from proxy.config import ConfigError

    with pytest.raises(ConfigError, match="admin_token_sha256"):
        load_config(flags={"backends": ["http://h:1"], "host": "0.0.0.0", "admin_port": 8080})
    cfg = load_config(
        flags={"backends": ["http://h:1"], "host": "0.0.0.0", "admin_port": 9901}, env={}
    )
    assert cfg.server.admin_port == 9901 and cfg.server.admin_host == "127.0.0.1"


class CountingGets:
    """An ASGI wrapper that counts the GETs (health checks, discovery, scrapes) its app gets."""

    def __init__(self, app: Any, wanted: int) -> None:
        self.app = app
        self.gets = 0
        self.enough = threading.Event()
        self.wanted = wanted

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            self.gets += 1
            if self.gets >= self.wanted:
                self.enough.set()
        await self.app(scope, receive, send)


@pytest.mark.e2e
@pytest.mark.redis
def test_a_real_serve_process_never_prints_the_credentials_in_its_urls(tmp_path: Any) -> None:
    from proxy.bench.mock import MockBackend
    from tests.routing_support import HAVE_REDIS_SERVER, RedisProcess
    from tests.support import ServerThread

    if not HAVE_REDIS_SERVER:
        pytest.skip("redis-server binary not installed")
    redis_server = RedisProcess(tmp_path).start()
    admin_client = redis_server.client()
    admin_client.config_set("requirepass", SECRET)  # the proxy gets in only with the password
    admin_client.close()
    backend = CountingGets(MockBackend(chunks=3, models=(MODEL,)), wanted=10)
    up = ServerThread(backend).start()
    port, admin_port = free_port(), free_port()
    args = [
        sys.executable, "-m", "proxy", "serve", "--port", str(port),
        "--admin-port", str(admin_port), "--log-level", "debug",
        "--backend", up.url.replace("http://", f"http://user:{SECRET}@"),
        "--backend", f"http://u:{SECRET}@127.0.0.1:{free_port()}",  # down: its checks fail
        "--redis", f"redis://:{SECRET}@127.0.0.1:{redis_server.port}/0",
    ]  # fmt: skip
    env = {
        "PATH": "/usr/bin:/bin",
        "WARMROUTE_HEALTH__INTERVAL_S": "0.1",
        "WARMROUTE_HEALTH__IDLE_INTERVAL_S": "0.1",  # no traffic yet: checked as often
        "WARMROUTE_HEALTH__IDLE_CHECKS_PER_S": "100",  # ... not stretched to one a second
        "WARMROUTE_HEALTH__METRICS_SCRAPE_S": "0.1",
    }
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    seen: list[str] = []
    try:
        base, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
        deadline = time.monotonic() + 30
        while True:  # another process: nothing to wait on but its answer
            try:
                if httpx.get(base + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "serve not ready"
            time.sleep(0.05)
        assert backend.enough.wait(30), "the health checks did not run"
        chat = httpx.post(base + API[0], json=BODIES[API[0]], timeout=10)
        assert chat.status_code == 200
        streamed = httpx.post(
            base + "/v1/chat/completions",
            json={"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]},
            timeout=10,
        )
        assert streamed.status_code == 200 and "data: [DONE]" in streamed.text
        for answer in (chat, streamed):  # no server header names what serves the port
            assert "server" not in answer.headers and "date" in answer.headers
        routing = httpx.get(admin + "/admin/routing", timeout=10)
        assert routing.json()["index"]["mode"] == "redis"  # the password did get it in
        for path in ("/admin/backends", "/admin/routing", "/ready", "/metrics"):
            seen.append(httpx.get(admin + path, timeout=10).text)
    finally:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        up.stop()
        redis_server.stop()
    seen += [out, err]
    assert "listening on" in err and "unhealthy" in err  # its real log, debug lines included
    assert err.count("\n") > 5
    for text in seen:
        assert SECRET not in text, text[:2000]


@pytest.mark.e2e
def test_spans_carry_the_wait_for_a_backend_and_the_priority_its_engine_was_sent(
    fake_backends: Any,
) -> None:
    """tenant-b (batch) finds its one backend at its bound: it waits for the slot, and the
    engine, which schedules by priority, is sent its level (batch: 2)."""
    [(app, server)] = fake_backends(1)
    config = keyed(str(server.url), admission_timeout_s=120)
    config["backends"][0].update({"max_inflight": 1, "engine_priority": "lower_first"})
    config["tenants"] = {"keys": {"tenant-b": {"priority": "batch"}}}
    with Proxy(config) as proxy:
        held = json.dumps(
            {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "delay:30"}]}
        ).encode()
        with socket.create_connection(("127.0.0.1", proxy.port)) as first:  # until closed
            first.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"authorization: Bearer %s\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (KEY_B.encode(), len(held), held)
            )
            until(lambda: len(app.rec.requests) == 1, "the first request on the backend")
            answer: list[httpx.Response] = []
            second = threading.Thread(
                target=lambda: answer.append(
                    httpx.post(
                        proxy.url + API[0],
                        json=BODIES[API[0]],
                        headers={"authorization": f"Bearer {KEY_B}"},
                        timeout=120,
                    )
                )
            )
            second.start()
            queue = proxy.app.state.steering.waiting
            until(lambda: len(queue.waiters) == 1, "the second request waiting for the slot")
        second.join(120)  # the first one's client left: its slot went to the waiter
        assert answer and answer[0].status_code == 200

        def waited() -> Any:
            spans = proxy.spans.get_finished_spans()
            return next(
                (s for s in spans if "warmroute.backend_wait_s" in (s.attributes or {})), None
            )

        until(waited, "the waiter's span")
        span = waited()
        assert span.attributes["warmroute.backend_wait_s"] > 0
        attempts = [
            s
            for s in proxy.spans.get_finished_spans()
            if s.context.trace_id == span.context.trace_id
            and "warmroute.engine.priority" in (s.attributes or {})
        ]
        assert [s.attributes["warmroute.engine.priority"] for s in attempts] == [2]
        assert app.rec.requests[1]["body"]["priority"] == 2


@pytest.mark.e2e
def test_a_keyed_request_span_carries_its_tenant_class_and_queue_wait(backend: str) -> None:
    config = keyed(backend)
    config["tenants"] = {"keys": {"tenant-b": {"priority": "batch"}}}
    with Proxy(config) as proxy:
        auth = {"authorization": f"Bearer {KEY_B}"}
        r = httpx.post(proxy.url + API[0], json=BODIES[API[0]], headers=auth, timeout=10)
        assert r.status_code == 200

        def server_span() -> Any:
            found = [
                s
                for s in proxy.spans.get_finished_spans()
                if (s.attributes or {}).get("warmroute.client") == "tenant-b"
            ]
            return found[0] if found else None

        until(server_span, "the request's span")
        attrs = server_span().attributes
        assert attrs["warmroute.priority"] == "batch"
        assert attrs["warmroute.queue_wait_s"] == 0.0  # a free slot: no wait
