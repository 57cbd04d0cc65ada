"""`warmroute doctor --url http://proxy:8080`: the proxy's diagnosis, read from GET
/admin/doctor and printed as a table per backend (or as the JSON with --json).

/admin/* is off by default (proxy/edge/access.py): the proxy serves it on its admin port
(server.admin_port) or, with an admin token configured, on its serving port to requests that
carry `Authorization: Bearer <token>`; --token (or WARMROUTE_ADMIN_TOKEN) sends that header.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import httpx
import orjson

from proxy.doctor.render import render_text, use_color

TOKEN_ENV = "WARMROUTE_ADMIN_TOKEN"

EPILOG = """\
examples:
  warmroute doctor --url http://127.0.0.1:8081              # the admin port, last 5 minutes
  warmroute doctor --url http://proxy:8080 --token "$T"     # admin token on the serving port
  warmroute doctor --url http://127.0.0.1:8081 --window-s 60 --json | jq '.findings[].id'

The proxy serves /admin/doctor only where admin access is on: start it with an admin port
(`warmroute serve --admin-port 8081`, server.admin_port) or an admin token
(server.admin_token_sha256: the SHA-256 of the token, `printf %s "$T" | sha256sum`), and pass
that token with --token or WARMROUTE_ADMIN_TOKEN.

Each finding has a stable id (kv_pressure, queueing, prefill_bound_ttft, cache_affinity_lost,
prefill_interference, long_context_itl, decode_below_ceiling, decode_at_ceiling), a severity,
the numbers that show it and the change to make; docs/doctor.md explains each one and its
threshold. The same findings are the metric warmroute.doctor.findings at /metrics.
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="why is the first token slow? a running proxy's diagnosis, per backend",
        description="Ask a running warmroute proxy for its diagnosis of the traffic it "
        "served: TTFT split into queueing and prefill, cache hits predicted and reported, ITL "
        "beside long prefills, decode against the bandwidth ceiling, with what to change.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--url",
        default="http://127.0.0.1:8080",
        help="the proxy's admin port, or its serving port with --token "
        "(default http://127.0.0.1:8080)",
    )
    p.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV) or None,
        help=f"the admin token, sent as Authorization: Bearer (env: {TOKEN_ENV})",
    )
    p.add_argument(
        "--window-s", type=float, help="judge the last N seconds (default: the proxy's 300)"
    )
    p.add_argument("--json", action="store_true", help="print the report's JSON")
    p.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="colours: on a terminal only (auto, the default), always or never",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the proxy")
    p.set_defaults(func=run)


ENABLE_ADMIN = (
    "admin access is off unless the proxy has an admin port (warmroute serve --admin-port "
    "PORT, or server.admin_port: point --url at that port) or an admin token "
    "(server.admin_token_sha256: pass the token with --token or " + TOKEN_ENV + "); "
    "docs/doctor.md"
)


def fetch(
    url: str, window_s: float | None = None, timeout: float = 30.0, token: str | None = None
) -> dict[str, Any]:
    """GET {url}/admin/doctor; raises RuntimeError with a sentence on any failure."""
    base = url.rstrip("/")
    params = {"window_s": f"{window_s:g}"} if window_s is not None else None
    headers = {"authorization": f"Bearer {token}"} if token else None
    try:
        r = httpx.get(base + "/admin/doctor", params=params, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise RuntimeError(
            f"could not reach the proxy at {base} ({type(e).__name__}: {e}); is "
            "`warmroute serve` running there?"
        ) from None
    if r.status_code == 404:
        raise RuntimeError(f"{base} does not serve /admin/doctor: {ENABLE_ADMIN}")
    if r.status_code == 401:
        what = "was refused" if token else "needs the admin token"
        raise RuntimeError(
            f"{base}/admin/doctor {what}: pass the token whose SHA-256 is the proxy's "
            f"server.admin_token_sha256 with --token or {TOKEN_ENV}"
        )
    if r.status_code != 200:
        raise RuntimeError(f"{base}/admin/doctor answered HTTP {r.status_code}: {r.text[:300]}")
    try:
        data = orjson.loads(r.content)
    except orjson.JSONDecodeError:
        raise RuntimeError(f"{base}/admin/doctor did not answer JSON") from None
    if not isinstance(data, dict):
        raise RuntimeError(f"{base}/admin/doctor answered an unexpected document")
    return data


def run(args: argparse.Namespace) -> int:
    if args.window_s is not None and not args.window_s > 0:
        print("warmroute doctor: --window-s must be above 0", file=sys.stderr)
        return 2
    try:
        report = fetch(args.url, args.window_s, args.timeout, args.token)
    except RuntimeError as e:
        print(f"warmroute doctor: {e}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        color = use_color(sys.stdout, args.color)
        sys.stdout.write(render_text(report, color=color, source=args.url))
    return 0
