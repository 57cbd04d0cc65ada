"""Real llama.cpp `llama-server` instances on loopback for tests.

The binary comes from deploy/llamacpp/build.sh (cached by version) and the model from
deploy/llamacpp/make_model.py (tiny, random, deterministic). Neither is built from here:
building takes minutes, so tests that need the engine skip with a clear reason when the
binary is missing, unless WARMROUTE_TEST_REQUIRE_LLAMACPP is set (CI sets it after running
build.sh), in which case a missing engine is a failure rather than a silent skip.

    from tests.llamacpp import llamacpp_engine, running_servers

    def test_x(llamacpp_engine):
        with running_servers(llamacpp_engine, 2) as (a, b):
            ...
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support import free_port

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy" / "llamacpp"
LLAMACPP_VERSION = os.environ.get("LLAMACPP_VERSION", "11434.0.0")
REQUIRE_ENV = "WARMROUTE_TEST_REQUIRE_LLAMACPP"
BINARY_ENV = "WARMROUTE_TEST_LLAMA_SERVER"  # an explicit binary path instead of the cache

# Total context across slots; --parallel 2 gives each slot 4096 tokens, enough for the
# ~1.6k-token prompts the prefix-cache tests use.
DEFAULT_CTX = 8192
DEFAULT_PARALLEL = 2


def cache_prefix() -> Path:
    root = Path(os.environ.get("WARMROUTE_CACHE") or Path.home() / ".cache" / "warmroute")
    return root / "llama.cpp" / LLAMACPP_VERSION


def binary_path() -> Path:
    explicit = os.environ.get(BINARY_ENV)
    return Path(explicit) if explicit else cache_prefix() / "bin" / "llama-server"


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _unavailable(reason: str) -> None:
    """Skip locally; fail in CI, where the engine is supposed to have been built."""
    if required():
        pytest.fail(f"{reason} ({REQUIRE_ENV} is set, so this is a failure)", pytrace=False)
    pytest.skip(f"{reason}; run deploy/llamacpp/build.sh, or set {REQUIRE_ENV}=1 to fail instead")


def _load_make_model() -> Any:
    # deploy/ is not a package; load the script by path (registered first, as dataclasses
    # look their module up in sys.modules while the class body runs).
    name = "warmroute_make_model"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, DEPLOY / "make_model.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Engine:
    binary: Path
    model: Path


def find_engine() -> Engine:
    """The built binary and the tiny model (written on first use), or skip/fail."""
    binary = binary_path()
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        _unavailable(f"llama-server not built at {binary}")
    try:
        import gguf  # noqa: F401
    except ImportError:
        _unavailable("the 'gguf' package is not installed (pip install gguf)")
    # Written once and cached; a few seconds the first time, free afterwards.
    model = _load_make_model().ensure_model()
    return Engine(binary, Path(model))


@pytest.fixture(scope="session")
def llamacpp_engine() -> Engine:
    return find_engine()


@dataclass
class LlamaServer:
    """One llama-server process on 127.0.0.1; `url` is its base URL (no /v1)."""

    engine: Engine
    alias: str = "tiny"
    ctx: int = DEFAULT_CTX
    parallel: int = DEFAULT_PARALLEL
    threads: int = 1
    extra_args: Sequence[str] = ()
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    _log: Any = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [
            str(self.engine.binary),
            "-m", str(self.engine.model),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "-a", self.alias,
            "-c", str(self.ctx),
            "--parallel", str(self.parallel),
            # One thread per instance: tests run two or three on a 2-core machine, and
            # oversubscribing makes every timing meaningless.
            "-t", str(self.threads),
            "--metrics",
            "--no-webui",
            # No host-RAM prompt cache: "cached" must mean "in this instance's slots", which
            # is the state prefix-aware routing reasons about.
            "--cache-ram", "0",
            *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout: float = 30.0) -> LlamaServer:
        for _attempt in range(3):  # free_port() can race with another process; retry
            self.port = free_port()
            fd, name = tempfile.mkstemp(prefix=f"llama-server-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
            self._log = open(self.log_path, "wb")  # closed in stop(): lives with the process
            self.proc = subprocess.Popen(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # so stop() signals exactly this process, no one else
            )
            _LIVE.add(self)
            if self._wait_healthy(timeout):
                return self
            bind_failed = "bind" in self.log_tail().lower()
            self.stop()
            if not bind_failed:
                break
        raise RuntimeError(f"llama-server did not become healthy:\n{self.log_tail()}")

    def _wait_healthy(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1.0) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # 503 while the model loads, refused before the socket is bound
            time.sleep(0.05)
        return False

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.log_path is not None and not os.environ.get("WARMROUTE_TEST_KEEP_LLAMA_LOGS"):
            self.log_path.unlink(missing_ok=True)

    def __hash__(self) -> int:
        return id(self)

    # -- small synchronous HTTP helpers (stdlib, so they work with or without the proxy) --

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return str(r.read().decode())

    def metrics(self) -> dict[str, float]:
        return parse_prometheus(self.get("/metrics"))


_LIVE: set[LlamaServer] = set()


@atexit.register
def _stop_leftovers() -> None:
    # A test that crashes past its finally must not leave engines eating the shared CPUs.
    for server in list(_LIVE):
        server.stop()


@contextlib.contextmanager
def running_servers(engine: Engine, n: int = 2, **kwargs: Any) -> Iterator[list[LlamaServer]]:
    servers: list[LlamaServer] = []
    try:
        for _ in range(n):
            servers.append(LlamaServer(engine, **kwargs).start())
        yield servers
    finally:
        for server in servers:
            server.stop()


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels} value` lines to {name: value}; llama.cpp's metrics carry no labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name.split("{", 1)[0]] = float(value)
        except ValueError:
            continue
    return out


# -- prompts and streaming measurements shared by the engine and end-to-end tests --


def long_system_prompt(tag: str | None = None, words: int = 850) -> str:
    """A system prompt of ~1.9 tokens per word with this tokenizer (850 words: ~1.6k tokens).

    The tag (default: a random nonce) goes first, so two prompts with different tags share
    only the chat template's opening tokens and a test never inherits another's warm cache.
    """
    tag = tag or uuid.uuid4().hex
    vocab = (
        "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
        "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
    ).split()
    body = " ".join(vocab[(i * 7 + len(tag)) % len(vocab)] for i in range(words))
    return f"[{tag}] You are a test assistant. {body}"


@dataclass
class StreamResult:
    ttft: float  # seconds from sending the request to the first content-bearing chunk
    chunks: list[dict[str, Any]]
    text: str
    usage: dict[str, Any] | None
    timings: dict[str, Any] | None
    headers: dict[str, str] = field(default_factory=dict)  # lower-cased names


def stream_chat(
    base_url: str,
    messages: list[dict[str, Any]],
    max_tokens: int = 4,
    model: str = "tiny",
    **extra: Any,
) -> StreamResult:
    """Stream a chat completion with the stdlib client and timestamp the first content chunk.

    Deliberately independent of the proxy's own meter and of the openai client, so it can
    serve as the referee's stopwatch.
    """
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # random weights may emit EOS at once; we want exact lengths
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    req = urllib.request.Request(
        base_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    chunks: list[dict[str, Any]] = []
    text: list[str] = []
    ttft = -1.0
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as resp:
        headers = {k.lower(): v for k, v in resp.headers.items()}
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            chunks.append(chunk)
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if ttft < 0:
                        ttft = time.perf_counter() - t0
                    text.append(content)
    usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    timings = next((c["timings"] for c in reversed(chunks) if c.get("timings")), None)
    return StreamResult(ttft, chunks, "".join(text), usage, timings, headers)
