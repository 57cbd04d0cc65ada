"""Noisy neighbour: one tenant floods, another sends a little; what does the quiet one get?

    python deploy/perf/noisy_neighbour.py [--seeds 1 2 3] [--duration 20] [--json FILE]

Starts four bench-mock engines (engine mode: a 2,000-token prompt prefills in ~0.1 s, serially
per engine, then 16 chunks 20 ms apart: ~0.42 s a request) and `warmroute serve` in front
with `server.max_inflight` 8 (the fleet's capacity: ~19 requests a second), a queue of 16
and two API keys, `flood` and `quiet`. Tenant `flood` sends 4x the capacity, `quiet` 20% of
it, both Poisson, streamed; then `quiet` alone at the same rate. Prints, per seed, the quiet
tenant's TTFT p50/p99 with and without the flood, its refusals, and what the flood got (200s,
429s with Retry-After, 503s). `--proxy-dir DIR` runs another checkout's proxy (a build before
the fair queue, for comparison). `--reserve 0 2` runs each seed with `tenants.reserve_slots`
0, then 2 (slots kept for the tenant below its share), one after the other. `--bound
backends` holds the 8 slots in the engines (`max_inflight: 2` each) instead of the proxy.
`--engine-priority` has the engines order their prefill queue by the request's `priority`
(vLLM's `--scheduling-policy priority`), which the proxy sets from the tenant's standing, and
prefill in steps of `--engine-chunk-tokens` tokens (default 2048, what `vllm serve` takes by
default; 0: whole prompts, serially, the engine model before steps), the prompts begun first,
as vLLM's chunked prefill. `--engine-preempt` adds what vLLM does not do: between steps a
higher-priority prompt passes a begun one (the mock's `--preempt-prefill`).
`--reserve-prefills 0 1` runs each seed with `tenants.reserve_prefills` 0, then 1 (engines
kept from prefilling the flood's prompts over its share, and the quiet tenant's cold prompts
sent where their prefill starts soonest).
`--goodput TARGET_S` instead sends one tenant at 1.5x the capacity, without a TTFT target
and then with `tenants.ttft_targets_s: {standard: TARGET_S}`, and prints the requests a
second that got their first token within the target. Not a test: numbers depend on the
machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from proxy.bench.client import exponential_offsets, paced  # noqa: E402
from proxy.bench.mock.engine import VLLM_BATCHED_TOKENS  # noqa: E402
from proxy.demo.stack import Stack, free_ports  # noqa: E402

ENGINES = 4
SLOTS = 8
SERVICE_S = 0.42
CAPACITY = SLOTS / SERVICE_S  # requests a second
PROMPT_CHARS = 6000  # 2,000 of the mock's 3-character tokens
CONTENT = re.compile(rb'"content":"[^"]')  # the first token (the role chunk's content is "")
GOODPUT = ("no target", "target")  # the two runs of --goodput


@dataclass(frozen=True)
class Engines:
    """How the mock engines schedule prefill: by `priority` or not, in steps of `chunk_tokens`
    (0: whole prompts, serially), a begun prompt passed by a higher-priority one or not."""

    priority: bool = False
    chunk_tokens: int = 0
    preempt: bool = False

    def flags(self) -> list[str]:
        return [
            *(["--priority-scheduling"] if self.priority else []),
            *(["--prefill-chunk-tokens", str(self.chunk_tokens)] if self.chunk_tokens else []),
            *(["--preempt-prefill"] if self.preempt else []),
        ]

    def label(self) -> str:
        parts = ["by priority"] if self.priority else []
        if self.chunk_tokens:
            parts.append(f"steps of {self.chunk_tokens}")
        if self.preempt:
            parts.append("preempting")
        return ", ".join(parts)


async def tenant(
    client: httpx.AsyncClient, url: str, key: str, rate: float, duration: float, seed: int
) -> list[dict[str, Any]]:
    """Poisson arrivals at `rate` a second for `duration` seconds; each a streamed request
    with its own 2,000-token prompt. Returns one row per request: status, TTFT."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    tasks = []
    async for at in paced(exponential_offsets(rng, rate, duration)):
        prompt = f"{key} {seed} {at:.6f} " + "".join(rng.choices("abcdefgh ", k=PROMPT_CHARS))
        tasks.append(asyncio.create_task(one(client, url, key, prompt, rows)))
    await asyncio.gather(*tasks)
    return rows


async def one(
    client: httpx.AsyncClient, url: str, key: str, prompt: str, rows: list[dict[str, Any]]
) -> None:
    body = {"model": "mock", "stream": True, "messages": [{"role": "user", "content": prompt}]}
    headers = {"authorization": f"Bearer {key}"}
    sent = time.perf_counter()
    ttft = None
    status: int | str
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            status, retry = r.status_code, r.headers.get("retry-after")
            async for chunk in r.aiter_bytes():
                if ttft is None and r.status_code == 200 and CONTENT.search(chunk):
                    ttft = time.perf_counter() - sent
    except httpx.HTTPError as e:
        status, retry = type(e).__name__, None
    rows.append({"status": status, "ttft_s": ttft, "retry_after": retry})


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [r["ttft_s"] * 1000 for r in rows if r["ttft_s"] is not None]
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    refused = [r for r in rows if r["status"] in (429, 503)]
    return {
        "requests": len(rows),
        "statuses": statuses,
        "ttft_p50_ms": pct(ttfts, 0.5),
        "ttft_p90_ms": pct(ttfts, 0.9),
        "ttft_p99_ms": pct(ttfts, 0.99),
        "refused_with_retry_after": sum(r["retry_after"] is not None for r in refused),
        "refused": len(refused),
    }


async def load(url: str, seed: int, duration: float, flood: bool) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        runs = [tenant(client, url, "quiet", 0.2 * CAPACITY, duration, seed)]
        if flood:
            runs.append(tenant(client, url, "flood", 4 * CAPACITY, duration, seed + 1000))
        found = await asyncio.gather(*runs)
    out = {"quiet": summary(found[0])}
    if flood:
        out["flood"] = summary(found[1])
    return out


@contextlib.contextmanager
def serving(
    proxy_dir: Path,
    tenants: dict[str, Any] | None = None,
    bound: str = "proxy",
    engines: Engines = Engines(),
    slots: int = SLOTS,
) -> Iterator[str]:
    """Four engines and the proxy (of `proxy_dir`'s checkout) in front of them; yields the
    chat completions URL. `bound`: where the fleet's 8 slots are held: `proxy`
    (server.max_inflight) or `backends` (each engine's max_inflight, 2). `engines`: how they
    schedule prefill; by priority, the proxy sets each request's.
    `slots`: requests the fleet is let hold (the load stays sized for 8)."""
    *mock_ports, port = free_ports(ENGINES + 1)  # the engines', then the proxy's
    mock_port = mock_ports[0]
    config: dict[str, Any] = {
        "server": {
            "port": port,
            "max_inflight": slots if bound == "proxy" else 4096,
            "admission_queue": 16,
            "admission_timeout_s": 5,
            "api_keys": [
                {"name": name, "sha256": hashlib.sha256(name.encode()).hexdigest()}
                for name in ("flood", "quiet")
            ],
        },
        "backends": [
            {"url": f"http://127.0.0.1:{mock_port + i}"}
            | ({"max_inflight": slots // ENGINES} if bound == "backends" else {})
            | ({"engine_priority": "lower_first"} if engines.priority else {})
            for i in range(ENGINES)
        ],
        "telemetry": {"enabled": False},
    }
    if tenants:
        config["tenants"] = tenants
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMROUTE_")}
    env["PYTHONPATH"] = str(proxy_dir)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f, Stack() as stack:
        json.dump(config, f)  # YAML is a superset of JSON
        f.flush()
        mock = stack.spawn(
            "mock",
            ["--port", str(mock_port), "--instances", str(ENGINES), "--chunks", "16",
             "--chunk-interval-ms", "20", "--cache-tokens", "3000",
             "--prefill-tokens-per-s", "20000", *engines.flags()],
            module="proxy.bench.mock",
        )  # fmt: skip
        stack.wait_http(f"http://127.0.0.1:{mock_port}/health", mock)
        proxy = stack.spawn("proxy", ["serve", "--config", f.name], env=env, cwd=proxy_dir)
        stack.wait_http(f"http://127.0.0.1:{port}/ready", proxy)
        yield f"http://127.0.0.1:{port}/v1/chat/completions"


def run(
    seed: int,
    duration: float,
    proxy_dir: Path,
    reserve: int = 0,
    bound: str = "proxy",
    engines: Engines = Engines(),
    slots: int = SLOTS,
    prefills: int = 0,
) -> dict[str, Any]:
    tenants = {"reserve_slots": reserve} if reserve else {}
    if prefills:
        tenants["reserve_prefills"] = prefills
    with serving(proxy_dir, tenants or None, bound, engines, slots) as url:
        alone = asyncio.run(load(url, seed, duration, flood=False))
        both = asyncio.run(load(url, seed, duration, flood=True))
    return {"seed": seed, "alone": alone["quiet"], "quiet": both["quiet"], "flood": both["flood"]}


def run_goodput(seed: int, duration: float, proxy_dir: Path, target_s: float) -> dict[str, Any]:
    """One tenant at 1.5x the capacity, without a TTFT target and with one: how many requests
    a second get their first token within `target_s` (goodput), and how many are refused."""
    out: dict[str, Any] = {"seed": seed, "target_s": target_s}
    for label in GOODPUT:
        tenants = {"ttft_targets_s": {"standard": target_s}} if label == "target" else None
        with serving(proxy_dir, tenants) as url:
            rows = asyncio.run(one_tenant(url, seed, duration))
        met = sum(1 for r in rows if r["ttft_s"] is not None and r["ttft_s"] <= target_s)
        found = summary(rows)
        found["met"] = met
        found["goodput_per_s"] = round(met / duration, 2)
        out[label] = found
    return out


async def one_tenant(url: str, seed: int, duration: float) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        return await tenant(client, url, "flood", 1.5 * CAPACITY, duration, seed)


def engines_from(args: argparse.Namespace) -> Engines:
    """--engine-priority: vLLM's priority order and chunked prefill, steps of 2048 tokens
    unless --engine-chunk-tokens says otherwise; --engine-preempt: and preemption between."""
    by_priority = args.engine_priority or args.engine_preempt
    default_chunk = VLLM_BATCHED_TOKENS if by_priority else 0
    chunk = default_chunk if args.engine_chunk_tokens is None else args.engine_chunk_tokens
    if chunk < 0 or (args.engine_preempt and not chunk):
        raise ValueError("--engine-chunk-tokens must be >= 0, and > 0 with --engine-preempt")
    return Engines(by_priority, chunk, args.engine_preempt)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--proxy-dir", type=Path, default=ROOT)
    parser.add_argument("--label", default="this build")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--reserve",
        type=int,
        nargs="+",
        default=[0],
        metavar="N",
        help="tenants.reserve_slots to run each seed with, in turn (default: 0)",
    )
    parser.add_argument(
        "--reserve-prefills",
        type=int,
        nargs="+",
        default=[0],
        metavar="N",
        help="tenants.reserve_prefills to run each seed with, in turn, after --reserve's "
        "(default: 0)",
    )
    parser.add_argument(
        "--bound",
        choices=["proxy", "backends"],
        default="proxy",
        help="hold the 8 slots in the proxy (server.max_inflight, default) or in the "
        "backends (max_inflight 2 each: requests wait for a backend below its bound)",
    )
    parser.add_argument(
        "--engine-priority",
        action="store_true",
        help="the engines order their prefill queue by priority (vLLM's --scheduling-policy "
        "priority), and the proxy sends each request's (engine_priority: lower_first); they "
        f"prefill in steps of --engine-chunk-tokens (default {VLLM_BATCHED_TOKENS}), the "
        "prompts begun first, as vLLM's chunked prefill",
    )
    parser.add_argument(
        "--engine-chunk-tokens",
        type=int,
        default=None,
        metavar="N",
        help=f"prompt tokens per engine step (vLLM's --max-num-batched-tokens; default "
        f"{VLLM_BATCHED_TOKENS} with --engine-priority or --engine-preempt, else 0); 0: whole "
        "prompts, serially (the engine model before steps)",
    )
    parser.add_argument(
        "--engine-preempt",
        action="store_true",
        help="--engine-priority, and between steps a higher-priority prompt passes a begun "
        "one (the mock's --preempt-prefill; vLLM does not do this)",
    )
    parser.add_argument(
        "--slots",
        type=int,
        default=SLOTS,
        help=f"requests the fleet is let hold (default {SLOTS}, what it serves without "
        "queueing; more queue at the engines' serial prefill)",
    )
    parser.add_argument(
        "--goodput",
        type=float,
        metavar="TARGET_S",
        help="instead: one tenant at 1.5x the capacity, with and without this TTFT target",
    )
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    try:
        engines = engines_from(args)
    except ValueError as e:
        parser.error(str(e))
    rows = []
    proxy_dir = args.proxy_dir.resolve()
    for seed in args.seeds:
        if args.goodput:
            row = run_goodput(seed, args.duration, proxy_dir, args.goodput)
            rows.append(row)
            for label in GOODPUT:
                print(goodput_line(seed, label, row[label], args.goodput), flush=True)
            continue
        for reserve, prefills in [(r, p) for r in args.reserve for p in args.reserve_prefills]:
            label = f"{args.label}, reserve {reserve}" if reserve else args.label
            label += f", prefills kept {prefills}" if prefills else ""
            label += f", engines {engines.label()}" if engines.label() else ""
            found = run(
                seed,
                args.duration,
                proxy_dir,
                reserve,
                args.bound,
                engines,
                args.slots,
                prefills,
            )
            row = {**found, "label": label, "bound": args.bound}
            row["reserve_slots"] = reserve
            row["reserve_prefills"] = prefills
            rows.append(row)
            print(flood_line(label, seed, row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def goodput_line(seed: int, label: str, g: dict[str, Any], target_s: float) -> str:
    return (
        f"seed {seed}, {label}: {g['met']} of {g['requests']} within {target_s:g} s "
        f"({g['goodput_per_s']}/s), TTFT p50/p99 {g['ttft_p50_ms']:.0f}/"
        f"{g['ttft_p99_ms']:.0f} ms, {g['statuses']}"
    )


def flood_line(label: str, seed: int, row: dict[str, Any]) -> str:
    a, q, f = row["alone"], row["quiet"], row["flood"]
    return (
        f"{label} seed {seed}: quiet TTFT p50/p90/p99 alone {a['ttft_p50_ms']:.0f}/"
        f"{a['ttft_p90_ms']:.0f}/{a['ttft_p99_ms']:.0f} ms, with the flood "
        f"{q['ttft_p50_ms']:.0f}/{q['ttft_p90_ms']:.0f}/{q['ttft_p99_ms']:.0f} ms "
        f"({q['ttft_p99_ms'] / a['ttft_p99_ms']:.2f}x p99); "
        f"quiet refused {q['refused']} of {q['requests']}; flood {f['statuses']}, "
        f"{f['refused_with_retry_after']} of {f['refused']} refusals with Retry-After"
    )


if __name__ == "__main__":
    main()
