"""The per-chunk hot path compiled, and its pure Python kept as the tested fallback.

setup.py compiles proxy.HOT_PATH with mypyc where it can; proxy/__init__.py imports the
sources instead when WARMROUTE_PURE_PYTHON=1, when one was edited since it was compiled, or
when there is nothing compiled. The suite runs whichever is installed; here the hot path's own
tests run again under the other (the pure one, when the suite runs compiled), the choice is
checked on a package laid out as an install would be, and what runs is reported.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Any

import httpx
import pytest

import proxy
from proxy.config import load_config
from proxy.server.serve import hot_path_line

ROOT = Path(__file__).resolve().parent.parent
# The tests of the compiled modules that run again under the pure Python (~17 s): the meter
# and the scans, the prefix index on its dict maps, the relay's step in the connection's
# callback and its parts, the body writer and the ASGI toolkit, the connection.
HOT_PATH_TESTS = (
    "tests/test_meter.py",
    "tests/test_eventscan.py",
    "tests/test_blockmap.py",
    "tests/test_prefixhash.py",
    "tests/test_index.py",
    "tests/test_upstream_push.py",
    "tests/test_relay_parts.py",
    "tests/test_body_writer.py",
    "tests/test_stream_writes.py",
    "tests/test_asgi.py",
    "tests/test_proxy_upstream.py",
    "tests/test_upstream_hygiene.py",
)


def _compiled(module: Any) -> bool:
    return not (module.__file__ or "").endswith(".py")


def test_hot_path_reports_the_modules_imported() -> None:
    modules = [importlib.import_module(m) for m in proxy.HOT_PATH]
    compiled = [m.__name__ for m in modules if _compiled(m)]
    assert compiled in ([], list(proxy.HOT_PATH)), "compiled in part: mypyc's group is one"
    impl = proxy.hot_path()
    assert impl["implementation"] == ("compiled" if compiled else "pure"), impl
    assert (impl["why"] == "") == bool(compiled), impl
    assert hot_path_line().startswith(
        "hot path: compiled (mypyc; the meter's event scans in C)"
        if compiled
        else "hot path: pure Python ("
    )


def _package(site: Path, *, compiled: bool = True) -> None:
    """proxy/__init__.py and the hot path's sources under `site`, with stand-ins for their
    extensions and the build's record, as an install lays them out (nothing is imported from
    them but the package itself)."""
    (site / "proxy").mkdir(parents=True)
    shutil.copy(ROOT / "proxy" / "__init__.py", site / "proxy" / "__init__.py")
    record = []
    for module in (*proxy.HOT_PATH, *proxy.HOT_PATH_C):
        rel = module.replace(".", "/") + (".c" if module in proxy.HOT_PATH_C else ".py")
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch(exist_ok=True)
        path.write_text(f"WHERE = {module!r}\n")
        record.append(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {rel}\n")
        if compiled:
            Path(str(path.with_suffix("")) + EXTENSION_SUFFIXES[0]).write_bytes(b"")
    if compiled:
        (site / "proxy" / "_compiled.sha256").write_text("".join(record))


def _choice(site: Path, **env: str) -> tuple[str, str]:
    code = (
        "import importlib.util as u, proxy\n"
        "origins = {u.find_spec(m).origin.endswith('.py') for m in proxy.HOT_PATH}\n"
        "print(proxy.hot_path()['implementation'], origins == {True}, proxy.hot_path()['why'])"
    )
    clean = {k: v for k, v in os.environ.items() if k != "WARMROUTE_PURE_PYTHON"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "PYTHONPATH": str(site), **env},
        cwd=site,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split(maxsplit=2)
    impl, sources, why = (*out, "")[:3]
    return f"{impl} {'sources' if sources == 'True' else 'compiled'}", why.strip()


def test_the_sources_run_when_asked_edited_or_not_compiled(tmp_path: Path) -> None:
    built = tmp_path / "built"
    _package(built)
    assert _choice(built) == ("compiled compiled", "")
    assert _choice(built, WARMROUTE_PURE_PYTHON="0") == ("compiled compiled", "")
    pure = ("pure sources", "WARMROUTE_PURE_PYTHON=1")
    assert _choice(built, WARMROUTE_PURE_PYTHON="1") == pure
    # A source edited since it was compiled: every module from source, not the stale build.
    meter = built / "proxy" / "forwarding" / "meter.py"
    meter.write_text(meter.read_text() + "# edited\n")
    edited = "proxy.forwarding.meter changed since it was compiled"
    assert _choice(built) == ("pure sources", edited)
    # ... and the C helper's source: the meter's scan comes from the same build, or not at all.
    rebuilt = tmp_path / "rebuilt"
    _package(rebuilt)
    scan = rebuilt / "proxy" / "_eventscan.c"
    scan.write_text(scan.read_text() + "/* edited */\n")
    assert _choice(rebuilt) == ("pure sources", "proxy._eventscan changed since it was compiled")
    # ... and an install whose C source is gone cannot say what was compiled: sources run.
    bare_c = tmp_path / "bare_c"
    _package(bare_c)
    (bare_c / "proxy" / "_eventscan.c").unlink()
    assert _choice(bare_c) == ("pure sources", "proxy._eventscan's source is missing")
    bare = tmp_path / "bare"
    _package(bare, compiled=False)
    assert _choice(bare) == ("pure sources", "not compiled")


def test_the_build_switches_are_not_taken_for_settings() -> None:
    """The proxy refuses a WARMROUTE_ variable that is not a setting; these two are the
    install's, and a shell that exported them still starts it."""
    env = {"WARMROUTE_COMPILE": "0", "WARMROUTE_PURE_PYTHON": "1"}
    assert load_config(flags={"backends": ["http://127.0.0.1:9"]}, env=env).server.port


@pytest.mark.e2e
def test_the_pure_fallback_passes_the_hot_path_tests() -> None:
    """Where the suite runs compiled, the hot path's tests again under the pure Python."""
    if not _compiled(importlib.import_module(proxy.HOT_PATH[0])):
        pytest.skip(f"the suite runs the pure Python already ({proxy.hot_path()['why']})")
    env = {**os.environ, "WARMROUTE_PURE_PYTHON": "1"}
    check = "import proxy.forwarding.meter as m, proxy; print(m.__file__, proxy.hot_path())"
    r = subprocess.run(
        [sys.executable, "-c", check], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert r.stdout.split()[0].endswith("meter.py") and "'pure'" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *HOT_PATH_TESTS],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-500:]


@pytest.mark.e2e
def test_admin_build_says_which_hot_path_runs(proxy_server: Any, closed_port_url: str) -> None:
    server = proxy_server([closed_port_url])
    body = httpx.get(server.url + "/admin/build", timeout=10).json()
    assert body["version"] == proxy.__version__
    assert body["hot_path"] == proxy.hot_path()
