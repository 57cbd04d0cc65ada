#!/usr/bin/env python3
"""Where the proxy's part of a request's time to first byte goes, step by step, at c=1.

    deploy/perf/ttft_path.py [--requests 1500] [--system-chars 200] [--chunks 16]
    deploy/perf/ttft_path.py --interval-ms 5      # the mock paced as an engine: see below

Starts the zero-latency bench mock (two instances) and `warmroute serve` in front of it, the
latter with a timestamp taken at each step of a request's path: its first bytes read by the
HTTP protocol, the head parsed (uvicorn's scope and the request's task), the handler entered,
the body parsed and validated, the backends' views read, the routing decision, the telemetry
record opened, the upstream request handed to the socket, the upstream's response head parsed,
the relay started, and the response's first bytes handed to the client's socket. It sends
REQUESTS streamed chat completions at concurrency 1 after 300 of warm-up and prints, per
step, the median time since the request's first bytes were read (µs) and the step's own share.

What it shows is wall time at c=1, as a client waiting for its first token sees it (between two
requests the proxy sleeps and its caches go cold: a step costs more here than under load), with
the backend's own time (the mock's, upstream write to upstream head) in the middle. Each
timestamp's wrapper adds ~0.3 µs. The steps are the proxy's functions by name: a refactor that
renames one drops its line (a warning says which). Compare builds in one session
(`--tree DIR` runs another checkout's proxy); deploy/perf/hot_path.sh measures the added TTFT
itself, deploy/perf/added_ttft.py beside other proxies'.

With `--interval-ms` the mock paces its content chunks as an engine does: the proxy then sleeps
between chunks and between requests while the mock and the client run, and each step of the
next request's path runs two to three times slower than at 0 (its code and data are no longer
in the core's caches): the case an idle proxy in front of real engines is in.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# The checkout whose proxy runs (--tree; this one by default)
TREE = Path(os.environ.get("TTFT_PATH_TREE", str(ROOT))).resolve()
sys.path.insert(0, str(TREE))

# (label, module, attribute): a timestamp at the call ("label") and, for the `timed` ones, at
# its return ("label done"); in the order a request passes them.
STEPS = [
    (
        "head parsed",
        "uvicorn.protocols.http.httptools_impl",
        "HttpToolsProtocol.on_headers_complete",
    ),
    ("handler", "proxy.forwarding.forward", "ProxyEndpoint.__call__"),
    ("body parse", "proxy.forwarding.forward", "parse"),
    ("routing", "proxy.forwarding.state", "RequestRouting.route"),
    ("views", "proxy.forwarding.state", "RequestRouting.views"),
    ("record", "proxy.forwarding.forward", "start_record"),
    ("upstream write", "proxy.upstream.pool", "Upstream.post"),
    ("upstream head", "proxy.upstream.conn", "Connection.on_headers_complete"),
    ("relay", "proxy.forwarding.relay", "Relay.stream"),
]
TIMED = {"body parse", "views", "routing", "record"}  # their return is a step too


def _serve_with_marks(out: str, warmup: int, serve_args: list[str]) -> None:
    """The child: `warmroute serve` with the STEPS wrapped; SIGUSR2 writes the samples of
    the requests after the first `warmup` to `out` (whole: written beside it, then renamed)."""
    import importlib
    import inspect

    marks: list[tuple[str, int]] = []
    samples: list[dict[str, float]] = []
    warmed: list[bool] = []
    clock = time.perf_counter_ns

    def mark(label: str) -> None:
        if marks and all(m[0] != label for m in marks):
            marks.append((label, clock()))

    def wrap(label: str, module: str, attr: str) -> None:
        owner: Any = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        f = getattr(owner, name, None) if owner is not None else None
        if f is None:
            print(f"ttft_path: no {module}.{attr}: its step is not measured", file=sys.stderr)
            return
        timed = label in TIMED
        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def step(*a: Any, **k: Any) -> Any:
                mark(label)
                r = await f(*a, **k)
                if timed:
                    mark(label + " done")
                return r

        else:

            @functools.wraps(f)
            def step(*a: Any, **k: Any) -> Any:
                mark(label)
                r = f(*a, **k)
                if timed:
                    mark(label + " done")
                return r

        setattr(owner, name, step)

    from proxy.edge.limits import LimitedHttpToolsProtocol
    from proxy.server.serve import HeadWithBodyTransport

    read = LimitedHttpToolsProtocol.data_received

    def data_received(self: Any, data: bytes) -> None:
        if not marks:  # a new request's first bytes
            marks.append(("read", clock()))
        read(self, data)

    LimitedHttpToolsProtocol.data_received = data_received  # type: ignore[method-assign]
    write = HeadWithBodyTransport.write

    def first_bytes(self: Any, data: bytes) -> None:
        held = self._held is not None  # the response head, going out with these bytes
        write(self, data)
        if held and marks:
            t0 = marks[0][1]
            if len(marks) > 2:  # a proxied request's (not /ready's, say)
                samples.append({label: (t - t0) / 1000 for label, t in marks})
                samples[-1]["first byte out"] = (clock() - t0) / 1000
                if not warmed and len(samples) == warmup:
                    samples.clear()
                    warmed.append(True)
            marks.clear()

    HeadWithBodyTransport.write = first_bytes  # type: ignore[method-assign]
    for label, module, attr in STEPS:
        wrap(label, module, attr)

    def dump(*_: Any) -> None:
        Path(out + ".part").write_text(json.dumps(samples if warmed else []))
        os.replace(out + ".part", out)

    signal.signal(signal.SIGUSR2, dump)
    from proxy.cli import main

    sys.argv = ["warmroute", "serve", *serve_args]
    main()


def _wait(url: str) -> None:
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # another process: nothing to wait on but its answer
    raise SystemExit(f"ttft_path: {url} did not come up")


def _bench(port: int, system_chars: int, requests: int) -> None:
    subprocess.run(
        [sys.executable, "-m", "proxy", "bench", "--base-url", f"http://127.0.0.1:{port}",
         "--workload", "hot-prompt", "--system-chars", str(system_chars), "--user-chars", "50",
         "--model", "mock", "--concurrency", "1", "--requests", str(requests), "--no-progress"],
        check=True, stdout=subprocess.DEVNULL, cwd=ROOT,
    )  # fmt: skip


def table(samples: list[dict[str, float]]) -> list[tuple[str, float, float]]:
    """(step, median µs since the request's first bytes, median of the step's own share)."""
    order: list[str] = []
    for s in samples:
        for label in s:
            if label not in order:
                order.append(label)
    medians = {k: statistics.median(s[k] for s in samples if k in s) for k in order}
    order.sort(key=medians.__getitem__)
    rows, last = [], 0.0
    for k in order:
        rows.append((k, medians[k], medians[k] - last))
        last = medians[k]
    return rows


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 3 and sys.argv[1] == "--serve-with-marks":
        _serve_with_marks(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--system-chars", type=int, default=200)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument(
        "--interval-ms", type=float, default=0.0,
        help="the mock's gap between content chunks (0: a whole answer at once; 5-20: an "
        "engine's pace, the proxy sleeping between chunks and between requests)",
    )  # fmt: skip
    p.add_argument("--json", metavar="FILE", help="also write the samples here")
    p.add_argument(
        "--tree", metavar="DIR", default=str(ROOT),
        help="run the proxy of this checkout (another build, to compare in one session)",
    )  # fmt: skip
    a = p.parse_args(argv)
    from proxy.demo.stack import free_ports

    mock_port, _, port = free_ports(3)
    backends = [f"http://127.0.0.1:{mock_port}", f"http://127.0.0.1:{mock_port + 1}"]
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "samples.json")
        try:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "proxy.bench.mock", "--port", str(mock_port),
                 "--instances", "2", "--chunks", str(a.chunks),
                 "--chunk-interval-ms", f"{a.interval_ms:g}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
            ))  # fmt: skip
            serve = [f"--backend={b}" for b in backends]
            serve += ["--port", str(port), "--log-level", "warning"]
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--serve-with-marks", out, str(a.warmup), *serve],
                stdout=subprocess.DEVNULL, cwd=a.tree, env={**os.environ, "TTFT_PATH_TREE": a.tree},
            ))  # fmt: skip
            _wait(f"http://127.0.0.1:{port}/ready")
            _bench(port, a.system_chars, a.warmup + a.requests)
            procs[-1].send_signal(signal.SIGUSR2)
            deadline = time.monotonic() + 30
            while not Path(out).exists():
                if time.monotonic() > deadline or procs[-1].poll() is not None:
                    raise SystemExit("ttft_path: the proxy wrote no samples")
                time.sleep(0.05)  # the child writes them from its signal handler
            samples = json.loads(Path(out).read_text())
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(10)
    if a.json:
        Path(a.json).write_text(json.dumps(samples))
    paced = f", {a.interval_ms:g} ms apart" if a.interval_ms else ""
    print(
        f"{len(samples)} requests at c=1, {a.system_chars}-char system prompts, {a.chunks}-chunk "
        f"streams{paced}; median µs since the request's first bytes were read (the step's own)"
    )
    for label, at, own in table(samples):
        print(f"  {label:<22} {at:8.1f}  (+{own:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
