"""`warmroute bench` and `warmroute bench report`: argument parsing and orchestration only."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from proxy.bench.client import MAX_REQUESTS, BenchError, run_bench, run_paired
from proxy.bench.metrics import parse_slo, summarize
from proxy.bench.options import (
    EPILOG,
    REPORT_EPILOG,
    add_load_options,
    add_output_options,
    add_report_outputs,
    add_size_options,
    add_target_options,
    positive,
)
from proxy.bench.report import (
    format_table,
    load_runs,
    plot_cdfs,
    print_notes,
    results_document,
    write_json,
)
from proxy.bench.results import RunResult
from proxy.bench.workloads import make_workload

DEFAULT_CONCURRENCY = 8  # closed loop, when neither --concurrency nor --rate is given


def register(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="load-test warmroute or any OpenAI-compatible server; TTFT/ITL report",
        description=(
            "Send a seeded workload to an OpenAI-compatible server (warmroute, vLLM, "
            "llama.cpp, ...), time every streamed chunk, and report TTFT, ITL, TPOT, E2E, "
            "throughput, goodput and prefix-cache hits side by side."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pos, flt = positive(int), positive(float)
    add_target_options(p)
    add_load_options(p, pos, flt)
    add_size_options(p, pos)
    add_output_options(p)
    p.set_defaults(func=run_command)

    rsub = p.add_subparsers(dest="bench_command", metavar="{report}")
    r = rsub.add_parser(
        "report",
        help="merge saved results files into one side-by-side table and plots",
        description="Merge runs from results files into one side-by-side table (and plots).",
        epilog=REPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("files", nargs="+", metavar="RESULTS.json")
    add_report_outputs(r)
    r.set_defaults(func=report_command)


def _fail(msg: str) -> int:
    print(f"warmroute bench: error: {msg}", file=sys.stderr)
    return 2


def process_cpu_s(pids: Sequence[int] | None) -> float | None:
    """User+system CPU seconds of these processes (from /proc), or None when not asked."""
    if not pids:
        return None
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError as e:
            raise BenchError(
                f"--server-pid {pid}: cannot read its CPU time ({e.strerror})"
            ) from None
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _misuse(args: argparse.Namespace) -> str | None:
    """What is wrong with the options together, if anything (the concurrency defaults here)."""
    if not args.base_url and not args.direct:
        return "--base-url is required (or WARMROUTE_BENCH_BASE_URL), or --direct alone"
    if args.concurrency is None and args.rate is None:
        args.concurrency = DEFAULT_CONCURRENCY  # closed loop
    if args.interleave and args.rate is not None:
        return "--interleave is closed loop: give --concurrency, not --rate"
    if args.interleave and args.vary_seed:
        return "--interleave sends the same requests to every run; drop --vary-seed"
    if args.requests > MAX_REQUESTS:
        return f"--requests is capped at {MAX_REQUESTS}"
    return None


def _plan(args: argparse.Namespace) -> list[tuple[str | list[str], str | None, str]]:
    """The runs, in order: (URL or the backends' URLs, label, role: target|compare|direct)."""
    plan: list[tuple[str | list[str], str | None, str]] = []
    if args.base_url:
        plan.append((args.base_url, args.label, "target"))
    plan += [(u, None, "compare") for u in args.compare or []]
    if args.direct:
        direct_label = "direct" if args.direct_affinity == "round-robin" else "direct-system"
        label = direct_label if args.base_url else (args.label or direct_label)
        plan.append((list(args.direct), label, "direct"))
    return plan


async def _runs(
    args: argparse.Namespace,
    plan: list[tuple[str | list[str], str | None, str]],
    workload: Any,
    common: dict[str, Any],
) -> list[RunResult]:
    """Every run of the plan, one after another (or interleaved), with the target's server
    CPU when --server-pid names its processes."""
    if args.interleave and len(plan) > 1:
        # One paired run: the server CPU of the whole run is the target's (the other
        # groups never touch it), as long as --server-pid names the target's processes.
        cpu0 = process_cpu_s(args.server_pid)
        runs = await run_paired(plan, workload, **common)
        cpu1 = process_cpu_s(args.server_pid)
        if cpu0 is not None and cpu1 is not None:
            runs[0].server_cpu_s = cpu1 - cpu0
        return runs
    runs = []
    for k, (url, label, role) in enumerate(plan):
        cpu0 = process_cpu_s(args.server_pid) if role == "target" else None
        # --vary-seed: same shape, disjoint prompts, so no run inherits a warm cache.
        w = dataclasses.replace(workload, seed=workload.seed + k) if args.vary_seed else workload
        runs.append(await run_bench(url, w, label=label, role=role, **common))
        cpu1 = process_cpu_s(args.server_pid) if cpu0 is not None else None
        if cpu0 is not None and cpu1 is not None:
            runs[-1].server_cpu_s = cpu1 - cpu0
    return runs


def run_command(args: argparse.Namespace) -> int:
    misuse = _misuse(args)
    if misuse is not None:
        return _fail(misuse)
    try:
        slo = parse_slo(args.slo)
        extra = orjson.loads(args.extra_body) if args.extra_body else None
        if extra is not None and not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
        workload = make_workload(
            args.workload,
            seed=args.seed,
            system_chars=args.system_chars,
            num_prefixes=args.prefixes,
            zipf_s=args.zipf,
            user_chars=args.user_chars,
            doc_chars=args.doc_chars,
            max_tokens=args.max_tokens,
            doc_max_tokens=args.doc_max_tokens,
            turns=args.turns,
            doc_fraction=args.doc_fraction,
        )
    except (ValueError, orjson.JSONDecodeError) as e:
        return _fail(str(e))
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    plan = _plan(args)
    common: dict[str, Any] = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "rate": args.rate,
        "model": args.model,
        "progress": not args.no_progress,
        "endpoint": args.endpoint,
        "max_duration": args.max_duration,
        "request_timeout": args.request_timeout,
        "extra_body": extra,
        "api_key": api_key,
        "allow_remote": args.allow_remote,
        "affinity": args.direct_affinity,
        "close_connections": args.close_connections,
    }

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runs = runner.run(_runs(args, plan, workload, common))
    except BenchError as e:
        return _fail(str(e))
    _unique_labels(runs)
    if args.out:
        write_json(args.out, results_document(runs, slo=slo, command=["warmroute", *sys.argv[1:]]))
    return _emit(runs, slo, args, max_error_rate=args.max_error_rate)


def report_command(args: argparse.Namespace) -> int:
    try:
        slo = parse_slo(args.slo)
        runs = load_runs(args.files)
    except ValueError as e:
        return _fail(str(e))
    return _emit(runs, slo, args, max_error_rate=None)


def _emit(
    runs: Sequence[RunResult],
    slo: dict[str, float],
    args: argparse.Namespace,
    *,
    max_error_rate: float | None,
) -> int:
    table = format_table(runs, slo=slo)
    print(table, end="")
    print_notes(runs)
    if args.out_md:
        Path(args.out_md).write_text(table)
    if args.plots:
        for path in plot_cdfs(runs, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    if max_error_rate is None:
        return 0
    status = 0
    for run in runs:
        s = summarize(run)
        sent = max(s["requests_sent"], 1)
        if s["failed"] / sent > max_error_rate:
            print(
                f"warmroute bench: {run.label}: {s['failed']} of {s['requests_sent']} requests "
                f"failed ({', '.join(f'{k}: {v}' for k, v in s['errors'].items())})",
                file=sys.stderr,
            )
            status = 1
    return status


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed: less client CPU per chunk, so the client stays off the
    critical path at high chunk rates."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _unique_labels(runs: Sequence[RunResult]) -> None:
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.label] = seen.get(r.label, 0) + 1
        if seen[r.label] > 1:
            r.label = f"{r.label}#{seen[r.label]}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run `warmroute bench` standalone (tests, python -m proxy.bench.cli)."""
    parser = argparse.ArgumentParser(prog="warmroute")
    register(parser.add_subparsers())
    args = parser.parse_args(["bench", *(argv or [])])
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
