"""Prefill/decode flows in the forwarder: the pool split and the two-leg KV-transfer flows.

Used only when `disagg.mode` is `on` or `auto` (with `off` the forwarder never calls this).
Per request, after routing:

- The controller (proxy/disagg/controller.py, pure) classifies the request from its uncached
  prompt on the router's winner and its expected output, and plans it: one leg on a pool, or
  two legs (prefill on the prefill pool, decode on the decode pool) when both pools hold
  engines that speak the same KV-transfer flow. Prefix affinity is kept inside each pool: a
  pool's backends are tried in the router's own order.
- vLLM (NixlConnector style): the prefill leg is a one-token non-streaming request carrying
  `kv_transfer_params`; its answer's params go into the decode leg, which is the client's
  request and streams to the client. Sequential.
- SGLang: the same body with `bootstrap_host/port/room` goes to the prefill and the decode
  backend at once (an anyio task group: if either side fails or the client leaves, the other
  is cancelled); the client's stream comes from decode, the prefill answer is drained.
- Any prefill-leg failure falls back to decode-only on the decode pool (the engine prefills
  itself), with the reason logged and on the span.

Spans: each leg is a CLIENT span of the request (`warmroute.pd.leg` prefill | decode) and
the KV-transfer wait is an INTERNAL span `kv_transfer`: from the moment the decode engine may
start pulling the KV (the prefill answer for vLLM, the decode leg sent for SGLang) to the
decode leg's first output byte.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import orjson

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
from proxy.exchange import Exchange
from proxy.relay import upstream_headers
from proxy.retry import Retry, describe

if TYPE_CHECKING:
    from proxy.backends import Backend
    from proxy.meter import StreamFacts
    from proxy.ports import Fleet, UpstreamResponseLike
    from proxy.state import RequestRouting
    from proxy.telemetry import RequestRecord

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("warmroute.disagg")

PREFILL_ANSWER_LIMIT = 1 << 20  # a one-token answer; more is not a prefill leg's


class Legs(Protocol):
    """What the flows use of the forwarder (proxy.forward.ProxyEndpoint)."""

    path: str

    async def open_leg(
        self,
        ex: Exchange,
        backend: Backend,
        body: bytes,
        headers: dict[str, str],
        fresh: bool = False,
        path: str | None = None,
    ) -> UpstreamResponseLike: ...

    async def attempts(
        self,
        ex: Exchange,
        ranking: list[str],
        first: str,
        record: RequestRecord,
        send: Send,
        body: bytes | None = None,
        final: bool = True,
    ) -> tuple[str, StreamFacts | None] | None: ...


class PdFlows:
    """The forwarder's prefill/decode part for one proxy replica."""

    def __init__(
        self,
        controller: DisaggController,
        fleet: Fleet,
        steering: RequestRouting,
        chars_per_token: float = 4.0,
        rng: random.Random | None = None,
    ) -> None:
        self.ctl = controller
        self.fleet = fleet
        self.steering = steering
        self.chars_per_token = chars_per_token
        self.rng = rng or random.SystemRandom()
        self.counts: dict[str, int] = {}  # plans and fallbacks, for /admin/disagg
        self._uncached: dict[str, int] = {}  # request id -> uncached tokens, while open
        self._due = 0.0  # when the decider looks next (perf_counter)

    # -- the window the decider judges from ----------------------------------------------
    def states(self) -> list[BackendState]:
        return [
            BackendState(v.name, v.role, v.healthy, v.inflight, flow_for(v.engine))
            for v in self.steering.views()
        ]

    def started(self, ex: Exchange, backend: str, now: float) -> None:
        self.ctl.started(ex.request_id, backend, now, self._uncached.get(ex.request_id, 0))

    def finished(self, ex: Exchange, backend: str, facts: StreamFacts | None) -> None:
        uncached = self._uncached.pop(ex.request_id, 0)
        now = time.perf_counter()
        ok = facts is not None and facts.error is None and not facts.cancelled
        if facts is not None and facts.first_output_at is not None:
            self.ctl.first_token(ex.request_id, facts.first_output_at)
        q = itl_quantiles(facts.itl_s) if facts is not None and facts.itl_s else None
        prompt = (facts.input_tokens if facts else None) or self._prompt_tokens(ex)
        cached = (facts.cached_tokens if facts else None) or 0
        self.ctl.finished(
            RequestFacts(
                request_id=ex.request_id,
                backend=backend,
                arrival=ex.t0,
                prompt_tokens=prompt,
                uncached_tokens=max(0, prompt - cached)
                if facts and facts.input_tokens
                else uncached,
                output_tokens=(facts.output_tokens or 0) if facts else 0,
                finished_at=now,
                first_token_at=facts.first_output_at if facts else None,
                itl_p50_s=q[0] if q else None,
                itl_p99_s=q[1] if q else None,
                ok=ok,
            )
        )

    def _prompt_tokens(self, ex: Exchange) -> int:
        ctx = ex.ctx
        chars = ctx.prompt_chars if ctx is not None else 0
        return math.ceil(chars / self.chars_per_token)

    def _uncached_on(self, ex: Exchange, backend: str) -> int:
        ctx = ex.ctx
        if ctx is None:
            return 0
        return uncached_tokens(
            ctx.prompt_chars,
            ctx.matched_blocks.get(backend, 0),
            ctx.block_chars,
            self.chars_per_token,
        )

    # -- one request ---------------------------------------------------------------------
    def evaluate(self, now: float) -> None:
        """Let the decider look at its window, at most every disagg.evaluate_s."""
        if now < self._due:
            return
        self._due = now + self.ctl.cfg.evaluate_s
        decision = self.ctl.evaluate(now, self.states(), force=True)
        if decision is not None and decision.changed:
            log.info("disaggregation %s: %s", "on" if decision.active else "off", decision.reason)

    def plan(self, ex: Exchange, ranking: Sequence[str]) -> RequestPlan:
        self.evaluate(time.perf_counter())
        winner = ranking[0] if ranking else ""
        uncached = self._uncached_on(ex, winner)
        self._uncached[ex.request_id] = uncached
        return self.ctl.plan(ex.body, self._prompt_tokens(ex), uncached, self.states())

    async def forward(
        self,
        legs: Legs,
        ex: Exchange,
        ranking: list[str],
        record: RequestRecord,
        send: Send,
    ) -> None:
        plan = self.plan(ex, ranking)
        self._count(f"{plan.legs}:{plan.request_class}")
        in_pool = _in_order(ranking, plan.candidates) if plan.candidates else list(ranking)
        result: tuple[str, StreamFacts | None] | None = None
        if plan.legs == "two" and plan.flow is not None:
            result = await self._two_legs(legs, ex, ranking, plan, record, send)
        else:
            if plan.candidates:
                record.set_attribute("warmroute.pd.pool", plan.request_class)
            result = await legs.attempts(ex, in_pool, in_pool[0], record, send)
        if result is not None:
            self.finished(ex, result[0], result[1])
        else:
            self._uncached.pop(ex.request_id, None)

    async def _two_legs(
        self,
        legs: Legs,
        ex: Exchange,
        ranking: list[str],
        plan: RequestPlan,
        record: RequestRecord,
        send: Send,
    ) -> tuple[str, StreamFacts | None] | None:
        decode_pool = _in_order(ranking, plan.candidates)
        decode = self._least_loaded(decode_pool)
        # The per-request threshold is judged on the decode backend: what it would prefill.
        uncached = self._uncached_on(ex, decode)
        if uncached < self.ctl.cfg.threshold_tokens:
            self._count("short_on_decode")
            record.set_attribute("warmroute.pd.pool", "decode")
            return await legs.attempts(ex, _first(decode_pool, decode), decode, record, send)
        prefill_pool = _in_order(ranking, plan.prefill_candidates)  # prefix affinity first
        prefill = prefill_pool[0]
        record.set_attribute("warmroute.pd.flow", plan.flow or "")
        if plan.flow == "vllm":
            return await self._vllm(legs, ex, prefill, decode, decode_pool, record, send)
        return await self._sglang(legs, ex, prefill, decode, decode_pool, record, send)

    async def _vllm(
        self,
        legs: Legs,
        ex: Exchange,
        prefill: str,
        decode: str,
        decode_pool: list[str],
        record: RequestRecord,
        send: Send,
    ) -> tuple[str, StreamFacts | None] | None:
        body = orjson.dumps(vllm_prefill_body(ex.body))
        params: dict[str, Any] | None = None
        try:
            answer = await self._prefill_leg(legs, ex, prefill, body, record)
            params = prefill_kv_params(answer)
            if params is None:
                raise Retry(
                    "its answer carried no kv_transfer_params (is a KV connector configured?)",
                    "pd_no_kv_params",
                    "protocol",
                )
        except Retry as r:
            return await self._fallback(legs, ex, prefill, r, decode, decode_pool, record, send)
        t_ready = time.time_ns()
        raw = orjson.dumps(vllm_decode_body(ex.body, params))
        return await self._decode_leg(legs, ex, decode, decode_pool, raw, t_ready, record, send)

    async def _sglang(
        self,
        legs: Legs,
        ex: Exchange,
        prefill: str,
        decode: str,
        decode_pool: list[str],
        record: RequestRecord,
        send: Send,
    ) -> tuple[str, StreamFacts | None] | None:
        pb = self.fleet[prefill]
        body = sglang_body(ex.body, bootstrap_host(pb.url), pb.cfg.bootstrap_port, self.rng)
        raw = orjson.dumps(body)
        log.debug("request %s: SGLang rooms %s via %s", ex.request_id, rooms_of(body), prefill)
        failure: list[Retry] = []
        result: tuple[str, StreamFacts | None] | None = None
        decode_scope = anyio.CancelScope()
        prefill_done = anyio.Event()

        async def prefill_leg() -> None:
            try:
                await self._prefill_leg(legs, ex, prefill, raw, record)
            except Retry as r:
                failure.append(r)
                if not ex.started_response:
                    decode_scope.cancel()  # it would wait for KV that never comes
            finally:
                prefill_done.set()

        t_ready = time.time_ns()
        async with anyio.create_task_group() as tg:
            tg.start_soon(prefill_leg)
            with decode_scope:
                result = await self._decode_leg(
                    legs, ex, decode, decode_pool, raw, t_ready, record, send, fallback=False
                )
            # The decode engine has its KV (or failed); the prefill answer is only drained.
            with anyio.move_on_after(5):
                await prefill_done.wait()
            tg.cancel_scope.cancel()
        if decode_scope.cancelled_caught or (
            result is None and failure and not ex.started_response
        ):
            r = failure[0] if failure else Retry("cancelled", "pd_cancelled", "protocol")
            return await self._fallback(legs, ex, prefill, r, decode, decode_pool, record, send)
        return result

    async def _prefill_leg(
        self, legs: Legs, ex: Exchange, name: str, body: bytes, record: RequestRecord
    ) -> Any:
        """Send the prefill leg and read its (small, whole) answer; failures raise Retry."""
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
        self.ctl.started(
            ex.request_id + "/prefill", name, time.perf_counter(), self._uncached_on(ex, name)
        )
        try:
            upstream = await legs.open_leg(ex, backend, body, headers)
            try:
                if upstream.status != 200:
                    raise Retry(f"HTTP {upstream.status}", f"http_{upstream.status}", "status")
                payload = await upstream.read(PREFILL_ANSWER_LIMIT)
            except (TimeoutError, OSError, ValueError) as e:
                raise Retry(f"its answer broke off: {describe(e)}", "body_error", "protocol") from e
            finally:
                upstream.release()
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
            other = Retry(describe(e), "prefill_error", "protocol")
            attempt.fail(other.error_type)
            self.fleet.mark_failure(backend, other.reason, kind=other.kind)
            raise other from e
        finally:
            self.ctl.first_token(ex.request_id + "/prefill", time.perf_counter())
            self.steering.inflight(name, -1)

    async def _decode_leg(
        self,
        legs: Legs,
        ex: Exchange,
        decode: str,
        decode_pool: list[str],
        raw: bytes,
        t_ready_ns: int,
        record: RequestRecord,
        send: Send,
        fallback: bool = True,
    ) -> tuple[str, StreamFacts | None] | None:
        """The decode leg streams to the client; a failure before its first byte retries on
        the decode pool as decode-only (the KV it was to receive belongs to that engine)."""
        result = await legs.attempts(ex, [decode], decode, record, send, raw, final=False)
        if result is not None:
            facts = result[1]
            if facts is not None and facts.first_output_at is not None:
                first_ns = time.time_ns() - int((time.perf_counter() - facts.first_output_at) * 1e9)
                record.interval(
                    "kv_transfer",
                    t_ready_ns,
                    max(t_ready_ns, first_ns),
                    {"warmroute.pd.decode_backend": decode},
                )
            return result
        if not fallback or ex.client_gone or ex.started_response:
            return None
        self._count("decode_leg_failed")
        rest = [n for n in decode_pool if n != decode] or decode_pool
        return await legs.attempts(ex, rest, rest[0], record, send)

    async def _fallback(
        self,
        legs: Legs,
        ex: Exchange,
        prefill: str,
        r: Retry,
        decode: str,
        decode_pool: list[str],
        record: RequestRecord,
        send: Send,
    ) -> tuple[str, StreamFacts | None] | None:
        self._count("prefill_failed")
        why = f"prefill leg on {prefill} failed ({r.reason}); decode-only on {decode}"
        log.warning("request %s: %s", ex.request_id, why)
        record.set_attribute("warmroute.pd.fallback", why)
        if ex.client_gone:
            return None
        return await legs.attempts(ex, _first(decode_pool, decode), decode, record, send)

    def _least_loaded(self, names: list[str]) -> str:
        inflight = {v.name: v.inflight for v in self.steering.views()}
        return min(names, key=lambda n: (inflight.get(n, 0), names.index(n)))

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def gauges(self) -> tuple[bool, dict[str, float]]:
        """(active, the decider's numeric inputs) for warmroute.disagg.* metrics."""
        d = self.ctl.decider
        inputs = d.last.inputs() if d.last else {}
        return d.active, {
            k: float(v)
            for k, v in inputs.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }

    def state(self) -> dict[str, Any]:
        out = self.ctl.state()
        out["requests"] = dict(self.counts)
        return out


def _in_order(ranking: Sequence[str], pool: Sequence[str]) -> list[str]:
    """The pool's backends in the router's order (prefix affinity first), then the rest."""
    members = set(pool)
    ordered = [n for n in ranking if n in members]
    return ordered + [n for n in pool if n not in ordered]


def _first(names: list[str], first: str) -> list[str]:
    return [first, *(n for n in names if n != first)]


__all__ = ["Legs", "PdFlows"]
