"""`warmroute demo --scenario disagg`: the prefill/decode decider on a simulated fleet.

In virtual time (proxy/harness/disagg.py: the real router and DisaggController over the
simulator's scheduler, on a discrete-event clock), the chat-docs workload — chat streams with
short prompts and long answers, beside long documents answered in a few tokens — runs with
`disagg.mode: off` (the mixed pool) and `auto` on a fleet big enough to split, then on a
2-engine fleet and at light load, where `auto` must stay off and change nothing. For each run:
the chat streams' ITL (before and after the switch, when there is one), the documents' TTFT,
output throughput, and what the decider decided, when, and why.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.config import DisaggConfig, DisaggMode
from proxy.stats import percentile

# The scenario's own sizes (the policy comparison's defaults are smaller).
ENGINES, DEVICE, REQUESTS, CONCURRENCY = 6, "h100", 1500, 48
SMALL_FLEET = 2
LIGHT_CONCURRENCY = 3  # a few streams at a time: little to interfere with


@dataclass(frozen=True, slots=True)
class Case:
    label: str
    engines: int
    mode: DisaggMode
    requests: int
    concurrency: int


@dataclass
class Outcome:
    case: Case
    run: Any  # proxy.bench.results.RunResult
    switches: list[dict[str, Any]]
    reason: str


def cases(engines: int, requests: int, concurrency: int) -> list[Case]:
    """The mixed pool and auto on the big fleet; then a small fleet and light traffic."""
    small = max(2, requests // 2)
    light = max(2, requests // 5)
    out = []
    for label, n, reqs, conc in (
        (f"{engines} engines", engines, requests, concurrency),
        (f"{SMALL_FLEET} engines", SMALL_FLEET, small, concurrency),
        (f"{engines} engines, light", engines, light, LIGHT_CONCURRENCY),
    ):
        for mode in ("off", "auto"):
            out.append(Case(label, n, mode, reqs, conc))
    return out


def chat_itl(run: Any, after: float | None = None, before: float | None = None) -> list[float]:
    """The chat streams' inter-token gaps, of streams started after / finished before a time."""
    return sorted(
        g
        for r in run.requests
        if r.ok
        and r.kind == "chat"
        and (after is None or r.start >= after)
        and (before is None or r.start + (r.e2e or 0.0) <= before)
        for g in r.itl
    )


def output_per_s(run: Any) -> float:
    return sum(r.output_tokens for r in run.requests if r.ok) / run.duration if run.duration else 0


def _p(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def row(o: Outcome) -> list[str]:
    run, on = o.run, next((s for s in o.switches if s["active"]), None)
    gaps = chat_itl(run)
    docs = sorted(r.ttft for r in run.requests if r.ok and r.kind == "doc" and r.ttft)
    if o.case.mode == "off":
        decider = "-"
        before = after = None
    elif on is None:
        decider = "stays off"
        before = after = None
    else:
        split = on.get("pools") or {}
        decider = f"on at {on['at']:.1f} s" + (
            f" ({len(split['prefill'])}P/{len(split['decode'])}D)" if split else ""
        )
        before = _p(chat_itl(run, before=on["at"]), 0.99)
        after = _p(chat_itl(run, after=on["at"]), 0.99)
    ok = sum(r.ok for r in run.requests)
    return [
        o.case.label,
        o.case.mode,
        f"{ok}/{len(run.requests)}",
        _ms(_p(gaps, 0.5)),
        _ms(_p(gaps, 0.99)),
        _ms(before),
        _ms(after),
        f"{_s(_p(docs, 0.5))} / {_s(_p(docs, 0.99))}",
        f"{output_per_s(run):,.0f}",
        decider,
    ]


HEAD = [
    "fleet",
    "disagg",
    "ok/sent",
    "chat ITL p50",
    "chat ITL p99",
    "p99 before switch",
    "p99 after switch",
    "doc TTFT p50 / p99",
    "output tok/s",
    "decider",
]


def format_table(outcomes: Sequence[Outcome]) -> str:
    lines = [HEAD, *(row(o) for o in outcomes)]
    widths = [max(len(r[c]) for r in lines) for c in range(len(HEAD))]
    out = []
    for n, r in enumerate(lines):
        out.append(
            "  ".join(
                v.ljust(w) if c in (0, 1, 9) else v.rjust(w)
                for c, (v, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def verdicts(outcomes: Sequence[Outcome]) -> list[str]:
    """One line per auto run: what the decider did, when, and why; and what it changed."""
    by = {(o.case.label, o.case.mode): o for o in outcomes}
    lines = []
    for o in outcomes:
        if o.case.mode != "auto":
            continue
        base = by.get((o.case.label, "off"))
        if o.switches:
            for s in o.switches:
                lines.append(f"{o.case.label}, auto: at {s['at']:.1f} s, {s['reason']}")
        else:
            lines.append(f"{o.case.label}, auto: stayed off; last reason: {o.reason}")
        if base is None:
            continue
        on = next((s for s in o.switches if s["active"]), None)
        ratio = output_per_s(o.run) / output_per_s(base.run) if output_per_s(base.run) else 0
        mixed, split = _p(chat_itl(base.run), 0.99), None
        if on is not None:
            split = _p(chat_itl(o.run, after=on["at"]), 0.99)
        if on is not None and mixed and split:
            lines.append(
                f"  chat ITL p99 {mixed * 1000:.1f} ms in the mixed pool -> {split * 1000:.1f} ms "
                f"once split ({mixed / split:.1f}x lower); throughput {ratio:.0%} of the "
                "mixed pool's"
            )
        elif on is None:
            same = [r.target for r in o.run.requests] == [r.target for r in base.run.requests]
            lines.append(
                f"  throughput {ratio:.0%} of disagg off's"
                + ("; every request went to the engine it went to with disagg off" if same else "")
            )
    return lines


async def run_cases(
    chosen: Sequence[Case], *, device: str, seed: int, progress: bool = True
) -> list[Outcome]:
    from proxy.bench.workloads import make_workload
    from proxy.harness.disagg import run_virtual_disagg
    from proxy.sim.config import SimConfig

    sim = SimConfig.from_preset(device, seed=seed)
    outcomes = []
    for case in chosen:
        run, _, ctl = await run_virtual_disagg(
            make_workload("chat-docs", seed=seed),
            sim=sim,
            cfg=DisaggConfig(mode=case.mode),
            engines=case.engines,
            requests=case.requests,
            concurrency=case.concurrency,
        )
        run.label = f"{case.label}, disagg {case.mode}"
        switches = list(ctl.decider.switches)
        outcomes.append(Outcome(case, run, switches, ctl.decider.reason))
        if progress:
            what = f"{len(switches)} switch(es)" if switches else "no switch"
            print(f"  {run.label}: {run.duration:.1f} s of virtual time, {what}", file=sys.stderr)
    return outcomes


def run_disagg(args: argparse.Namespace) -> int:
    """The scenario's entry point (from proxy.demo.run.run)."""
    from proxy.bench import results_document, write_json

    engines: int = args.engines or ENGINES
    device: str = args.device or DEVICE
    requests: int = args.requests or REQUESTS
    concurrency: int = args.concurrency or CONCURRENCY
    if engines < 4:
        print(
            "warmroute demo: --scenario disagg needs --engines 4 or more for the fleet that "
            f"may split (disagg.min_backends is 4; the small fleet is always {SMALL_FLEET})",
            file=sys.stderr,
        )
        return 2
    chosen = cases(engines, requests, concurrency)
    print(
        f"warmroute demo --scenario disagg: chat-docs on simulated {device} engines in virtual "
        f"time (seed {args.seed}): chat streams beside long documents, disagg off vs auto on "
        f"{engines} engines ({requests} requests at concurrency {concurrency}), on "
        f"{SMALL_FLEET} engines, and at light load\n",
        file=sys.stderr,
    )
    try:
        outcomes = asyncio.run(run_cases(chosen, device=device, seed=args.seed))
    except ValueError as e:
        print(f"warmroute demo: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = results_document([o.run for o in outcomes], command=["warmroute", "demo", *sys.argv[2:]])
    doc["disagg"] = [
        {"run": o.run.label, "switches": o.switches, "reason": o.reason} for o in outcomes
    ]
    write_json(out / "results.json", doc)
    print()
    print(format_table(outcomes))
    print()
    for line in verdicts(outcomes):
        print(line)
    print(
        "\nchat ITL = gaps between a chat stream's tokens (every stream in a batch waits for a "
        "long prefill's step);\np99 before/after switch: chat streams that ended before / began "
        "after the decider turned the split on;\ndoc TTFT = time to the documents' first token. "
        "(virtual time: the simulated device's latencies; no network, no proxy CPU)"
    )
    print(
        f"\nResults: {out / 'results.json'}. The decider and its thresholds: "
        "docs/disaggregation.md; the same through real sockets: deploy/perf/disagg.sh"
    )
    return 0
