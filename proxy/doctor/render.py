"""The report as a person reads it: a table per backend, then the findings (pure: the report's
JSON in, text out; colours only when asked, i.e. on a terminal)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import IO, Any

_SEVERITY = {"critical": "\x1b[1;31m", "warning": "\x1b[33m"}
_BOLD, _DIM, _GREEN, _RESET = "\x1b[1m", "\x1b[2m", "\x1b[32m", "\x1b[0m"


def use_color(stream: IO[str], choice: str = "auto") -> bool:
    """Colours on a terminal (and never with NO_COLOR set), unless forced either way."""
    if choice == "always":
        return True
    if choice == "never" or os.environ.get("NO_COLOR"):
        return False
    return stream.isatty()


def _ms(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if v < 10 else f"{v:.1f} s"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{v:.0%}"


def _num(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    text = f"{v:,.0f}" if abs(v) >= 10 else f"{v:.1f}"
    return f"{text}{unit}"


def _rows(m: Mapping[str, Any]) -> list[tuple[str, str]]:
    split = ""
    if m.get("queue_s_mean") is not None:
        split = (
            f" = queue {_ms(m['queue_s_mean'])} + prefill {_ms(m['prefill_s_mean'])}"
            f"  ({m['split_source']})"
        )
    rows = [
        (
            "TTFT",
            f"p50 {_ms(m['ttft_p50_s'])}, p90 {_ms(m['ttft_p90_s'])}; upstream mean "
            f"{_ms(m['upstream_ttft_s_mean'])}{split}",
        ),
        (
            "prompts",
            f"mean {_num(m['prompt_tokens_mean'])} tokens, {_pct(m['reported_hit_ratio'])} "
            f"cached (index predicted {_pct(m['predicted_hit_ratio'])}); uncached mean "
            f"{_num(m['uncached_tokens_mean'])}, p90 {_num(m['uncached_tokens_p90'])}; "
            f"prefill {_num(m['prefill_tokens_per_s'], ' tok/s')}",
        ),
        (
            "ITL",
            f"p50 {_ms(m['itl_p50_s'])}, p99 {_ms(m['itl_p99_s'])} (without long prefills "
            f"{_ms(m['clean_itl_p99_s'])}); {_pct(m['alongside_gap_share'])} of gaps beside "
            f"{m['long_prefills']} prefills over {_num(m['step_tokens'])} tokens",
        ),
        (
            "decode",
            f"context in flight p90 {_num(m['context_tokens_p90'])} tokens, KV reads "
            f"{_pct(m['kv_share_of_step'])} of a step; "
            + (
                f"{_num(m['decode_tok_s'])} tok/s per stream of a "
                f"{_num(m['ceiling_tok_s'])} ceiling ({_pct(m['decode_efficiency'])})"
                if m.get("ceiling_tok_s") is not None
                else "ceiling not checked"
            ),
        ),
    ]
    if m.get("scrapes"):
        rows.append(
            (
                "engine",
                f"{m['scrapes']} scrapes: waiting mean {_num(m['waiting_mean'])}, running "
                f"{_num(m['running_mean'])}, KV usage mean {_pct(m['kv_usage_mean'])} max "
                f"{_pct(m['kv_usage_max'])}"
                + (f", {m['preemptions']:.0f} preemptions" if m.get("preemptions") else ""),
            )
        )
    return rows


def render_text(report: Mapping[str, Any], *, color: bool = False, source: str = "") -> str:
    """The report (Report.as_dict(), or GET /admin/doctor's JSON) as text."""

    def c(code: str, text: str) -> str:
        return f"{code}{text}{_RESET}" if color else text

    findings = report.get("findings", [])
    window = report.get("window_s")
    head = "warmroute doctor" + (f": {source}" if source else "")
    if window:
        head += f", last {window:g} s"
    head += f"; {len(report.get('backends', []))} backend(s), {len(findings)} finding(s)"
    out = [c(_BOLD, head), ""]
    by_backend: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for f in findings:
        by_backend.setdefault((f["backend"], f["model"]), []).append(f)
    for b in report.get("backends", []):
        title = f"{b['backend']}" + (f"  model {b['model']}" if b["model"] else "")
        title += f"  engine {b['engine']}"
        if b.get("hardware"):
            title += f"  {b['hardware']}"
        title += f"  {b['requests']} requests"
        if b.get("errors"):
            title += f" ({b['errors']} failed)"
        if b["requests"]:
            title += f" in {b['span_s']:.0f} s"
        out.append(c(_BOLD, title))
        if b["requests"]:
            width = max(len(k) for k, _ in _rows(b["measurements"]))
            for name, text in _rows(b["measurements"]):
                out.append(f"  {name.ljust(width)}  {text}")
        for f in by_backend.get((b["backend"], b["model"]), []):
            tag = c(_SEVERITY.get(f["severity"], ""), f"{f['severity'].upper()} {f['id']}")
            out.append(f"  {tag}: {f['summary']}")
            out.append(f"    change: {f['change']}")
        if not by_backend.get((b["backend"], b["model"])) and b["requests"]:
            out.append("  " + c(_GREEN, "no finding"))
        for note in b.get("notes", []):
            out.append("  " + c(_DIM, f"note: {note}"))
        out.append("")
    shown = {(b["backend"], b["model"]) for b in report.get("backends", [])}
    for (backend, model), found in by_backend.items():  # the admission queue's, proxy-wide
        if (backend, model) in shown:
            continue
        out.append(c(_BOLD, f"{backend} (the proxy's admission queue)"))
        for f in found:
            tag = c(_SEVERITY.get(f["severity"], ""), f"{f['severity'].upper()} {f['id']}")
            out.append(f"  {tag}: {f['summary']}")
            out.append(f"    change: {f['change']}")
        out.append("")
    if not findings:
        out.append(c(_GREEN, "healthy: no finding on any backend"))
    return "\n".join(out).rstrip() + "\n"
