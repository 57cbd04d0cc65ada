#!/usr/bin/env python3
"""Write a tiny llama-architecture GGUF with deterministic random weights.

No model can be downloaded in CI or on an offline laptop, yet a real engine needs one. The
weights' values do not matter for serving physics: prefill cost, decode cost and the prompt
cache depend on the shapes, not on what the model says. So this writes random f16 weights
(output is gibberish; use temperature 0 and ignore_eos) with a real SentencePiece tokenizer
copied from the vocab-only GGUF that llama.cpp ships, plus a ChatML chat template so that
/v1/chat/completions works.

The same seed and shape give a byte-identical file. The result is cached next to the
llama-server binary that build.sh installs; a second run is a no-op and prints the path.

    python deploy/llamacpp/make_model.py            # prints the model's path
    python deploy/llamacpp/make_model.py --seed 7 --out /tmp/m.gguf
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LLAMACPP_VERSION = os.environ.get("LLAMACPP_VERSION", "11434.0.0")
VOCAB_FILE = "ggml-vocab-llama-spm.gguf"

# ChatML, tolerant of OpenAI content-part lists (text parts only) so clients that send
# `[{"type": "text", ...}]` work too. The tokenizer has no <|im_start|> tokens; the markers
# are plain text, which is fine for a model that produces gibberish anyway.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

# Tokenizer keys copied verbatim from the vocab-only file.
TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
)


@dataclass(frozen=True)
class Shape:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    ffn: int = 768
    ctx: int = 4096

    @property
    def tag(self) -> str:
        return f"L{self.layers}-E{self.hidden}-H{self.heads}-F{self.ffn}-C{self.ctx}"


def cache_prefix() -> Path:
    root = Path(os.environ.get("WARMROUTE_CACHE") or Path.home() / ".cache" / "warmroute")
    return root / "llama.cpp" / LLAMACPP_VERSION


def default_model_path(shape: Shape, seed: int) -> Path:
    return cache_prefix() / "models" / f"warmroute-tiny-{shape.tag}-seed{seed}.gguf"


def find_vocab(explicit: Path | None) -> Path:
    candidates = [explicit] if explicit else []
    prefix = cache_prefix()
    # build.sh copies the vocab next to the binary; the tree is there only with KEEP_BUILD.
    candidates += [
        prefix / "share" / VOCAB_FILE,
        prefix / "work" / "src" / "llama.cpp" / "models" / VOCAB_FILE,
    ]
    for path in candidates:
        if path and path.is_file():
            return path
    tried = ", ".join(str(p) for p in candidates if p)
    raise SystemExit(
        f"make_model: {VOCAB_FILE} not found (tried {tried}). "
        "Run deploy/llamacpp/build.sh first, or pass --vocab."
    )


def read_tokenizer(vocab: Path) -> dict[str, object]:
    import gguf

    reader = gguf.GGUFReader(vocab)
    out: dict[str, object] = {}
    for key in TOKENIZER_KEYS:
        field = reader.get_field(key)
        if field is not None:
            out[key] = field.contents()
    if "tokenizer.ggml.tokens" not in out:
        raise SystemExit(f"make_model: {vocab} has no tokenizer.ggml.tokens")
    return out


def write_model(out: Path, vocab: Path, shape: Shape, seed: int) -> None:
    import gguf

    tok = read_tokenizer(vocab)
    tokens = list(tok["tokenizer.ggml.tokens"])  # type: ignore[call-overload]
    n_vocab = len(tokens)
    if shape.hidden % shape.heads:
        raise SystemExit("make_model: --hidden must be a multiple of --heads")
    head_dim = shape.hidden // shape.heads

    rng = np.random.default_rng(seed)

    def weight(*np_shape: int) -> np.ndarray:
        # Small scale keeps activations finite through the layers (no NaNs in f16).
        fan_in = np_shape[-1]
        w = rng.standard_normal(np_shape, dtype=np.float32) / np.sqrt(fan_in)
        return w.astype(np.float16)

    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), arch="llama")
    w.add_name(f"warmroute-tiny-{shape.tag}-seed{seed}")
    w.add_context_length(shape.ctx)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    w.add_tokenizer_model(str(tok["tokenizer.ggml.model"]))
    if "tokenizer.ggml.pre" in tok:
        w.add_tokenizer_pre(str(tok["tokenizer.ggml.pre"]))
    w.add_token_list(tokens)
    w.add_token_scores(list(tok["tokenizer.ggml.scores"]))  # type: ignore[call-overload]
    w.add_token_types(list(tok["tokenizer.ggml.token_type"]))  # type: ignore[call-overload]
    w.add_bos_token_id(int(tok["tokenizer.ggml.bos_token_id"]))  # type: ignore[call-overload]
    w.add_eos_token_id(int(tok["tokenizer.ggml.eos_token_id"]))  # type: ignore[call-overload]
    if "tokenizer.ggml.unknown_token_id" in tok:
        w.add_unk_token_id(int(tok["tokenizer.ggml.unknown_token_id"]))  # type: ignore[call-overload]
    w.add_add_bos_token(bool(tok.get("tokenizer.ggml.add_bos_token", True)))
    w.add_add_eos_token(bool(tok.get("tokenizer.ggml.add_eos_token", False)))
    w.add_chat_template(CHAT_TEMPLATE)

    # numpy shapes are ggml's ne reversed: (rows=out_features, cols=in_features).
    e, f = shape.hidden, shape.ffn
    w.add_tensor("token_embd.weight", weight(n_vocab, e))
    for i in range(shape.layers):
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", np.ones(e, dtype=np.float32))
        w.add_tensor(f"{p}.attn_q.weight", weight(e, e))
        w.add_tensor(f"{p}.attn_k.weight", weight(e, e))
        w.add_tensor(f"{p}.attn_v.weight", weight(e, e))
        w.add_tensor(f"{p}.attn_output.weight", weight(e, e))
        w.add_tensor(f"{p}.ffn_norm.weight", np.ones(e, dtype=np.float32))
        w.add_tensor(f"{p}.ffn_gate.weight", weight(f, e))
        w.add_tensor(f"{p}.ffn_up.weight", weight(f, e))
        w.add_tensor(f"{p}.ffn_down.weight", weight(e, f))
    w.add_tensor("output_norm.weight", np.ones(e, dtype=np.float32))
    w.add_tensor("output.weight", weight(n_vocab, e))

    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        # Rename last so a concurrent reader (another test worker) never sees a partial file.
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_model(
    out: Path | None = None,
    seed: int = 0,
    shape: Shape | None = None,
    vocab: Path | None = None,
    force: bool = False,
) -> Path:
    """Return the model's path, writing it first if it does not exist yet."""
    shape = shape or Shape()
    out = out or default_model_path(shape, seed)
    if out.is_file() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    write_model(out, find_vocab(vocab), shape, seed)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    d = Shape()
    ap.add_argument("--out", type=Path, help="output path (default: next to the llama-server)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--vocab", type=Path, help=f"vocab-only GGUF (default: build.sh's {VOCAB_FILE})"
    )
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--hidden", type=int, default=d.hidden)
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--ffn", type=int, default=d.ffn)
    ap.add_argument("--ctx", type=int, default=d.ctx)
    ap.add_argument("--force", action="store_true", help="rewrite even if the file exists")
    a = ap.parse_args(argv)
    try:
        import gguf  # noqa: F401
    except ImportError:
        print("make_model: the 'gguf' package is missing: pip install gguf", file=sys.stderr)
        return 2
    shape = Shape(a.layers, a.hidden, a.heads, a.ffn, a.ctx)
    path = ensure_model(a.out, a.seed, shape, a.vocab, a.force)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
