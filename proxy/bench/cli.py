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

from proxy.bench.client import AFFINITIES, MAX_REQUESTS, BenchError, run_bench, run_paired
from proxy.bench.metrics import parse_slo, summarize
from proxy.bench.report import (
    format_table,
    load_runs,
    plot_cdfs,
    print_notes,
    results_document,
    write_json,
)
from proxy.bench.results import RunResult
from proxy.bench.workloads import WORKLOADS, make_workload

ENV_PREFIX = "WARMROUTE_BENCH_"
REPORT_EPILOG = """\
example:
  warmroute bench report proxy.json direct.json --out-md results.md --plots plots/
"""

EPILOG = f"""\
workloads (seeded: the same --seed sends byte-identical prompts):
  shared-prefix  K system prompts (--prefixes, --system-chars) picked with Zipf popularity
                 (--zipf), each followed by a short unique user turn (--user-chars)
  hot-prompt     one system prompt for every request (the hotspot case for routing)
  multi-turn     conversations of --turns turns; each later turn carries the real reply of the
                 earlier ones and is sent only after it completed
  long-doc       long unique prompts (--doc-chars), short answers (--doc-max-tokens)
  mixed          shared-prefix chat streams plus a --doc-fraction of long-doc requests
  chat-docs      the same mix sized for prefill/decode interference: 512-token answers, 15%
                 ~8,000-token documents with 16-token answers (each size flag overrides)
  Sizes are characters; ~4 characters make one token.

metrics (as `vllm bench serve` defines them; see docs/measurement.md):
  TTFT  first chunk carrying output (content/reasoning/tool call/text) - request sent
  ITL   every gap between output chunks;  TPOT (e2e - ttft) / (completion_tokens - 1)
  E2E   last output chunk - request sent; goodput = completed requests/s meeting --slo
  prefix cache hit ratio = sum(cached_tokens) / sum(prompt_tokens) when the server reports
  usage.prompt_tokens_details.cached_tokens

examples:
  # 200 requests, 16 in flight, against the proxy; model taken from /v1/models
  warmroute bench --base-url http://127.0.0.1:8080 --workload shared-prefix \\
      --requests 200 --concurrency 16 --out proxy.json --plots plots/

  # what does the proxy add? same workload straight at the backends (round-robin)
  warmroute bench --base-url http://127.0.0.1:8080 --direct http://127.0.0.1:8001 \\
      --direct http://127.0.0.1:8002 --workload hot-prompt --requests 300 --concurrency 32

  # the static-affinity bound on engines that keep their cache to themselves: system prompt
  # i always on backend i mod N (see "direct affinity" below; python -m proxy.bench.mock -h)
  warmroute bench --direct http://127.0.0.1:9301 --direct http://127.0.0.1:9302 \\
      --direct-affinity system --workload shared-prefix --zipf 0 --requests 400 \\
      --concurrency 32

  # the proxy's added TTFT at concurrency 1, paired request by request with direct access
  warmroute bench --base-url http://127.0.0.1:8080 --direct http://127.0.0.1:8001 \\
      --interleave --requests 2000 --concurrency 1

  # open loop at 4 req/s (Poisson), with an SLO for goodput
  warmroute bench --base-url http://127.0.0.1:8080 --workload mixed --requests 200 \\
      --rate 4 --slo ttft=0.5,tpot=0.05 --out mixed.json

  # compare two proxies side by side, then merge saved runs into one table
  warmroute bench --base-url http://127.0.0.1:8080 --compare http://127.0.0.1:9090 ...
  warmroute bench report a.json b.json --out-md results.md --plots plots/

direct affinity (--direct-affinity, how a run with several --direct URLs picks one):
  round-robin  (default) requests in turn by index; a multi-turn conversation stays on one
  system       system prompt i always on backend i mod N: each backend's cache holds only
               its share of the prompts. A cache-aware router should come close to this
               bound's cache hit ratio and TTFT while also spreading load; requests without
               a system prompt (long-doc) still go round-robin

Runs go one after another (target, --compare targets, then --direct), never at once, so they
do not compete; engines with a prefix cache will be warmer for the later runs (the same
prompts again) unless --vary-seed gives every run its own prompts. --interleave sends each
request to every run in turn instead: the way to compare latencies on a busy machine.
Guard rails: at most {MAX_REQUESTS} requests, --max-duration seconds (default 1800), loopback
targets only unless --allow-remote. Exit status: 0 ok, 1 error rate above --max-error-rate,
2 usage error or unreachable target.
Every option has an environment default WARMROUTE_BENCH_<OPTION>, e.g.
WARMROUTE_BENCH_BASE_URL=http://127.0.0.1:8080, WARMROUTE_BENCH_CONCURRENCY=8,
WARMROUTE_BENCH_DIRECT=url1,url2.
"""


DEFAULT_CONCURRENCY = 8  # closed loop, when neither --concurrency nor --rate is given


def _env(name: str, default: Any = None) -> Any:
    return os.environ.get(ENV_PREFIX + name.upper().replace("-", "_"), default)


def _env_list(name: str) -> list[str] | None:
    raw = _env(name)
    return [u.strip() for u in raw.split(",") if u.strip()] if raw else None


def _env_flag(name: str) -> bool:
    return str(_env(name, "")).lower() in ("1", "true", "yes", "on")


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


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
    pos, flt = _positive(int), _positive(float)
    _target_options(p)
    _load_options(p, pos, flt)
    _size_options(p, pos)
    _output_options(p)
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
    _add_report_outputs(r)
    r.set_defaults(func=report_command)


def _target_options(p: Any) -> None:
    """bench's options: the server(s) to load and how to name the run."""
    g = p.add_argument_group("target")
    g.add_argument(
        "--base-url",
        default=_env("base-url"),
        metavar="URL",
        help="the server to load, e.g. http://127.0.0.1:8080 (/v1 optional)",
    )
    g.add_argument(
        "--model",
        default=_env("model"),
        help="model name (default: the first one the target's /v1/models lists)",
    )
    g.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default=_env("endpoint", "chat"),
        help="/v1/chat/completions (default) or /v1/completions",
    )
    g.add_argument("--label", default=_env("label"), help="name of this run in tables and plots")
    g.add_argument(
        "--compare",
        action="append",
        default=_env_list("compare"),
        metavar="URL",
        help="also run the workload against URL and show it side by side (repeatable)",
    )
    g.add_argument(
        "--direct",
        action="append",
        default=_env_list("direct"),
        metavar="URL",
        help="the backend(s) behind the proxy: run the workload against them directly "
        "(spread by --direct-affinity when repeated) and report the proxy's added TTFT; "
        "without --base-url only the direct run is made",
    )
    g.add_argument(
        "--direct-affinity",
        choices=AFFINITIES,
        default=_env("direct-affinity", "round-robin"),
        help="how requests are spread over several --direct URLs: round-robin (default) or "
        "system (system prompt i on URL i mod N, the static-affinity bound; see below)",
    )
    g.add_argument(
        "--api-key-env",
        default=_env("api-key-env"),
        metavar="VAR",
        help="environment variable holding a bearer token to send",
    )
    g.add_argument(
        "--allow-remote",
        action="store_true",
        default=_env_flag("allow-remote"),
        help="allow targets that are not loopback addresses",
    )


def _load_options(p: Any, pos: Callable[[str], Any], flt: Callable[[str], Any]) -> None:
    """bench's options: how much load, and how it arrives."""
    g = p.add_argument_group("load")
    g.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=_env("workload", "shared-prefix"),
        help="request mix (default shared-prefix; see below)",
    )
    g.add_argument(
        "--requests",
        type=pos,
        default=_env("requests", "100"),
        metavar="N",
        help=f"requests to send (default 100, at most {MAX_REQUESTS})",
    )
    g.add_argument(
        "--concurrency",
        type=pos,
        default=_env("concurrency"),
        metavar="C",
        help="closed loop: C requests in flight (default 8 without --rate); with --rate: "
        "the cap in flight",
    )
    g.add_argument(
        "--rate",
        type=flt,
        default=_env("rate"),
        metavar="R",
        help="open loop: Poisson arrivals at R requests/s",
    )
    g.add_argument("--seed", type=int, default=_env("seed", "0"), help="workload seed (default 0)")
    g.add_argument(
        "--vary-seed",
        action="store_true",
        default=_env_flag("vary-seed"),
        help="give each --compare/--direct run seed+k: same shape, disjoint prompts, so no "
        "run finds a prefix cache warmed by the previous one",
    )
    g.add_argument(
        "--interleave",
        action="store_true",
        default=_env_flag("interleave"),
        help="send each request to the target, then to every --compare/--direct run (taking "
        "turns at going first) instead of one run after another: paired latency samples that "
        "a busy machine's load swings hit alike (use it for the proxy's added TTFT at "
        "--concurrency 1; throughput then describes the mix)",
    )
    g.add_argument(
        "--max-duration",
        type=flt,
        default=_env("max-duration", "1800"),
        metavar="S",
        help="stop sending and cancel in-flight requests after S seconds (default 1800)",
    )
    g.add_argument(
        "--request-timeout",
        type=flt,
        default=_env("request-timeout", "600"),
        metavar="S",
        help="per-request timeout (default 600)",
    )


def _size_options(p: Any, pos: Callable[[str], Any]) -> None:
    """bench's options: the workload's shape."""
    g = p.add_argument_group("workload sizes (characters; ~4 per token)")
    g.add_argument(
        "--max-tokens",
        type=pos,
        default=_env("max-tokens"),
        help="max_tokens of chat requests (default 128)",
    )
    g.add_argument(
        "--system-chars",
        type=pos,
        default=_env("system-chars"),
        help="length of each shared system prompt (default 2000)",
    )
    g.add_argument(
        "--user-chars",
        type=pos,
        default=_env("user-chars"),
        help="length of each unique user turn (default 200)",
    )
    g.add_argument(
        "--doc-chars",
        type=pos,
        default=_env("doc-chars"),
        help="length of each long-doc prompt (default 8000)",
    )
    g.add_argument(
        "--doc-max-tokens",
        type=pos,
        default=_env("doc-max-tokens"),
        help="max_tokens of long-doc requests (default 32)",
    )
    g.add_argument(
        "--prefixes",
        type=pos,
        default=_env("prefixes"),
        metavar="K",
        help="distinct system prompts for shared-prefix/multi-turn/mixed (default 8)",
    )
    g.add_argument(
        "--zipf",
        type=float,
        default=_env("zipf"),
        metavar="S",
        help="Zipf exponent of system prompt popularity, 0 = uniform (default 1.1)",
    )
    g.add_argument(
        "--turns",
        type=pos,
        default=_env("turns"),
        help="turns per multi-turn conversation (default 4)",
    )
    g.add_argument(
        "--doc-fraction",
        type=float,
        default=_env("doc-fraction"),
        metavar="F",
        help="share of long-doc requests in mixed (default 0.2) and chat-docs (0.15)",
    )
    g.add_argument(
        "--extra-body",
        default=_env("extra-body"),
        metavar="JSON",
        help="fields merged into every request body, e.g. '{\"ignore_eos\": true}'",
    )


def _output_options(p: Any) -> None:
    """bench's options: what the run writes and when it fails."""
    g = p.add_argument_group("output")
    g.add_argument(
        "--out",
        default=_env("out"),
        metavar="FILE",
        help="results JSON (every request's timings; schema warmroute.bench/v1)",
    )
    _add_report_outputs(g)
    g.add_argument(
        "--server-pid",
        type=int,
        action="append",
        metavar="PID",
        help="measure the CPU these processes (e.g. the proxy) use during the --base-url run, "
        "reported as server CPU per request; repeatable (one per worker)",
    )
    g.add_argument(
        "--max-error-rate",
        type=float,
        default=_env("max-error-rate", "0"),
        metavar="F",
        help="exit 1 when a run's failed share exceeds F (default 0)",
    )
    g.add_argument(
        "--no-progress",
        action="store_true",
        default=_env_flag("no-progress"),
        help="no progress bar on stderr",
    )


def _add_report_outputs(g: Any) -> None:
    g.add_argument(
        "--slo",
        default=_env("slo"),
        metavar="ttft=S,tpot=S",
        help="goodput SLO in seconds (ms suffix allowed), keys ttft, tpot, e2e",
    )
    g.add_argument(
        "--out-md",
        default=_env("out-md"),
        metavar="FILE",
        help="also write the table as Markdown to FILE",
    )
    g.add_argument(
        "--plots",
        default=_env("plots"),
        metavar="DIR",
        help="write ttft_cdf.png and itl_cdf.png to DIR",
    )


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
