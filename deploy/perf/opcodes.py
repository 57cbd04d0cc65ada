#!/usr/bin/env python3
"""Where a request's interpreted work goes: bytecodes run per request, by function and file.

    deploy/perf/opcodes.py [--requests 200] [--warmup 300] [--top 40] [--system-chars 200]
                           [--concurrency 1] [--itl-ms 0]

Starts the zero-latency bench mock (two instances, 16-chunk streams) and `warmroute serve` in
front of it with a tracer that counts each bytecode the interpreter runs (sys.settrace with
opcode events), switched on after WARMUP requests at c=1 and off after REQUESTS more, and
prints the bytecodes per request of the TOP functions and files. `--concurrency` and
`--itl-ms` (the mock's pace between content chunks) count a request among others at an
engine's pace, where work that grows with the requests in flight would show. What is compiled
(the hot path's mypyc modules, uvloop, httptools, orjson) runs no bytecode and is not counted;
the count does not depend on the machine's load, and a function's count is what a change to it
moves. The tracer slows the proxy ~20-fold: the timings of a traced run mean nothing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


FIRST_SCRAPE_S = 2.5  # the default health.metrics_scrape_s, and a margin


def _serve_counting(out: str, serve_args: list[str]) -> None:
    """The child: `warmroute serve`, counting bytecodes between SIGUSR1 and SIGUSR2 (which
    writes the counts to `out`)."""
    counts: collections.Counter[str] = collections.Counter()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        code = frame.f_code
        path = code.co_filename.split("site-packages/")[-1].replace(str(ROOT) + "/", "")
        key = f"{path}:{code.co_firstlineno}:{code.co_name}"
        if path == "<string>":  # a generated method (a dataclass's __init__): named by its class
            cls = type(frame.f_locals.get("self"))
            key = f"<string>:{code.co_firstlineno}:{cls.__module__}.{cls.__qualname__}"
            key += f".{code.co_name}"

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                counts[key] += 1
            return local

        return local

    def on(*_: Any) -> None:
        sys.settrace(tracer)

    def off(*_: Any) -> None:
        sys.settrace(None)
        Path(out + ".part").write_text(json.dumps(counts))
        os.replace(out + ".part", out)

    signal.signal(signal.SIGUSR1, on)
    signal.signal(signal.SIGUSR2, off)
    from proxy.cli import main

    sys.argv = ["warmroute", "serve", *serve_args]
    main()


def per_file(counts: dict[str, int]) -> dict[str, int]:
    """Function counts (`path:line:name`) summed by path."""
    files: collections.Counter[str] = collections.Counter()
    for key, n in counts.items():
        files[key.rsplit(":", 2)[0]] += n
    return dict(files)


def _bench(port: int, chars: int, n: int, seed: int, concurrency: int = 1) -> None:
    """`n` requests at `concurrency`. Each seed is a workload of its own: the same seed twice would
    send the same prompts again, and a prompt head seen again is placed (a cost the counted
    requests would then all pay)."""
    subprocess.run(
        [sys.executable, "-m", "proxy", "bench", "--base-url", f"http://127.0.0.1:{port}",
         "--workload", "hot-prompt", "--system-chars", str(chars), "--user-chars", "50",
         "--model", "mock", "--requests", str(n), "--concurrency", str(concurrency),
         "--no-progress", "--seed", str(seed)],
        cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--serve-counting":
        _serve_counting(sys.argv[2], sys.argv[3:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--system-chars", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=1, help="of the counted requests")
    p.add_argument("--itl-ms", type=float, default=0.0, help="the mock's pace between chunks")
    p.add_argument("--json", metavar="FILE", help="also write the counts per request here")
    a = p.parse_args(argv)
    from idle_cpu import stop, wait_ready

    from proxy.demo.stack import free_ports

    mock_port, _, port = free_ports(3)
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "counts.json")
        try:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "proxy.bench.mock", "--port", str(mock_port),
                 "--instances", "2", "--chunks", "16", "--chunk-interval-ms", str(a.itl_ms)],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))  # fmt: skip
            serve = [f"--backend=http://127.0.0.1:{mock_port + i}" for i in (0, 1)]
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--serve-counting", out, *serve, "--port", str(port),
                 "--log-level", "warning"],
                cwd=ROOT, stdout=subprocess.DEVNULL,
            ))  # fmt: skip
            wait_ready(f"http://127.0.0.1:{port}/ready", 120)
            ready_at = time.monotonic()
            _bench(port, a.system_chars, a.warmup, 1)
            # Each backend's first metrics scrape (and with it the engine's detection, through
            # httpx: a client, an SSL context, anyio imported) falls at a random point of the
            # first health.metrics_scrape_s (2 s) after start: once, not per request.
            time.sleep(max(0.0, ready_at + FIRST_SCRAPE_S - time.monotonic()))
            procs[-1].send_signal(signal.SIGUSR1)
            _bench(port, a.system_chars, a.requests, 2, a.concurrency)
            procs[-1].send_signal(signal.SIGUSR2)
            deadline = time.monotonic() + 30
            while not Path(out).exists():
                if time.monotonic() > deadline or procs[-1].poll() is not None:
                    raise SystemExit("opcodes: the proxy wrote no counts")
                time.sleep(0.05)  # the child writes them from its signal handler
            counts: dict[str, int] = json.loads(Path(out).read_text())
        finally:
            stop(*reversed(procs))
    per = {k: v / a.requests for k, v in counts.items()}
    if a.json:
        Path(a.json).write_text(json.dumps(per, indent=1))
    at = f"c={a.concurrency}" + (f", ITL {a.itl_ms:g} ms" if a.itl_ms else "")
    print(f"{sum(per.values()):,.0f} bytecodes per request ({a.requests} requests at {at})")
    print("by function:")
    for key, n in sorted(per.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"  {n:8.1f}  {key}")
    print("by file:")
    for key, n in sorted(per_file(per).items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"  {n:8.1f}  {key}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "deploy" / "perf"))
    raise SystemExit(main())
