"""A bounded soak: streaming load through `warmroute serve` while backends and Redis misbehave.

    python deploy/perf/soak.py                       # 10 minutes
    python deploy/perf/soak.py --duration 60 --json /tmp/soak.json
    python deploy/perf/soak.py --hostile --duration 1800 --json /tmp/soak-hostile.json

Starts a private redis-server, --engines `warmroute sim` processes (each injecting errors,
stalls longer than the proxy's idle timeout and mid-stream disconnects) and one proxy
(prefix_aware, sharing its index through that Redis). Closed-loop `openai` streaming clients
(AsyncOpenAI) run the whole time, plus a few slow clients that read each event late. On a
timeline: one engine is SIGKILLed mid-stream and restarted, Redis is restarted in the middle
and later frozen (SIGSTOP) for a few seconds.

--hostile puts --engines deploy/perf/hostile_backend.py processes in place of the sims: each
answers --good of its requests well and the rest with a seeded hostile fault (huge or over-cap
JSON, multi-MB or 100+-field heads, HTML for a 200, invalid UTF-8 in an event, 429s, error
bodies with a new `type` each, trickled heads/events/bodies, cuts mid-stream; its docstring
lists them and the clean error each must end as). The proxy gets first_byte_s 2 and idle_s 3,
and --json-share of the usual clients' requests are non-streamed. Same timeline and outcomes.

Every request ends as one of:
  ok      a complete stream: a finish_reason, and the usage chunk's completion_tokens equal to
          the token chunks received (nothing silently dropped); non-streamed: a whole answer
  error   a clean OpenAI error (APIStatusError, or APIError from an SSE error event), by cause
  lost    anything else: a cut connection, a JSON error, a truncated stream
  hung    not finished within --deadline seconds
It prints a table (requests, errors by cause, lost, hung, the proxy's RSS and open fds from
/proc at start and end, the engines' open streams at the end) and the proxy's RSS over the run
(sampled every 5 s: a text plot, a PNG with --plot; the slope over each third of the run says
whether it levels off), writes a JSON summary with --json (the series under proxy.rss), and
exits 1 when anything was lost or hung. tests/test_chaos.py reuses the client and
process helpers here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import openai

from proxy.stats import percentile

ROOT = Path(__file__).resolve().parents[2]
MODEL = "sim-8b"


# -- one request, classified ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Outcome:
    kind: str  # ok | error | lost | hung
    cause: str = ""
    tokens: int = 0
    seconds: float = 0.0


def _error_cause(e: openai.APIError) -> str:
    code = e.code or getattr(e, "type", None) or "unknown"
    if isinstance(e, openai.APIStatusError):
        return f"http {e.status_code} {code}"
    return f"stream {code}"  # the proxy's SSE error event, raised by the client


async def stream_chat(
    client: openai.AsyncOpenAI,
    prompt: str | list[dict[str, str]],
    *,
    max_tokens: int,
    deadline_s: float,
    model: str = MODEL,
    read_delay_s: float = 0.0,
    extra_body: dict[str, Any] | None = None,
) -> Outcome:
    """One streamed chat completion, read to its end (each event `read_delay_s` late)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    t0 = time.monotonic()
    tokens = 0

    async def go() -> Outcome:
        nonlocal tokens
        finish = None
        usage = None
        # messages are plain dicts here, not the client's TypedDicts
        stream = await client.chat.completions.create(  # type: ignore[call-overload]
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra_body,
        )
        async with stream:
            async for chunk in stream:
                if chunk.choices:
                    choice = chunk.choices[0]
                    if choice.delta is None or choice.delta.role is None:
                        tokens += 1  # one chunk per token after the role chunk
                    finish = choice.finish_reason or finish
                if chunk.usage is not None:
                    usage = chunk.usage
                if read_delay_s:
                    await asyncio.sleep(read_delay_s)
        if finish is None:
            return Outcome("lost", "truncated: no finish_reason", tokens)
        if usage is None:
            return Outcome("lost", "truncated: no usage chunk", tokens)
        if usage.completion_tokens != tokens:
            why = f"truncated: {tokens} of {usage.completion_tokens} tokens"
            return Outcome("lost", why, tokens)
        return Outcome("ok", "", tokens)

    return await _settle(go(), deadline_s, t0, lambda: tokens)


async def chat_once(
    client: openai.AsyncOpenAI,
    prompt: str | list[dict[str, str]],
    *,
    max_tokens: int,
    deadline_s: float,
    model: str = MODEL,
) -> Outcome:
    """One non-streamed chat completion: ok when it is a whole answer (choices, a
    finish_reason, content, usage)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    t0 = time.monotonic()

    async def go() -> Outcome:
        # messages are plain dicts here, not the client's TypedDicts
        r = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
        )
        if not r.choices or r.choices[0].finish_reason is None or r.usage is None:
            return Outcome("lost", "malformed: no choice, finish_reason or usage")
        if not isinstance(r.choices[0].message.content, str):
            return Outcome("lost", "malformed: no content")
        return Outcome("ok", "", r.usage.completion_tokens)

    return await _settle(go(), deadline_s, t0, lambda: 0)


async def _settle(
    go: Awaitable[Outcome], deadline_s: float, t0: float, tokens: Callable[[], int]
) -> Outcome:
    """A request's outcome, whatever it raised, timed from t0."""
    try:
        out = await asyncio.wait_for(go, deadline_s)
    except TimeoutError:
        out = Outcome("hung", f"not done in {deadline_s:g}s", tokens())
    except openai.APITimeoutError:
        out = Outcome("hung", "client timeout", tokens())
    except openai.APIConnectionError as e:
        out = Outcome("lost", f"connection: {type(e.__cause__ or e).__name__}", tokens())
    except openai.APIError as e:
        out = Outcome("error", _error_cause(e), tokens())
    except Exception as e:  # JSONDecodeError and the like: exactly what must never happen
        out = Outcome("lost", f"{type(e).__name__}: {e}"[:120], tokens())
    return Outcome(out.kind, out.cause, out.tokens, time.monotonic() - t0)


@dataclass
class Tally:
    """Outcomes counted by kind and cause, with every request's duration."""

    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    lost: Counter[str] = field(default_factory=Counter)
    hung: int = 0
    seconds: list[float] = field(default_factory=list)
    slowest: Outcome | None = None

    def add(self, o: Outcome) -> None:
        self.seconds.append(o.seconds)
        if self.slowest is None or o.seconds > self.slowest.seconds:
            self.slowest = o
        if o.kind == "ok":
            self.ok += 1
        elif o.kind == "error":
            self.errors[o.cause] += 1
        elif o.kind == "hung":
            self.hung += 1
        else:
            self.lost[o.cause] += 1

    @property
    def total(self) -> int:
        return len(self.seconds)

    def __add__(self, other: Tally) -> Tally:
        slow = [o for o in (self.slowest, other.slowest) if o is not None]
        return Tally(
            self.ok + other.ok,
            self.errors + other.errors,
            self.lost + other.lost,
            self.hung + other.hung,
            self.seconds + other.seconds,
            max(slow, key=lambda o: o.seconds) if slow else None,
        )

    def as_dict(self) -> dict[str, Any]:
        times = sorted(self.seconds)
        slowest = self.slowest
        return {
            "requests": self.total,
            "ok": self.ok,
            "errors": dict(self.errors.most_common()),
            "lost": dict(self.lost.most_common()),
            "lost_total": sum(self.lost.values()),
            "hung": self.hung,
            "seconds_p50": round(percentile(times, 0.5), 3) if times else None,
            "seconds_p99": round(percentile(times, 0.99), 3) if times else None,
            "slowest": None
            if slowest is None
            else {
                "seconds": round(slowest.seconds, 2),
                "kind": slowest.kind,
                "cause": slowest.cause,
            },
        }


def client_for(url: str, timeout_s: float = 120.0) -> openai.AsyncOpenAI:
    """The official client with its own retries off: every outcome is the proxy's."""
    return openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="soak", max_retries=0, timeout=timeout_s
    )


# -- processes ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _output(log: Path | None) -> IO[bytes]:
    """Where a child writes: its log file, or an anonymous one read back if it fails."""
    return open(log, "ab") if log else tempfile.TemporaryFile()


def _tail(out: IO[bytes] | None) -> str:
    if out is None:
        return ""
    out.flush()
    out.seek(max(0, out.seek(0, os.SEEK_END) - 2000))
    return "; its output ends:\n" + out.read().decode(errors="replace")


def wait_ready(
    url: str,
    proc: subprocess.Popen[bytes] | None = None,
    timeout_s: float = 30,
    output: IO[bytes] | None = None,
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            code = proc.poll() if proc else None
            raise RuntimeError(f"{url} not ready (exit code {code}){_tail(output)}")
        time.sleep(0.05)  # another process: nothing to wait on but its answer


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)  # a frozen one cannot take SIGTERM
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def sim_args(port: int, *, time_scale: float, seed: int, faults: dict[str, float]) -> list[str]:
    """`warmroute sim` on one port; `faults` as --fault-* flags (error_rate=0.02, ...)."""
    args = [
        sys.executable,
        "-m",
        "proxy",
        "sim",
        "--port",
        str(port),
        "--time-scale",
        str(time_scale),
    ]
    args += ["--min-output-tokens", "16", "--max-output-tokens", "256", "--seed", str(seed)]
    for name, value in faults.items():
        args += [f"--fault-{name.replace('_', '-')}", str(value)]
    return args


class Engine:
    """One `warmroute sim` process that can be killed and brought back on its port."""

    def __init__(self, args: list[str], port: int, log: Path | None = None) -> None:
        self.args, self.port, self.log = args, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.out: IO[bytes] | None = None

    def start(self, wait: bool = True) -> Engine:
        self.out = _output(self.log)
        self.proc = subprocess.Popen(self.args, stdout=self.out, stderr=self.out, cwd=ROOT)
        if wait:
            self.wait()
        return self

    def wait(self) -> None:
        wait_ready(self.url + "/health", self.proc, output=self.out)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def _control(self, method: str, path: str, body: Any = None) -> Any:
        # An engine injecting refusals refuses its control connections too: ask again.
        for attempt in range(20):
            try:
                r = httpx.request(method, self.url + path, json=body, timeout=5)
                break
            except httpx.TransportError:
                if attempt == 19:
                    raise
        r.raise_for_status()
        return r.json()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self._control("GET", "/sim/stats")
        out.pop("requests", None)  # the per-request log: not needed here
        return out

    def set_faults(self, **faults: float) -> None:
        self._control("POST", "/sim/faults", faults)

    def close(self) -> None:
        if self.proc is not None:
            stop(self.proc)
        if self.out is not None:
            self.out.close()


class Redis:
    """A private redis-server (never the shared one): killed, frozen, restarted at will."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Redis:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {self.port} did not start")
            time.sleep(0.05)
        return self

    def ping(self) -> bool:
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", self.port), 1) as s,
        ):
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
        return False

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None:
            stop(self.proc)


def serve_args(port: int, backends: Sequence[str], *, policy: str, redis: str | None) -> list[str]:
    args = [sys.executable, "-m", "proxy", "serve", "--port", str(port), "--policy", policy]
    args += ["--log-level", "warning"]
    for b in backends:
        args += ["--backend", b]
    if redis:
        args += ["--redis", redis]
    return args


@contextlib.contextmanager
def proxy_process(
    args: list[str], env: dict[str, str], log: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`warmroute serve` in a child process, ready (/ready) before it is yielded."""
    port = args[args.index("--port") + 1]
    out = _output(log)
    proc = subprocess.Popen(args, stdout=out, stderr=out, cwd=ROOT, env={**os.environ, **env})
    try:
        wait_ready(f"http://127.0.0.1:{port}/ready", proc, output=out)
        yield proc
    finally:
        stop(proc)
        out.close()


def rss_kb(pid: int) -> int:
    """Resident set size of a process, from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _tcp_sockets() -> dict[str, tuple[int, int]]:
    """Socket inode -> (local port, remote port) of every TCP socket on the machine."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                p = line.split()
                out[p[9]] = (int(p[1].rsplit(":", 1)[1], 16), int(p[2].rsplit(":", 1)[1], 16))
    return out


def fd_kinds(pid: int, serving_port: int, peers: dict[str, set[int]]) -> dict[str, int]:
    """A process's open fds by what they are: client connections (on `serving_port`),
    connections to each group of `peers` ports ({"engines": {...}, "redis": {...}}), other."""
    tcp = _tcp_sockets()
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        ports = tcp.get(target[8:-1]) if target.startswith("socket:[") else None
        if ports is None:
            kinds["other"] += 1
        elif ports[0] == serving_port:
            kinds["listener" if ports[1] == 0 else "clients"] += 1
        else:
            group = next((g for g, ps in peers.items() if ports[1] in ps), "other")
            kinds[group] += 1
    return dict(sorted(kinds.items()))


def established(port: int) -> int:
    """TCP connections in ESTABLISHED state whose local port is `port` (the server's side)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                if parts[3] == "01" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                    n += 1
    return n


# -- the soak ---------------------------------------------------------------------------------
SYSTEMS = [
    f"You are assistant {i}. " + " ".join(f"rule-{i}-{k}" for k in range(60)) for i in range(8)
]


def prompt(rng: random.Random, n: int) -> list[dict[str, str]]:
    """A chat of one of a few shared system prompts (prefix routing, the Redis index) and a
    question of its own."""
    return [
        {"role": "system", "content": rng.choice(SYSTEMS)},
        {"role": "user", "content": f"question {n}: {rng.random()}"},
    ]


class Soak:
    def __init__(
        self, args: argparse.Namespace, port: int, proxy_pid: int, peers: dict[str, set[int]]
    ) -> None:
        self.args = args
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.pid = proxy_pid
        self.peers = peers
        self.fds_by_kind: dict[str, dict[str, int]] = {}
        self.fast = Tally()
        self.slow = Tally()
        self.whole = Tally()  # --hostile: non-streamed requests
        self.samples: list[dict[str, float]] = []
        self.events: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.stopping = asyncio.Event()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def event(self, what: str) -> None:
        self.events.append({"t_s": self.now(), "event": what})
        if not self.args.quiet:
            print(f"[{self.now():7.1f}s] {what}", flush=True)

    async def worker(self, i: int, slow: bool) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        client = client_for(self.url)
        n = 0
        try:
            while not self.stopping.is_set():
                n += 1
                if slow:  # a client reading a long answer late: the proxy must hold back
                    o = await stream_chat(
                        client,
                        prompt(rng, n),
                        max_tokens=200,
                        read_delay_s=0.05,
                        deadline_s=self.args.deadline + 200 * 0.05,
                    )
                    self.slow.add(o)
                elif self.args.hostile and rng.random() < self.args.json_share:
                    o = await chat_once(
                        client,
                        prompt(rng, n),
                        max_tokens=rng.randint(8, 128),
                        deadline_s=self.args.deadline,
                    )
                    self.whole.add(o)
                else:  # an application's usual request
                    o = await stream_chat(
                        client,
                        prompt(rng, n),
                        max_tokens=rng.randint(8, 128),
                        deadline_s=self.args.deadline,
                    )
                    self.fast.add(o)
                if o.kind in ("lost", "hung") and not self.args.quiet:
                    print(f"[{self.now():7.1f}s] {o.kind}: {o.cause}", flush=True)
        finally:
            await client.close()

    async def sampler(self) -> None:
        while not self.stopping.is_set():
            s = self.sample()
            if len(self.samples) % 12 == 1:  # each minute: how big /metrics has grown
                s["metrics_bytes"] = (await asyncio.to_thread(_metrics, self.url))[0]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), 5)

    def sample(self) -> dict[str, float]:
        s = {"t_s": self.now(), "rss_kb": rss_kb(self.pid), "fds": open_fds(self.pid)}
        s["requests"] = self.fast.total + self.slow.total + self.whole.total
        self.samples.append(s)
        return s

    async def timeline(self, engines: list[Engine], redis: Redis) -> None:
        d = self.args.duration
        victim = engines[-1]

        async def at(fraction: float) -> None:
            await asyncio.sleep(max(0.0, self.t0 + d * fraction - time.monotonic()))

        await at(0.25)
        self.event(f"SIGKILL engine {victim.url} mid-stream")
        victim.kill()
        await asyncio.sleep(min(15.0, d * 0.05))
        victim.start(wait=False)
        await asyncio.to_thread(victim.wait)
        self.event(f"engine {victim.url} restarted")
        await at(0.5)
        self.event("Redis killed")
        redis.kill()
        await asyncio.sleep(min(3.0, d * 0.02))
        await asyncio.to_thread(redis.start)
        self.event("Redis restarted (empty)")
        await at(0.7)
        self.event("Redis frozen (SIGSTOP)")
        redis.freeze()
        await asyncio.sleep(min(5.0, d * 0.02))
        redis.thaw()
        self.event("Redis thawed (SIGCONT)")

    async def run(self, engines: list[Engine], redis: Redis) -> None:
        a = self.args
        self.event(f"load: {a.concurrency} clients + {a.slow_clients} slow for {a.duration:g}s")
        self.sample()
        self.fds_by_kind["start"] = fd_kinds(self.pid, self.port, self.peers)
        tasks = [asyncio.create_task(self.worker(i, False)) for i in range(a.concurrency)]
        tasks += [asyncio.create_task(self.worker(1000 + i, True)) for i in range(a.slow_clients)]
        sampler = asyncio.create_task(self.sampler())
        timeline = asyncio.create_task(self.timeline(engines, redis))
        try:
            await asyncio.sleep(a.duration)
            self.stopping.set()
            self.event("load stopped; waiting for the requests in flight")
            await asyncio.gather(*tasks)
            await timeline
            await sampler
        finally:  # done already, unless the run was cancelled (SIGTERM)
            for t in [*tasks, sampler, timeline]:
                t.cancel()

    async def settle(self, timeout_s: float = 15.0) -> float:
        """Wait (bounded) for the proxy's fds to come back to their count at the start: idle
        keep-alive connections close within the engines' 5 s. Returns the seconds waited."""
        t = time.monotonic()
        # another process's fds: nothing to wait on but a fresh count
        while open_fds(self.pid) > self.samples[0]["fds"] and time.monotonic() - t < timeout_s:  # noqa: ASYNC110
            await asyncio.sleep(0.5)
        return round(time.monotonic() - t, 1)


def _slowest(t: dict[str, Any]) -> str:
    s = t["slowest"]
    return (
        "-"
        if s is None
        else f"{s['seconds']} s ({s['kind']}{': ' + s['cause'] if s['cause'] else ''})"
    )


def _signed(v: float | None) -> str:
    return "-" if v is None else f"{v:+.3f}"


def _table(summary: dict[str, Any]) -> str:
    r, p = summary["requests"], summary["proxy"]
    f, sl, w = summary["usual"], summary["slow"], summary["non_streamed"]
    rss = p["rss"]
    rows = [
        ("requests", str(r["requests"])),
        ("ok (complete answers)", str(r["ok"])),
        *((f"error: {k}", str(v)) for k, v in r["errors"].items()),
        ("lost", str(r["lost_total"]) + (f"  {r['lost']}" if r["lost"] else "")),
        ("hung", str(r["hung"])),
        ("seconds p50 / p99 (usual clients)", f"{f['seconds_p50']} / {f['seconds_p99']}"),
        ("slowest (usual clients)", _slowest(f)),
        ("slow clients: requests / ok", f"{sl['requests']} / {sl['ok']}"),
        ("slowest (slow clients)", _slowest(sl)),
        *(
            ()
            if not w["requests"]
            else [("non-streamed: requests / ok", f"{w['requests']} / {w['ok']}")]
        ),
        (
            "proxy RSS start / warm / end",
            f"{p['rss_mb_start']} / {p['rss_mb_warm']} / {p['rss_mb_end']} MB"
            f" (max {p['rss_mb_max']})",
        ),
        (
            "proxy RSS slope by third of the run",
            " / ".join(_signed(v) for v in rss["slope_mb_per_min_by_third"]) + " MB/min",
        ),
        (
            "  slope of each minute's lowest, last third",
            f"{_signed(rss['floor_slope_mb_per_min_last_third'])} MB/min",
        ),
        (
            "proxy open fds start -> end",
            f"{p['fds_start']} -> {p['fds_end']} (max {p['fds_max']};"
            f" end read {p['settle_s']} s after the load)",
        ),
        *(
            (f"  fds {when}", ", ".join(f"{k} {v}" for k, v in kinds.items()))
            for when, kinds in p["fds_by_kind"].items()
        ),
        (
            "proxy /metrics at end",
            f"{p['metrics_bytes']} bytes, {p['hostile_labels']} hostile_ labels",
        ),
        ("engine streams open at end", str(summary["engine_streams_open_at_end"])),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# -- the proxy's RSS over the run -------------------------------------------------------------
def _slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) points, in MB per minute."""
    if len(points) < 2:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if not var:
        return None
    return round(60 * sum((t - mt) * (v - mv) for t, v in points) / var, 3)


def rss_trend(samples: Sequence[dict[str, float]], duration_s: float) -> dict[str, Any]:
    """The RSS series (seconds, MB) and its slope over each third of the load: a leak keeps
    its slope to the end, a process filling its pools and caches levels off."""
    points = [(s["t_s"], round(s["rss_kb"] / 1024, 1)) for s in samples]
    thirds = []
    for k in range(3):
        lo, hi = duration_s * k / 3, duration_s * (k + 1) / 3
        thirds.append(_slope([(t, v) for t, v in points if lo <= t <= hi]))
    # Each minute's lowest sample: what stays once the transient buffers (a 64 MiB answer
    # being refused) are freed. A leak lifts this floor; a spike does not.
    floors: dict[int, float] = {}
    for t, v in points:
        if t <= duration_s:
            floors[int(t // 60)] = min(v, floors.get(int(t // 60), v))
    last = [(60.0 * m, v) for m, v in floors.items() if 60.0 * m >= duration_s * 2 / 3]
    return {
        "series_mb": [list(pt) for pt in points],
        "slope_mb_per_min_by_third": thirds,
        "slope_mb_per_min_last_third": thirds[2],
        "floor_mb_by_minute": [floors[m] for m in sorted(floors)],
        "floor_slope_mb_per_min_last_third": _slope(last),
    }


def ascii_plot(points: Sequence[Sequence[float]], width: int = 60, height: int = 10) -> str:
    """The RSS series as text: one column per slice of time (its highest sample)."""
    if len(points) < 2:
        return ""
    t_end = points[-1][0] or 1.0
    cols: list[float | None] = [None] * width
    for t, v in points:
        i = min(width - 1, int(t / t_end * (width - 1)))
        cols[i] = v if cols[i] is None else max(v, cols[i] or v)
    for i in range(1, width):  # a slice with no sample of its own: the one before
        cols[i] = cols[i - 1] if cols[i] is None else cols[i]
    lo, hi = min(v for _, v in points), max(v for _, v in points)
    span = (hi - lo) or 1.0
    rows = []
    for r in range(height - 1, -1, -1):
        cut = lo + span * r / (height - 1)
        line = "".join(" " if c is None else ("#" if c >= cut else " ") for c in cols)
        rows.append(f"{cut:8.1f} MB |{line}")
    rows.append(" " * 12 + "+" + "-" * width)
    rows.append(" " * 13 + f"0 min{'':>{width - 14}}{t_end / 60:6.1f} min")
    return "\n".join(rows)


def png_plot(points: Sequence[Sequence[float]], path: str, title: str) -> str:
    """The RSS series as a PNG (matplotlib, from the bench extra); what became of it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install -e '.[bench]')"
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot([t / 60 for t, _ in points], [v for _, v in points], lw=1.2)
    ax.set(xlabel="minutes", ylabel="proxy RSS (MB)", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"RSS plot written to {path}"


# -- the run ----------------------------------------------------------------------------------
def hostile_args(port: int, *, seed: int, good: float, cap_bytes: int) -> list[str]:
    """deploy/perf/hostile_backend.py on one port."""
    args = [sys.executable, str(ROOT / "deploy/perf/hostile_backend.py"), "--port", str(port)]
    return [*args, "--seed", str(seed), "--good", str(good), "--cap-bytes", str(cap_bytes)]


def _engines(args: argparse.Namespace, logs: Path | None) -> tuple[list[Engine], dict[str, Any]]:
    """The backends (sims, or hostile backends with --hostile), not started yet, and the
    faults they inject."""
    if args.hostile:
        faults: dict[str, Any] = {"good": args.good, "max_response_bytes": args.cap_bytes}
    else:
        faults = {
            "error_rate": args.fault_rate,
            "cut_rate": args.fault_rate,
            "cut_after": 3,
            "stall_rate": args.fault_rate,
            "stall_after": 2,
            # simulated seconds: wall stall = stall_s / time_scale, past the proxy's idle timeout
            "stall_s": (args.idle_s + 2) * args.time_scale,
        }
    engines = []
    for i in range(args.engines):
        port = free_port()
        if args.hostile:
            argv = hostile_args(port, seed=args.seed + i, good=args.good, cap_bytes=args.cap_bytes)
        else:
            argv = sim_args(port, time_scale=args.time_scale, seed=args.seed + i, faults=faults)
        name = f"{'hostile' if args.hostile else 'sim'}-{i}.log"
        engines.append(Engine(argv, port, logs / name if logs else None))
    return engines, faults


def _metrics(url: str) -> tuple[int, int]:
    """The proxy's /metrics: its size, and how many hostile error types made it in as labels."""
    with contextlib.suppress(httpx.HTTPError):
        text = httpx.get(url + "/metrics", timeout=10).text
        return len(text), len(set(re.findall(r"hostile_[0-9a-f]{12}", text)))
    return -1, -1


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    # SIGTERM (a nohup'd run ignores SIGINT): cancelled, so every child is stopped on the way out
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    logs = Path(args.logs) if args.logs else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    redis = Redis().start()
    engines, faults = _engines(args, logs)
    timeouts = {"idle_s": args.idle_s, "first_byte_s": args.first_byte_s}
    try:
        for e in engines:
            e.start(wait=False)
        for e in engines:
            e.wait()
        port = free_port()
        env = {
            "WARMROUTE_TIMEOUTS__IDLE_S": str(args.idle_s),
            "WARMROUTE_TIMEOUTS__FIRST_BYTE_S": str(args.first_byte_s),
            "WARMROUTE_UPSTREAM__MAX_RESPONSE_BYTES": str(args.cap_bytes),
            "WARMROUTE_REDIS__KEY_PREFIX": f"soak-{os.getpid()}",
        }
        argv = serve_args(port, [e.url for e in engines], policy="prefix_aware", redis=redis.url)
        with proxy_process(argv, env, logs / "proxy.log" if logs else None) as proc:
            peers = {"engines": {e.port for e in engines}, "redis": {redis.port}}
            run = Soak(args, port, proc.pid, peers)
            await run.run(engines, redis)
            settle_s = await run.settle()
            end = run.sample()
            run.fds_by_kind["end"] = fd_kinds(proc.pid, port, peers)
            metrics = _metrics(run.url)
            stats = {e.url: e.stats() for e in engines}
            streams = sum(s["running"] + s["waiting"] for s in stats.values())
    finally:
        for e in engines:
            e.close()
        redis.close()
    first = run.samples[0]
    # "warm": the first sample past a tenth of the run, once pools and caches have filled
    warm = next((s for s in run.samples if s["t_s"] >= args.duration / 10), end)
    return {
        "command": " ".join(["python", "deploy/perf/soak.py", *sys.argv[1:]]),
        "mode": "hostile" if args.hostile else "sim",
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "slow_clients": args.slow_clients,
        "engines": args.engines,
        "faults_per_engine": faults,
        "proxy_timeouts": timeouts,
        "requests": (run.fast + run.slow + run.whole).as_dict(),
        "usual": run.fast.as_dict(),
        "slow": run.slow.as_dict(),
        "non_streamed": run.whole.as_dict(),
        "events": run.events,
        "proxy": {
            "rss_mb_start": round(first["rss_kb"] / 1024, 1),
            "rss_mb_warm": round(warm["rss_kb"] / 1024, 1),
            "rss_mb_end": round(end["rss_kb"] / 1024, 1),
            "rss_mb_max": round(max(s["rss_kb"] for s in run.samples) / 1024, 1),
            "rss": rss_trend(run.samples, args.duration),
            "fds_start": first["fds"],
            "fds_end": end["fds"],
            "fds_max": max(s["fds"] for s in run.samples),
            "settle_s": settle_s,
            "fds_by_kind": run.fds_by_kind,
            "metrics_bytes": metrics[0],
            "hostile_labels": metrics[1],
        },
        "samples": run.samples,
        "engine_streams_open_at_end": streams,
        # what each engine injected (the killed one: since its restart)
        "engine_counts": {url: s["counts"] for url, s in stats.items()},
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    p.add_argument("--concurrency", type=int, default=24, help="streaming clients (default 24)")
    p.add_argument("--slow-clients", type=int, default=4, help="clients reading late (default 4)")
    p.add_argument("--engines", type=int, default=3, help="backend processes (default 3)")
    p.add_argument(
        "--fault-rate",
        type=float,
        default=0.02,
        help="share of requests each sim errors, stalls and cuts (each; default 0.02)",
    )
    p.add_argument("--hostile", action="store_true", help="hostile backends instead of sims")
    p.add_argument("--good", type=float, default=0.7, help="--hostile: good answers (0.7)")
    p.add_argument(
        "--json-share", type=float, default=0.3, help="--hostile: non-streamed requests (0.3)"
    )
    p.add_argument(
        "--cap-bytes",
        type=int,
        default=64 << 20,
        help="the proxy's upstream.max_response_bytes (default 64 MiB)",
    )
    p.add_argument("--idle-s", type=float, default=3.0, help="the proxy's idle timeout (default 3)")
    p.add_argument(
        "--first-byte-s",
        type=float,
        help="the proxy's first-byte timeout (default 10; 2 with --hostile)",
    )
    p.add_argument("--time-scale", type=float, default=10.0, help="engines' speed-up (default 10)")
    p.add_argument(
        "--deadline",
        type=float,
        default=60.0,
        help="a request not done after this many seconds is hung (default 60)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON here")
    p.add_argument("--plot", metavar="PNG", help="plot the proxy's RSS over the run here")
    p.add_argument("--logs", metavar="DIR", help="keep the engines' and proxy's logs here")
    p.add_argument("--quiet", action="store_true", help="only the final table")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.first_byte_s is None:
        args.first_byte_s = 2.0 if args.hostile else 10.0
    try:
        summary = asyncio.run(soak(args))
    except asyncio.CancelledError:
        print("stopped (SIGTERM): no summary", file=sys.stderr)
        return 143
    print(_table(summary))
    series = summary["proxy"]["rss"]["series_mb"]
    print("\nproxy RSS over the run:\n" + ascii_plot(series))
    if args.plot:
        print(png_plot(series, args.plot, f"warmroute soak ({summary['mode']}): proxy RSS"))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    r = summary["requests"]
    return 1 if r["lost_total"] or r["hung"] or summary["engine_streams_open_at_end"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
