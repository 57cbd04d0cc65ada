"""Device and model presets: the numbers the simulated engine's physics is built from, and
the ones the doctor judges a declared backend's decode ceiling by (one table for both).

A leaf: it imports nothing of the proxy, so the simulator (which may use only leaves) and the
doctor's diagnosis (which may do no I/O) import it without loading each other.

Bandwidths are the datasheet figures behind the ceiling table in docs/physics.md: an 8B bf16
model decodes at bandwidth / 16 GB tokens per second on each device. Peak compute is dense
(no sparsity) tensor throughput; only prefill and big batches ever reach it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    bandwidth_gbs: float  # memory bandwidth, GB/s (1e9 bytes)
    tflops_16bit: float  # dense bf16/fp16 tensor TFLOPS
    tflops_8bit: float  # dense int8/fp8 TFLOPS
    memory_gb: float  # device memory (host RAM for the CPU preset), GB
    description: str

    @property
    def bandwidth(self) -> float:
        return self.bandwidth_gbs * 1e9


@dataclass(frozen=True)
class ModelLayout:
    name: str
    params: float  # parameter count
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    description: str


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device("h100", 3350, 989, 1979, 80, "NVIDIA H100 SXM 80GB"),
        Device("a100", 2039, 312, 624, 80, "NVIDIA A100 80GB SXM"),
        Device("l40s", 864, 362, 733, 48, "NVIDIA L40S 48GB"),
        Device("a10g", 600, 70, 140, 24, "NVIDIA A10G 24GB (AWS g5)"),
        Device("rtx4090", 1008, 165, 330, 24, "NVIDIA GeForce RTX 4090 24GB"),
        Device("cpu-ddr5", 90, 1.5, 3.0, 64, "dual-channel DDR5 CPU server"),
    )
}

MODELS: dict[str, ModelLayout] = {
    m.name: m
    for m in (
        ModelLayout("1b", 1.24e9, 16, 8, 64, 2048, "Llama-3.2-1B layout"),
        ModelLayout("3b", 3.21e9, 28, 8, 128, 3072, "Llama-3.2-3B layout"),
        # 8.0e9 rather than 8.03e9 so the ceilings are bandwidth / 16 GB (docs/physics.md).
        ModelLayout("8b", 8.0e9, 32, 8, 128, 4096, "Llama-3.1-8B layout (GQA)"),
        ModelLayout("14b", 14.7e9, 48, 8, 128, 5120, "Qwen2.5-14B layout"),
        ModelLayout("32b", 32.5e9, 64, 8, 128, 5120, "Qwen2.5-32B layout"),
        ModelLayout("70b", 70.6e9, 80, 8, 128, 8192, "Llama-3.1-70B layout"),
    )
}

# Bytes per weight element; 8-bit weights halve the bytes and roughly double the ceiling.
DTYPE_BYTES: dict[str, float] = {
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}

KV_DTYPE_BYTES: dict[str, float] = {"auto": 2.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}


def device(name: str) -> Device:
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)}") from None


def model_layout(name: str) -> ModelLayout:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown params {name!r}; choose one of {', '.join(MODELS)}") from None


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}"
        ) from None
