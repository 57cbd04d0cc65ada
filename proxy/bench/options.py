"""`warmroute bench`'s command line: its options in groups, the environment variables that set
them (WARMROUTE_BENCH_*), and the help's examples. proxy/bench/cli.py registers them and runs."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from proxy.bench.client import AFFINITIES, MAX_REQUESTS
from proxy.bench.workloads import WORKLOADS

ENV_PREFIX = "WARMROUTE_BENCH_"
REPORT_EPILOG = """\
example:
  warmroute bench report proxy.json direct.json --out-md results.md --plots plots/
"""

EPILOG = f"""\
workloads (seeded: the same --seed sends byte-identical prompts):
  shared-prefix  K system prompts (--prefixes, --system-chars) picked with Zipf popularity
                 (--zipf), each followed by a short unique user turn (--user-chars)
  hot-prompt     one system prompt for every request (the hotspot case for routing)
  multi-turn     conversations of --turns turns; each later turn carries the real reply of the
                 earlier ones and is sent only after it completed
  long-doc       long unique prompts (--doc-chars), short answers (--doc-max-tokens)
  mixed          shared-prefix chat streams plus a --doc-fraction of long-doc requests
  chat-docs      the same mix sized for prefill/decode interference: 512-token answers, 15%
                 ~8,000-token documents with 16-token answers (each size flag overrides)
  Sizes are characters; ~4 characters make one token.

metrics (as `vllm bench serve` defines them; see docs/measurement.md):
  TTFT  first chunk carrying output (content/reasoning/tool call/text) - request sent
  ITL   every gap between output chunks;  TPOT (e2e - ttft) / (completion_tokens - 1)
  E2E   last output chunk - request sent; goodput = completed requests/s meeting --slo
  prefix cache hit ratio = sum(cached_tokens) / sum(prompt_tokens) when the server reports
  usage.prompt_tokens_details.cached_tokens

examples:
  # 200 requests, 16 in flight, against the proxy; model taken from /v1/models
  warmroute bench --base-url http://127.0.0.1:8080 --workload shared-prefix \\
      --requests 200 --concurrency 16 --out proxy.json --plots plots/

  # what does the proxy add? same workload straight at the backends (round-robin)
  warmroute bench --base-url http://127.0.0.1:8080 --direct http://127.0.0.1:8001 \\
      --direct http://127.0.0.1:8002 --workload hot-prompt --requests 300 --concurrency 32

  # the static-affinity bound on engines that keep their cache to themselves: system prompt
  # i always on backend i mod N (see "direct affinity" below; python -m proxy.bench.mock -h)
  warmroute bench --direct http://127.0.0.1:9301 --direct http://127.0.0.1:9302 \\
      --direct-affinity system --workload shared-prefix --zipf 0 --requests 400 \\
      --concurrency 32

  # the proxy's added TTFT at concurrency 1, paired request by request with direct access
  warmroute bench --base-url http://127.0.0.1:8080 --direct http://127.0.0.1:8001 \\
      --interleave --requests 2000 --concurrency 1

  # open loop at 4 req/s (Poisson), with an SLO for goodput
  warmroute bench --base-url http://127.0.0.1:8080 --workload mixed --requests 200 \\
      --rate 4 --slo ttft=0.5,tpot=0.05 --out mixed.json

  # compare two proxies side by side, then merge saved runs into one table
  warmroute bench --base-url http://127.0.0.1:8080 --compare http://127.0.0.1:9090 ...
  warmroute bench report a.json b.json --out-md results.md --plots plots/

direct affinity (--direct-affinity, how a run with several --direct URLs picks one):
  round-robin  (default) requests in turn by index; a multi-turn conversation stays on one
  system       system prompt i always on backend i mod N: each backend's cache holds only
               its share of the prompts. A cache-aware router should come close to this
               bound's cache hit ratio and TTFT while also spreading load; requests without
               a system prompt (long-doc) still go round-robin

Runs go one after another (target, --compare targets, then --direct), never at once, so they
do not compete; engines with a prefix cache will be warmer for the later runs (the same
prompts again) unless --vary-seed gives every run its own prompts. --interleave sends each
request to every run in turn instead: the way to compare latencies on a busy machine.
Guard rails: at most {MAX_REQUESTS} requests, --max-duration seconds (default 1800), loopback
targets only unless --allow-remote. Exit status: 0 ok, 1 error rate above --max-error-rate,
2 usage error or unreachable target.
Every option has an environment default WARMROUTE_BENCH_<OPTION>, e.g.
WARMROUTE_BENCH_BASE_URL=http://127.0.0.1:8080, WARMROUTE_BENCH_CONCURRENCY=8,
WARMROUTE_BENCH_DIRECT=url1,url2.
"""


def env(name: str, default: Any = None) -> Any:
    return os.environ.get(ENV_PREFIX + name.upper().replace("-", "_"), default)


def env_list(name: str) -> list[str] | None:
    raw = env(name)
    return [u.strip() for u in raw.split(",") if u.strip()] if raw else None


def env_flag(name: str) -> bool:
    return str(env(name, "")).lower() in ("1", "true", "yes", "on")


def positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def add_target_options(p: Any) -> None:
    """bench's options: the server(s) to load and how to name the run."""
    g = p.add_argument_group("target")
    g.add_argument(
        "--base-url",
        default=env("base-url"),
        metavar="URL",
        help="the server to load, e.g. http://127.0.0.1:8080 (/v1 optional)",
    )
    g.add_argument(
        "--model",
        default=env("model"),
        help="model name (default: the first one the target's /v1/models lists)",
    )
    g.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default=env("endpoint", "chat"),
        help="/v1/chat/completions (default) or /v1/completions",
    )
    g.add_argument("--label", default=env("label"), help="name of this run in tables and plots")
    g.add_argument(
        "--compare",
        action="append",
        default=env_list("compare"),
        metavar="URL",
        help="also run the workload against URL and show it side by side (repeatable)",
    )
    g.add_argument(
        "--direct",
        action="append",
        default=env_list("direct"),
        metavar="URL",
        help="the backend(s) behind the proxy: run the workload against them directly "
        "(spread by --direct-affinity when repeated) and report the proxy's added TTFT; "
        "without --base-url only the direct run is made",
    )
    g.add_argument(
        "--direct-affinity",
        choices=AFFINITIES,
        default=env("direct-affinity", "round-robin"),
        help="how requests are spread over several --direct URLs: round-robin (default) or "
        "system (system prompt i on URL i mod N, the static-affinity bound; see below)",
    )
    g.add_argument(
        "--close-connections",
        action="store_true",
        default=env_flag("close-connections"),
        help="a new connection for every request: for servers that close a connection after a "
        "streamed response although they announce keep-alive (llama-server), where a reused "
        "connection fails the next request",
    )
    g.add_argument(
        "--api-key-env",
        default=env("api-key-env"),
        metavar="VAR",
        help="environment variable holding a bearer token to send",
    )
    g.add_argument(
        "--allow-remote",
        action="store_true",
        default=env_flag("allow-remote"),
        help="allow targets that are not loopback addresses",
    )


def add_load_options(p: Any, pos: Callable[[str], Any], flt: Callable[[str], Any]) -> None:
    """bench's options: how much load, and how it arrives."""
    g = p.add_argument_group("load")
    g.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=env("workload", "shared-prefix"),
        help="request mix (default shared-prefix; see below)",
    )
    g.add_argument(
        "--requests",
        type=pos,
        default=env("requests", "100"),
        metavar="N",
        help=f"requests to send (default 100, at most {MAX_REQUESTS})",
    )
    g.add_argument(
        "--concurrency",
        type=pos,
        default=env("concurrency"),
        metavar="C",
        help="closed loop: C requests in flight (default 8 without --rate); with --rate: "
        "the cap in flight",
    )
    g.add_argument(
        "--rate",
        type=flt,
        default=env("rate"),
        metavar="R",
        help="open loop: Poisson arrivals at R requests/s",
    )
    g.add_argument("--seed", type=int, default=env("seed", "0"), help="workload seed (default 0)")
    g.add_argument(
        "--vary-seed",
        action="store_true",
        default=env_flag("vary-seed"),
        help="give each --compare/--direct run seed+k: same shape, disjoint prompts, so no "
        "run finds a prefix cache warmed by the previous one",
    )
    g.add_argument(
        "--interleave",
        action="store_true",
        default=env_flag("interleave"),
        help="send each request to the target, then to every --compare/--direct run (taking "
        "turns at going first) instead of one run after another: paired latency samples that "
        "a busy machine's load swings hit alike (use it for the proxy's added TTFT at "
        "--concurrency 1; throughput then describes the mix)",
    )
    g.add_argument(
        "--max-duration",
        type=flt,
        default=env("max-duration", "1800"),
        metavar="S",
        help="stop sending and cancel in-flight requests after S seconds (default 1800)",
    )
    g.add_argument(
        "--request-timeout",
        type=flt,
        default=env("request-timeout", "600"),
        metavar="S",
        help="per-request timeout (default 600)",
    )


def add_size_options(p: Any, pos: Callable[[str], Any]) -> None:
    """bench's options: the workload's shape."""
    g = p.add_argument_group("workload sizes (characters; ~4 per token)")
    g.add_argument(
        "--max-tokens",
        type=pos,
        default=env("max-tokens"),
        help="max_tokens of chat requests (default 128)",
    )
    g.add_argument(
        "--system-chars",
        type=pos,
        default=env("system-chars"),
        help="length of each shared system prompt (default 2000)",
    )
    g.add_argument(
        "--user-chars",
        type=pos,
        default=env("user-chars"),
        help="length of each unique user turn (default 200)",
    )
    g.add_argument(
        "--doc-chars",
        type=pos,
        default=env("doc-chars"),
        help="length of each long-doc prompt (default 8000)",
    )
    g.add_argument(
        "--doc-max-tokens",
        type=pos,
        default=env("doc-max-tokens"),
        help="max_tokens of long-doc requests (default 32)",
    )
    g.add_argument(
        "--prefixes",
        type=pos,
        default=env("prefixes"),
        metavar="K",
        help="distinct system prompts for shared-prefix/multi-turn/mixed (default 8)",
    )
    g.add_argument(
        "--zipf",
        type=float,
        default=env("zipf"),
        metavar="S",
        help="Zipf exponent of system prompt popularity, 0 = uniform (default 1.1)",
    )
    g.add_argument(
        "--turns",
        type=pos,
        default=env("turns"),
        help="turns per multi-turn conversation (default 4)",
    )
    g.add_argument(
        "--doc-fraction",
        type=float,
        default=env("doc-fraction"),
        metavar="F",
        help="share of long-doc requests in mixed (default 0.2) and chat-docs (0.15)",
    )
    g.add_argument(
        "--extra-body",
        default=env("extra-body"),
        metavar="JSON",
        help="fields merged into every request body, e.g. '{\"ignore_eos\": true}'",
    )


def add_output_options(p: Any) -> None:
    """bench's options: what the run writes and when it fails."""
    g = p.add_argument_group("output")
    g.add_argument(
        "--out",
        default=env("out"),
        metavar="FILE",
        help="results JSON (every request's timings; schema warmroute.bench/v1)",
    )
    add_report_outputs(g)
    g.add_argument(
        "--server-pid",
        type=int,
        action="append",
        metavar="PID",
        help="measure the CPU these processes (e.g. the proxy) use during the --base-url run, "
        "reported as server CPU per request; repeatable (one per worker)",
    )
    g.add_argument(
        "--max-error-rate",
        type=float,
        default=env("max-error-rate", "0"),
        metavar="F",
        help="exit 1 when a run's failed share exceeds F (default 0)",
    )
    g.add_argument(
        "--no-progress",
        action="store_true",
        default=env_flag("no-progress"),
        help="no progress bar on stderr",
    )


def add_report_outputs(g: Any) -> None:
    g.add_argument(
        "--slo",
        default=env("slo"),
        metavar="ttft=S,tpot=S",
        help="goodput SLO in seconds (ms suffix allowed), keys ttft, tpot, e2e",
    )
    g.add_argument(
        "--out-md",
        default=env("out-md"),
        metavar="FILE",
        help="also write the table as Markdown to FILE",
    )
    g.add_argument(
        "--plots",
        default=env("plots"),
        metavar="DIR",
        help="write ttft_cdf.png and itl_cdf.png to DIR",
    )
