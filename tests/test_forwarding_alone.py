"""The forwarder built from its collaborators alone: no app, no registry, no router.

`Forwarding` takes the ports of proxy/forwarding/ports.py; here each is a small fake that records
what the forwarder asked of it (the fleet's verdicts, routing's in-flight count), the upstream is
scripted (tests/forward_support.py) and the telemetry is the real SDK with an in-memory
exporter. What the endpoint promises its collaborators is checked here, where a change to one
of them cannot hide it.
"""

from __future__ import annotations

from typing import Any

import orjson
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.config import BackendConfig, load_config
from proxy.forwarding.forward import Forwarding, ProxyEndpoint
from proxy.forwarding.retry import RetryPolicy
from proxy.routing.types import Decision, Dropped, Verdict
from proxy.telemetry import Telemetry
from proxy.types import FailureKind
from proxy.upstream.backends import Backend
from proxy.upstream.pool import UpstreamConnectError
from tests.forward_support import CHUNK, DONE, FakeUpstream, chat, ok, request

A, B = "127.0.0.1:9101", "127.0.0.1:9102"


class Fleet:
    """The Fleet port: two backends, and the verdicts the forwarder gave them."""

    def __init__(self) -> None:
        configs = [BackendConfig(url=f"http://{n}", models=["m"]) for n in (A, B)]
        self.backends = {b.name: b for b in map(Backend, configs)}
        self.verdicts: list[tuple[str, str]] = []

    def __getitem__(self, name: str) -> Backend:
        return self.backends[name]

    def get(self, name: str) -> Backend | None:
        return self.backends.get(name)

    def may_serve(self, model: str) -> bool:
        return model == "m"

    def mark_attempt(self, backend: Backend) -> None:
        self.verdicts.append((backend.name, "attempt"))

    def mark_failure(self, backend: Backend, reason: str, *, kind: FailureKind) -> None:
        self.verdicts.append((backend.name, kind))

    def mark_success(self, backend: Backend) -> None:
        self.verdicts.append((backend.name, "success"))


class Steering:
    """Routing as the forwarder sees it: a fixed decision, and what it was told back."""

    waiting = None  # no queue for requests whose every backend is at its bound

    def __init__(self, ranking: list[str], filtered_out: dict[str, str] | None = None) -> None:
        self.decision = Decision("fixed", ranking, "fixed", filtered_out=filtered_out or {})
        self.events: list[tuple[str, Any]] = []

    async def route(self, ctx: Any, *, record: bool = True) -> Decision:
        return self.decision

    def sent(self, decision: Any, backend: str) -> None:
        self.events.append(("sent", backend))

    def inflight(self, backend: str, delta: int) -> None:
        self.events.append(("inflight", (backend, delta)))

    def prefilled(self, decision: Any) -> None:
        self.events.append(("prefilled", decision.ranking if decision else None))

    def finished(self, decision: Any) -> None:
        self.events.append(("finished", decision.ranking if decision else None))

    def observe_stream(self, backend: str, facts: Any, decision: Any) -> None:
        self.events.append(("stream", (backend, facts.output_tokens)))

    def observe_response(self, backend: str, facts: Any, decision: Any) -> None:
        self.events.append(("response", backend))


def _endpoint(
    steering: Steering, scripts: dict[str, list[Any]]
) -> tuple[ProxyEndpoint, Fleet, FakeUpstream, InMemorySpanExporter]:
    cfg = load_config(flags={"backends": [f"http://{A}", f"http://{B}"]}, env={})
    cfg = cfg.model_validate({**cfg.model_dump(), "retries": {"backoff_base_s": 0.0}})
    spans = InMemorySpanExporter()
    fleet, upstream = Fleet(), FakeUpstream(scripts)
    forwarding = Forwarding(
        config=cfg,
        fleet=fleet,
        upstream=upstream,
        steering=steering,  # type: ignore[arg-type]
        recorder=Telemetry(cfg.telemetry, span_exporter=spans),
        retry=RetryPolicy(cfg.retries),
    )
    return ProxyEndpoint(forwarding, "chat"), fleet, upstream, spans


async def test_a_stream_goes_to_the_ranked_backend_and_every_collaborator_hears_of_it() -> None:
    steering = Steering([A, B])
    endpoint, fleet, upstream, _ = _endpoint(steering, {A: [ok], B: [ok]})
    status, body, _ = await request(endpoint, chat())
    assert (status, body) == (200, CHUNK + DONE)
    assert [c[0] for c in upstream.calls] == [A]
    assert fleet.verdicts == [(A, "attempt"), (A, "success")]
    assert steering.events[:2] == [("inflight", (A, 1)), ("sent", A)]
    assert ("inflight", (A, -1)) in steering.events
    assert steering.events[-1] == ("finished", [A, B])  # once, after everything else
    # The first byte ends the prompt's prefill (the backlog's bound): before the rest.
    prefilled = steering.events.index(("prefilled", [A, B]))
    assert prefilled < steering.events.index(("inflight", (A, -1)))
    assert endpoint.fw.open_requests == 0


async def test_a_refused_connection_is_a_verdict_on_its_backend_and_the_next_one_answers() -> None:
    steering = Steering([A, B])
    endpoint, fleet, upstream, _ = _endpoint(
        steering, {A: [UpstreamConnectError("refused")], B: [ok]}
    )
    status, body, _ = await request(endpoint, chat())
    assert (status, body) == (200, CHUNK + DONE)
    assert [c[0] for c in upstream.calls] == [A, B]
    assert (A, FailureKind.CONNECT) in fleet.verdicts and (B, "success") in fleet.verdicts
    inflight = [e[1] for e in steering.events if e[0] == "inflight"]
    assert inflight == [(A, 1), (A, -1), (B, 1), (B, -1)]  # every attempt released
    assert [e for e in steering.events if e[0] == "finished"] == [("finished", [A, B])]


async def test_nothing_ranked_at_capacity_is_a_429_and_no_backend_is_asked() -> None:
    at_bound = Dropped(Verdict.AT_BOUND, "at its in-flight bound (1)")
    steering = Steering([], filtered_out={A: at_bound, B: at_bound})
    endpoint, fleet, upstream, spans = _endpoint(steering, {A: [ok], B: [ok]})
    status, body, headers = await request(endpoint, chat())
    assert status == 429 and headers[b"retry-after"] == b"1"
    assert orjson.loads(body)["error"]["code"] == "backends_at_capacity"
    assert upstream.calls == [] and fleet.verdicts == []
    [span] = spans.get_finished_spans()
    assert span.attributes is not None and span.attributes["error.type"] == "backends_at_capacity"
