"""The two-leg request bodies, field by field, as vLLM's and SGLang's own proxies build them."""

from __future__ import annotations

import random
from typing import Any

import pytest

from proxy.disagg import legs

# What a vLLM prefill leg must carry, spelled out here rather than read from proxy.disagg.legs:
# the wire format is the specification the code is checked against (other tests import it).
VLLM_PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "summarise this"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 200,
    "temperature": 0.2,
}


def test_vllm_prefill_leg_is_a_one_token_non_streaming_kv_producer() -> None:
    body = legs.vllm_prefill_body(CHAT)
    assert body == {
        "model": "m",
        "messages": CHAT["messages"],
        "temperature": 0.2,
        "stream": False,
        "max_tokens": 1,
        "kv_transfer_params": VLLM_PREFILL_KV,
    }
    assert CHAT["stream"] is True and "kv_transfer_params" not in CHAT  # the client's is intact


def test_vllm_prefill_leg_sets_max_completion_tokens_only_when_the_client_sent_it() -> None:
    assert "max_completion_tokens" not in legs.vllm_prefill_body(CHAT)
    body = legs.vllm_prefill_body({**CHAT, "max_completion_tokens": 300})
    assert body["max_completion_tokens"] == 1 and body["max_tokens"] == 1


def test_min_tokens_are_held_back_from_the_prefill_leg_and_kept_for_decode() -> None:
    client = {**CHAT, "min_tokens": 20, "min_completion_tokens": 5}
    prefill = legs.vllm_prefill_body(client)
    assert "min_tokens" not in prefill and "min_completion_tokens" not in prefill
    decode = legs.vllm_decode_body(client, {"do_remote_prefill": True})
    assert decode["min_tokens"] == 20 and decode["min_completion_tokens"] == 5


def test_vllm_decode_leg_is_the_clients_body_plus_the_returned_params() -> None:
    answer = {
        "choices": [{"index": 0, "message": {"content": "x"}}],
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [4, 5, 6],
            "remote_engine_id": "engine-a",
            "remote_request_id": "req-1",
            "remote_host": "10.0.0.5",
            "remote_port": 5600,
            "tp_size": 1,
        },
    }
    params = legs.prefill_kv_params(answer)
    decode = legs.vllm_decode_body(CHAT, params)
    assert decode == {**CHAT, "kv_transfer_params": answer["kv_transfer_params"]}


@pytest.mark.parametrize(
    "answer", [{}, {"kv_transfer_params": None}, {"kv_transfer_params": {}}, [], None]
)
def test_a_prefill_answer_without_params_means_decode_only(answer: Any) -> None:
    assert legs.prefill_kv_params(answer) is None
    assert legs.vllm_decode_body(CHAT, None) == CHAT


def test_sglang_body_adds_scalar_bootstrap_fields_with_a_63_bit_room() -> None:
    rng = random.Random(7)
    body = legs.sglang_body(CHAT, legs.bootstrap_host("http://10.0.0.7:30000/v1"), 8998, rng)
    assert {k: body[k] for k in CHAT} == CHAT
    assert body["bootstrap_host"] == "10.0.0.7" and body["bootstrap_port"] == 8998
    room = body["bootstrap_room"]
    assert isinstance(room, int) and 0 <= room < 2**63
    again = legs.sglang_body(CHAT, "10.0.0.7", None, rng)
    assert again["bootstrap_port"] is None and again["bootstrap_room"] != room


@pytest.mark.parametrize(
    ("extra", "batch"),
    [
        ({"n": 3}, 3),
        ({"n": 1}, None),
        ({"prompt": ["a", "b"]}, 2),
        ({"prompt": [[1, 2], [3, 4], [5]]}, 3),
        ({"prompt": [1, 2, 3]}, None),  # one tokenized prompt, not three
        ({"prompt": "one"}, None),
        ({"text": ["x", "y"]}, 2),
        ({"input_ids": [[1], [2]]}, 2),
    ],
)
def test_sglang_batched_requests_get_one_room_per_prompt(
    extra: dict[str, Any], batch: int | None
) -> None:
    body = {"model": "m", **extra}
    assert legs.sglang_batch_size(body) == batch
    out = legs.sglang_body(body, "h", 8998, random.Random(1))
    if batch is None:
        assert isinstance(out["bootstrap_room"], int)
    else:
        assert out["bootstrap_host"] == ["h"] * batch
        assert out["bootstrap_port"] == [8998] * batch
        assert len(set(out["bootstrap_room"])) == batch
        assert legs.rooms_of(out) == out["bootstrap_room"]


def test_bootstrap_host_brackets_ipv6_and_flows_follow_the_engine() -> None:
    assert legs.bootstrap_host("http://[::1]:30000") == "[::1]"
    assert legs.bootstrap_host("https://prefill.internal") == "prefill.internal"
    assert legs.flow_for("vllm") == "vllm" and legs.flow_for("sglang") == "sglang"
    assert legs.flow_for("llamacpp") is None and legs.flow_for("openai") is None
