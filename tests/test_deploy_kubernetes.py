"""deploy/kubernetes, rendered and validated offline: the Kustomize output against the
Kubernetes schemas (kubernetes-validate), probes against the proxy's real endpoints, and the
pieces against each other (selectors, ports, config, drain times)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from proxy.cli import build_parser
from proxy.config import Config, load_config
from proxy.otel_env import HONOURED
from proxy.server.app import create_app
from tests import kustomize_lite
from tests.support import ServerThread, free_port

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy/kubernetes"
OVERLAYS = [KUBE / "base", *sorted((KUBE / "overlays").iterdir())]
K8S_VERSION = "1.31.0"  # schemas shipped with kubernetes-validate
CRDS = {"ServiceMonitor"}  # no schema offline: checked by hand below


def kubectl_render(directory: Path) -> list[dict[str, Any]] | None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize` where installed, else tests/kustomize_lite.py (checked against it)."""
    return kubectl_render(directory) or kustomize_lite.render(directory)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _unsuffixed(docs: list[dict[str, Any]]) -> dict[tuple[str, str], Any]:
    text = yaml.safe_dump(docs, sort_keys=True)
    text = re.sub(r"(warmroute-config)-[a-z0-9]{10}\b", r"\1-HASH", text)
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load(text)}


@pytest.mark.parametrize("directory", OVERLAYS, ids=lambda p: p.name)
def test_the_small_renderer_agrees_with_kubectl_kustomize(directory: Path) -> None:
    real = kubectl_render(directory)
    if real is None:
        pytest.skip("kubectl is not installed: the rendering is kustomize_lite's alone")
    assert _unsuffixed(kustomize_lite.render(directory)) == _unsuffixed(real)


@pytest.mark.parametrize("directory", OVERLAYS, ids=lambda p: p.name)
def test_rendered_manifests_validate_against_the_kubernetes_schemas(directory: Path) -> None:
    docs = render(directory)
    kinds = {d["kind"] for d in docs}
    for wanted in ("Deployment", "Service", "ConfigMap", "HorizontalPodAutoscaler"):
        assert wanted in kinds
    assert {"PodDisruptionBudget", "NetworkPolicy", "ServiceAccount"} <= kinds
    for d in docs:
        if d["kind"] in CRDS:
            continue
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)  # raises on any error


def test_the_validator_rejects_a_broken_manifest() -> None:
    """The offline validation is not vacuous: a misspelt field fails it."""
    [deployment] = by_kind(render(KUBE / "base"), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def _proxy(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    [deployment] = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "warmroute"]
    pod = deployment["spec"]["template"]
    [container] = pod["spec"]["containers"]
    return deployment, pod, container


@pytest.mark.parametrize("directory", OVERLAYS, ids=lambda p: p.name)
def test_the_pods_config_is_valid_and_the_ports_and_drain_times_line_up(directory: Path) -> None:
    docs = render(directory)
    deployment, pod, container = _proxy(docs)
    args = build_parser("serve").parse_args(container["args"])
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "config"]
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == "config"]
    [cm] = [
        c
        for c in by_kind(docs, "ConfigMap")
        if c["metadata"]["name"] == volume["configMap"]["name"]
    ]
    key = str(Path(args.config).relative_to(mount["mountPath"]))
    config = Config.model_validate(yaml.safe_load(cm["data"][key]))  # as `serve --config` would
    assert config.server.host == "0.0.0.0"
    [port] = container["ports"]
    assert port["containerPort"] == config.server.port
    [service] = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "warmroute"]
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(config.server.port)
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    # Drain: preStop wait + the proxy's shutdown grace fit in the pod's termination grace.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["spec"]["terminationGracePeriodSeconds"] > int(pre_stop[1]) + (
        config.server.shutdown_grace_s
    )
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


@pytest.mark.parametrize("directory", OVERLAYS, ids=lambda p: p.name)
def test_selectors_and_references_find_the_proxy_pods(directory: Path) -> None:
    docs = render(directory)
    deployment, pod, _ = _proxy(docs)
    labels = pod["metadata"]["labels"]

    def selects(selector: dict[str, str]) -> bool:
        return bool(selector) and selector.items() <= labels.items()

    assert selects(deployment["spec"]["selector"]["matchLabels"])
    [service] = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "warmroute"]
    assert selects(service["spec"]["selector"])
    [pdb] = by_kind(docs, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"])
    for p in by_kind(docs, "NetworkPolicy"):  # the base's, and any an overlay adds
        assert selects(p["spec"]["podSelector"]["matchLabels"]), p["metadata"]["name"]
    [policy] = [p for p in by_kind(docs, "NetworkPolicy") if p["metadata"]["name"] == "warmroute"]
    [hpa] = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] >= 2
    ingress_ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert service["spec"]["ports"][0]["port"] in ingress_ports
    for monitor in by_kind(docs, "ServiceMonitor"):
        assert (
            monitor["spec"]["selector"]["matchLabels"].items()
            <= service["metadata"]["labels"].items()
        )
        ports = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
        assert {e["path"] for e in monitor["spec"]["endpoints"]} == {"/metrics"}


def test_environment_variables_are_ones_warmroute_reads() -> None:
    _, _, container = _proxy(render(KUBE / "overlays/example"))
    names = {e["name"] for e in container["env"]}
    otel = {n for n in names if n.startswith("OTEL_")}
    assert otel <= set(HONOURED), otel - set(HONOURED)
    assert names - otel <= {"POD_NAME", "POD_NAMESPACE"}  # the downward API, used in the above
    # ... and each one is: Kubernetes expands $(NAME) only from variables listed before it.
    for i, e in enumerate(container["env"]):
        if e["name"].startswith("POD_"):
            later = " ".join(str(x.get("value", "")) for x in container["env"][i + 1 :])
            assert f"$({e['name']})" in later, f"{e['name']} is set but nothing reads it"
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    cfg = load_config(flags={"backends": ["http://x:1"]}, env=env).telemetry
    assert cfg.traces_exporter == "otlp" and cfg.metrics_exporter == "none"  # scraped, not pushed


@pytest.mark.e2e
def test_probes_point_at_endpoints_the_proxy_serves(fake_backends: Any) -> None:
    _, _, container = _proxy(render(KUBE / "overlays/example"))
    probes = {
        kind: container[kind]["httpGet"]["path"]
        for kind in ("readinessProbe", "livenessProbe", "startupProbe")
    }
    assert probes["readinessProbe"] == "/ready" and probes["livenessProbe"] == "/health"
    # ... on the port the proxy listens on (by its name or number), in plain HTTP.
    [port] = container["ports"]
    for kind in probes:
        get = container[kind]["httpGet"]
        assert get["port"] in (port["name"], port["containerPort"]), kind
        assert get.get("scheme", "HTTP") == "HTTP", kind
    [(_, backend)] = fake_backends(1)
    port = free_port()
    cfg = load_config(flags={"backends": [backend.url], "port": port}, env={})
    with ServerThread(create_app(cfg), port=port) as proxy:
        for kind, path in probes.items():
            assert httpx.get(proxy.url + path, timeout=5).status_code == 200, kind
        metrics = httpx.get(proxy.url + "/metrics", timeout=5)  # what the ServiceMonitor reads
        assert metrics.status_code == 200 and "# TYPE" in metrics.text


def _config(docs: list[dict[str, Any]]) -> str:
    """The proxy's config file, as the pod mounts it."""
    _, pod, container = _proxy(docs)
    args = build_parser("serve").parse_args(container["args"])
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "config"]
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == "config"]
    [cm] = [
        c
        for c in by_kind(docs, "ConfigMap")
        if c["metadata"]["name"] == volume["configMap"]["name"]
    ]
    return str(cm["data"][str(Path(args.config).relative_to(mount["mountPath"]))])


def _granted(docs: list[dict[str, Any]], account: str, namespace: str) -> list[dict[str, Any]]:
    """The rules of every Role bound to the service account (namespace/account)."""
    roles = {r["metadata"]["name"]: r for r in by_kind(docs, "Role")}
    rules = []
    for binding in by_kind(docs, "RoleBinding"):
        bound = any(
            s["kind"] == "ServiceAccount"
            and s["name"] == account
            and s.get("namespace") == namespace
            for s in binding["subjects"]
        )
        if not bound:
            continue
        ref = binding["roleRef"]
        assert ref["apiGroup"] == "rbac.authorization.k8s.io" and ref["kind"] == "Role", ref
        role = roles[ref["name"]]  # a binding to a Role that is not there grants nothing
        assert role["metadata"].get("namespace") == binding["metadata"].get("namespace")
        rules += role["rules"]
    assert not by_kind(docs, "ClusterRoleBinding")  # nothing beyond the namespace
    return rules


@pytest.mark.parametrize("directory", OVERLAYS, ids=lambda p: p.name)
def test_rbac_is_what_discovery_needs_bound_to_the_proxys_account(
    directory: Path, tmp_path: Path
) -> None:
    """An overlay whose config follows `kubernetes:` binds the Deployment's service account
    to exactly get/list/watch on EndpointSlices in its namespace, mounts the token and lets
    the pods reach the API server; one that does not binds nothing."""
    docs = render(directory)
    deployment, pod, _ = _proxy(docs)
    namespace = deployment["metadata"].get("namespace")
    account = pod["spec"]["serviceAccountName"]
    assert [a["metadata"]["name"] for a in by_kind(docs, "ServiceAccount")] == [account]
    (tmp_path / "warmroute.yaml").write_text(_config(docs))
    config = load_config(tmp_path / "warmroute.yaml", env={})  # as `serve --config` reads it
    following = [d.kubernetes for d in config.discovered if d.kubernetes is not None]
    rules = _granted(docs, account, namespace) if namespace else []
    if not following:
        assert rules == [], "least privilege: no discovery, no Role"
        return
    assert pod["spec"]["automountServiceAccountToken"] is True  # the pod needs its token
    assert rules == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    for k in following:
        assert k.namespace in (None, namespace), "the Role is in the proxy's own namespace"
    egress = [
        p["port"]
        for policy in by_kind(docs, "NetworkPolicy")
        for rule in policy["spec"].get("egress", [])
        for p in rule.get("ports", [])
    ]
    assert {443, 6443} <= set(egress), "the pods must reach the API server"


def test_the_discovery_overlay_follows_a_service_it_deploys() -> None:
    """discover-vllm: its `kubernetes:` entry names a Service of the overlay, by a port that
    Service has, and the warmroute.io/ labels the slices inherit are ones the proxy takes."""
    docs = render(KUBE / "overlays/discover-vllm")
    config = Config.model_validate(yaml.safe_load(_config(docs)))
    assert not config.listed, "discovered, not listed"
    [entry] = config.discovered
    assert entry.kubernetes is not None and entry.dns is None
    assert entry.source == "kubernetes:-/vllm"
    [service] = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "vllm"]
    assert entry.kubernetes.service == service["metadata"]["name"]
    assert entry.kubernetes.port_name in {p["name"] for p in service["spec"]["ports"]}
    assert service["spec"]["clusterIP"] == "None"  # headless: its DNS name lists the pods too
    labels = service["metadata"]["labels"]
    overrides = {
        key: labels[f"warmroute.io/{key}"]
        for key in ("role", "engine", "weight")
        if f"warmroute.io/{key}" in labels
    }
    assert overrides, "the example shows the labels"
    entry.member("10.0.0.1", 8000, **overrides)  # valid values: raises otherwise
    _, pod, _ = _proxy(docs)
    selector = service["spec"]["selector"].items()
    assert not selector <= pod["metadata"]["labels"].items(), "it must not select the proxy"


# The API groups of a cluster with nothing installed (Kubernetes 1.31's built-in ones).
BUILT_IN_GROUPS = {"", "apps", "autoscaling", "policy", "networking.k8s.io"}
BUILT_IN_GROUPS |= {"rbac.authorization.k8s.io", "discovery.k8s.io"}


def test_every_overlay_lists_in_the_parametrized_set() -> None:
    names = {p.name for p in OVERLAYS}
    assert {"example", "discover-vllm", "try-simulated", "prometheus-operator"} <= names


@pytest.mark.parametrize("directory", OVERLAYS, ids=lambda p: p.name)
def test_only_the_prometheus_operator_overlay_needs_crds(directory: Path) -> None:
    """The base and the example apply on a bare cluster: the ServiceMonitor, whose CRD comes
    with the Prometheus Operator, is an optional component (components/servicemonitor)."""
    docs = render(directory)
    groups = {d["apiVersion"].rpartition("/")[0] for d in docs}
    if directory.name != "prometheus-operator":
        assert groups <= BUILT_IN_GROUPS, groups - BUILT_IN_GROUPS
        return
    assert groups - BUILT_IN_GROUPS == {"monitoring.coreos.com"}
    [monitor] = by_kind(docs, "ServiceMonitor")
    assert monitor["metadata"]["namespace"] == "llm"  # beside the Service it selects
    example = {(d["kind"], d["metadata"]["name"]) for d in render(KUBE / "overlays/example")}
    assert {(d["kind"], d["metadata"]["name"]) for d in docs} == example | {
        ("ServiceMonitor", "warmroute")
    }


def _images(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {
        f"{d['kind']}/{d['metadata']['name']}": c["image"]
        for d in docs
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
    }


def test_the_simulated_engines_are_the_backends_the_example_config_names() -> None:
    """try-simulated: `warmroute sim` pods answer at the URLs the example's config lists, from
    the same image as the proxy, on a port the proxy's NetworkPolicy lets it reach."""
    docs = render(KUBE / "overlays/try-simulated")
    [engines] = by_kind(docs, "StatefulSet")
    [service] = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "vllm"]
    assert engines["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"  # pod names resolve: vllm-0.vllm
    pod = engines["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    [container] = pod["spec"]["containers"]
    [port] = container["ports"]
    args = build_parser("sim").parse_args(container["args"])
    assert (args.host, args.port) == ("0.0.0.0", port["containerPort"])
    names = {f"{engines['metadata']['name']}-{i}" for i in range(engines["spec"]["replicas"])}
    config = Config.model_validate(yaml.safe_load(_config(docs)))
    urls = {b.url for b in config.listed}
    assert urls == {
        f"http://{n}.{service['metadata']['name']}:{port['containerPort']}" for n in names
    }
    images = _images(docs)
    assert images["StatefulSet/vllm"] == images["Deployment/warmroute"], images
    assert (
        images["Deployment/warmroute"]
        == _images(render(KUBE / "overlays/example"))["Deployment/warmroute"]
    ), "set the same image in overlays/example and overlays/try-simulated"
    egress = {
        p["port"]
        for policy in by_kind(docs, "NetworkPolicy")
        for rule in policy["spec"].get("egress", [])
        for p in rule.get("ports", [])
    }
    assert port["containerPort"] in egress
