"""proxy.forwarding.validate: each field the proxy reads has its JSON type checked when the
client sends it (null is absent), and a wrong one is a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.errors import RequestError
from proxy.forwarding.validate import validate

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

# field -> (values it takes, values it refuses)
FIELDS: dict[str, tuple[list[Any], list[Any]]] = {
    "stream": ([True, False], ["yes", 1, 0.0, [], {}]),
    "stream_options": ([{}, {"include_usage": True}], [True, "x", [], 1]),
    "max_tokens": ([0, 16], ["10", 1.5, True, []]),
    "max_completion_tokens": ([16], ["16", False]),
    "max_output_tokens": ([16], [2.0, True]),
    "n": ([1], ["1", True]),
    "temperature": ([0, 0.7, 2], ["hot", True, []]),
    "top_p": ([1, 0.9], ["0.9", False]),
    "user": (["u-1"], [7, True, {}]),
}


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_each_read_field_takes_its_type_or_null_and_refuses_others_by_name(field: str) -> None:
    good, bad = FIELDS[field]
    for value in [*good, None]:
        validate("chat", {**CHAT, field: value})
    for value in bad:
        with pytest.raises(RequestError) as e:
            validate("chat", {**CHAT, field: value})
        assert e.value.status == 400 and e.value.param == field
        assert e.value.code == "invalid_value" and f"'{field}' must be" in e.value.message


def test_fields_the_proxy_does_not_read_are_left_to_the_backend() -> None:
    validate("chat", {**CHAT, "seed": "x", "logprobs": "maybe", "tools": [{"type": "function"}]})
