"""The model's own chat template, for exact prefix keys (what the engine really tokenizes).

An engine does not tokenize a chat request's messages as they come: it renders them with the
model's Jinja chat template (`tokenizer_config.json`'s `chat_template`: special tokens, role
headers, the generation prompt) and tokenizes the result without adding special tokens again
(vLLM's chat path). Exact prefix mode promises that one of our blocks is one of the engine's KV
blocks; that holds only if we render the same text the engine does. Without a template, exact
mode tokenizes warmroute's own canonical rendering: blocks line up with each other (good enough
to route) but not with the engine's token ids (not good enough to compare with its KV events).

Jinja2 is optional, like `tokenizers`: only exact mode with a template needs it. Templates run
in Jinja's immutable sandbox with the helpers Hugging Face templates expect (`raise_exception`,
`strftime_now`, the `tojson` filter).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any


class ChatTemplate:
    """A compiled chat template with the special tokens its config names."""

    def __init__(
        self, source: str, bos_token: str = "", eos_token: str = "", origin: str = "template"
    ) -> None:
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ValueError(
                "prefix.chat_template_file needs the `jinja2` package: pip install jinja2"
            ) from None

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except Exception as e:  # a syntax error: say where it came from
            raise ValueError(f"{origin}: not a valid Jinja chat template ({e})") from None
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_file(cls, path: str) -> ChatTemplate:
        """A tokenizer_config.json (its `chat_template`, `bos_token`, `eos_token`) or a bare
        Jinja file."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"prefix.chat_template_file {path!r}: cannot read it ({e})") from None
        if p.suffix != ".json":
            return cls(text, origin=f"prefix.chat_template_file {path!r}")
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"prefix.chat_template_file {path!r}: invalid JSON ({e})") from None
        source = cfg.get("chat_template") if isinstance(cfg, dict) else None
        if isinstance(source, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        if not isinstance(source, str) or not source:
            raise ValueError(
                f"prefix.chat_template_file {path!r}: no `chat_template` in it; point the key "
                "at the model's tokenizer_config.json or at a .jinja file"
            )
        return cls(
            source,
            _token(cfg.get("bos_token")),
            _token(cfg.get("eos_token")),
            origin=f"prefix.chat_template_file {path!r}",
        )

    def render(self, messages: Sequence[Any], tools: Any = None) -> str:
        """The prompt text the engine tokenizes for a chat request (generation prompt added)."""
        return str(
            self._template.render(
                messages=[_plain(m) for m in messages if isinstance(m, Mapping)],
                tools=tools or None,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        )


def _plain(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as HF templates expect it: text parts joined into one string (what vLLM's
    "string" content format does); other fields as they are."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "\n".join(
            str(p.get("text", "")) for p in content if isinstance(p, Mapping) and "text" in p
        )
    return out


def _token(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)
