"""Pure metrics over a run's request records, defined as `vllm bench serve` defines them.

- TTFT: first output-bearing chunk - request sent. As in docs/measurement.md, a role-only or
  usage-only chunk does not count (vllm's chat client counts the role chunk; engines send it at
  once, so counting it would hide prefill time).
- ITL: every gap between consecutive output-bearing chunks, pooled over requests.
- TPOT: (e2e - ttft) / (output_tokens - 1) per request with more than one output token.
- E2E: last output-bearing chunk - request sent.
- Throughput: completed requests and output tokens over the run's duration.
- Goodput: completed requests meeting every SLO (tpot counts as 0 for one-token answers, as
  vllm does) per second of run.
- Prefix-cache hit ratio: sum(cached_tokens) / sum(prompt_tokens) over completed requests
  whose server reported cached tokens.

Percentiles are proxy.stats.percentile: linear interpolation, numpy's default and vllm's choice.
Empty series give None, not 0: a missing measurement must not look like a perfect one.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from proxy.bench.results import RequestResult, RunResult
from proxy.stats import percentile

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2e")


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    """mean, p50, p90, p99, max and n of `values` (seconds in, seconds out)."""
    if not values:
        return {"n": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    ordered = sorted(values)
    out: dict[str, float | int | None] = {
        "n": len(values),
        "mean": math.fsum(ordered) / len(ordered),
    }
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(ordered, p / 100)
    out["max"] = float(ordered[-1])
    return out


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft=0.5,tpot=0.05` (seconds; `ms` suffix allowed) -> {"ttft": 0.5, "tpot": 0.05}."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        key, sep, raw = part.strip().partition("=")
        key = key.strip().lower().replace("e2el", "e2e")
        if not sep or key not in SLO_KEYS:
            raise ValueError(
                f"bad SLO {part!r}: use KEY=SECONDS with KEY in {', '.join(SLO_KEYS)}, "
                "e.g. ttft=0.5,tpot=0.05 (or ttft=500ms)"
            )
        raw = raw.strip().lower()
        try:
            value = float(raw[:-2]) / 1000 if raw.endswith("ms") else float(raw.rstrip("s"))
        except ValueError:
            raise ValueError(f"bad SLO value {raw!r} for {key}: expected seconds") from None
        if value <= 0:
            raise ValueError(f"SLO {key} must be > 0")
        slo[key] = value
    return slo


def is_good(r: RequestResult, slo: Mapping[str, float]) -> bool:
    """Whether a completed request meets every SLO (vllm: tpot of a 1-token answer is 0)."""
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2e": r.e2e}
    return all((values[k] is not None and values[k] <= v) for k, v in slo.items())  # type: ignore[operator]


def error_counts(requests: Iterable[RequestResult]) -> dict[str, int]:
    return dict(sorted(Counter(r.error_kind or "unknown" for r in requests if not r.ok).items()))


def cache_hit_ratio(requests: Iterable[RequestResult]) -> float | None:
    cached = prompt = 0
    reported = False
    for r in requests:
        if r.ok and r.cached_tokens is not None and r.prompt_tokens:
            reported = True
            cached += r.cached_tokens
            prompt += r.prompt_tokens
    return cached / prompt if reported and prompt else None


def summarize(run: RunResult, slo: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The run's headline numbers as a JSON-ready dict (seconds, tokens, ratios)."""
    done = [r for r in run.requests if r.ok]
    dur = run.duration if run.duration > 0 else float("nan")
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens or 0 for r in done)
    itl = [g for r in done for g in r.itl]
    tpots = [t for r in done if (t := r.tpot) is not None]
    goodput: dict[str, Any] | None = None
    if slo:
        good = sum(1 for r in done if is_good(r, slo))
        goodput = {
            "slo": dict(slo),
            "good_requests": good,
            "request_goodput": _rate(good, dur),
            "fraction": good / len(run.requests) if run.requests else None,
        }
    return {
        "label": run.label,
        "role": run.role,
        "targets": list(run.targets),
        "workload": run.workload.get("name"),
        "model": run.model,
        "endpoint": run.endpoint,
        "concurrency": run.concurrency,
        "rate": run.rate,
        "requests_planned": run.requests_planned,
        "requests_sent": len(run.requests),
        "not_sent": run.not_sent,
        "completed": len(done),
        "failed": len(run.requests) - len(done),
        "errors": error_counts(run.requests),
        "duration_s": run.duration,
        "request_throughput": _rate(len(done), dur),
        "output_throughput": _rate(out_tokens, dur),
        "total_token_throughput": _rate(in_tokens + out_tokens, dur),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "cached_tokens": sum(r.cached_tokens or 0 for r in done),
        "prefix_cache_hit_ratio": cache_hit_ratio(done),
        "goodput": goodput,
        "ttft_s": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": distribution(tpots),
        "itl_s": distribution(itl),
        "e2e_s": distribution([r.e2e for r in done if r.e2e is not None]),
        "by_kind": by_kind(run.requests),
        "output_chunks": sum(r.output_chunks for r in done),
        "chunk_throughput": _rate(sum(r.output_chunks for r in done), dur),
        "client_cpu_s": run.client_cpu_s,
        "client_cpu_util": _rate(run.client_cpu_s, dur),
        "server_cpu_s": run.server_cpu_s,
        "server_cpu_ms_per_request": (
            None if run.server_cpu_s is None or not done else run.server_cpu_s / len(done) * 1000
        ),
    }


def by_kind(requests: Iterable[RequestResult]) -> dict[str, dict[str, Any]]:
    """TTFT, ITL and E2E per request kind (chat, doc): a mixed workload's pooled ITL hides
    what the chat streams saw beside the documents' prefills."""
    kinds: dict[str, list[RequestResult]] = {}
    for r in requests:
        kinds.setdefault(r.kind, []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted(kinds):
        done = [r for r in kinds[kind] if r.ok]
        out[kind] = {
            "requests": len(kinds[kind]),
            "completed": len(done),
            "output_tokens": sum(r.output_tokens for r in done),
            "ttft_s": distribution([r.ttft for r in done if r.ttft is not None]),
            "itl_s": distribution([g for r in done for g in r.itl]),
            "e2e_s": distribution([r.e2e for r in done if r.e2e is not None]),
        }
    return out


def added_latency(proxied: Mapping[str, Any], direct: Mapping[str, Any]) -> dict[str, Any]:
    """What the proxy adds: TTFT/ITL/E2E differences (proxy - direct) at mean, p50 and p99."""
    out: dict[str, Any] = {"proxy": proxied["label"], "direct": direct["label"]}
    for metric in ("ttft_s", "itl_s", "e2e_s"):
        diffs: dict[str, float | None] = {}
        for stat in ("mean", "p50", "p99"):
            a, b = proxied[metric][stat], direct[metric][stat]
            diffs[stat] = None if a is None or b is None else a - b
        out[metric] = diffs
    return out


def _rate(n: float, dur: float) -> float | None:
    return None if dur != dur or dur <= 0 else n / dur
