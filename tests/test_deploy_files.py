"""deploy/ files parse, the example config is valid, the scripts run (compose: test_compose.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from proxy.config import load_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "path",
    sorted((ROOT / "deploy").rglob("*.yaml")) + sorted((ROOT / "deploy").rglob("*.yml")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_deploy_yaml_parses(path):
    docs = list(yaml.safe_load_all(path.read_text()))  # Kubernetes files may hold several
    assert docs and all(d is not None for d in docs)


def test_example_config_is_valid():
    cfg = load_config(ROOT / "deploy" / "warmroute.example.yaml", env={})
    assert cfg.server.port == 8080


@pytest.mark.parametrize(
    "path", sorted((ROOT / "deploy").rglob("*.sh")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_deploy_scripts_are_executable_and_parse(path):
    import os
    import subprocess

    if path.read_text().startswith("#!"):  # a script; a file without one is sourced by them
        assert os.access(path, os.X_OK), f"{path.name} is not executable"
    subprocess.run(["bash", "-n", str(path)], check=True)
