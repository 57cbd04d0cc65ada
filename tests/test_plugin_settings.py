"""Typed plugin settings: every `routing.plugins` block is checked against the settings its
plugins declare, and a misspelt key gets the message any other key gets."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import plugins
from proxy.config import EXAMPLE_FILE, ConfigError, load_config
from proxy.routing.setup import block_names, block_settings, build_router
from proxy.routing.types import PluginSettings
from proxy.server.app import check_config

BACKEND = "http://127.0.0.1:9"


def _check(yaml: str, tmp_path: Path, env: dict[str, str] | None = None) -> None:
    f = tmp_path / "w.yaml"
    f.write_text(yaml)
    check_config(load_config(f, flags={"backends": [BACKEND]}, env=env or {}))


def test_a_misspelt_plugin_key_is_reported_as_any_other_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as plugin:
        _check("routing:\n  plugins:\n    prefix: {capcity_blocks: 100}\n", tmp_path)
    with pytest.raises(ConfigError) as other:
        _check("server:\n  prot: 9000\n", tmp_path)
    said = str(plugin.value)
    assert said.startswith("invalid configuration:\n") and str(other.value).startswith(said[:22])
    assert (
        "  routing.plugins.prefix.capcity_blocks: unknown key; did you mean 'capacity_blocks'? "
        f"(every key: {EXAMPLE_FILE})"
    ) in said.splitlines()


def test_a_misspelt_block_a_nested_key_and_a_wrong_type_are_each_named(tmp_path: Path) -> None:
    yaml = (
        "routing:\n  plugins:\n"
        "    bounded_laod: {epsilon: 1}\n"
        "    bounded_load: {choices: many, placement_options: {fil: 0.5}}\n"
        "    prefix_aware: {weights: {prefx: 2}}\n"
    )
    with pytest.raises(ConfigError) as e:
        _check(yaml, tmp_path)
    lines = str(e.value).splitlines()[1:]
    assert lines[0].startswith(
        "  routing.plugins.bounded_laod: unknown key; did you mean 'bounded_load'?"
    )
    assert any(
        line.startswith("  routing.plugins.bounded_load.choices: Input should be a valid integer")
        and line.endswith("(got 'many')")
        for line in lines
    )
    assert any(
        line.startswith("  routing.plugins.bounded_load.placement_options.fil: unknown key;")
        and "did you mean 'fill'?" in line
        for line in lines
    )
    assert "  routing.plugins.prefix_aware.weights: unknown scorer(s) ['prefx']" in "\n".join(lines)


def test_the_prefix_block_holds_the_scorers_the_hashers_and_the_indexs_keys(
    tmp_path: Path,
) -> None:
    yaml = (
        "routing:\n  plugins:\n    prefix: {half_tokens: 128, block_chars: 32,"
        " capacity_blocks: 500, ttl_s: 60, learn_capacity: false}\n"
    )
    _check(yaml, tmp_path)  # every key is one of theirs
    model = block_settings("prefix")
    assert model is not None
    assert {"half_tokens", "block_chars", "capacity_blocks", "ttl_s", "learn_capacity"} <= set(
        model.model_fields
    )


def test_plugin_keys_from_the_environment_are_typed(tmp_path: Path) -> None:
    env = {"WARMROUTE_ROUTING__PLUGINS__BOUNDED_LOAD__EPSILON": "0.25"}
    cfg = load_config(flags={"backends": [BACKEND]}, env=env)
    check_config(cfg)
    assert build_router(cfg.routing).policy.picker.epsilon == 0.25  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"bounded_load\.epsilon: Input should be a valid number"):
        _check("", tmp_path, {"WARMROUTE_ROUTING__PLUGINS__BOUNDED_LOAD__EPSILON": "lots"})


def test_every_plugin_declares_settings_whose_defaults_are_its_constructors() -> None:
    """The settings are the one place a plugin's keys live: their defaults must be what the
    plugin is built with when its block is empty."""
    for name in block_names():
        model = block_settings(name)
        assert model is not None and issubclass(model, PluginSettings), name
        cls = plugins.registry().get(name)
        if cls is None or getattr(cls, "kind", "") == "policy":
            continue
        params = inspect.signature(cls.__init__).parameters
        for field, info in model.model_fields.items():
            if field in params and info.default is not None:
                assert params[field].default == info.default, (name, field)
