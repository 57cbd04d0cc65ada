"""warmroute's build: pyproject.toml holds the package; this file adds its compiled hot path.

The modules a streamed chunk runs through (proxy.HOT_PATH: the meter, the relay's step, the
SSE and JSON byte scans) are compiled with mypyc where the machine can (docs/hot-path.md,
round 6), and the C helpers beside them (proxy.HOT_PATH_C: the meter's event scan, round 7;
the prefix index's tables) with the same compiler, in the same step. Compiling is optional:
with WARMROUTE_COMPILE=0, without mypyc, or when it fails (no C compiler), the same package is
installed as pure Python, and one line says so. The sources are installed beside the compiled
modules either way; proxy/__init__.py decides at import which of the two runs
(WARMROUTE_PURE_PYTHON=1: the sources).
"""

from __future__ import annotations

import ast
import glob
import hashlib
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
GROUP = "proxy.hot_path"  # the compiled modules' shared library: proxy/hot_path__mypyc.*.so
RECORD = "_compiled.sha256"  # beside them: each source's digest as compiled (proxy/__init__.py)


def say(message: str) -> None:
    print(f"warmroute: {message}", file=sys.stderr)


def _declared(name: str) -> list[str]:
    """A tuple of module names in proxy/__init__.py, read without importing the package."""
    tree = ast.parse((ROOT / "proxy" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise RuntimeError(f"proxy/__init__.py has no {name}")


def hot_path() -> list[str]:
    """proxy.HOT_PATH: the modules mypyc compiles."""
    return _declared("HOT_PATH")


def hot_path_c() -> list[str]:
    """proxy.HOT_PATH_C: the C helpers, each from proxy/<name>.c."""
    return _declared("HOT_PATH_C")


def brief(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:120] if text else ''}"


def source(module: str) -> str:
    return module.replace(".", "/") + (".c" if module in hot_path_c() else ".py")


def in_tree_outputs() -> list[Path]:
    """What an editable build compiled into the checkout: stale once a later build is not
    compiled, and then removed (else the last compiled copy would still be imported)."""
    found = [ROOT / "proxy" / RECORD]
    for module in [*hot_path(), *hot_path_c(), GROUP + "__mypyc"]:
        base = str(ROOT / module.replace(".", "/"))
        found += [Path(p) for suffix in EXTENSION_SUFFIXES for p in glob.glob(base + suffix)]
    return [p for p in found if p.exists()]


def remove_in_tree_outputs() -> None:
    for path in in_tree_outputs():
        path.unlink()


def extensions() -> list[Any]:
    if os.environ.get("WARMROUTE_COMPILE", "1") == "0":
        say("WARMROUTE_COMPILE=0: the hot path is installed as pure Python, not compiled")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as e:
        say(f"mypyc is missing ({e}): the hot path is installed as pure Python")
        return []
    # No config file: pyproject's [tool.mypy] loads the pydantic plugin, which the isolated
    # build environment does not have. Only the compiled modules are checked (their imports
    # silently, as Any where a dependency is not installed); mypy proper runs in CI.
    options = ["--config-file=", "--ignore-missing-imports", "--follow-imports=silent"]
    cwd = os.getcwd()
    os.chdir(ROOT)  # mypyc writes its C sources under ./build
    try:
        exts = mypycify(
            [*options, *(source(m) for m in hot_path())], group_name=GROUP, opt_level="3"
        )
    except (Exception, SystemExit) as e:  # a type error mypyc refuses exits
        say(f"mypyc could not compile the hot path ({brief(e)}): it is installed as pure Python")
        return []
    finally:
        os.chdir(cwd)
    native = [Extension(m, [source(m)], extra_compile_args=["-O2"]) for m in hot_path_c()]
    return [*exts, *native]


class BuildHotPath(build_ext):
    """build_ext that falls back to the pure Python when the compile fails, and records the
    sources it compiled beside what it built."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # no C compiler, a compile or link error
            say(f"the hot path was not compiled ({brief(e)}): it is installed as pure Python")
            for ext in self.extensions:
                for inplace in {False, bool(self.inplace)}:
                    path = self._fullpath(ext.name, inplace)
                    if os.path.exists(path):
                        os.unlink(path)
            if self.inplace:
                remove_in_tree_outputs()
            self.extensions = []
            return
        if not self.extensions:  # nothing compiled (mypyc failed or was switched off)
            if self.inplace:
                remove_in_tree_outputs()
            return
        digests = "".join(
            f"{hashlib.sha256((ROOT / source(m)).read_bytes()).hexdigest()}  {source(m)}\n"
            for m in [*hot_path(), *hot_path_c()]
        )
        for inplace in {False, bool(self.inplace)}:
            package = os.path.dirname(self._fullpath("proxy.sse", inplace))
            Path(package, RECORD).write_text(digests)
        compiled = ", ".join(hot_path())
        say(f"compiled the hot path with mypyc: {compiled}; in C: {', '.join(hot_path_c())}")

    def _fullpath(self, name: str, inplace: bool) -> str:
        saved, self.inplace = self.inplace, inplace
        try:
            return str(self.get_ext_fullpath(name))
        finally:
            self.inplace = saved


# Compiled only by the commands that build (pip asks for metadata first, which needs none).
BUILDS = {"bdist_wheel", "editable_wheel", "build", "build_ext", "install", "develop"}
ext_modules = extensions() if BUILDS & set(sys.argv) else []
if not ext_modules and "editable_wheel" in sys.argv:
    remove_in_tree_outputs()
setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildHotPath})
