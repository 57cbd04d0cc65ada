#!/usr/bin/env python3
"""Elastic fleet under load: what adding, removing and restarting engines costs.

While the bench's shared-prefix load runs at concurrency 32 through one `warmroute serve`, the
fleet behind it changes:

  scale-out  2 -> 4 engines: two cold engines added through POST /admin/backends mid-run
  scale-in   4 -> 2 engines: two engines (admin-added before the load) removed with
             DELETE /admin/backends/{name} mid-run; their streams must finish (drain)
  roll       a rolling restart of all 4: one by one, each engine is dropped from the config
             file + SIGHUP (a leave: drain, then forgotten), its mock process killed, a fresh
             (cold) one started on the same port, the file listing it again + SIGHUP, and the
             next engine only once it serves again
  roll-paced the same, with ROLL_GAP requests between a re-add and the next removal, so that
             each re-added engine's warm-up and the placement's moves to it can be seen
  static-2, static-3, static-4  the same seed on a fleet of that size from the start: the
             STATIC BOUND of each fleet a change leaves (3: a roll with one engine out)

The engines are the bench mock in engine mode (python -m proxy.bench.mock --cache-tokens), one
process per engine, each with an LRU prefix cache of ~3 of the 8 ~2.7k-token prompts
(CACHE=8500, as deploy/perf/scale_out.sh), serial prefill, nothing published about the cache.
Every run starts on fresh engines and a fresh proxy. The load is the bench's own runner
(proxy.bench.client.run_bench) in this process, so each request's send time is known on the
same clock as each membership change.

Figures per run (goals in brackets):
  failed, hung         requests that did not complete [0], that hit HUNG_S [0]
  in flight            streams on a leaving engine when it was removed (the proxy's own count,
                       its log line "...; N in flight"; the engine's queued+running gauge) and
                       how many completed whole [all]; drain time; requests cut at the grace
  hit windows          the engines' cached_tokens / prompt_tokens per window of WINDOW
                       requests: before each change, then each window after it, against the
                       static bound of the new fleet (hit of static-N over requests
                       CHANGE_AT.. of the same seed); "recovered" = requests after the change
                       until the end of the first window within TOLERANCE (relative) of the
                       bound [<= 200]
  moved                share of placed prefixes whose homes (GET /admin/routing ->
                       cache.placement.hottest) changed from just before a change to one
                       WINDOW after it ("+1 window": the change's own moves) and to just
                       before the next change or the run's end ("by the next change": with
                       the churn traffic alone causes, see the static runs' "prefix moves");
                       on a join the share balance needs is joined/new fleet size [moved <=
                       that, none between the old engines]; on a leave only the departed
                       engines' prefixes may move [others 0; none left homed on them]

  deploy/perf/elastic.py                                  # seeds 1-3, every scenario (~5 min)
  SEEDS="1" SCENARIOS="scale-out" deploy/perf/elastic.py  # one quick run
  VIA=sighup deploy/perf/elastic.py       # scale-out/in through the config file + SIGHUP too
  CHANGE_AT=300 AFTER=600 WINDOW=50 TOLERANCE=0.05 deploy/perf/elastic.py
  git archive HEAD~3 | tar -x -C /tmp/old && BASE=/tmp/old deploy/perf/elastic.py

Environment (or the matching --flag):
  SEEDS ("1 2 3")          one pass of every run per seed
  SCENARIOS                "scale-out scale-in roll roll-paced" (the static runs they need are
                           added; static-N alone is allowed too)
  CACHE (8500)             prefix cache tokens per engine: ~3 of the 8 prompts
  CONCURRENCY (32)         the bench's closed loop
  RATE_TPS (20000)         serial prefill speed of each engine, tokens/s
  CHUNK_MS (20)            gap between the 16 streamed chunks: streams are mid-answer when
                           their engine leaves
  CHANGE_AT (200)          requests before the first change (every engine warm by then)
  AFTER (400)              requests after the last change
  WINDOW (50), TOLERANCE (0.05)   hit ratio windows; "back" = within 5% (relative) of the bound
  HUNG_S (30)              per-request bound: a request past it is cancelled and counted hung
  DRAIN_GRACE (30)         fleet.drain_grace_s of the proxy
  VIA (admin)              scale-out/in through the admin API, or sighup: the config file
  ROLL_GAP (100)           roll-paced: requests between a re-add and the next removal
  MAX_REQUESTS (4000)      a run's cap; OUT (/tmp/warmroute-elastic); BASE (a checkout to run
                           the proxy from, for a before/after)

Prints one line per run and a summary table (also OUT/summary.md); writes OUT/<run>.json (every
request, every change, the placement snapshots) and OUT/elastic.json (all summaries). Every
process it starts is stopped on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from proxy.bench.client import run_bench  # noqa: E402
from proxy.bench.workloads import Message, RequestSpec, Workload  # noqa: E402

SMALL, LARGE = 2, 4
STATICS = ("static-2", "static-3", "static-4")
# The static runs each scenario is judged by: the fleet after each change (the roll's leaves
# leave 3 engines), and the one before it.
SCENARIO_NEEDS = {
    "scale-out": ("static-2", "static-4"),
    "scale-in": ("static-2", "static-4"),
    "roll": ("static-3", "static-4"),
    "roll-paced": ("static-3", "static-4"),
}
ROLLS = ("roll", "roll-paced")


# -- settings --------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="deploy/perf/elastic.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seeds", default=env("SEEDS", "1 2 3"))
    p.add_argument("--scenarios", default=env("SCENARIOS", "scale-out scale-in roll roll-paced"))
    p.add_argument("--cache", type=int, default=int(env("CACHE", "8500")))
    p.add_argument("--concurrency", type=int, default=int(env("CONCURRENCY", "32")))
    p.add_argument("--rate-tps", type=float, default=float(env("RATE_TPS", "20000")))
    p.add_argument("--chunk-ms", type=float, default=float(env("CHUNK_MS", "20")))
    p.add_argument("--change-at", type=int, default=int(env("CHANGE_AT", "200")))
    p.add_argument("--after", type=int, default=int(env("AFTER", "400")))
    p.add_argument("--window", type=int, default=int(env("WINDOW", "50")))
    p.add_argument("--tolerance", type=float, default=float(env("TOLERANCE", "0.05")))
    p.add_argument("--hung-s", type=float, default=float(env("HUNG_S", "30")))
    p.add_argument("--drain-grace", type=float, default=float(env("DRAIN_GRACE", "30")))
    p.add_argument("--via", choices=("admin", "sighup"), default=env("VIA", "admin"))
    p.add_argument("--roll-gap", type=int, default=int(env("ROLL_GAP", "100")))
    p.add_argument("--max-requests", type=int, default=int(env("MAX_REQUESTS", "4000")))
    p.add_argument("--out", default=env("OUT", "/tmp/warmroute-elastic"))
    p.add_argument("--base", default=env("BASE", ""), help="run the proxy from this checkout")
    a = p.parse_args(argv)
    a.seeds = [int(s) for s in a.seeds.split()]
    a.scenarios = a.scenarios.split()
    for s in a.scenarios:
        if s not in SCENARIO_NEEDS and s not in STATICS:
            p.error(f"unknown scenario {s!r}: {', '.join([*SCENARIO_NEEDS, *STATICS])}")
    return a


# -- processes -------------------------------------------------------------------------------
PROCS: list[subprocess.Popen[bytes]] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(
    cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: str | Path = ROOT
) -> subprocess.Popen[bytes]:
    """`cmd` in `cwd` (another checkout's: `python -m` puts it before PYTHONPATH)."""
    f = log.open("ab")
    try:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env, stdin=subprocess.DEVNULL
        )
    finally:
        f.close()
    PROCS.append(proc)
    return proc


def stop(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc in PROCS:
        PROCS.remove(proc)


async def astop(proc: subprocess.Popen[bytes], within: float = 5.0) -> None:
    """stop() without blocking the event loop (the load keeps running meanwhile)."""
    if proc.poll() is None:
        proc.terminate()
        deadline = time.monotonic() + within
        while proc.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
            while proc.poll() is None:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
    if proc in PROCS:
        PROCS.remove(proc)


def stop_all() -> None:
    for proc in list(reversed(PROCS)):
        with contextlib.suppress(Exception):
            stop(proc)


async def wait_http(session: aiohttp.ClientSession, url: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not come up in {within:g}s")


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
        r.raise_for_status()
        return await r.json(content_type=None)


@dataclass
class Engine:
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.name}"

    def start(self, a: argparse.Namespace) -> None:
        self.starts += 1
        cmd = [sys.executable, "-m", "proxy.bench.mock", "--port", str(self.port)]
        cmd += ["--instances", "1", "--chunks", "16", "--cache-tokens", str(a.cache)]
        cmd += ["--prefill-tokens-per-s", str(a.rate_tps), "--chunk-interval-ms", str(a.chunk_ms)]
        self.proc = spawn(cmd, self.log)

    async def inflight(self, session: aiohttp.ClientSession) -> int | None:
        """The engine's own count: requests queued for prefill plus streaming."""
        try:
            async with session.get(
                self.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                text = await r.text()
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
        total = 0
        for line in text.splitlines():
            if line.startswith(("mock_requests_waiting ", "mock_requests_running ")):
                total += int(float(line.split()[1]))
        return total


class Proxy:
    def __init__(self, a: argparse.Namespace, logdir: Path, label: str) -> None:
        self.a = a
        self.port, self.admin_port = free_port(), free_port()
        self.cfg = logdir / f"{label}-warmroute.yaml"
        self.log = logdir / f"{label}-proxy.log"
        self.listed: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}/admin"

    def write_config(self, urls: Sequence[str]) -> None:
        self.listed = list(urls)
        lines = ["backends:"] + [f"  - url: {u}" for u in urls]
        tmp = self.cfg.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.cfg)  # atomic: a reload never reads half a file

    def start(self, urls: Sequence[str]) -> None:
        self.write_config(urls)
        env = dict(os.environ)
        env["WARMROUTE_FLEET__DRAIN_GRACE_S"] = str(self.a.drain_grace)
        for k in ("WARMROUTE_BACKENDS", "WARMROUTE_CONFIG", "WARMROUTE_PORT"):
            env.pop(k, None)
        if self.a.base:
            env["PYTHONPATH"] = self.a.base + (
                ":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
            )
        cmd = [sys.executable, "-m", "proxy", "serve", "--config", str(self.cfg)]
        cmd += [
            "--port",
            str(self.port),
            "--admin-port",
            str(self.admin_port),
            "--log-level",
            "info",
        ]
        self.proc = spawn(cmd, self.log, env, self.a.base or ROOT)

    def reload(self, urls: Sequence[str]) -> None:
        self.write_config(urls)
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGHUP)


# -- the load, tracked -----------------------------------------------------------------------
class Tracker:
    """Send time of every request (perf_counter, the clock the changes are timed on), waits
    for a request index to go out, and the index at which the load stops."""

    def __init__(self) -> None:
        self.reset(0)

    def reset(self, limit: int) -> None:
        self.sent_at: dict[int, float] = {}
        self.sent = 0  # requests sent so far (they go out in index order)
        self.limit = limit
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def on_send(self, index: int) -> None:
        self.sent_at[index] = time.perf_counter()
        self.sent = max(self.sent, index + 1)
        keep = []
        for i, fut in self._waiters:
            if self.sent > i:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((i, fut))
        self._waiters = keep

    async def reach(self, index: int) -> None:
        """Returns once request `index` was sent."""
        if self.sent > index:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((index, fut))
        await fut


TRACK = Tracker()


class _Plan(list[RequestSpec]):
    """The bench's plan; its workers stop taking requests at TRACK.limit (a clean end: no
    request is cancelled)."""

    def __iter__(self) -> Any:
        for spec in list.__iter__(self):
            if spec.index >= TRACK.limit:
                return
            yield spec


class TrackedWorkload(Workload):
    """The shared-prefix workload, byte for byte, telling TRACK when each request goes out."""

    def plan(self, n: int) -> list[RequestSpec]:
        return _Plan(super().plan(n))

    def messages(self, spec: RequestSpec, history: Sequence[Message] = ()) -> list[Message]:
        TRACK.on_send(spec.index)  # the runner renders a request right before it posts it
        return super().messages(spec, history)


def workload(seed: int) -> TrackedWorkload:
    # As the other scripts: --workload shared-prefix --prefixes 8 --system-chars 8000 --zipf 0
    # --max-tokens 16 (user turns of the default 200 characters).
    return TrackedWorkload(
        name="shared-prefix",
        seed=seed,
        system_chars=8000,
        num_prefixes=8,
        zipf_s=0.0,
        max_tokens=16,
    )


# -- one run ---------------------------------------------------------------------------------
@dataclass
class Change:
    kind: str  # join | leave
    engines: list[str]
    index: int  # first request sent after it
    t: float  # perf_counter when it was issued
    fleet_after: int
    before: dict[str, list[str]] = field(default_factory=dict)  # placement: prefix -> homes
    after: dict[str, list[str]] = field(default_factory=dict)
    engine_inflight: dict[str, int | None] = field(default_factory=dict)
    proxy_inflight: dict[str, int] = field(default_factory=dict)  # requests_here just before
    settled_s: float | None = None  # join: until serving; leave: until gone
    note: str = ""


class Run:
    def __init__(self, a: argparse.Namespace, scenario: str, seed: int, logdir: Path) -> None:
        self.a, self.scenario, self.seed = a, scenario, seed
        self.label = f"{scenario}-s{seed}"
        self.logdir = logdir
        self.changes: list[Change] = []
        self.snapshots: list[dict[str, Any]] = []  # every WINDOW requests
        self.session: aiohttp.ClientSession | None = None
        n = int(scenario.split("-")[1]) if scenario in STATICS else LARGE
        self.engines = [
            Engine(free_port(), logdir / f"{self.label}-engine{i}.log") for i in range(n)
        ]
        self.proxy = Proxy(a, logdir, self.label)

    # the fleet, through the admin API or the config file
    async def hottest(self) -> list[dict[str, Any]]:
        """GET /admin/routing's placement snapshot: the hot prefixes and their homes."""
        assert self.session is not None
        info = await get_json(self.session, self.proxy.admin + "/routing")
        return list(info.get("cache", {}).get("placement", {}).get("hottest", []))

    async def homes(self) -> dict[str, list[str]]:
        return {h["prefix"]: sorted(h["homes"]) for h in await self.hottest()}

    async def backends(self) -> dict[str, Any]:
        assert self.session is not None
        return await get_json(self.session, self.proxy.admin + "/backends")

    async def add(self, engines: list[Engine], via: str) -> None:
        assert self.session is not None
        if via == "admin":
            for e in engines:
                async with self.session.post(
                    self.proxy.admin + "/backends", json={"url": e.url}
                ) as r:
                    if r.status != 201:
                        raise RuntimeError(
                            f"POST /admin/backends {e.url}: {r.status} {await r.text()}"
                        )
        else:
            self.proxy.reload([*self.proxy.listed, *(e.url for e in engines)])

    async def remove(self, engines: list[Engine], via: str) -> None:
        assert self.session is not None
        if via == "admin":
            for e in engines:
                async with self.session.delete(f"{self.proxy.admin}/backends/{e.name}") as r:
                    if r.status != 202:
                        raise RuntimeError(
                            f"DELETE /admin/backends/{e.name}: {r.status} {await r.text()}"
                        )
        else:
            gone = {e.url for e in engines}
            self.proxy.reload([u for u in self.proxy.listed if u not in gone])

    async def wait_state(self, names: list[str], want: str, within: float) -> float:
        """Seconds until every name is `want` (serving), or gone from the fleet (gone)."""
        t0 = time.perf_counter()
        deadline = t0 + within
        while time.perf_counter() < deadline:
            info = await self.backends()
            states = {b["name"]: b["state"] for b in info["backends"]}
            if want == "gone" and not any(n in states for n in names):
                return time.perf_counter() - t0
            if want != "gone" and all(states.get(n) == want for n in names):
                return time.perf_counter() - t0
            await asyncio.sleep(0.05)
        raise RuntimeError(f"{names} not {want} after {within:g}s")

    async def change(self, kind: str, engines: list[Engine], via: str, fleet_after: int) -> Change:
        assert self.session is not None
        before = await self.homes()
        c = Change(kind, [e.name for e in engines], 0, 0.0, fleet_after, before=before)
        if kind == "leave":  # what is on them right now, both sides' counts
            counts = await asyncio.gather(*(e.inflight(self.session) for e in engines))
            c.engine_inflight = {e.name: n for e, n in zip(engines, counts, strict=True)}
            here = {
                b["name"]: b.get("requests_here", 0) for b in (await self.backends())["backends"]
            }
            c.proxy_inflight = {e.name: here.get(e.name, 0) for e in engines}
        c.index, c.t = TRACK.sent, time.perf_counter()
        if kind == "join":
            await self.add(engines, via)
            c.settled_s = await self.wait_state(c.engines, "serving", 30)
        else:
            await self.remove(engines, via)
            c.settled_s = await self.wait_state(c.engines, "gone", self.a.drain_grace + 20)
        if self.changes:
            self.changes[-1].after = before
        self.changes.append(c)
        return c

    async def sampler(self) -> None:
        """A placement snapshot every WINDOW requests (for the JSON; the table uses the ones
        taken at each change)."""
        k = 0
        while True:
            await TRACK.reach(k)
            with contextlib.suppress(Exception):
                hot = await self.hottest()
                self.snapshots.append(
                    {
                        "index": k,
                        "homes": {h["prefix"]: sorted(h["homes"]) for h in hot},
                        "overflow": [h["prefix"] for h in hot if h.get("overflow")],
                    }
                )
            k += self.a.window

    async def controller(self) -> None:
        a = self.a
        e = self.engines
        await TRACK.reach(a.change_at)
        if self.scenario == "scale-out":
            await self.change("join", e[SMALL:], a.via, LARGE)
        elif self.scenario == "scale-in":
            await self.change("leave", e[SMALL:], a.via, SMALL)
        elif self.scenario in ROLLS:
            gap = a.roll_gap if self.scenario == "roll-paced" else 0
            for k, eng in enumerate(e):
                await self.change("leave", [eng], "sighup", LARGE - 1)
                assert eng.proc is not None
                await astop(eng.proc)  # the old engine process goes: its cache with it
                eng.start(a)  # a fresh, cold engine at the same address
                await wait_http(self.session, eng.url + "/v1/models")  # type: ignore[arg-type]
                await self.change("join", [eng], "sighup", LARGE)
                if gap and k + 1 < len(e):
                    await TRACK.reach(TRACK.sent + gap)
        TRACK.limit = min(TRACK.limit, TRACK.sent + a.after)

    async def execute(self) -> dict[str, Any]:
        a = self.a
        static = self.scenario.startswith("static")
        total = a.change_at + a.after if static else a.max_requests
        async with aiohttp.ClientSession() as session:
            self.session = session
            for eng in self.engines:
                eng.start(a)
            await asyncio.gather(*(wait_http(session, x.url + "/v1/models") for x in self.engines))
            if self.scenario in STATICS:
                self.proxy.start([x.url for x in self.engines])
            elif self.scenario in ROLLS or (self.scenario == "scale-in" and a.via == "sighup"):
                self.proxy.start([x.url for x in self.engines])
            else:
                self.proxy.start([x.url for x in self.engines[:SMALL]])
            await wait_http(session, self.proxy.url + "/ready", 60)
            if self.scenario == "scale-in" and a.via == "admin":
                await self.add(self.engines[SMALL:], "admin")  # removable through the admin API
                await self.wait_state([x.name for x in self.engines[SMALL:]], "serving", 30)
            TRACK.reset(total)
            sampler = asyncio.create_task(self.sampler())
            ctl = None if static else asyncio.create_task(self.controller())
            bench = asyncio.create_task(
                run_bench(
                    self.proxy.url,
                    workload(self.seed),
                    requests=total,
                    concurrency=a.concurrency,
                    request_timeout=a.hung_s,
                    max_duration=900,
                    label=self.label,
                )
            )
            t_start = time.perf_counter()
            try:
                if ctl is not None:
                    done, _ = await asyncio.wait({ctl, bench}, return_when=asyncio.FIRST_COMPLETED)
                    if ctl in done:
                        ctl.result()  # raises what went wrong
                    else:
                        ctl.cancel()
                        note = "the load ended before every change was made"
                        self.changes.append(Change("none", [], TRACK.sent, 0, 0, note=note))
                result = await bench
            except BaseException:
                TRACK.limit = 0  # the bench stops taking requests
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(bench, 60)
                raise
            finally:
                sampler.cancel()
                with contextlib.suppress(BaseException):
                    await sampler
            end_homes = await self.homes()
            if self.changes:
                self.changes[-1].after = end_homes
            final_backends = await self.backends()
        duration = time.perf_counter() - t_start
        if self.proxy.proc is not None:
            stop(self.proxy.proc)  # first: engines gone under a live proxy would log as down
        stop_all()
        return self.summarize(result, end_homes, final_backends, duration)

    # -- the figures -------------------------------------------------------------------------
    def summarize(
        self, result: Any, end_homes: dict[str, list[str]], final: dict[str, Any], duration: float
    ) -> dict[str, Any]:
        a = self.a
        reqs = {r.index: r for r in result.requests}
        hung_kinds = {"timeout", "deadline"}
        errors: dict[str, int] = {}
        for r in reqs.values():
            if not r.ok:
                errors[r.error_kind or "?"] = errors.get(r.error_kind or "?", 0) + 1
        hung = sum(v for k, v in errors.items() if k in hung_kinds)
        failed = sum(errors.values()) - hung
        e2e = [r.e2e for r in reqs.values() if r.ok and r.e2e is not None]
        logs = parse_proxy_log(self.proxy.log.read_text(errors="replace"))
        out: dict[str, Any] = {
            "scenario": self.scenario,
            "seed": self.seed,
            "sent": len(reqs),
            "duration_s": round(duration, 1),
            "failed": failed,
            "hung": hung,
            "errors": errors,
            "e2e_max_s": round(max(e2e), 3) if e2e else None,
            "hit": hit(reqs.values()),
            "log": logs,
            "changes": [],
            "snapshots": self.snapshots,
            "final_fleet": [(b["name"], b["state"]) for b in final.get("backends", [])],
            "requests": [
                {
                    "i": r.index,
                    "t": round(TRACK.sent_at.get(r.index, 0.0), 4),
                    "ok": r.ok,
                    "e2e": r.e2e,
                    "prompt": r.prompt_tokens,
                    "cached": r.cached_tokens,
                    "error": r.error_kind,
                    "msg": r.error,
                }
                for r in sorted(reqs.values(), key=lambda r: r.index)
            ],
        }
        out["windows"] = windows(reqs, 0, len(reqs), a.window)
        if self.scenario.startswith("static"):
            out["bound"] = hit(r for i, r in reqs.items() if i >= a.change_at)
            # Prefixes that changed homes per WINDOW requests with no change at all (a fleet
            # too small for every prompt shuffles them): the churn a change's figures include.
            snaps = [x["homes"] for x in self.snapshots if x["index"] >= a.change_at]
            out["churn"] = [
                sum(1 for k in y if k in x and x[k] != y[k]) for x, y in pairwise(snaps)
            ]
            return out
        leaves = iter(logs["leaves"])
        for k, c in enumerate(self.changes):
            if c.kind == "none":
                out["changes"].append({"kind": "none", "note": c.note})
                continue
            nxt = self.changes[k + 1].index if k + 1 < len(self.changes) else len(reqs)
            d: dict[str, Any] = {
                "kind": c.kind,
                "engines": c.engines,
                "index": c.index,
                "fleet_after": c.fleet_after,
                "settled_s": round(c.settled_s or 0, 2),
                "hit_before": hit(r for i, r in reqs.items() if c.index - a.window <= i < c.index),
                "windows": windows(reqs, c.index, nxt, a.window),
                "requests_until_next": nxt - c.index,
            }
            d.update(moved(c))
            # The placement one window after the change (before any later one): what the
            # change itself moved, apart from the churn that traffic alone causes later.
            early = next(
                (x["homes"] for x in self.snapshots if c.index + a.window <= x["index"] < nxt),
                c.after,
            )
            d["early"] = {
                k: v
                for k, v in moved(
                    Change(c.kind, c.engines, 0, 0, c.fleet_after, c.before, early)
                ).items()
                if k.startswith("moved") or k == "stale_homes"
            }
            d["layout_after"] = layout(c.after)
            if c.kind == "leave":
                d.update(self.leave_figures(c, reqs, leaves, logs))
            out["changes"].append(d)
        return out

    def leave_figures(
        self, c: Change, reqs: dict[int, Any], leaves: Any, logs: dict[str, Any]
    ) -> dict[str, Any]:
        """In flight on the leaving engines at the removal, and what became of them."""
        at_log = {}
        for _ in c.engines:
            rec = next(leaves, None)
            if rec is not None:
                at_log[rec["name"]] = rec["inflight"]
        inflight = sum(at_log.get(n, c.proxy_inflight.get(n, 0)) for n in c.engines)
        # The client's side. A failure whose error names a leaving engine (the proxy's cut
        # says "backend NAME left the fleet...") was on it, whenever it was sent (one sent a
        # few ms before the proxy applied the removal counts in its "in flight" too). Any other
        # failure of a request in flight at the removal is counted against the leaving engines
        # as well: the bench does not record which engine served a request (an upper bound).
        lost = 0
        for i, r in reqs.items():
            if r.ok:
                continue
            t = TRACK.sent_at.get(i)
            named = any(n in (r.error or "") for n in c.engines)
            in_flight = t is not None and t < c.t and (r.e2e is None or t + r.e2e >= c.t)
            if named or in_flight:
                lost += 1
        cut = sum(x["cut"] for x in logs["cuts"] if x["name"] in c.engines)
        drained = [x["drain_s"] for x in logs["lefts"] if x["name"] in c.engines]
        return {
            "inflight_proxy": inflight,
            "inflight_proxy_by_engine": at_log,
            "requests_here_before": c.proxy_inflight,
            "inflight_engine": c.engine_inflight,
            "failed_among_inflight": lost,
            "completed_whole": max(inflight - lost, 0),
            "cut_at_grace": cut,
            "drain_s": max(drained) if drained else None,
        }


def hit(requests: Any) -> float | None:
    p = c = 0
    for r in requests:
        if r.ok and r.prompt_tokens:
            p += r.prompt_tokens
            c += r.cached_tokens or 0
    return round(c / p, 4) if p else None


def windows(reqs: dict[int, Any], start: int, end: int, size: int) -> list[float | None]:
    return [
        hit(reqs[i] for i in range(s, min(s + size, end)) if i in reqs)
        for s in range(start, end, size)
        if min(s + size, end) - s >= size // 2
    ]


def moved(c: Change) -> dict[str, Any]:
    """Which placed prefixes changed homes between c.before and c.after."""
    b, a = c.before, c.after
    common = [k for k in b if k in a]
    changed = [k for k in common if b[k] != a[k]]
    names = set(c.engines)
    if c.kind == "join":
        to_new = [k for k in changed if set(a[k]) & names]
        other = [k for k in changed if k not in to_new]
        need = len(c.engines) / c.fleet_after
    else:
        homed = [k for k in b if set(b[k]) & names]
        other = [k for k in changed if not set(b[k]) & names]
        to_new = []
        need = len(homed) / len(b) if b else 0.0
    stale = [k for k in a if c.kind == "leave" and set(a[k]) & names]
    return {
        "placed_before": len(b),
        "placed_after": len(a),
        "moved_share": round(len(changed) / len(common), 3) if common else None,
        "moved_needed": round(need, 3),
        "moved_other": len(other),
        "moved_to_joined": len(to_new),
        "stale_homes": len(stale),
    }


def layout(homes: dict[str, list[str]]) -> dict[str, int]:
    """Placed prefixes per engine (port: count)."""
    per: dict[str, int] = {}
    for hs in homes.values():
        for h in hs:
            per[h.split(":")[-1]] = per.get(h.split(":")[-1], 0) + 1
    return dict(sorted(per.items()))


_LEAVE = re.compile(r"backend (\S+) leaves \(.*?\): no new requests; (\d+) in flight")
_LEFT = re.compile(r"backend (\S+) left the fleet \(drained in ([0-9.]+)s\)")
_CUT = re.compile(r"backend (\S+): (\d+) request\(s\) still open after")
_BAD = re.compile(r"\b(ERROR|CRITICAL|Traceback)\b")


def parse_proxy_log(text: str) -> dict[str, Any]:
    return {
        "leaves": [{"name": m[1], "inflight": int(m[2])} for m in _LEAVE.finditer(text)],
        "lefts": [{"name": m[1], "drain_s": float(m[2])} for m in _LEFT.finditer(text)],
        "cuts": [{"name": m[1], "cut": int(m[2])} for m in _CUT.finditer(text)],
        "errors": [ln[:300] for ln in text.splitlines() if _BAD.search(ln)][:20],
        "warnings": [ln[:300] for ln in text.splitlines() if " WARNING " in ln][:20],
    }


# -- the bound, recovery, the report ---------------------------------------------------------
def recovered(ws: list[float | None], bound: float | None, tol: float, size: int) -> int | None:
    """Requests until the end of the first window within `tol` (relative) of `bound`."""
    if bound is None:
        return None
    for k, w in enumerate(ws):
        if w is not None and w >= (1 - tol) * bound:
            return (k + 1) * size
    return None


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def series(ws: list[float | None], n: int = 8) -> str:
    return " ".join(pct(w) for w in ws[:n]) + (" ..." if len(ws) > n else "")


def annotate(
    run: dict[str, Any], bounds: dict[tuple[str, int], float | None], a: argparse.Namespace
) -> None:
    """Each change against the static bound of the fleet it leaves behind."""
    real = [c for c in run["changes"] if c["kind"] != "none"]
    for c in real:
        c["bound"] = bounds.get((f"static-{c['fleet_after']}", run["seed"]))
        c["recovered_after"] = recovered(c["windows"], c["bound"], a.tolerance, a.window)
    joins = [c for c in real if c["kind"] == "join"]
    last = joins[-1] if run["scenario"] in ROLLS and joins else (real[-1] if real else None)
    run["recovered_after"] = last["recovered_after"] if last else None
    if run["scenario"] in ROLLS and real:
        ws = [w for c in real[:-1] for w in c["windows"] if w is not None]
        run["roll_requests"] = real[-1]["index"] - real[0]["index"]
        run["roll_min_window"] = min(ws) if ws else None
        run["roll_hit"] = hit_between(run, real[0]["index"], real[-1]["index"])


def hit_between(run: dict[str, Any], lo: int, hi: int) -> float | None:
    p = c = 0
    for r in run["requests"]:
        if lo <= r["i"] < hi and r["ok"] and r["prompt"]:
            p += r["prompt"]
            c += r["cached"] or 0
    return round(c / p, 4) if p else None


def mv(m: dict[str, Any]) -> str:
    """A moved share as `share (needed; others N[, STALE N])`."""
    stale = f", STALE {m['stale_homes']}" if m.get("stale_homes") else ""
    return f"{m['moved_share']} ({m['moved_needed']}; others {m['moved_other']}{stale})"


def line(run: dict[str, Any], a: argparse.Namespace) -> str:
    s = (
        f"seed {run['seed']}  {run['scenario']:<9} sent {run['sent']:4d}  failed {run['failed']}"
        f"  hung {run['hung']}  e2e max {run['e2e_max_s'] or 0:4.1f}s  hit {pct(run['hit'])}"
        f"  ({run['duration_s']:.0f}s)"
    )
    if run["scenario"] in STATICS:
        return s + (
            f"  churn {sum(run['churn'])} moves in {run['sent'] - a.change_at}"
            f"  bound {pct(run['bound'])} (warm after {run['warm_after']})"
            f"  windows {series(run['windows'], 12)}"
        )
    if run["scenario"] in ROLLS and "roll_hit" in run:
        s += (
            f"  roll: {run['roll_requests']} requests, hit {pct(run['roll_hit'])}, "
            f"worst window {pct(run['roll_min_window'])}"
        )
    for c in run["changes"]:
        if c["kind"] == "none":
            s += f"\n    !! {c['note']}"
            continue
        rec = c["recovered_after"]
        if rec is not None:
            back = f"back within {a.tolerance:.0%} after {rec}"
        elif len(c["windows"]) < 2 and c["requests_until_next"] < 2 * a.window:
            back = f"next change after {c['requests_until_next']} requests"
        else:
            back = f"NOT back within {a.tolerance:.0%} in {c['requests_until_next']}"
        ports = ",".join(n.split(":")[1] for n in c["engines"])
        s += (
            f"\n    {c['kind']:<5} {ports} at {c['index']} ({c['settled_s']:.2f}s)"
            f"  before {pct(c['hit_before'])}  bound {pct(c['bound'])}"
            f"  after {series(c['windows'])}  {back}"
            f"  moved {mv(c['early'])} +1 window, {mv(c)} by the next change"
            f"  layout {'/'.join(map(str, c['layout_after'].values()))}"
        )
        if c["kind"] == "leave":
            eng = sum(v or 0 for v in c["inflight_engine"].values())
            s += (
                f"  in flight {c['inflight_proxy']} (engine {eng})"
                f" completed {c['completed_whole']}/{c['inflight_proxy']}"
                f" cut {c['cut_at_grace']} drain {c['drain_s']}s"
            )
    if run["log"]["errors"]:
        errs = run["log"]["errors"]
        s += f"\n    proxy log: {len(errs)} error line(s); first: {errs[0]}"
    return s


def summary_table(runs: list[dict[str, Any]], a: argparse.Namespace) -> str:
    """One Markdown table per scenario."""
    out: list[str] = []
    tol = f"{a.tolerance:.0%}"

    def leaves_of(r: dict[str, Any]) -> list[dict[str, Any]]:
        return [c for c in r["changes"] if c["kind"] == "leave"]

    def inflight(r: dict[str, Any]) -> str:
        ls = leaves_of(r)
        if not ls:
            return "-"
        return (
            f"{sum(c['completed_whole'] for c in ls)}/{sum(c['inflight_proxy'] for c in ls)}"
            f" (cut {sum(c['cut_at_grace'] for c in ls)}, drain max "
            f"{max((c['drain_s'] or 0) for c in ls):.1f}s)"
        )

    for scenario in (*STATICS, "scale-out", "scale-in", *ROLLS):
        rs = [r for r in runs if r["scenario"] == scenario]
        if not rs:
            continue
        out.append(f"\n### {scenario}\n")
        if scenario in STATICS:
            out.append(
                f"| seed | sent | failed | hung | bound (hit, requests {a.change_at}..) "
                f"| warm after (requests from cold, within {tol}) "
                f"| prefix moves after request {a.change_at} (no change made) "
                f"| windows of {a.window} |"
            )
            out.append("|---|---|---|---|---|---|---|---|")
            for r in rs:
                out.append(
                    f"| {r['seed']} | {r['sent']} | {r['failed']} | {r['hung']} "
                    f"| {pct(r['bound'])} | {r['warm_after']} | {sum(r['churn'])} "
                    f"| {series(r['windows'], 12)} |"
                )
            continue
        if scenario in ROLLS:
            out.append(
                "| seed | sent | failed | hung | in flight at removals: completed/total "
                "| hit during the roll (worst window) | bound (4) "
                f"| windows after the last re-add | back within {tol} after "
                "| leaves, +1 window: moved (needed; others) "
                "| re-adds, by the next change: moved (needed; others) |"
            )
            out.append("|---|---|---|---|---|---|---|---|---|---|---|")
            for r in rs:
                cs = [c for c in r["changes"] if c["kind"] != "none"]
                js = [c for c in cs if c["kind"] == "join"]
                lv = " ".join(mv(c["early"]) for c in leaves_of(r))
                jn = " ".join(mv(c) for c in js)
                last = js[-1] if js else None
                out.append(
                    f"| {r['seed']} | {r['sent']} | {r['failed']} | {r['hung']} | {inflight(r)} "
                    f"| {pct(r.get('roll_hit'))} ({pct(r.get('roll_min_window'))}) "
                    f"| {pct(last['bound']) if last else '-'} "
                    f"| {series(last['windows']) if last else '-'} | {r['recovered_after']} "
                    f"| {lv} | {jn} |"
                )
            continue
        out.append(
            "| seed | sent | failed | hung | in flight at removal: completed/total "
            f"| hit before | bound | windows after | back within {tol} after "
            "| moved +1 window (needed; others) | moved by the end (needed; others) "
            "| prompts per engine at the end |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rs:
            cs = [c for c in r["changes"] if c["kind"] != "none"]
            c = cs[0] if cs else None
            if c is None:
                out.append(
                    f"| {r['seed']} | {r['sent']} | {r['failed']} | {r['hung']} | no change |"
                )
                continue
            out.append(
                f"| {r['seed']} | {r['sent']} | {r['failed']} | {r['hung']} | {inflight(r)} "
                f"| {pct(c['hit_before'])} | {pct(c['bound'])} | {series(c['windows'])} "
                f"| {c['recovered_after']} | {mv(c['early'])} | {mv(c)} "
                f"| {'/'.join(map(str, c['layout_after'].values()))} |"
            )
    return "\n".join(out) + "\n"


async def main_async(a: argparse.Namespace) -> int:
    out = Path(a.out)
    logdir = out / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    needed = [s for x in a.scenarios for s in SCENARIO_NEEDS.get(x, ())]
    order = [s for s in STATICS if s in needed or s in a.scenarios]
    order += [s for s in ("scale-out", "scale-in", *ROLLS) if s in a.scenarios]
    print(
        f"elastic: seeds {a.seeds}, runs {' '.join(order)}; c={a.concurrency}, cache "
        f"{a.cache} tokens, 16 chunks {a.chunk_ms:g} ms apart, first change at request "
        f"{a.change_at}, {a.after} after the last; out {out}",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    bounds: dict[tuple[str, int], float | None] = {}
    t0 = time.monotonic()
    for seed in a.seeds:
        for scenario in order:
            run = Run(a, scenario, seed, logdir)
            try:
                res = await run.execute()
            finally:
                stop_all()
            if scenario in STATICS:
                bounds[(scenario, seed)] = res["bound"]
                res["warm_after"] = recovered(res["windows"], res["bound"], a.tolerance, a.window)
            else:
                annotate(res, bounds, a)
            (out / f"{run.label}.json").write_text(json.dumps(res, indent=1))
            runs.append({k: v for k, v in res.items() if k not in ("requests", "snapshots")})
            print(line(res, a), flush=True)
    table = summary_table(runs, a)
    print(table, end="")
    (out / "summary.md").write_text(table)
    wall = round(time.monotonic() - t0, 1)
    (out / "elastic.json").write_text(
        json.dumps({"settings": vars(a), "runs": runs, "wall_s": wall}, indent=1)
    )
    print(f"elastic: {len(runs)} runs in {wall:.0f}s; results in {out}", flush=True)
    return 1 if sum(r["failed"] + r["hung"] for r in runs) else 0


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    try:
        return asyncio.run(main_async(a))
    except KeyboardInterrupt:
        return 130
    finally:
        stop_all()


if __name__ == "__main__":
    raise SystemExit(main())
