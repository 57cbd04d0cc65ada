"""The layers stay one-way: what sim/ and bench/ load, checked at run time.

The import contracts (.importlinter, run by `lint-imports` in .ci/run and below) check the
rules statically; the first test also catches what they cannot see, a package __init__ that
drags a layer in, and the cycle test looks across proxy/ and plugins/ at once.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent

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


def test_the_import_contracts_hold() -> None:
    # .importlinter: sim/bench stand alone, plugins see the routing vocabulary only, routing
    # never imports plugins, no cycles between sibling modules or packages.
    out = subprocess.run(
        [sys.executable, "-m", "importlinter.cli", "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_no_module_imports_itself_through_others() -> None:
    """Module-level cycles, across proxy/ and plugins/ too (the contracts look within one
    package at a time); lazy imports inside functions count."""
    graph = grimp.build_graph("proxy", "plugins", cache_dir=None)
    assert strongly_connected(graph) == []


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """Tarjan's algorithm, iterative: every group of two or more modules that import each
    other (directly or through others), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return sorted(found)


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for name in ("a", "b", "c", "d"):
        graph.add_module(name)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    graph.add_import(importer="c", imported="a")
    graph.add_import(importer="c", imported="d")
    assert strongly_connected(graph) == [["a", "b", "c"]]
