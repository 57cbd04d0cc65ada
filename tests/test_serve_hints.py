"""`warmroute serve` says what telemetry goes where, and its hints point the right way: one
test each for the start line, `--check`'s sources, and every hint (issue 29)."""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import build_parser
from proxy.config import EXAMPLE_FILE, ConfigError, load_config
from proxy.server import serve
from tests.support import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "deploy" / "warmroute.example.yaml"
BACKEND = "http://127.0.0.1:9"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith(("OTEL_", "WARMROUTE_")):
            monkeypatch.delenv(var)


def _args(*argv: str) -> Any:
    return build_parser("serve").parse_args(["serve", *argv])


def _check(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert serve.run(_args("--check", "--backend", BACKEND, *argv)) == 0
    return dict(json.loads(capsys.readouterr().out)["effective_telemetry"])


# -- part 2: telemetry never switches itself off unsaid ----------------------------------------


def test_the_example_file_leaves_the_exporters_to_the_otel_variables() -> None:
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp"}
    telemetry = load_config(EXAMPLE, env=env).telemetry
    assert telemetry.traces_exporter == "otlp" and telemetry.metrics_exporter == "otlp"
    by_endpoint = load_config(EXAMPLE, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert by_endpoint.telemetry.traces_exporter == "otlp"


def test_check_shows_each_telemetry_value_with_its_source(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge")
    shown = _check(capsys)
    assert shown["traces_exporter"] == {
        "value": "otlp",
        "source": "env OTEL_EXPORTER_OTLP_ENDPOINT",
    }
    assert shown["traces_endpoint"] == {
        "value": "http://collector:4318/v1/traces",
        "source": "env OTEL_EXPORTER_OTLP_ENDPOINT",
    }
    assert shown["otlp_endpoint"] == {
        "value": "http://collector:4318",
        "source": "env OTEL_EXPORTER_OTLP_ENDPOINT",
    }
    assert shown["service_name"]["source"] == "env OTEL_SERVICE_NAME"
    assert shown["metrics_exporter"] == {"value": "none", "source": "default"}
    assert shown["logs"]["value"] == "stderr"
    # A file that decides says so, and names the variable it overrides.
    f = tmp_path / "w.yaml"
    f.write_text("telemetry:\n  traces_exporter: none\n  otlp_endpoint: http://mine:4318\n")
    shown = _check(capsys, "--config", str(f))
    assert shown["traces_exporter"]["source"] == f"config file {f}"
    assert (
        shown["traces_exporter"]["overrides"] == "OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318"
    )
    assert (
        shown["otlp_endpoint"]["overrides"] == "OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318"
    )
    assert shown["traces_endpoint"] == {
        "value": "http://mine:4318/v1/traces",
        "source": f"config file {f}",
    }
    monkeypatch.setenv("WARMROUTE_TELEMETRY__CHUNK_EVENTS", "all")
    assert _check(capsys)["chunk_events"]["source"] == "env WARMROUTE_TELEMETRY__CHUNK_EVENTS"


class _NoServer:
    """uvicorn's Server, started no further than `serve` logging it is ready."""

    started = True

    def __init__(self, config: Any) -> None:
        self.app = config.app

    def run(self, sockets: list[socket.socket]) -> None:
        for sock in sockets:
            sock.close()
        self.app.state.telemetry.shutdown(deadline_s=0.5)  # the lifespan's job, not run here


def _start_lines(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> list[str]:
    monkeypatch.setattr(serve, "setup_logging", lambda level: None)  # caplog keeps the root
    monkeypatch.setattr(serve.uvicorn, "Server", _NoServer)
    with caplog.at_level(logging.INFO, logger="warmroute"):
        assert serve.run(_args("--backend", BACKEND, "--port", "0")) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "warmroute"]
    return [line for line in lines if line.startswith("telemetry:")]


def test_serve_says_in_one_line_at_start_what_is_exported_where(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    collector = f"http://127.0.0.1:{free_port()}"  # nothing listens: nothing is sent here
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector)
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "100")
    [line] = _start_lines(monkeypatch, caplog)
    assert f"traces: otlp to {collector}/v1/traces over http/protobuf" in line
    assert f"metrics: GET /metrics and otlp to {collector}/v1/metrics" in line
    assert "logs: stderr" in line


def test_serve_says_when_traces_are_off_and_what_would_turn_them_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    [line] = _start_lines(monkeypatch, caplog)
    assert "traces: not exported (traces_exporter: none, from default" in line
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in line
    assert "metrics: GET /metrics for Prometheus to scrape (not pushed)" in line


# -- part 6: hints that point the right way ------------------------------------------------------


def test_admin_port_in_use_names_the_admin_port_option() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        config = load_config(flags={"backends": [BACKEND], "admin_port": port}, env={})
        with pytest.raises(serve.PortTaken) as e:
            serve.admin_sockets(config)
    assert "--admin-port or WARMROUTE_ADMIN_PORT" in str(e.value)
    assert "--port or" not in str(e.value)


def test_serving_port_in_use_names_the_port_option() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        with pytest.raises(serve.PortTaken, match="--port or WARMROUTE_PORT"):
            serve.listen_socket("127.0.0.1", taken.getsockname()[1])


def test_a_misspelt_key_gets_the_closest_valid_one_and_the_example_file(tmp_path: Path) -> None:
    f = tmp_path / "w.yaml"
    f.write_text("server:\n  prot: 9000\n")
    with pytest.raises(ConfigError) as e:
        load_config(f, flags={"backends": [BACKEND]}, env={})
    assert "server.prot: unknown key; did you mean 'port'?" in str(e.value)
    assert EXAMPLE_FILE in str(e.value) and (ROOT / EXAMPLE_FILE).is_file()
    assert "serve --help" not in str(e.value)
    f.write_text("backends:\n  - url: http://a:1\n    zzz: 1\n")
    with pytest.raises(ConfigError, match=r"backends\.0\.zzz: unknown key; valid here: api_key"):
        load_config(f, env={})


def test_policy_help_names_every_policy_and_prefix_aware_as_the_default() -> None:
    from proxy.server.app import plugins

    text = " ".join(build_parser("serve")._subparsers._group_actions[0].choices["serve"]
                    .format_help().split())  # fmt: skip
    assert "prefix_aware (the default" in text
    for name in plugins.policy_names():
        assert name in text


def test_log_level_is_accepted_in_any_case() -> None:
    assert _args("--log-level", "DEBUG").log_level == "debug"
    assert _args("--log-level", "Warning").log_level == "warning"
    with pytest.raises(SystemExit):
        _args("--log-level", "loud")
    level = load_config(flags={"backends": [BACKEND]}, env={"WARMROUTE_LOG_LEVEL": "DEBUG"})
    assert level.server.log_level == "debug"  # the variable and the file, too


def test_the_start_line_says_when_telemetry_is_off_and_which_setting_did_it() -> None:
    from proxy.config import telemetry_sources
    from proxy.telemetry.effective import effective_telemetry, telemetry_line

    env = {"OTEL_SDK_DISABLED": "true"}
    cfg = load_config(flags={"backends": [BACKEND]}, env=env).telemetry
    line = telemetry_line(cfg, effective_telemetry(cfg, telemetry_sources(env=env), env))
    assert line.startswith("telemetry: off (telemetry.enabled: false, from env OTEL_SDK_DISABLED)")
