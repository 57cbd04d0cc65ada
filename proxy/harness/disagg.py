"""The prefill/decode pool split on the virtual fleet: the decider benchmarked in virtual time.

`run_virtual_disagg` runs a workload through `run_virtual` with a DisaggController wired in as
the proxy would hold it: every request is classified from its uncached prompt (the router's
prefix index, as in the proxy) and its expected output, narrowed to a pool while the split is
active, and every start, first token and finish feeds the decider's window, which is evaluated
every `disagg.evaluate_s` of virtual time. In `auto`, requests are routed exactly as with
disagg off while the split is off (no pools, no dry-run route), so a run that never switches
is the off run, request for request. The engines stay whole-request engines (no KV
transfer in virtual time): this measures the pool split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.bench.results import RequestResult, RunResult
from proxy.bench.workloads import Workload
from proxy.config import DisaggConfig
from proxy.disagg.controller import DisaggController
from proxy.disagg.pools import BackendState, uncached_tokens
from proxy.disagg.replay import facts_of
from proxy.harness.virtual import VirtualFleet, run_virtual
from proxy.routing.types import BackendView, RouteContext
from proxy.sim.config import SimConfig


async def run_virtual_disagg(
    workload: Workload,
    *,
    sim: SimConfig,
    cfg: DisaggConfig,
    engines: int = 6,
    requests: int = 1000,
    concurrency: int = 48,
    policy: str = "prefix_aware",
    roles: Sequence[str] | None = None,
    **kwargs: Any,
) -> tuple[RunResult, VirtualFleet, DisaggController]:
    """`workload` on `engines` virtual engines with `disagg` as configured; the run, the fleet
    and the controller (its decider's state() and switches say what it did and why)."""
    ctl = DisaggController(cfg)
    hooks = _Hooks(ctl, cfg.mode)
    run, fleet = await run_virtual(
        workload,
        policy=policy,
        sim=sim,
        engines=engines,
        requests=requests,
        concurrency=concurrency,
        roles=roles,
        select=hooks.select if cfg.mode == "on" else None,
        on_start=hooks.on_start,
        on_first_token=hooks.on_first,
        on_finish=hooks.on_finish,
        **kwargs,
    )
    run.label = f"disagg {cfg.mode}"
    run.notes.append(f"disagg: {ctl.decider.reason}")
    return run, fleet, ctl


class _Hooks:
    """What the proxy's P/D flows do around a request, as run_virtual's hooks: the
    controller's window fed from each request's start, first token and end, and its plan
    narrowing each request's candidates to a pool."""

    def __init__(self, ctl: DisaggController, mode: str) -> None:
        self.ctl, self.mode = ctl, mode

    @staticmethod
    def states(fleet: VirtualFleet) -> list[BackendState]:
        return [
            BackendState(name, fleet.roles[i], True, fleet.inflight[i])
            for i, name in enumerate(fleet.names)
        ]

    def select(
        self, fleet: VirtualFleet, ctx: RouteContext, views: list[BackendView]
    ) -> list[BackendView]:
        ctl = self.ctl
        backends = self.states(fleet)
        ctl.evaluate(ctx.now, backends)
        # As the proxy (proxy/forwarding/pdflow.py): judged on what the decode pool would prefill.
        split = ctl.split
        pool = [v for v in views if split is None or v.name in split.decode] or views
        uncached = min(
            uncached_tokens(
                ctx.prompt_chars,
                ctx.matched_blocks.get(v.name, 0),
                ctx.block_chars,
                fleet.cfgs[0].chars_per_token,
            )
            for v in pool
        )
        prompt = -(-ctx.prompt_chars // fleet.cfgs[0].chars_per_token)
        plan = ctl.plan(ctx.body, prompt, uncached, backends)
        if not plan.candidates:
            return views
        keep = set(plan.candidates)
        return [v for v in views if v.name in keep]

    def on_start(
        self, fleet: VirtualFleet, engine: int, r: RequestResult, ctx: RouteContext
    ) -> None:
        chars = fleet.cfgs[0].chars_per_token
        uncached = uncached_tokens(
            ctx.prompt_chars, ctx.matched_blocks.get(fleet.names[engine], 0), ctx.block_chars, chars
        )
        self.ctl.started(str(r.index), fleet.names[engine], fleet.now, uncached)

    def on_first(self, fleet: VirtualFleet, engine: int, r: RequestResult) -> None:
        self.ctl.first_token(str(r.index), fleet.now)

    def on_finish(self, fleet: VirtualFleet, engine: int, r: RequestResult, *_: Any) -> None:
        ctl = self.ctl
        ctl.finished(facts_of(r))
        ctl.evaluate(fleet.now, self.states(fleet))
        if self.mode == "auto":
            # No pools while the split is off: routed exactly as with disagg off (selecting
            # takes a dry-run route first, which moves the router's placement state).
            fleet.select = self.select if ctl.split is not None else None
