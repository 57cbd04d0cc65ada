"""A window's measurements as the report shows them, and notes on what could not be judged."""

from __future__ import annotations

from typing import Any

from proxy.doctor.analysis import Measures

# Every key of BackendReport.measurements (the JSON schema in docs/doctor.md lists them too).
MEASUREMENT_KEYS = (
    "ttft_p50_s",
    "ttft_p90_s",
    "upstream_ttft_s_mean",
    "queue_s_mean",
    "prefill_s_mean",
    "split_source",
    "prefill_tokens_per_s",
    "prompt_tokens_mean",
    "uncached_tokens_mean",
    "uncached_tokens_p90",
    "output_tokens_mean",
    "reported_hit_ratio",
    "predicted_hit_ratio",
    "itl_p50_s",
    "itl_p99_s",
    "clean_itl_p99_s",
    "alongside_gap_share",
    "long_prefills",
    "step_tokens",
    "context_tokens_p90",
    "kv_share_of_step",
    "decode_tok_s",
    "ceiling_tok_s",
    "decode_efficiency",
    "scrapes",
    "waiting_mean",
    "running_mean",
    "kv_usage_mean",
    "kv_usage_max",
    "preemptions",
)


def _r(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


def measurements(m: Measures) -> dict[str, Any]:
    s, c, g, tl = m.split, m.cache, m.gauges, m.timeline
    out: dict[str, Any] = {
        "ttft_p50_s": _r(m.ttft_p50_s, 6),
        "ttft_p90_s": _r(m.ttft_p90_s, 6),
        "upstream_ttft_s_mean": _r(s.upstream_ttft_s, 6),
        "queue_s_mean": _r(s.queue_s, 6),
        "prefill_s_mean": _r(s.prefill_s, 6),
        "split_source": s.source,
        "prefill_tokens_per_s": _r(m.prefill_rate, 1),
        "prompt_tokens_mean": _r(m.input_mean, 1),
        "uncached_tokens_mean": _r(m.uncached_mean, 1),
        "uncached_tokens_p90": _r(m.uncached_p90, 1),
        "output_tokens_mean": _r(m.output_mean, 1),
        "reported_hit_ratio": _r(c.reported_tokens / c.input_tokens)
        if c.reporting and c.input_tokens
        else None,
        "predicted_hit_ratio": _r(c.predicted_tokens / c.input_tokens)
        if c.predicting and c.input_tokens
        else None,
        "itl_p50_s": _r(tl.itl_p50_s, 6),
        "itl_p99_s": _r(tl.itl_p99_s, 6),
        "clean_itl_p99_s": _r(tl.clean_p99_s, 6),
        "alongside_gap_share": _r(tl.alongside_gaps / tl.gaps) if tl.gaps else None,
        "long_prefills": tl.long_prefills,
        "step_tokens": _r(tl.step_tokens, 1),
        "context_tokens_p90": _r(tl.context_p90_tokens, 1),
        "kv_share_of_step": _r(tl.kv_share_p90),
        "decode_tok_s": _r(tl.decode_tok_s, 2),
        "ceiling_tok_s": _r(tl.ceiling_tok_s, 2),
        "decode_efficiency": _r(tl.efficiency),
        "scrapes": g.scrapes,
        "waiting_mean": _r(g.waiting_mean, 3),
        "running_mean": _r(g.running_mean, 3),
        "kv_usage_mean": _r(g.kv_usage_mean),
        "kv_usage_max": _r(g.kv_usage_max),
        "preemptions": g.preemptions,
    }
    assert tuple(out) == MEASUREMENT_KEYS
    return out


def notes(m: Measures, min_requests: int, min_gaps: int) -> list[str]:
    """What this window could not be judged on, and why (each a sentence)."""
    w = m.window
    out: list[str] = []
    if not m.requests:
        out.append("no requests in the window: nothing to judge")
        return out
    if m.requests < min_requests:
        out.append(f"{m.requests} request(s): too few to judge TTFT (findings need {min_requests})")
    if 0 < m.timeline.gaps < min_gaps:
        out.append(
            f"{m.timeline.gaps} inter-token gaps: too few for an ITL p99 (findings need {min_gaps})"
        )
    if m.split.upstream_ttft_s is None:
        out.append("no streamed responses: TTFT and ITL are only measured on streams")
    elif m.split.source is None:
        if w.engine == "openai":
            out.append(
                "engine 'openai' publishes no queue gauge or latency split: TTFT cannot be "
                "split into queueing and prefill (set engine: vllm, sglang or llamacpp if "
                "it is one)"
            )
        else:
            out.append(
                f"no scrape of the {w.engine} engine's /metrics in the window: TTFT cannot be "
                "split into queueing and prefill"
            )
    if w.engine != "openai" and not m.gauges.scrapes:
        out.append("no engine gauges in the window: KV pressure cannot be judged")
    elif m.gauges.scrapes and m.gauges.kv_usage_mean is None:
        out.append(f"the {w.engine} engine publishes no KV usage: KV pressure cannot be judged")
    if m.cache.reporting == 0 and m.cache.input_tokens:
        out.append("the engine reports no cached_tokens in usage: the cache findings need them")
    if m.cache.input_tokens == 0:
        out.append("no usage in the responses: prompt sizes and contexts are unknown")
    if m.cache.predicting == 0 and m.requests:
        out.append(
            f"the routing policy ({w.policy or 'unknown'}) did not match prompts against the "
            "prefix index: whether prompts repeat is unknown"
        )
    if w.hardware is None:
        out.append(
            "no declared hardware (device, params, dtype in the backend's config): the "
            "decode ceiling is not checked"
        )
    return out
