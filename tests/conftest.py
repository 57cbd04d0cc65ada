from __future__ import annotations

import contextlib
import functools
import os
import ssl
from collections.abc import Callable, Iterator
from typing import Any

import httpx._transports.default as httpx_transports
import pytest

from proxy.bench.mock import EngineSettings, MockBackend, MockEngine, prompt_directives
from proxy.config import load_config
from proxy.server.app import create_app
from proxy.server.serve import NoDelayHttpToolsProtocol
from tests.support import ServerThread, free_port, stop_servers

_create_ssl_context: Callable[..., ssl.SSLContext] = getattr(
    httpx_transports, "create_ssl_context", ssl.create_default_context
)


@functools.cache
def _default_ssl_context(kwargs: tuple[tuple[str, Any], ...], env: object) -> ssl.SSLContext:
    return _create_ssl_context(**dict(kwargs))


def _shared_default_ssl_context(*args: Any, **kwargs: Any) -> ssl.SSLContext:
    """httpx builds a new SSL context for every client, so for every `httpx.get(...)`: certifi's
    bundle parsed again, ~40 ms of CPU with the GIL held, which also stalls the servers that
    tests run in threads. The tests make hundreds of such calls, nearly all plain HTTP to
    loopback: the default context (verify=True, no client certificate) is built once per set
    of arguments and trust settings, and shared. Any other (a test's own context, verify=False)
    is built for its client, as before."""
    if args or kwargs.get("verify", True) is not True or kwargs.get("cert") is not None:
        return _create_ssl_context(*args, **kwargs)
    env = tuple(os.environ.get(k) for k in ("SSL_CERT_FILE", "SSL_CERT_DIR", "SSLKEYLOGFILE"))
    return _default_ssl_context(tuple(sorted(kwargs.items())), env)


if hasattr(httpx_transports, "create_ssl_context"):  # httpx's own module: no error if it moves
    httpx_transports.create_ssl_context = _shared_default_ssl_context


@pytest.fixture
def fake_backends() -> Iterator[Callable[..., list[tuple[MockBackend, ServerThread]]]]:
    """Start mock backends as real loopback servers: fake_backends(2) -> [(app, server), ...].

    Each answers as its prompt's words ask (proxy.bench.mock.prompt_directives: "fail500",
    "cut:3", "chunks:10", ...) and records what it saw (`app.rec`). `cache_tokens`: an engine
    with a prefix cache of that size (and prefill that costs nothing) reports cached tokens.
    """
    started: list[ServerThread] = []

    def start(
        n: int = 1, models: tuple[str, ...] = ("test-model",), cache_tokens: int = 0
    ) -> list[tuple[MockBackend, ServerThread]]:
        out = []
        for _ in range(n):
            engine = None
            if cache_tokens:
                settings = EngineSettings(cache_tokens, prefill_tokens_per_s=1e12)
                engine = MockEngine(settings)
            app = MockBackend(
                engine,
                chunks=5,
                models=models,
                name=f"b{len(started)}",
                script=prompt_directives,
                record=True,
            )
            server = ServerThread(app).start()
            started.append(server)
            out.append((app, server))
        return out

    yield start
    stop_servers(started)


@pytest.fixture
def proxy_server() -> Iterator[Callable[..., ServerThread]]:
    """Start the real proxy app under uvicorn: proxy_server([url, ...], policy=..., ...)."""
    started: list[ServerThread] = []

    def start(
        backends: list[str], config: dict[str, Any] | None = None, **flags: Any
    ) -> ServerThread:
        port = free_port()
        # /admin on the serving port (a loopback one), as tests read it
        flags = {"port": port, "admin_port": port, **flags}
        cfg = load_config(flags={"backends": backends, **flags}, env={})
        if config:
            cfg = cfg.model_validate(_deep_merge(cfg.model_dump(), config))
        # The production HTTP protocol (TCP_NODELAY, head sent with the first body bytes).
        app = create_app(cfg)
        server = ServerThread(app, port=port, http=NoDelayHttpToolsProtocol).start()
        started.append(server)
        return server

    yield start
    with contextlib.suppress(Exception):
        stop_servers(started)


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


@pytest.fixture
def closed_port_url() -> str:
    """A loopback URL where nothing listens (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"
