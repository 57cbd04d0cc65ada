"""`warmroute serve`: run the proxy under uvicorn (uvloop + httptools when available)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import errno
import functools
import inspect
import json
import logging
import os
import signal
import socket
import sys
from typing import Any, cast

import uvicorn

from proxy import hot_path
from proxy.config import Config, ConfigError, load_config, telemetry_sources
from proxy.edge.limits import (
    LimitedHttpToolsProtocol,
    default_max_connections,
    raise_open_file_limit,
)
from proxy.heap import freeze_startup_heap
from proxy.redact import install_safe_formatter, redacted_config

CONFIG_ENV = "_WARMROUTE_SERVE_CONFIG"  # hands the validated config to worker processes
RELOAD_ENV = "_WARMROUTE_SERVE_RELOAD"  # and how to read it again (file and flags), for SIGHUP

EPILOG = """\
examples:
  # the simplest start: one OpenAI-compatible backend
  warmroute serve --backend http://127.0.0.1:8000

  # two vLLM servers, prefix-aware routing state shared through Redis
  warmroute serve --backend http://10.0.0.5:8000 --backend http://10.0.0.6:8000 \\
      --policy least_inflight --redis redis://127.0.0.1:6379/0

  # everything from a file (see deploy/warmroute.example.yaml), port from the environment
  WARMROUTE_PORT=9000 warmroute serve --config warmroute.yaml

Every option can also be set as an environment variable: WARMROUTE_<OPTION> (e.g.
WARMROUTE_BACKENDS=url1,url2, WARMROUTE_POLICY=round_robin), and nested config keys as
WARMROUTE_<SECTION>__<KEY> (e.g. WARMROUTE_TIMEOUTS__IDLE_S=30). Precedence: config file <
environment < flags. Then point any OpenAI client at http://HOST:PORT/v1.
"""


class NoDelayHttpToolsProtocol(LimitedHttpToolsProtocol):
    """Sets TCP_NODELAY on every client connection explicitly (and enforces the limits on
    client connections: proxy/edge/limits.py).

    Without it the first SSE chunk can wait ~40 ms for a delayed ACK (measured on a Rust
    router here); the event loops usually set it, but this must not depend on the loop.
    """

    def connection_made(self, transport: Any) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head_with_body = HeadWithBodyTransport(transport, self.loop)
        super().connection_made(cast(asyncio.Transport, head_with_body))


class HeadWithBodyTransport:
    """The client connection's transport, sending a response head together with its body.

    uvicorn writes the status line and headers the moment the app sends
    http.response.start, and the body in a second write: two syscalls and, with
    TCP_NODELAY, two segments and two client wakeups before the client has its first chunk.
    The forwarder sends the first body bytes right after the start message, in the same step
    of its task, so the head is held only until then and goes out with them in one write.
    Should nothing follow at once, it goes out alone at the end of this event loop turn.
    Everything else is the wrapped transport's.
    """

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: Any, loop: Any) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 1"):
            self._held = data  # a response head (not an interim 1xx): wait for its body
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():
                self._transport.write(held)

    @property
    def direct_write(self) -> Any:
        """The wrapped transport's `write` once no head is held (None while one is): what
        proxy.asgi.body_writer writes a stream's later parts with, past this wrapper."""
        return self._transport.write if self._held is None else None

    def close(self) -> None:
        self.flush()
        self._transport.close()

    # What is asked of every connection or request, without the failed lookup before
    # __getattr__ (an AttributeError made and dropped: ~2,000 instructions)
    def is_closing(self) -> bool:
        return bool(self._transport.is_closing())

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML config file (env: WARMROUTE_CONFIG)")
    p.add_argument(
        "--backend",
        dest="backends",
        action="append",
        metavar="URL",
        help="backend base URL, repeatable, with options after '#': engine, role, name, weight, "
        "bootstrap_port (e.g. 'http://10.0.0.6:30000#engine=sglang,role=prefill,"
        "bootstrap_port=8998'; env: WARMROUTE_BACKENDS=url1,url2)",
    )
    p.add_argument(
        "--policy",
        help="routing policy: prefix_aware (the default: a warm prefix cache, weighed against "
        "load), round_robin, least_inflight, session (env: WARMROUTE_POLICY)",
    )
    p.add_argument(
        "--redis",
        metavar="URL",
        help="Redis URL for shared routing state (env: WARMROUTE_REDIS_URL)",
    )


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run the proxy in front of your backends",
        description="Run warmroute as an OpenAI-compatible proxy in front of LLM backends.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", help="address to listen on (default 127.0.0.1; env: WARMROUTE_HOST)")
    p.add_argument("--port", type=int, help="port to listen on (default 8080; env: WARMROUTE_PORT)")
    add_common_args(p)
    p.add_argument(
        "--workers", type=int, help="worker processes (default 1; env: WARMROUTE_WORKERS)"
    )
    p.add_argument(
        "--log-level",
        type=str.lower,  # --log-level DEBUG as well
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default info; env: WARMROUTE_LOG_LEVEL)",
    )
    p.add_argument(
        "--debug-headers",
        action="store_true",
        default=None,
        help="add x-warmroute-route (the routing decision) to every response",
    )
    p.add_argument(
        "--disagg",
        choices=["off", "on", "auto"],
        help="prefill/decode disaggregation: off (default), on, or auto (decided from measured "
        "traffic; docs/disaggregation.md; env: WARMROUTE_DISAGG__MODE)",
    )
    p.add_argument(
        "--admin-port",
        type=int,
        help="serve /admin/* on this port, on --admin-host (default: /admin is not served; "
        "the serving port itself puts it there; env: WARMROUTE_ADMIN_PORT)",
    )
    p.add_argument(
        "--admin-host",
        help="address of the admin listener (default 127.0.0.1; env: WARMROUTE_ADMIN_HOST)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        help="client connections open at once; more get 503 (default: half the open-file "
        "limit; env: WARMROUTE_MAX_CONNECTIONS)",
    )
    p.add_argument(
        "--max-inflight",
        type=int,
        help="requests worked on at once before a short queue, then 503 + Retry-After "
        "(default 4096; env: WARMROUTE_MAX_INFLIGHT)",
    )
    p.add_argument(
        "--check", action="store_true", help="validate the configuration, print it, and exit"
    )
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> Config:
    return load_config(args.config, serve_flags(args))


def serve_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {
        k: getattr(args, k, None)
        for k in (
            "host",
            "port",
            "backends",
            "policy",
            "redis",
            "workers",
            "log_level",
            "debug_headers",
            "admin_port",
            "admin_host",
            "max_connections",
            "max_inflight",
            "disagg",
        )
    }


def setup_logging(level: str) -> None:
    # Credentials in URLs masked and control characters escaped in every message (uvicorn's
    # too: log_config=None sends its records here), proxy/redact.py.
    install_safe_formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", level)
    if level != "debug":
        # httpx logs every request at INFO: each health check and metrics scrape of every
        # backend, every few seconds. Changes of a backend's state are logged by warmroute.
        logging.getLogger("httpx").setLevel(logging.WARNING)


class PortTaken(Exception):
    """The address to listen on is in use or not ours to take; the message says which."""


# How the serving listener and the admin listener are chosen: (port option, its variable,
# address option), for the hint when one cannot be had.
SERVING = ("--port", "WARMROUTE_PORT", "--host")
ADMIN = ("--admin-port", "WARMROUTE_ADMIN_PORT", "--admin-host")


def listen_socket(host: str, port: int, options: tuple[str, str, str] = SERVING) -> socket.socket:
    """The server's listening socket, bound before the app starts: a port in use is one clean
    error, not a started proxy that logs it is ready and then exits. `options` name what
    chose the address (SERVING or ADMIN), for the hint."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        port_option, port_env, host_option = options
        hint = (
            "another process listens there (another warmroute?); stop it, or pick another "
            f"port with {port_option} or {port_env}"
            if e.errno == errno.EADDRINUSE
            else f"check {host_option} (an address of this machine) and {port_option}"
        )
        raise PortTaken(f"cannot listen on {host}:{port}: {e.strerror}; {hint}") from None
    sock.set_inheritable(True)  # worker processes serve on it
    return sock


def admin_sockets(config: Config) -> list[socket.socket]:
    """The admin listener's socket, when server.admin_port names a port of its own."""
    s = config.server
    if s.admin_port is None or s.admin_port == s.port:
        return []
    return [listen_socket(s.admin_host, s.admin_port, ADMIN)]


def app_factory() -> Any:
    """Entry point for uvicorn worker processes (--workers N)."""
    from proxy.server.app import create_app

    config = Config.model_validate_json(os.environ[CONFIG_ENV])
    setup_logging(config.server.log_level)
    file, flags = json.loads(os.environ[RELOAD_ENV])
    app = create_app(config, reload=functools.partial(load_config, file, flags), config_path=file)
    freeze_startup_heap()
    return_freed_memory()
    return app


# glibc serves allocations this large or larger with their own mmap, so freeing one returns
# it to the system. Its default threshold starts here too but rises to the largest block freed
# (up to 32 MiB): after one large answer, later ones are carved out of the heap and the
# process keeps its peak for ever. Fixed, a soak of hostile backends' large answers went back
# to ~76 MB after peaks of ~350 MB instead of staying at the peak. The per-chunk path
# allocates far less than this.
MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold (MMAP_THRESHOLD) unless MALLOC_MMAP_THRESHOLD_ already says
    one; False where the C library is not glibc."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # musl and the like
        return False


def uvicorn_config(config: Config, app: Any, **overrides: Any) -> uvicorn.Config:
    kwargs: dict[str, Any] = {
        "host": config.server.host,
        "port": config.server.port,
        "http": NoDelayHttpToolsProtocol,
        "loop": "uvloop" if _has("uvloop") else "asyncio",
        "log_level": config.server.log_level,
        "access_log": False,
        "proxy_headers": False,  # X-Forwarded-* rewriting costs CPU per request; unused here
        "server_header": False,  # no `server: uvicorn`: what runs behind the port is not news
        "timeout_graceful_shutdown": config.server.shutdown_grace_s,
        "timeout_keep_alive": config.server.keepalive_timeout_s,
        "log_config": None,  # uvicorn's records go through setup_logging's formatter
        "lifespan": "on",
    }
    kwargs.update(overrides)
    return uvicorn.Config(app, **kwargs)


def supervisor_class() -> Any:
    """uvicorn's worker supervisor, but SIGHUP re-reads the fleet in every worker instead of
    replacing the workers (which would cut their streams and forget what they learned)."""
    from uvicorn.supervisors import Multiprocess

    class FleetReloadingSupervisor(Multiprocess):
        def handle_hup(self) -> None:
            logging.getLogger("warmroute").info(
                "SIGHUP: re-reading the config's backends in %d worker(s)", len(self.processes)
            )
            for p in self.processes:
                if p.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGHUP)

    return FleetReloadingSupervisor


def hot_path_line() -> str:
    """Which per-chunk hot path runs (proxy.HOT_PATH): the compiled one, or pure Python."""
    impl = hot_path()
    if impl["implementation"] == "compiled":
        return "hot path: compiled (mypyc; the meter's event scans in C)"
    return f"hot path: pure Python ({impl['why']})"


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        from proxy.server.app import check_config, create_app
        from proxy.telemetry.effective import effective_telemetry, telemetry_line

        check_config(config)
        file = args.config or os.environ.get("WARMROUTE_CONFIG")
        flags = serve_flags(args)
        settings = effective_telemetry(config.telemetry, telemetry_sources(file, flags))
        if args.check:
            dump = {**config.model_dump(mode="json"), "effective_telemetry": settings}
            print(json.dumps(redacted_config(dump), indent=2))
            return 0
        setup_logging(config.server.log_level)
        # Before the app exists: its default server.max_connections is half the limit, and
        # worker processes inherit it.
        before, after = raise_open_file_limit()
        if after != before:
            logging.getLogger("warmroute").debug(
                "open-file limit raised from %d to %d", before, after
            )
        # SIGHUP re-reads the same file with the same flags (proxy/fleet/reload.py).
        if config.server.workers > 1:
            os.environ[CONFIG_ENV] = config.model_dump_json()
            os.environ[RELOAD_ENV] = json.dumps([file, flags])
            server_config = uvicorn_config(
                config,
                "proxy.server.serve:app_factory",
                factory=True,
                workers=config.server.workers,
            )
        else:
            reload = functools.partial(load_config, file, flags)
            app = create_app(config, reload=reload, config_path=file)
            server_config = uvicorn_config(config, app)
            freeze_startup_heap()
            return_freed_memory()
        sock = listen_socket(config.server.host, config.server.port)
        sockets = [sock, *admin_sockets(config)]
    except ConfigError as e:
        print(f"warmroute: {e}", file=sys.stderr)
        return 2
    except PortTaken as e:
        print(f"warmroute: {e}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    cap = config.server.max_connections or default_max_connections()
    logging.getLogger("warmroute").info(
        "listening on %s (OpenAI base URL %s/v1); at most %d client connections%s",
        url,
        url,
        cap,
        "" if config.server.max_connections else " (half the open-file limit, less a reserve)",
    )
    if len(sockets) > 1:
        logging.getLogger("warmroute").info(
            "admin on http://%s:%d/admin", config.server.admin_host, config.server.admin_port
        )
    # After the sockets: a start that fails (a port in use) says so in one line, alone.
    logging.getLogger("warmroute").info("%s", telemetry_line(config.telemetry, settings))
    logging.getLogger("warmroute").info("%s", hot_path_line())
    if config.server.workers > 1:
        supervisor = supervisor_class()
        if "target" in inspect.signature(supervisor.__init__).parameters:  # uvicorn < 0.36
            supervisor(
                server_config, target=uvicorn.Server(server_config).run, sockets=sockets
            ).run()
        else:  # the supervisor builds each worker's Server itself
            supervisor(server_config, sockets=sockets).run()
        return 0
    server = uvicorn.Server(server_config)
    server.run(sockets=sockets)
    return 0 if server.started else 1
