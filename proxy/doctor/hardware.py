"""Declared hardware -> the decode ceiling, from the simulator's device and model tables.

The tables (memory bandwidth per device, layouts per model size, bytes per weight) are the
ones the simulated engine runs on (proxy/presets.py, the ceiling table in
docs/physics.md), so a declared `device: h100, params: 8b` means the same here as there.
"""

from __future__ import annotations

import re

from proxy import presets
from proxy.doctor.model import Hardware

_COUNT = re.compile(r"^(\d+(?:\.\d+)?)\s*([bm])$", re.IGNORECASE)


def parse_params(params: str) -> tuple[float, presets.ModelLayout | None]:
    """('8b' | '7b' | '1.5b' | '500m') -> (parameter count, the preset layout if one matches).

    A preset size (1b, 3b, 8b, 14b, 32b, 70b) brings its layout, hence the KV bytes per
    token; any other count gives the weights only (the ceiling at short context)."""
    key = params.strip().lower()
    layout = presets.MODELS.get(key)
    if layout is not None:
        return layout.params, layout
    m = _COUNT.match(key)
    if m is None:
        raise ValueError(
            f"params {params!r}: give a model size such as 8b, 70b or 1.5b "
            f"(with a KV layout for {', '.join(presets.MODELS)})"
        )
    count = float(m.group(1)) * (1e9 if m.group(2) == "b" else 1e6)
    if count <= 0:
        raise ValueError(f"params {params!r}: must be more than zero")
    return count, None


def check(device: str | None, params: str | None, dtype: str) -> None:
    """Raise ValueError naming the choices when a declared value is unknown."""
    if device is not None:
        presets.device(device)
    if params is not None:
        parse_params(params)
    presets.dtype_bytes(dtype)
    if (device is None) != (params is None):
        raise ValueError("declare both device and params (the ceiling needs the two)")


def declared(device: str | None, params: str | None, dtype: str = "bf16") -> Hardware | None:
    """The Hardware a backend's config declares, or None when it declares none."""
    if device is None or params is None:
        return None
    check(device, params, dtype)
    dev = presets.device(device)
    count, layout = parse_params(params)
    kv: float | None = None
    if layout is not None:  # 2 (K and V) x layers x KV heads x head_dim x 16-bit elements
        elements = 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim
        kv = elements * presets.KV_DTYPE_BYTES["auto"]
    return Hardware(
        label=f"{device}/{params}/{dtype}",
        bandwidth_bytes_s=dev.bandwidth,
        weight_bytes=count * presets.dtype_bytes(dtype),
        kv_bytes_per_token=kv,
    )
