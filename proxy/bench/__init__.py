"""`warmroute bench`: seeded workloads, an async load runner and vllm-compatible metrics.

Programmatic use (what `warmroute demo` does)::

    from proxy.bench import Workload, run_bench, summarize, format_table
    run = await run_bench("http://127.0.0.1:8080", Workload("shared-prefix", seed=1),
                          requests=200, concurrency=16, rate=None, model=None, progress=False)
    print(format_table([run]))
"""

from proxy.bench.client import BenchError, run_bench
from proxy.bench.metrics import added_latency, parse_slo, summarize
from proxy.bench.report import format_table, load_runs, plot_cdfs, results_document, write_json
from proxy.bench.results import SCHEMA, RequestResult, RunResult
from proxy.bench.workloads import WORKLOADS, RequestSpec, Workload, make_workload

__all__ = [
    "SCHEMA",
    "WORKLOADS",
    "BenchError",
    "RequestResult",
    "RequestSpec",
    "RunResult",
    "Workload",
    "added_latency",
    "format_table",
    "load_runs",
    "make_workload",
    "parse_slo",
    "plot_cdfs",
    "results_document",
    "run_bench",
    "summarize",
    "write_json",
]
