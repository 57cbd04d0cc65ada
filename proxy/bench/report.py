"""Results files, side-by-side tables and CDF plots for bench runs.

The JSON document (schema `warmroute.bench/v1`) is the source of truth: every run with every
request's timings, plus each run's summary as computed when written. Tables and plots are
derived from it, so `warmroute bench report a.json b.json` can rebuild them later.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from proxy import __version__
from proxy.bench.metrics import added_latency, summarize
from proxy.bench.results import SCHEMA, RunResult

RunLike = RunResult | Mapping[str, Any]


def results_document(
    runs: Sequence[RunResult],
    *,
    slo: Mapping[str, float] | None = None,
    command: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The JSON results document: environment, runs (with requests and summary), comparisons."""
    summaries = [summarize(r, slo) for r in runs]
    return {
        "schema": SCHEMA,
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": list(command) if command is not None else None,
        "environment": environment(),
        "slo": dict(slo or {}),
        "runs": [{**r.to_dict(), "summary": s} for r, s in zip(runs, summaries, strict=True)],
        "comparisons": comparisons(summaries),
    }


def environment() -> dict[str, Any]:
    return {
        "warmroute": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def comparisons(summaries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Proxy-added latency for every target run that has a direct run of the same workload."""
    directs = [s for s in summaries if s["role"] == "direct"]
    out = []
    for s in summaries:
        if s["role"] == "direct":
            continue
        for d in directs:
            if d["workload"] == s["workload"]:
                out.append(added_latency(s, d))
    return out


def write_json(path: str | Path, document: Mapping[str, Any]) -> None:
    Path(path).write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))


def load_runs(paths: Sequence[str | Path]) -> list[RunResult]:
    """All runs of the given results files, labels made unique (a#2) for side-by-side columns."""
    runs: list[RunResult] = []
    for p in paths:
        try:
            doc = orjson.loads(Path(p).read_bytes())
        except (OSError, orjson.JSONDecodeError) as e:
            raise ValueError(f"cannot read results file {p}: {e}") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise ValueError(f"{p} is not a warmroute bench results file (schema {SCHEMA})")
        runs.extend(RunResult.from_dict(r) for r in doc["runs"])
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.label] = seen.get(r.label, 0) + 1
        if seen[r.label] > 1:
            r.label = f"{r.label}#{seen[r.label]}"
    return runs


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _num(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _pct(v: Any) -> str:
    return "-" if v is None else f"{v:.1%}"


def _errors(s: Mapping[str, Any]) -> str:
    errs = s["errors"]
    return ", ".join(f"{k}: {v}" for k, v in errs.items()) if errs else "none"


def _rows(s: Mapping[str, Any], kinds: Sequence[str] = ()) -> list[tuple[str, str]]:
    load = (
        f"rate {s['rate']:g}/s" + (f", ≤{s['concurrency']} in flight" if s["concurrency"] else "")
        if s["rate"]
        else f"concurrency {s['concurrency']}"
    )
    rows = [
        ("target", ", ".join(t.split("://", 1)[-1] for t in s["targets"])),
        ("workload", f"{s['workload']} ({s['endpoint']})"),
        ("load", load),
        (
            "ok / sent / planned",
            f"{s['completed']} / {s['requests_sent']} / {s['requests_planned']}",
        ),
        ("errors", _errors(s)),
        ("duration (s)", _num(s["duration_s"])),
        ("requests/s", _num(s["request_throughput"])),
        ("output tokens/s", _num(s["output_throughput"], "{:.1f}")),
        ("output chunks/s", _num(s["chunk_throughput"], "{:.1f}")),
    ]
    if s["goodput"]:
        g = s["goodput"]
        slo = ",".join(f"{k}≤{v * 1000:g}ms" for k, v in g["slo"].items())
        rows.append(
            (f"goodput req/s ({slo})", f"{_num(g['request_goodput'])} ({_pct(g['fraction'])})")
        )
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        d = s[key]
        for stat in ("mean", "p50", "p90", "p99", "max"):
            rows.append((f"{name} {stat} (ms)", _ms(d[stat])))
    for kind in kinds:  # a mix of request kinds: each kind's own latencies
        k = s.get("by_kind", {}).get(kind)
        rows.append((f"{kind}: ok / sent", f"{k['completed']} / {k['requests']}" if k else "-"))
        for key, name in (("ttft_s", "TTFT"), ("itl_s", "ITL")):
            for stat in ("p50", "p99"):
                rows.append((f"{kind}: {name} {stat} (ms)", _ms(k[key][stat]) if k else "-"))
    rows += [
        ("prompt / output tokens", f"{s['input_tokens']} / {s['output_tokens']}"),
        ("prefix cache hit ratio", _pct(s["prefix_cache_hit_ratio"])),
        ("client CPU (share of a core)", _pct(s["client_cpu_util"])),
        ("server CPU per request (ms)", _num(s.get("server_cpu_ms_per_request"))),
    ]
    return rows


def format_table(
    runs: Sequence[RunLike],
    *,
    slo: Mapping[str, float] | None = None,
    show_comparisons: bool = True,
) -> str:
    """A Markdown table with one column per run (RunResults or their summaries), followed by
    the proxy's added latency for every run that has a direct counterpart."""
    summaries = [r if isinstance(r, Mapping) else summarize(r, slo) for r in runs]
    if not summaries:
        return "(no runs)\n"
    kinds = sorted({k for s in summaries for k in s.get("by_kind", {})})
    columns = [_rows(s, kinds if len(kinds) > 1 else ()) for s in summaries]
    header = ["metric", *(str(s["label"]) for s in summaries)]
    lines = [
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * len(summaries),
    ]
    for i, (name, _) in enumerate(columns[0]):
        lines.append("| " + " | ".join([name, *(col[i][1] for col in columns)]) + " |")
    out = "\n".join(lines) + "\n"
    if show_comparisons:
        for c in comparisons(summaries):
            t = c["ttft_s"]
            out += (
                f"\nProxy added TTFT ({c['proxy']} - {c['direct']}): "
                f"p50 {_signed_ms(t['p50'])}, p99 {_signed_ms(t['p99'])}, "
                f"mean {_signed_ms(t['mean'])}; ITL p50 {_signed_ms(c['itl_s']['p50'])}.\n"
            )
    return out


def _signed_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:+.1f} ms"


def plot_cdfs(runs: Sequence[RunResult], out_dir: str | Path) -> list[Path]:
    """`ttft_cdf.png` and `itl_cdf.png` in `out_dir`, one curve per run (ms)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt
    import numpy as np

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for key, title in (("ttft", "Time to first token"), ("itl", "Inter-token latency")):
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        lo, hi = float("inf"), 0.0
        for run in runs:
            ok = [r for r in run.requests if r.ok]
            vals = (
                [r.ttft for r in ok if r.ttft is not None]
                if key == "ttft"
                else [g for r in ok for g in r.itl]
            )
            if not vals:
                continue
            xs = np.sort(np.asarray(vals) * 1000)
            ys = np.arange(1, len(xs) + 1) / len(xs)
            lo, hi = min(lo, float(xs[0])), max(hi, float(xs[-1]))
            ax.step(xs, ys, where="post", label=f"{run.label} (n={len(xs)})")
        # Log x only when the samples span decades (tails); otherwise it loses its ticks.
        if lo > 0 and hi / lo > 30:
            ax.set_xscale("log")
            # Plain numbers on a 1-2-5 series (1, 2, 5 per decade up to three decades): the
            # default labels minor ticks as 3x10^1, 4x10^1..., which run into each other.
            from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

            subs = (1.0, 2.0, 5.0) if hi / lo <= 1000 else (1.0,)
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"{key.upper()} (ms)")
        ax.set_ylabel("fraction of samples ≤ x")
        ax.set_title(f"{title}: CDF per run")
        ax.set_ylim(0, 1.01)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize=8)
        path = out / f"{key}_cdf.png"
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def print_notes(runs: Sequence[RunResult]) -> None:
    for r in runs:
        for note in r.notes:
            print(f"note ({r.label}): {note}", file=sys.stderr)
