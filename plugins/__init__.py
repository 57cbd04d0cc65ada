"""Routing plugins: one policy, filter, scorer or picker per module, found by name.

Every plugin module exports ``PLUGINS``: a list of classes, each with a unique ``name``, a
``from_config(cfg: dict)`` constructor and a ``Settings`` class (a
:class:`proxy.routing.types.PluginSettings`) declaring the keys of its config block with their
types and defaults: ``warmroute serve --check`` and startup report a misspelt key or a value of
the wrong type in ``routing.plugins.<name>`` as they do any other key (a plugin without
``Settings`` has its block passed along unchecked). Third parties add plugins through the
entry-point group ``warmroute.plugins`` (each entry point loads such a module). A *policy*
plugin additionally has ``kind = "policy"`` and builds a :class:`proxy.routing.types.Policy`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
from functools import cache
from typing import Any

ENTRY_POINT_GROUP = "warmroute.plugins"


@cache
def registry() -> dict[str, Any]:
    """Map plugin name -> class, built once from this package and installed entry points."""
    found: dict[str, Any] = {}
    modules = [
        importlib.import_module(f"{__name__}.{info.name}")
        for info in pkgutil.iter_modules(__path__)
        if not info.name.startswith("_")
    ]
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        modules.append(ep.load())
    for module in modules:
        for cls in getattr(module, "PLUGINS", ()):
            if cls.name in found and found[cls.name] is not cls:
                raise ValueError(f"two routing plugins are named {cls.name!r}")
            found[cls.name] = cls
    return found


def policy_names() -> list[str]:
    return sorted(n for n, c in registry().items() if getattr(c, "kind", "") == "policy")


def build(name: str, cfg: dict[str, Any] | None = None) -> Any:
    """Construct the plugin called ``name`` from its config block."""
    try:
        cls = registry()[name]
    except KeyError:
        known = ", ".join(sorted(registry()))
        raise KeyError(f"no routing plugin named {name!r} (known: {known})") from None
    return cls.from_config(cfg or {})
