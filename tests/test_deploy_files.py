"""docker-compose.yml and deploy/ stay correct without a Docker engine: parse and cross-check."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from proxy.cli import build_parser
from proxy.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def test_compose_services_use_real_commands_and_existing_files():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "jaeger", "proxy", "sim", "prometheus", "grafana"} <= set(services)
    parser = build_parser()
    for name in ("proxy", "sim"):
        svc = services[name]
        assert svc["build"] == "."
        args = parser.parse_args(svc["command"])  # the CLI accepts exactly these arguments
        assert args.func is not None
    env = services["proxy"]["environment"]
    cfg = load_config(env={k: v for k, v in env.items() if k.startswith("WARMROUTE_")})
    assert cfg.redis.url == "redis://redis:6379/0"
    assert [b.url for b in cfg.backends] == ["http://sim:8001", "http://sim:8002"]
    for dep in services["proxy"]["depends_on"]:
        assert dep in services
    for svc in services.values():
        for vol in svc.get("volumes", []):
            host = vol.split(":")[0]
            assert (ROOT / host).exists(), f"compose mounts missing {host}"


def test_dockerfile_installs_the_package_and_runs_the_cli():
    text = (ROOT / "Dockerfile").read_text()
    assert "pip install" in text and 'ENTRYPOINT ["warmroute"]' in text
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in shlex.split(line)[1:-1]:
                assert (ROOT / src).exists(), src


@pytest.mark.parametrize(
    "path",
    sorted((ROOT / "deploy").rglob("*.yaml")) + sorted((ROOT / "deploy").rglob("*.yml")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_deploy_yaml_parses(path):
    assert yaml.safe_load(path.read_text()) is not None


def test_example_config_is_valid():
    cfg = load_config(ROOT / "deploy" / "warmroute.example.yaml", env={})
    assert cfg.server.port == 8080


@pytest.mark.parametrize(
    "path", sorted((ROOT / "deploy").rglob("*.sh")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_deploy_scripts_are_executable_and_parse(path):
    import os
    import subprocess

    assert os.access(path, os.X_OK), f"{path.name} is not executable"
    subprocess.run(["bash", "-n", str(path)], check=True)
