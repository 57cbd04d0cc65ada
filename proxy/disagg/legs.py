"""The request bodies of a two-leg prefill/decode flow, as pure functions of the client's body.

Nothing here sends anything: the forwarder builds each leg's body with these functions and
sends it. Both legs carry the client's `x-request-id`. What each engine expects was checked
against vLLM's and SGLang's own proxies (docs/disaggregation.md, "Verified against").

vLLM (NixlConnector and the connectors that copy its flow), one leg after the other:
  1. prefill leg = `vllm_prefill_body(body)`: `max_tokens: 1`, non-streaming, and
     `kv_transfer_params` asking the engine to keep the KV for a remote decode;
  2. its JSON answer carries `kv_transfer_params` (where the KV blocks are): read them with
     `prefill_kv_params(answer)`; None means the prefill leg did not hand over KV;
  3. decode leg = `vllm_decode_body(body, params)`: the client's own body plus those params.

SGLang, both legs at once: the same body, `sglang_body(body, host, port, rng)`, goes to the
prefill and the decode engine concurrently; the decode engine pulls the KV from the prefill
engine's bootstrap server (host, port) for the request's random `bootstrap_room`. The client's
stream comes from the decode leg; the prefill leg's answer is drained and dropped.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

PdFlow = Literal["vllm", "sglang"]

# What the vLLM prefill leg asks for: compute the prompt's KV, keep it for a remote decode.
# The null fields are filled in by the prefill engine's answer (engine, blocks, host, port).
VLLM_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Sampling constraints a one-token prefill cannot honour; vLLM's reference proxy leaves them
# out of the prefill leg and keeps them for the decode leg.
HELD_BACK_FROM_PREFILL = ("min_tokens", "min_completion_tokens")
# Engines that speak a KV-transfer flow, by the backend's configured `engine`.
FLOWS: dict[str, PdFlow] = {"vllm": "vllm", "sglang": "sglang"}
# The APIs (proxy.forwarding.exchange.API_PATHS keys) with a two-leg flow, as in vLLM's and
# SGLang's own P/D proxies: an embedding has no decode to hand over, and a prefill leg of
# /v1/responses would not be capped (its output limit is `max_output_tokens`).
KV_TRANSFER_APIS = frozenset({"chat", "completions"})
ROOM_BITS = 63  # SGLang draws rooms in [0, 2**63 - 1]


def flow_for(engine: str) -> PdFlow | None:
    """Which KV-transfer flow a backend's `engine` speaks; None: pool split only."""
    return FLOWS.get(engine)


# --- vLLM -------------------------------------------------------------------------------


def vllm_prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg: the client's body made a one-token, non-streaming KV producer.

    `max_completion_tokens` is set to 1 only when the client sent it (vLLM prefers it over
    `max_tokens` when both are present); `stream_options` goes, since vLLM rejects it on a
    non-streaming request; `min_tokens`/`min_completion_tokens` are held back (a one-token
    answer cannot satisfy them) and stay in the decode leg.
    """
    out = {k: v for k, v in body.items() if k not in HELD_BACK_FROM_PREFILL}
    out.pop("stream_options", None)
    out["kv_transfer_params"] = dict(VLLM_PREFILL_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def prefill_kv_params(answer: Any) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a vLLM prefill leg's JSON answer, or None when it has none.

    An engine without a KV connector answers `"kv_transfer_params": null` (or leaves it out);
    then there is nothing to decode from and the flow falls back to decode-only.
    """
    if not isinstance(answer, Mapping):
        return None
    params = answer.get("kv_transfer_params")
    if not isinstance(params, Mapping) or not params:
        return None
    return dict(params)


def vllm_decode_body(
    body: Mapping[str, Any], kv_params: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The decode leg: the client's body unchanged plus the prefill leg's `kv_transfer_params`.

    Without params (the prefill leg failed or returned none) it is the client's body as is: a
    plain decode-only request that prefills locally.
    """
    out = dict(body)
    if kv_params:
        out["kv_transfer_params"] = dict(kv_params)
    return out


# --- SGLang ------------------------------------------------------------------------------


def sglang_batch_size(body: Mapping[str, Any]) -> int | None:
    """How many bootstrap rooms a request needs: None for one (scalar fields), else a count.

    As SGLang's router: `n > 1` asks for n rooms; otherwise a batch of prompts (`prompt` or
    `text` as a list of strings or of token lists, `input_ids` as a list of token lists) one
    room per prompt. One prompt given as token ids (a list of ints) is a single request.
    """
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return n
    for key in ("prompt", "text", "input_ids"):
        value = body.get(key)
        if isinstance(value, list) and value:
            if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                return None  # one tokenized prompt
            return len(value)
    return None


def bootstrap_host(url: str) -> str:
    """The host part of a prefill backend's URL, IPv6 in brackets (as SGLang's balancer)."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


def new_room(rng: random.Random) -> int:
    """A random 63-bit bootstrap room, the range SGLang's own balancers draw from."""
    return rng.getrandbits(ROOM_BITS)


def sglang_body(
    body: Mapping[str, Any],
    host: str,
    port: int | None,
    rng: random.Random,
) -> dict[str, Any]:
    """The body both SGLang legs get: the client's plus `bootstrap_host/port/room`.

    `host` is the prefill backend's (`bootstrap_host(url)`), `port` its bootstrap server's
    port (SGLang `--disaggregation-bootstrap-port`; None lets the engine use its default).
    Batched requests get one entry per prompt in each field, every room drawn afresh.
    """
    out = dict(body)
    batch = sglang_batch_size(body)
    if batch is None:
        out.update(bootstrap_host=host, bootstrap_port=port, bootstrap_room=new_room(rng))
    else:
        out.update(
            bootstrap_host=[host] * batch,
            bootstrap_port=[port] * batch,
            bootstrap_room=[new_room(rng) for _ in range(batch)],
        )
    return out


def rooms_of(body: Mapping[str, Any]) -> list[int]:
    """The bootstrap rooms a body carries (for logs and spans), scalar or batched."""
    room = body.get("bootstrap_room")
    if room is None:
        return []
    return [r for r in (room if isinstance(room, list) else [room]) if isinstance(r, int)]
