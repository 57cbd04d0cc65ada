"""The image's install, for real: `pip install .` without extras into a fresh virtual
environment, from what the Dockerfile copies, and the two commands the compose stack runs from
that image, `warmroute sim` and `warmroute serve`, proxying a stream between them.

tests/test_deploy_dependencies.py only hides the extras from the test environment, which has
every dependency installed: a base dependency missing from pyproject.toml would pass there and
fail in the image. Here nothing but the base dependencies is installed, each process reports
the modules it loaded, and the proxy which hot path runs (setup.py compiles it where a C
compiler is). It needs the package index (pip's cache makes it ~60 s on 2 cores, half of it
compiling); without one it skips, except in CI (`.ci/run`), where it fails.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import free_port
from tests.test_deploy_dependencies import NOT_IN_BASE

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.e2e]

# Loaded by every interpreter of the test venv (a .pth line): on SIGUSR1, write the top-level
# names in sys.modules to the file WARMROUTE_TEST_MODULES names. uvicorn re-raises SIGTERM, so
# an exit hook would not run.
PROBE = """\
import os, signal, sys

_path = os.environ.get("WARMROUTE_TEST_MODULES")
if _path:
    def _dump(*_):
        with open(_path + ".tmp", "w") as f:
            f.write("\\n".join(sorted({m.split(".")[0] for m in sys.modules})))
        os.replace(_path + ".tmp", _path)

    signal.signal(signal.SIGUSR1, _dump)
"""
# Network failures of pip (then the test skips outside CI); anything else is a real failure.
OFFLINE = (
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "No route to host",
    "Could not fetch URL",
)


def _image_sources() -> list[tuple[str, str]]:
    """(source, destination) of each COPY into the Dockerfile's build stage, where it runs
    `pip install .`."""
    text = (ROOT / "Dockerfile").read_text()
    build_stage = text.split("\nFROM ", 2)[1]
    copies = []
    for line in build_stage.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            *sources, dest = shlex.split(line)[1:]
            copies += [(src, dest) for src in sources]
    assert copies, "the Dockerfile's build stage copies nothing"
    return copies


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("base-install")
    src = work / "src"
    src.mkdir()
    for source, dest in _image_sources():
        target = src / dest / Path(source).name if dest.endswith("/") else src / dest
        if (ROOT / source).is_dir():
            shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / source, target)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # Not --no-cache-dir as in the image: pip's cache (warm from installing the test
    # environment) saves the downloads; what is installed is the same.
    r = subprocess.run(
        [str(venv / "bin/python"), "-m", "pip", "install", "--disable-pip-version-check", "."],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if r.returncode != 0:
        if any(s in r.stdout + r.stderr for s in OFFLINE) and not os.environ.get("CI"):
            pytest.skip("the package index is unreachable: `pip install .` cannot run")
        pytest.fail(f"pip install . failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "_warmroute_test_probe.py").write_text(PROBE)
    (site / "_warmroute_test_probe.pth").write_text("import _warmroute_test_probe\n")
    return venv


def test_the_base_install_has_none_of_the_extras_packages(base_venv: Path) -> None:
    """Not pulled in by a base dependency either."""
    check = "import importlib.util as u, sys; print(*[m for m in sys.argv[1:] if u.find_spec(m)])"
    r = subprocess.run(
        [str(base_venv / "bin/python"), "-c", check, *NOT_IN_BASE],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert r.stdout.split() == [], f"installed without being asked for: {r.stdout}"


def test_bench_and_demo_name_the_extra_they_need_in_the_base_install(base_venv: Path) -> None:
    for command in ("bench", "demo"):
        r = subprocess.run(
            [str(base_venv / "bin/warmroute"), command, "--requests", "5"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=base_venv,
        )
        assert r.returncode == 2 and "pip install 'warmroute[bench]'" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


class Command:
    """One `warmroute ...` process of the base venv, that reports its modules on request."""

    def __init__(self, venv: Path, modules: Path, *args: str, **env_vars: str) -> None:
        self.modules = modules
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("WARMROUTE_", "OTEL_")) and k != "PYTHONPATH"
        }  # nothing of the checkout or of this machine's settings: only what was installed
        env.update(env_vars, WARMROUTE_TEST_MODULES=str(modules))
        self.proc = subprocess.Popen(
            [str(venv / "bin/warmroute"), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=modules.parent,  # not the checkout, whose proxy/ would shadow the install
            env=env,
        )

    def wait_until_ok(self, url: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, self.stderr()
            assert time.monotonic() < deadline, f"{url} did not answer 200"
            time.sleep(0.1)  # another process: nothing to wait on but its answer

    def loaded(self) -> set[str]:
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not self.modules.exists():
            assert self.proc.poll() is None, self.stderr()
            assert time.monotonic() < deadline, "no module list after SIGUSR1"
            time.sleep(0.05)
        return set(self.modules.read_text().split())

    def stderr(self) -> str:
        if self.proc.poll() is None:
            self.stop()
        return self.proc.stderr.read()[-3000:] if self.proc.stderr else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def commands() -> Iterator[list[Command]]:
    started: list[Command] = []
    yield started
    for c in started:
        c.stop()


def test_serve_proxies_a_stream_from_sim_with_only_the_base_dependencies(
    base_venv: Path, tmp_path: Path, commands: list[Command]
) -> None:
    sim_port, proxy_port = free_port(), free_port()
    sim = Command(
        base_venv, tmp_path / "sim.modules",
        "sim", "--port", str(sim_port), "--device", "h100", "--time-scale", "20",
    )  # fmt: skip
    commands.append(sim)
    sim_url = f"http://127.0.0.1:{sim_port}"
    sim.wait_until_ok(sim_url + "/health")
    proxy = Command(
        base_venv, tmp_path / "serve.modules",
        "serve", "--port", str(proxy_port), "--admin-port", str(proxy_port),
        "--backend", sim_url, "--log-level", "warning",
        WARMROUTE_HEALTH__METRICS_SCRAPE_S="0.2",
    )  # fmt: skip
    commands.append(proxy)
    url = f"http://127.0.0.1:{proxy_port}"
    proxy.wait_until_ok(url + "/ready")

    [model] = [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]
    body = {
        "model": model,
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hello from the base install"}],
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3, events
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert "gen_ai_server_time_to_first_token_seconds_bucket" in metrics
    # setup.py compiled the hot path wherever the C compiler Python was built with is there.
    hot_path = httpx.get(url + "/admin/build", timeout=10).json()["hot_path"]
    if shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]):
        assert hot_path == {"implementation": "compiled", "why": ""}, hot_path
    # The proxy reads the sim's /metrics as well: it finds vLLM's names and the KV gauge.
    deadline = time.monotonic() + 20
    while True:
        [backend] = httpx.get(url + "/admin/backends", timeout=10).json()["backends"]
        if backend["engine"] == "vllm" and backend["load"]["kv_usage"] is not None:
            break
        assert time.monotonic() < deadline, backend
        time.sleep(0.1)  # the proxy's next scrape: nothing to wait on but its answer

    for command in (sim, proxy):
        loaded = command.loaded()
        assert "proxy" in loaded  # it is warmroute's own process that reported
        assert not loaded & set(NOT_IN_BASE), (command.proc.args, loaded & set(NOT_IN_BASE))
