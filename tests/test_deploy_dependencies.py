"""What `pip install warmroute` (no extras) brings, and that the proxy needs no more.

The Docker image installs the package without extras. Here, fast and without the package
index, the base install is imitated in a child process whose imports of the bench extra's
modules (and gRPC's) fail as if they were not installed: `warmroute serve` must start, serve a
streamed request, export its metrics and never try them. That cannot see a base dependency
missing from pyproject.toml (the test environment has them all): tests/test_deploy_base_install.py
installs for real into a fresh virtual environment (slow, needs the index).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import free_port, readme_first_command

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Modules a deployment must not need: the bench extra's, and gRPC (the grpc extra).
NOT_IN_BASE = ("aiohttp", "tqdm", "numpy", "matplotlib", "grpc")

# Runs the CLI with NOT_IN_BASE made uninstallable; prints every attempt to import one, and on
# SIGUSR1 (uvicorn re-raises SIGTERM, so no atexit hook runs) those imported all the same.
BASE_INSTALL = textwrap.dedent(
    """
    import signal, sys
    BLOCKED = {blocked!r}

    class NotInstalled:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                print("IMPORT-ATTEMPT " + name, file=sys.stderr, flush=True)
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    signal.signal(signal.SIGUSR1, lambda *_: print("LOADED " + ",".join(
        sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)), file=sys.stderr, flush=True))
    from proxy.cli import main
    sys.exit(main(sys.argv[1:]))
    """
).format(blocked=NOT_IN_BASE)


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()  # type: ignore[union-attr]


def test_the_base_install_leaves_out_the_bench_and_grpc_dependencies() -> None:
    base = {_name(r) for r in PROJECT["dependencies"]}
    extras = PROJECT["optional-dependencies"]
    assert not base & {"aiohttp", "tqdm", "numpy", "matplotlib"}
    assert "opentelemetry-exporter-otlp-proto-grpc" not in base
    assert {_name(r) for r in extras["bench"]} == {"aiohttp", "tqdm", "numpy", "matplotlib"}
    # The README's test command installs [test]: it must hold every other extra's packages.
    test = {_name(r) for r in extras["test"]}
    for extra in ("bench", "grpc", "exact"):
        missing = {_name(r) for r in extras[extra]} - test
        assert not missing, f"[test] lacks {missing} from [{extra}]"


def test_the_readme_first_command_installs_what_the_demo_needs() -> None:
    first = readme_first_command()
    assert "warmroute demo" in first and ".[bench]" in first, first


def _run_base(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BASE_INSTALL, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        **kwargs,
    )


@pytest.mark.e2e
def test_serve_runs_and_streams_without_the_extras(
    fake_backends: Callable[..., list[Any]],
) -> None:
    [(_, backend)] = fake_backends(1)
    port = free_port()
    args = ["serve", "--port", str(port), "--backend", backend.url, "--log-level", "warning"]
    proc = subprocess.Popen(
        [sys.executable, "-c", BASE_INSTALL, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the proxy did not become ready"
            time.sleep(0.1)  # another process: nothing to wait on but its answer
        body = {
            "model": "test-model",
            "stream": True,
            "messages": [{"role": "user", "content": "hello chunks:3"}],
        }
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            text = "".join(r.iter_text())
        assert "data: [DONE]" in text
        metrics = httpx.get(url + "/metrics", timeout=5).text
        assert "gen_ai_server_time_to_first_token_seconds_bucket" in metrics
        proc.send_signal(signal.SIGUSR1)
        assert proc.stderr is not None
        loaded = next(line for line in proc.stderr if line.startswith("LOADED"))
        assert loaded == "LOADED \n", loaded  # none of them, even indirectly
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert "IMPORT-ATTEMPT" not in err, err[-2000:]


@pytest.mark.e2e
def test_bench_and_demo_say_which_extra_to_install_when_it_is_missing() -> None:
    for command in ("bench", "demo"):
        r = _run_base([command, "--requests", "5"])
        assert r.returncode == 2
        assert "pip install 'warmroute[bench]'" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    r = _run_base(["--help"])
    assert r.returncode == 0
    assert re.search(r"bench\s+\(not installed: pip install 'warmroute\[bench\]'\)", r.stdout)
