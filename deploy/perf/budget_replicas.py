"""Three replicas, one budget: does a tokens-per-minute limit hold across proxies sharing Redis?

    python deploy/perf/budget_replicas.py [--replicas 3] [--tpm 60000] [--seconds 90]
        [--measure-from 30] [--seeds 1 2] [--json FILE]

Starts one bench-mock backend (engine mode, for its token counts, with next to no latency),
N `warmroute serve` processes sharing one Redis (a fresh key prefix per run) with
`tenants.default.tokens_per_minute: TPM`, and sends four times the limit's worth of requests
(Poisson, streamed with usage, each to the next replica in turn: a round-robin balancer). The
tokens of a request are the engine's own count (its usage: prompt + completion). Prints, per
seed, the tokens admitted per minute over the window from --measure-from to the end (past the
first ~20 s, in which the full bucket admits a minute's burst on top), as a share of the
limit, and how the refusals were answered. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from proxy.bench.client import exponential_offsets, paced  # noqa: E402
from proxy.demo.stack import Stack, free_ports  # noqa: E402

PROMPT_CHARS = 600


async def load(urls: list[str], rate: float, seconds: float, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []

    async def one(client: httpx.AsyncClient, url: str, at: float, prompt: str) -> None:
        body = {
            "model": "mock",
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": prompt}],
        }
        row: dict[str, Any] = {"at": at}
        try:
            async with client.stream("POST", url, json=body) as r:
                row["status"] = r.status_code
                row["retry_after"] = r.headers.get("retry-after")
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"usage"' in line:
                        usage = json.loads(line[6:]).get("usage") or {}
                        row["tokens"] = usage.get("prompt_tokens", 0) + usage.get(
                            "completion_tokens", 0
                        )
        except httpx.HTTPError as e:
            row["status"] = type(e).__name__
        rows.append(row)

    limits = httpx.Limits(max_connections=500)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        tasks, i = [], 0
        async for at in paced(exponential_offsets(rng, rate, seconds)):
            prompt = f"{seed} {i} " + "".join(rng.choices("abcdefgh ", k=PROMPT_CHARS))
            tasks.append(asyncio.create_task(one(client, urls[i % len(urls)], at, prompt)))
            i += 1
        await asyncio.gather(*tasks)
    return rows


def run(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    mock_port, *ports = free_ports(1 + args.replicas)
    prefix = f"wrbudget-{uuid.uuid4().hex[:8]}"
    config = {
        "backends": [{"url": f"http://127.0.0.1:{mock_port}"}],
        "redis": {"url": args.redis, "key_prefix": prefix},
        "tenants": {"default": {"tokens_per_minute": args.tpm}},
        "telemetry": {"enabled": False},
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMROUTE_")}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f, Stack() as stack:
        json.dump(config, f)
        f.flush()
        mock = stack.spawn(
            "mock",
            ["--port", str(mock_port), "--chunks", "16", "--cache-tokens", "1000",
             "--prefill-tokens-per-s", "1000000"],
            module="proxy.bench.mock",
        )  # fmt: skip
        stack.wait_http(f"http://127.0.0.1:{mock_port}/health", mock)
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        procs = [
            stack.spawn(
                f"proxy-{port}", ["serve", "--config", f.name, "--port", str(port)], env=env
            )
            for port in ports
        ]
        for url, proc in zip(urls, procs, strict=True):
            stack.wait_http(url + "/ready", proc)
        # A request is ~(PROMPT_CHARS / 3 + 16) of the mock's tokens: four times the limit's
        # rate, so that the minute's burst the full bucket starts with is spent in ~20 s.
        per_request = PROMPT_CHARS / 3 + 16
        rate = 4 * args.tpm / 60 / per_request
        chat = [u + "/v1/chat/completions" for u in urls]
        rows = asyncio.run(load(chat, rate, args.seconds, seed))
    window = args.seconds - args.measure_from
    inside = [r for r in rows if r["at"] >= args.measure_from]
    tokens = sum(r.get("tokens", 0) for r in inside)
    per_minute = tokens / window * 60
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    refused = [r for r in rows if r["status"] == 429]
    return {
        "seed": seed,
        "replicas": args.replicas,
        "tpm": args.tpm,
        "admitted_tokens_per_minute": round(per_minute),
        "share_of_limit": round(per_minute / args.tpm, 4),
        "statuses": statuses,
        "refusals_with_retry_after": sum(r.get("retry_after") is not None for r in refused),
        "prefix": prefix,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--tpm", type=int, default=60_000)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--measure-from", type=float, default=30.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = []
    for seed in args.seeds:
        row = run(args, seed)
        out.append(row)
        print(
            f"seed {seed}: {args.replicas} replicas, limit {args.tpm} tokens/min: admitted "
            f"{row['admitted_tokens_per_minute']} tokens/min from {args.measure_from:g} s to "
            f"{args.seconds:g} s ({row['share_of_limit']:.1%} of the limit); {row['statuses']}, "
            f"{row['refusals_with_retry_after']} refusals with Retry-After",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
