"""The layers stay one-way: what sim/, bench/, plugins/ and the doctor's diagnosis load.

The import contracts (.importlinter) are run here by `lint-imports` as .ci/run runs it, and a
deliberately broken copy proves the runner looks. The run-time tests catch what the contracts
cannot see, a package __init__ that drags a layer in. The checks are allowlists (the leaves,
the routing vocabulary, the diagnosis's pure modules), so a module added to the proxy is
forbidden without anyone remembering to forbid it. The cycle test looks across proxy/ and
plugins/ at once; the size test keeps modules small or their size explained.
"""

from __future__ import annotations

import ast
import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent

# All of the proxy that the simulator and the load generator may use (docs/architecture.md):
# leaf utilities that import nothing else of it, and the package root for its version.
LEAVES = frozenset(
    {
        "proxy",
        "proxy.asgi",
        "proxy.sse",
        "proxy.stats",
        "proxy.presets",
        "proxy.heap",
        "proxy.kvevents",
        "proxy.kvevents.wire",
        "proxy.kvevents.publisher",
        # The compiled hot path's shared library (setup.py), loaded with proxy.sse or
        # proxy.asgi where they run compiled: each module in it runs only when imported.
        "proxy.hot_path__mypyc",
    }
)
STANDALONE = ("proxy.sim", "proxy.bench")
ENTRY_POINTS = (
    "proxy.sim",
    "proxy.sim.cli",
    "proxy.sim.server",
    "proxy.bench",
    "proxy.bench.cli",
    "proxy.bench.mock",
)
# All of the proxy that plugins may import (docs/architecture.md, the plugins contract), with
# the packages that importing it runs.
ROUTING_VOCABULARY = frozenset(
    {
        "proxy",
        "proxy.routing",
        "proxy.routing.types",
        "proxy.routing.rendezvous",
        "proxy.routing.learn",
    }
)
# The doctor's diagnosis (docs/doctor.md): windows in, findings out, the same in the proxy, on
# the virtual fleet and in a test, so no I/O. Of the proxy it may use these modules and two
# leaves (the percentile, the device tables); of the standard library only what is below
# (time: the collector's default clock, passed in everywhere else).
DIAGNOSIS = (
    "proxy.doctor",
    "proxy.doctor.model",
    "proxy.doctor.stats",
    "proxy.doctor.hardware",
    "proxy.doctor.timeline",
    "proxy.doctor.analysis",
    "proxy.doctor.report",
    "proxy.doctor.diagnose",
    "proxy.doctor.collector",
    "proxy.doctor.virtual",
)
DIAGNOSIS_MAY_USE = frozenset({"proxy", "proxy.stats", "proxy.presets", *DIAGNOSIS})
DIAGNOSIS_STDLIB = frozenset(
    "__future__ array bisect collections dataclasses math re struct time typing".split()
)
# I/O, should any arrive at run time through something allowed: servers, clients, event loops,
# threads, sockets, Redis, ZeroMQ, exporters.
IO_PACKAGES = frozenset(
    "anyio asyncio h11 http httpcore httptools httpx opentelemetry redis selectors socket ssl "
    "starlette subprocess threading urllib3 uvicorn uvloop zmq".split()
)
MAX_LINES = 600
MAX_FUNCTION_LINES = 80


def _standalone(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in STANDALONE)


def loaded_by(modules: list[str]) -> set[str]:
    """Every module a fresh interpreter holds once it has imported `modules`."""
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_the_simulator_and_the_bench_load_nothing_of_the_proxy() -> None:
    ours = (m for m in loaded_by(list(ENTRY_POINTS)) if m.split(".")[0] in ("proxy", "plugins"))
    loaded = sorted(m for m in ours if not _standalone(m) and m not in LEAVES)
    assert loaded == [], f"sim/bench loaded proxy modules that are not leaves: {loaded}"


def test_the_simulator_and_the_bench_import_only_leaves_of_the_proxy() -> None:
    """Statically, module by module, lazy imports included: what sim/ and bench/ import,
    directly or through others, is theirs or a leaf."""
    graph = grimp.build_graph("proxy", "plugins", cache_dir=None)
    used: dict[str, str] = {}
    for package in STANDALONE:
        for module in sorted(graph.find_descendants(package) | {package}):
            for dep in graph.find_upstream_modules(module):
                if not _standalone(dep) and dep not in LEAVES:
                    used.setdefault(dep, module)
    assert used == {}, f"not leaves (imported by): {used}"


def test_the_standalone_contract_forbids_every_module_but_the_leaves() -> None:
    """.importlinter lists the forbidden modules by name: a module added to proxy/ must be
    added there (or be a leaf, here and in docs/architecture.md)."""
    ini = configparser.ConfigParser()
    ini.read(ROOT / ".importlinter")
    listed = set(ini["importlinter:contract:standalone"]["forbidden_modules"].split())
    graph = grimp.build_graph("proxy", "plugins", cache_dir=None)
    expected = {"plugins"}
    for package in ("proxy", "proxy.kvevents"):
        expected |= {
            m for m in graph.find_children(package) if not _standalone(m) and m not in LEAVES
        }
    assert sorted(expected - listed) == [], "add these to the standalone contract"
    assert sorted(listed - expected) == [], "these are gone or leaves: take them out"


def test_no_module_is_over_600_lines_without_a_stated_reason() -> None:
    """A module over MAX_LINES says why in a `Size:` line of its docstring."""
    over = []
    for path in sorted([*(ROOT / "proxy").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")]):
        text = path.read_text()
        if text.count("\n") <= MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if not any(line.startswith("Size:") for line in doc.splitlines()):
            over.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert over == [], "split these, or say why not in a 'Size:' docstring line"


def test_no_function_is_over_80_lines_without_a_measured_reason() -> None:
    """A function over MAX_FUNCTION_LINES is split where a concern ends, or says in a `Long:`
    line of its docstring what measured hot loop keeps it whole (CONTRIBUTING.md)."""
    over = []
    for path in sorted([*(ROOT / "proxy").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            doc = ast.get_docstring(node) or ""
            if lines > MAX_FUNCTION_LINES and "Long:" not in doc:
                over.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert over == [], "split these, or say what measured hot loop needs them whole"


def lint_imports(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`lint-imports` from this interpreter's environment, the command .ci/run runs.

    Not `python -m importlinter.cli`: that module has no __main__ block, so it loads, checks
    nothing and exits 0.
    """
    script = Path(sys.executable).parent / "lint-imports"
    assert script.is_file(), f"{script} is missing: install the [test] extra"
    return subprocess.run(
        [str(script), "--no-cache", "--no-logo", *args],
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200"},  # one line per contract, however long its name
        capture_output=True,
        text=True,
        timeout=120,
    )


def contract_count(config: Path) -> int:
    ini = configparser.ConfigParser()
    ini.read(config)
    return sum(1 for section in ini.sections() if section.startswith("importlinter:contract:"))


def test_the_import_contracts_hold() -> None:
    # .importlinter: sim/bench stand alone, plugins see the routing vocabulary only, routing
    # never imports plugins, no cycles between sibling modules or packages.
    out = lint_imports()
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    # Every contract was read and checked: a runner that checks nothing prints no count.
    assert f"Contracts: {contract_count(ROOT / '.importlinter')} kept, 0 broken." in out.stdout


def test_the_contract_runner_fails_a_broken_contract(tmp_path: Path) -> None:
    """A copy of .importlinter without the one import the router may make of plugins (setup
    composing the policy): the same runner must report that contract broken, and exit 1."""
    config = tmp_path / "importlinter.ini"
    text = (ROOT / ".importlinter").read_text()
    allowance = "ignore_imports =\n    proxy.routing.setup -> plugins\n"
    assert allowance in text
    config.write_text(text.replace(allowance, ""))
    out = lint_imports("--config", str(config), "--contract", "router-takes-policies")
    assert out.returncode == 1, out.stdout[-4000:] + out.stderr[-2000:]
    assert "routing never imports plugins" in out.stdout and "BROKEN" in out.stdout
    assert "proxy.routing.setup -> plugins" in out.stdout
    assert "Contracts: 0 kept, 1 broken." in out.stdout


# Beyond the routing vocabulary: what a plugin must not reach, one of each kind (a pure core
# of the request path, a router helper, the doctor, a module that was added after the rule).
BEYOND_THE_VOCABULARY = {
    "round_robin": "proxy.forwarding.meter",
    "session": "proxy.routing.placement",
    "queue_scorer": "proxy.doctor.diagnose",
    "model_filter": "proxy.disagg.window",
}


def test_a_plugin_importing_beyond_the_routing_vocabulary_breaks_the_plugins_contract(
    tmp_path: Path,
) -> None:
    """The plugins contract is an allowlist: on a copy of the tree where plugins (or the
    vocabulary they use) import other modules of the proxy, each import is reported."""
    for package in ("proxy", "plugins"):
        shutil.copytree(
            ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    imports = {f"plugins.{plugin}": module for plugin, module in BEYOND_THE_VOCABULARY.items()}
    imports["proxy.routing.learn"] = "proxy.forwarding.meter"  # and through the vocabulary
    for importer, module in imports.items():
        with tmp_path.joinpath(*importer.split(".")).with_suffix(".py").open("a") as f:
            f.write(f"\nimport {module}  # noqa: E402\n")
    out = lint_imports("--contract", "plugins", "--contract", "routing-vocabulary", cwd=tmp_path)
    assert out.returncode == 1, out.stdout[-4000:] + out.stderr[-2000:]
    for importer, module in imports.items():
        assert f"{importer} -> {module}" in out.stdout, (importer, out.stdout[-4000:])
    assert "Contracts: 0 kept, 2 broken." in out.stdout


def test_plugins_load_nothing_of_the_proxy_but_the_routing_vocabulary() -> None:
    """At run time too: a package __init__ on the way (proxy.routing's) drags nothing in."""
    names = sorted(f"plugins.{p.stem}" for p in (ROOT / "plugins").glob("[!_]*.py"))
    proxy = {m for m in loaded_by(["plugins", *names]) if m.split(".")[0] == "proxy"}
    assert sorted(proxy - ROUTING_VOCABULARY) == []


def test_the_diagnosis_imports_only_its_own_pure_modules_and_no_io() -> None:
    """Statically, lazy imports included, the standard library too: an allowlist."""
    graph = grimp.build_graph("proxy", "plugins", include_external_packages=True, cache_dir=None)
    used: dict[str, str] = {}
    for module in DIAGNOSIS:
        for dep in graph.find_upstream_modules(module):
            if dep not in DIAGNOSIS_MAY_USE and dep not in DIAGNOSIS_STDLIB:
                used.setdefault(dep, module)
    assert used == {}, f"not allowed to the diagnosis (imported by): {used}"


def test_the_diagnosis_loads_no_io_and_nothing_else_of_the_proxy() -> None:
    """At run time: importing a module runs its packages' __init__, which the graph above does
    not follow (proxy.sim's starts uvicorn's import)."""
    loaded = loaded_by(list(DIAGNOSIS))
    ours = sorted(m for m in loaded if m.split(".")[0] in ("proxy", "plugins"))
    assert [m for m in ours if m not in DIAGNOSIS_MAY_USE] == []
    assert sorted({m.split(".")[0] for m in loaded} & IO_PACKAGES) == []


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
