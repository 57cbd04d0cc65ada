"""Validation of OpenAI request bodies: only what routing and forwarding rely on.

The backend validates the rest; here a bad type in a field we read must become a 400 that
names the field instead of a crash or a confusing upstream error.
"""

from __future__ import annotations

from typing import Any

from proxy.errors import RequestError

# api -> the field that carries the prompt and its accepted JSON types
PROMPT_FIELD = {
    "chat": ("messages", (list,)),
    "completions": ("prompt", (str, list)),
    "embeddings": ("input", (str, list)),
    "responses": ("input", (str, list)),
}
_TYPE_NAMES = {list: "an array", str: "a string", dict: "an object", bool: "a boolean"}


def _bad(param: str, message: str) -> RequestError:
    return RequestError(400, message, param=param, code="invalid_value")


def _expect(body: dict[str, Any], key: str, types: tuple[type, ...], what: str) -> None:
    value = body.get(key)
    if value is None:
        return
    # bool is an int in Python; a JSON true is never a valid number here.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
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
    _expect(body, "stream", (bool,), "a boolean")
    _expect(body, "stream_options", (dict,), "an object")
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n"):
        _expect(body, key, (int,), "an integer")
    for key in ("temperature", "top_p"):
        _expect(body, key, (int, float), "a number")
    _expect(body, "user", (str,), "a string")
