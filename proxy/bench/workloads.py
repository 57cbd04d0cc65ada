"""Seeded, deterministic request generators for `warmroute bench`.

A `Workload` is a small value object (name, seed, sizes). `plan(n)` turns it into the ordered
list of `RequestSpec`s the runner issues; `messages(spec, history)` renders one request. Text is
rendered lazily from a per-workload corpus so that 100k long documents never sit in memory at
once, and the same seed always yields byte-identical prompts (random.Random is stable across
CPython versions for integer seeds).

Sizes are in characters; ~4 characters make one token for English text, so the defaults are
a ~500-token system prompt, ~50-token user turns and ~2,000-token documents.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

WORKLOADS = ("shared-prefix", "multi-turn", "long-doc", "mixed", "hot-prompt", "chat-docs")
# Sizes a workload starts from when make_workload is not told otherwise. chat-docs is the
# prefill/decode interference case (docs/disaggregation.md): chat streams with short uncached
# prompts and long answers, beside ~8,000-token documents that are prefilled once and answered
# in a few tokens.
PRESETS: dict[str, dict[str, Any]] = {
    "chat-docs": {
        "max_tokens": 512,
        "doc_chars": 32000,
        "doc_max_tokens": 16,
        "doc_fraction": 0.15,
    },
}
CHARS_PER_TOKEN = 4

Message = dict[str, str]
Kind = Literal["chat", "doc"]

# Common English words: prompts look like text to tokenizers (≈4 chars/token), unlike random
# letters, which would tokenize into many more tokens than the character budget suggests.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no will can more about other into some could them these time two may first then do "
    "any like my now over such our man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people "
    "how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year "
    "off come since against go came right used take three system prompt cache model token "
    "latency stream request answer question document section table figure value result "
    "server memory bandwidth prefill decode batch queue backend router proxy measure"
).split()

_CORPUS_CHARS = 1 << 16


@dataclass(frozen=True)
class RequestSpec:
    """One request of a plan: what to send, without the rendered text (see `Workload.messages`)."""

    index: int
    kind: Kind
    max_tokens: int
    user_offset: int  # where in the corpus this request's unique text starts
    user_chars: int
    system_id: int | None = None  # which shared system prompt, None for none
    conversation: int | None = None  # multi-turn: later turns wait for the earlier ones
    turn: int = 0


@dataclass(frozen=True)
class Workload:
    """A named, seeded workload; every size is configurable (characters, ~4 per token)."""

    name: str = "shared-prefix"
    seed: int = 0
    system_chars: int = 2000
    system_chars_min: int | None = None  # each prompt's length uniform in [min, system_chars]
    num_prefixes: int = 8  # K distinct system prompts (shared-prefix, multi-turn, mixed)
    zipf_s: float = 1.1  # popularity exponent over the K prompts; 0 = uniform
    user_chars: int = 200
    doc_chars: int = 8000
    max_tokens: int = 128
    doc_max_tokens: int = 32
    turns: int = 4  # multi-turn: turns per conversation
    active_conversations: int = 8  # multi-turn: conversations interleaved at once
    doc_fraction: float = 0.2  # mixed: share of long-doc requests
    _corpus: str = field(default="", init=False, repr=False, compare=False)
    _systems: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(
                f"unknown workload {self.name!r}; choose one of {', '.join(WORKLOADS)}"
            )
        for key in ("system_chars", "user_chars", "doc_chars", "max_tokens", "doc_max_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"workload {key} must be >= 1")
        if self.system_chars_min is not None and not 1 <= self.system_chars_min <= (
            self.system_chars
        ):
            raise ValueError("workload system_chars_min must be between 1 and system_chars")
        if self.num_prefixes < 1 or self.turns < 1 or self.active_conversations < 1:
            raise ValueError("workload num_prefixes, turns and active_conversations must be >= 1")
        if not 0.0 <= self.doc_fraction <= 1.0:
            raise ValueError("workload doc_fraction must be between 0 and 1")
        rng = random.Random(f"{self.seed}:corpus")
        corpus = _words(rng, _CORPUS_CHARS)
        k = 1 if self.name == "hot-prompt" else self.num_prefixes
        # A distinct head per prompt: prefix caches and the router must tell them apart from
        # the first block, as with real system prompts that differ in their opening lines.
        lengths = [self._system_length(i) for i in range(k)]
        systems = tuple(
            (
                f"System prompt {i} ({self.name}, seed {self.seed}). You are assistant number {i}. "
                + _words(random.Random(f"{self.seed}:system:{i}"), n)
            )[:n]
            for i, n in enumerate(lengths)
        )
        object.__setattr__(self, "_corpus", corpus)
        object.__setattr__(self, "_systems", systems)

    def _system_length(self, i: int) -> int:
        low = self.system_chars_min
        if low is None or low >= self.system_chars:
            return self.system_chars
        return random.Random(f"{self.seed}:system-length:{i}").randint(low, self.system_chars)

    def params(self) -> dict[str, Any]:
        """The knobs that define this workload, for results files."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    @property
    def system_prompts(self) -> tuple[str, ...]:
        return self._systems

    def plan(self, n: int) -> list[RequestSpec]:
        """The first `n` requests in issue order; identical for identical (workload, n)."""
        rng = random.Random(f"{self.seed}:plan:{self.name}")
        if self.name == "multi-turn":
            return self._plan_multi_turn(n, rng)
        pick = _zipf_picker(rng, self.num_prefixes, self.zipf_s)
        out: list[RequestSpec] = []
        for i in range(n):
            is_doc = self.name == "long-doc" or (
                self.name in ("mixed", "chat-docs") and rng.random() < self.doc_fraction
            )
            if is_doc:
                out.append(
                    RequestSpec(i, "doc", self.doc_max_tokens, self._offset(rng), self.doc_chars)
                )
            else:
                system_id = 0 if self.name == "hot-prompt" else pick()
                out.append(
                    RequestSpec(
                        i, "chat", self.max_tokens, self._offset(rng), self.user_chars, system_id
                    )
                )
        return out

    def _plan_multi_turn(self, n: int, rng: random.Random) -> list[RequestSpec]:
        # Conversations run in waves of `active_conversations`, turn by turn, so that several
        # are in flight at once and turn k+1 of one is issued while others still run turn k.
        pick = _zipf_picker(rng, self.num_prefixes, self.zipf_s)
        n_conv = math.ceil(n / self.turns) if n else 0
        systems = [pick() for _ in range(n_conv)]
        out: list[RequestSpec] = []
        for wave in range(0, n_conv, self.active_conversations):
            convs = range(wave, min(wave + self.active_conversations, n_conv))
            for turn in range(self.turns):
                for c in convs:
                    if len(out) == n:
                        return out
                    out.append(
                        RequestSpec(
                            len(out),
                            "chat",
                            self.max_tokens,
                            self._offset(rng),
                            self.user_chars,
                            systems[c],
                            conversation=c,
                            turn=turn,
                        )
                    )
        return out

    def _offset(self, rng: random.Random) -> int:
        return rng.randrange(_CORPUS_CHARS)

    def user_text(self, spec: RequestSpec) -> str:
        """The unique part of a request: a tag that differs from the first characters, then text."""
        tag = (
            f"Document {spec.index} of seed {self.seed}. Summarize it in one sentence.\n"
            if spec.kind == "doc"
            else f"Request {spec.index}, turn {spec.turn}: "
        )
        return tag + _slice(self._corpus, spec.user_offset, max(spec.user_chars - len(tag), 1))

    def user(self, spec: RequestSpec) -> str | None:
        """The OpenAI `user` field a chat app would send: one per conversation, else none."""
        if spec.conversation is None:
            return None
        return f"seed{self.seed}-conversation-{spec.conversation}"

    def messages(self, spec: RequestSpec, history: Sequence[Message] = ()) -> list[Message]:
        """Chat messages for `spec`; `history` holds earlier turns (user and assistant replies)."""
        msgs: list[Message] = []
        if spec.system_id is not None and spec.kind == "chat":
            msgs.append({"role": "system", "content": self._systems[spec.system_id]})
        msgs.extend(history)
        msgs.append({"role": "user", "content": self.user_text(spec)})
        return msgs

    def prompt(self, spec: RequestSpec, history: Sequence[Message] = ()) -> str:
        """The same request flattened for /v1/completions (system, history, user; one per block)."""
        parts = [f"{m['role']}: {m['content']}" for m in self.messages(spec, history)]
        return "\n\n".join([*parts, "assistant:"])


def make_workload(name: str, seed: int = 0, **sizes: Any) -> Workload:
    """Build a workload by name from its PRESETS, then the size knobs given (None: unset)."""
    given = {k: v for k, v in sizes.items() if v is not None}
    return Workload(name=name, seed=seed, **{**PRESETS.get(name, {}), **given})


def _zipf_picker(rng: random.Random, k: int, s: float) -> Any:
    weights = [1.0 / (i + 1) ** s for i in range(k)]
    cum: list[float] = []
    total = 0.0
    for w in weights:
        total += w
        cum.append(total)
    population = list(range(k))

    def pick() -> int:
        return rng.choices(population, cum_weights=cum)[0]

    return pick


def _words(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    sentence = 0
    while size < chars:
        w = rng.choice(_WORDS)
        sentence += 1
        if sentence >= 12 and rng.random() < 0.2:
            w += "."
            sentence = 0
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:chars]


def _slice(corpus: str, offset: int, n: int) -> str:
    if offset + n <= len(corpus):
        return corpus[offset : offset + n]
    parts = [corpus[offset:]]
    left = n - len(parts[0])
    while left > 0:
        parts.append(corpus[:left])
        left -= len(parts[-1])
    return "".join(parts)
