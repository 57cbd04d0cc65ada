"""The disagg section of the configuration: every way to set the mode, and the errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.config import ConfigError, load_config


def test_mode_defaults_off_and_comes_from_yaml_env_or_flag(tmp_path: Path) -> None:
    assert load_config(env={}).disagg.mode == "off"
    for text, mode in (("off", "off"), ("on", "on"), ("auto", "auto"), ("'on'", "on")):
        f = tmp_path / "c.yaml"
        f.write_text(f"disagg:\n  mode: {text}\n")  # bare on/off are YAML booleans
        assert load_config(f, env={}).disagg.mode == mode
    assert load_config(env={"WARMROUTE_DISAGG__MODE": "auto"}).disagg.mode == "auto"
    env = {"WARMROUTE_DISAGG__MODE": "auto"}
    assert load_config(env=env, flags={"disagg": "on"}).disagg.mode == "on"  # flag wins


def test_bad_values_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"disagg\.mode: Input should be 'off', 'on' or 'auto'"):
        load_config(env={"WARMROUTE_DISAGG__MODE": "sometimes"})
    with pytest.raises(ConfigError, match=r"disagg\.hysteresis"):
        load_config(env={"WARMROUTE_DISAGG__HYSTERESIS": "1.5"})


def test_backends_carry_a_role_and_an_sglang_bootstrap_port(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "backends:\n"
        "  - {url: 'http://10.0.0.5:30000', engine: sglang, role: prefill, bootstrap_port: 8998}\n"
        "  - {url: 'http://10.0.0.6:30000', engine: sglang, role: decode}\n"
    )
    p, d = load_config(f, env={}).backends
    assert (p.role, p.bootstrap_port) == ("prefill", 8998)
    assert (d.role, d.bootstrap_port) == ("decode", None)
