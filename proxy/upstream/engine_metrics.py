"""What an engine's /metrics says of its load: the queue, the running requests, the KV-cache
usage and pool size, and the cumulative counters the doctor reads (pure parsing; the registry
scrapes, proxy/upstream/backends.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from proxy.routing.types import EngineLoad

# Engine-specific load gauges: the engines' own queue and KV signals, scraped.
LOAD_METRICS: dict[str, dict[str, str]] = {
    "vllm": {
        "vllm:num_requests_waiting": "waiting",
        "vllm:num_requests_running": "running",
        "vllm:kv_cache_usage_perc": "kv_usage",
        "vllm:gpu_cache_usage_perc": "kv_usage",  # older vLLM name
        # Cumulative counters (EngineLoad.counters): the doctor compares them across its window
        # to split TTFT into queueing and prefill and to read the prefix cache (docs/doctor.md).
        "vllm:request_queue_time_seconds_sum": "queue_time_sum",
        "vllm:request_queue_time_seconds_count": "queue_time_count",
        "vllm:request_prefill_time_seconds_sum": "prefill_time_sum",
        "vllm:request_prefill_time_seconds_count": "prefill_time_count",
        "vllm:prefix_cache_queries_total": "prefix_queries",
        "vllm:prefix_cache_hits_total": "prefix_hits",
        "vllm:num_preemptions_total": "preemptions",
    },
    "sglang": {
        "sglang:num_queue_reqs": "waiting",
        "sglang:num_running_reqs": "running",
        "sglang:token_usage": "kv_usage",
    },
    "llamacpp": {
        "llamacpp:requests_deferred": "waiting",
        "llamacpp:requests_processing": "running",
    },
}
KV_CONFIG_INFO = "vllm:cache_config_info"
_GAUGES = ("waiting", "running", "kv_usage")


def parse_load(engine: str, text: str, now: float) -> EngineLoad | None:
    """Sum the engine's load gauges over all label sets in a Prometheus text exposition.

    Parsed with prometheus_client's parser (values, labels, escapes and timestamps as the
    format defines them), but only on the lines of the few families we read: vLLM's
    exposition runs to hundreds of KB, every scrape, on the event loop, and parsing all of it
    costs ~50x more than picking the lines by name first.
    """
    wanted = LOAD_METRICS.get(engine)
    if not wanted:
        return None
    names = (*wanted, KV_CONFIG_INFO)
    lines = [ln for ln in text.splitlines() if ln.startswith(names)]
    if not lines:
        return None
    sums: dict[str, float] = {}
    kv_tokens: int | None = None
    try:
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except ValueError:
        families = _per_line(lines)  # one bad line must not hide the rest
    for family in families:
        for sample in family.samples:
            if sample.name in (KV_CONFIG_INFO, KV_CONFIG_INFO + "_total"):
                kv_tokens = _kv_pool_tokens(sample.labels) or kv_tokens
                continue
            attr = wanted.get(sample.name)
            if attr is not None and sample.value == sample.value:  # not NaN
                sums[attr] = sums.get(attr, 0.0) + sample.value
    if not sums and kv_tokens is None:
        return None
    return EngineLoad(
        waiting=sums.get("waiting"),
        running=sums.get("running"),
        kv_usage=sums.get("kv_usage"),
        kv_tokens=kv_tokens,
        scraped_at=now,
        counters={k: v for k, v in sums.items() if k not in _GAUGES},
    )


def counters_reset(before: Mapping[str, float], after: Mapping[str, float]) -> str | None:
    """The cumulative counter that went back between two scrapes (the engine restarted: its
    cache is cold), or None."""
    for name, value in after.items():
        was = before.get(name)
        if was is not None and value < was:
            return name
    return None


def _per_line(lines: list[str]) -> list[Any]:
    out: list[Any] = []
    for line in lines:
        with contextlib.suppress(ValueError):
            out.extend(text_string_to_metric_families(line + "\n"))
    return out


def _kv_pool_tokens(labels: dict[str, str]) -> int | None:
    """num_gpu_blocks x block_size from vLLM's cache_config_info labels."""
    try:
        return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return None
