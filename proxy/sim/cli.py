"""`warmroute sim`: run one or more simulated engines. Every option also reads WARMROUTE_SIM_*."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import sys
from typing import Any

from proxy import presets
from proxy.heap import freeze_startup_heap
from proxy.kvevents.publisher import offset_endpoint
from proxy.sim.config import PD_FLOWS, ROLES, Faults, SimConfig
from proxy.sim.fleet import SimFleet

ENV_PREFIX = "WARMROUTE_SIM_"

DESCRIPTION = f"""\
A simulated LLM engine with vLLM's OpenAI-compatible API (/v1/chat/completions,
/v1/completions, /v1/models, /health, /metrics) and the physics of a real one: prefill time
grows with the uncached prompt, decode speed is memory bandwidth / bytes read per step,
continuous batching over a fixed KV pool, chunked prefill, a 16-token-block prefix cache,
prefill/decode roles and fault injection. Cached prompt tokens are reported in
usage.prompt_tokens_details.cached_tokens. GET /sim/stats shows its state as JSON.

examples:
  warmroute sim --port 8001                                  # an 8B bf16 model on an H100
  warmroute sim --port 8001 --instances 3 --device l40s      # three engines, ports 8001-8003
  warmroute sim --port 8001 --time-scale 10 --kv-blocks 512  # 10x faster, tiny KV pool
  warmroute sim --port 8001 --hide-kv-pool                   # no pool size in /metrics
  warmroute sim --port 8001 --fault-error-rate 0.05 --fault-stall-rate 0.1 --fault-stall-s 2
  warmroute sim --port 8001 --instances 2 --kv-events-endpoint tcp://127.0.0.1:5557 \\
    --kv-events-replay-endpoint tcp://127.0.0.1:5600   # engine i: ports 5557+i and 5600+i
  curl -N localhost:8001/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model":"sim-8b","messages":[{{"role":"user","content":"hi"}}],"stream":true}}'

devices: {", ".join(f"{d.name} ({d.bandwidth_gbs:g} GB/s)" for d in presets.DEVICES.values())}
params:  {", ".join(presets.MODELS)}      dtypes: {", ".join(presets.DTYPE_BYTES)}
Every option can also be set as an environment variable: --max-num-seqs 64 is
WARMROUTE_SIM_MAX_NUM_SEQS=64, --fault-error-rate is WARMROUTE_SIM_FAULT_ERROR_RATE.
"""

# (SimConfig field, help). Flags are the field names with dashes, vLLM's where vLLM has one.
ENGINE_OPTIONS: tuple[tuple[str, str], ...] = (
    ("model", "served model name (default: sim-<params>)"),
    ("device", "device preset: bandwidth, compute and memory"),
    ("params", "model size preset: parameters and KV layout"),
    ("dtype", "weight dtype; 8-bit halves the bytes read per decode step"),
    ("kv_cache_dtype", "KV cache dtype: auto (16-bit) or fp8"),
    ("tensor_parallel_size", "devices the model is split over (multiplies bandwidth/compute)"),
    ("bandwidth_gbs", "override the device's memory bandwidth, GB/s"),
    ("tflops", "override the device's dense peak TFLOPS for this dtype"),
    ("memory_gb", "override the device's memory, GB"),
    ("bandwidth_efficiency", "share of bandwidth reached (1.0 = the ceiling in docs/physics.md)"),
    ("compute_efficiency", "fraction of peak compute reached by prefill (MFU)"),
    ("step_overhead_s", "fixed cost of every engine step, seconds"),
    ("max_num_seqs", "most sequences in one batch"),
    ("max_num_batched_tokens", "token budget of one step, shared by decodes and prefill chunks"),
    ("enable_chunked_prefill", "split long prompts into budget-sized chunks"),
    ("max_model_len", "longest prompt + completion, tokens"),
    ("gpu_memory_utilization", "share of device memory for weights + KV cache"),
    ("kv_blocks", "KV pool size in blocks (vLLM --num-gpu-blocks-override)"),
    ("block_size", "tokens per KV block and per prefix-cache hash"),
    ("enable_prefix_caching", "reuse the KV of shared prompt prefixes"),
    ("hide_kv_pool", "leave vllm:cache_config_info (the KV pool size) out of /metrics"),
    ("time_scale", "run X times faster than the simulated device (tests, demos)"),
    ("role", "mixed, prefill or decode (P/D disaggregation)"),
    ("pd", "P/D flow spoken: vllm (kv_transfer_params), sglang (bootstrap rooms), or both"),
    ("kv_transfer_gbs", "P/D link bandwidth for KV transfers, GB/s"),
    ("kv_transfer_latency_s", "fixed latency of one KV transfer, seconds"),
    ("bootstrap_timeout_s", "how long a decode leg waits for its prefill leg, wall seconds"),
    ("min_output_tokens", "shortest natural answer (without ignore_eos)"),
    ("max_output_tokens", "longest natural answer (without ignore_eos)"),
    ("chars_per_token", "characters per simulated token"),
    ("seed", "seed of the output words and of fault dice"),
    ("kv_events_endpoint", "publish KV cache events like vLLM (ZeroMQ PUB; engine i: port + i)"),
    ("kv_events_replay_endpoint", "replay missed KV events (ZeroMQ ROUTER; engine i: port + i)"),
    ("kv_events_topic", "topic frame of every KV event message"),
    (
        "lora_modules",
        "LoRA adapters served beside the model, NAME[=PATH],... (vLLM's "
        "--lora-modules); POST /v1/load_lora_adapter and /v1/unload_lora_adapter change them",
    ),
)
FAULT_HELP = {
    "error_rate": "share of requests answered with --fault-error-status",
    "error_status": "HTTP status of injected errors",
    "stall_rate": "share of streams that pause mid-way",
    "stall_s": "length of a stall, simulated seconds",
    "stall_after": "tokens sent before a stall",
    "cut_rate": "share of streams whose connection is dropped mid-way",
    "cut_after": "tokens sent before the cut",
    "slow_start_rate": "share of requests whose response starts late",
    "slow_start_s": "delay before a slow response starts, simulated seconds",
    "refuse_rate": "share of new connections aborted at accept",
    "load_s": "simulated model-loading time after start: /health and requests answer 503",
}
CHOICES: dict[str, Any] = {
    "device": list(presets.DEVICES),
    "params": list(presets.MODELS),
    "dtype": list(presets.DTYPE_BYTES),
    "kv_cache_dtype": list(presets.KV_DTYPE_BYTES),
    "role": list(ROLES),
    "pd": list(PD_FLOWS),
}


def _env(name: str) -> str | None:
    return os.environ.get(ENV_PREFIX + name.upper())


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true/false, got {text!r}")


def _add(group: Any, dest: str, flag: str, default: Any, kind: type, help_: str) -> None:
    env = _env(flag.removeprefix("--").replace("-", "_"))
    if env is not None:
        try:
            default = _parse_bool(env) if kind is bool else kind(env)
        except ValueError as e:
            raise SystemExit(f"warmroute sim: bad {ENV_PREFIX}{dest.upper()}={env!r}: {e}") from e
    shown = "" if default is None else f" (default: {default})"
    if kind is bool:
        group.add_argument(
            flag,
            dest=dest,
            action=argparse.BooleanOptionalAction,
            default=default,
            help=help_ + shown,
        )
    else:
        group.add_argument(
            flag,
            dest=dest,
            type=kind,
            default=default,
            choices=CHOICES.get(dest),
            help=help_ + shown,
        )


# Options whose default is None ("take it from the preset") and so cannot show their type.
NULLABLE: dict[str, type] = {
    "model": str,
    "bandwidth_gbs": float,
    "tflops": float,
    "memory_gb": float,
    "kv_blocks": int,
    "kv_events_endpoint": str,
    "kv_events_replay_endpoint": str,
}


def _field_type(default: Any, name: str) -> type:
    return NULLABLE.get(name) or type(default)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sim",
        help="run simulated vLLM-like engines (no GPU needed)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    net = p.add_argument_group("serving")
    _add(net, "host", "--host", "127.0.0.1", str, "address to listen on")
    _add(net, "port", "--port", 8000, int, "port of the first engine")
    _add(net, "instances", "--instances", 1, int, "engines on consecutive ports")
    _add(net, "log_level", "--log-level", "warning", str, "uvicorn log level")

    eng = p.add_argument_group("engine")
    defaults = SimConfig()
    for name, help_ in ENGINE_OPTIONS:
        default = None if name == "model" else getattr(defaults, name)
        kind = _field_type(default, name)
        _add(eng, name, "--" + name.replace("_", "-"), default, kind, help_)

    flt = p.add_argument_group("faults")
    for f in dataclasses.fields(Faults):
        default = getattr(Faults(), f.name)
        _add(flt, "fault_" + f.name, "--fault-" + f.name.replace("_", "-"), default,
             type(default), FAULT_HELP[f.name])  # fmt: skip
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    kwargs = {name: getattr(args, name) for name, _ in ENGINE_OPTIONS}
    if kwargs["model"] is None:
        kwargs["model"] = f"sim-{kwargs['params']}"
    faults = Faults(
        **{f.name: getattr(args, "fault_" + f.name) for f in dataclasses.fields(Faults)}
    )
    return SimConfig(**kwargs, faults=faults)


def run(args: argparse.Namespace) -> int:
    try:
        base = config_from_args(args)
    except ValueError as e:
        print(f"warmroute sim: {e}", file=sys.stderr)
        return 2
    if args.instances < 1:
        print("warmroute sim: --instances must be >= 1", file=sys.stderr)
        return 2
    try:
        cfgs = engine_configs(base, args.instances)
    except ValueError as e:
        print(f"warmroute sim: {e}", file=sys.stderr)
        return 2
    ports = [args.port + i if args.port else 0 for i in range(args.instances)]
    problem = port_problem(args.host, ports)
    if problem:
        print(f"warmroute sim: {problem}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_main(cfgs, args.host, ports, args.log_level))
    except RuntimeError as e:
        print(f"warmroute sim: {e}", file=sys.stderr)
        return 1
    return 0


def port_problem(host: str, ports: list[int]) -> str | None:
    """Why the engines cannot listen on these ports (out of range, taken), or None.

    Checked before any engine starts, so the answer is one line instead of a traceback per
    engine; a port taken in between still fails the start, with SimFleet's message.
    """
    for i, port in enumerate(ports):
        if not 0 <= port <= 65535:
            which = "--port" if i == 0 else f"engine {i + 1}'s port (--port + {i})"
            return f"{which} must be between 1 and 65535 (or 0 for any free port), got {port}"
    for i, port in enumerate(ports):
        if port == 0:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                engine = f" (engine {i + 1} of {len(ports)})" if len(ports) > 1 else ""
                return (
                    f"cannot listen on {host}:{port}{engine}: {e.strerror}; another process "
                    "has it: pick another --port"
                )
    return None


def engine_configs(base: SimConfig, instances: int) -> list[SimConfig]:
    """One config per engine: engine i publishes KV events on the endpoints' ports + i."""
    cfgs = [base] + [
        base.replace(
            kv_events_endpoint=offset_endpoint(base.kv_events_endpoint, i),
            kv_events_replay_endpoint=offset_endpoint(base.kv_events_replay_endpoint, i),
        )
        for i in range(1, instances)
    ]
    _check_distinct_endpoints(cfgs)
    return cfgs


def _check_distinct_endpoints(cfgs: list[SimConfig]) -> None:
    """Each engine binds its own KV event ports: consecutive ranges must not overlap."""
    seen: dict[str, str] = {}
    for i, cfg in enumerate(cfgs):
        for what, ep in (("endpoint", cfg.kv_events_endpoint),
                         ("replay endpoint", cfg.kv_events_replay_endpoint)):  # fmt: skip
            if ep is None or ep.endswith(":0"):
                continue
            if ep in seen:
                raise ValueError(
                    f"engine {i}'s KV events {what} {ep} is already {seen[ep]}; with "
                    "--instances N each engine uses port + i, so space the two ports N apart"
                )
            seen[ep] = f"engine {i}'s {what}"


async def _main(cfgs: list[SimConfig], host: str, ports: list[int], log_level: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    async with SimFleet(cfgs, host, ports, log_level) as fleet:
        # Built: its startup heap out of every full collection's scan (one of 18 ms paused
        # every engine of this process mid-run, as the bench mock's did; proxy/heap.py).
        freeze_startup_heap()
        c = cfgs[0]
        print(
            f"warmroute sim: {len(cfgs)} x {c.model} ({c.params} {c.dtype} on {c.device}, "
            f"decode ceiling {c.decode_ceiling_tok_s:.0f} tok/s, KV pool {c.kv_pool_tokens} "
            f"tokens, time scale {c.time_scale:g}, role {c.role})",
            flush=True,
        )
        for url in fleet.urls:
            print(f"  {url}/v1   metrics {url}/metrics   state {url}/sim/stats", flush=True)
        await stop.wait()
