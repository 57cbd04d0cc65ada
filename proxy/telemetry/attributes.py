"""The span attribute model: every attribute the proxy writes, defined once.

Each group (`request`, `attempt`, `decision`, `finish`, `fleet`, `events`) is one function written
against render.Writer. render.DictWriter renders it as the attribute dict the SDK's span
processors get; render.compile_fields renders it straight into OTLP protobuf fields for the
OTLP/HTTP path, without a dict (`*_fields` below). Both follow the same calls in the same
order, so the bytes are the SDK encoder's (tests/test_telemetry_encoding.py).
Attribute values are written in the SDK's cleaned form (sequences as tuples, timings as
doubles) and stay far under its default limits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import orjson
from opentelemetry.sdk.trace import Event

from proxy.redact import quote
from proxy.routing.types import Decision
from proxy.stats import percentile
from proxy.telemetry.render import DictWriter, Writer, compile_fields
from proxy.telemetry.series import PROVIDER
from proxy.telemetry.wire import AttrKey
from proxy.types import StreamFacts

log = logging.getLogger("warmroute.telemetry")

OPERATION = {
    "chat": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
    # The OpenAI semconv maps the Responses API to "chat", told apart by openai.api.type.
    "responses": "chat",
}
API_TYPE = {"chat": "chat_completions", "completions": "completions", "responses": "responses"}
CONTENT_KEYS = ("messages", "prompt", "input", "instructions")

ERROR_TYPE = AttrKey("error.type")
STATUS_CODE = AttrKey("http.response.status_code")
BACKEND = AttrKey("warmroute.backend")
REQUEST_ID = AttrKey("warmroute.request.id")
CLIENT = AttrKey("warmroute.client")  # the name of the API key presented (proxy/edge/access.py)
PRIORITY = AttrKey("warmroute.priority")  # its class in the admission queue (with API keys)
QUEUE_WAIT = AttrKey("warmroute.queue_wait_s")  # seconds it waited for an admission slot
API = AttrKey("openai.api.type")
CHOICE_COUNT = AttrKey("gen_ai.request.choice.count")
STOP_SEQUENCES = AttrKey("gen_ai.request.stop_sequences")
CONTENT = {key: AttrKey(f"warmroute.request.{key}") for key in CONTENT_KEYS}
_MAX_TOKENS = AttrKey("gen_ai.request.max_tokens")
# request body key -> span attribute (the aliases of max_tokens adjacent: the first one wins)
PARAMS = (
    ("max_tokens", _MAX_TOKENS),
    ("max_completion_tokens", _MAX_TOKENS),
    ("max_output_tokens", _MAX_TOKENS),
    ("temperature", AttrKey("gen_ai.request.temperature")),
    ("top_p", AttrKey("gen_ai.request.top_p")),
    ("top_k", AttrKey("gen_ai.request.top_k")),
    ("seed", AttrKey("gen_ai.request.seed")),
    ("frequency_penalty", AttrKey("gen_ai.request.frequency_penalty")),
    ("presence_penalty", AttrKey("gen_ai.request.presence_penalty")),
)
# the routing decision
DECISION_MS = AttrKey("warmroute.route.decision_ms")
CANDIDATES = AttrKey("warmroute.route.candidates")
PREFIX_BLOCKS = AttrKey("warmroute.route.prefix_blocks")
FILTERED_OUT = AttrKey("warmroute.route.filtered_out")
ROUTE_BACKEND = AttrKey("warmroute.route.backend")
SCORE = AttrKey("warmroute.route.score")
MATCHED_BLOCKS = AttrKey("warmroute.route.matched_blocks")
# Where the winner's match came from when some backend's KV events were live: kv_events | index
MATCH_SOURCE = AttrKey("warmroute.route.match_source")
MATCHED_CHARS = AttrKey("warmroute.route.matched_chars")
PREDICTED_HIT = AttrKey("warmroute.prefix.predicted_hit_ratio")
# the response, from the stream facts
RETRIES = AttrKey("warmroute.route.retries")
FINISH_REASONS = AttrKey("gen_ai.response.finish_reasons")
RESPONSE_ID = AttrKey("gen_ai.response.id")
RESPONSE_MODEL = AttrKey("gen_ai.response.model")
INPUT_TOKENS = AttrKey("gen_ai.usage.input_tokens")
OUTPUT_TOKENS = AttrKey("gen_ai.usage.output_tokens")
CACHED_TOKENS = AttrKey("gen_ai.usage.cache_read.input_tokens")
OBSERVED_HIT = AttrKey("warmroute.prefix.observed_hit_ratio")
TTFC = AttrKey("gen_ai.response.time_to_first_chunk")
UPSTREAM_TTFC = AttrKey("warmroute.upstream.time_to_first_chunk")
OVERHEAD = AttrKey("warmroute.proxy.overhead_s")
TPOT = AttrKey("warmroute.tpot_s")
E2E = AttrKey("warmroute.e2e_s")
CHUNKS = AttrKey("warmroute.chunks")
EVENTS = AttrKey("warmroute.events")
ITL_P50 = AttrKey("warmroute.itl.p50_s")
ITL_P99 = AttrKey("warmroute.itl.p99_s")
ITL_MAX = AttrKey("warmroute.itl.max_s")
CANCELLED = AttrKey("warmroute.cancelled")
# the fleet as the request found it: its membership version, and whether a change was under way
FLEET_EPOCH = AttrKey("warmroute.fleet.epoch")
FLEET_CHANGING = AttrKey("warmroute.fleet.changing")
# span events' attributes (Event.attributes is field 3)
EVENT_TTFC = AttrKey("gen_ai.response.time_to_first_chunk", b"\x1a")
CHUNK_INDEX = AttrKey("warmroute.chunk.index", b"\x1a")
CHUNK_GAP = AttrKey("warmroute.chunk.gap_s", b"\x1a")

# Encoded groups whose values repeat across requests, by value (bounded).
_HEADS: dict[Any, bytes] = {}  # operation, provider, model, stream
_ATTEMPTS: dict[Any, bytes] = {}  # a CLIENT span's attributes at start
_SERVERS: dict[Any, bytes] = {}  # server.address, server.port
_ROUTES: dict[Any, bytes] = {}  # policy, reason
_CANDIDATES: dict[Any, bytes] = {}
_REASONS: dict[Any, bytes] = {}  # finish reasons
_SCORES: dict[str, AttrKey] = {}  # scorer -> its warmroute.route.score.* key


# -- the groups -------------------------------------------------------------------------------
def base(op: str, model: str | None) -> dict[str, Any]:
    """What every span and series of a request starts with."""
    attrs: dict[str, Any] = {"gen_ai.operation.name": op, "gen_ai.provider.name": PROVIDER}
    if model:
        attrs["gen_ai.request.model"] = model
    return attrs


def _head(op: str, model: str | None, stream: bool) -> dict[str, Any]:
    attrs = base(op, model)
    attrs["gen_ai.request.stream"] = stream
    return attrs


def request(
    w: Writer,
    op: str,
    model: str | None,
    stream: bool,
    api: str,
    request_id: str,
    params: Mapping[str, Any],
    capture_content: bool,
) -> None:
    """The SERVER span's attributes from the request."""
    # cached only for exact types: True == 1 and hash alike but encode differently
    exact = type(stream) is bool and (model is None or type(model) is str)
    w.group(_HEADS, (op, model, stream) if exact else None, _head, op, model, stream)
    w.ident(REQUEST_ID, request_id)
    if api in API_TYPE:
        w.text(API, API_TYPE[api])
    done = None
    for name, key in PARAMS:
        v = params.get(name)
        if v is None:  # most are absent
            continue
        if isinstance(v, int | float) and not isinstance(v, bool) and key is not done:
            w.value(key, v)
            done = key
    n = params.get("n")
    if isinstance(n, int) and n != 1:
        w.value(CHOICE_COUNT, n)
    stop = params.get("stop")
    if isinstance(stop, str):
        w.value(STOP_SEQUENCES, (stop,))
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        w.value(STOP_SEQUENCES, tuple(stop))
    if capture_content:
        for name in CONTENT_KEYS:
            if name in params:
                w.value(CONTENT[name], orjson.dumps(params[name]).decode())


def _attempt(
    op: str, model: str | None, address: str, port: int, backend: str, attempt: int
) -> dict[str, Any]:
    attrs = base(op, model)
    attrs["server.address"] = address
    attrs["server.port"] = port
    attrs["warmroute.backend"] = backend
    attrs["warmroute.attempt"] = attempt
    return attrs


def attempt(
    w: Writer, op: str, model: str | None, address: str, port: int, backend: str, number: int
) -> None:
    """A CLIENT span's attributes at start: the same for every attempt of a series."""
    key = (op, model, address, port, backend, number)
    exact = type(port) is int and type(number) is int
    exact = exact and all(type(x) is str for x in (model or "", address, backend))
    w.group(_ATTEMPTS, key if exact else None, _attempt, *key)


def _route(policy: str, reason: str) -> dict[str, Any]:
    return {"warmroute.route.policy": policy, "warmroute.route.reason": reason}


def _server(address: str, port: int) -> dict[str, Any]:
    return {"server.address": address, "server.port": port}


def score_key(scorer: str) -> AttrKey:
    key = _SCORES.get(scorer)
    if key is None:
        key = AttrKey(f"warmroute.route.score.{scorer}")
        if len(_SCORES) < 256:
            _SCORES[scorer] = key
    return key


def decision(w: Writer, d: Decision) -> None:
    """The routing decision as warmroute.route.* attributes."""
    policy, reason = d.policy, d.reason
    exact = type(policy) is str and type(reason) is str
    w.group(_ROUTES, (policy, reason) if exact else None, _route, policy, reason)
    w.double(DECISION_MS, round(d.decision_s * 1000, 4))
    w.texts(CANDIDATES, tuple(d.ranking[:16]), _CANDIDATES)
    w.count(PREFIX_BLOCKS, d.prefix_blocks)
    if d.filtered_out:
        dropped = list(d.filtered_out.items())[:16]  # a reason may quote the client's model
        w.value(FILTERED_OUT, tuple(f"{k}: {quote(v)}" for k, v in dropped))
    winner = d.winner
    if winner is None:
        return
    w.text(ROUTE_BACKEND, winner)
    if d.scored():
        if winner in d.totals:
            w.value(SCORE, d.totals[winner])
        for scorer, value in d.scores.get(winner, {}).items():
            w.value(_SCORES.get(scorer) or score_key(scorer), value)
    matched = d.matched_blocks.get(winner, 0)
    w.count(MATCHED_BLOCKS, matched)
    if d.exact:
        w.text(MATCH_SOURCE, "kv_events" if winner in d.exact else "index")
    block_chars, prompt_chars = d.block_chars, d.prompt_chars
    if block_chars:
        chars = matched * block_chars
        w.count(MATCHED_CHARS, chars)
        if prompt_chars:
            w.double(PREDICTED_HIT, min(1.0, chars / prompt_chars))


def finish(
    w: Writer,
    f: StreamFacts | None,
    stream: bool,
    status: int,
    err: str | None,
    backend: str,
    address: str,
    port: int,
    retries: int,
    itl: list[float] | None,
) -> None:
    """The SERVER span's attributes from the response (`itl`: the facts' gaps, sorted)."""
    w.count(STATUS_CODE, status)
    if backend:
        w.text(BACKEND, backend)
    if address:
        exact = type(port) is int and type(address) is str
        w.group(_SERVERS, (address, port) if exact else None, _server, address, port)
    if retries:
        w.count(RETRIES, retries)
    if err is not None:
        w.text(ERROR_TYPE, err)
    if f is None:
        if err is not None:
            # No response reached the client: still findable by finish reason, like a broken
            # stream.
            reason = "cancelled" if err == "cancelled" else "error"
            w.texts(FINISH_REASONS, (reason,), _REASONS)
        return
    w.texts(FINISH_REASONS, tuple(f.finish_reasons), _REASONS)
    if f.response_id is not None:
        w.ident(RESPONSE_ID, f.response_id)
    if f.response_model is not None:
        w.text(RESPONSE_MODEL, f.response_model)
    fin, cached = f.input_tokens, f.cached_tokens
    if fin is not None:
        w.count(INPUT_TOKENS, fin)
    if f.output_tokens is not None:
        w.count(OUTPUT_TOKENS, f.output_tokens)
    if cached is not None:
        w.count(CACHED_TOKENS, cached)
        if fin:
            w.double(OBSERVED_HIT, cached / fin)
    ttft, up = f.ttft_s, f.upstream_ttft_s
    if ttft is not None:
        w.double(TTFC, ttft)
    if up is not None:
        w.double(UPSTREAM_TTFC, up)
        if ttft is not None:
            w.double(OVERHEAD, ttft - up)
    if f.tpot_s is not None:
        w.double(TPOT, f.tpot_s)
    if f.e2e_s is not None:
        w.double(E2E, f.e2e_s)
    if stream:
        w.count(CHUNKS, f.chunks)
        w.count(EVENTS, f.events)
    if itl:
        w.double(ITL_P50, percentile(itl, 0.5))
        w.double(ITL_P99, percentile(itl, 0.99))
        w.double(ITL_MAX, itl[-1])
    if f.cancelled:
        w.value(CANCELLED, True)


def fleet(w: Writer, epoch: int, changing: bool) -> None:
    """The fleet the request was routed in: its epoch (bumped by every membership change) and
    whether backends were joining or draining then, to tell a change's requests apart."""
    w.count(FLEET_EPOCH, epoch)
    w.value(FLEET_CHANGING, changing)


# -- span events ------------------------------------------------------------------------------
def epoch_ns(t: float, anchor: tuple[int, float]) -> int:
    """perf_counter seconds -> wall-clock ns, through a (time_ns, perf_counter) pair."""
    return anchor[0] + int((t - anchor[1]) * 1e9)


def events(w: Writer, mode: str, cap: int, f: StreamFacts, anchor: tuple[int, float]) -> None:
    """first_token and, per `mode` (cfg.chunk_events), chunk events: never more than `cap`."""
    if mode == "off" or f.first_output_at is None:
        return
    w.event("first_token", epoch_ns(f.first_output_at, anchor))
    w.double(EVENT_TTFC, f.ttft_s or 0.0)
    gaps = f.itl_s
    if mode == "first" or not gaps or cap <= 0:
        return
    n = len(gaps)
    if mode == "all" or n <= cap:
        picks: Iterable[int] = range(min(n, cap))
    else:  # "sampled": evenly spread, always including the last chunk
        picks = sorted({round(i * (n - 1) / max(1, cap - 1)) for i in range(cap)})
    t = f.first_output_at
    done = 0
    for i in picks:
        while done <= i:  # advance the clock through the gaps up to chunk i+1
            t += gaps[done]
            done += 1
        w.event("chunk", epoch_ns(t, anchor))
        w.count(CHUNK_INDEX, i + 1)
        w.double(CHUNK_GAP, gaps[i])


def event_objects(mode: str, cap: int, f: StreamFacts, anchor: tuple[int, float]) -> list[Event]:
    """The events as the SDK's Event objects."""
    w = DictWriter({})
    events(w, mode, cap, f, anchor)
    return w.event_objects()


# The groups as protobuf fields (render.compile_fields: the same calls, inlined).
request_fields = compile_fields(request)
attempt_fields = compile_fields(attempt)
decision_fields = compile_fields(decision)
finish_fields = compile_fields(finish)
fleet_fields = compile_fields(fleet)
event_fields = compile_fields(events, events=True)
