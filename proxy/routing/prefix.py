"""Prompt -> chain of block hashes (pure, no I/O).

The request is rendered canonically in the order an engine's chat template lays it out (tools,
then messages), cut into fixed blocks and chain-hashed: h0 = H(model, salt), hi = H(h(i-1),
block i). Because each hash covers everything before it, "backend has seen hk" means "backend
has seen the whole prefix up to block k", so a longest-prefix match is a lookup of one hash.

Rendering works on the parsed body, so dict key order and JSON spacing never change the key.
It is not the engine's exact token stream (templates differ per model); what matters is that
two requests sharing a prompt prefix share a rendered prefix, and that blocks are stable.
The salt is the request's `cache_salt` and, with API keys and server.isolate_tenants, the
key's name: one tenant's prompts never match another's (docs/security.md).
Exact mode with the model's chat template (proxy.routing.template) is the engine's stream.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import orjson
import xxhash
from pydantic import Field

import proxy
from proxy.routing.template import ChatTemplate
from proxy.routing.types import PluginSettings
from proxy.types import TENANT

_h64 = xxhash.xxh3_64_intdigest
# The chain in one C call where the compiled hot path runs (proxy/_prefixhash.c: the same
# hashes, ~30 times faster than a Python step a block); None where the sources do.
_native = proxy.native("proxy._prefixhash")
_chain_c = None if _native is None else _native.chain
# Separators that cannot be confused with ordinary text: one between messages, one between the
# fields of a message. Without them "ab"+"c" and "a"+"bc" would render identically.
_MSG = "\x1e"
_FIELD = "\x1f"
DEFAULT_BLOCK_CHARS = 64  # ~16 tokens: the KV block size of vLLM and SGLang's page multiple
DEFAULT_MAX_BLOCKS = 4096  # 256k chars; longer tails add lookup cost but never change routing


def _digest(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return format(_h64(raw), "016x")


def _json(value: Any) -> str:
    # Sorted keys: the rendering must not depend on how the client ordered its dicts.
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _part(part: Any) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        return _json(part)
    kind = part.get("type")
    if kind in ("text", "input_text", "output_text"):
        return str(part.get("text", ""))
    if kind in ("image_url", "input_image"):
        # A data: URL can be megabytes of base64; its hash identifies the image just as well.
        img = part.get("image_url")
        url = img.get("url", "") if isinstance(img, Mapping) else img or ""
        return f"<image:{_digest(str(url))}>"
    if kind == "input_audio":
        audio = part.get("input_audio")
        data = audio.get("data", "") if isinstance(audio, Mapping) else ""
        return f"<audio:{_digest(str(data))}>"
    return _json(part)


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part(p) for p in content)
    return _json(content)


def _message(m: Any) -> str:
    if not isinstance(m, Mapping):
        return _json(m)
    fields = [str(m.get("role", "")), str(m.get("name") or ""), _content(m.get("content"))]
    # Tool calls and results are part of the prompt the engine prefills on the next turn.
    if m.get("tool_calls"):
        fields.append(_json(m["tool_calls"]))
    if m.get("tool_call_id"):
        fields.append(str(m["tool_call_id"]))
    return _FIELD.join(fields)


def _prompt(prompt: Any) -> str:
    if prompt is None:
        return ""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            return _MSG.join(prompt)
        return _json(prompt)
    return _json(prompt)


def render(api: str, body: Mapping[str, Any]) -> str:
    """The request's prompt as one canonical string (tools, then messages; or the prompt)."""
    parts: list[str] = []
    tools = body.get("tools")
    if tools:
        parts.append(_json(tools))
    messages = body.get("messages")
    # Only chat validates `messages`; another API's body may carry any value under that key.
    if api == "chat" or isinstance(messages, list):
        parts.extend(_message(m) for m in (messages if isinstance(messages, list) else ()))
    elif api == "responses":
        if body.get("instructions"):
            parts.append(_FIELD.join(("system", "", str(body["instructions"]))))
        items = body.get("input")
        if isinstance(items, str):
            parts.append(_FIELD.join(("user", "", items)))
        else:
            parts.extend(_message(m) for m in items or ())
    elif api == "embeddings":
        parts.append(_prompt(body.get("input")))
    else:
        parts.append(_prompt(body.get("prompt")))
    return _MSG.join(parts)


def token_ids(api: str, body: Mapping[str, Any]) -> list[int] | None:
    """The prompt as token ids when the client sent ids (completions), else None."""
    prompt = body.get("input" if api == "embeddings" else "prompt")
    if isinstance(prompt, list) and prompt:
        if all(type(t) is int for t in prompt):
            return list(prompt)
        if all(isinstance(p, list) for p in prompt) and all(
            type(t) is int for p in prompt for t in p
        ):
            # A batch: the engine caches each prompt; the first one carries the shared prefix.
            return list(prompt[0])
    return None


def seed(model: str, salt: str | None = None) -> int:
    """h0: the chain's start. Different models (or cache salts) never share a block."""
    return _h64(f"{model}{_FIELD}{salt or ''}".encode())


def chain_bytes(h0: int, data: bytes, block_bytes: int, max_blocks: int) -> list[int]:
    """Chain-hash whole blocks of `data`; a partial last block is not hashed (not cacheable)."""
    if _chain_c is not None:
        done = _chain_c(h0, data, block_bytes, max_blocks)
        if done is not None:  # (None: a block longer than the C hash takes, 240 bytes)
            return done
    return chain_bytes_py(h0, data, block_bytes, max_blocks)


def chain_bytes_py(h0: int, data: bytes, block_bytes: int, max_blocks: int) -> list[int]:
    """chain_bytes in Python: the fallback, and the reference tests/test_prefixhash.py holds
    proxy/_prefixhash.c to."""
    out: list[int] = []
    h = h0
    n = min(len(data) // block_bytes, max_blocks)
    for i in range(0, n * block_bytes, block_bytes):
        # The previous hash is the seed: H(h(i-1), block i) at the cost of one xxh3 call.
        h = _h64(data[i : i + block_bytes], h)
        out.append(h)
    return out


def chain_text(h0: int, text: str, block_chars: int, max_blocks: int) -> list[int]:
    """Chain-hash `text` in blocks of `block_chars` characters."""
    if text.isascii():
        # Bytes == chars: one encode and byte slices beat encoding every block.
        return chain_bytes(h0, text.encode(), block_chars, max_blocks)
    out: list[int] = []
    h = h0
    n = min(len(text) // block_chars, max_blocks)
    for i in range(0, n * block_chars, block_chars):
        h = _h64(text[i : i + block_chars].encode("utf-8", "surrogatepass"), h)
        out.append(h)
    return out


def chain_tokens(h0: int, ids: Sequence[int], block_tokens: int, max_blocks: int) -> list[int]:
    """Chain-hash token ids in blocks of `block_tokens` (aligned with the engine's KV blocks)."""
    packed = array("q", ids).tobytes()
    return chain_bytes(h0, packed, block_tokens * 8, max_blocks)


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """One request's prefix: its block hashes and what a block is worth in characters."""

    blocks: list[int]
    chars: int  # rendered prompt length (estimated from tokens in exact mode)
    block_chars: int  # characters per block (estimated in exact mode) to turn blocks into size
    tokens: bool = False  # blocks of token ids (exact mode, or a token-id prompt): engine blocks


class HasherSettings(PluginSettings):
    """The hasher's keys in the `routing.plugins.prefix` block."""

    block_chars: int = Field(DEFAULT_BLOCK_CHARS, gt=0)  # characters a block (approximate mode)
    max_blocks: int = Field(DEFAULT_MAX_BLOCKS, gt=0)  # blocks hashed at most, from the start
    tokenizer_file: str | None = None  # exact mode: the model's tokenizer.json
    kv_block_tokens: int = Field(16, gt=0)  # exact mode: tokens a block (the engine's)
    chars_per_token: float = Field(4.0, gt=0)
    chat_template_file: str | None = None  # exact mode: render chats as the engine does


class PrefixHasher:
    """Turns a parsed request body into a PrefixKey.

    Character mode (default) cuts the rendered prompt into `block_chars` blocks. Exact mode
    (`tokenizer_file` set, HF `tokenizers` JSON) tokenizes the rendering and cuts it into
    `kv_block_tokens` blocks, so one of our blocks is one of the engine's KV blocks. Token-id
    prompts (completions) are always cut by tokens.
    """

    def __init__(
        self,
        block_chars: int = DEFAULT_BLOCK_CHARS,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        tokenizer_file: str | None = None,
        kv_block_tokens: int = 16,
        chars_per_token: float = 4.0,
        chat_template_file: str | None = None,
    ) -> None:
        if block_chars <= 0 or kv_block_tokens <= 0 or max_blocks <= 0:
            raise ValueError("block_chars, kv_block_tokens and max_blocks must be positive")
        if chat_template_file and not tokenizer_file:
            raise ValueError(
                "prefix.chat_template_file renders prompts for exact mode: set "
                "prefix.tokenizer_file (the model's tokenizer.json) too"
            )
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self.tokenizer_file = tokenizer_file
        self.kv_block_tokens = kv_block_tokens
        self.chars_per_token = chars_per_token
        self.template: ChatTemplate | None = None
        self.template_errors = 0  # chat requests the template refused (keyed canonically)
        if chat_template_file:
            self.template = ChatTemplate.from_file(chat_template_file)
        if tokenizer_file:
            _ = self._tokenizer  # loaded now: a bad setting fails at startup, not per request

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> PrefixHasher:
        return cls(**HasherSettings.of(cfg).model_dump())

    @cached_property
    def _tokenizer(self) -> Any:
        # Imported here: `tokenizers` is optional and only exact mode needs it.
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(
                "prefix.tokenizer_file needs the `tokenizers` package: pip install tokenizers"
            ) from None
        try:
            return Tokenizer.from_file(str(self.tokenizer_file))
        except Exception as e:  # missing file, not a tokenizer.json: say which and why
            raise ValueError(
                f"prefix.tokenizer_file {self.tokenizer_file!r}: cannot load it as a Hugging "
                f"Face tokenizer.json ({e})"
            ) from None

    def _template_text(self, api: str, body: Mapping[str, Any]) -> str | None:
        """A chat request rendered with the model's template, as the engine renders it."""
        messages = body.get("messages")
        if api != "chat" or not isinstance(messages, list) or self.template is None:
            return None
        try:
            return self.template.render(messages, body.get("tools"))
        except Exception:  # a template that refuses these messages: key canonically instead
            self.template_errors += 1
            return None

    @property
    def token_block_chars(self) -> int:
        return max(1, round(self.kv_block_tokens * self.chars_per_token))

    def key(
        self, model: str, api: str, body: Mapping[str, Any], salt: str | None = None
    ) -> PrefixKey:
        if salt is None:
            raw_salt = body.get("cache_salt")  # vLLM's per-tenant cache isolation
            salt = raw_salt if isinstance(raw_salt, str) else None
            tenant = TENANT.get()  # the API key's name, when tenants are isolated
            if tenant is not None:
                salt = f"{tenant}{_FIELD}{salt or ''}"
        h0 = seed(model, salt)
        ids = token_ids(api, body)
        if ids is not None:
            blocks = chain_tokens(h0, ids, self.kv_block_tokens, self.max_blocks)
            tbc = self.token_block_chars
            return PrefixKey(blocks, round(len(ids) * self.chars_per_token), tbc, tokens=True)
        text = self._template_text(api, body) if self.template is not None else None
        if text is None:
            text = render(api, body)
        if self.tokenizer_file:
            enc = self._tokenizer.encode(text, add_special_tokens=False)
            blocks = chain_tokens(h0, enc.ids, self.kv_block_tokens, self.max_blocks)
            # This prompt's own chars per block, so matched blocks convert to a fair size.
            per_block = len(text) * self.kv_block_tokens / max(len(enc.ids), 1)
            return PrefixKey(blocks, len(text), max(1, round(per_block)), tokens=True)
        return PrefixKey(
            chain_text(h0, text, self.block_chars, self.max_blocks), len(text), self.block_chars
        )
