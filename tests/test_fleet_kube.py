"""KubernetesSource (proxy/fleet/kube.py) against tests/kube_api.py, a stand-in for the
Kubernetes API server: a real HTTP server on loopback that answers the EndpointSlice list and
watch with JSON recorded from a cluster (tests/data/kube/), refuses connections when told, and
records every request, so the tests assert what the client asked (paths, labelSelector, watch,
resourceVersion, allowWatchBookmarks, the bearer token) and what it reported.

No sleeps: each test waits on what the server saw, what the source reported or logged (one
asyncio.Event poked by all three), under a timeout that only guards against a hang.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import shutil
import subprocess
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config import DiscoveryConfig
from proxy.fleet.kube import (
    KubeError,
    KubernetesSource,
    load_credentials,
    members_of,
)
from proxy.fleet.members import Member
from proxy.upstream.conn import RETRY_AFTER_MAX_S, retry_after_s
from tests.kube_api import KubeAPI, Reply, Step, Watch, recorded

PATH = "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"
SERVICE = "kubernetes.io/service-name=vllm"
HANG_GUARD_S = 10.0  # a hung test fails instead of waiting for pytest's timeout


class Probe:
    """What the source reported and logged, and an event poked by every change."""

    def __init__(self) -> None:
        self.changed = asyncio.Event()
        self.reports: list[dict[str, bool]] = []  # url -> serving, per report
        self.logs: list[logging.LogRecord] = []

    def poke(self) -> None:
        self.changed.set()

    def report(self, members: Sequence[Member]) -> None:
        self.reports.append({m.cfg.url: m.serving for m in members})
        self.poke()

    async def until(self, done: Callable[[], bool]) -> None:
        while not done():
            self.changed.clear()
            await self.changed.wait()

    def lines(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.logs if r.levelno == level]


class _Handler(logging.Handler):
    def __init__(self, probe: Probe) -> None:
        super().__init__(logging.DEBUG)
        self.probe = probe

    def emit(self, record: logging.LogRecord) -> None:
        self.probe.logs.append(record)
        self.probe.poke()


@pytest.fixture
def probe() -> Iterator[Probe]:
    p = Probe()
    logger = logging.getLogger("warmroute.fleet")
    handler, level = _Handler(p), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield p
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def account(tmp_path: Path) -> Path:
    """A pod's service account files: token, namespace (no ca.crt: the stand-in is http)."""
    d = tmp_path / "serviceaccount"
    d.mkdir()
    (d / "token").write_text("token-1\n")
    (d / "namespace").write_text("llm")
    return d


def discovery(api: KubeAPI, **kube: Any) -> DiscoveryConfig:
    kube = {"service": "vllm", **kube, "api_server": api.url}
    return DiscoveryConfig.model_validate({"kubernetes": kube, "engine": "vllm"})


def source(api: KubeAPI, account: Path, **kube: Any) -> KubernetesSource:
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.port)}
    return KubernetesSource(
        discovery(api, **kube),
        service_account_dir=account,
        env=env,
        backoff_s=(0.001, 0.01),
        refused_retry_s=0.001,
        watch_timeout_s=60,
    )


async def following(
    probe: Probe,
    script: list[Step],
    make: Callable[[KubeAPI], KubernetesSource],
    scenario: Callable[[KubeAPI], Awaitable[None]],
) -> None:
    """Serve `script`, run the source on it, and let `scenario(api)` wait and assert."""
    async with KubeAPI(script, on_request=probe.poke) as api:
        task = asyncio.create_task(make(api).run(probe.report))
        try:
            async with asyncio.timeout(HANG_GUARD_S):
                await scenario(api)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


def url(ip: str) -> str:
    return f"http://[{ip}]:8000" if ":" in ip else f"http://{ip}:8000"


def listing(**extra: str) -> dict[str, str]:
    return {"labelSelector": SERVICE, "limit": "500", **extra}


def watching(rv: str, selector: str = SERVICE) -> dict[str, str]:
    return {
        "labelSelector": selector,
        "watch": "1",
        "allowWatchBookmarks": "true",
        "resourceVersion": rv,
        "timeoutSeconds": "60",
    }


INITIAL = {url("10.244.1.17"): True, url("10.244.2.9"): True}
SCALED_OUT = {**INITIAL, url("10.244.3.4"): True}  # the new slice (10.244.2.9 in both: once)
# 10.244.1.17 terminating (serving, not ready): drained; 10.244.1.23 ready unset: ready;
# 10.244.1.31 starting (neither): left out.
TERMINATING = {**SCALED_OUT, url("10.244.1.17"): False, url("10.244.1.23"): True}
RELISTED = {url(ip): True for ip in ("10.244.2.9", "10.244.1.23", "10.244.1.31", "10.244.3.4")}
SCALED_IN = {k: v for k, v in RELISTED.items() if k != url("10.244.3.4")}


@pytest.mark.e2e
def test_list_watch_bookmark_resume_410_relist_and_an_outage(probe: Probe, account: Path) -> None:
    script: list[Step] = [
        Reply(recorded("list-initial")),
        Watch(recorded("watch-scale-out")),  # ADDED, MODIFIED, BOOKMARK 48260; then it ends
        Reply(recorded("status-410"), status=410),  # the bookmark's version is compacted away
        Reply(recorded("list-relist")),
        Watch(recorded("watch-expired")),  # an ERROR event with code 410
        Reply(recorded("list-after-expired")),
        Watch(recorded("watch-scale-in"), end="drop"),  # DELETED 49230, then the line is cut
        Reply(recorded("status-503"), status=503),
        Reply(recorded("status-503"), status=503),
        Watch(end="hold"),  # back
    ]

    async def scenario(api: KubeAPI) -> None:
        await probe.until(lambda: len(api.requests) == 10 and bool(probe.lines(logging.INFO)))
        assert [(r.method, r.path) for r in api.requests] == [("GET", PATH)] * 10
        assert [r.query for r in api.requests] == [
            listing(),
            watching("48213"),  # the list's version
            watching("48260"),  # the bookmark's: the watch ended, resumed where it was
            listing(),  # 410: list again
            watching("48950"),
            listing(),  # the ERROR event's 410: list again
            watching("49107"),
            watching("49230"),  # the line was cut after DELETED: resumed from it
            watching("49230"),  # 503: the same version again, after a backoff
            watching("49230"),
        ]
        assert probe.reports == [
            INITIAL,
            SCALED_OUT,
            TERMINATING,  # the bookmark reported nothing
            RELISTED,  # a list is reported whole
            RELISTED,
            SCALED_IN,  # nothing during the outage: the fleet is kept
        ]
        [warning] = probe.lines(logging.WARNING)
        assert "kubernetes:llm/vllm" in warning and "503" in warning and "keeping" in warning
        [info] = probe.lines(logging.INFO)
        assert "answers again" in info
        assert probe.lines(logging.ERROR) == []

    asyncio.run(
        following(probe, script, lambda api: source(api, account, namespace="llm"), scenario)
    )


@pytest.mark.e2e
def test_connections_refused_keep_the_fleet_and_warn_once(probe: Probe, account: Path) -> None:
    script: list[Step] = [Reply(recorded("list-initial")), Watch(end="drop", down=True)]

    def retries() -> int:
        return sum(r.levelno == logging.DEBUG and "retrying" in r.getMessage() for r in probe.logs)

    async def scenario(api: KubeAPI) -> None:
        await probe.until(lambda: retries() >= 5)  # five connects refused
        assert len(api.requests) == 2
        [warning] = probe.lines(logging.WARNING)  # five refused connects, one line
        assert "unavailable" in warning and "ConnectError" in warning
        assert probe.lines(logging.INFO) == []
        await api.up()
        await probe.until(lambda: bool(probe.lines(logging.INFO)))
        assert probe.reports == [INITIAL]  # nothing reported while it was away
        assert len(probe.lines(logging.WARNING)) == 1
        assert api.requests[-1].query == watching("48213")  # back: resumed, not relisted
        assert [r.query.get("watch") for r in api.requests].count(None) == 1

    asyncio.run(following(probe, script, lambda api: source(api, account), scenario))


@pytest.mark.e2e
def test_a_429_is_retried_no_sooner_than_its_retry_after(probe: Probe, account: Path) -> None:
    """API Priority and Fairness sheds load with 429 and Retry-After (whole seconds; 1 here, as
    its recorded Status says): the backoff never retries sooner, whatever its own delay."""
    throttled = Reply(recorded("status-429"), status=429, headers={"Retry-After": "1"})
    script: list[Step] = [Reply(recorded("list-initial")), throttled, Watch(end="hold")]

    def delays() -> list[str]:
        return [r.getMessage() for r in probe.logs if "retrying in" in r.getMessage()]

    async def scenario(api: KubeAPI) -> None:
        await probe.until(lambda: len(api.requests) == 3)
        assert delays() == ["kubernetes:llm/vllm: retrying in 1.000s"]  # the backoff's is 0.001
        [warning] = probe.lines(logging.WARNING)
        assert "429" in warning and "keeping" in warning
        assert api.requests[-1].query == watching("48213")  # resumed, not relisted
        assert probe.reports == [INITIAL]

    asyncio.run(
        following(probe, script, lambda api: source(api, account, namespace="llm"), scenario)
    )


def test_retry_after_is_read_as_seconds_and_bounded() -> None:
    assert [retry_after_s(v) for v in ("1", "2.5", None, "", "-3", "soon")] == [
        1.0,
        2.5,
        0.0,
        0.0,
        0.0,
        0.0,
    ]
    assert retry_after_s("Wed, 21 Oct 2026 07:28:00 GMT") == 0.0  # a date: not what k8s sends
    assert retry_after_s("86400") == RETRY_AFTER_MAX_S


@pytest.mark.e2e
def test_rotated_token_is_sent_and_403_names_the_rbac(probe: Probe, account: Path) -> None:
    def rotate(token: str) -> Callable[[], None]:
        def hook() -> None:
            (account / "token").write_text(token)

        return hook

    script: list[Step] = [
        Reply(recorded("list-initial"), hook=rotate("token-2")),  # the kubelet rotates it
        Reply(recorded("status-403"), status=403, hook=rotate("token-3")),
        Reply(recorded("status-403"), status=403),
        Watch(end="hold"),  # the Role is bound: it answers
    ]

    async def scenario(api: KubeAPI) -> None:
        await probe.until(lambda: len(api.requests) == 4 and bool(probe.lines(logging.INFO)))
        tokens = [r.headers["authorization"] for r in api.requests]
        assert tokens == ["Bearer token-1", "Bearer token-2", "Bearer token-3", "Bearer token-3"]
        # The namespace is the service account's (no namespace: in the config).
        assert {r.path for r in api.requests} == {PATH}
        assert [r.query for r in api.requests] == [listing()] + [watching("48213")] * 3
        [error] = probe.lines(logging.ERROR)  # two refusals, one line
        assert "get, list and watch on endpointslices (apiGroup discovery.k8s.io)" in error
        assert "in namespace llm" in error and "RoleBinding" in error and "forbidden" in error
        assert probe.reports == [INITIAL]

    asyncio.run(following(probe, script, lambda api: source(api, account), scenario))


@pytest.mark.e2e
def test_an_unreadable_answer_is_an_outage_not_the_end(probe: Probe, account: Path) -> None:
    script: list[Step] = [
        Reply("<html>bad gateway</html>"),  # a proxy in the way, answering 200
        Reply(recorded("list-initial")),
    ]

    async def scenario(api: KubeAPI) -> None:
        await probe.until(lambda: len(api.requests) == 3 and bool(probe.lines(logging.INFO)))
        assert [r.query for r in api.requests] == [listing(), listing(), watching("48213")]
        [warning] = probe.lines(logging.WARNING)
        assert "unreadable EndpointSliceList" in warning
        assert probe.reports == [INITIAL]

    asyncio.run(following(probe, script, lambda api: source(api, account), scenario))


ROLES_SELECTOR = "app.kubernetes.io/part-of=llm"


@pytest.mark.e2e
def test_a_selector_labels_and_a_named_port(probe: Probe, account: Path) -> None:
    """One Service per role; their slices carry the warmroute.io/ labels; port `http` of two."""

    async def scenario(api: KubeAPI) -> None:
        await probe.until(lambda: len(api.requests) == 2 and len(probe.reports) == 1)
        assert api.requests[0].query == {"labelSelector": ROLES_SELECTOR, "limit": "500"}
        assert api.requests[1].query == watching("51020", ROLES_SELECTOR)

    def make(api: KubeAPI) -> KubernetesSource:
        src = source(api, account, service=None, selector=ROLES_SELECTOR, port_name="http")
        assert src.name == "kubernetes:-/app.kubernetes.io/part-of=llm"
        return src

    asyncio.run(following(probe, [Reply(recorded("list-roles"))], make, scenario))
    assert probe.reports == [
        {
            "http://10.244.4.11:8000": True,
            "http://10.244.4.12:8000": True,
            "http://10.244.5.21:8000": True,
            "http://10.244.5.22:8000": False,
            "http://[fd00:10:244:5::21]:8000": True,
        }
    ]
    warnings = probe.lines(logging.WARNING)
    assert len(warnings) == 2, warnings  # weight=heavy, role=decoder: each once
    assert any("warmroute.io/weight='heavy'" in w for w in warnings)
    assert any("warmroute.io/role='decoder'" in w for w in warnings)


def _slices(name: str) -> dict[str, dict[str, Any]]:
    return {s["metadata"]["name"]: s for s in recorded(name)["items"]}


def _cfg(**kube: Any) -> DiscoveryConfig:
    kube = {"service": "vllm", **kube}
    return DiscoveryConfig.model_validate({"kubernetes": kube, "weight": 1.5})


def test_members_take_role_engine_and_weight_from_the_slice_labels(probe: Probe) -> None:
    members = {m.cfg.url: m for m in members_of(_cfg(port_name="http"), _slices("list-roles"))}
    prefill = members["http://10.244.4.11:8000"].cfg
    assert (prefill.role, prefill.engine, prefill.weight) == ("prefill", "vllm", 2.0)
    decode = members["http://10.244.5.21:8000"].cfg
    assert (decode.role, decode.engine, decode.weight) == ("decode", "sglang", 1.5)  # template's
    v6 = members["http://[fd00:10:244:5::21]:8000"].cfg
    assert (v6.role, v6.engine) == ("mixed", "sglang")  # role=decoder ignored
    warned: set[tuple[str, str]] = set()
    members_of(_cfg(port_name="http"), _slices("list-roles"), warned)
    members_of(_cfg(port_name="http"), _slices("list-roles"), warned)
    assert len(probe.lines(logging.WARNING)) == 2 + 2  # the call above, and these two once


def test_the_port_is_the_named_one_else_the_first() -> None:
    first = members_of(_cfg(), _slices("list-roles"))
    assert {m.cfg.url.rsplit(":", 1)[1] for m in first} == {"9090"}  # `metrics`, listed first
    assert members_of(_cfg(port_name="grpc"), _slices("list-roles")) == []


def test_an_address_in_two_slices_is_one_member_ready_winning() -> None:
    slices = _slices("list-relist")
    twin = {**slices["vllm-q8m4d"], "endpoints": [*slices["vllm-q8m4d"]["endpoints"]]}
    twin["endpoints"].append(
        {"addresses": ["10.244.2.9"], "conditions": {"ready": False, "serving": True}}
    )
    members = members_of(_cfg(), {"vllm-7xk2p": slices["vllm-7xk2p"], "vllm-q8m4d": twin})
    urls = [m.cfg.url for m in members]
    assert sorted(urls) == sorted(RELISTED) and len(urls) == len(set(urls))
    assert all(m.serving for m in members)


# Credentials: in-cluster files and kubeconfigs, without a server.


@pytest.fixture(scope="module")
def pem_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A throwaway self-signed CA certificate and its key, made by openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: no certificate to load")
    d = tmp_path_factory.mktemp("pki")
    args = "req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=kubernetes"
    args += " -days 1 -addext basicConstraints=critical,CA:TRUE"
    subprocess.run(
        [openssl, *args.split(), "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return (d / "cert.pem").read_text(), (d / "key.pem").read_text()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _kubeconfig(path: Path, user: dict[str, Any], cluster: dict[str, Any]) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "gpu",
        "contexts": [{"name": "gpu", "context": {"cluster": "c", "user": "u", "namespace": "ml"}}],
        "clusters": [{"name": "c", "cluster": {"server": "https://10.0.0.1:6443", **cluster}}],
        "users": [{"name": "u", "user": user}],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def _k(**kube: Any) -> Any:
    return DiscoveryConfig.model_validate({"kubernetes": {"service": "vllm", **kube}}).kubernetes


def test_in_cluster_credentials(account: Path, pem_pair: tuple[str, str]) -> None:
    cert, _ = pem_pair
    (account / "ca.crt").write_text(cert)
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    creds = load_credentials(_k(), service_account_dir=account, env=env)
    assert creds.server == "https://[fd00::1]:443" and creds.namespace == "llm"
    assert creds.headers()["Authorization"] == "Bearer token-1"
    (account / "token").write_text("token-2")
    assert creds.headers()["Authorization"] == "Bearer token-2"  # re-read: it rotates
    assert not isinstance(creds.verify, bool)  # the pod's CA


def test_kubeconfig_token_ca_and_namespace(tmp_path: Path, pem_pair: tuple[str, str]) -> None:
    cert, _ = pem_pair
    path = _kubeconfig(
        tmp_path / "config", {"token": "kc-token"}, {"certificate-authority-data": _b64(cert)}
    )
    creds = load_credentials(_k(), service_account_dir=tmp_path, env={"KUBECONFIG": str(path)})
    assert (creds.server, creds.namespace) == ("https://10.0.0.1:6443", "ml")
    assert creds.headers()["Authorization"] == "Bearer kc-token"
    assert not isinstance(creds.verify, bool)
    over = load_credentials(
        _k(kubeconfig=str(path), api_server="http://127.0.0.1:8001"), service_account_dir=tmp_path
    )
    assert over.server == "http://127.0.0.1:8001"


def test_kubeconfig_client_certificate_and_insecure(
    tmp_path: Path, pem_pair: tuple[str, str]
) -> None:
    cert, key = pem_pair
    (tmp_path / "client.crt").write_text(cert)
    user = {"client-certificate": "client.crt", "client-key-data": _b64(key)}
    path = _kubeconfig(tmp_path / "config", user, {"insecure-skip-tls-verify": True})
    creds = load_credentials(_k(kubeconfig=str(path)), service_account_dir=tmp_path, env={})
    assert not isinstance(creds.verify, bool) and not creds.verify.check_hostname
    assert "Authorization" not in creds.headers()


def test_exec_plugins_and_no_credentials_are_declined_clearly(tmp_path: Path) -> None:
    user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "aws"}}
    path = _kubeconfig(tmp_path / "config", user, {})
    with pytest.raises(KubeError, match=r"exec or auth-provider plugin.*kubectl proxy"):
        load_credentials(_k(kubeconfig=str(path)), service_account_dir=tmp_path, env={})
    with pytest.raises(KubeError, match="no Kubernetes credentials"):
        load_credentials(_k(), service_account_dir=tmp_path, env={"HOME": str(tmp_path)})
    in_a_pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(KubeError, match="automountServiceAccountToken: true"):
        load_credentials(_k(), service_account_dir=tmp_path / "none", env=in_a_pod)
    # `kubectl proxy` holds the credentials: none of our own.
    creds = load_credentials(
        _k(api_server="http://127.0.0.1:8001"), service_account_dir=tmp_path, env={}
    )
    assert creds.server == "http://127.0.0.1:8001" and "Authorization" not in creds.headers()
