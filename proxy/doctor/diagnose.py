"""The diagnosis (pure): windows of measurements in, findings with evidence and a change out.

Each rule reads one window's Measures (analysis.py) and fires only on enough evidence; where
two findings would describe one cause, the cause wins (a full KV pool explains both the queue
and the evicted prefixes). Why each threshold is where it is: docs/doctor.md. One rule,
tenant_crowding, is proxy-wide: it reads the span's keyed requests, not a backend's window.

Size: every rule beside its evidence and its change text, so that one file reads as the
doctor's whole judgement; the proxy-wide rule took it just past 600 lines.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.doctor.analysis import Measures, measure
from proxy.doctor.model import (
    ADMISSION,
    FINDING_IDS,
    BackendReport,
    Finding,
    Report,
    TenantRequest,
    Window,
)
from proxy.doctor.report import measurements, notes


@dataclass(frozen=True)
class Thresholds:
    """Where each finding starts (and turns critical). docs/doctor.md gives the reasons."""

    dominated: float = 0.5  # a cause "dominates" TTFT when it is more than half of it
    dominated_critical: float = 0.8
    min_cost_s: float = 0.1  # a TTFT cause costs a request at least this: perceptible
    repeated: float = 0.1  # an engine caching nothing: this share of its prefill was a repeat
    full_while_waiting: float = 0.5  # most waiting happened with no room in the KV pool
    disagreement: float = 0.5  # the index is wrong about more tokens than it is right
    disagreement_critical: float = 0.8
    itl_inflation: float = 2.0  # p99 at least one whole extra decode step above p50
    itl_inflation_critical: float = 4.0
    inflated_share: float = 0.01  # the gaps that set a p99 are 1% of all gaps
    chunk_gain: float = 2.0  # the advised prefill chunk must at least halve the shared step
    kv_share: float = 0.5  # KV reads cost as much as the weights: context doubled the step
    kv_share_critical: float = 0.75
    efficiency: float = 0.5  # below: the stack loses more per step than the memory reads take
    efficiency_critical: float = 0.25
    decode_target_tok_s: float = 10.0  # per stream: twice an average reader's pace
    min_requests: int = 20
    min_gaps: int = 100  # a p99 of fewer samples is the maximum
    min_scrapes: int = 3


Rule = Callable[[Measures, Thresholds], Finding | None]
# The smallest prefill chunk advised: four 16-token KV blocks. Each step reads every weight
# once, so a chunk this small already spends most of its step on the weights, and a smaller
# one would lengthen the prefilling request's TTFT more than it shortens anyone's ITL.
MIN_CHUNK_TOKENS = 64


def _finding(
    m: Measures, fid: str, critical: bool, summary: str, evidence: dict[str, Any], change: str
) -> Finding:
    w = m.window
    return Finding(
        id=fid,
        severity="critical" if critical else "warning",
        backend=w.backend,
        model=w.model,
        summary=summary,
        evidence={k: _round(v) for k, v in evidence.items()},
        change=change,
    )


def _round(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 6 if abs(v) < 1 else 3)
    return v


def _queue_share(m: Measures, t: Thresholds) -> float | None:
    s = m.split
    if m.requests < t.min_requests or s.queue_s is None or not s.upstream_ttft_s:
        return None
    if s.queue_s < t.min_cost_s:
        return None  # a wait of a few steps: a request joins the batch at a step boundary
    return min(s.queue_s / s.upstream_ttft_s, 1.0)


def kv_pressure(m: Measures, t: Thresholds) -> Finding | None:
    share = _queue_share(m, t)
    g = m.gauges
    full = g.full_while_waiting
    if share is None or share < t.dominated or full is None or full < t.full_while_waiting:
        return None
    if g.scrapes < t.min_scrapes:
        return None
    return _finding(
        m,
        "kv_pressure",
        share >= t.dominated_critical,
        f"requests waited for KV-cache room: {share:.0%} of the time to first token was "
        f"queueing, and {full:.0%} of the scrapes that saw a request waiting found the KV pool "
        f"full (usage up to {g.kv_usage_max:.0%})",
        {
            "queue_share_of_ttft": share,
            "queue_s_mean": m.split.queue_s,
            "upstream_ttft_s_mean": m.split.upstream_ttft_s,
            "split_source": m.split.source,
            "full_while_waiting": full,
            "waiting_mean": g.waiting_mean,
            "running_mean": g.running_mean,
            "kv_usage_mean": g.kv_usage_mean,
            "kv_usage_max": g.kv_usage_max,
            "kv_pool_tokens": g.kv_tokens,
            "preemptions": g.preemptions,
            "prompt_tokens_mean": m.input_mean,
        },
        "capacity, not the model: add replicas, give the KV cache more memory (vLLM "
        "--gpu-memory-utilization, a smaller or quantized model, --kv-cache-dtype fp8), or cap "
        "the context (--max-model-len) so more requests fit in the pool",
    )


def queueing(m: Measures, t: Thresholds) -> Finding | None:
    share = _queue_share(m, t)
    if share is None or share < t.dominated:
        return None
    full = m.gauges.full_while_waiting
    if full is not None and full >= t.full_while_waiting and m.gauges.scrapes >= t.min_scrapes:
        return None  # kv_pressure: the pool is the cause
    return _finding(
        m,
        "queueing",
        share >= t.dominated_critical,
        f"time to first token is mostly waiting: {share:.0%} of the upstream TTFT "
        f"({share * (m.split.upstream_ttft_s or 0) * 1000:.0f} of "
        f"{(m.split.upstream_ttft_s or 0) * 1000:.0f} ms) was spent queued, per the "
        f"{m.split.source}",
        {
            "queue_share_of_ttft": share,
            "queue_s_mean": m.split.queue_s,
            "upstream_ttft_s_mean": m.split.upstream_ttft_s,
            "split_source": m.split.source,
            "waiting_mean": m.gauges.waiting_mean,
            "running_mean": m.gauges.running_mean,
            "full_while_waiting": full,
            "requests_per_s": m.requests / m.span_s if m.span_s else None,
        },
        "more replicas for this model, or a load bound: the requests wait before the engine "
        "starts them (raise the engine's --max-num-seqs if its batch is the limit and memory "
        "allows)",
    )


def _prefill_costs(m: Measures) -> tuple[float, float, float] | None:
    """(avoidable share of the upstream TTFT, all prefill's share of it, avoidable seconds per
    request): what a working prefix cache would have saved, against all the prefill there was."""
    up = m.split.upstream_ttft_s
    if not m.prefill_rate or not up or not m.requests:
        return None
    avoidable_s = m.cache.avoidable_tokens / m.prefill_rate / m.requests
    prefill = m.split.prefill_s
    if prefill is None:  # no split: the prefill of the uncached prompt at the measured rate
        prefill = (m.uncached_mean or 0.0) / m.prefill_rate
    return min(avoidable_s / up, 1.0), min(prefill / up, 1.0), avoidable_s


def prefill_bound_ttft(m: Measures, t: Thresholds) -> Finding | None:
    costs = _prefill_costs(m)
    if m.requests < t.min_requests or costs is None:
        return None
    share, prefill_share, avoidable_s = costs
    c = m.cache
    prefilled = sum(u for r in m.window.requests if r.ok and (u := r.uncached_tokens))
    repeated = c.avoidable_tokens / prefilled if prefilled else 0.0
    if c.engine_caches_nothing:
        # An engine that reports no hit teaches the capacity learner that it holds nothing, so
        # the index forgets that backend's prompts: what it still recognizes is a lower bound
        # of what repeats. The prefill share is measured; the bound need only show repeats.
        # Prefix caching costs nothing where prompts do not repeat, so showing that they do
        # is enough to advise it, once prefill is most of a perceptible TTFT.
        if prefill_share < t.dominated or repeated < t.repeated:
            return None
        judged, cost_s = prefill_share, prefill_share * (m.split.upstream_ttft_s or 0.0)
    else:
        if share < t.dominated:
            return None
        judged, cost_s = share, avoidable_s
    if cost_s < t.min_cost_s:
        return None
    per_request = c.avoidable_tokens / m.requests
    what, cause, change = _prefill_bound_words(m, share, prefill_share, repeated, per_request)
    return _finding(
        m,
        "prefill_bound_ttft",
        judged >= t.dominated_critical,
        f"time to first token is mostly prefill of prompts seen before: {what}; {cause}",
        {
            "avoidable_share_of_ttft": share,
            "prefill_share_of_ttft": prefill_share,
            "avoidable_s_per_request": avoidable_s,
            "avoidable_tokens_per_request": per_request,
            "repeated_share_of_prefill": repeated,
            "avoidable_tokens_here": c.avoidable_here,
            "avoidable_tokens_elsewhere": c.avoidable_elsewhere,
            "uncached_tokens_mean": m.uncached_mean,
            "uncached_tokens_p90": m.uncached_p90,
            "prefill_tokens_per_s": m.prefill_rate,
            "upstream_ttft_s_mean": m.split.upstream_ttft_s,
            "reported_hit_ratio": c.reported_tokens / c.input_tokens if c.input_tokens else None,
            "engine_caches_nothing": c.engine_caches_nothing,
        },
        change,
    )


def _prefill_bound_words(
    m: Measures, share: float, prefill_share: float, repeated: float, per_request: float
) -> tuple[str, str, str]:
    """prefill_bound_ttft's what, cause and change: the engine caches nothing, routing sent
    the prompt away from its cache, or the engine lost what the index expected it to hold."""
    c = m.cache
    if c.engine_caches_nothing:
        cause = (
            f"the engine reported no cached tokens at all, and at least {repeated:.0%} of what "
            "it prefilled had been sent before"
        )
        what = (
            f"prefill is {prefill_share:.0%} of the upstream TTFT, and at least "
            f"{per_request:.0f} tokens per request were prefilled though the index had seen them "
            "(a lower bound: the index forgets what an engine reports it did not keep)"
        )
        change = (
            "enable prefix caching on the engine (vLLM: do not pass "
            "--no-enable-prefix-caching; SGLang: drop --disable-radix-cache; llama.cpp: "
            "cache_prompt and --cache-reuse), then check that cached_tokens comes back in usage"
        )
    else:
        what = (
            f"{per_request:.0f} tokens per request were prefilled though the index had seen "
            f"them, {share:.0%} of the upstream TTFT at {m.prefill_rate:.0f} tokens/s"
        )
        if c.avoidable_elsewhere > c.avoidable_here:
            cause = "most of it was cached on another backend: routing sent it elsewhere"
            change = (
                "check routing affinity: use the prefix_aware policy (now "
                f"{m.window.policy or 'unknown'}), share the prefix index between proxy "
                "replicas (--redis), and keep a prompt's prefix identical between requests"
            )
        else:
            cause = "the index expected this backend to hold it, and the engine did not"
            change = (
                "fix prefix caching on the engine: it evicts or never keeps what it served "
                "(a KV pool too small for the prompts it holds, a prompt that differs early "
                "such as a timestamp in the system prompt, or a chat template that renders "
                "differently)"
            )
    return what, cause, change


def cache_affinity_lost(m: Measures, t: Thresholds) -> Finding | None:
    c = m.cache
    if m.requests < t.min_requests or c.predicting < t.min_requests or not c.reporting:
        return None
    lost = 1.0 - c.predicted_hit_tokens / c.predicted_tokens if c.predicted_tokens else 0.0
    unexpected = c.unpredicted_tokens / c.reported_tokens if c.reported_tokens else 0.0
    if max(lost, unexpected) < t.disagreement:
        return None
    if lost >= unexpected:
        what = (
            f"the index predicted {c.predicted_tokens / c.predicting:.0f} cached tokens per "
            f"request and the engine reported {lost:.0%} of them missing"
        )
        change = (
            "the engine loses what the index expects: eviction (a pool too small for the "
            "prompts it serves), a different tokenizer or chat template than the index's "
            "(set routing.plugins.prefix.tokenizer_file and chat_template_file), or the "
            "engine's prefix caching off"
        )
        if c.engine_caches_nothing:
            change = "the engine caches nothing: enable its prefix caching; " + change
    else:
        what = (
            f"{unexpected:.0%} of the tokens the engine reported cached were beyond what the "
            "index predicted"
        )
        change = (
            "the index forgets what the engine keeps: raise routing.plugins.prefix."
            "capacity_blocks or keep learn_capacity on, share the index between proxy "
            "replicas (--redis), and check that clients do not reach the engine directly"
        )
    return _finding(
        m,
        "cache_affinity_lost",
        max(lost, unexpected) >= t.disagreement_critical,
        f"the prefix index and the engine disagree: {what}",
        {
            "predicted_tokens": c.predicted_tokens,
            "predicted_hit_tokens": c.predicted_hit_tokens,
            "missing_share": lost,
            "unpredicted_share": unexpected,
            "reported_tokens": c.reported_tokens,
            "requests_with_prediction": c.predicting,
            "learner": dict(m.window.cache) if m.window.cache else None,
        },
        change,
    )


def prefill_interference(m: Measures, t: Thresholds) -> Finding | None:
    tl = m.timeline
    p50, p99 = tl.itl_p50_s, tl.itl_p99_s
    if tl.gaps < t.min_gaps or not p50 or p99 is None or tl.step_tokens is None:
        return None
    ratio = p99 / p50
    if ratio < t.itl_inflation or tl.inflated_share < t.inflated_share:
        return None
    # The tail must be the long prefills': without the gaps beside them, ITL is steady.
    # (What inflates it otherwise, prefills a cache would skip or preemptions, is another
    # finding's.)
    clean50, clean99 = tl.clean_p50_s, tl.clean_p99_s
    if not clean50 or clean99 is None or clean99 / clean50 >= t.itl_inflation:
        return None
    chunk = max(MIN_CHUNK_TOKENS, -(-int(tl.step_tokens) // MIN_CHUNK_TOKENS) * MIN_CHUNK_TOKENS)
    # With that chunk a shared step costs a decode step plus the chunk's prefill; the advice
    # stands only if it at least halves what the streams beside long prefills saw.
    along99 = tl.alongside_p99_s
    rate = m.prefill_rate
    if along99 is None or not rate:
        return None
    advised_step_s = p50 + chunk / rate
    if along99 < t.chunk_gain * advised_step_s:
        return None
    split, disagg = _split_advice(m.window.disagg)
    return _finding(
        m,
        "prefill_interference",
        ratio >= t.itl_inflation_critical,
        f"long prefills stall decoding streams: ITL p99 is {ratio:.1f}x p50 "
        f"({p99 * 1000:.0f} vs {p50 * 1000:.0f} ms); {tl.inflated_share:.1%} of the gaps ran "
        f"alongside one of {tl.long_prefills} prefills longer than a decode step "
        f"(> {tl.step_tokens:.0f} tokens, mean {tl.long_prefill_tokens_mean or 0:.0f}) and "
        "took two steps or more",
        {
            "itl_p50_s": p50,
            "itl_p99_s": p99,
            "itl_p99_over_p50": ratio,
            "clean_itl_p99_s": tl.clean_p99_s,
            "alongside_itl_p50_s": tl.alongside_p50_s,
            "alongside_itl_p99_s": tl.alongside_p99_s,
            "inflated_gap_share": tl.inflated_share,
            "long_prefills": tl.long_prefills,
            "long_prefill_tokens_mean": tl.long_prefill_tokens_mean,
            "step_tokens": tl.step_tokens,
            "prefill_tokens_per_s": m.prefill_rate,
            "advised_chunk_tokens": chunk,
            "advised_shared_step_s": advised_step_s,
            "disagg": disagg,
        },
        "lower the engine's prefill chunk (vLLM --max-num-batched-tokens) toward about "
        f"{chunk} tokens, what this device prefills in one decode step: a shared step then "
        "costs about two decode steps (smaller chunks favour ITL, larger ones TTFT); " + split,
    )


def _split_advice(view: Mapping[str, Any] | None) -> tuple[str, dict[str, Any] | None]:
    """The prefill/decode split half of the change, with the decider's current view."""
    if not view:
        return (
            "or split prefill from decode (backends' role: prefill and decode, disagg.mode: "
            "auto lets warmroute decide from this traffic) so decoding streams never share a "
            "step with a long prompt",
            None,
        )
    seen = {k: view.get(k) for k in ("mode", "active", "reason")}
    if view.get("active"):
        advice = (
            f"the disaggregation decider has split the pools already ({view.get('reason')}): "
            "what remains shares a step inside a pool"
        )
    else:
        advice = (
            "or split prefill from decode; the disaggregation decider "
            f"({view.get('mode')}) keeps the pools joined: {view.get('reason')}"
        )
    return advice, seen


def long_context_itl(m: Measures, t: Thresholds) -> Finding | None:
    tl = m.timeline
    if tl.gaps < t.min_gaps or tl.context_p90_tokens is None:
        return None
    share, source = tl.kv_share_p90, "measured"
    if share is None and tl.efficiency is not None and tl.efficiency >= t.efficiency:
        # The contexts did not vary enough to measure a slope; the declared hardware's
        # roofline describes this engine (it decodes within 2x of it), so it says the share.
        share, source = tl.expected_kv_share_p90, "declared hardware"
    if share is None or share < t.kv_share:
        return None
    ctx = tl.context_p90_tokens
    evidence: dict[str, Any] = {
        "kv_share_of_step": share,
        "source": source,
        "context_tokens_p90": ctx,
        "streams_mean": tl.mean_streams,
        "itl_p50_s": tl.itl_p50_s,
        "expected_kv_share": tl.expected_kv_share_p90,
    }
    if source == "measured" and tl.context_fit is not None:
        intercept, slope, t_slope = tl.context_fit
        evidence |= {
            "itl_at_no_context_s": intercept,
            "itl_per_1k_context_tokens_s": slope * 1000,
            "slope_t": min(t_slope, 1e6),
        }
        how = (
            f"a decode step takes {(intercept + slope * ctx) * 1000:.1f} ms at {ctx:,.0f} KV "
            f"tokens in flight (p90) against {intercept * 1000:.1f} ms with none"
        )
    else:
        how = f"at {ctx:,.0f} KV tokens in flight (p90), by the declared hardware's roofline"
    return _finding(
        m,
        "long_context_itl",
        share >= t.kv_share_critical,
        f"ITL grows with the context in flight: {how}: {share:.0%} of each step reads the KV cache",
        evidence,
        "each token reads the KV cache of the whole context of every stream in the batch: "
        "shorten what is sent (trim or summarize history, smaller documents), cap the "
        "context (--max-model-len), quantize the KV cache (--kv-cache-dtype fp8 halves it), or "
        "spread long conversations over more replicas",
    )


def _decode(m: Measures, t: Thresholds) -> tuple[float, float, float] | None:
    tl = m.timeline
    if m.window.hardware is None or tl.gaps < t.min_gaps:
        return None
    if tl.efficiency is None or tl.decode_tok_s is None or tl.ceiling_tok_s is None:
        return None
    return tl.efficiency, tl.decode_tok_s, tl.ceiling_tok_s


def _decode_evidence(m: Measures) -> dict[str, Any]:
    tl = m.timeline
    hw = m.window.hardware
    return {
        "efficiency": tl.efficiency,
        "decode_tok_s": tl.decode_tok_s,
        "ceiling_tok_s": tl.ceiling_tok_s,
        "single_stream_tok_s": tl.single_stream_tok_s,
        "single_stream_ceiling_tok_s": hw.ceiling_tok_s if hw else None,
        "hardware": hw.label if hw else None,
        "streams_mean": tl.mean_streams,
        "context_tokens_p90": tl.context_p90_tokens,
    }


def decode_below_ceiling(m: Measures, t: Thresholds) -> Finding | None:
    d = _decode(m, t)
    if d is None or d[0] >= t.efficiency:
        return None
    eff, tok_s, ceiling = d
    return _finding(
        m,
        "decode_below_ceiling",
        eff < t.efficiency_critical,
        f"decode runs at {eff:.0%} of the memory-bandwidth ceiling of "
        f"{m.window.hardware.label if m.window.hardware else '?'}: {tok_s:.1f} tokens/s per "
        f"stream where the same batches and contexts allow {ceiling:.1f}",
        _decode_evidence(m),
        "a serving-stack problem, not the hardware: check that the engine runs on the "
        "accelerator you declared (drivers, CUDA graphs, no CPU offload), its kernels and "
        "tensor-parallel setup, and what else shares the device",
    )


def decode_at_ceiling(m: Measures, t: Thresholds) -> Finding | None:
    d = _decode(m, t)
    if d is None or d[0] < t.efficiency or d[1] >= t.decode_target_tok_s:
        return None
    eff, tok_s, ceiling = d
    return _finding(
        m,
        "decode_at_ceiling",
        tok_s < t.decode_target_tok_s / 2,
        f"decode is at the hardware's limit and still slow: {tok_s:.1f} tokens/s per stream "
        f"({eff:.0%} of the {ceiling:.1f} that memory bandwidth allows), under the "
        f"{t.decode_target_tok_s:g} tokens/s a reader needs",
        {**_decode_evidence(m), "target_tok_s": t.decode_target_tok_s},
        "only fewer bytes per token or more bandwidth help: quantize the weights (8-bit "
        "halves the bytes and about doubles the ceiling), use a smaller model, or a device "
        "with more memory bandwidth",
    )


RULES: tuple[Rule, ...] = (
    kv_pressure,
    queueing,
    prefill_bound_ttft,
    cache_affinity_lost,
    prefill_interference,
    long_context_itl,
    decode_below_ceiling,
    decode_at_ceiling,
)
# Per backend window; tenant_crowding, the proxy-wide one, is judged once per report.
assert (*(r.__name__ for r in RULES), "tenant_crowding") == FINDING_IDS


def diagnose_window(m: Measures, t: Thresholds) -> list[Finding]:
    found: list[Finding] = []
    for rule in RULES:
        f = rule(m, t)
        if f is None:
            continue
        ids = {x.id for x in found}
        if f.id == "cache_affinity_lost" and ids & {"kv_pressure", "prefill_bound_ttft"}:
            continue  # a full pool evicts; prefill_bound_ttft already names the cache's fault
        if f.id == "prefill_interference" and "kv_pressure" in ids and m.gauges.preemptions:
            continue  # a preempted sequence is prefilled again: the full pool's long prefills
        found.append(f)
    return found


def tenant_crowding(rows: Sequence[TenantRequest], t: Thresholds) -> Finding | None:
    """One tenant's load is what makes the others wait: it had most of the tokens served
    while the other tenants' requests waited, on average, a perceptible time for a slot."""
    tokens: dict[str, int] = {}
    for r in rows:
        tokens[r.tenant] = tokens.get(r.tenant, 0) + r.tokens
    total = sum(tokens.values())
    if len(rows) < t.min_requests or len(tokens) < 2 or total <= 0:
        return None
    top = max(tokens, key=lambda k: tokens[k])
    share = tokens[top] / total
    mine = [r.waited_s for r in rows if r.tenant == top]
    others = [r.waited_s for r in rows if r.tenant != top]
    waited = sum(others) / len(others)
    if share < t.dominated or waited < t.min_cost_s:
        return None
    evidence = {
        "tenant": top,
        "token_share": share,
        "request_share": len(mine) / len(rows),
        "others_wait_s_mean": waited,
        "tenant_wait_s_mean": sum(mine) / len(mine),
        "others_requests": len(others),
        "tenants": len(tokens),
    }
    return Finding(
        "tenant_crowding",
        "critical" if share >= t.dominated_critical else "warning",
        ADMISSION,
        "",
        f"tenant `{top}` had {share:.0%} of the tokens served while the other tenants' "
        f"requests waited {waited * 1000:.0f} ms on average for an admission slot",
        {k: _round(v) for k, v in evidence.items()},
        f"cap `{top}` (tenants.keys.{top}: tokens_per_minute or requests_per_minute), or give "
        "it a lower weight or `priority: batch` so the others go first; if every tenant needs "
        "what it sends, add capacity (server.max_inflight, more engines)",
    )


def diagnose(
    windows: Sequence[Window],
    thresholds: Thresholds | None = None,
    *,
    window_s: float | None = None,
    generated_at: str = "",
    tenants: Sequence[TenantRequest] = (),
) -> Report:
    """The report for these windows: every backend's measurements and findings, and the
    admission queue's (`tenants`: the keyed requests of the same span)."""
    t = thresholds or Thresholds()
    backends: list[BackendReport] = []
    findings: list[Finding] = []
    for w in windows:
        m = measure(w)
        found = diagnose_window(m, t)
        findings += found
        hw = w.hardware
        backends.append(
            BackendReport(
                backend=w.backend,
                model=w.model,
                engine=w.engine,
                hardware=hw.label if hw else None,
                requests=m.requests,
                errors=w.errors,
                span_s=round(m.span_s, 3),
                measurements=measurements(m),
                findings=[f.id for f in found],
                notes=notes(m, t.min_requests, t.min_gaps),
            )
        )
    crowding = tenant_crowding(tenants, t)
    if crowding is not None:
        findings.append(crowding)
    return Report(window_s, backends, findings, generated_at)
