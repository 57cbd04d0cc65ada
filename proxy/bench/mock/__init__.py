"""The mock OpenAI backend of the bench and the tests (`python -m proxy.bench.mock --help`).

cache.py    what the mock engine reads of a prompt, and the prefix cache it keeps (pure)
engine.py   MockEngine: the cache an instance keeps and its prefill, serial or in steps
backend.py  MockBackend: the one fake OpenAI server; engine mode, scripted replies, a recorder
serve.py    the zero-latency app, instances on consecutive ports, the command line
"""

from proxy.bench.mock.backend import (
    MockBackend,
    Recorder,
    Reply,
    Request,
    Script,
    prompt_directives,
    prompt_tokens,
)
from proxy.bench.mock.cache import (
    CHARS_PER_TOKEN,
    DEFAULT_BLOCK_TOKENS,
    CacheStats,
    PrefixCache,
    parse_schedule,
    render_prompt,
    tokenize,
)
from proxy.bench.mock.engine import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    VLLM_BATCHED_TOKENS,
    EngineSettings,
    MockEngine,
    StepScheduler,
)
from proxy.bench.mock.serve import build_parser, main, make_app, resize_on_schedule, serve

__all__ = [
    "CHARS_PER_TOKEN",
    "DEFAULT_BLOCK_TOKENS",
    "DEFAULT_PREFILL_TOKENS_PER_S",
    "VLLM_BATCHED_TOKENS",
    "CacheStats",
    "EngineSettings",
    "MockBackend",
    "MockEngine",
    "PrefixCache",
    "Recorder",
    "Reply",
    "Request",
    "Script",
    "StepScheduler",
    "build_parser",
    "main",
    "make_app",
    "parse_schedule",
    "prompt_directives",
    "prompt_tokens",
    "render_prompt",
    "resize_on_schedule",
    "serve",
    "tokenize",
]
