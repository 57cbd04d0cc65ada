"""Which engine a backend runs, said in its URL or read off its /metrics.

Two ways to say it without a YAML file, for `--backend` and `WARMROUTE_BACKENDS`:

    http://10.0.0.5:8000#engine=vllm
    http://10.0.0.6:8000#engine=sglang,role=prefill,name=gpu-6,weight=2,bootstrap_port=8998

The fragment (after `#`, never sent to the backend) holds `key=value` options of the backend,
comma-separated; in WARMROUTE_BACKENDS a comma followed by a new `http(s)://` starts the next
backend. A backend whose engine is not said (`engine: auto`, the default) is identified from the
metric names on its GET /metrics: `vllm:`, `sglang:` or `llamacpp:` names mean that engine (and
its queue and KV gauges are scraped from then on); a server without them is `openai`.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import httpx

log = logging.getLogger("warmroute.backends")

# The metric-name prefix each engine publishes, in the order they are tried.
METRIC_PREFIXES = (("vllm:", "vllm"), ("sglang:", "sglang"), ("llamacpp:", "llamacpp"))
URL_OPTIONS = ("engine", "role", "name", "weight", "bootstrap_port")
_NEXT_URL = re.compile(r",\s*(?=https?://)", re.I)


class _Backend(Protocol):
    """What detect() reads of a backend's config (proxy.config.BackendConfig, which imports
    this module: named structurally to keep the import one-way)."""

    @property
    def url(self) -> str: ...
    @property
    def key(self) -> str: ...
    def model_copy(self: _B, *, update: dict[str, Any] | None = None, deep: bool = False) -> _B: ...


_B = TypeVar("_B", bound=_Backend)


def split_backend_list(value: str) -> list[str]:
    """WARMROUTE_BACKENDS: URLs separated by commas, each possibly with `#options`.

    Old form `url1,url2` and new form `url1#engine=vllm,role=prefill,url2` both split on a
    comma that begins another http(s) URL; a comma inside a URL's options stays with it.
    """
    if "#" not in value:
        return [u.strip() for u in value.split(",") if u.strip()]
    return [u.strip() for u in _NEXT_URL.split(value) if u.strip().strip(",")]


def parse_backend_url(url: str) -> dict[str, Any]:
    """`http://h:8000#engine=vllm,role=prefill` -> {"url": "http://h:8000", "engine": ...}.

    Raises ValueError naming the option that is not one of URL_OPTIONS or has no value, or a
    `bootstrap_port` that is not a port number.
    """
    base, sep, fragment = url.partition("#")
    out: dict[str, Any] = {"url": base}
    if not sep:
        return out
    for item in fragment.split(","):
        if not item.strip():
            continue
        key, eq, value = (s.strip() for s in item.partition("="))
        if key not in URL_OPTIONS or not eq or not value:
            raise ValueError(
                f"{url!r}: after '#' write options as key=value separated by commas, with keys "
                f"{', '.join(URL_OPTIONS)} (e.g. http://10.0.0.5:8000#engine=vllm,role=prefill); "
                f"got {item.strip()!r}"
            )
        out[key] = _port(url, value) if key == "bootstrap_port" else value
    return out


def _port(url: str, value: str) -> int:
    """An SGLang prefill engine's bootstrap port as written in a URL's options."""
    port = int(value) if value.isascii() and value.isdigit() and len(value) < 6 else 0
    if not 1 <= port <= 65535:
        raise ValueError(
            f"{url!r}: bootstrap_port is the SGLang prefill engine's "
            f"--disaggregation-bootstrap-port, a number from 1 to 65535; got {value!r}"
        )
    return port


def backend_url(base: str, path: str) -> str:
    """The URL of `path` (an API path, which may carry a query) on the backend at `base`.

    `base` may have a path prefix and a query (`http://h:8000/llm?token=X`: a gateway's): the
    prefix goes before `path` and the query after it, merged with `path`'s own
    (`http://h:8000/llm/v1/models?token=X`). A trailing `/v1` before a query is dropped as
    BackendConfig drops it from a URL without one.
    """
    parts = urlsplit(base)
    if not parts.query:
        return base.rstrip("/") + path
    path, _, own = path.partition("?")
    prefix = parts.path.rstrip("/").removesuffix("/v1")
    query = f"{own}&{parts.query}" if own else parts.query
    return f"{parts.scheme}://{parts.netloc}{prefix}{path}?{query}"


def engine_from_metrics(text: str) -> str | None:
    """The engine whose metric names appear in a Prometheus exposition, or None."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for prefix, engine in METRIC_PREFIXES:
            if line.startswith(prefix):
                return engine
    return None


async def detect(http: httpx.AsyncClient, cfg: _B, headers: dict[str, str], timeout_s: float) -> _B:
    """`cfg` with `engine: auto` resolved from the backend's /metrics.

    A server that answers without engine metrics (or 404s) is `openai`; one that cannot be
    reached or answers 5xx stays `auto` and is asked again at the next scrape.
    """
    try:
        r = await http.get(backend_url(cfg.url, "/metrics"), headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        log.debug("backend %s: /metrics unreachable, engine still unknown: %s", cfg.key, e)
        return cfg
    if r.status_code >= 500:  # starting up (loading the model), or failing: ask again later
        return cfg
    engine = engine_from_metrics(r.text) if r.status_code == 200 else None
    if engine is None:
        log.info(
            "backend %s: no engine metrics on /metrics (HTTP %d); treating it as a plain "
            "OpenAI-compatible server (say `#engine=...` or engine: to override)",
            cfg.key,
            r.status_code,
        )
    else:
        log.info("backend %s: engine %s, detected from its /metrics", cfg.key, engine)
    return cfg.model_copy(update={"engine": engine or "openai"})
