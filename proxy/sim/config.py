"""SimConfig: every knob of one simulated engine, with defaults derived from presets."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from proxy import presets
from proxy.sim.lora import parse_modules

ROLES = ("mixed", "prefill", "decode")
PD_FLOWS = ("both", "vllm", "sglang")  # which engines' P/D fields a sim accepts
GIB = 1024**3


@dataclass
class Faults:
    """Injected failures. Rates are per request (refuse: per new connection), 0..1.

    Durations are simulated seconds, divided by the time scale like everything else.
    They may be changed at runtime (POST /sim/faults) to script an outage in a test.
    """

    error_rate: float = 0.0  # answer HTTP `error_status` before any work
    error_status: int = 500
    stall_rate: float = 0.0  # pause a stream for `stall_s` after `stall_after` tokens
    stall_s: float = 0.0
    stall_after: int = 1
    cut_rate: float = 0.0  # drop the connection mid-stream after `cut_after` tokens
    cut_after: int = 1
    slow_start_rate: float = 0.0  # delay the response headers by `slow_start_s`
    slow_start_s: float = 0.0
    refuse_rate: float = 0.0  # abort new TCP connections as soon as they are accepted
    load_s: float = 0.0  # "model loading" after start: /health and requests answer 503

    def validate(self) -> None:
        for name in ("error_rate", "stall_rate", "cut_rate", "slow_start_rate", "refuse_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"faults.{name} must be between 0 and 1, got {v}")
        for name in ("stall_s", "slow_start_s", "load_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"faults.{name} must be >= 0")
        if not 400 <= self.error_status <= 599:
            raise ValueError("faults.error_status must be an HTTP error status (400..599)")

    def update(self, changes: dict[str, Any]) -> None:
        known = {f.name: f.type for f in dataclasses.fields(self)}
        for key, value in changes.items():
            if key not in known:
                raise ValueError(f"unknown fault {key!r}; known: {', '.join(known)}")
            current = getattr(self, key)
            setattr(self, key, type(current)(value))
        self.validate()


@dataclass
class SimConfig:
    """One simulated engine. `SimConfig.from_preset("l40s", "8b", "int8")` is the short form."""

    model: str = "sim-8b"
    device: str = "h100"
    params: str = "8b"
    dtype: str = "bf16"
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    # Overrides of the device preset (None: take the preset's figure).
    bandwidth_gbs: float | None = None
    tflops: float | None = None
    memory_gb: float | None = None
    # How close the engine gets to the hardware: 1.0 decodes exactly at the bandwidth ceiling.
    bandwidth_efficiency: float = 1.0
    compute_efficiency: float = 0.5  # prefill MFU
    step_overhead_s: float = 5e-5  # scheduler + kernel launch per step
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int = 32768
    gpu_memory_utilization: float = 0.9
    activation_reserve_gb: float = 1.0
    kv_blocks: int | None = None  # vLLM --num-gpu-blocks-override
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Leave vllm:cache_config_info out of /metrics, like a vLLM behind a gateway that passes only
    # load gauges: the proxy must then learn the pool size from cached_tokens alone.
    hide_kv_pool: bool = False
    time_scale: float = 1.0  # 10 runs everything 10x faster than the simulated device
    role: str = "mixed"
    pd: str = "both"  # the P/D flow spoken: vllm (kv_transfer_params), sglang (bootstrap)
    kv_transfer_gbs: float = 25.0  # P/D link (200 Gb/s RDMA), GB/s
    kv_transfer_latency_s: float = 0.002
    bootstrap_timeout_s: float = 30.0  # wall seconds a decode leg waits for its prefill
    # Without ignore_eos a request ends at a deterministic "natural" length in this range.
    min_output_tokens: int = 64
    max_output_tokens: int = 512
    chars_per_token: int = 4
    # KV cache events as vLLM publishes them (ZeroMQ PUB + replay ROUTER); None: off.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    # LoRA adapters served beside the model: "name[=path],..." (vLLM's --lora-modules).
    lora_modules: str = ""
    seed: int = 0
    engine_id: str = ""
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        if isinstance(self.faults, dict):
            self.faults = Faults(**self.faults)
        if not self.engine_id:
            self.engine_id = f"{self.model}-{id(self):x}"
        self.validate()

    @classmethod
    def from_preset(
        cls, device: str = "h100", params: str = "8b", dtype: str = "bf16", **overrides: Any
    ) -> SimConfig:
        overrides.setdefault("model", f"sim-{params.lower()}")
        return cls(device=device, params=params, dtype=dtype, **overrides)

    def replace(self, **changes: Any) -> SimConfig:
        """A copy with changes (a fresh Faults and engine id unless given)."""
        changes.setdefault("faults", dataclasses.replace(self.faults))
        changes.setdefault("engine_id", "")
        return dataclasses.replace(self, **changes)

    # --- derived physics -------------------------------------------------------------
    @property
    def device_preset(self) -> presets.Device:
        return presets.device(self.device)

    @property
    def layout(self) -> presets.ModelLayout:
        return presets.model_layout(self.params)

    @property
    def weight_bytes(self) -> float:
        return self.layout.params * presets.dtype_bytes(self.dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x KV heads x head_dim x bytes per element."""
        m = self.layout
        elem = presets.KV_DTYPE_BYTES[self.kv_cache_dtype]
        return int(2 * m.num_layers * m.num_kv_heads * m.head_dim * elem)

    @property
    def bandwidth(self) -> float:
        """Bytes per second the whole tensor-parallel group reads."""
        gbs = (
            self.bandwidth_gbs
            if self.bandwidth_gbs is not None
            else self.device_preset.bandwidth_gbs
        )
        return gbs * 1e9 * self.tensor_parallel_size * self.bandwidth_efficiency

    @property
    def peak_flops(self) -> float:
        if self.tflops is not None:
            tf = self.tflops
        elif presets.dtype_bytes(self.dtype) <= 1.0:
            tf = self.device_preset.tflops_8bit
        else:
            tf = self.device_preset.tflops_16bit
        return tf * 1e12 * self.tensor_parallel_size

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * self.compute_efficiency

    @property
    def decode_ceiling_tok_s(self) -> float:
        """The single-stream decode ceiling: bandwidth / weight bytes (docs/physics.md)."""
        return self.bandwidth / self.weight_bytes

    @property
    def num_kv_blocks(self) -> int:
        if self.kv_blocks is not None:
            return self.kv_blocks
        mem_gb = self.memory_gb if self.memory_gb is not None else self.device_preset.memory_gb
        usable = mem_gb * 1e9 * self.tensor_parallel_size * self.gpu_memory_utilization
        free = usable - self.weight_bytes - self.activation_reserve_gb * GIB
        return max(0, math.floor(free / (self.kv_bytes_per_token * self.block_size)))

    @property
    def kv_pool_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def effective_max_model_len(self) -> int:
        """Where vLLM would refuse to start (a sequence longer than the pool could never
        finish), the sim serves a shorter context instead, so tiny test pools just work."""
        return min(self.max_model_len, self.kv_pool_tokens)

    def validate(self) -> None:
        presets.device(self.device)
        presets.model_layout(self.params)
        presets.dtype_bytes(self.dtype)
        if self.kv_cache_dtype not in presets.KV_DTYPE_BYTES:
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; "
                f"choose one of {', '.join(presets.KV_DTYPE_BYTES)}"
            )
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.pd not in PD_FLOWS:
            raise ValueError(f"pd must be one of {', '.join(PD_FLOWS)}, got {self.pd!r}")
        positive = (
            "tensor_parallel_size",
            "bandwidth_efficiency",
            "compute_efficiency",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "block_size",
            "time_scale",
            "kv_transfer_gbs",
            "chars_per_token",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        parse_modules(self.lora_modules, self.model)
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint as well")
        if self.step_overhead_s < 0:
            raise ValueError("step_overhead_s must be >= 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if not 1 <= self.min_output_tokens <= self.max_output_tokens:
            raise ValueError("need 1 <= min_output_tokens <= max_output_tokens")
        if self.num_kv_blocks < 1:
            raise ValueError(
                f"the {self.params} weights ({self.weight_bytes / 1e9:.0f} GB in {self.dtype}) "
                f"leave no room for a KV cache on {self.device}; use a smaller --params, "
                "--dtype int8, --tensor-parallel-size 2 or set --kv-blocks"
            )
        self.faults.validate()
