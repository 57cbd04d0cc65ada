"""The layers stay one-way: what sim/ and bench/ load, checked at run time.

The import contracts in pyproject.toml ([tool.importlinter]) check the same rules statically;
this test also catches what they cannot see: a package __init__ that drags a layer in.
"""

from __future__ import annotations

import subprocess
import sys

# What the simulator and the load generator must run without (docs/architecture.md).
PROXY_PARTS = (
    "proxy.app",
    "proxy.config",
    "proxy.forward",
    "proxy.handlers",
    "proxy.meter",
    "proxy.routing",
    "proxy.telemetry",
    "proxy.upstream",
    "plugins",
)
STANDALONE = (
    "proxy.sim",
    "proxy.sim.cli",
    "proxy.sim.server",
    "proxy.bench",
    "proxy.bench.cli",
    "proxy.bench.mock",
)


def test_the_simulator_and_the_bench_load_nothing_of_the_proxy() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {STANDALONE!r}: importlib.import_module(name)\n"
        f"print('\\n'.join(sorted(m for m in sys.modules if m.startswith({PROXY_PARTS!r}))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [], f"sim/bench loaded proxy modules:\n{out.stdout}"
