"""Prefill/decode flows in the forwarder: the pool split and the two-leg KV-transfer flows.

Used only when `disagg.mode` is `on` or `auto` (with `off` the forwarder never calls this).
Per request, after routing:

- The controller (proxy/disagg/controller.py, pure) plans the request from its uncached prompt
  on the decode pool and its expected output: one leg on a pool, or two legs (prefill pool,
  then decode pool) for a chat or completions prompt over the threshold when both pools hold
  engines of one KV-transfer flow. A pool is used only inside the router's own ranking (what
  it filtered out stays out); P/D-role backends the role filter set aside for whole requests
  join when they can serve. No pool member left: the router's ranking. Inside a pool, the
  router's winner first when a member, else the member holding most of the prompt (prefix
  affinity); the decode leg goes to the least loaded decode backend.
- vLLM (NixlConnector style): the prefill leg is a one-token non-streaming request carrying
  `kv_transfer_params`; its answer's params go into the decode leg, which is the client's
  request and streams to the client. Sequential.
- SGLang: the same body with `bootstrap_host/port/room` goes to the prefill and the decode
  backend at once (an anyio task group: if either side fails or the client leaves, the other
  is cancelled and its connection closed); the client's stream comes from decode, the prefill
  answer is drained.
- Any prefill-leg failure (an error, a stall past the first-byte timeout, no KV params) falls
  back to decode-only on the decode backend (the engine prefills itself), with the reason
  logged and on the span (`warmroute.pd.fallback`).
- Retries are not decided here: a request back after a failed leg re-enters the attempt
  loop with a `Resume`; proxy/forwarding/retry.py says whether and where, to one deadline per
  request.

The decider's window sees what each engine really did: the prefill leg opens its long-prefill
interval on the prefill engine, the decode leg none (its KV came over the link), a decode-only
fallback the whole prompt. Spans: each leg is a CLIENT span of the request (`warmroute.pd.leg`:
prefill, decode, or decode_only for a fallback), the KV-transfer wait an INTERNAL span
`kv_transfer`: from when the decode engine may pull the KV (the prefill answer for vLLM, the
decode leg sent for SGLang) to the decode leg's first output byte.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import orjson

from proxy.asgi import Send
from proxy.disagg.controller import DisaggController
from proxy.disagg.legs import (
    bootstrap_host,
    flow_for,
    prefill_kv_params,
    rooms_of,
    sglang_body,
    vllm_decode_body,
    vllm_prefill_body,
)
from proxy.disagg.pools import BackendState, RequestPlan, uncached_tokens
from proxy.disagg.window import RequestFacts, itl_quantiles
from proxy.forwarding.attempts import Answered, Attempts
from proxy.forwarding.exchange import Exchange
from proxy.forwarding.request_headers import upstream_headers
from proxy.forwarding.retry import Resume, Retry, describe
from proxy.routing.types import Verdict, verdict_of
from proxy.types import FailureKind

if TYPE_CHECKING:
    from proxy.forwarding.ports import Fleet
    from proxy.forwarding.state import RequestRouting
    from proxy.routing.types import BackendView
    from proxy.telemetry import RequestRecord
    from proxy.telemetry.record import AttemptRecord
    from proxy.types import StreamFacts

Result = Answered | None

log = logging.getLogger("warmroute.disagg")

PREFILL_ANSWER_LIMIT = 1 << 20  # a one-token answer; more is not a prefill leg's
# SGLang: once the decode leg has streamed, its engine had the KV, so the prefill answer is
# due; a prefill engine that still has not answered by then is not waited for longer.
PREFILL_DRAIN_S = 5.0


@dataclass(eq=False)
class _Flow:
    """One request's way through the flows: the attempt step it varies, and what its legs
    have said so far. Also the `Watch` its attempts report to."""

    flows: PdFlows
    attempts: Attempts
    ex: Exchange
    record: RequestRecord
    send: Send
    leg: str | None = None  # warmroute.pd.leg of its next attempts (None: a single leg)
    prefilled: int | None = None  # prompt tokens its prefill leg computed

    def started(self, backend: str, now: float, attempt: AttemptRecord) -> None:
        """An attempt is about to be sent: tag its span with its leg and tell the window what
        this engine has to prefill (nothing, when its KV comes over)."""
        if self.leg is not None:
            attempt.set_attribute("warmroute.pd.leg", self.leg)
        uncached = 0 if self.leg == "decode" else self.flows.uncached_on(self.ex, backend)
        self.flows.ctl.started(self.ex.request_id, backend, now, uncached)

    async def run(
        self,
        ranking: list[str],
        first: str,
        *,
        body: bytes | None = None,
        final: bool = True,
        resume: Resume | None = None,
    ) -> Result:
        """The attempt step on `ranking` from `first`, watched by this flow."""
        ex = self.ex
        return await self.attempts.run(
            ex,
            ranking,
            first,
            self.record,
            self.send,
            body=body,
            final=final,
            resume=resume,
            watch=self,
        )


class PdFlows:
    """The forwarder's prefill/decode part for one proxy replica."""

    def __init__(
        self,
        controller: DisaggController,
        fleet: Fleet,
        steering: RequestRouting,
        chars_per_token: float = 4.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.ctl = controller
        self.fleet = fleet
        self.steering = steering
        self.chars_per_token = chars_per_token
        self.rng = rng or random.SystemRandom()
        self.clock = clock  # the request path's clock (Exchange.t0, StreamFacts times)
        self.counts: dict[str, int] = {}  # plans and fallbacks, for /admin/disagg
        self._due = 0.0  # when the decider looks next (self.clock)

    # -- the window the decider judges from ----------------------------------------------
    def states(self) -> list[BackendState]:
        return [
            BackendState(v.name, v.role, _up(v), v.inflight, flow_for(v.engine))
            for v in self.steering.views()
        ]

    def finished(self, flow: _Flow, backend: str, facts: StreamFacts | None) -> None:
        ex = flow.ex
        rid = ex.request_id
        prefilled = flow.prefilled
        now = self.clock()
        ok = facts is not None and facts.error is None and not facts.cancelled
        if facts is not None and facts.first_output_at is not None:
            self.ctl.first_token(rid, facts.first_output_at)
        q = itl_quantiles(facts.itl_s) if facts is not None and facts.itl_s else None
        prompt = (facts.input_tokens if facts else None) or self._prompt_tokens(ex)
        if prefilled is not None:
            # The decode engine reports the transferred KV as cached: the prompt's prefill
            # demand is what the prefill leg computed.
            uncached = prefilled
        elif facts is not None and facts.input_tokens:
            uncached = max(0, facts.input_tokens - (facts.cached_tokens or 0))
        else:
            uncached = self.uncached_on(ex, backend)
        self.ctl.finished(
            RequestFacts(
                request_id=rid,
                backend=backend,
                arrival=ex.t0,
                prompt_tokens=prompt,
                uncached_tokens=uncached,
                output_tokens=(facts.output_tokens or 0) if facts else 0,
                finished_at=now,
                first_token_at=facts.first_output_at if facts else None,
                itl_p50_s=q[0] if q else None,
                itl_p99_s=q[1] if q else None,
                ok=ok,
            ),
            generates=ex.api != "embeddings",
        )

    def _prompt_tokens(self, ex: Exchange) -> int:
        d = ex.decision
        chars = d.prompt_chars if d is not None else 0
        return math.ceil(chars / self.chars_per_token)

    def uncached_on(self, ex: Exchange, backend: str) -> int:
        d = ex.decision
        if d is None:
            return 0
        return uncached_tokens(
            d.prompt_chars, d.matched_blocks.get(backend, 0), d.block_chars, self.chars_per_token
        )

    # -- the decider ---------------------------------------------------------------------
    def evaluate(self, now: float | None = None) -> None:
        """Let the decider look at its window, at most every disagg.evaluate_s; called per
        request and on every read of its state, so an idle proxy reports the window now."""
        now = self.clock() if now is None else now
        if now < self._due:
            return
        self._due = now + self.ctl.cfg.evaluate_s
        decision = self.ctl.evaluate(now, self.states(), force=True)
        if decision is not None and decision.changed:
            log.info("disaggregation %s: %s", "on" if decision.active else "off", decision.reason)

    def gauges(self) -> tuple[bool, dict[str, float]]:
        """(active, the decider's numeric inputs) for warmroute.disagg.* metrics."""
        self.evaluate()
        d = self.ctl.decider
        inputs = d.last.inputs() if d.last else {}
        return d.active, {
            k: float(v)
            for k, v in inputs.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }

    def state(self) -> dict[str, Any]:
        """GET /admin/disagg."""
        self.evaluate()
        out = self.ctl.state()
        out["requests"] = dict(self.counts)
        # The clock `switched_at` and each switch's `at` are read on (the process's monotonic
        # clock): a reader turns them into ages, or wall-clock times, with it.
        out["now"] = self.clock()
        return out

    # -- one request ---------------------------------------------------------------------
    def plan(self, ex: Exchange, ranking: Sequence[str]) -> RequestPlan:
        """Classified by what the decode pool would have to prefill (its best member): a
        document cached only in the prefill pool is still a long prefill for a decode engine,
        so it goes back to the prefill engine that holds it. Without a split: the winner's."""
        self.evaluate()
        split = self.ctl.split
        names = [n for n in ranking if n in split.decode] if split is not None else []
        names = names or ([] if split is None else list(split.decode)) or list(ranking[:1])
        uncached = min((self.uncached_on(ex, n) for n in names), default=0)
        return self.ctl.plan(ex.body, self._prompt_tokens(ex), uncached, self.states(), ex.api)

    async def run(
        self,
        attempts: Attempts,
        ex: Exchange,
        ranking: list[str],
        record: RequestRecord,
        send: Send,
    ) -> None:
        """The attempt step's variant: the request planned on the pools, its legs sent
        through `attempts` (the endpoint's step), and what it did told to the window."""
        plan = self.plan(ex, ranking)
        self._count(f"{plan.legs}:{plan.request_class}")
        flow = _Flow(self, attempts, ex, record, send)
        if plan.legs == "two" and plan.flow is not None:
            result = await self._two_legs(flow, ranking, plan)
        else:
            pool = self._pool(ex, ranking, plan.candidates) if plan.candidates else []
            pool = await self._ordered(ex, pool, ranking)
            if plan.candidates and not pool:
                self._count("pool_unavailable")  # every member filtered out: as routed
            if pool:
                record.set_attribute("warmroute.pd.pool", plan.request_class)
            # Retries stay in the pool, then the rest of the router's ranking.
            order = pool + [n for n in ranking if n not in pool]
            result = await flow.run(order, order[0])
        if result is not None:
            self.finished(flow, result[0], result[1])

    def _pool(self, ex: Exchange, ranking: Sequence[str], pool: Sequence[str]) -> list[str]:
        """The pool's backends the router ranked, in its order; then its P/D-role backends
        that only the role filter set aside, when they can serve this request."""
        members = set(pool)
        out = [n for n in ranking if n in members]
        dropped = ex.decision.filtered_out if ex.decision is not None else {}
        aside = [n for n in pool if n not in out and verdict_of(dropped.get(n, "")) is Verdict.ROLE]
        if aside:
            model = str(ex.body.get("model", ""))
            views = {v.name: v for v in self.steering.views()}
            out += [n for n in aside if (v := views.get(n)) is not None and _can_serve(v, model)]
        return out

    async def _ordered(self, ex: Exchange, names: list[str], ranking: Sequence[str]) -> list[str]:
        """A pool's backends in the order to try them: the router's winner first when it is
        one of them (it weighed prefix and load); otherwise the one holding the most of the
        prompt (prefix affinity inside the pool), ties in the router's order, then by load.
        Backends the router did not rank (set aside by the role filter before its index
        lookup) are looked up now."""
        if not names or (ranking and names[0] == ranking[0]):
            return names
        d = ex.decision
        ranked = {n: i for i, n in enumerate(ranking)}
        unranked = [n for n in names if n not in ranked]
        index = self.steering.router.index
        if unranked and d is not None and d.blocks and index is not None:
            # The decision's matches grow by theirs: the legs' records and the window's
            # uncached prompts read them there.
            d.matched_blocks.update(await index.lookup(d.blocks, unranked))
        matched = d.matched_blocks if d is not None else {}
        inflight = {v.name: v.inflight for v in self.steering.views()}
        return sorted(
            names,
            key=lambda n: (-matched.get(n, 0), ranked.get(n, len(ranked)), inflight.get(n, 0)),
        )

    async def _two_legs(self, flow: _Flow, ranking: list[str], plan: RequestPlan) -> Result:
        ex, record = flow.ex, flow.record
        decode_pool = self._pool(ex, ranking, plan.candidates)
        if not decode_pool:
            self._count("pool_unavailable")
            return await flow.run(list(ranking), ranking[0])
        decode = self._least_loaded(decode_pool)
        # The per-request threshold is judged on the decode backend: what it would prefill.
        uncached = self.uncached_on(ex, decode)
        if uncached < self.ctl.cfg.threshold_tokens:
            self._count("short_on_decode")
            record.set_attribute("warmroute.pd.pool", "decode")
            return await flow.run(_first(decode_pool, decode), decode)
        prefill_pool = self._pool(ex, ranking, plan.prefill_candidates)
        if not prefill_pool:
            self._count("no_prefill_backend")
            why = "no backend of the prefill pool can serve it"
            return await self._fallback(flow, why, decode, decode_pool, failed=False)
        prefill_pool = await self._ordered(ex, prefill_pool, ranking)
        prefill = prefill_pool[0]
        record.set_attribute("warmroute.pd.flow", plan.flow or "")
        if plan.flow == "vllm":
            return await self._vllm(flow, prefill, decode, decode_pool)
        return await self._sglang(flow, prefill, decode, decode_pool)

    async def _vllm(self, flow: _Flow, prefill: str, decode: str, decode_pool: list[str]) -> Result:
        ex = flow.ex
        body = orjson.dumps(vllm_prefill_body(ex.body))
        params: dict[str, Any] | None = None
        try:
            answer = await self._prefill_leg(flow, prefill, body)
            params = prefill_kv_params(answer)
            if params is None:
                raise Retry(
                    "its answer carried no kv_transfer_params (is a KV connector configured?)",
                    "pd_no_kv_params",
                    FailureKind.PROTOCOL,
                )
        except Retry as r:
            self._count("prefill_failed")
            why = f"prefill leg on {prefill} failed ({r.reason})"
            return await self._fallback(flow, why, decode, decode_pool)
        flow.prefilled = _prefilled(answer, self.uncached_on(ex, prefill))
        t_ready = time.time_ns()
        raw = orjson.dumps(vllm_decode_body(ex.body, params))
        return await self._decode_leg(flow, decode, decode_pool, raw, t_ready)

    async def _sglang(
        self, flow: _Flow, prefill: str, decode: str, decode_pool: list[str]
    ) -> Result:
        ex = flow.ex
        pb = self.fleet[prefill]
        body = sglang_body(ex.body, bootstrap_host(pb.url), pb.cfg.bootstrap_port, self.rng)
        raw = orjson.dumps(body)
        log.debug("request %s: SGLang rooms %s via %s", ex.request_id, rooms_of(body), prefill)
        flow.prefilled = self.uncached_on(ex, prefill)
        failure: list[Retry] = []
        result: Result = None
        decode_scope = anyio.CancelScope()
        prefill_done = anyio.Event()

        async def prefill_leg() -> None:
            try:
                await self._prefill_leg(flow, prefill, raw)
            except Retry as r:
                failure.append(r)
                if not ex.started_response:
                    decode_scope.cancel()  # it would wait for KV that never comes
            finally:
                prefill_done.set()

        t_ready = time.time_ns()
        prefill_pending = False
        async with anyio.create_task_group() as tg:
            tg.start_soon(prefill_leg)
            with decode_scope:
                result = await self._decode_leg(
                    flow, decode, decode_pool, raw, t_ready, fallback=False
                )
            # A decode leg that gave up while its prefill leg had not answered was waiting for
            # KV that was not coming: the prefill stalled, not the decode engine.
            prefill_pending = result is None and not prefill_done.is_set()
            if result is not None and not ex.client_gone:
                # The decode engine had its KV; the prefill answer is only drained.
                with anyio.move_on_after(PREFILL_DRAIN_S):
                    await prefill_done.wait()
            tg.cancel_scope.cancel()  # the client left, or decode failed: close the prefill
        if result is not None or ex.client_gone or ex.started_response:
            return result
        if failure or prefill_pending:
            self._count("prefill_failed")
            if failure:
                why = f"prefill leg on {prefill} failed ({failure[0].reason})"
            else:
                why = (
                    f"prefill leg on {prefill} had not answered when the decode leg on {decode} "
                    "gave up waiting for its KV"
                )
            return await self._fallback(flow, why, decode, decode_pool)
        return await self._decode_only(flow, decode, decode_pool)

    async def _prefill_leg(self, flow: _Flow, name: str, body: bytes) -> Any:
        """Send the prefill leg and read its (small, whole) answer; failures raise Retry."""
        ex, record = flow.ex, flow.record
        backend = self.fleet[name]
        headers = upstream_headers(ex, backend, ex.client)
        attempt = record.attempt(
            backend=name, address=backend.host, port=backend.port, attempt=len(ex.attempts) + 1
        )
        attempt.set_attribute("warmroute.pd.leg", "prefill")
        attempt.inject_headers(headers)
        ex.attempts.append(name)
        self.fleet.mark_attempt(backend)
        self.steering.inflight(name, +1)
        key = ex.request_id + "/prefill"
        self.ctl.prefill_started(key, name, self.clock(), self.uncached_on(ex, name))
        try:
            upstream = await flow.attempts.open_leg(ex, backend, body, headers)
            try:
                if upstream.status != 200:
                    status = upstream.status
                    raise Retry(f"HTTP {status}", f"http_{status}", FailureKind.STATUS)
                payload = await upstream.read(PREFILL_ANSWER_LIMIT)
            except (TimeoutError, OSError, ValueError) as e:
                why = f"its answer broke off: {describe(e)}"
                raise Retry(why, "body_error", FailureKind.PROTOCOL) from e
            finally:
                upstream.release()  # an answer not read to its end closes the connection
            try:
                answer = orjson.loads(payload) if payload[:1] in (b"{", b"[") else None
            except orjson.JSONDecodeError:
                answer = None  # SGLang's prefill answer may be a stream: drained all the same
            self.fleet.mark_success(backend)
            attempt.done(upstream.status)
            return answer
        except Retry as r:
            attempt.fail(r.error_type, r.status)
            self.fleet.mark_failure(backend, r.reason, kind=r.kind)
            raise
        except Exception as e:  # upstream read errors are typed UpstreamError
            other = Retry(describe(e), "prefill_error", FailureKind.PROTOCOL)
            attempt.fail(other.error_type)
            self.fleet.mark_failure(backend, other.reason, kind=other.kind)
            raise other from e
        except BaseException as e:  # cut: no verdict, but a half-open probe must hear it ended
            self.fleet.mark_failure(backend, type(e).__name__, kind=FailureKind.CANCELLED)
            raise
        finally:
            self.ctl.prefill_ended(key, self.clock())
            self.steering.inflight(name, -1)

    async def _decode_leg(
        self,
        flow: _Flow,
        decode: str,
        decode_pool: list[str],
        raw: bytes,
        t_ready_ns: int,
        fallback: bool = True,
    ) -> Result:
        """The decode leg streams to the client; a failure before its first byte retries on
        the decode pool as decode-only (the KV it was to receive belongs to that engine)."""
        ex, record = flow.ex, flow.record
        flow.leg = "decode"
        try:
            result = await flow.run([decode], decode, body=raw, final=False)
        finally:
            flow.leg = None
        if result is not None:
            facts = result[1]
            if facts is not None and facts.first_output_at is not None:
                ago_ns = int((self.clock() - facts.first_output_at) * 1e9)
                record.interval(
                    "kv_transfer",
                    t_ready_ns,
                    max(t_ready_ns, time.time_ns() - ago_ns),
                    {"warmroute.pd.decode_backend": decode},
                )
            return result
        if not fallback or ex.client_gone or ex.started_response:
            return None
        return await self._decode_only(flow, decode, decode_pool)

    async def _decode_only(self, flow: _Flow, failed: str, decode_pool: list[str]) -> Result:
        """The decode leg failed before its first byte: the request whole, retried on the rest
        of the decode pool as the retry policy allows (the KV it was to receive is lost)."""
        self._count("decode_leg_failed")
        flow.prefilled = None
        flow.leg = "decode_only"
        why = f"decode leg on {failed} failed before its first byte"
        return await flow.run(decode_pool, failed, resume=Resume(why))

    async def _fallback(
        self, flow: _Flow, why: str, decode: str, decode_pool: list[str], failed: bool = True
    ) -> Result:
        """No KV to decode from: the request whole on the decode backend, which prefills it.
        After a failed prefill leg (`failed`) the retry policy has the last word (deadline)."""
        ex = flow.ex
        flow.prefilled = None
        said = f"{why}; decode-only on {decode}"
        flow.record.set_attribute("warmroute.pd.fallback", said)
        if ex.client_gone:
            return None
        log.warning("request %s: %s", ex.request_id, said)
        flow.leg = "decode_only"
        resume = Resume(why, fallback=True) if failed else None
        return await flow.run(_first(decode_pool, decode), decode, resume=resume)

    def _least_loaded(self, names: list[str]) -> str:
        inflight = {v.name: v.inflight for v in self.steering.views()}
        return min(names, key=lambda n: (inflight.get(n, 0), names.index(n)))

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1


def _up(view: BackendView) -> bool:
    """Whether a backend counts for the pools: healthy, not ejected, serving some model. Not
    its in-flight bound: pools following a per-request state would move engines and caches."""
    return view.healthy and (view.models is None or bool(view.models))


def _can_serve(view: BackendView, model: str) -> bool:
    """What the router's model and health filters would say of a backend for this request."""
    full = view.max_inflight is not None and view.inflight >= view.max_inflight
    return view.healthy and view.serves(model) and not full


def _prefilled(answer: Any, predicted: int) -> int:
    """Prompt tokens the prefill leg computed: its usage (prompt - cached), else predicted."""
    usage = answer.get("usage") if isinstance(answer, Mapping) else None
    if isinstance(usage, Mapping) and isinstance(usage.get("prompt_tokens"), int):
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
        return max(0, usage["prompt_tokens"] - (cached if isinstance(cached, int) else 0))
    return predicted


def _first(names: list[str], first: str) -> list[str]:
    return [first, *(n for n in names if n != first)]


__all__ = ["PdFlows"]
