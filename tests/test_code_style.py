"""The house habits hold on every commit: ruff-clean, ruff-formatted, mypy-clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_ruff_finds_nothing_and_the_code_is_formatted() -> None:
    check = run("ruff", "check", "proxy", "plugins", "tests")
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = run("ruff", "format", "--check", "proxy", "plugins", "tests")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_mypy_finds_no_type_errors_in_the_proxy_and_plugins() -> None:
    result = run("mypy", "proxy", "plugins")
    assert result.returncode == 0, result.stdout + result.stderr


# Where a request's bytes are looked at: per request or per chunk.
REQUEST_PATH = (
    "proxy/forwarding",
    "proxy/upstream",
    "proxy/edge",
    "proxy/routing",
    "proxy/asgi.py",
)
REQUEST_PATH += ("proxy/jsonscan.py", "proxy/sse.py", "proxy/eventscan.py", "proxy/server")


def test_the_request_path_searches_bytes_with_find_not_in() -> None:
    """`b"..." in data` first tries the needle as an int, and on CPython 3.11 formats a
    TypeError and drops it before searching: ~2,000 instructions a test, where `data.find()`
    (or an int needle for one byte) costs a tenth of it."""
    import ast

    found = []
    for top in REQUEST_PATH:
        path = ROOT / top
        for file in [path] if path.is_file() else sorted(path.rglob("*.py")):
            for node in ast.walk(ast.parse(file.read_text())):
                if (
                    isinstance(node, ast.Compare)
                    and isinstance(node.left, ast.Constant)
                    and isinstance(node.left.value, bytes)
                    and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
                ):
                    found.append(f"{file.relative_to(ROOT)}:{node.lineno}")
    assert found == []
