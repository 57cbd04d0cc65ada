"""Prefix hashing: canonical rendering and the block hash chain."""

from __future__ import annotations

import importlib.util
import json

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.routing.prefix import (
    PrefixHasher,
    chain_text,
    chain_tokens,
    render,
    seed,
)

TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=600)
BLOCK = st.integers(min_value=1, max_value=80)


@given(TEXT, TEXT, BLOCK)
def test_shared_prefix_gives_identical_leading_hashes(a: str, b: str, block: int) -> None:
    h0 = seed("m")
    full = chain_text(h0, a + b, block, 10_000)
    head = chain_text(h0, a, block, 10_000)
    assert full[: len(head)] == head


@given(TEXT, BLOCK)
def test_one_block_per_whole_block_of_text(text: str, block: int) -> None:
    assert len(chain_text(seed("m"), text, block, 10_000)) == len(text) // block


@given(st.text(min_size=64, max_size=300), st.integers(min_value=0, max_value=63))
def test_a_changed_character_changes_its_block_and_every_later_hash(text: str, i: int) -> None:
    changed = text[:i] + ("b" if text[i] == "a" else "a") + text[i + 1 :]
    one, two = chain_text(seed("m"), text, 16, 1000), chain_text(seed("m"), changed, 16, 1000)
    k = i // 16
    assert one[:k] == two[:k]
    assert all(x != y for x, y in zip(one[k:], two[k:], strict=True))


@given(TEXT.filter(lambda t: len(t) >= 64))
def test_model_and_cache_salt_seed_separate_chains(text: str) -> None:
    a = chain_text(seed("llama"), text, 64, 100)
    assert chain_text(seed("qwen"), text, 64, 100)[0] != a[0]
    assert chain_text(seed("llama", "tenant-1"), text, 64, 100)[0] != a[0]


def test_block_count_is_capped_by_max_blocks() -> None:
    assert len(chain_text(seed("m"), "x" * 10_000, 64, 10)) == 10


def test_ascii_and_non_ascii_paths_agree_on_ascii_text() -> None:
    # The ASCII fast path encodes once; the general path encodes per block: same hashes.
    text = "hello world " * 40
    fast = chain_text(seed("m"), text, 64, 100)
    slow = chain_text(seed("m"), text + "é", 64, 100)
    assert fast == slow[: len(fast)]


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3)
    ),
    max_leaves=8,
)


def _reorder(value: object) -> object:
    if isinstance(value, dict):
        return {k: _reorder(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reorder(v) for v in value]
    return value


@given(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text()},
            optional={"name": st.text(max_size=5)},
        ),
        max_size=4,
    ),
    st.lists(JSONISH, max_size=2),
    st.integers(0, 4),
)
def test_rendering_ignores_key_order_and_json_spacing(
    messages: list[dict[str, str]], tools: list[object], indent: int
) -> None:
    body = {"model": "m", "tools": tools, "messages": messages, "temperature": 0.2}
    reparsed = json.loads(json.dumps(_reorder(body), indent=indent or None))
    assert render("chat", reparsed) == render("chat", orjson.loads(orjson.dumps(body)))


def test_sampling_parameters_do_not_change_the_key() -> None:
    msgs = [{"role": "user", "content": "hi " * 50}]
    hasher = PrefixHasher()
    a = hasher.key("m", "chat", {"messages": msgs, "temperature": 0})
    b = hasher.key("m", "chat", {"messages": msgs, "temperature": 1, "max_tokens": 9})
    assert a.blocks == b.blocks and a.blocks


def test_tools_come_before_messages_and_change_the_key() -> None:
    msgs = [{"role": "system", "content": "s" * 200}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    text = render("chat", {"messages": msgs, "tools": [tool]})
    assert text.index('"function"') < text.index("s" * 200)
    assert render("chat", {"messages": msgs}) != text


def test_field_boundaries_are_not_ambiguous() -> None:
    a = render(
        "chat", {"messages": [{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}]}
    )
    b = render(
        "chat", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "bc"}]}
    )
    assert a != b


def test_images_are_keyed_by_a_hash_of_their_url() -> None:
    def body(url: str) -> dict[str, object]:
        part = {"type": "image_url", "image_url": {"url": url}}
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, part]}]}

    big = "data:image/png;base64," + "A" * 1_000_000
    text = render("chat", body(big))
    assert len(text) < 200  # the megabyte of base64 is not in the rendering
    assert text != render("chat", body(big[:-1] + "B"))


def test_tool_calls_and_results_are_part_of_the_prompt() -> None:
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    with_call = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    assert render("chat", {"messages": with_call}) != render(
        "chat", {"messages": [{"role": "assistant", "content": None}]}
    )


def test_completions_prompt_is_used_as_is() -> None:
    assert render("completions", {"prompt": "abc"}) == "abc"
    assert render("completions", {"prompt": ["ab", "c"]}) != render(
        "completions", {"prompt": ["a", "bc"]}
    )


def test_token_id_prompts_are_cut_into_kv_blocks_of_tokens() -> None:
    hasher = PrefixHasher(kv_block_tokens=16)
    key = hasher.key("m", "completions", {"prompt": list(range(40))})
    assert key.blocks == chain_tokens(seed("m"), list(range(40)), 16, 4096)
    assert len(key.blocks) == 2
    batch = hasher.key("m", "completions", {"prompt": [list(range(40)), [1, 2]]})
    assert batch.blocks == key.blocks


def test_cache_salt_in_the_body_separates_tenants() -> None:
    msgs = [{"role": "user", "content": "x" * 128}]
    hasher = PrefixHasher()
    a = hasher.key("m", "chat", {"messages": msgs, "cache_salt": "t1"})
    b = hasher.key("m", "chat", {"messages": msgs, "cache_salt": "t2"})
    assert a.blocks[0] != b.blocks[0]


def test_responses_api_instructions_and_input_are_rendered() -> None:
    a = render("responses", {"instructions": "be brief", "input": "hello"})
    b = render("responses", {"instructions": "be long", "input": "hello"})
    assert a != b and "hello" in a


def test_a_follow_up_turn_extends_the_previous_turns_chain() -> None:
    hasher = PrefixHasher()
    turn1 = [{"role": "system", "content": "S" * 500}, {"role": "user", "content": "q1 " * 40}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "a1 " * 40},
        {"role": "user", "content": "q2"},
    ]
    k1, k2 = (
        hasher.key("m", "chat", {"messages": turn1}),
        hasher.key("m", "chat", {"messages": turn2}),
    )
    assert k2.blocks[: len(k1.blocks)] == k1.blocks
    assert len(k2.blocks) > len(k1.blocks)


# tokenizers is third-party and optional (the `exact` extra); the test extra installs it, so CI
# always runs this.
@pytest.mark.skipif(
    importlib.util.find_spec("tokenizers") is None, reason="tokenizers not installed"
)
def test_exact_mode_aligns_blocks_with_kv_blocks_of_tokens(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["the quick brown fox jumps over the lazy dog", "system user assistant"]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))

    hasher = PrefixHasher(tokenizer_file=str(path), kv_block_tokens=4)
    body = {"messages": [{"role": "user", "content": "the quick brown fox " * 10}]}
    key = hasher.key("m", "chat", body)
    ids = tok.encode(render("chat", body), add_special_tokens=False).ids
    assert key.blocks == chain_tokens(seed("m"), ids, 4, 4096)
    assert len(key.blocks) == len(ids) // 4
    assert key.block_chars > 0


def test_a_tokenizer_that_cannot_load_is_a_config_error_at_startup(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Exact mode with a bad tokenizer_file (or without `tokenizers`) must not start and then
    fail every request: the config check names the key and the cause."""
    import sys

    from proxy.config import Config, ConfigError
    from proxy.server.app import check_config

    def config(path: str) -> Config:
        prefix = {"tokenizer_file": path, "kv_block_tokens": 16}
        return Config.model_validate(
            {
                "backends": [{"url": "http://127.0.0.1:1"}],
                "routing": {"plugins": {"prefix": prefix}},
            }
        )

    with pytest.raises(ConfigError, match=r"tokenizer_file '/nowhere/tokenizer.json'"):
        check_config(config("/nowhere/tokenizer.json"))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if it were not installed
    with pytest.raises(ConfigError, match="pip install tokenizers"):
        check_config(config("/nowhere/tokenizer.json"))


CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _word_tokenizer(tmp_path):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["<s> <|im_start|> <|im_end|> system user assistant the quick brown fox policy"]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return tok, path


def test_exact_mode_renders_chat_with_the_models_own_template(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tok, path = _word_tokenizer(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    config.write_text(
        orjson.dumps({"chat_template": CHATML, "bos_token": {"content": "<s>"}}).decode()
    )
    hasher = PrefixHasher(
        tokenizer_file=str(path), kv_block_tokens=4, chat_template_file=str(config)
    )
    messages = [
        {"role": "system", "content": "policy " * 20},
        {"role": "user", "content": [{"type": "text", "text": "the quick"},
                                     {"type": "text", "text": "fox"}]},
    ]  # fmt: skip
    key = hasher.key("m", "chat", {"messages": messages})
    # What the engine tokenizes: the template's rendering, text parts joined, generation prompt.
    text = (
        "<s><|im_start|>system\n" + "policy " * 20 + "<|im_end|>\n"
        "<|im_start|>user\nthe quick\nfox<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(text, add_special_tokens=False).ids
    assert key.blocks == chain_tokens(seed("m"), ids, 4, 4096)
    assert hasher.template_errors == 0


def test_a_template_that_refuses_a_request_falls_back_to_the_canonical_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tok, path = _word_tokenizer(tmp_path)
    strict = tmp_path / "strict.jinja"
    strict.write_text(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('no') }}{% endif %}x"
    )
    hasher = PrefixHasher(
        tokenizer_file=str(path), kv_block_tokens=4, chat_template_file=str(strict)
    )
    body = {"messages": [{"role": "user", "content": "the quick brown fox " * 4}]}
    key = hasher.key("m", "chat", body)
    ids = tok.encode(render("chat", body), add_special_tokens=False).ids
    assert key.blocks == chain_tokens(seed("m"), ids, 4, 4096)
    assert hasher.template_errors == 1


def test_a_chat_template_setting_that_cannot_work_names_the_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, path = _word_tokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"set prefix\.tokenizer_file"):
        PrefixHasher(chat_template_file=str(tmp_path / "x.jinja"))
    empty = tmp_path / "tokenizer_config.json"
    empty.write_text("{}")
    with pytest.raises(ValueError, match="no `chat_template` in it"):
        PrefixHasher(tokenizer_file=str(path), chat_template_file=str(empty))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for %}")
    with pytest.raises(ValueError, match="not a valid Jinja chat template"):
        PrefixHasher(tokenizer_file=str(path), chat_template_file=str(broken))
