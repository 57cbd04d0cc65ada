"""Routing policies on a simulated fleet in virtual time: exact, reproducible, seconds to run.

The same pieces as `warmroute demo`, minus sockets and the wall clock: the real Router (policy,
prefix hasher, memory index sized from the engines' KV pools, prefill learner, in-flight
counts) decides, the simulator's scheduler core (proxy/sim/engine.py: continuous batching,
chunked prefill, the block pool with its prefix cache) serves, and a discrete-event loop
advances time from one engine step to the next. Closed-loop clients replay a bench Workload
exactly as `warmroute bench` would (later turns of a conversation wait for, and carry, the
earlier replies), and the run comes back as a bench RunResult, so the demo's tables, the
oracle and the plots apply unchanged.

What the model leaves out: network and proxy latency (zero here), CPU contention between
processes (which on a small box inflates every latency in the socket demo), scrape jitter.
Engine gauges are sampled every `scrape_s` like the proxy's background scrape.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from proxy.bench.results import RequestResult, RunResult
from proxy.bench.workloads import Message, RequestSpec, Workload
from proxy.kvevents.view import KvCacheView
from proxy.routing.backlog import PrefillBacklog
from proxy.routing.index import MemoryPrefixIndex, capacity_blocks_from_tokens
from proxy.routing.prefix import DEFAULT_MAX_BLOCKS, chain_tokens, seed
from proxy.routing.setup import build_router
from proxy.routing.types import BackendView, Decision, EngineLoad, RouteContext
from proxy.routing.views import ViewKeeper
from proxy.sim import tokens
from proxy.sim.config import SimConfig
from proxy.sim.engine import Scheduler, Seq, StepPlan, make_seq

STATIC_AFFINITY = "static_affinity"
# select(fleet, ctx, views) -> the views this request may go to (e.g. one pool of a split)
Select = Callable[["VirtualFleet", RouteContext, list[BackendView]], Sequence[BackendView]]


class _LiveView:
    """A KV-event view the router may always trust (virtual delivery is instant and lossless)."""

    live = True

    def __init__(self, view: KvCacheView) -> None:
        self.view = view

    def match(self, blocks: Sequence[int]) -> int:
        return self.view.match(blocks)

    def match_tiers(self, blocks: Sequence[int]) -> tuple[int, ...]:
        return self.view.match_tiers(blocks)


@dataclass
class _Open:
    """A request in flight on an engine."""

    spec: RequestSpec
    result: RequestResult
    engine: int
    start: float
    ctx: RouteContext
    decision: Decision  # what the router decided (and where it recorded the prefix)
    last: float = 0.0
    reply: list[str] = field(default_factory=list)
    history: list[Message] = field(default_factory=list)


class VirtualFleet:
    """`engines` schedulers behind one Router, stepped by a discrete-event clock."""

    def __init__(
        self,
        sim: SimConfig,
        engines: int,
        policy: str,
        plugins: Mapping[str, Any] | None = None,
        scrape_s: float = 2.0,
        publish_kv_pool: bool = True,
        kv_events: bool = False,
        roles: Sequence[str] | None = None,
    ) -> None:
        self.cfgs = [sim.replace() for _ in range(engines)]
        # Backend roles as the router sees them (mixed | prefill | decode); the engines stay
        # whole-request engines, so a prefill/decode split here is the pool split.
        self.roles = list(roles) if roles is not None else ["mixed"] * engines
        if len(self.roles) != engines:
            raise ValueError(f"{len(self.roles)} roles for {engines} engines")
        # Narrows the candidates of each request (a pool split); called after a dry-run route
        # has filled ctx.matched_blocks, so it can judge the prompt's uncached part.
        self.select: Select | None = None
        self.scheds = [Scheduler(c, record_kv_events=kv_events) for c in self.cfgs]
        # Names like real backends' (host:port): rendezvous placement hashes them.
        self.names = [f"10.0.0.{i + 1}:8000" for i in range(engines)]
        self.now = 0.0
        # The index ages entries on the virtual clock, not the wall clock.
        self.index = MemoryPrefixIndex(clock=lambda: self.now)
        # STATIC_AFFINITY is a bound to compare with, not a policy: system prompt i on engine
        # i mod n, chosen by whoever wrote the workload. The router still hashes and records.
        self.static = policy == STATIC_AFFINITY
        self.router = build_router(
            {"policy": "prefix_aware" if self.static else policy, "plugins": dict(plugins or {})},
            index=self.index,
        )
        self.router.backlog = PrefillBacklog(clock=lambda: self.now)
        hasher = self.router.hasher
        # Like the proxy's scrape of vllm:cache_config_info; an engine that hides it (most
        # real ones) leaves the router to learn its cache from the cached_tokens it reports.
        self.publish_kv_pool = publish_kv_pool
        for name, cfg in zip(self.names, self.cfgs, strict=True):
            if publish_kv_pool:
                self.router.set_published_capacity(
                    name,
                    capacity_blocks_from_tokens(
                        cfg.kv_pool_tokens, hasher.block_chars, hasher.chars_per_token
                    ),
                )
        # KV events: each engine's pool reports every change, a view per engine applies them
        # (at every decision: delivery in virtual time is instant), and requests are keyed by
        # the engine's own token blocks (exact mode with the engine's tokenizer).
        self.kv_events = kv_events
        self.kv_views = [KvCacheView(c.model, c.block_size) for c in self.cfgs] if kv_events else []
        for name, view in zip(self.names, self.kv_views, strict=False):
            self.router.exact[name] = _LiveView(view)
        self.learner = self.router.learner
        self.inflight = [0] * engines
        self.inflight_area = [0.0] * engines  # integral of in-flight over time: mean load
        self.served = [0] * engines
        self.loads = [
            EngineLoad(kv_tokens=c.kv_pool_tokens if publish_kv_pool else None) for c in self.cfgs
        ]
        self.scrape_s = scrape_s
        self._busy = [False] * engines
        self._events: list[tuple[float, int, int, StepPlan]] = []
        self._tie = itertools.count()
        # The router is handed its views as the proxy's ViewCache hands them (a Views with the
        # fleet-wide facts); made afresh each request here, so read whole each time.
        self._keeper = ViewKeeper()

    def views(self) -> list[BackendView]:
        return self._keeper.read(self._views())

    def _views(self) -> list[BackendView]:
        return [
            BackendView(
                name=name,
                url=f"http://{name}",
                engine="vllm",
                role=self.roles[i],
                weight=1.0,
                healthy=True,
                inflight=self.inflight[i],
                load=self.loads[i],
                models=frozenset({cfg.model}),
                prefill_tokens_per_s=self.learner.rate(name),
                mean_prefill_s=self.learner.mean_prefill_s(name),
                backlog_tokens=self.router.backlog_tokens(name),
            )
            for i, (name, cfg) in enumerate(zip(self.names, self.cfgs, strict=True))
        ]

    def scrape(self) -> None:
        for i, s in enumerate(self.scheds):
            self.loads[i] = EngineLoad(
                waiting=float(len(s.waiting)),
                running=float(len(s.running)),
                kv_usage=s.pool.usage,
                kv_tokens=self.cfgs[i].kv_pool_tokens if self.publish_kv_pool else None,
                scraped_at=self.now,
            )

    def deliver_kv_events(self) -> None:
        for sched, view in zip(self.scheds, self.kv_views, strict=False):
            view.apply(sched.pool.take_events())

    async def route(
        self,
        request_id: str,
        body: dict[str, Any],
        system_id: int | None = None,
        prompt: list[int] | None = None,
    ) -> tuple[int, RouteContext, Decision]:
        ctx = RouteContext(
            request_id=request_id,
            model=body["model"],
            api="chat",
            body=body,
            headers={},
            now=self.now,
            session_key=body.get("user"),  # as the proxy does (or the x-session-id header)
        )
        if self.kv_events and prompt is not None:
            self.deliver_kv_events()
            cfg = self.cfgs[0]
            ctx.prefix_blocks = chain_tokens(
                seed(ctx.model), prompt, cfg.block_size, DEFAULT_MAX_BLOCKS
            )
            ctx.block_chars = cfg.block_size * cfg.chars_per_token
            ctx.prompt_chars = len(prompt) * cfg.chars_per_token
            ctx.token_keyed = True
        if self.static and system_id is not None:
            decided = await self.router.route(ctx, self.views(), record=False)
            i = system_id % len(self.names)
            self.router.record(decided, self.names[i])
            self.router.run_upkeep()
            return i, ctx, decided
        views = self.views()
        if self.select is not None:
            await self.router.route(ctx, views, record=False)
            views = list(self.select(self, ctx, views)) or views
        decision = await self.router.route(ctx, views)
        # The placement's upkeep runs once the request is on its way, as the proxy's event
        # loop runs it (this loop never yields to it).
        self.router.run_upkeep()
        winner = decision.winner
        assert winner is not None, decision.reason
        return self.names.index(winner), ctx, decision

    def kick(self, i: int) -> None:
        """Start engine i's next step if it is idle and has work."""
        if self._busy[i]:
            return
        sched = self.scheds[i]
        sched.now = self.now
        plan = sched.schedule()
        if plan is None:
            return
        self._busy[i] = True
        heapq.heappush(self._events, (self.now + plan.duration, next(self._tie), i, plan))

    def next_step(self) -> tuple[int, StepPlan] | None:
        if not self._events:
            return None
        at, _, i, plan = heapq.heappop(self._events)
        for e, n in enumerate(self.inflight):
            self.inflight_area[e] += n * (at - self.now)
        self.now = at
        self._busy[i] = False
        return i, plan


async def run_virtual(
    workload: Workload,
    *,
    policy: str,
    sim: SimConfig,
    engines: int = 4,
    requests: int = 1000,
    concurrency: int = 32,
    plugins: Mapping[str, Any] | None = None,
    scrape_s: float = 2.0,
    publish_kv_pool: bool = True,
    events: Sequence[tuple[int, Callable[[VirtualFleet], None]]] = (),
    kv_events: bool = False,
    on_finish: Callable[[VirtualFleet, int, RequestResult, RouteContext, Seq], None] | None = None,
    roles: Sequence[str] | None = None,
    select: Select | None = None,
    on_start: Callable[[VirtualFleet, int, RequestResult, RouteContext], None] | None = None,
    on_first_token: Callable[[VirtualFleet, int, RequestResult], None] | None = None,
) -> tuple[RunResult, VirtualFleet]:
    """Replay `workload` through `policy` on `engines` simulated engines; virtual seconds.

    `policy` may be STATIC_AFFINITY (system prompt i on engine i mod n: a bound, not a policy).
    `events`: (request index, action) pairs run just before that request is sent, e.g. to
    resize the engines' caches mid-run. `on_finish(fleet, engine, result, ctx, seq)` is called
    as each request completes (what the proxy's telemetry hook sees, for the doctor).
    `roles`, `select(fleet, ctx, views)`, `on_start(fleet, engine, result, ctx)` and
    `on_first_token(fleet, engine, result)` let a prefill/decode split run here: `select`
    narrows each request's candidates to a pool, the hooks feed the decider's window."""
    fleet = VirtualFleet(sim, engines, policy, plugins, scrape_s, publish_kv_pool, kv_events, roles)
    fleet.select = select
    replay = _Replay(fleet, workload, sim, requests, concurrency, events)
    replay.on_start, replay.on_first_token, replay.on_finish = on_start, on_first_token, on_finish
    await replay.run(scrape_s)
    results = replay.results
    results.sort(key=lambda r: r.index)
    run = RunResult(
        label=policy,
        targets=list(fleet.names),
        workload=workload.params(),
        model=sim.model,
        endpoint="chat",
        concurrency=concurrency,
        rate=None,
        requests_planned=requests,
        started_at=datetime.now(UTC).isoformat(timespec="seconds"),
        duration=fleet.now,
        requests=results,
        notes=[f"virtual time: {engines} x {sim.device} engines, {sim.kv_pool_tokens} KV tokens"],
    )
    return run, fleet


class _Replay:
    """One run's state: the workload's queue, the conversations' turns, the requests open on
    the engines; the workers' moves are its methods, and run() steps the fleet's clock."""

    def __init__(
        self,
        fleet: VirtualFleet,
        workload: Workload,
        sim: SimConfig,
        requests: int,
        concurrency: int,
        events: Sequence[tuple[int, Callable[[VirtualFleet], None]]],
    ) -> None:
        self.fleet, self.workload, self.sim = fleet, workload, sim
        self.actions = dict(events)
        self.queue: deque[RequestSpec] = deque(workload.plan(requests))
        self.history: dict[int, list[Message]] = {}
        self.done_turns: set[tuple[int, int]] = set()
        # A worker whose next request is a later turn waits for the earlier one (as the bench
        # does).
        self.pending: dict[tuple[int | None, int], list[RequestSpec]] = {}
        self.failed: set[int] = set()  # conversations whose earlier turn failed
        self.open: dict[str, _Open] = {}
        self.results: list[RequestResult] = []
        self.idle_workers = min(concurrency, requests)
        self.on_start: Callable[[VirtualFleet, int, RequestResult, RouteContext], None] | None
        self.on_first_token: Callable[[VirtualFleet, int, RequestResult], None] | None
        self.on_finish: Callable[[VirtualFleet, int, RequestResult, RouteContext, Seq], None] | None
        self.on_start = self.on_first_token = self.on_finish = None

    async def run(self, scrape_s: float) -> None:
        """Until no engine has work left: scrape on schedule, step the next engine, hand its
        outputs to their requests, refill the workers."""
        fleet = self.fleet
        next_scrape = 0.0
        await self.fill()
        while True:
            if fleet.now >= next_scrape:
                fleet.scrape()
                next_scrape = fleet.now + scrape_s
            step = fleet.next_step()
            if step is None:
                break
            i, step_plan = step
            for out in fleet.scheds[i].complete(step_plan):
                o = self.open.get(out.seq.seq_id)
                if o is not None:
                    await self.output(i, o, out)
            await self.fill()
            fleet.kick(i)

    async def output(self, i: int, o: _Open, out: Any) -> None:
        """A token of request `o` on engine `i` (its first: TTFT; its last: the request ends)."""
        fleet, r, now = self.fleet, o.result, self.fleet.now
        if r.output_chunks == 0:
            r.ttft = now - o.start
            r.cached_tokens = max(out.seq.num_cached, 0)
            fleet.router.observe(
                o.decision, fleet.names[i], r.prompt_tokens, r.cached_tokens, r.ttft
            )
            fleet.router.finished(o.decision)  # prefilled (the proxy's first byte)
            if self.on_first_token is not None:
                self.on_first_token(fleet, i, r)
        else:
            r.itl.append(now - o.last)
        o.last = now
        r.output_chunks += 1
        r.output_chars += len(out.text)
        o.reply.append(out.text)
        if out.finish_reason is None:
            return
        del self.open[out.seq.seq_id]
        fleet.inflight[i] -= 1
        fleet.router.finished(o.decision)  # (a no-op after the first token: as the proxy does)
        r.ok, r.e2e, r.finish_reason = True, now - o.start, out.finish_reason
        r.completion_tokens = r.output_chunks
        if self.on_finish is not None:
            self.on_finish(fleet, i, r, o.ctx, out.seq)
        conv = o.spec.conversation
        if conv is not None:
            self.history[conv] = [
                *o.history,
                {"role": "user", "content": self.workload.user_text(o.spec)},
                {"role": "assistant", "content": "".join(o.reply)},
            ]
        await self.turn_over(o.spec, ok=True)

    async def issue(self, spec: RequestSpec) -> None:
        fleet, workload, sim = self.fleet, self.workload, self.sim
        conv = spec.conversation
        past = self.history.get(conv, []) if conv is not None else []
        messages = workload.messages(spec, past)
        body: dict[str, Any] = {"model": sim.model, "messages": messages}
        body["max_tokens"] = spec.max_tokens
        if (user := workload.user(spec)) is not None:
            body["user"] = user
        rid = f"req-{spec.index}"
        action = self.actions.pop(spec.index, None)
        if action is not None:
            action(fleet)
        prompt = tokens.tokenize(tokens.render_chat(messages), sim.chars_per_token)
        i, ctx, decision = await fleet.route(rid, body, spec.system_id, prompt)
        seq = make_seq(fleet.cfgs[i], rid, prompt, spec.max_tokens)
        fleet.scheds[i].now = fleet.now
        r = RequestResult(
            index=spec.index,
            target=fleet.names[i],
            kind=spec.kind,
            conversation=conv,
            turn=spec.turn,
            system_id=spec.system_id,
            start=fleet.now,
            prompt_tokens=len(prompt),
        )
        self.results.append(r)
        try:
            fleet.scheds[i].add(seq)
        except ValueError as e:  # the engine refuses it (longer than its KV pool): a 400
            r.http_status, r.error_kind, r.error = 400, "http_400", str(e)
            await self.turn_over(spec, ok=False)
            return
        fleet.inflight[i] += 1
        fleet.served[i] += 1
        self.open[rid] = _Open(spec, r, i, fleet.now, ctx, decision, history=past)
        if self.on_start is not None:
            self.on_start(fleet, i, r, ctx)
        fleet.kick(i)

    async def start(self, spec: RequestSpec) -> None:
        """A worker takes `spec`: send it, or fail it if its conversation already failed."""
        conv = spec.conversation
        if conv is not None and conv in self.failed:
            self.results.append(
                RequestResult(
                    index=spec.index,
                    target="",
                    kind=spec.kind,
                    conversation=conv,
                    turn=spec.turn,
                    system_id=spec.system_id,
                    start=self.fleet.now,
                    error_kind="dependency",
                    error="an earlier turn of this conversation failed",
                )
            )
            await self.turn_over(spec, ok=False)
            return
        await self.issue(spec)

    async def turn_over(self, spec: RequestSpec, ok: bool) -> None:
        """`spec` is done: its worker is free, and the conversation's next turn may go."""
        self.idle_workers += 1
        conv = spec.conversation
        if conv is None:
            return
        if not ok:
            self.failed.add(conv)
        self.done_turns.add((conv, spec.turn))
        for nxt in self.pending.pop((conv, spec.turn), []):
            await self.start(nxt)  # on the worker that has been holding it since it was queued

    async def fill(self) -> None:
        """Hand queued requests to idle workers; a later turn blocks its worker until ready."""
        queue = self.queue
        while self.idle_workers and queue:
            spec = queue.popleft()
            self.idle_workers -= 1
            key = (spec.conversation, spec.turn - 1)
            if spec.conversation is not None and spec.turn > 0 and key not in self.done_turns:
                self.pending.setdefault(key, []).append(spec)
                continue
            await self.start(spec)


def engine_stats(fleet: VirtualFleet) -> list[dict[str, Any]]:
    """Per engine: requests, mean in-flight, prefix hits, evictions, busy time (for the demo)."""
    out = []
    for i, (name, s) in enumerate(zip(fleet.names, fleet.scheds, strict=True)):
        out.append(
            {
                "engine": name,
                "requests": fleet.served[i],
                "mean_inflight": fleet.inflight_area[i] / fleet.now if fleet.now else 0.0,
                "prompt_tokens": s.prefix_queries,
                "hit_tokens": s.prefix_hits,
                "evictions": s.pool.evictions,
                "preemptions": s.preemptions,
                "busy_s": s.busy_seconds,
            }
        )
    return out
