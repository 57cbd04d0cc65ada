"""The async load runner: closed loop (concurrency) or open loop (Poisson rate) over aiohttp.

Every response chunk is timestamped with `time.perf_counter()` the moment its read returns,
before any parsing, so JSON work never inflates TTFT or ITL. One `ClientSession` with a pool
sized to the concurrency serves the whole run (keep-alive, like an application's client), and
the event loop thread's CPU time is recorded so a saturated client is visible in the results.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import sys
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import orjson
from tqdm import tqdm

from proxy.bench.group import GroupRun
from proxy.bench.results import RunResult
from proxy.bench.workloads import RequestSpec, Workload
from proxy.heap import still_heap

MAX_REQUESTS = 100_000
# How a run with several targets picks one per request (see GroupRun.target_for).
AFFINITIES = ("round-robin", "system")
MAX_DURATION_S = 24 * 3600.0
_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=10, sock_connect=5)


class BenchError(Exception):
    """A problem the user can fix (bad target, unreachable server); the message says how."""


def normalize_base_url(url: str) -> str:
    """`http://h:p/v1/` -> `http://h:p`; the runner appends `/v1/...` itself."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(f"{url!r} is not an http(s) URL; use e.g. http://127.0.0.1:8080")
    return url.rstrip("/").removesuffix("/v1")


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_targets(urls: Sequence[str], allow_remote: bool) -> list[str]:
    """Normalized URLs; refuses non-loopback targets unless explicitly allowed (a load
    generator pointed at the wrong host is a denial of service)."""
    out = [normalize_base_url(u) for u in urls]
    if not allow_remote:
        remote = [u for u in out if not is_loopback(u)]
        if remote:
            raise BenchError(
                f"refusing to load non-loopback target(s) {', '.join(remote)}; "
                "pass --allow-remote (allow_remote=True) if you own them"
            )
    return out


async def discover_model(session: aiohttp.ClientSession, base_url: str) -> str | None:
    """First model id of `GET /v1/models`; raises BenchError if the server cannot be reached."""
    try:
        async with session.get(f"{base_url}/v1/models", timeout=_PROBE_TIMEOUT) as resp:
            if resp.status != 200:
                return None
            body = orjson.loads(await resp.read())
    except aiohttp.ClientConnectorError as e:
        raise BenchError(
            f"cannot reach {base_url}: {e.os_error or e}. Is the server running on that "
            "address? (check --base-url / --direct / --compare)"
        ) from None
    except (TimeoutError, aiohttp.ClientError) as e:
        raise BenchError(f"{base_url}/v1/models did not answer: {type(e).__name__} {e}") from None
    except orjson.JSONDecodeError:
        return None
    data = body.get("data") if isinstance(body, dict) else None
    if data and isinstance(data[0], dict) and data[0].get("id"):
        return str(data[0]["id"])
    return None


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets (s) of a Poisson process, rescaled so the last is n/rate like vllm's, which
    keeps throughput comparable across seeds."""
    if n == 0:
        return []
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    times = np.cumsum(gaps)
    times *= (n / rate) / times[-1]
    times -= times[0]  # the first request goes out at once
    return [float(t) for t in times]


def exponential_offsets(rng: random.Random, rate: float, duration: float) -> Iterator[float]:
    """Arrival offsets (s) of a Poisson process at `rate` a second until `duration`, drawn from
    `rng` one at a time as they are asked for (what the caller draws between them keeps its
    place in the sequence: a seed gives the same prompts and arrivals every run)."""
    at = 0.0
    while True:
        at += rng.expovariate(rate)
        if at >= duration:
            return
        yield at


async def paced(offsets: Iterable[float]) -> AsyncIterator[float]:
    """Each of `offsets` (seconds after the first is asked for, ascending) once its time has
    come: an open loop's clock. A late one is yielded at once, never skipped."""
    t0 = time.perf_counter()
    for at in offsets:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield at


async def run_bench(
    base_url: str | Sequence[str],
    workload: Workload,
    *,
    requests: int,
    concurrency: int | None = None,
    rate: float | None = None,
    model: str | None = None,
    progress: bool = False,
    endpoint: str = "chat",
    label: str | None = None,
    role: str = "target",
    max_duration: float | None = None,
    request_timeout: float = 600.0,
    extra_body: dict[str, Any] | None = None,
    api_key: str | None = None,
    allow_remote: bool = False,
    affinity: str = "round-robin",
    close_connections: bool = False,
) -> RunResult:
    """Run `requests` requests of `workload` against `base_url` (several: spread by `affinity`,
    "round-robin" by conversation or index, or "system": system prompt i on target i mod N).

    Closed loop with `concurrency` workers, or open loop at `rate` req/s (Poisson, seeded by
    the workload's seed) capped at `concurrency` in flight when both are given. Raises
    BenchError when the target is unreachable or the arguments are out of bounds.
    """
    runs = await run_paired(
        [(base_url, label, role)],
        workload,
        requests=requests,
        concurrency=concurrency,
        rate=rate,
        model=model,
        progress=progress,
        endpoint=endpoint,
        max_duration=max_duration,
        request_timeout=request_timeout,
        extra_body=extra_body,
        api_key=api_key,
        allow_remote=allow_remote,
        affinity=affinity,
        close_connections=close_connections,
    )
    return runs[0]


async def run_paired(
    groups: Sequence[tuple[str | Sequence[str], str | None, str]],
    workload: Workload,
    *,
    requests: int,
    concurrency: int | None = None,
    rate: float | None = None,
    model: str | None = None,
    progress: bool = False,
    endpoint: str = "chat",
    max_duration: float | None = None,
    request_timeout: float = 600.0,
    extra_body: dict[str, Any] | None = None,
    api_key: str | None = None,
    allow_remote: bool = False,
    affinity: str = "round-robin",
    close_connections: bool = False,
) -> list[RunResult]:
    """One run per (targets, label, role) group, their requests interleaved.

    With one group this is a plain run. With several, every request of the plan goes to each
    group in turn (rotating which goes first), on the same workers: paired samples, so a
    change in the machine's load hits every group alike. That is what latency comparisons on
    a shared machine need (the proxy's added TTFT at concurrency 1); the throughput of such
    runs describes the mix, not any one group. Closed loop only when interleaving.
    """
    _check_load(len(groups), requests, concurrency, rate, endpoint, affinity)
    deadline_s = min(max_duration or MAX_DURATION_S, MAX_DURATION_S)
    group_targets = [_group_targets(base_url, allow_remote) for base_url, _, _ in groups]
    plan = workload.plan(requests)
    headers = {"Content-Type": "application/json"}
    # The token goes on the session so that /v1/models discovery is authorized too.
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else None
    pool = concurrency or 0  # 0: unbounded, an open loop must not queue inside the client
    session_for = _session(pool, len(groups), close_connections, request_timeout, auth)
    async with session_for as session:
        # Every target is probed: an unreachable one fails here, before any load is sent.
        discovered = [await discover_model(session, t) for ts in group_targets for t in ts]
        model = model or discovered[0]
        if not model:
            raise BenchError(
                f"{group_targets[0][0]}/v1/models lists no model; pass --model (model=...) "
                "explicitly"
            )
        shape = {"model": model, "endpoint": endpoint, "concurrency": concurrency, "rate": rate}
        runs = _new_runs(groups, group_targets, workload, requests, affinity, **shape)
        pbar = tqdm(
            total=requests * len(runs),
            desc=" + ".join(r.label for r in runs),
            unit="req",
            file=sys.stderr,
            disable=not progress,
        )
        states = [
            GroupRun(
                targets,
                workload,
                plan,
                model=model,
                endpoint=endpoint,
                session=session,
                extra_body=extra_body,
                headers=headers,
                pbar=pbar,
                affinity=affinity,
            )
            for targets in group_targets
        ]
        cpu0, t0 = time.thread_time(), time.perf_counter()
        for st in states:
            st.t0 = t0
        try:
            with still_heap():  # (a client's GC pause would read as the server's latency)
                await _drive(states, plan, runs, concurrency, rate, workload.seed, deadline_s)
        finally:
            pbar.close()
        duration, client_cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    _finish_runs(runs, states, requests, duration, client_cpu)
    return runs


def _session(
    pool: int, groups: int, close: bool, request_timeout: float, auth: dict[str, str] | None
) -> aiohttp.ClientSession:
    """The run's client session: `pool` connections per host (0: unbounded), `close`: a
    connection per request, for servers that close theirs after a streamed response while
    announcing keep-alive (llama-server: every other request on a reused connection failed)."""
    connector = aiohttp.TCPConnector(limit=pool * groups, limit_per_host=pool, force_close=close)
    timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=10)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, headers=auth)


def _group_targets(base_url: str | Sequence[str], allow_remote: bool) -> list[str]:
    """A group's target URLs, checked (loopback unless allowed)."""
    targets = check_targets([base_url] if isinstance(base_url, str) else base_url, allow_remote)
    if not targets:
        raise BenchError("no target URL given")
    return targets


def _check_load(
    groups: int,
    requests: int,
    concurrency: int | None,
    rate: float | None,
    endpoint: str,
    affinity: str,
) -> None:
    """The run's shape, or a BenchError that says what is wrong with it."""
    if not 1 <= requests <= MAX_REQUESTS:
        raise BenchError(f"requests must be between 1 and {MAX_REQUESTS}, got {requests}")
    if concurrency is None and rate is None:
        raise BenchError("give a concurrency (closed loop) or a rate (open loop, req/s)")
    if concurrency is not None and concurrency < 1:
        raise BenchError("concurrency must be >= 1")
    if rate is not None and rate <= 0:
        raise BenchError("rate must be > 0 requests per second")
    if endpoint not in ("chat", "completions"):
        raise BenchError("endpoint must be 'chat' or 'completions'")
    if affinity not in AFFINITIES:
        raise BenchError(f"affinity must be one of {', '.join(AFFINITIES)}, got {affinity!r}")
    if groups > 1 and rate is not None:
        raise BenchError("interleaved runs are closed loop: give --concurrency, not --rate")


def _new_runs(
    groups: Sequence[tuple[str | Sequence[str], str | None, str]],
    group_targets: list[list[str]],
    workload: Workload,
    requests: int,
    affinity: str,
    **shape: Any,
) -> list[RunResult]:
    """One result per group, empty, with what the run is (`shape`: model, endpoint,
    concurrency, rate) and the notes its pairing needs."""
    started = datetime.now(UTC).isoformat(timespec="seconds")
    runs = [
        RunResult(
            label=label or _default_label(targets),
            targets=targets,
            workload=workload.params(),
            requests_planned=requests,
            started_at=started,
            role=role,
            **shape,
        )
        for (_, label, role), targets in zip(groups, group_targets, strict=True)
    ]
    _note_pairing(runs, affinity)
    return runs


def _note_pairing(runs: list[RunResult], affinity: str) -> None:
    """What a reader of each run must know: it was interleaved, or statically pinned."""
    if len(runs) > 1:
        note = "interleaved with " + ", ".join(r.label for r in runs)
        for r in runs:
            r.notes.append(note + ": compare latencies; throughput is the mix's")
    if affinity == "system":
        for r in runs:
            if len(r.targets) > 1:
                r.notes.append(
                    f"static affinity: system prompt i went to target i mod {len(r.targets)}"
                )


async def _drive(
    states: list[GroupRun],
    plan: list[RequestSpec],
    runs: list[RunResult],
    concurrency: int | None,
    rate: float | None,
    seed: int,
    deadline_s: float,
) -> None:
    """Send the plan: closed loop (workers, each request to every group in turn) or open loop
    (arrivals at `rate`), until done or the deadline, when what is in flight is cancelled."""
    tasks: list[asyncio.Task[None]] = []
    if rate is None:
        assert concurrency is not None
        queue = iter(plan)

        async def worker() -> None:
            for spec in queue:
                # Rotate which group goes first, so that no group always follows the
                # same one (a request right after its own kind finds warmer caches).
                k = spec.index % len(states)
                order = states[k:] + states[:k]
                for st in order:
                    await st.issue(spec)

        tasks = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(plan)))]
        main: asyncio.Future[Any] = asyncio.gather(*tasks)
    else:
        main = asyncio.ensure_future(_open_loop(states[0], plan, rate, concurrency, seed, tasks))
    try:
        await asyncio.wait_for(asyncio.shield(main), timeout=deadline_s)
    except TimeoutError:
        for run in runs:
            run.notes.append(f"max duration {deadline_s:g}s reached: in-flight requests cancelled")
        main.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(main, *tasks, return_exceptions=True)


def _finish_runs(
    runs: list[RunResult], states: list[GroupRun], requests: int, duration: float, client_cpu: float
) -> None:
    """Each run's requests in order, those cut by the deadline named, and the client's CPU."""
    for run, state in zip(runs, states, strict=True):
        run.duration = duration
        run.client_cpu_s = client_cpu / len(runs)
        for res in state.results.values():
            if not res.ok and res.error_kind is None:
                res.error_kind, res.error = "deadline", "cancelled at --max-duration"
        run.requests = [state.results[i] for i in sorted(state.results)]
        run.not_sent = requests - len(run.requests)
        if duration > 0 and client_cpu / duration > 0.7:
            run.notes.append(
                f"the bench client used {client_cpu / duration:.0%} of a core: "
                "it may be the bottleneck; lower the load or run the client on another machine"
            )


async def _open_loop(
    state: GroupRun,
    plan: list[RequestSpec],
    rate: float,
    cap: int | None,
    seed: int,
    tasks: list[asyncio.Task[None]],
) -> None:
    sem = asyncio.Semaphore(cap) if cap else None

    async def one(spec: RequestSpec) -> None:
        if sem is None:
            await state.issue(spec)
            return
        async with sem:
            await state.issue(spec)

    specs = iter(plan)
    async for _ in paced(poisson_arrivals(len(plan), rate, seed)):
        tasks.append(asyncio.create_task(one(next(specs))))
    await asyncio.gather(*tasks)


def _default_label(targets: list[str]) -> str:
    names = [urlsplit(t).netloc for t in targets]
    return names[0] if len(names) == 1 else f"{names[0]}+{len(names) - 1}"
