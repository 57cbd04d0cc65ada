"""The SDK bridge: SDK internals in one module, used only inside the tested range."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased

from proxy.config import TelemetryConfig
from proxy.telemetry import Telemetry, UnsupportedSDK, sdk_bridge
from proxy.telemetry.batcher import EncodedBatcher
from proxy.telemetry.spans import compile_sampler
from proxy.telemetry.transport import HTTPClientTransport, http_span_exporter

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def untested_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sdk_bridge, "supported", dict.fromkeys(sdk_bridge.supported, False))
    monkeypatch.setattr(sdk_bridge, "_warned", set())


def test_the_installed_sdk_is_the_one_the_bridge_is_tested_with() -> None:
    """Upgrading OpenTelemetry fails here first: run the telemetry tests on the new release,
    then widen TESTED and the pins in pyproject.toml together."""
    assert all(sdk_bridge.supported.values()), (sdk_bridge.supported, sdk_bridge.install_hint())


def test_pyproject_pins_opentelemetry_to_the_tested_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for req in project["dependencies"] + project["optional-dependencies"]["test"]:
        name, _, spec = re.match(r"([A-Za-z0-9_.-]+)(\[.*\])?(.*)", req).groups()  # type: ignore[union-attr]
        pins[name] = spec.replace(" ", "")
    for dist, (major, minor), (next_major, next_minor) in sdk_bridge.TESTED:
        # pinned here, not only through whatever requires it today; a 0.x line's releases are
        # betas (0.66b2), so its range starts at the line's first beta
        assert pins.get(dist) in (
            f">={major}.{minor},<{next_major}.{next_minor}",
            f">={major}.{minor}b0,<{next_major}.{next_minor}",
        ), dist
    for name in (
        "opentelemetry-api",
        "opentelemetry-proto",
        "opentelemetry-exporter-otlp-proto-grpc",
    ):
        assert pins[name] == pins["opentelemetry-sdk"], name  # released in lockstep


def test_no_module_but_the_bridge_touches_sdk_internals() -> None:
    private = re.compile(
        r"\.(_collect|_set_collect_callback|_client|_transport|_max_request_size|_endpoint"
        r"|_decision|_root|_remote_parent_\w+|_local_parent_\w+|_active_span_processor)\b"
        r"|transport\._base|_shutdown\b"
    )
    telemetry, harness = ROOT / "proxy" / "telemetry", ROOT / "proxy" / "harness"
    for path in sorted([*telemetry.glob("*.py"), *harness.glob("*.py")]):
        if path.name == "sdk_bridge.py":
            continue
        hits = [
            line.strip()
            for line in path.read_text().splitlines()
            if private.search(line) and not line.lstrip().startswith("#")
        ]
        assert hits == [], path.name


def test_outside_the_tested_range_samplers_are_asked_instead_of_compiled(
    untested_sdk: None,
) -> None:
    for sampler in (ALWAYS_ON, ParentBased(ALWAYS_ON), ParentBased(TraceIdRatioBased(0.5))):
        assert compile_sampler(sampler) is None
    # a sampler read through public fields only still compiles
    assert compile_sampler(TraceIdRatioBased(0.5)) is not None


def test_outside_the_tested_range_spans_take_the_sdks_exporter_and_transport(
    untested_sdk: None,
) -> None:
    exporter: Any = http_span_exporter(endpoint="http://127.0.0.1:9/v1/traces")
    assert not EncodedBatcher.can_use(exporter)
    assert not isinstance(exporter._client._transport, HTTPClientTransport)
    exporter.shutdown()


def test_outside_the_tested_range_metrics_refuse_to_start_and_say_what_to_install(
    untested_sdk: None,
) -> None:
    with pytest.raises(UnsupportedSDK, match=re.escape("'opentelemetry-sdk>=1.45,<1.46'")):
        Telemetry(TelemetryConfig())
    # with telemetry off nothing SDK-internal is needed
    Telemetry(TelemetryConfig(enabled=False)).shutdown()
