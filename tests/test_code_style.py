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
