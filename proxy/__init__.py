"""warmroute: an OpenAI-compatible LLM proxy that measures what users see and routes to
warm prefix caches.

The modules a streamed chunk runs through (HOT_PATH) are compiled with mypyc where the
install could (setup.py; docs/hot-path.md, round 6). Each compiled module sits beside its
source, and Python imports it first. The sources are imported instead, all of them, when
WARMROUTE_PURE_PYTHON=1, or when a source is not the one compiled (a checkout edited since its
editable install: rebuild with `pip install -e .`). `hot_path()` says which runs, and why.
"""

from __future__ import annotations

import os
import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import EXTENSION_SUFFIXES, ModuleSpec
from importlib.util import spec_from_file_location
from types import ModuleType

__version__ = "0.1.0"

# Compiled as one group, which calls between its modules natively: all of them run compiled,
# or none. setup.py reads this tuple.
HOT_PATH = (
    "proxy.jsonscan",
    "proxy.sse",
    "proxy.asgi",
    "proxy.forwarding.meter",
    "proxy.forwarding.push",
    "proxy.upstream.conn",
)
# C helpers, built by the same step from proxy/<name>.c and chosen with the compiled group
# (`native`): the meter's event scan (proxy/eventscan.py), the prefix index's tables
# (proxy/routing/blockmap.py) and a prompt's chain of block hashes (proxy/routing/prefix.py).
# setup.py reads this tuple too.
HOT_PATH_C = ("proxy._eventscan", "proxy._blockmap", "proxy._prefixhash")
PURE_ENV = "WARMROUTE_PURE_PYTHON"
_RECORD = "_compiled.sha256"  # written by the build beside what it compiled
_SITE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source(module: str) -> str:
    return os.path.join(_SITE, *module.split(".")) + (".c" if module in HOT_PATH_C else ".py")


def _built(module: str) -> bool:
    base = os.path.splitext(_source(module))[0]
    return any(os.path.exists(base + suffix) for suffix in EXTENSION_SUFFIXES)


def _compiled_present() -> bool:
    return any(_built(m) for m in HOT_PATH)


def _choose() -> str:
    """Why the sources run ("" if the compiled modules do)."""
    try:
        with open(os.path.join(_SITE, "proxy", _RECORD)) as f:
            record = {path: digest for digest, path in (line.split() for line in f)}
    except (OSError, ValueError):
        return "not compiled"
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return f"{PURE_ENV}={os.environ[PURE_ENV]}"
    import hashlib

    for module in (*HOT_PATH, *HOT_PATH_C):
        path = _source(module)
        if not _built(module):
            return "not compiled"
        try:
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            return f"{module}'s source is missing"
        if record.get(os.path.relpath(path, _SITE).replace(os.sep, "/")) != digest:
            return f"{module} changed since it was compiled"
    return ""


class _Sources(MetaPathFinder):
    """Finds the hot path's sources ahead of their compiled modules."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in HOT_PATH:
            return None
        return spec_from_file_location(fullname, _source(fullname))


_WHY_PURE = _choose()
if _WHY_PURE and _compiled_present():
    sys.meta_path.insert(0, _Sources())


def native(name: str) -> ModuleType | None:
    """The hot path's C helper `name` (one of HOT_PATH_C) where the compiled hot path runs;
    None where the sources do, whose callers then use their Python."""
    if name not in HOT_PATH_C:
        raise ValueError(f"{name} is not one of the hot path's C helpers")
    if _WHY_PURE:
        return None
    import importlib

    return importlib.import_module(name)


def hot_path() -> dict[str, str]:
    """{"implementation": "compiled" or "pure", "why": why pure ("" when compiled)}, from the
    modules imported (the choice made at import while none is)."""
    loaded = [sys.modules[m] for m in HOT_PATH if m in sys.modules]
    if loaded:
        pure = [m.__name__ for m in loaded if (m.__file__ or "").endswith(".py")]
        if pure and not _WHY_PURE:
            return {"implementation": "pure", "why": f"{', '.join(pure)} imported from source"}
        if not pure:
            return {"implementation": "compiled", "why": ""}
    return {"implementation": "pure" if _WHY_PURE else "compiled", "why": _WHY_PURE}
