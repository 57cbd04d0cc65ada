"""`warmroute demo`: a simulated fleet, the proxy, a realistic workload, one table per policy.

Each policy gets a fresh fleet (cold caches) and the same seeded workload, so the numbers
differ only by routing. Every process the demo starts is stopped on success, error or Ctrl-C.
It ends on a few lines saying what the run showed, with the doctor's verdict on the default
policy's run; `--verbose` adds the doctor's whole report and the proxy's own /metrics lines.

Size: the options, the two runners (real sockets and virtual time) and the report they share
read one argument namespace; the disagg scenario is apart, in demo_disagg.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

import plugins
from proxy import presets
from proxy.bench.results import RequestResult
from proxy.bench.workloads import WORKLOADS
from proxy.config import RoutingConfig
from proxy.demo.stack import Stack, StackError, free_ports

EPILOG = """\
examples:
  warmroute demo                                   # ~1-2 minutes, every routing policy
  warmroute demo --policies round_robin,prefix_aware --requests 400
  warmroute demo --workload multi-turn --engines 3 --device h100
  warmroute demo --keep-running                    # leave the last stack up to explore
  warmroute demo --scenario disagg                 # prefill/decode split: when and why
  warmroute demo --virtual --workload multi-turn --prefixes 32 --system-chars 16000 \\
      --system-chars-min 4000 --requests 2000 --concurrency 32 --kv-blocks 2000
                                                   # docs/benchmarks.md's simulated fleet
  warmroute demo --verbose                         # + the doctor's report, raw /metrics lines
"""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


STATIC_AFFINITY = "static_affinity"  # as proxy.harness.virtual names it (imported lazily)
DEFAULT_POLICY = RoutingConfig().policy  # what `warmroute serve` routes with unless told
# The engines' prefill chunk: vLLM's --max-num-batched-tokens. A whole 2k-token prompt in one
# scheduler step stalls every stream decoding beside it (ITL p99 ~9x p50, the doctor's
# prefill_interference); 512 tokens, vLLM's long-time chunked-prefill default, is what a tuned
# engine runs with, so the demo's fleet is one the doctor has nothing against.
PREFILL_CHUNK_TOKENS = 512


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="simulated engines + proxy + workload: compare routing policies in one command",
        description="Start simulated engines and the proxy, drive a realistic workload "
        "(shared system prompts with Zipf popularity, short user turns, a few long documents) "
        "through every routing policy, and print TTFT/ITL percentiles and the prefix-cache hit "
        "ratio side by side. Needs no GPU.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--policies", help="comma-separated policies (default: all installed)")
    p.add_argument(
        "--scenario",
        default="policies",
        choices=("policies", "disagg"),
        help="policies (default): every routing policy side by side; disagg: prefill/decode "
        "disaggregation, disagg off vs auto on a fleet that can split (defaults 6 h100 "
        "engines, 1500 requests at concurrency 48), on 2 engines and at light load, in "
        "virtual time (docs/disaggregation.md)",
    )
    _fleet_options(p)
    _workload_options(p)
    _run_options(p)
    p.set_defaults(func=run)


def _fleet_options(p: Any) -> None:
    """demo's options: the simulated engines."""
    p.add_argument("--engines", type=_positive, help="simulated engines (default 4)")
    p.add_argument(
        "--device",
        choices=list(presets.DEVICES),
        help="simulated GPU preset: memory bandwidth and compute (default l40s)",
    )
    p.add_argument(
        "--kv-blocks",
        type=_positive,
        default=3000,
        help="KV-cache blocks per engine (16 tokens each; default 3000 = 48k tokens: "
        "the prompt set fits the fleet only if routing partitions it)",
    )


def _workload_options(p: Any) -> None:
    """demo's options: the workload sent through each policy."""
    p.add_argument(
        "--workload",
        default="mixed",
        choices=WORKLOADS,
        help="request mix (default mixed: shared prompts + long documents; see "
        "`warmroute bench --help` for each)",
    )
    p.add_argument("--requests", type=_positive, help="requests per policy (default 240)")
    p.add_argument("--concurrency", type=_positive, help="requests in flight (default 16)")
    p.add_argument(
        "--prefixes", type=_positive, default=16, help="distinct system prompts (default 16)"
    )
    p.add_argument(
        "--zipf", type=float, default=1.1, help="popularity skew of the prompts (0 = uniform)"
    )
    p.add_argument(
        "--system-chars",
        type=_positive,
        default=8000,
        help="system prompt length in characters (default 8000, ~2k tokens)",
    )
    p.add_argument(
        "--system-chars-min",
        type=_positive,
        help="vary the system prompts' lengths uniformly between this and --system-chars",
    )
    p.add_argument(
        "--turns",
        type=_positive,
        default=4,
        help="multi-turn workload: turns per conversation (default 4)",
    )
    p.add_argument(
        "--max-tokens", type=_positive, default=48, help="output tokens per chat (default 48)"
    )


def _run_options(p: Any) -> None:
    """demo's options: the engines' step budget, time, seed, output and what to show."""
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive,
        default=PREFILL_CHUNK_TOKENS,
        help="the engines' token budget per step, i.e. their prefill chunk, as vLLM's flag "
        f"(default {PREFILL_CHUNK_TOKENS}; 2048 lets a long prompt stall the streams decoding "
        "beside it, which the doctor reports as prefill_interference)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="run the simulated devices this much faster than real time",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=7,
        help="seed of the workload and the simulated engines (default 7): the same seed sends "
        "the same prompts; with --virtual the whole run repeats exactly",
    )
    p.add_argument("--out", default="warmroute-demo", help="directory for results and plots")
    p.add_argument(
        "--virtual",
        action="store_true",
        help="no sockets, no wall clock: the same router and engine physics in simulated time "
        "(exact and reproducible, seconds to run; latencies are the device's, without the "
        "CPU contention of running every process on this machine)",
    )
    p.add_argument(
        "--hide-kv-pool",
        action="store_true",
        help="engines do not publish their KV pool size (like most real ones): the proxy "
        "learns each cache from the cached_tokens it reports. With --virtual, the policy "
        f"{STATIC_AFFINITY} (system prompt i on engine i mod n) gives the bound to compare with",
    )
    p.add_argument(
        "--kv-events",
        action="store_true",
        help="with --virtual: the engines publish their KV events and the router reads each "
        "engine's cache from them (requests keyed by the engine's own token blocks) instead of "
        "the learned prefix index",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also print the doctor's whole report on the default policy's run (the last "
        "policy's if the default did not run) and the proxy's own Prometheus lines for it",
    )
    p.add_argument(
        "--keep-running",
        action="store_true",
        help="after the last policy, keep its proxy and engines up until Ctrl-C",
    )


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if v < 10 else f"{v:.1f} s"


def format_policy_table(rows: list[dict[str, Any]]) -> str:
    head = [
        "policy",
        "ok/sent",
        "TTFT mean",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "E2E p50",
        "cache hit",
        "req/s",
    ]
    lines = [head]
    for s in rows:
        t, i, e = s["ttft_s"], s["itl_s"], s["e2e_s"]
        hit = s.get("prefix_cache_hit_ratio")
        lines.append(
            [
                s["label"],
                f"{s['completed']}/{s['requests_sent']}",
                _ms(t["mean"]),
                _ms(t["p50"]),
                _ms(t["p99"]),
                _ms(i["p50"]),
                _ms(i["p99"]),
                _ms(e["p50"]),
                "-" if hit is None else f"{hit:.1%}",
                "-" if s["request_throughput"] is None else f"{s['request_throughput']:.1f}",
            ]
        )
    widths = [max(len(str(r[c])) for r in lines) for c in range(len(head))]
    out = []
    for n, r in enumerate(lines):
        out.append(
            "  ".join(
                str(v).ljust(w) if c == 0 else str(v).rjust(w)
                for c, (v, w) in enumerate(zip(r, widths, strict=True))
            )
        )
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def oracle_hit_ratio(
    workload: Any, requests: Sequence[RequestResult], replies_cached: bool = False
) -> float | None:
    """The best hit ratio any router could reach on these requests (an upper bound).

    Every prefix seen before is cached somewhere and every request finds it: a repeated system
    prompt hits, and a conversation's later turn hits its previous prompt, plus the previous
    reply when the engine caches generated tokens (vLLM does; the simulator, whose output
    tokens are not the reply's re-tokenized text, does not). The cache is unbounded and a
    token is ~4 characters on both sides. Requests count in the order they were issued.
    """
    plan = {s.index: s for s in workload.plan(max((r.index for r in requests), default=-1) + 1)}
    seen: set[int] = set()
    # conversation -> (chars sent and generated so far, of which a later turn can find cached)
    context: dict[int, tuple[int, int]] = {}
    cached = total = 0
    for r in sorted(requests, key=lambda r: r.start):
        spec = plan.get(r.index)
        if spec is None or not r.ok:
            continue
        has_system = spec.kind == "chat" and spec.system_id is not None
        system = len(workload.system_prompts[spec.system_id]) if has_system else 0
        conv = spec.conversation
        if conv is not None and spec.turn > 0 and conv in context:
            before, hit = context[conv]
        else:
            before, hit = system, (system if spec.system_id in seen else 0)
        user = len(workload.user_text(spec)) if spec.kind == "chat" else spec.user_chars
        total += before + user
        cached += hit
        if has_system:
            seen.add(spec.system_id)
        if conv is not None:
            reply = r.output_chars
            context[conv] = (
                before + user + reply,
                before + user + (reply if replies_cached else 0),
            )
    return cached / total if total else None


_SCOPE_LABELS = re.compile(r'otel_scope_[a-z_]+="[^"]*",?')


def proxy_metrics_excerpt(url: str) -> str:
    """The proxy's own view of the same traffic, from its Prometheus endpoint."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return ""
    keep = [
        # The exporter's scope labels are the same on every line: noise on a terminal.
        _SCOPE_LABELS.sub("", ln).replace(",}", "}")
        for ln in text.splitlines()
        if not ln.startswith("#")
        and (
            "time_to_first_token_seconds_count" in ln
            or "time_to_first_token_seconds_sum" in ln
            or ("proxy_overhead" in ln and "_sum" in ln)
            or "route_decisions" in ln
        )
    ]
    return "\n".join(keep[:12])


def run(args: argparse.Namespace) -> int:
    if args.scenario == "disagg":
        from proxy.demo.disagg import run_disagg

        return run_disagg(args)
    # Unset sizes take the policy comparison's defaults (the disagg scenario has its own).
    args.engines, args.device = args.engines or 4, args.device or "l40s"
    args.requests, args.concurrency = args.requests or 240, args.concurrency or 16
    setup = _setup(args)
    if isinstance(setup, int):
        return setup
    policies, sim, workload = setup
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # SIGTERM gets the same cleanup as Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    _announce(args, policies)
    # The doctor and the proxy's /metrics are read on one run: the default policy's, since
    # that is what `warmroute serve` would do; the last policy's when the default is not run.
    diagnosed = DEFAULT_POLICY if DEFAULT_POLICY in policies else policies[-1]
    if args.virtual:
        runs, summaries, doctor = _virtual_runs(args, policies, sim, workload, diagnosed)
        return _report(args, out, workload, runs, summaries, "", doctor, diagnosed)
    done = _real_runs(args, policies, workload, diagnosed, out)
    if isinstance(done, int):
        return done
    runs, summaries, excerpt, doctor = done
    return _report(args, out, workload, runs, summaries, excerpt, doctor, diagnosed)


def _setup(args: argparse.Namespace) -> tuple[list[str], Any, Any] | int:
    """The policies to compare, the simulated engine and the workload; or an exit status
    after saying what is wrong (checked here, not in a child process's log)."""
    from proxy.bench import make_workload
    from proxy.sim.config import SimConfig

    available = plugins.policy_names()
    policies = args.policies.split(",") if args.policies else available
    if args.virtual:
        available = [*available, STATIC_AFFINITY]
    unknown = [p for p in policies if p not in available]
    if unknown:
        print(
            f"warmroute demo: unknown policy {', '.join(unknown)}; available: "
            f"{', '.join(available)}",
            file=sys.stderr,
        )
        return 2
    try:
        # An unknown device, a pool too small, an unknown workload, a minimum prompt length
        # above the maximum...
        sim = SimConfig.from_preset(
            args.device,
            kv_blocks=args.kv_blocks,
            seed=args.seed,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        workload = make_workload(
            args.workload,
            seed=args.seed,
            num_prefixes=args.prefixes,
            zipf_s=args.zipf,
            system_chars=args.system_chars,
            system_chars_min=args.system_chars_min,
            max_tokens=args.max_tokens,
            turns=args.turns,
            # Every worker can hold a conversation: fewer would idle workers waiting on turns.
            active_conversations=args.concurrency,
        )
    except ValueError as e:
        print(f"warmroute demo: {e}", file=sys.stderr)
        return 2
    return policies, sim, workload


def _announce(args: argparse.Namespace, policies: list[str]) -> None:
    low = args.system_chars_min
    tokens = f"{low // 4}-{args.system_chars // 4}" if low else f"{args.system_chars // 4}"
    print(
        f"warmroute demo: {args.engines} simulated {args.device} engines "
        f"({args.kv_blocks * 16} KV tokens each), workload {args.workload!r} "
        f"({args.prefixes} system prompts of ~{tokens} tokens, Zipf popularity), "
        f"{args.requests} requests at concurrency {args.concurrency}, per policy: "
        f"{', '.join(policies)}\n",
        file=sys.stderr,
    )


def _virtual_runs(
    args: argparse.Namespace, policies: list[str], sim: Any, workload: Any, diagnosed: str
) -> tuple[list[Any], list[dict[str, Any]], dict[str, Any] | str]:
    """Each policy's run in virtual time, and the doctor's report on the diagnosed one."""
    from proxy.bench import summarize
    from proxy.doctor import diagnose
    from proxy.doctor.hardware import declared
    from proxy.doctor.virtual import VirtualRecorder
    from proxy.harness.virtual import engine_stats, run_virtual

    runs: list[Any] = []
    summaries: list[dict[str, Any]] = []
    doctor: dict[str, Any] | str = ""  # the report, or a sentence saying why there is none
    for policy in policies:
        recorder = VirtualRecorder(declared(args.device, sim.params, sim.dtype), policy)
        run, fleet = asyncio.run(
            run_virtual(
                workload,
                policy=policy,
                sim=sim,
                engines=args.engines,
                requests=args.requests,
                concurrency=args.concurrency,
                publish_kv_pool=not args.hide_kv_pool,
                kv_events=args.kv_events,
                on_finish=recorder.finished,
            )
        )
        if policy == diagnosed:
            doctor = diagnose(recorder.windows()).as_dict()
        runs.append(run)
        summaries.append(summarize(run))
        print(f"  {policy}: {format_engine_balance(engine_stats(fleet))}", file=sys.stderr)
    return runs, summaries, doctor


def _sim_args(args: argparse.Namespace) -> list[str]:
    """`warmroute sim`'s flags for the demo's engines."""
    sim_args = ["--hide-kv-pool"] if args.hide_kv_pool else []
    return [
        *sim_args,
        "--device",
        args.device,
        "--kv-blocks",
        str(args.kv_blocks),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--time-scale",
        str(args.time_scale),
        "--seed",
        str(args.seed),
    ]


def _real_runs(
    args: argparse.Namespace, policies: list[str], workload: Any, diagnosed: str, out: Path
) -> tuple[list[Any], list[dict[str, Any]], str, dict[str, Any] | str] | int:
    """Each policy's run on a fresh stack of real processes (engines, proxy), the proxy's
    metrics and the doctor's report on the diagnosed one; or an exit status."""
    from proxy.bench import run_bench, summarize

    runs: list[Any] = []
    summaries: list[dict[str, Any]] = []
    excerpt = ""
    doctor: dict[str, Any] | str = ""  # the report, or a sentence saying why there is none
    try:
        with Stack(log_dir=str(out / "logs")) as stack:
            for n, policy in enumerate(policies):
                sims = stack.sims(args.engines, _sim_args(args))
                # /admin on a port of its own: the doctor's report is read from there
                [admin_port] = free_ports(1)
                proxy = stack.proxy(sims, ["--policy", policy, "--admin-port", str(admin_port)])
                started = time.monotonic()
                result = asyncio.run(
                    run_bench(
                        proxy,
                        workload,
                        requests=args.requests,
                        concurrency=args.concurrency,
                        progress=True,
                        label=policy,
                        max_duration=600,
                    )
                )
                runs.append(result)
                summary = summarize(result)
                summaries.append(summary)
                print(
                    f"  {policy}: {summary['completed']} ok, {summary['failed']} failed in "
                    f"{time.monotonic() - started:.1f}s",
                    file=sys.stderr,
                )
                if policy == diagnosed:
                    excerpt = proxy_metrics_excerpt(proxy)
                    doctor = fetch_doctor(f"http://127.0.0.1:{admin_port}")
                if n == len(policies) - 1 and args.keep_running:
                    _keep_running(proxy, sims)
                stack.stop_all()
    except (StackError, OSError) as e:
        print(f"warmroute demo: {e} (logs in {out / 'logs'})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "\nwarmroute demo: interrupted; every process it started was stopped.", file=sys.stderr
        )
        return 130
    return runs, summaries, excerpt, doctor


def doctor_text(report: dict[str, Any], policy: str) -> str:
    """The doctor's report (docs/doctor.md) on one policy's run, as the terminal shows it."""
    from proxy.doctor.render import render_text, use_color

    return render_text(report, color=use_color(sys.stdout), source=f"the {policy} run")


def fetch_doctor(admin_url: str) -> dict[str, Any] | str:
    """GET /admin/doctor from the proxy's admin port (a sentence saying why if it cannot)."""
    from proxy.doctor.cli import fetch

    try:
        return fetch(admin_url, timeout=30)
    except RuntimeError as e:
        return str(e)


def format_engine_balance(stats: Sequence[dict[str, Any]]) -> str:
    """Mean in-flight per engine and the max/min ratio (hotspots show here)."""
    loads = [s["mean_inflight"] for s in stats]
    ratio = max(loads) / min(loads) if loads and min(loads) > 0 else float("inf")
    shares = " / ".join(f"{x:.1f}" for x in loads)
    return f"mean in-flight per engine {shares} (max/min {ratio:.2f})"


def _ratio(ours: float, theirs: float) -> str:
    if ours <= 0 or theirs <= 0:
        return ""
    if ours < theirs:
        return f" ({theirs / ours:.2f}x lower)"
    return f" ({ours / theirs:.2f}x higher)" if ours > theirs else " (the same)"


def doctor_verdict(report: dict[str, Any] | str, policy: str) -> str:
    """One line: what the doctor found on `policy`'s run (ids by severity, backends counted)."""
    if isinstance(report, str):
        return f"no report on the {policy} run: {report}" if report else ""
    findings = report.get("findings", [])
    backends = len(report.get("backends", []))
    if not findings:
        return (
            f"no finding on the {policy} run: none of {backends} engines is queueing, short "
            "of cache, prefill-bound or stalled by long prefills"
        )
    parts = []
    for severity in ("critical", "warning"):
        ids: dict[str, int] = {}
        for f in findings:
            if f["severity"] == severity:
                ids[f["id"]] = ids.get(f["id"], 0) + 1
        parts += [
            f"{severity.upper()} {fid} on {n} of {backends} backends" for fid, n in ids.items()
        ]
    return f"on the {policy} run: {'; '.join(parts)} (--verbose prints the report)"


def format_summary(
    summaries: Sequence[dict[str, Any]],
    oracle: float | None,
    policy: str,
    verdict: str,
) -> str:
    """What the run showed, in a few lines: the diagnosed policy against the weakest other one
    (round_robin when it ran), what every policy served, and the doctor's verdict."""
    by_label = {s["label"]: s for s in summaries}
    ours = by_label.get(policy)
    lines = [f"What this demo showed ({policy} is warmroute's default policy):"]
    if policy != DEFAULT_POLICY:
        lines[0] = (
            f"What this demo showed (for {policy}; the default, {DEFAULT_POLICY}, did not run):"
        )
    others = [s for s in summaries if s["label"] != policy]
    base = by_label.get("round_robin") if policy != "round_robin" else None
    if base is None and others:
        base = min(others, key=lambda s: s.get("prefix_cache_hit_ratio") or 0.0)
    if ours is not None:
        hit = ours.get("prefix_cache_hit_ratio")
        if hit is not None:
            text = f"  cache   {policy} served {hit:.1%} of prompt tokens from the engines' caches"
            if oracle:
                text += f", {hit / oracle:.0%} of the {oracle:.1%} any router could"
            base_hit = None if base is None else base.get("prefix_cache_hit_ratio")
            if base is not None and base_hit is not None:
                text += f"; {base['label']} {base_hit:.1%}"
            lines.append(text)
        t = ours["ttft_s"]
        if base is not None and t["mean"] is not None and base["ttft_s"]["mean"] is not None:
            b = base["ttft_s"]
            text = (
                f"  TTFT    mean {_ms(t['mean'])} against {base['label']}'s {_ms(b['mean'])}"
                f"{_ratio(t['mean'], b['mean'])}, p99 {_ms(t['p99'])} against {_ms(b['p99'])}"
            )
            lines.append(text)
        elif t["mean"] is not None:
            lines.append(f"  TTFT    mean {_ms(t['mean'])}, p99 {_ms(t['p99'])}")
    sent = sum(s["requests_sent"] for s in summaries)
    done = sum(s["completed"] for s in summaries)
    every = "every policy" if len(summaries) > 1 else "the policy"
    lines.append(f"  served  {done} of {sent} requests answered under {every}")
    if verdict:
        lines.append(f"  doctor  {verdict}")
    return "\n".join(lines)


def _report(
    args: argparse.Namespace,
    out: Path,
    workload: Any,
    runs: list[Any],
    summaries: list[dict[str, Any]],
    excerpt: str,
    doctor: dict[str, Any] | str,
    diagnosed: str,
) -> int:
    from proxy.bench import plot_cdfs, results_document, write_json

    doc = results_document(runs, command=["warmroute", "demo", *sys.argv[2:]])
    write_json(out / "results.json", doc)
    plots = plot_cdfs(runs, out)
    print()
    print(format_policy_table(summaries))
    print()
    oracle = oracle_hit_ratio(workload, runs[0].requests) if runs else None
    if oracle is not None:
        print(
            f"oracle: the best achievable cache hit ratio for this workload is {oracle:.1%} "
            "(every repeated system prompt and every earlier turn served from cache)."
        )
    print(
        "TTFT = time to the first content token as the client saw it; ITL = gap between "
        "tokens;\ncache hit = prompt tokens the engines served from their prefix cache."
    )
    if args.virtual:
        print("(virtual time: the simulated device's latencies; no network, no proxy CPU)")
    if excerpt and args.verbose:
        print(f"\nThe proxy measured the same requests itself (its GET /metrics, {diagnosed}):")
        print(excerpt)
    print(f"\nResults: {out / 'results.json'}; plots: {', '.join(str(p) for p in plots)}")
    print(
        "Where to look next:\n"
        "  metrics  `warmroute serve ...` serves Prometheus text at /metrics "
        "(dashboard: deploy/grafana/)\n"
        "  traces   WARMROUTE_TRACES_EXPORTER=otlp OTEL_EXPORTER_OTLP_ENDPOINT="
        "http://127.0.0.1:4318 warmroute serve ...  (Jaeger/Tempo)\n"
        "           or `docker compose up` and open http://127.0.0.1:16686\n"
        "  rehearse `warmroute demo --keep-running`, then `warmroute bench --base-url ...`\n"
        "  diagnose `warmroute serve --admin-port 8081 ...`, then "
        "`warmroute doctor --url http://127.0.0.1:8081`\n"
        "  details  `warmroute demo --verbose` adds the doctor's report and raw /metrics lines"
    )
    if args.verbose and isinstance(doctor, dict):
        print(f"\nThe doctor on the {diagnosed} run (docs/doctor.md):\n")
        print(doctor_text(doctor, diagnosed), end="")
    print()
    print(format_summary(summaries, oracle, diagnosed, doctor_verdict(doctor, diagnosed)))
    return 0


def _keep_running(proxy: str, sims: list[str]) -> None:
    print(
        f"\nStack kept running: proxy {proxy} (metrics {proxy}/metrics), engines "
        f"{', '.join(sims)}. Ctrl-C to stop.",
        file=sys.stderr,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
