#!/usr/bin/env python3
"""The TTFT a proxy adds at concurrency 1, beside other proxies in front of the same mock.

    deploy/perf/added_ttft.py                                    # warmroute, ITL 0 and 5 ms
    PROXIES="nginx sglang-router warmroute" deploy/perf/added_ttft.py
    PROXIES="warmroute@/tmp/before warmroute" ROUNDS=4 deploy/perf/added_ttft.py   # two builds
    ITLS=5 CHUNKS=16 PAIRS=400 deploy/perf/added_ttft.py

For each pace in ITLS the bench mock (two instances, CHUNKS content chunks ITL ms apart: 0 sends
a whole answer at once) is started, every proxy in PROXIES in front of it (the kinds
deploy/perf/paced_chunks.py runs: warmroute, warmroute@DIR, nginx, sglang-router,
vllm-router), each warmed with WARMUP (300) requests; then, ROUNDS times with the proxies' order
reversed every other round, PAIRS streamed chat completions through each proxy at c=1, each
followed by the same request straight to the mock (`warmroute bench --interleave`). A proxy's
added TTFT is its median TTFT less the direct requests' median, measured in the same pairs.

The pace matters. At ITL 0 the proxy is busy from one request to the next and each step of its
path runs with warm caches; paced, it sleeps between chunks and between requests while the mock
and the client run, and each step of the next request's path runs slower
(deploy/perf/ttft_path.py with --interval-ms shows where). At ITL 0 the rest of a stream, relayed
while the client reads its first chunk, also competes with the client for the cores.

Environment: ITLS ("0 5"), CHUNKS (16), PAIRS (400), ROUNDS (2), SYSTEM_CHARS (200), PROXIES
("warmroute"), OUT (/tmp/warmroute-added-ttft: each bench's JSON and added_ttft.json). One line
per pace, round and proxy:
  itl <ms>  r<round>  <proxy>  added TTFT p50 <ms> p99 <ms>  (proxy p50 <ms>, direct p50 <ms>)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "perf"))
sys.path.insert(0, str(ROOT))

from idle_cpu import stop, wait_ready  # noqa: E402
from paced_chunks import _command, _tree  # noqa: E402

from proxy.demo.stack import free_ports  # noqa: E402

WARMUP = 300  # requests through each proxy before the first round (env WARMUP)


def _bench(
    port: int, direct: list[str], n: int, chars: int, out: Path | None, seed: int
) -> dict[str, Any] | None:
    """`n` requests at c=1 through the proxy on `port`, each followed by one to `direct` when
    it is given; the bench's JSON document (None without `out`). Each run has a seed of its
    own: prompts sent again would be heads seen again, which warmroute places."""
    cmd = [
        sys.executable, "-m", "proxy", "bench", "--base-url", f"http://127.0.0.1:{port}",
        "--workload", "hot-prompt", "--system-chars", str(chars), "--user-chars", "50",
        "--model", "mock", "--requests", str(n), "--concurrency", "1", "--no-progress",
        "--seed", str(seed),
    ]  # fmt: skip
    if direct:
        cmd += [a for d in direct for a in ("--direct", d)] + ["--interleave"]
    if out is not None:
        cmd += ["--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return None if out is None else json.loads(out.read_text())


def added(document: dict[str, Any]) -> dict[str, float]:
    """The proxy's added TTFT (p50, p99) and both medians, in ms, from an interleaved bench."""
    proxy, direct = (r["summary"]["ttft_s"] for r in document["runs"])
    extra = document["comparisons"][0]["ttft_s"]
    return {
        "added_p50_ms": round(1000 * extra["p50"], 3),
        "added_p99_ms": round(1000 * extra["p99"], 3),
        "proxy_p50_ms": round(1000 * proxy["p50"], 3),
        "direct_p50_ms": round(1000 * direct["p50"], 3),
    }


def one_pace(itl: float, kinds: list[str], env: dict[str, str], out: Path) -> list[dict[str, Any]]:
    chunks, pairs = env.get("CHUNKS", "16"), int(env.get("PAIRS", "400"))
    rounds, chars = int(env.get("ROUNDS", "2")), int(env.get("SYSTEM_CHARS", "200"))
    mock_port, _, *ports = free_ports(2 + len(kinds))  # (the mock's second instance: +1)
    backends = [f"http://127.0.0.1:{mock_port}", f"http://127.0.0.1:{mock_port + 1}"]
    mock = subprocess.Popen(
        [sys.executable, "-m", "proxy.bench.mock", "--port", str(mock_port), "--instances", "2",
         "--chunks", chunks, "--chunk-interval-ms", f"{itl:g}"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="added-ttft-") as tmp:
        try:
            for url in backends:
                wait_ready(f"{url}/v1/models", 60)
            for kind, port in zip(kinds, ports, strict=True):
                work = Path(tmp) / str(port)
                work.mkdir()
                cmd, ready = _command(kind, port, backends, work)
                procs.append(
                    subprocess.Popen(
                        cmd, cwd=_tree(kind), stdout=subprocess.DEVNULL,
                        stderr=open(work / "stderr", "wb"), start_new_session=True,
                    )
                )  # fmt: skip
                wait_ready(ready, 120)
                _bench(port, [], int(env.get("WARMUP", WARMUP)), chars, None, 1000)
            for r in range(rounds):
                order = list(zip(kinds, ports, strict=True))
                for kind, port in order if r % 2 == 0 else order[::-1]:
                    name = kind.replace("/", "_")
                    json_out = out / f"itl{itl:g}-r{r}-{name}.json"
                    doc = _bench(port, backends, pairs, chars, json_out, r)
                    assert doc is not None
                    row = {"itl_ms": itl, "round": r, "proxy": kind, "pairs": pairs, **added(doc)}
                    rows.append(row)
                    print(
                        f"itl {itl:g}  r{r}  {kind:<22} added TTFT p50 {row['added_p50_ms']:+.3f}"
                        f" ms p99 {row['added_p99_ms']:+.3f} ms  (proxy p50 "
                        f"{row['proxy_p50_ms']:.3f} ms, direct p50 {row['direct_p50_ms']:.3f} ms)",
                        flush=True,
                    )
        finally:
            stop(*procs, mock)
    return rows


def main() -> None:
    env = dict(os.environ)
    kinds = env.get("PROXIES", "warmroute").split()
    out = Path(env.get("OUT", "/tmp/warmroute-added-ttft"))
    out.mkdir(parents=True, exist_ok=True)
    rows = [
        row
        for itl in env.get("ITLS", "0 5").split()
        for row in one_pace(float(itl), kinds, env, out)
    ]
    (out / "added_ttft.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
