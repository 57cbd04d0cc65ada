"""Validation of OpenAI request bodies: only what routing and forwarding rely on.

The backend validates the rest; here a bad type in a field we read must become a 400 that
names the field instead of a crash or a confusing upstream error.
"""

from __future__ import annotations

from typing import Any

from proxy.errors import RequestError
from proxy.redact import quote

# api -> the field that carries the prompt and its accepted JSON types
PROMPT_FIELD = {
    "chat": ("messages", (list,)),
    "completions": ("prompt", (str, list)),
    "embeddings": ("input", (str, list)),
    "responses": ("input", (str, list)),
}
_TYPE_NAMES = {list: "an array", str: "a string", dict: "an object", bool: "a boolean"}
# The deepest nesting the proxy can serialize again (orjson writes 254 levels, reads 1024): the
# prefix hash renders tools and content parts, a stream_options rewrite the whole body.
MAX_DEPTH = 254
# Token ids are hashed as signed 64-bit integers; no tokenizer comes near the bound.
_TOKEN_MIN, _TOKEN_MAX = -(2**63), 2**63 - 1


# The other fields the proxy reads, and the JSON types each must have when present (not null)
_TYPED: dict[str, tuple[tuple[type, ...], str]] = {
    "stream": ((bool,), "a boolean"),
    "stream_options": ((dict,), "an object"),
    "max_tokens": ((int,), "an integer"),
    "max_completion_tokens": ((int,), "an integer"),
    "max_output_tokens": ((int,), "an integer"),
    "n": ((int,), "an integer"),
    "temperature": ((int, float), "a number"),
    "top_p": ((int, float), "a number"),
    "user": ((str,), "a string"),
}


def _bad(param: str, message: str) -> RequestError:
    return RequestError(400, message, param=param, code="invalid_value")


def _expect(key: str, value: Any, types: tuple[type, ...], what: str) -> None:
    # bool is an int in Python; a JSON true is never a valid number here.
    if not isinstance(value, types) or (type(value) is bool and bool not in types):
        raise _bad(key, f"'{key}' must be {what}, got {type(value).__name__}: {value!r:.60}")


def validate(api: str, body: Any) -> None:
    """Raise RequestError(400) naming the first offending field."""
    if not isinstance(body, dict):
        raise RequestError(400, "The request body must be a JSON object.", code="invalid_json")
    model = body.get("model")
    if model is None:
        raise RequestError(
            400,
            "Missing required parameter: 'model'.",
            param="model",
            code="missing_required_parameter",
        )
    if not isinstance(model, str) or not model:
        raise _bad("model", "'model' must be a non-empty string.")
    field, types = PROMPT_FIELD[api]
    value = body.get(field)
    if value is None:
        raise RequestError(
            400,
            f"Missing required parameter: '{field}'.",
            param=field,
            code="missing_required_parameter",
        )
    if not isinstance(value, types):
        expected = " or ".join(_TYPE_NAMES[t] for t in types)
        raise _bad(field, f"'{field}' must be {expected}, got {type(value).__name__}.")
    if api == "chat":
        if not value:
            raise _bad("messages", "'messages' must contain at least one message.")
        for i, msg in enumerate(value):
            if not isinstance(msg, dict):
                raise _bad(f"messages[{i}]", f"'messages[{i}]' must be an object.")
            if not isinstance(msg.get("role"), str):
                raise RequestError(
                    400,
                    f"Missing required parameter: 'messages[{i}].role'.",
                    param=f"messages[{i}].role",
                    code="missing_required_parameter",
                )
            for key, part in msg.items():  # strings (the usual content) cost one type check
                if type(part) is list or type(part) is dict:
                    _check_depth(part, 4, f"messages[{i}].{key}")
    elif api in ("completions", "embeddings") and type(value) is list:
        _check_token_ids(field, value)
    # One pass over the fields the client sent (a few), not a lookup for each one read.
    typed = _TYPED
    for key, part in body.items():
        kind = type(part)
        if (kind is list or kind is dict) and (key != field or api != "chat"):
            _check_depth(part, 2, key)
        if key in typed and part is not None:
            _expect(key, part, *typed[key])


def _check_depth(value: Any, depth: int, param: str) -> None:
    """400 naming `param` when `value` (itself at nesting `depth`) nests past MAX_DEPTH."""
    stack = [(value, depth)]
    while stack:
        node, level = stack.pop()
        if level > MAX_DEPTH:
            param = quote(param)  # a key of the client's body: any length
            raise _bad(
                param,
                f"'{param}' is nested more than {MAX_DEPTH} levels deep (with the request "
                "body itself); this proxy does not accept deeper JSON.",
            )
        for child in node.values() if type(node) is dict else node:
            if type(child) is list or type(child) is dict:
                stack.append((child, level + 1))


def _check_token_ids(param: str, value: list[Any]) -> None:
    """400 naming `param` for a token id outside the signed 64-bit range."""
    rows = value if value and type(value[0]) is list else [value]
    for i, row in enumerate(rows):
        if type(row) is not list or not row:
            continue
        try:
            low, high = min(row), max(row)
        except TypeError:  # mixed types: not token ids, the backend will say what it wants
            continue
        if (type(low) is int and low < _TOKEN_MIN) or (type(high) is int and high > _TOKEN_MAX):
            where = f"{param}[{i}]" if rows is value else param
            raise _bad(where, f"'{where}' holds a token id outside the 64-bit integer range.")
