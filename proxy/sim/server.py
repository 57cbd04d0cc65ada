"""The simulated engine's HTTP face: vLLM's OpenAI-compatible API as a raw ASGI app.

Raw ASGI rather than Starlette's responses because the streaming path must notice a client
disconnect at once (to free the sequence's KV in the engine) and must be able to drop a
connection mid-stream on purpose (fault injection).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import orjson
import xxhash
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from proxy.asgi import (
    BodyTooLarge,
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    end_stream,
    header,
    read_body,
    respond,
    send_json,
    serve_lifespan,
    sse,
    start_stream,
    stream_chunk,
    watch_disconnect,
)
from proxy.kvevents.publisher import KvEventPublisher
from proxy.kvevents.wire import AllBlocksCleared
from proxy.sim import tokens
from proxy.sim.config import SimConfig
from proxy.sim.engine import Seq, kv_transfer_seconds, make_seq
from proxy.sim.runner import AsyncEngine, TokenEvent

MAX_BODY = 32 * 1024 * 1024
MAX_N = 128
ROOM_TTL_S = 120.0
log = logging.getLogger("warmroute.sim")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class StreamCut(Exception):
    """Raised on purpose after the response started: the server drops the connection."""


ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    err: dict[str, Any] = {"message": message, "type": ERROR_TYPES.get(status, "Error")}
    err.update(param=param, code=status)
    return orjson.dumps({"error": err})


class _QuietStreamCut(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, StreamCut)


@dataclass
class _Room:
    """SGLang-style bootstrap room: a decode leg waits here for its prefill leg."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    prompt_tokens: int = 0
    created: float = field(default_factory=time.monotonic)


@dataclass
class _Job:
    """One prompt of a request and the parameters of its sequences."""

    prompt_ids: list[int]
    seqs: list[Seq] = field(default_factory=list)


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
        self.rooms: dict[str, _Room] = {}
        self.created = int(time.time())
        self._ids = itertools.count()
        self._client: httpx.AsyncClient | None = None
        self._log_filter = _QuietStreamCut()
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
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # --- connection refusal (needs the protocol below) --------------------------------
    def http_protocol(self) -> type[asyncio.Protocol]:
        """A uvicorn HTTP protocol class that can abort new connections (refuse fault)."""
        if self._protocol_class is None:
            self._protocol_class = _protocol_for(self)
        return self._protocol_class

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """Extra uvicorn.Config arguments so every fault works: `ServerThread(app, **kw)`."""
        return {"http": self.http_protocol()}

    def should_refuse(self) -> bool:
        if time.monotonic() < self.refuse_until:
            return True
        rate = self.cfg.faults.refuse_rate
        return rate > 0 and self.rng.random() < rate

    def _close_idle_connections(self) -> None:
        for proto in list(self.protocols):
            cycle = getattr(proto, "cycle", None)
            if cycle is None or cycle.response_complete:
                proto.transport.close()

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
        elif path == "/metrics":
            text = self.engine.metrics.render(self.engine.scheduler, self.engine.aborted)
            await respond(send, 200, text.encode(), b"text/plain; version=0.0.4")
        elif path == "/version":
            await send_json(send, 200, {"version": "warmroute-sim"})
        elif path == "/sim/stats":
            await send_json(send, 200, self.stats())
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
            await self._bootstrap_wait(path.rsplit("/", 1)[1], scope, send)
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
        return {"object": "list", "data": [card]}

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
            self._close_idle_connections()

    # --- completions ------------------------------------------------------------------
    async def _completion(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        body = await _json_body(receive)
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        self.counts["requests"] += 1
        faults = self.cfg.faults
        if faults.error_rate and self.rng.random() < faults.error_rate:
            self.counts["errors_injected"] += 1
            raise HTTPError(faults.error_status, "injected fault: simulated engine error")

        model = body.get("model")
        if model is not None and model != self.cfg.model:
            raise HTTPError(404, f"The model `{model}` does not exist.", "model")
        prompts = self._prompts(body, chat)
        n = _int(body, "n", 1, 1, MAX_N)
        max_tokens = body.get("max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        longest = max(len(p) for p in prompts)
        max_len = self.cfg.effective_max_model_len
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
        ignore_eos = bool(body.get("ignore_eos", False))
        seed = body.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise HTTPError(400, "seed must be an integer", "seed")
        salt = body.get("cache_salt")
        cache_salt = xxhash.xxh64_intdigest(str(salt).encode()) if salt else 0
        salt_text = str(salt) if salt else ""
        stream = bool(body.get("stream", False))
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise HTTPError(400, "stream_options must be an object", "stream_options")
        if opts and not stream:
            # vLLM rejects this too; a proxy that injects include_usage must check `stream`.
            raise HTTPError(
                400, "Stream options can only be defined when `stream=True`.", "stream_options"
            )

        # Prefill/decode disaggregation: which leg is this, if any?
        kvp = body.get("kv_transfer_params")
        if kvp is not None and not isinstance(kvp, dict):
            raise HTTPError(400, "kv_transfer_params must be an object", "kv_transfer_params")
        rooms = _rooms(body.get("bootstrap_room"))
        # --pd: which engine's flow this sim speaks (default both); the other one's fields
        # are ignored, as a real engine ignores what it does not know.
        vllm_pd, sglang_pd = self.cfg.pd in ("both", "vllm"), self.cfg.pd in ("both", "sglang")
        prefill_leg = (vllm_pd and bool(kvp and kvp.get("do_remote_decode"))) or (
            sglang_pd and bool(rooms) and self.cfg.role == "prefill"
        )
        external = 0
        if prefill_leg:
            max_tokens, ignore_eos, n = 1, True, 1
        elif vllm_pd and kvp and kvp.get("do_remote_prefill"):
            blocks = kvp.get("remote_block_ids") or []
            external = min(longest, len(blocks) * self.cfg.block_size)
        elif sglang_pd and rooms and self.cfg.role == "decode":
            external = await self._bootstrap_fetch(body, rooms, longest)
        if external:
            await self._kv_transfer(prompts[0], external, cache_salt)

        header_id = header(scope, b"x-request-id")
        rid = header_id or uuid.uuid4().hex
        jobs = [_Job(p) for p in prompts]
        events: asyncio.Queue[tuple[int, TokenEvent | None]] = asyncio.Queue()
        seqs: list[tuple[int, Seq]] = []
        for j, job in enumerate(jobs):
            for i in range(n):
                sid = f"{rid}#{next(self._ids)}"
                seq = make_seq(
                    self.cfg,
                    sid,
                    job.prompt_ids,
                    max_tokens,
                    index=i,
                    seed=seed,
                    ignore_eos=ignore_eos,
                    stop=stop,
                    external_tokens=external,
                    cache_salt=cache_salt,
                    cache_salt_text=salt_text,
                )
                seq.request_id = rid
                job.seqs.append(seq)
                seqs.append((j * n + i, seq))
        ctx = _Request(
            app=self,
            chat=chat,
            rid=("chatcmpl-" if chat else "cmpl-") + rid,
            jobs=jobs,
            n=n,
            events=events,
            include_usage=bool(opts.get("include_usage")),
            continuous_usage=bool(opts.get("continuous_usage_stats")),
        )
        if faults.slow_start_s and self.rng.random() < faults.slow_start_rate:
            self.counts["slow_starts"] += 1
            await asyncio.sleep(faults.slow_start_s / self.scale)
        try:
            for index, seq in seqs:
                self.engine.submit(seq, queue=events, index=index)
        except ValueError as e:
            ctx.abort_all()
            raise HTTPError(400, str(e)) from None
        except RuntimeError as e:
            ctx.abort_all()
            raise HTTPError(500, str(e)) from None

        watcher = asyncio.create_task(watch_disconnect(receive, ctx.client_gone))
        try:
            if stream:
                await ctx.stream(send, on_done=self._prefilled(rooms) if prefill_leg else None)
            else:
                result = await ctx.collect()
                if result and prefill_leg:
                    self._prefilled(rooms)(longest)
                    result["kv_transfer_params"] = self._kv_params(scope, seqs[0][1])
                if result:
                    await send_json(send, 200, result)
        finally:
            watcher.cancel()
            ctx.abort_all()

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

    # --- prefill/decode ---------------------------------------------------------------
    def _prefilled(self, rooms: list[str]) -> Callable[[int], None]:
        """Callback for a finished prefill leg: wake the decode legs waiting on its rooms."""

        def done(prompt_tokens: int) -> None:
            for room in rooms:
                r = self._room(room)
                r.prompt_tokens = prompt_tokens
                r.event.set()

        return done

    def _kv_params(self, scope: Scope, seq: Seq) -> dict[str, Any]:
        host, port = scope.get("server") or ("127.0.0.1", 0)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(seq.last_blocks),
            "remote_engine_id": self.cfg.engine_id,
            "remote_request_id": seq.request_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": self.cfg.tensor_parallel_size,
        }

    async def _kv_transfer(self, prompt: list[int], external: int, salt: int) -> None:
        """Pay the link time for the part of the prompt this engine does not already hold."""
        from proxy.sim.kvcache import block_hashes

        bs = self.cfg.block_size
        hit = self.engine.scheduler.pool.longest_hit(block_hashes(prompt[:external], bs, salt))
        missing = max(0, external - len(hit) * bs)
        if missing:
            await asyncio.sleep(kv_transfer_seconds(self.cfg, missing) / self.scale)

    def _room(self, room: str) -> _Room:
        now = time.monotonic()
        for key in [k for k, r in self.rooms.items() if now - r.created > ROOM_TTL_S]:
            del self.rooms[key]
        if room not in self.rooms:
            self.rooms[room] = _Room()
        return self.rooms[room]

    async def _bootstrap_wait(self, room: str, scope: Scope, send: Send) -> None:
        """Long poll of a decode engine: answers once the prefill leg of `room` finished."""
        r = self._room(room)
        try:
            await asyncio.wait_for(r.event.wait(), self.cfg.bootstrap_timeout_s)
        except TimeoutError:
            raise HTTPError(404, f"bootstrap room {room} never prefilled here") from None
        self.rooms.pop(room, None)
        await send_json(
            send,
            200,
            {"room": room, "prompt_tokens": r.prompt_tokens, "engine": self.cfg.engine_id},
        )

    async def _bootstrap_fetch(
        self, body: dict[str, Any], rooms: list[str], prompt_tokens: int
    ) -> int:
        """Wait for the prefill engine of every room (GET its /sim/bootstrap/{room}); the
        prompt tokens whose KV arrived (the fewest, for a batch)."""
        hosts = _per_room(body.get("bootstrap_host"), len(rooms))
        ports = _per_room(body.get("bootstrap_port"), len(rooms))
        if not all(hosts) or not all(ports):
            raise HTTPError(
                400, "bootstrap_room needs bootstrap_host and bootstrap_port", "bootstrap_host"
            )
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.cfg.bootstrap_timeout_s + 5)
        client = self._client

        async def fetch(host: Any, port: Any, room: str) -> int:
            h = str(host).strip("[]")
            host_part = f"[{h}]" if ":" in h else h
            r = await client.get(f"http://{host_part}:{int(port)}/sim/bootstrap/{room}")
            r.raise_for_status()
            return int(r.json().get("prompt_tokens", 0))

        try:
            got = await asyncio.gather(*map(fetch, hosts, ports, rooms))
        except (httpx.HTTPError, ValueError, TypeError) as e:
            raise HTTPError(500, f"KV transfer from the prefill engine failed: {e}") from None
        return min(min(got), prompt_tokens)


class _Request:
    """One completion request's sequences and how their tokens become OpenAI JSON."""

    def __init__(
        self,
        app: SimApp,
        chat: bool,
        rid: str,
        jobs: list[_Job],
        n: int,
        events: asyncio.Queue[tuple[int, TokenEvent | None]],
        include_usage: bool,
        continuous_usage: bool,
    ) -> None:
        self.app = app
        self.chat = chat
        self.rid = rid
        self.jobs = jobs
        self.n = n
        self.events = events
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.created = int(time.time())
        self.model = app.cfg.model
        self.texts = [""] * (len(jobs) * n)
        self.finish: list[tuple[str, str | None] | None] = [None] * (len(jobs) * n)
        self.completion_tokens = 0

    def abort_all(self) -> None:
        for job in self.jobs:
            for seq in job.seqs:
                self.app.engine.abort(seq.seq_id)

    def client_gone(self) -> None:
        self.abort_all()
        self.events.put_nowait((-1, None))

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(j.prompt_ids) for j in self.jobs)
        cached = 0
        for job in self.jobs:
            cached += max(0, job.seqs[0].num_cached)
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def next_event(self) -> tuple[int, TokenEvent] | None:
        """The next token of any choice; None when the client went away."""
        index, ev = await self.events.get()
        return None if ev is None else (index, ev)

    def _record(self, index: int, ev: TokenEvent) -> None:
        self.completion_tokens += 1
        self.texts[index] += ev.text
        if ev.finish_reason is not None:
            self.finish[index] = (ev.finish_reason, ev.stop_reason)

    async def collect(self) -> dict[str, Any]:
        while any(f is None for f in self.finish):
            got = await self.next_event()
            if got is None:
                return {}
            self._record(*got)
        choices = []
        for i, text in enumerate(self.texts):
            reason, stop_reason = self.finish[i] or ("abort", None)
            if self.chat:
                choice: dict[str, Any] = {
                    "index": i,
                    "message": {"role": "assistant", "content": text, "tool_calls": []},
                }
            else:
                choice = {"index": i, "text": text}
            choice.update(logprobs=None, finish_reason=reason, stop_reason=stop_reason)
            choices.append(choice)
        return {
            "id": self.rid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
            "kv_transfer_params": None,
        }

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            obj["usage"] = usage
        return sse(obj)

    async def stream(self, send: Send, on_done: Callable[[int], None] | None = None) -> None:
        app, faults = self.app, self.app.cfg.faults
        stall = faults.stall_s > 0 and app.rng.random() < faults.stall_rate
        cut = faults.cut_rate > 0 and app.rng.random() < faults.cut_rate
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
        ]
        await start_stream(send, 200, headers)

        async def write(data: bytes) -> None:
            await stream_chunk(send, data)

        if self.chat:
            for i in range(len(self.texts)):
                delta = {"role": "assistant", "content": ""}
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                await write(self._chunk([choice], self._usage_if_continuous()))
        sent = 0
        while any(f is None for f in self.finish):
            got = await self.next_event()
            if got is None:
                return
            index, ev = got
            self._record(index, ev)
            if not ev.text and ev.finish_reason is None:
                continue
            if self.chat:
                choice = {"index": index, "delta": {"content": ev.text}, "logprobs": None}
            else:
                choice = {"index": index, "text": ev.text, "logprobs": None}
            choice["finish_reason"] = ev.finish_reason
            if ev.finish_reason is not None or not self.chat:
                choice["stop_reason"] = ev.stop_reason
            await write(self._chunk([choice], self._usage_if_continuous()))
            sent += 1
            if cut and sent >= faults.cut_after:
                app.counts["cuts"] += 1
                self.abort_all()
                raise StreamCut("injected fault: stream cut")
            if stall and sent == faults.stall_after:
                app.counts["stalls"] += 1
                await asyncio.sleep(faults.stall_s / app.scale)
        if on_done is not None:
            on_done(len(self.jobs[0].prompt_ids))
        if self.include_usage:
            await write(self._chunk([], self.usage()))
        await write(b"data: [DONE]\n\n")
        await end_stream(send)

    def _usage_if_continuous(self) -> dict[str, Any] | None:
        return self.usage() if self.include_usage and self.continuous_usage else None


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


def _rooms(value: Any) -> list[str]:
    """SGLang's bootstrap_room: one integer, or one per prompt of a batch."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(r, int) and not isinstance(r, bool) for r in items):
        raise HTTPError(
            400, "bootstrap_room must be an integer or a list of them", "bootstrap_room"
        )
    return [str(r) for r in items]


def _per_room(value: Any, rooms: int) -> list[Any]:
    """A bootstrap field given once for all rooms, or as a list with one entry per room."""
    if isinstance(value, list):
        if len(value) != rooms:
            raise HTTPError(400, "bootstrap fields must have one entry per bootstrap_room")
        return value
    return [value] * rooms


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


def _protocol_for(app: SimApp) -> type[asyncio.Protocol]:
    base: Any = AutoHTTPProtocol

    class SimHTTPProtocol(base):
        """uvicorn's HTTP protocol, but a refusing engine aborts the connection at accept."""

        _refused = False

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            if app.should_refuse():
                self._refused = True
                app.counts["refused"] += 1
                transport.abort()  # type: ignore[attr-defined]
                return
            super().connection_made(transport)
            app.protocols.add(self)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            app.protocols.discard(self)
            super().connection_lost(exc)

    return SimHTTPProtocol


def create_sim_app(cfg: SimConfig) -> SimApp:
    """The ASGI app of one simulated engine (pass `app.uvicorn_kwargs()` to uvicorn)."""
    return SimApp(cfg)
