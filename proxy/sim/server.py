"""The simulated engine's HTTP face: vLLM's OpenAI-compatible API as a raw ASGI app.

Raw ASGI rather than Starlette's responses because the streaming path must notice a client
disconnect at once (to free the sequence's KV in the engine) and must be able to drop a
connection mid-stream on purpose (fault injection).

Here: routing, the request's checks and its sequences. Its answer is completion.py, the
prefill/decode legs pd.py, the connection faults faults.py, the error bodies errors.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Awaitable
from dataclasses import asdict
from typing import Any, NamedTuple, TypeVar

import orjson
import xxhash

from proxy.asgi import (
    BodyTooLarge,
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    respond,
    send_json,
    serve_lifespan,
    watch_disconnect,
)
from proxy.kvevents.publisher import KvEventPublisher
from proxy.kvevents.wire import AllBlocksCleared
from proxy.sim import tokens
from proxy.sim.completion import Completion, Job
from proxy.sim.config import SimConfig
from proxy.sim.engine import Seq, make_seq
from proxy.sim.errors import ERROR_TYPES, HTTPError, StreamCut, error_body
from proxy.sim.faults import QuietStreamCut, close_idle, protocol_for
from proxy.sim.lora import Adapters, keyed_salt
from proxy.sim.pd import Disagg
from proxy.sim.runner import AsyncEngine

T = TypeVar("T")

__all__ = ["ERROR_TYPES", "HTTPError", "SimApp", "StreamCut", "create_sim_app", "error_body"]

MAX_BODY = 32 * 1024 * 1024
MAX_N = 128
RECEIVED_KEPT = 16  # completion requests GET /sim/received shows, newest last


class SimApp:
    """ASGI app of one simulated engine; the lifespan starts and stops its step loop."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.engine = AsyncEngine(cfg)
        self.rng = random.Random(cfg.seed)
        self.counts: dict[str, int] = dict.fromkeys(
            ("requests", "errors_injected", "stalls", "cuts", "slow_starts", "refused"), 0
        )
        self.refuse_until = 0.0
        self.protocols: set[Any] = set()
        self.pd = Disagg(cfg)
        self.adapters = Adapters(cfg.model, cfg.lora_modules)
        # A debug view for tests of what sits in front of the engine (a proxy's rewritten
        # bodies, its headers): the last completion requests exactly as they arrived.
        self.received: deque[dict[str, Any]] = deque(maxlen=RECEIVED_KEPT)
        self.created = int(time.time())
        self._ids = itertools.count()
        self._log_filter = QuietStreamCut()
        self._protocol_class: type[asyncio.Protocol] | None = None

    # --- ASGI -------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        self.engine.start()  # lazily, for servers that skip the lifespan
        try:
            await self._route(scope, receive, send)
        except HTTPError as e:
            await respond(send, e.status, error_body(e.status, e.message, e.param))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await serve_lifespan(receive, send, self.startup, self.shutdown)

    async def startup(self) -> None:
        self.engine.start()
        logging.getLogger("uvicorn.error").addFilter(self._log_filter)
        cfg = self.cfg
        if cfg.kv_events_endpoint and self.engine.kv_events is None:
            publisher = KvEventPublisher(
                cfg.kv_events_endpoint,
                replay_endpoint=cfg.kv_events_replay_endpoint,
                topic=cfg.kv_events_topic,
            )
            try:
                await publisher.start()
            except Exception:
                await self.engine.stop()
                raise
            # A fresh engine's first word: whatever a subscriber knew of this endpoint is gone.
            publisher.publish([AllBlocksCleared()])
            self.engine.kv_events = publisher

    async def shutdown(self) -> None:
        await self.engine.stop()
        publisher, self.engine.kv_events = self.engine.kv_events, None
        if publisher is not None:
            await publisher.close()
        logging.getLogger("uvicorn.error").removeFilter(self._log_filter)
        await self.pd.close()

    # --- connection refusal (the protocol: proxy/sim/faults.py) -----------------------
    def http_protocol(self) -> type[asyncio.Protocol]:
        """A uvicorn HTTP protocol class that can abort new connections (refuse fault)."""
        if self._protocol_class is None:
            self._protocol_class = protocol_for(self)
        return self._protocol_class

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """Extra uvicorn.Config arguments so every fault works: `ServerThread(app, **kw)`."""
        return {"http": self.http_protocol()}

    def should_refuse(self) -> bool:
        if time.monotonic() < self.refuse_until:
            return True
        rate = self.cfg.faults.refuse_rate
        return rate > 0 and self.rng.random() < rate

    # --- routing ----------------------------------------------------------------------
    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        loading = time.monotonic() - self.engine.started_at < self.cfg.faults.load_s / self.scale
        if path in ("/v1/chat/completions", "/v1/completions"):
            _need(method, "POST")
            if loading:
                raise HTTPError(503, "the model is still loading")
            await self._completion(scope, receive, send, chat=path.endswith("chat/completions"))
        elif path == "/health":
            status = 500 if self.engine.dead else 503 if loading else 200
            await respond(send, status, b"", b"text/plain")
        elif path == "/v1/models":
            await send_json(send, 200, self._models())
        elif path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            _need(method, "POST")
            change = self.adapters.load if path.endswith("/load_lora_adapter") else None
            body = await _json_body(receive)
            text = change(body) if change else self.adapters.unload(body)
            await respond(send, 200, text.encode(), b"text/plain")
        elif path == "/metrics":
            text = self.engine.metrics.render(self.engine.scheduler, self.engine.aborted)
            await respond(send, 200, text.encode(), b"text/plain; version=0.0.4")
        elif path == "/version":
            await send_json(send, 200, {"version": "warmroute-sim"})
        elif path == "/sim/stats":
            await send_json(send, 200, self.stats())
        elif path == "/sim/received":
            await send_json(send, 200, {"requests": list(self.received)})
        elif path == "/sim/faults":
            if method == "POST":
                await self._set_faults(await _json_body(receive), send)
            else:
                await send_json(send, 200, asdict(self.cfg.faults))
        elif path == "/reset_prefix_cache":
            _need(method, "POST")
            self.engine.scheduler.pool.reset()
            self.engine.flush_kv_events()
            await respond(send, 200, b"", b"text/plain")
        elif path == "/sim/kv-cache":
            pool = self.engine.scheduler.pool
            await send_json(send, 200, {"block_size": pool.block_size, "hashes": list(pool.cached)})
        elif path.startswith("/sim/bootstrap/"):
            # A decode engine's long poll: it ends with the decode leg that asked.
            room = await self._until_gone(self.pd.wait(path.rsplit("/", 1)[1]), receive)
            await send_json(send, 200, room)
        else:
            raise HTTPError(404, f"no route for {method} {path}")

    @property
    def scale(self) -> float:
        return self.cfg.time_scale

    def stats(self) -> dict[str, Any]:
        cfg = self.cfg
        out = self.engine.stats()
        out["faults"] = asdict(cfg.faults)
        out["counts"] = dict(self.counts)
        out["kv_waits"] = self.pd.kv_waits
        kv_events = self.engine.kv_events
        out["kv_events"] = kv_events.stats() if kv_events is not None else None
        out["config"] = {
            "device": cfg.device,
            "params": cfg.params,
            "dtype": cfg.dtype,
            "time_scale": cfg.time_scale,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "block_size": cfg.block_size,
            "kv_bytes_per_token": cfg.kv_bytes_per_token,
            "kv_pool_tokens": cfg.kv_pool_tokens,
            "decode_ceiling_tok_s": cfg.decode_ceiling_tok_s,
            "weight_bytes": cfg.weight_bytes,
        }
        return out

    def _models(self) -> dict[str, Any]:
        card = {
            "id": self.cfg.model,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.cfg.model,
            "parent": None,
            "max_model_len": self.cfg.effective_max_model_len,
        }
        return {"object": "list", "data": [card, *self.adapters.cards(self.created)]}

    async def _set_faults(self, body: Any, send: Send) -> None:
        if not isinstance(body, dict):
            raise HTTPError(400, "expected a JSON object of fault settings")
        body = dict(body)
        refuse_for = body.pop("refuse_for_s", None)
        try:
            self.cfg.faults.update(body)
        except (ValueError, TypeError) as e:
            raise HTTPError(400, str(e)) from None
        if refuse_for:
            self.refuse_until = time.monotonic() + float(refuse_for)
        await send_json(send, 200, asdict(self.cfg.faults))
        if refuse_for:
            # Keep-alive connections would bypass the accept-time check.
            close_idle(self.protocols)

    # --- completions ------------------------------------------------------------------
    async def _completion(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        body = await _json_body(receive)
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        self.received.append(
            {"path": scope["path"], "request_id": header(scope, b"x-request-id"), "body": body}
        )
        self.counts["requests"] += 1
        faults = self.cfg.faults
        if faults.error_rate and self.rng.random() < faults.error_rate:
            self.counts["errors_injected"] += 1
            raise HTTPError(faults.error_status, "injected fault: simulated engine error")
        model = body.get("model")
        lora = model if model is not None and model in self.adapters else ""
        if model is not None and model != self.cfg.model and not lora:
            raise HTTPError(404, f"The model `{model}` does not exist.", "model")
        prompts = self._prompts(body, chat)
        longest = max(len(p) for p in prompts)
        params = _params(body, chat, longest, self.cfg.effective_max_model_len)
        if lora:  # an adapter's blocks are its own (vLLM keys every block by its name)
            params = params._replace(cache_salt=keyed_salt(lora, params.cache_salt), lora=lora)

        # Prefill/decode disaggregation: which leg is this, if any? An SGLang decode leg waits
        # here for its prefill's KV; a client that leaves meanwhile ends that wait, as the
        # engine aborts a request whose client is gone (the proxy cancels it on a failed prefill).
        if body.get("bootstrap_room") is not None and self.cfg.role == "decode":
            leg = await self._until_gone(self.pd.leg(body, longest), receive)
        else:
            leg = await self.pd.leg(body, longest)
        if leg.prefill:
            params = params._replace(max_tokens=1, ignore_eos=True, n=1)
        external = leg.external
        if external:
            salt = params.cache_salt
            await self.pd.transfer(self.engine.scheduler.pool, prompts[0], external, salt)

        rid = header(scope, b"x-request-id") or uuid.uuid4().hex
        jobs = [Job(p) for p in prompts]
        seqs = self._sequences(rid, jobs, params, external)
        ctx = Completion(
            app=self,
            chat=chat,
            rid=("chatcmpl-" if chat else "cmpl-") + rid,
            jobs=jobs,
            n=params.n,
            events=asyncio.Queue(),
            include_usage=bool(params.stream_options.get("include_usage")),
            continuous_usage=bool(params.stream_options.get("continuous_usage_stats")),
        )
        if faults.slow_start_s and self.rng.random() < faults.slow_start_rate:
            self.counts["slow_starts"] += 1
            await asyncio.sleep(faults.slow_start_s / self.scale)
        try:
            for index, seq in seqs:
                self.engine.submit(seq, queue=ctx.events, index=index)
        except ValueError as e:
            ctx.abort_all()
            raise HTTPError(400, str(e)) from None
        except RuntimeError as e:
            ctx.abort_all()
            raise HTTPError(500, str(e)) from None
        await self._answer(scope, receive, send, ctx, params.stream, leg, seqs, longest)

    def _sequences(
        self, rid: str, jobs: list[Job], params: _Params, external: int
    ) -> list[tuple[int, Seq]]:
        """The engine's sequences for the request: `n` per prompt, each with its output index."""
        seqs: list[tuple[int, Seq]] = []
        for j, job in enumerate(jobs):
            for i in range(params.n):
                sid = f"{rid}#{next(self._ids)}"
                seq = make_seq(
                    self.cfg,
                    sid,
                    job.prompt_ids,
                    params.max_tokens,
                    index=i,
                    seed=params.seed,
                    ignore_eos=params.ignore_eos,
                    stop=params.stop,
                    external_tokens=external,
                    cache_salt=params.cache_salt,
                    cache_salt_text=params.salt_text,
                    lora_name=params.lora,
                    lora_id=self.adapters.id_of(params.lora) if params.lora else None,
                )
                seq.request_id = rid
                job.seqs.append(seq)
                seqs.append((j * params.n + i, seq))
        return seqs

    async def _answer(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        ctx: Completion,
        stream: bool,
        leg: Any,
        seqs: list[tuple[int, Seq]],
        longest: int,
    ) -> None:
        """Stream the tokens as they come, or send the whole answer (a prefill leg's with its
        KV-transfer parameters); a client that leaves aborts every sequence."""
        watcher = asyncio.create_task(watch_disconnect(receive, ctx.client_gone))
        try:
            if stream:
                await ctx.stream(
                    send, on_done=self.pd.prefilled(leg.rooms) if leg.prefill else None
                )
            else:
                result = await ctx.collect()
                if result and leg.prefill:
                    self.pd.prefilled(leg.rooms)(longest)
                    result["kv_transfer_params"] = self.pd.kv_params(scope, seqs[0][1])
                if result:
                    await send_json(send, 200, result)
        finally:
            watcher.cancel()
            ctx.abort_all()

    @staticmethod
    async def _until_gone(work: Awaitable[T], receive: Receive) -> T:
        """`work`, cancelled if the client disconnects first."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.create_task(watch_disconnect(receive, task.cancel))
        try:
            return await task
        except asyncio.CancelledError:
            if watcher.done() and task.cancelled():
                raise HTTPError(400, "client disconnected") from None
            raise
        finally:
            watcher.cancel()

    def _prompts(self, body: dict[str, Any], chat: bool) -> list[list[int]]:
        cpt = self.cfg.chars_per_token
        try:
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise HTTPError(400, "messages must be a non-empty list", "messages")
                text = tokens.render_chat(messages, body.get("tools"))
                return [tokens.tokenize(text, cpt)]
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return [tokens.tokenize(prompt, cpt)]
            if isinstance(prompt, list) and prompt:
                if all(isinstance(t, int) for t in prompt):
                    return [list(prompt)]
                if all(isinstance(p, str) for p in prompt):
                    return [tokens.tokenize(p, cpt) for p in prompt]
                if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
                    return [list(p) for p in prompt]
        except ValueError as e:
            raise HTTPError(400, str(e), "messages") from None
        raise HTTPError(
            400, "prompt must be a string, a list of strings or a list of token ids", "prompt"
        )


async def _json_body(receive: Receive) -> Any:
    try:
        raw = await read_body(receive, MAX_BODY)
    except ClientDisconnected:
        raise HTTPError(400, "client disconnected") from None
    except BodyTooLarge:
        raise HTTPError(413, f"request body over {MAX_BODY} bytes") from None
    try:
        return orjson.loads(raw or b"null")
    except orjson.JSONDecodeError as e:
        raise HTTPError(400, f"invalid JSON body: {e}") from None


def _need(method: str, expected: str) -> None:
    if method != expected:
        raise HTTPError(405, f"use {expected}")


def _int(body: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise HTTPError(400, f"{key} must be an integer in [{lo}, {hi}]", key)
    return v


def create_sim_app(cfg: SimConfig) -> SimApp:
    """The ASGI app of one simulated engine (pass `app.uvicorn_kwargs()` to uvicorn)."""
    return SimApp(cfg)


class _Params(NamedTuple):
    """A completion request's generation parameters, checked as vLLM checks them."""

    n: int
    max_tokens: int
    stop: list[str]
    ignore_eos: bool
    seed: int | None
    cache_salt: int
    salt_text: str
    stream: bool
    stream_options: dict[str, Any]
    lora: str = ""  # the adapter the request names ("": the base model)


def _params(body: dict[str, Any], chat: bool, longest: int, max_len: int) -> _Params:
    """The request's parameters, or the 400 vLLM answers for the first one that is wrong."""
    n = _int(body, "n", 1, 1, MAX_N)
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if longest >= max_len:
        raise HTTPError(
            400,
            f"This model's maximum context length is {max_len} tokens. However, your "
            f"request has {longest} input tokens. Please reduce the length of the input.",
            "messages" if chat else "prompt",
        )
    if max_tokens is None:
        max_tokens = max_len - longest
    elif not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise HTTPError(400, "max_tokens must be an integer >= 1", "max_tokens")
    if longest + max_tokens > max_len:
        raise HTTPError(
            400,
            f"This model's maximum context length is {max_len} tokens. "
            f"However, you requested {longest + max_tokens} tokens ({longest} in the "
            f"messages, {max_tokens} in the completion). Please reduce the length of "
            "the messages or completion.",
            "max_tokens",
        )
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise HTTPError(400, "stop must be a string or a list of strings", "stop")
    seed = body.get("seed")
    if seed is not None and not isinstance(seed, int):
        raise HTTPError(400, "seed must be an integer", "seed")
    salt = body.get("cache_salt")
    stream = bool(body.get("stream", False))
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise HTTPError(400, "stream_options must be an object", "stream_options")
    if opts and not stream:
        # vLLM rejects this too; a proxy that injects include_usage must check `stream`.
        raise HTTPError(
            400, "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    return _Params(
        n=n,
        max_tokens=max_tokens,
        stop=stop,
        ignore_eos=bool(body.get("ignore_eos", False)),
        seed=seed,
        cache_salt=xxhash.xxh64_intdigest(str(salt).encode()) if salt else 0,
        salt_text=str(salt) if salt else "",
        stream=stream,
        stream_options=opts,
    )
