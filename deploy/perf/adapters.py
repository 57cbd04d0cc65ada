"""LoRA adapters: does every adapter request reach an engine serving the adapter, and how much
of the prompts come from cache, against an adapter-aware static affinity?

    python deploy/perf/adapters.py [--seeds 1 2 3] [--requests 400] [--json FILE]

Four simulated engines (`warmroute sim`, `--kv-blocks` each) and four LoRA adapters, each
served by two of them (a, b on engine 0; b, c on 1; c, d on 2; d, a on 3), the base model on
all. The workload: 8 system prompts of ~1,500 tokens, each asked of the base model and of every
adapter (40 (model, prompt) pairs, Zipf-popular in a random order per seed), each request with
its own question; an engine caches a (model, prompt) pair apart from every other (vLLM keys an
adapter's blocks by its name). Two setups, each on fresh engines:

- `static`: each pair sent straight to one engine serving its model, fixed by a hash of the
  pair: the adapter-aware static affinity (every repeat of a pair finds it cached, if the
  engine's cache holds all the pairs it was dealt);
- `warmroute`: the same requests through `warmroute serve` in front of the four, which learns
  the adapters from the engines' `/v1/models`.

Prints per seed and setup the requests answered, those an engine refused for not serving their
model (404: sent to the wrong engine), the hit ratio (cached prompt tokens over prompt tokens,
from the engines' usage) and the response time p50/p99. Not a test: numbers depend on the
machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from proxy.demo.stack import Stack, free_ports  # noqa: E402

BASE = "sim-8b"
ADAPTERS = ("a", "b", "c", "d")
SERVED = (("a", "b"), ("b", "c"), ("c", "d"), ("d", "a"))  # per engine
PROMPTS = 8
SYSTEM_CHARS = 6000  # ~1,500 tokens of the sim's 4 characters
MODELS = (BASE, *ADAPTERS)


def serving(model: str) -> list[int]:
    """The engines that serve `model`."""
    return [i for i, served in enumerate(SERVED) if model == BASE or model in served]


def static_engine(model: str, prompt: int) -> int:
    engines = serving(model)
    return engines[zlib.crc32(f"{model}/{prompt}".encode()) % len(engines)]


def workload(seed: int, n: int) -> list[tuple[str, int, dict[str, Any]]]:
    """n requests: (model, prompt index, body)."""
    rng = random.Random(seed)
    systems = [
        f"[system {k}] " + "".join(rng.choices("abcdefgh ", k=SYSTEM_CHARS)) for k in range(PROMPTS)
    ]
    pairs = [(m, k) for m in MODELS for k in range(PROMPTS)]
    rng.shuffle(pairs)
    weights = [1 / (r + 1) for r in range(len(pairs))]
    out = []
    for i in range(n):
        model, k = rng.choices(pairs, weights)[0]
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": systems[k]},
                {"role": "user", "content": f"question {i}: " + "x" * rng.randint(40, 200)},
            ],
            "max_tokens": 4,
            "ignore_eos": True,
        }
        out.append((model, k, body))
    return out


async def send(
    urls: list[str], requests: list[tuple[str, int, dict[str, Any]]], concurrency: int
) -> list[dict[str, Any]]:
    """Each request to its URL (one per request), `concurrency` at a time."""
    rows: list[dict[str, Any]] = []
    queue = list(zip(urls, requests, strict=True))
    queue.reverse()
    async with httpx.AsyncClient(timeout=120) as client:

        async def worker() -> None:
            while queue:
                url, (model, _, body) = queue.pop()
                started = time.perf_counter()
                r = await client.post(url, json=body)
                row: dict[str, Any] = {"model": model, "status": r.status_code}
                row["s"] = time.perf_counter() - started
                if r.status_code == 200:
                    usage = r.json()["usage"]
                    row["prompt"] = usage["prompt_tokens"]
                    row["cached"] = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0
                    )
                rows.append(row)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r["status"] == 200]
    times = sorted(r["s"] for r in ok)

    def pct(q: float) -> float | None:
        return times[min(len(times) - 1, int(q * len(times)))] * 1000 if times else None

    prompt = sum(r["prompt"] for r in ok)
    return {
        "requests": len(rows),
        "ok": len(ok),
        "wrong_engine": sum(r["status"] == 404 for r in rows),
        "other_errors": sum(r["status"] not in (200, 404) for r in rows),
        "hit": sum(r["cached"] for r in ok) / prompt if prompt else None,
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
    }


def run(setup: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    *engine_ports, port = free_ports(len(SERVED) + 1)
    engines = [f"http://127.0.0.1:{p}" for p in engine_ports]
    requests = workload(seed, args.requests)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMROUTE_")}
    with Stack() as stack, tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        for i, (p, served) in enumerate(zip(engine_ports, SERVED, strict=True)):
            proc = stack.spawn(
                f"engine{i}",
                ["sim", "--port", str(p), "--lora-modules", ",".join(served),
                 "--kv-blocks", str(args.kv_blocks), "--time-scale", str(args.time_scale),
                 "--seed", str(seed)],
                env=env,
            )  # fmt: skip
            stack.wait_http(f"http://127.0.0.1:{p}/health", proc)
        if setup == "static":
            urls = [f"{engines[static_engine(m, k)]}/v1/chat/completions" for m, k, _ in requests]
        else:
            config = {
                "server": {"port": port},
                "backends": [{"url": u, "engine": "vllm"} for u in engines],
                "telemetry": {"enabled": False},
            }
            json.dump(config, f)  # YAML is a superset of JSON
            f.flush()
            proxy = stack.spawn("proxy", ["serve", "--config", f.name], env=env)
            stack.wait_http(f"http://127.0.0.1:{port}/ready", proxy)
            urls = [f"http://127.0.0.1:{port}/v1/chat/completions"] * len(requests)
        rows = asyncio.run(send(urls, requests, args.concurrency))
    return {"setup": setup, "seed": seed, **summary(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=600, help="each engine's KV pool")
    parser.add_argument("--time-scale", type=float, default=5.0, help="the sims' speed-up")
    parser.add_argument("--json", default=None, help="write every row here")
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        for setup in ("static", "warmroute"):
            row = run(setup, seed, args)
            rows.append(row)
            hit = "-" if row["hit"] is None else f"{row['hit']:.1%}"
            print(
                f"seed {seed}  {setup:<9}  ok {row['ok']}/{row['requests']}  "
                f"wrong engine {row['wrong_engine']}  errors {row['other_errors']}  hit {hit}  "
                f"response p50 {row['p50_ms']:.0f} ms  p99 {row['p99_ms']:.0f} ms",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
