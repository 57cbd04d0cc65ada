"""CPU that telemetry code costs per request, in process: this tree against a git revision.

`python -m proxy.harness.telemetry_cost --old 33ead9a` runs the calls the proxy makes for one
streamed 64-chunk request (observe_routing, start_request, set_decision, attempt +
inject_headers, finish) in a loop, old and new code alternating round by round in one process,
and prints the median and best µs per request for metrics only, traces sampled at 10% and
traces at 100% through the OTLP/HTTP exporter. Process CPU time is measured, so the export
thread counts; the OTLP receiver is a child process that reads and discards each export.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from proxy.config import TelemetryConfig
from proxy.routing.types import Decision
from proxy.types import StreamFacts

SINK = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

CONFIGS = {
    "metrics": ({}, "metrics only"),
    "ratio10": (
        {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"},
        "traces 10%",
    ),
    "traces": ({"OTEL_TRACES_SAMPLER": "parentbased_always_on"}, "traces 100%"),
}


def load_old(rev: str) -> Any:
    shown = subprocess.run(
        ["git", "show", f"{rev}:proxy/telemetry.py"], capture_output=True, text=True
    )
    if shown.returncode != 0:
        # Since telemetry became a package (proxy/telemetry/), one revision's code cannot be
        # loaded beside another's in this process.
        raise SystemExit(
            f"telemetry_cost: {rev} has no single-module proxy/telemetry.py to load beside this "
            "tree's; compare whole builds instead: deploy/perf/count-instructions.sh run in a "
            f"worktree of {rev} and in this one"
        )
    src = shown.stdout
    path = os.path.join(tempfile.mkdtemp(), "telemetry_old.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("telemetry_old", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["telemetry_old"] = module
    spec.loader.exec_module(module)
    return module


def workload() -> tuple[Decision, Callable[[], StreamFacts], dict[str, Any]]:
    decision = Decision(
        policy="prefix_aware",
        ranking=["b0", "b1"],
        reason="highest score",
        scores={"b0": {"prefix": 0.8, "queue": 1.0, "kv_usage": 0.9, "inflight": 0.5, "ttft": 0.7}},
        totals={"b0": 3.9, "b1": 2.1},
        matched_blocks={"b0": 3, "b1": 0},
        prefix_blocks=4,
        prompt_chars=250,
        decision_s=0.00004,
    )
    gaps = [0.0002 + 0.00001 * (i % 7) for i in range(63)]
    fwd = [0.00003 + 0.000001 * (i % 5) for i in range(64)]

    def facts() -> StreamFacts:
        t = time.perf_counter()
        return StreamFacts(
            ttft_s=0.004,
            upstream_ttft_s=0.0035,
            itl_s=list(gaps),
            tpot_s=0.00021,
            e2e_s=0.018,
            chunks=64,
            events=67,
            output_tokens=64,
            input_tokens=70,
            cached_tokens=48,
            finish_reasons=["length"],
            response_id="chatcmpl-mock",
            response_model="mock",
            error=None,
            cancelled=False,
            first_output_at=t - 0.014,
            last_output_at=t,
            forward_s=list(fwd),
        )

    params = {"model": "mock", "messages": [{"role": "user", "content": "x"}], "stream": True}
    params["max_tokens"] = 128
    return decision, facts, params


def run(tel: Any, n: int, decision: Decision, facts: Callable[[], StreamFacts], params: Any) -> int:
    """CPU ns for n requests (facts built outside the timed part, as the meter builds them)."""
    all_facts = [facts() for _ in range(n)]
    headers = {"content-type": "application/json"}
    t = time.process_time_ns()
    for i in range(n):
        tel.observe_routing("prefix_aware", "highest score", 0.00004)
        rec = tel.start_request(
            request_id=f"req-{i}",
            api="chat",
            model="mock",
            stream=True,
            params=params,
            headers=headers,
            t0=time.perf_counter(),
        )
        rec.set_decision(decision)
        attempt = rec.attempt(backend="b0", address="127.0.0.1", port=9201, attempt=1)
        upstream: dict[str, str] = {}
        attempt.inject_headers(upstream)
        rec.finish(all_facts[i], status=200, backend="b0")
    tel.tracer_provider.force_flush()  # every span processor, through the SDK's public API
    return time.process_time_ns() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="HEAD", help="git revision to compare with (default HEAD)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("-n", type=int, default=1000, help="requests per round and configuration")
    ap.add_argument("--configs", default="metrics,ratio10,traces")
    ap.add_argument("--sink-port", type=int, default=9250)
    args = ap.parse_args()

    import proxy.telemetry as new

    old = load_old(args.old)
    sink = subprocess.Popen([sys.executable, "-c", SINK, str(args.sink_port)])
    time.sleep(0.5)
    try:
        decision, facts, params = workload()
        tels: dict[tuple[str, str], Any] = {}
        for c in args.configs.split(","):
            env, _ = CONFIGS[c]
            for k in ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"):
                os.environ.pop(k, None)
            os.environ.update(env)
            cfg = TelemetryConfig.model_validate(
                {
                    "traces_exporter": "none" if c == "metrics" else "otlp",
                    "otlp_endpoint": f"http://127.0.0.1:{args.sink_port}",
                }
            )
            for name, mod in (("old", old), ("new", new)):
                tels[(c, name)] = tel = mod.Telemetry(cfg)
                run(tel, 200, decision, facts, params)  # warm caches and the connection
        results: dict[tuple[str, str], list[float]] = {k: [] for k in tels}
        for r in range(args.rounds):
            order = list(tels) if r % 2 == 0 else list(reversed(tels))
            for key in order:
                gc.collect()
                results[key].append(run(tels[key], args.n, decision, facts, params) / args.n / 1e3)
        print(f"µs of telemetry CPU per request ({args.rounds} rounds x {args.n}, old={args.old})")
        print(
            f"{'configuration':16} {'old median':>11} {'old best':>9} {'new median':>11} "
            f"{'new best':>9}"
        )
        for c in args.configs.split(","):
            o, nw = results[(c, "old")], results[(c, "new")]
            print(
                f"{CONFIGS[c][1]:16} {statistics.median(o):11.1f} {min(o):9.1f} "
                f"{statistics.median(nw):11.1f} {min(nw):9.1f}"
            )
        for tel in tels.values():
            tel.shutdown()
    finally:
        sink.terminate()
        sink.wait()


if __name__ == "__main__":
    main()
