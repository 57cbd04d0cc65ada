"""Deterministic stand-ins for a tokenizer, a chat template and a sampler.

A token is a fixed run of `chars_per_token` characters (~4, the usual English average), so two
prompts that share a textual prefix share token ids up to it: exactly what prefix caching and
prefix-aware routing need, without shipping a real tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import xxhash

VOCAB_SIZE = 128_000
IMAGE_TOKENS = 576  # one image as a ViT's patch tokens (LLaVA-style 24x24)

WORDS = (
    "the of and to in is that it for as with was on be by this are from at or an which "
    "cache token prefill decode batch stream latency memory bandwidth router prefix "
    "engine model request queue block layer head weight compute kernel tensor step "
    "server client proxy backend signal metric trace span window pool first last "
    "fast slow warm cold long short steady quiet bright clear simple careful"
).split()


def tokenize(text: str, chars_per_token: int = 4) -> list[int]:
    """Token ids for `text`: one id per `chars_per_token` characters."""
    step = chars_per_token
    return [
        xxhash.xxh32_intdigest(text[i : i + step].encode()) % VOCAB_SIZE
        for i in range(0, len(text), step)
    ]


def count_tokens(text: str, chars_per_token: int = 4) -> int:
    return -(-len(text) // chars_per_token)


def _content_text(content: Any) -> str:
    """Message content as template text; an image becomes a fixed run of placeholder chars."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict):
                raise ValueError("message content parts must be objects")
            kind = part.get("type")
            if kind == "text":
                out.append(str(part.get("text", "")))
            elif kind in ("image_url", "input_image", "image"):
                # Identical images must give identical tokens, so hash the reference.
                ref = orjson.dumps(part, option=orjson.OPT_SORT_KEYS)
                h = xxhash.xxh64_hexdigest(ref)
                out.append("<image:" + (h * IMAGE_TOKENS)[: IMAGE_TOKENS * 4 - 8] + ">")
            else:
                out.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
        return "".join(out)
    raise ValueError("message content must be a string or a list of parts")


def render_chat(
    messages: Sequence[Any], tools: Sequence[Any] | None = None, add_generation_prompt: bool = True
) -> str:
    """A ChatML-like template: tools first, then each message, then the assistant header."""
    parts: list[str] = []
    if tools:
        parts.append(
            "<|im_start|>tools\n"
            + orjson.dumps(list(tools), option=orjson.OPT_SORT_KEYS).decode()
            + "<|im_end|>\n"
        )
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError("each message must be an object with a 'role'")
        header = str(m["role"])
        if m.get("name"):
            header += f" name={m['name']}"
        body = _content_text(m.get("content"))
        if m.get("tool_calls"):
            body += orjson.dumps(m["tool_calls"], option=orjson.OPT_SORT_KEYS).decode()
        parts.append(f"<|im_start|>{header}\n{body}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def request_seed(prompt_ids: Sequence[int], index: int, seed: int | None, salt: int) -> int:
    """Seed of one output sequence: same prompt, index and seed -> same words."""
    h = xxhash.xxh64(seed=salt & 0xFFFFFFFFFFFFFFFF)
    h.update(len(prompt_ids).to_bytes(8, "little"))
    tail = prompt_ids[-64:]
    h.update(b"".join(t.to_bytes(4, "little") for t in tail))
    h.update(index.to_bytes(4, "little"))
    h.update((seed or 0).to_bytes(8, "little", signed=True))
    return h.intdigest()


def output_token(seq_seed: int, position: int) -> tuple[int, str]:
    """The `position`-th output token of a sequence: (token id, text)."""
    h = xxhash.xxh64_intdigest(position.to_bytes(4, "little"), seed=seq_seed)
    word = WORDS[h % len(WORDS)]
    text = (" " if position else "") + word
    if position and h % 11 == 0:
        text = "." + text[0] + word.capitalize()
    return h % VOCAB_SIZE, text


def natural_length(seq_seed: int, low: int, high: int) -> int:
    """Where the sequence would emit EOS when `ignore_eos` is false."""
    return low + xxhash.xxh64_intdigest(b"eos", seed=seq_seed) % (high - low + 1)
