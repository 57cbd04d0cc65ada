"""SIGHUP re-reads the config file's `backends:` in a running `warmroute serve` (a real process,
real signals): a valid file changes the fleet, an invalid one is refused with the same error as
at start and the running fleet is kept; with workers, every worker reloads."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support import free_port, until

pytestmark = pytest.mark.e2e
MODEL = "test-model"


def write(path: Path, backends: list[Any], **more: Any) -> None:
    path.write_text(yaml.safe_dump({"backends": backends, **more}))


@contextmanager
def serve(
    config: Path, log: Path, workers: int = 1
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    args = [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(port)]
    args += ["--admin-port", str(port), "--workers", str(workers)]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        until(lambda: _ready(url) or proc.poll() is not None, "the proxy to start")
        assert proc.poll() is None, log.read_text()
        yield url, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def states(url: str) -> dict[str, str]:
    return {b["name"]: b["state"] for b in httpx.get(url + "/admin/backends").json()["backends"]}


def test_sighup_applies_a_valid_file_and_refuses_an_invalid_one(
    tmp_path: Path, fake_backends: Callable[..., Any]
) -> None:
    (_, a), (_, b) = fake_backends(2)
    name_a, name_b = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
    config, log = tmp_path / "warmroute.yaml", tmp_path / "serve.log"
    write(config, [{"url": a.url, "models": [MODEL]}])
    with serve(config, log) as (url, proc):
        assert states(url) == {name_a: "serving"}
        write(config, [{"url": a.url, "models": [MODEL]}, {"url": b.url}])
        proc.send_signal(signal.SIGHUP)
        until(lambda: states(url).get(name_b) == "serving", "b to join")
        assert proc.poll() is None  # SIGHUP no longer stops the proxy

        write(config, [{"url": "ftp://nowhere"}])
        proc.send_signal(signal.SIGHUP)
        until(lambda: "refused" in log.read_text(), "the refusal")
        assert states(url) == {name_a: "serving", name_b: "serving"}  # kept
        text = log.read_text()
        assert "config reload (SIGHUP) refused; the running fleet is kept" in text
        assert "backends.0.url: must be an http(s) URL" in text  # the error as at start

        write(config, [{"url": b.url}], server={"max_body_bytes": 1024})
        proc.send_signal(signal.SIGHUP)
        until(lambda: name_a not in states(url), "a to leave")
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200 and r.headers["x-warmroute-backend"] == name_b
        text = log.read_text()
        assert "server changed; these take effect at the next restart" in text
        assert f"backend {name_a} left the fleet" in text
        assert "Traceback" not in text


def test_sighup_reloads_every_worker(tmp_path: Path, fake_backends: Callable[..., Any]) -> None:
    (_, a), (_, b) = fake_backends(2)
    config, log = tmp_path / "warmroute.yaml", tmp_path / "serve.log"
    write(config, [{"url": a.url, "models": [MODEL]}])
    with serve(config, log, workers=2) as (_url, proc):
        until(lambda: log.read_text().count("warmroute ready") == 2, "both workers")
        write(config, [{"url": a.url, "models": [MODEL]}, {"url": b.url, "models": [MODEL]}])
        proc.send_signal(signal.SIGHUP)
        until(lambda: log.read_text().count(f"backend 127.0.0.1:{b.port} joined") == 2, "2 joins")
        assert proc.poll() is None
        assert "restarting processes" not in log.read_text()  # uvicorn's own SIGHUP: not used
