"""docker-compose.yml and the configs it mounts hold together, checked without a Docker engine.

The compose file validates against the Compose Specification's JSON schema (vendored under
tests/schemas/); every host:port a config file targets is a service that exposes that port;
every environment variable set on the proxy is one warmroute reads; Prometheus's config passes
`promtool check config`; the collector's pipelines use only components it defines; every
datasource uid the dashboard uses is provisioned, and exemplar links open the trace store that
runs.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from proxy.cli import build_parser
from proxy.config import ConfigError, load_config
from proxy.otel_env import HONOURED

ROOT = Path(__file__).resolve().parent.parent
RAW = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
DEPLOY = ROOT / "deploy"
# The trace stores the stack can send to, and the profiles each needs.
TRACE_STORES = {"jaeger": set(), "tempo": {"tempo"}}
PUBLISHED = {"lb": "8080", "jaeger": "16686", "prometheus": "9090", "grafana": "3000"}


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR:-default} and $$, applied through a parsed document."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, default = m.group(1), m.group(3)
        return env.get(name) or (default if default is not None else "")

    return re.sub(r"\$\$|\$\{([A-Z_][A-Z0-9_]*)(:-([^}]*))?\}", one, value)


def compose(trace_store: str = "jaeger") -> dict[str, Any]:
    return interpolate(RAW, {"TRACE_STORE": trace_store} if trace_store != "jaeger" else {})


def services() -> dict[str, Any]:
    return compose()["services"]


def expose(svc: Mapping[str, Any]) -> set[str]:
    return {str(p) for p in svc.get("expose", [])}


# -- the file itself ------------------------------------------------------------------------


def test_compose_file_validates_against_the_compose_specification() -> None:
    schema = json.loads((ROOT / "tests/schemas/compose-spec.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(RAW), key=str)
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


@pytest.mark.parametrize(
    ("where", "key", "value"),
    [
        (("services", "proxy"), "helthcheck", {"test": ["CMD", "true"]}),
        (("services", "proxy", "healthcheck"), "intervall", "5s"),
        (("services", "proxy", "depends_on", "redis"), "condition", "service_ready"),
        (("services", "grafana"), "entrypoint", {"sh": "-c"}),
    ],
)
def test_the_compose_schema_rejects_what_compose_would(
    where: tuple[str, ...], key: str, value: Any
) -> None:
    """The validation above is not vacuous: a misspelt key or a wrong value fails it."""
    schema = json.loads((ROOT / "tests/schemas/compose-spec.json").read_text())
    broken = copy.deepcopy(RAW)
    node = broken
    for part in where:
        node = node[part]
    node[key] = value
    assert list(jsonschema.Draft7Validator(schema).iter_errors(broken))


def test_every_service_has_a_healthcheck_and_waits_for_healthy_dependencies() -> None:
    for name, svc in services().items():
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on must name a condition"
        for dep, how in deps.items():
            assert dep in RAW["services"], f"{name} depends on unknown {dep}"
            assert how["condition"] == "service_healthy", f"{name} -> {dep}"
            # A dependency in a profile of its own is optional, else it would block `up`.
            if set(RAW["services"][dep].get("profiles", [])) - set(svc.get("profiles", [])):
                assert how.get("required") is False, f"{name} -> {dep} needs required: false"


def test_images_are_pinned_and_only_the_proxy_and_ui_ports_are_published() -> None:
    for name, svc in services().items():
        image = svc.get("image", "")
        if "build" in svc:
            assert image.endswith(":local"), name  # built here
            inline = (
                svc["build"].get("dockerfile_inline", "") if isinstance(svc["build"], dict) else ""
            )
            images = re.findall(r"^FROM (\S+)", inline, re.M)
        else:
            images = [image]
        for ref in images:
            tag = ref.rsplit(":", 1)[-1] if ":" in ref else ""
            assert tag and tag != "latest" and re.search(r"\d", tag), f"{name}: pin {ref}"
        ports = svc.get("ports", [])
        if name in PUBLISHED:
            assert ports == [f"127.0.0.1:{PUBLISHED[name]}:{PUBLISHED[name]}"], name
        else:
            assert not ports, f"{name} publishes {ports}: keep it on the compose network"


def test_mounted_files_exist_and_the_proxy_outlives_its_drain() -> None:
    for name, svc in services().items():
        for vol in svc.get("volumes", []):
            host = vol.split(":")[0]
            if host.startswith("."):
                assert (ROOT / host).exists(), f"{name} mounts missing {host}"
    proxy = services()["proxy"]
    grace = load_config(env={"WARMROUTE_BACKENDS": "http://x:1"}).server.shutdown_grace_s
    assert int(proxy["stop_grace_period"].rstrip("s")) > grace
    assert proxy["deploy"]["replicas"] >= 2 and "container_name" not in proxy


# -- warmroute's own services --------------------------------------------------------------


def test_the_proxy_and_sim_commands_parse_and_listen_on_their_exposed_ports() -> None:
    s = services()
    for name in ("proxy", "sim"):
        args = build_parser(s[name]["command"][0]).parse_args(s[name]["command"])
        assert args.func is not None
    sim = build_parser("sim").parse_args(s["sim"]["command"])
    assert expose(s["sim"]) == {str(sim.port + i) for i in range(sim.instances)}
    # serve's port comes from the image (Dockerfile ENV), checked against what compose exposes.
    env = dict(re.findall(r"(WARMROUTE_\w+)=(\S+)", (ROOT / "Dockerfile").read_text()))
    assert expose(s["proxy"]) == {env["WARMROUTE_PORT"]} and env["WARMROUTE_HOST"] == "0.0.0.0"
    assert f":{env['WARMROUTE_PORT']}/ready" in str(s["proxy"]["healthcheck"]["test"])


def test_every_environment_variable_set_on_the_proxy_is_one_warmroute_reads() -> None:
    env = {k: str(v) for k, v in services()["proxy"]["environment"].items()}
    otel = {k for k in env if k.startswith("OTEL_")}
    assert otel <= set(HONOURED), otel - set(HONOURED)
    assert set(env) - otel == {k for k in env if k.startswith("WARMROUTE_")}
    cfg = load_config(env=env)  # unknown WARMROUTE_* keys are an error here
    assert cfg.redis.url == "redis://redis:6379/0"
    assert [(b.url, b.engine) for b in cfg.backends] == [
        ("http://sim:8001", "auto"),  # detected as vllm from the sims' /metrics
        ("http://sim:8002", "auto"),
    ]
    assert (cfg.telemetry.traces_exporter, cfg.telemetry.metrics_exporter) == ("otlp", "otlp")
    # ... which holds because a WARMROUTE_* name warmroute does not read stops the start.
    with pytest.raises(ConfigError, match="WARMROUTE_REDIS_ULR is not a warmroute setting"):
        load_config(env={**env, "WARMROUTE_REDIS_ULR": env["WARMROUTE_REDIS_URL"]})


# -- every host:port a config targets is a service that exposes it --------------------------


@dataclass(frozen=True)
class ScrapeTarget:
    job: str
    host: str
    port: str
    by_dns: bool  # a dns_sd_configs name (no target while it does not resolve), else static


def scrape_targets() -> list[ScrapeTarget]:
    """Every host:port Prometheus's config names, static or found by DNS."""
    prom = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    out = []
    for job in prom["scrape_configs"]:
        name = job["job_name"]
        assert set(job) - {"job_name", "metrics_path"} <= {"static_configs", "dns_sd_configs"}, (
            f"{name}: a kind of target this test does not check"
        )
        for sd in job.get("dns_sd_configs", []):
            assert sd["type"] == "A", f"{name}: an A record has no port; SRV is not used here"
            out += [ScrapeTarget(name, host, str(sd["port"]), True) for host in sd["names"]]
        for sc in job.get("static_configs", []):
            for target in sc["targets"]:
                host, port = target.rsplit(":", 1)
                out.append(ScrapeTarget(name, host, port, False))
    return out


def _targets(trace_store: str) -> Iterator[tuple[str, str, str]]:
    """(where, host, port) of every address the stack's configs point at."""
    s = compose(trace_store)["services"]
    env = s["proxy"]["environment"]
    for url in load_config(env={"WARMROUTE_BACKENDS": env["WARMROUTE_BACKENDS"]}).backends:
        u = urlsplit(url.url)
        yield "WARMROUTE_BACKENDS", u.hostname or "", str(u.port)
    for var in ("WARMROUTE_REDIS_URL", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        u = urlsplit(env[var])
        yield var, u.hostname or "", str(u.port)
    for target in scrape_targets():
        yield f"prometheus {target.job}", target.host, target.port
    collector = yaml.safe_load((DEPLOY / "otel-collector/config.yaml").read_text())
    collector_env = s["otel-collector"]["environment"]
    for name, exporter in collector["exporters"].items():
        endpoint = exporter.get("endpoint", "")
        endpoint = re.sub(r"\$\{env:(\w+)\}", lambda m: collector_env[m.group(1)], endpoint)
        host, port = endpoint.rsplit(":", 1)
        if host != "0.0.0.0":
            yield f"collector {name}", host, port
    datasources = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/datasources.yaml").read_text()
    )
    for ds in datasources["datasources"]:
        u = urlsplit(ds["url"])
        yield f"grafana {ds['uid']}", u.hostname or "", str(u.port)
    nginx = (DEPLOY / "nginx/nginx.conf").read_text()
    for host, port in re.findall(r"^\s*server (\w[\w-]*):(\d+)", nginx, re.M):
        yield "nginx upstream", host, port


@pytest.mark.parametrize("trace_store", sorted(TRACE_STORES))
def test_every_address_a_config_targets_is_a_service_exposing_that_port(trace_store: str) -> None:
    s = compose(trace_store)["services"]
    seen = set()
    for where, host, port in _targets(trace_store):
        assert host in s, f"{where} targets {host}, which is no compose service"
        assert port in expose(s[host]), (
            f"{where} targets {host}:{port}; {host} exposes {expose(s[host])}"
        )
        seen.add(host)
    # The traces go where TRACE_STORE says, and that service runs with the profiles named for it.
    assert trace_store in seen
    assert set(s[trace_store].get("profiles", [])) <= TRACE_STORES[trace_store]


def _profiles(svc: Mapping[str, Any]) -> set[str]:
    return set(svc.get("profiles", []))


def test_no_static_scrape_target_is_down_for_want_of_a_profile() -> None:
    """A static target must run whenever Prometheus does (no profile of its own, or every
    profile Prometheus has); a service that runs only under another profile is found by DNS,
    which gives no target while compose does not resolve its name."""
    s = services()
    prometheus = _profiles(s["prometheus"])
    for t in scrape_targets():
        if not t.by_dns:
            theirs = _profiles(s[t.host])
            assert not theirs or prometheus <= theirs, (
                f"{t.job} scrapes {t.host}:{t.port} statically, but {t.host} runs only with "
                f"--profile {' or '.join(sorted(theirs))}: use dns_sd_configs (type A)"
            )


def _documented_gpu_backends() -> list[str]:
    """The WARMROUTE_BACKENDS value docker-compose.yml and docs/deployment.md give for
    `--profile gpu` (the same in both)."""
    found = [
        re.findall(r"WARMROUTE_BACKENDS='([^']+)'.*?--profile gpu", path.read_text(), re.S)
        for path in (ROOT / "docker-compose.yml", ROOT / "docs/deployment.md")
    ]
    assert found[0] and found[0] == found[1], found
    return found[0]


def test_every_engine_the_proxy_can_be_pointed_at_is_scraped_on_the_port_it_serves() -> None:
    s = services()
    engines = {(t.host, t.port) for t in scrape_targets() if t.job == "engines"}
    settings = [s["proxy"]["environment"]["WARMROUTE_BACKENDS"], *_documented_gpu_backends()]
    named = set()
    for value in settings:
        for backend in load_config(env={"WARMROUTE_BACKENDS": value}).backends:
            u = urlsplit(backend.url)
            named.add((u.hostname or "", str(u.port)))
    assert {("vllm-0", "8000"), ("vllm-1", "8000"), ("sim", "8001")} <= named
    assert named <= engines, f"not scraped: {named - engines}"
    # Every engine service is one of them, and its server listens on the port scraped.
    for name, svc in s.items():
        if name == "sim" or svc.get("image", "").startswith("vllm/"):
            assert {p for h, p in engines if h == name} == expose(svc), name
        if svc.get("image", "").startswith("vllm/"):
            [port] = [a.split("=", 1)[1] for a in svc["command"] if a.startswith("--port=")]
            assert expose(svc) == {port}, name


def test_grafana_anonymous_users_only_view_and_the_admin_password_is_no_default() -> None:
    raw_env = RAW["services"]["grafana"]["environment"]
    for trace_store in TRACE_STORES:
        env = compose(trace_store)["services"]["grafana"]["environment"]
        assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
        assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] not in ("Admin", "Editor")
        # Nothing else lifts what a Viewer may do.
        assert str(env.get("GF_USERS_VIEWERS_CAN_EDIT", "false")).lower() == "false"
        assert "GF_AUTH_ANONYMOUS_ORG_NAME" not in env and "GF_SECURITY_ADMIN_USER" not in env
    # The role is written out, not taken from a variable that could say Admin.
    assert raw_env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    # The password is the operator's, with no default literal (Grafana's own is `admin`) ...
    assert raw_env["GF_SECURITY_ADMIN_PASSWORD"] == "${GRAFANA_ADMIN_PASSWORD:-}"
    assert not {k for k in raw_env if k.startswith("GF_SECURITY_ADMIN_PASSWORD__")}


def _grafana_start(env: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """Run the grafana service's entrypoint script with `env`, `env -0` standing in for
    Grafana: (what it printed, the environment it would start Grafana with)."""
    entrypoint = services()["grafana"]["entrypoint"]
    assert entrypoint[:2] == ["/bin/sh", "-c"] and entrypoint[-1] == "/run.sh"
    out = subprocess.run(
        ["sh", "-c", entrypoint[2], entrypoint[3], "env", "-0"],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        timeout=10,
        check=True,
    ).stdout.decode()
    printed, _, environ = out.rpartition("\n")
    return printed, dict(v.split("=", 1) for v in environ.split("\0") if "=" in v)


def test_grafana_gets_a_random_admin_password_unless_one_is_given(tmp_path: Path) -> None:
    """... and when none is given, the entrypoint makes a random one and prints it once."""
    fresh = {"GF_PATHS_DATA": str(tmp_path), "GF_SECURITY_ADMIN_PASSWORD": ""}
    printed, env = _grafana_start(fresh)
    password = env["GF_SECURITY_ADMIN_PASSWORD"]
    assert len(password) >= 20 and password != "admin"
    assert f"user admin, password {password} " in printed
    assert _grafana_start(fresh)[1]["GF_SECURITY_ADMIN_PASSWORD"] != password  # random
    given = {**fresh, "GF_SECURITY_ADMIN_PASSWORD": "chosen-by-operator"}
    printed, env = _grafana_start(given)
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == "chosen-by-operator" and printed == ""
    # Its data exists (a restart): Grafana keeps the first password; a new one would be a lie.
    (tmp_path / "grafana.db").write_text("")
    printed, env = _grafana_start(fresh)
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == ""
    assert "printed when its data was created" in printed and "reset-admin-password" in printed


def test_nginx_streams_without_buffering_and_waits_longer_than_a_first_byte() -> None:
    nginx = (DEPLOY / "nginx/nginx.conf").read_text()
    assert re.search(r"proxy_buffering off;", nginx)
    timeout = int(re.search(r"proxy_read_timeout (\d+)s;", nginx).group(1))  # type: ignore[union-attr]
    assert timeout > load_config(env={"WARMROUTE_BACKENDS": "http://x:1"}).timeouts.first_byte_s
    assert re.search(r"resolver 127\.0\.0\.11", nginx)  # replicas are re-resolved


# -- Prometheus, the collector, Grafana ------------------------------------------------------


def _promtool() -> str:
    found = shutil.which("promtool")
    if found:
        return found
    why = "`promtool` is not installed (Debian package `prometheus`: apt-get install prometheus)"
    if os.environ.get("CI"):
        pytest.fail(f"{why}; .ci/run installs it")
    pytest.skip(why)


@pytest.mark.e2e
def test_promtool_accepts_the_prometheus_config() -> None:
    r = subprocess.run(
        [_promtool(), "check", "config", str(DEPLOY / "prometheus/prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.e2e
def test_the_alerting_rules_load_and_fire_on_the_series_they_watch() -> None:
    for args in (
        ["check", "rules", str(DEPLOY / "prometheus/alerts.yml")],
        ["test", "rules", str(ROOT / "tests/prometheus/alerts_test.yml")],
    ):
        r = subprocess.run([_promtool(), *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def test_collector_pipelines_use_defined_components_and_send_no_metrics_to_the_trace_store() -> (
    None
):
    cfg = yaml.safe_load((DEPLOY / "otel-collector/config.yaml").read_text())
    service = cfg["service"]
    assert set(service["extensions"]) <= set(cfg["extensions"])
    for name, pipeline in service["pipelines"].items():
        assert name.split("/")[0] in ("traces", "metrics", "logs")
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in cfg[kind], f"pipeline {name}: {kind} {component} undefined"
        # memory_limiter first, as the collector's docs require
        assert pipeline["processors"][0] == "memory_limiter"
    pipelines = service["pipelines"]
    assert pipelines["traces"]["exporters"] == ["otlp/traces"]
    assert "otlp/traces" not in pipelines["metrics"]["exporters"]
    prom = cfg["exporters"]["prometheus"]
    assert prom["enable_open_metrics"] is True  # exemplars only travel in OpenMetrics
    # Every defined component is used (a stray exporter to a missing host logs errors).
    used = {
        c
        for p in pipelines.values()
        for k in ("receivers", "processors", "exporters")
        for c in p.get(k, [])
    }
    for kind in ("receivers", "processors", "exporters"):
        assert set(cfg[kind]) <= used, f"unused {kind}: {set(cfg[kind]) - used}"
    # The ports it listens on are the ones compose exposes.
    listens = {
        cfg["receivers"]["otlp"]["protocols"][p]["endpoint"].rsplit(":", 1)[1]
        for p in ("grpc", "http")
    } | {
        prom["endpoint"].rsplit(":", 1)[1],
        cfg["extensions"]["health_check"]["endpoint"].rsplit(":", 1)[1],
    }
    assert listens == expose(services()["otel-collector"])
    assert ":13133/" in " ".join(services()["otel-collector"]["healthcheck"]["test"])


def _dashboard() -> dict[str, Any]:
    return json.loads((DEPLOY / "grafana/dashboards/warmroute.json").read_text())


def _uids(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        ds = node.get("datasource")
        if isinstance(ds, dict) and "uid" in ds:
            yield ds["uid"]
        for v in node.values():
            yield from _uids(v)
    elif isinstance(node, list):
        for v in node:
            yield from _uids(v)


@pytest.mark.parametrize("trace_store", sorted(TRACE_STORES))
def test_every_datasource_the_dashboard_uses_is_provisioned_and_exemplars_open_a_running_store(
    trace_store: str,
) -> None:
    text = (DEPLOY / "grafana/provisioning/datasources/datasources.yaml").read_text()
    grafana_env = compose(trace_store)["services"]["grafana"]["environment"]
    # Grafana expands $VAR / ${VAR} from its environment when it provisions the file.
    text = re.sub(r"\$\{?(\w+)\}?", lambda m: str(grafana_env[m.group(1)]), text)
    provisioned = {ds["uid"]: ds for ds in yaml.safe_load(text)["datasources"]}
    used = set(_uids(_dashboard()))
    assert used and used <= set(provisioned), used - set(provisioned)
    # Every query names its datasource by uid (a name, or none, would escape the check above
    # and fall to whatever Grafana's default is).
    dashboard = _dashboard()
    queries = [p for p in dashboard["panels"] if p["type"] != "row"]
    queries += dashboard["templating"]["list"]
    for node in queries + [t for p in queries for t in p.get("targets", [])]:
        assert isinstance(node.get("datasource"), dict) and node["datasource"].get("uid"), node
    for ds in provisioned.values():
        for link in ds.get("jsonData", {}).get("exemplarTraceIdDestinations", []):
            assert link["datasourceUid"] == trace_store
            host = urlsplit(provisioned[trace_store]["url"]).hostname
            assert host == trace_store  # the service the collector sends the traces to


def test_dashboard_exemplars_come_from_the_collectors_copy() -> None:
    """GET /metrics has no exemplars; the collector's otlp_ series do (see prometheus.yml)."""
    collector = yaml.safe_load((DEPLOY / "otel-collector/config.yaml").read_text())
    prefix = collector["exporters"]["prometheus"]["namespace"] + "_"
    targets = [t for p in _dashboard()["panels"] for t in p.get("targets", [])]
    with_exemplars = [t for t in targets if t.get("exemplar")]
    assert with_exemplars
    for t in targets:
        assert bool(t.get("exemplar")) == (prefix in t["expr"]), t["expr"]


# -- the image ------------------------------------------------------------------------------


def test_the_image_is_multi_stage_non_root_proxy_only_with_a_healthcheck() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    installs = re.findall(r"^RUN .*pip install[^\n]*", text, re.M)
    assert installs and all(i.endswith(" .") for i in installs), installs  # no [extras]
    health = re.search(r"^HEALTHCHECK [^\n]*\\\n\s*CMD (\[.*\])$", text, re.M)
    assert health and "/health" in health.group(1)
    json.loads(health.group(1))  # exec form, valid JSON
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            for src in shlex.split(line)[1:-1]:
                assert (ROOT / src).exists(), src
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "tests" in ignored and ".venv" in ignored
