"""Every use of the OpenTelemetry SDK's private internals, behind one version guard.

The proxy leans on SDK internals in four places, each worth a measured cost (see
docs/telemetry-overhead.md): the reader's collect callback (pre-aggregated histograms join
every collection), the samplers' fields (compiled samplers), the OTLP/HTTP exporter's client
and limits (spans encoded as they end), and the HTTP transport's result type (a keep-alive
http.client transport). Nothing else in proxy/ touches an SDK name that starts with `_`.

Inside TESTED (the range pyproject.toml pins) the internals are used. Outside it every feature
with a public fallback falls back (samplers asked per span, the SDK's exporter and batch
processor, its requests transport); merging the histograms has none and raises
UnsupportedSDK, which names the range to install.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from opentelemetry.sdk.metrics.export import MetricReader, MetricsData
from opentelemetry.sdk.trace import sampling

log = logging.getLogger("warmroute.telemetry")

# (distribution, lowest tested release, first release not tested): each is pinned to its
# range in pyproject.toml (tests/test_telemetry_sdk_bridge.py checks), and a range widens only
# after the telemetry tests have run on the new release.
TESTED: tuple[tuple[str, tuple[int, int], tuple[int, int]], ...] = (
    ("opentelemetry-sdk", (1, 45), (1, 46)),
    ("opentelemetry-exporter-otlp-proto-http", (1, 45), (1, 46)),
    ("opentelemetry-exporter-http-transport", (0, 66), (0, 67)),
)


class UnsupportedSDK(RuntimeError):
    """The installed OpenTelemetry SDK is outside the range warmroute is tested against."""


def _release(dist: str) -> tuple[int, int] | None:
    """(major, minor) of an installed distribution: "0.66b2" -> (0, 66)."""
    try:
        match = re.match(r"(\d+)\.(\d+)", version(dist))
    except PackageNotFoundError:
        return None
    return None if match is None else (int(match[1]), int(match[2]))


def _check() -> dict[str, bool]:
    supported = {}
    for dist, low, below in TESTED:
        release = _release(dist)
        supported[dist] = release is not None and low <= release < below
    return supported


# dist -> installed within TESTED (absent counts as outside). Tests change it to check the
# fallbacks.
supported = _check()
_warned: set[str] = set()


def _untested(dist: str, what: str) -> bool:
    """True (after one warning per distribution) when `dist` is outside TESTED."""
    if supported.get(dist, False):
        return False
    if dist not in _warned:
        _warned.add(dist)
        log.warning("%s is outside the tested range (%s): %s", dist, install_hint(), what)
    return True


def install_hint() -> str:
    """The pip requirement that brings every distribution into TESTED."""
    return " ".join(
        f"'{dist}>={low[0]}.{low[1]},<{below[0]}.{below[1]}'" for dist, low, below in TESTED
    )


# -- metric readers ---------------------------------------------------------------------------
def wrap_collect(
    reader: MetricReader, wrap: Callable[[MetricsData | None], MetricsData | None]
) -> None:
    """Have every collection of `reader` pass through `wrap`.

    The SDK sets the reader's collect callback when the reader joins a MeterProvider; call this
    after the provider is built. tests/test_telemetry.py checks that the histograms arrive.
    """
    if not supported.get("opentelemetry-sdk", False):
        raise UnsupportedSDK(
            "warmroute's histograms join the SDK's metric collection through SDK internals, "
            f"tested with {install_hint()}; install those versions"
        )
    inner: Callable[..., Any] | None = reader._collect
    if inner is None:
        return

    def collect(r: MetricReader, timeout_millis: float = 10_000) -> Any:
        return wrap(inner(r, timeout_millis=timeout_millis))

    reader._set_collect_callback(collect)


# -- samplers ---------------------------------------------------------------------------------
def static_decision(sampler: sampling.StaticSampler) -> sampling.Decision | None:
    """What an ALWAYS_ON/ALWAYS_OFF sampler decides; None: ask it."""
    if _untested("opentelemetry-sdk", "samplers are asked per span (slower)"):
        return None
    decision: sampling.Decision = sampler._decision
    return decision


def parent_based_delegates(sampler: sampling.ParentBased) -> tuple[sampling.Sampler, ...] | None:
    """(root, remote sampled, remote not sampled, local sampled, local not sampled)."""
    if _untested("opentelemetry-sdk", "samplers are asked per span (slower)"):
        return None
    return (
        sampler._root,
        sampler._remote_parent_sampled,
        sampler._remote_parent_not_sampled,
        sampler._local_parent_sampled,
        sampler._local_parent_not_sampled,
    )


# -- the OTLP/HTTP span exporter ---------------------------------------------------------------
_HTTP = "opentelemetry-exporter-otlp-proto-http"


def exporter_client(exporter: Any) -> Any:
    """The exporter's HTTP client (endpoint, headers, compression, retries), or None: then the
    SDK exporter is used as it is."""
    if _untested(_HTTP, "spans go through the SDK's encoder and batch processor (slower)"):
        return None
    return getattr(exporter, "_client", None)


def exporter_shut_down(exporter: Any) -> bool:
    return bool(getattr(exporter, "_shutdown", False))


def request_size_limit(exporter: Any) -> int | None:
    """The exporter's largest request in bytes; None or 0: no limit."""
    limit: int | None = getattr(exporter, "_max_request_size", None)
    return limit


def replace_transport(exporter: Any, make: Callable[[], Any]) -> bool:
    """Put make() under the exporter's HTTP client in place of its requests transport (which
    is closed); False, leaving it, where the client has no transport or make() cannot run."""
    client = exporter_client(exporter)
    old = getattr(client, "_transport", None)
    if old is None or _untested(
        "opentelemetry-exporter-http-transport", "spans keep the SDK's requests transport"
    ):
        return False
    try:
        client._transport = make()
    except ImportError:
        return False
    old.close()
    return True


def exporter_endpoint(exporter: Any) -> str | None:
    endpoint = getattr(exporter, "_endpoint", None)
    return endpoint if isinstance(endpoint, str) else None


def http_result_base() -> type:
    """The transport interface's result class (ImportError: a release without it)."""
    from opentelemetry.exporter.http.transport._base import BaseHTTPResult

    return BaseHTTPResult
