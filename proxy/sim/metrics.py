"""Prometheus text exposition with vLLM's metric names, one registry per engine (no globals).

Latencies are observed on the wall clock, i.e. what a client of this process sees: with
--time-scale 10 they are ten times shorter than the simulated device's.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.sim.engine import Scheduler, StepPlan

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v)) if not float(v).is_integer() else f"{v:.1f}"


_Emit = Callable[[str, str, str, list[str]], None]  # one metric's lines


class Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, acc = [], 0
        for le, c in zip((*self.buckets, float("inf")), self.counts, strict=True):
            acc += c
            out.append(f'{name}_bucket{{{labels},le="{_fmt(le)}"}} {acc}')
        out.append(f"{name}_sum{{{labels}}} {self.sum}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class EngineMetrics:
    """Counters and histograms; gauges are read from the scheduler when rendered."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        # vLLM's per-request phases: waiting to be scheduled, then scheduled to first token
        self.queue_time = Histogram(REQUEST_BUCKETS)
        self.prefill_time = Histogram(REQUEST_BUCKETS)
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.prefill_tokens = 0
        self.decode_steps = 0
        self.errors_injected = 0

    def step(self, plan: StepPlan) -> None:
        self.prefill_tokens += plan.prefill_tokens
        self.decode_steps += 1

    def finished(self, reason: str, e2e: float, ttft: float | None, num_output: int) -> None:
        self.success[reason] = self.success.get(reason, 0) + 1
        self.e2e.observe(e2e)
        if ttft is not None and num_output > 1:
            self.tpot.observe((e2e - ttft) / (num_output - 1))

    def render(self, sched: Scheduler, aborted: int) -> str:
        """The engine's /metrics text, in vLLM's names (and a few of the simulator's own)."""
        lbl = f'model_name="{self.model}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(samples)

        self._gauges(metric, sched, lbl)
        self._counters(metric, sched, lbl, aborted)
        self._histograms(metric, lbl)
        return "\n".join(lines) + "\n"

    @staticmethod
    def _gauges(metric: _Emit, sched: Scheduler, lbl: str) -> None:
        metric(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            [f"vllm:num_requests_running{{{lbl}}} {len(sched.running)}"],
        )
        metric(
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            [f"vllm:num_requests_waiting{{{lbl}}} {len(sched.waiting)}"],
        )
        if not sched.cfg.hide_kv_pool:
            metric(
                "vllm:cache_config_info",
                "gauge",
                "Information of the LLMEngine CacheConfig (the KV pool size).",
                [
                    f'vllm:cache_config_info{{block_size="{sched.cfg.block_size}",'
                    f'enable_prefix_caching="{sched.cfg.enable_prefix_caching}",'
                    f'num_gpu_blocks="{sched.pool.num_blocks}"}} 1.0'
                ],
            )
        usage = sched.pool.usage
        metric(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            [f"vllm:kv_cache_usage_perc{{{lbl}}} {usage}"],
        )
        metric(
            "vllm:gpu_cache_usage_perc",
            "gauge",
            "GPU KV-cache usage (older vLLM name). 1 means 100 percent usage.",
            [f"vllm:gpu_cache_usage_perc{{{lbl}}} {usage}"],
        )

    def _counters(self, metric: _Emit, sched: Scheduler, lbl: str, aborted: int) -> None:
        counters = (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", sched.prefix_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", sched.prefix_hits),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", sched.prompt_tokens),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                sched.generation_tokens,
            ),
            ("vllm:num_preemptions", "Cumulative number of preemptions.", sched.preemptions),
            (
                "warmroute_sim_aborted_requests",
                "Requests aborted because the client went away (simulator only).",
                aborted,
            ),
            (
                "warmroute_sim_external_kv_tokens",
                "Prompt tokens whose KV arrived from a prefill engine (simulator only).",
                sched.external_tokens,
            ),
        )
        for name, help_, value in counters:
            metric(name, "counter", help_, [f"{name}_total{{{lbl}}} {value}"])
        metric(
            "vllm:request_success",
            "counter",
            "Count of finished requests by finish reason.",
            [
                f'vllm:request_success_total{{{lbl},finished_reason="{r}"}} {n}'
                for r, n in self.success.items()
            ],
        )

    def _histograms(self, metric: _Emit, lbl: str) -> None:
        for name, help_, hist in (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token.", self.ttft),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency.", self.itl),
            (
                "vllm:time_per_output_token_seconds",
                "Histogram of mean time per output token, per request.",
                self.tpot,
            ),
            (
                "vllm:e2e_request_latency_seconds",
                "Histogram of end to end request latency.",
                self.e2e,
            ),
            (
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                self.queue_time,
            ),
            (
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                self.prefill_time,
            ),
        ):
            metric(name, "histogram", help_, hist.lines(name, lbl))
