"""One typed configuration tree: YAML file < environment (WARMROUTE_*) < command-line flags.

Errors name the key, what was wrong and how to fix it (ConfigError), never a bare traceback.

Size: one tree on purpose (a newcomer finds every key and its check in one file); the fleet's
discovery entries added ~100 lines, and where each telemetry key came from (`serve --check`)
and the closest valid key for a misspelt one ~100 more.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from proxy import engines, otel_env

ENV_PREFIX = "WARMROUTE_"
# Settings of the other subcommands (sim, bench, demo) share the prefix but not this tree.
OTHER_COMMANDS_ENV = tuple(ENV_PREFIX + p for p in ("SIM_", "BENCH_", "DEMO_", "TEST_", "CACHE"))
# `warmroute doctor`'s admin token: a client's secret (the proxy holds only its SHA-256).
CLIENT_ENV = frozenset({ENV_PREFIX + "ADMIN_TOKEN"})
# The install's compiled hot path (setup.py, proxy/__init__.py): read there, not settings.
BUILD_ENV = frozenset({ENV_PREFIX + "COMPILE", ENV_PREFIX + "PURE_PYTHON"})
# auto: read off the backend's /metrics names (proxy/engines.py), openai if it has none.
Engine = Literal["auto", "vllm", "sglang", "llamacpp", "openai"]
Role = Literal["mixed", "prefill", "decode"]  # what a backend serves (docs/disaggregation.md)
DisaggMode = Literal["off", "on", "auto"]


class ConfigError(Exception):
    """A configuration problem a user can fix; the message says which key and how."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KvEventsConfig(_Model):
    """Where an engine publishes its KV cache events (vLLM --kv-events-config, SGLang)."""

    endpoint: str  # the engine's ZMQ PUB socket, e.g. tcp://10.0.0.5:5557
    replay_endpoint: str | None = None  # its replay ROUTER socket, to repair lost messages
    topic: str = ""
    model: str | None = None  # the served model name the blocks belong to (default: models[0])
    block_tokens: int | None = Field(None, gt=0)  # default: routing.plugins.prefix.kv_block_tokens
    silent_after_s: float = Field(30.0, gt=0)

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("tcp://", "ipc://")):
            raise ValueError("must be a ZeroMQ endpoint such as tcp://127.0.0.1:5557")
        return v


class _BackendTemplate(_Model):
    """What a backend runs and serves: the keys a listed backend and a discovered fleet share."""

    models: list[str] | None = None  # None: discovered from GET {url}/v1/models
    engine: Engine = "auto"  # or in the URL: http://h:8000#engine=vllm,role=prefill
    role: Role = "mixed"
    api_key_env: str | None = None  # name of the env var holding the upstream key
    weight: float = Field(1.0, gt=0)
    # Requests open on it at once (all replicas, with Redis); beyond it the backend is skipped,
    # and when every backend is at its bound the client gets 429 with Retry-After. None: no bound.
    max_inflight: int | None = Field(None, ge=1)
    # The engine orders its queue by the request's `priority` field: `lower_first` (vLLM with
    # --scheduling-policy priority; SGLang with --schedule-low-priority-values-first) or
    # `higher_first` (SGLang's --enable-priority-scheduling). With API keys, each request is
    # sent its class and its tenant's standing (docs/tenants.md). None: no priority is sent.
    engine_priority: Literal["lower_first", "higher_first"] | None = None
    # SGLang prefill engines: their --disaggregation-bootstrap-port (None: the engine's default)
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    # Declared hardware, optional: the doctor checks decode against its bandwidth ceiling
    # (docs/doctor.md). device: h100 | a100 | l40s | a10g | rtx4090 | cpu-ddr5; params: the
    # model size (8b, 70b, 1.5b...); dtype: its weights' (bf16, fp16, fp8, int8, int4).
    device: str | None = None
    params: str | None = None
    dtype: str = "bf16"

    @model_validator(mode="after")
    def _hardware(self) -> Any:
        from proxy.doctor.hardware import check  # the simulator's device tables, on demand

        check(self.device, self.params, self.dtype)
        return self

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class BackendConfig(_BackendTemplate):
    """One backend at a fixed address."""

    @model_validator(mode="before")
    @classmethod
    def _url_options(cls, data: Any) -> Any:
        """Options written in the URL's fragment (proxy/engines.py) become keys."""
        if not isinstance(data, dict) or "#" not in str(data.get("url", "")):
            return data
        parsed = engines.parse_backend_url(str(data["url"]))
        twice = sorted(k for k in parsed if k != "url" and k in data)
        if twice:
            raise ValueError(f"{', '.join(twice)} given both in the URL and as a key; keep one")
        return {**data, **parsed}

    url: str
    name: str | None = None
    kv_events: KvEventsConfig | None = None  # listen to its KV events: an exact cache view

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http(s) URL such as http://127.0.0.1:8000")
        return v.rstrip("/").removesuffix("/v1")

    @property
    def key(self) -> str:
        if self.name:
            return self.name
        parts = urlsplit(self.url)
        return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


class KubernetesConfig(_Model):
    """The ready endpoints of a Service, from its EndpointSlices (docs/deployment.md)."""

    namespace: str | None = None  # default: the pod's own (its service account's namespace)
    service: str | None = None  # the Service whose EndpointSlices list the engines
    selector: str | None = None  # or a label selector on the EndpointSlices
    port_name: str | None = None  # the slice port to use (default: its only, or first, port)
    # Default: in-cluster (the pod's service account), else $KUBECONFIG or ~/.kube/config.
    kubeconfig: str | None = None
    api_server: str | None = None  # overrides the API server's URL from either

    @model_validator(mode="after")
    def _one_target(self) -> KubernetesConfig:
        if (self.service is None) == (self.selector is None):
            raise ValueError(
                "name the engines' Service (service: vllm) or a label selector on its "
                "EndpointSlices (selector: app=vllm), one of the two"
            )
        return self


class DiscoveryConfig(_BackendTemplate):
    """A fleet whose members come and go: every address a name resolves to, or every ready
    endpoint of a Kubernetes Service, is one backend with these keys (proxy/fleet/)."""

    dns: str | None = None  # a name whose A/AAAA records (or SRV records, srv: true) are engines
    srv: bool = False
    port: int | None = Field(None, ge=1, le=65535)  # the engines' port (SRV records carry theirs)
    kubernetes: KubernetesConfig | None = None
    scheme: Literal["http", "https"] = "http"
    # The name is asked again when its records' TTL runs out, within these bounds.
    min_ttl_s: float = Field(5.0, gt=0)
    max_ttl_s: float = Field(300.0, gt=0)

    @field_validator("dns")
    @classmethod
    def _dns_name(cls, v: str | None) -> str | None:
        if v is None:
            return v
        import dns.name  # dnspython, loaded only where a fleet is followed by DNS

        try:
            dns.name.from_text(v)
        except dns.exception.DNSException as e:
            raise ValueError(f"{v!r} is not a DNS name ({e})") from None
        if "." not in v.strip("."):
            raise ValueError(
                f"write the name in full, e.g. vllm.llm.svc.cluster.local (got {v!r}: names are "
                "asked as written, without the resolver's search list)"
            )
        return v

    @model_validator(mode="after")
    def _one_source(self) -> DiscoveryConfig:
        if (self.dns is None) == (self.kubernetes is None):
            raise ValueError("a discovered fleet has either `dns:` or `kubernetes:`, not both")
        if self.dns is not None and not self.srv and self.port is None:
            raise ValueError(
                f"port: which port do the engines behind {self.dns} listen on? (or srv: true "
                "for SRV records, which carry it)"
            )
        if self.min_ttl_s > self.max_ttl_s:
            raise ValueError("min_ttl_s: must not exceed max_ttl_s")
        return self

    @property
    def source(self) -> str:
        """The source's name, on /admin/backends, in logs and on the fleet metric."""
        if self.dns is not None:
            return f"dns:{self.dns}"
        k = self.kubernetes
        assert k is not None
        return f"kubernetes:{k.namespace or '-'}/{k.service or k.selector}"

    def member(self, host: str, port: int, **overrides: Any) -> BackendConfig:
        """The backend at `host`:`port` that this fleet reports; `overrides` (role, engine,
        weight from the engine's own labels) replace the template's keys."""
        address = f"[{host}]" if ":" in host else host
        keys = self.model_dump(include=set(_BackendTemplate.model_fields))
        return BackendConfig.model_validate(
            {**keys, **overrides, "url": f"{self.scheme}://{address}:{port}"}
        )


def _entry_kind(v: Any) -> str:
    if isinstance(v, DiscoveryConfig) or (
        isinstance(v, dict) and ("dns" in v or "kubernetes" in v)
    ):
        return "discovered"
    return "listed"


# A backend entry: a URL, or a name to follow (dns: / kubernetes:).
BackendEntry = Annotated[
    Annotated[BackendConfig, Tag("listed")] | Annotated[DiscoveryConfig, Tag("discovered")],
    Discriminator(_entry_kind),
]
_ENTRY_TAGS = ("listed", "discovered")


def parse_nameserver(text: str) -> tuple[str, int]:
    """A `fleet.nameservers` entry as (host, port): "10.0.0.2", "10.0.0.2:5353", "dns.local",
    "dns.local:5353", "::1" or "[::1]:5353" (an IPv6 address with a port needs the brackets)."""
    s = text.strip()
    port = "53"
    if s.startswith("["):
        host, closed, rest = s[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ValueError(f"nameserver {text!r}: write an IPv6 address as [::1] or [::1]:53")
        if rest:
            port = rest[1:]
    elif s.count(":") == 1:
        host, port = s.split(":")
    else:
        host = s  # a name, an IPv4 address, or an IPv6 address without a port
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"nameserver {text!r}: expected host or host:port (port 1-65535)")
    return host, int(port)


class FleetConfig(_Model):
    """How the fleet follows its sources (docs/deployment.md, Elastic fleets)."""

    # A leaving backend's streams may finish for this long; then each gets an error event.
    drain_grace_s: float = Field(30.0, ge=0)
    # DNS servers to ask (host or host:port); default: the system's (/etc/resolv.conf).
    nameservers: list[str] = Field(default_factory=list)
    # Re-read the config file when it changes (as on SIGHUP), checked this often; 0: off.
    watch_config_s: float = Field(0.0, ge=0)
    # Requests routed this soon after a membership change are marked on their span.
    change_window_s: float = Field(30.0, ge=0)

    @field_validator("nameservers")
    @classmethod
    def _nameservers(cls, v: list[str]) -> list[str]:
        for entry in v:
            parse_nameserver(entry)
        return v


class ApiKeyConfig(_Model):
    """A client API key, as its name and the SHA-256 of the key (never the key itself)."""

    name: str = Field(min_length=1, max_length=64)  # on spans and metrics: keep it short
    sha256: str  # printf %s "$KEY" | sha256sum

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        v = v.strip().lower()
        if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
            raise ValueError(
                "must be the key's SHA-256 as 64 hex digits (printf %s $KEY | sha256sum)"
            )
        return v


class ServerConfig(_Model):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    workers: int = Field(1, ge=1, le=64)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)
    shutdown_grace_s: float = Field(30.0, ge=0)
    debug_headers: bool = False  # x-warmroute-route: the routing decision, per response
    # Client connections (proxy/edge/limits.py, docs/security.md)
    max_header_bytes: int = Field(32 * 1024, ge=1024)  # request line + headers; past it 431
    max_headers: int = Field(100, ge=8, le=10_000)
    header_timeout_s: float = Field(10.0, gt=0)  # connection (or first byte) -> head complete
    body_timeout_s: float = Field(60.0, gt=0)  # head complete -> body complete
    keepalive_timeout_s: float = Field(30.0, gt=0)  # idle between requests on a connection
    write_timeout_s: float = Field(60.0, gt=0)  # a client that reads none of its response
    max_connections: int | None = Field(None, ge=1)  # default: half the open-file limit
    # Overload (proxy/admission/slots.py): in flight at once, then a short queue, then 503; the
    # same limits hold requests whose every backend is at its max_inflight (backend_queue.py)
    max_inflight: int = Field(4096, ge=1)
    admission_queue: int = Field(256, ge=0)
    admission_timeout_s: float = Field(5.0, ge=0)
    # Access (proxy/edge/access.py): admin off the serving port unless configured
    admin_port: int | None = Field(None, ge=1, le=65535)  # == port: on the serving port
    admin_host: str = "127.0.0.1"  # the admin listener's address
    admin_token_sha256: str | None = None  # when set, /admin/* needs this token
    api_keys: list[ApiKeyConfig] = Field(default_factory=list)  # empty: no client keys
    isolate_tenants: bool = True  # with keys: each key's prompts hash apart (its own salt)

    @field_validator("log_level", mode="before")
    @classmethod
    def _any_case(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v  # DEBUG as well, in a file or variable

    @field_validator("admin_token_sha256")
    @classmethod
    def _token_hex(cls, v: str | None) -> str | None:
        return None if v is None else ApiKeyConfig._hex(v)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys_from_text(cls, v: Any) -> Any:
        # WARMROUTE_SERVER__API_KEYS=name:sha256,name2:sha256
        if isinstance(v, str):
            pairs = [p.strip().partition(":") for p in v.split(",") if p.strip()]
            return [{"name": name, "sha256": digest} for name, _, digest in pairs]
        return v

    @model_validator(mode="after")
    def _admin_exposure(self) -> ServerConfig:
        names = [k.name for k in self.api_keys]
        if len(set(names)) != len(names):
            raise ValueError("api_keys: two keys share a name; give each a unique name")
        public = self.host not in ("127.0.0.1", "::1", "localhost")
        if self.admin_port == self.port and public and self.admin_token_sha256 is None:
            raise ValueError(
                f"admin_port: /admin on the serving port ({self.host}:{self.port}, not "
                "loopback) needs server.admin_token_sha256; or give admin its own port"
            )
        return self


class TimeoutsConfig(_Model):
    connect_s: float = Field(5.0, gt=0)
    # request sent -> first body byte (queue + prefill); heads and 1xx do not stop the clock
    first_byte_s: float = Field(300.0, gt=0)
    # progress after the first body byte: between two complete SSE events of a stream; the
    # rest of a whole (non-streamed) body after its first byte. Stray bytes reset nothing.
    idle_s: float = Field(60.0, gt=0)
    health_s: float = Field(2.0, gt=0)


class RetryConfig(_Model):
    """Retries happen only before the client got a byte (proxy/forwarding/retry.py owns the
    policy)."""

    max_attempts: int = Field(3, ge=1, le=10)
    unhealthy_cooldown_s: float = Field(5.0, ge=0)  # a refused backend's first ejection
    backoff_base_s: float = Field(0.025, ge=0)  # full jitter: U(0, min(max, base * 2^n))
    backoff_max_s: float = Field(0.5, ge=0)
    deadline_s: float = Field(60.0, gt=0)  # no new attempt this long after the request came
    budget_ratio: float = Field(0.2, ge=0, le=10)  # retries per request, over the last 10 s
    budget_min_per_s: float = Field(5.0, ge=0)  # retries always allowed at this rate


class UpstreamConfig(_Model):
    """The connections to the backends (the forwarder's and the health checks')."""

    max_connections_per_backend: int = Field(1024, ge=1)  # in use at once; more wait
    # The most bytes of a non-streamed answer the proxy reads (it holds the whole answer to
    # meter it): past it, or a Content-Length over it, the client gets a 502
    # (upstream_response_too_large) and the connection is closed. Streams are bounded per
    # event instead (meter.MAX_EVENT_BYTES).
    max_response_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    # The most bytes all non-streamed answers being read or relayed hold at once, beyond the
    # first MiB of each (ordinary answers never count): an answer that would go past it gets
    # a 503 (upstream_responses_over_budget) with Retry-After, so a few large answers at once
    # cannot take the proxy past its memory limit. Leave room for it in that limit.
    max_buffered_bytes: int = Field(256 * 1024 * 1024, ge=0)
    tls_verify: bool = True  # verify https backends' certificates
    tls_ca_file: str | None = None  # a CA bundle for them (default: the system's)
    tls_cert_file: str | None = None  # a client certificate (mutual TLS)
    tls_key_file: str | None = None


class OutlierConfig(_Model):
    """Passive health: eject a backend that keeps failing, probe it back (half-open)."""

    consecutive_failures: int = Field(5, ge=1)  # 5xx, timeouts, resets, protocol errors
    ejection_s: float = Field(5.0, gt=0)  # first ejection; doubles on each re-ejection
    max_ejection_s: float = Field(120.0, gt=0)


class HealthConfig(_Model):
    """Active checks, proportional to need (proxy/upstream/cadence.py check_interval): a backend
    with traffic or an open breaker each `interval_s`; an unhealthy one each `metrics_scrape_s`
    (at most `interval_s`) to see it come back; an idle healthy one each `idle_interval_s`
    (at least `interval_s`), stretched so that the fleet's idle checks come to at most
    `idle_checks_per_s` (docs/deployment.md, "Large fleets: what idle engines cost")."""

    interval_s: float = Field(5.0, gt=0)
    idle_interval_s: float = Field(60.0, gt=0)  # Envoy's no_traffic_interval default
    # ~3 ms of CPU each through httpx, under 1 ms on the proxy's own pool (a vLLM's model list,
    # health and scrape on a fresh connection): 1 a second keeps an idle proxy's cost flat; 60
    # idle engines at 60 s, 256 at ~4 min
    idle_checks_per_s: float = Field(1.0, gt=0)
    models_refresh_s: float = Field(30.0, gt=0)  # with the first health check past it
    metrics_scrape_s: float = Field(2.0, gt=0)


class RoutingConfig(_Model):
    policy: str = "prefix_aware"
    # A slot engine (llama.cpp) running a request of a prompt: another request of it waits
    # for that one to end, at most this many times its cold prefill there (0: never waits).
    slot_wait: float = Field(1.0, ge=0)
    # Per-plugin config blocks (weights, thresholds), keyed by plugin name.
    plugins: dict[str, dict[str, Any]] = Field(default_factory=dict)


class DisaggConfig(_Model):
    """Prefill/decode disaggregation: when to split the pools, per request and by traffic.

    off: today's behaviour exactly. on: split whenever both pools have a healthy backend.
    auto: the decider splits only while its window of measured traffic justifies it.
    Every knob is explained in docs/disaggregation.md.
    """

    mode: DisaggMode = "off"
    # A request is prefill-heavy from this many uncached prompt tokens on its backend (and a
    # prefill that long counts as one that stalls the streams beside it).
    threshold_tokens: int = Field(1024, ge=1)
    output_ratio: float = Field(0.25, gt=0)  # ... with an expected output at most this share
    window_s: float = Field(60.0, gt=0)  # the decider's sliding window
    evaluate_s: float = Field(5.0, gt=0)  # how often it looks
    min_backends: int = Field(4, ge=2)  # healthy backends before a split is considered
    min_requests: int = Field(100, ge=1)  # finished requests in the window
    min_rate_per_s: float = Field(1.0, ge=0)
    max_rate_cv: float = Field(0.5, gt=0)  # steadiness: CV of arrivals per bucket
    rate_buckets: int = Field(12, ge=2)
    min_long_share: float = Field(0.05, ge=0, le=0.5)  # of requests prefill-heavy, and not
    min_overlap_share: float = Field(0.1, ge=0, le=1)  # of streams beside a long prefill
    on_inflation: float = Field(2.0, gt=1)  # their p99/p50 ITL over the others'
    hysteresis: float = Field(0.25, ge=0, lt=1)  # off only this far below the on thresholds
    min_dwell_s: float = Field(120.0, ge=0)  # between two switches
    max_streams_per_engine: int = Field(256, ge=1)  # decoding streams one engine may hold
    target_utilization: float = Field(0.8, gt=0, le=1)  # of the prefill pool's measured rate
    prefill_tokens_per_s: float | None = Field(None, gt=0)  # per engine; None: measured

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `mode: off` / `mode: on` as a boolean.
        return {False: "off", True: "on"}.get(v, v) if isinstance(v, bool) else v


class RedisConfig(_Model):
    url: str | None = None  # redis://, rediss://, redis+sentinel://, or with cluster: true
    cluster: bool = False
    timeout_s: float = Field(0.05, gt=0)
    key_prefix: str = "warmroute"
    # Connections to a plain Redis per replica; a call past them waits (within its timeout).
    max_connections: int = Field(64, ge=1)
    # Prefix lookups answered from this replica's copy of the shared index, kept current by the
    # other replicas' writes (a Redis stream), once it agrees with Redis: no round trip on a
    # decision's path. false: one round trip a lookup, and a copy of this replica's records only.
    local_lookups: bool = True

    @field_validator("url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if not v:
            return None
        parts = urlsplit(v)
        if parts.scheme == "unix" and parts.path:
            return v
        if parts.scheme not in ("redis", "rediss", "redis+sentinel") or not parts.hostname:
            raise ValueError(
                "must be a Redis URL such as redis://127.0.0.1:6379/0 (or rediss://, "
                "redis+sentinel://, unix:///path)"
            )
        return v


class BudgetLimits(_Model):
    """Per-minute limits of one tenant (or of one of its models); None: not limited. Each
    holds across replicas through Redis (proxy/tenants/, docs/tenants.md)."""

    requests_per_minute: int | None = Field(None, ge=1)
    input_tokens_per_minute: int | None = Field(None, ge=1)  # the prompt's tokens
    output_tokens_per_minute: int | None = Field(None, ge=1)  # the generated tokens
    tokens_per_minute: int | None = Field(None, ge=1)  # input + output, as OpenAI counts TPM
    max_concurrent: int | None = Field(None, ge=1)  # requests in flight, over the replicas

    @property
    def limited(self) -> bool:
        return any(
            v is not None
            for v in (
                self.requests_per_minute,
                self.input_tokens_per_minute,
                self.output_tokens_per_minute,
                self.tokens_per_minute,
                self.max_concurrent,
            )
        )


class TenantConfig(BudgetLimits):
    models: dict[str, BudgetLimits] = Field(default_factory=dict)  # per model, on top
    # When requests wait for a slot (server.admission_queue): its share against the other
    # tenants waiting, and its class (interactive before standard before batch).
    weight: float = Field(1.0, gt=0)
    priority: Literal["interactive", "standard", "batch"] = "standard"
    # Whether a request may raise its class with `x-warmroute-priority` (lowering it is
    # always allowed).
    priority_header: bool = False

    @property
    def limited(self) -> bool:
        return super().limited or any(m.limited for m in self.models.values())


class TenantsConfig(_Model):
    """Tenants are the configured API keys (server.api_keys), or one tenant, `default`,
    when keys are off."""

    default: TenantConfig = TenantConfig()  # every tenant without an entry under `keys`
    keys: dict[str, TenantConfig] = Field(default_factory=dict)  # by API key name
    charge_every_s: float = Field(1.0, gt=0)  # a running stream's output charged this often
    # A class's TTFT target: a request that must wait and is predicted to miss it is refused
    # at once (503 deadline_unreachable) instead of waiting to time out; goodput counts the
    # rest as met or missed.
    ttft_targets_s: dict[Literal["interactive", "standard", "batch"], float] = Field(
        default_factory=dict
    )
    # Slots of server.max_inflight kept for tenants below their share: a tenant already
    # running more than its weight's share may not take the last `reserve_slots` free slots
    # while another tenant has sent a request in the last few seconds (0: every slot to
    # whoever is next).
    reserve_slots: int = Field(0, ge=0)
    # Engines kept from prefilling the prompts of tenants over their share: while another
    # tenant is active, those may be at most (routable engines - reserve_prefills) prompts
    # between admission and first token, and a quiet tenant's cold prompt goes to the engine
    # with the least prefill ahead (an engine does not pass a prompt it has begun; 0: off).
    reserve_prefills: int = Field(0, ge=0)

    @field_validator("ttft_targets_s")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        for name, target in v.items():
            if not target > 0:
                raise ValueError(f"{name}: a TTFT target is a number of seconds above 0")
        return v

    @property
    def limited(self) -> bool:
        return self.default.limited or any(t.limited for t in self.keys.values())


class TelemetryConfig(_Model):
    enabled: bool = True  # false: no spans, no metrics (the stream is still metered for routing)
    service_name: str = "warmroute"
    # "otlp" honours the standard OTEL_EXPORTER_OTLP_* variables; "console" prints spans.
    # The OTEL_* variables set defaults for these keys (proxy/otel_env.py, docs/deployment.md).
    traces_exporter: Literal["none", "otlp", "console"] = "none"
    # Metrics pushed over OTLP, to a receiver that takes metrics (an OTel Collector; a trace
    # store such as Jaeger does not): separate from traces. GET /metrics is `prometheus`.
    metrics_exporter: Literal["none", "otlp", "console"] = "none"
    otlp_protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    otlp_endpoint: str | None = None
    chunk_events: Literal["off", "first", "sampled", "all"] = "first"
    chunk_events_cap: int = Field(64, ge=0, le=120)
    capture_content: bool = False
    prometheus: bool = True


class Config(_Model):
    server: ServerConfig = ServerConfig()
    backends: list[BackendEntry] = Field(default_factory=list)
    timeouts: TimeoutsConfig = TimeoutsConfig()
    retries: RetryConfig = RetryConfig()
    outlier: OutlierConfig = OutlierConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    health: HealthConfig = HealthConfig()
    routing: RoutingConfig = RoutingConfig()
    redis: RedisConfig = RedisConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    disagg: DisaggConfig = DisaggConfig()
    fleet: FleetConfig = FleetConfig()
    tenants: TenantsConfig = TenantsConfig()

    @model_validator(mode="after")
    def _tenants_are_keys(self) -> Config:
        names = {k.name for k in self.server.api_keys}
        for name in self.tenants.keys:
            if name not in names:
                known = ", ".join(sorted(names)) or "none: server.api_keys is empty"
                raise ValueError(
                    f"tenants.keys.{name}: no API key is named {name!r} (server.api_keys: "
                    f"{known}); tenants are the keys' names"
                )
        reserve = self.tenants.reserve_slots
        if reserve and reserve >= self.server.max_inflight:
            raise ValueError(
                f"tenants.reserve_slots: {reserve} would keep every one of server.max_inflight's "
                f"{self.server.max_inflight} slots; keep fewer than that"
            )
        return self

    @field_validator("backends")
    @classmethod
    def _unique_names(cls, v: list[BackendConfig | DiscoveryConfig]) -> list[Any]:
        seen: set[str] = set()
        for b in v:
            key = b.key if isinstance(b, BackendConfig) else b.source
            if key in seen:
                raise ValueError(f"two backends are named {key!r}; give each a unique name")
            seen.add(key)
        return v

    @property
    def listed(self) -> list[BackendConfig]:
        """The backends at fixed addresses."""
        return [b for b in self.backends if isinstance(b, BackendConfig)]

    @property
    def discovered(self) -> list[DiscoveryConfig]:
        """The fleets followed through DNS or Kubernetes."""
        return [b for b in self.backends if isinstance(b, DiscoveryConfig)]


# Flat option name -> dotted key. The same names work as flags and as WARMROUTE_<NAME> env vars.
FLAT_KEYS: dict[str, str] = {
    "host": "server.host",
    "port": "server.port",
    "workers": "server.workers",
    "log_level": "server.log_level",
    "max_body_bytes": "server.max_body_bytes",
    "debug_headers": "server.debug_headers",
    "admin_port": "server.admin_port",
    "admin_host": "server.admin_host",
    "max_connections": "server.max_connections",
    "max_inflight": "server.max_inflight",
    "policy": "routing.policy",
    "redis": "redis.url",
    "redis_url": "redis.url",
    "connect_timeout": "timeouts.connect_s",
    "first_byte_timeout": "timeouts.first_byte_s",
    "idle_timeout": "timeouts.idle_s",
    "max_attempts": "retries.max_attempts",
    "traces_exporter": "telemetry.traces_exporter",
    "chunk_events": "telemetry.chunk_events",
    "disagg": "disagg.mode",
}


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        child = node.get(p)
        if not isinstance(child, dict):
            child = {}
            node[p] = child
        node = child
    node[leaf] = value


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """WARMROUTE_PORT=9000, WARMROUTE_BACKENDS=url1,url2, WARMROUTE_TIMEOUTS__IDLE_S=30."""
    tree: dict[str, Any] = {}
    for raw_key, value in env.items():
        if not raw_key.startswith(ENV_PREFIX) or raw_key == ENV_PREFIX + "CONFIG":
            continue
        if raw_key.startswith(OTHER_COMMANDS_ENV) or raw_key in CLIENT_ENV | BUILD_ENV:
            continue
        name = raw_key[len(ENV_PREFIX) :].lower()
        if name in ("backend", "backends"):
            tree["backends"] = [{"url": u} for u in engines.split_backend_list(value)]
        elif name in FLAT_KEYS:
            _set(tree, FLAT_KEYS[name], value)
        elif "__" in name:
            _set(tree, name.replace("__", "."), value)
        else:
            raise ConfigError(
                f"environment variable {raw_key} is not a warmroute setting; known: "
                + ", ".join(ENV_PREFIX + k.upper() for k in sorted(FLAT_KEYS))
                + f", {ENV_PREFIX}BACKENDS, or nested keys like {ENV_PREFIX}TIMEOUTS__IDLE_S"
            )
    return tree


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping (key: value) at the top")
    return data


def describe_errors(err: ValidationError) -> str:
    """A validation error as `key: what to fix` clauses on one line."""
    return "; ".join(line.strip() for line in _lines(err))


def _describe(err: ValidationError) -> str:
    return _describe_lines(_lines(err))


def _lines(
    err: ValidationError, at: tuple[str, ...] = (), root: type[BaseModel] | None = None
) -> list[str]:
    """`err`'s clauses; `at`: where the validated section sits in the whole configuration,
    `root`: its model (the whole Config when not given)."""
    lines = []
    for e in err.errors():
        loc = [*at, *(p for p in e["loc"] if p not in _ENTRY_TAGS)]  # the backend entry's kind
        key = ".".join(str(p) for p in loc) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = unknown_key(str(e["loc"][-1]), _keys_at(e["loc"][:-1], root or Config))
        elif "input" in e and not isinstance(e["input"], dict | list):
            msg += f" (got {e['input']!r})"
        lines.append(f"  {key}: {msg}")
    return lines


def section_errors(err: ValidationError, at: tuple[str, ...], model: type[BaseModel]) -> str:
    """A section validated on its own (a routing plugin's block, `model` its settings), in
    the words of a configuration error: `key: what to fix`, keys from the top."""
    return _describe_lines(_lines(err, at, model))


def _describe_lines(lines: list[str]) -> str:
    return "invalid configuration:\n" + "\n".join(lines)


EXAMPLE_FILE = "deploy/warmroute.example.yaml"


def unknown_key(key: str, valid: list[str]) -> str:
    """The hint for a misspelt key: the closest of the `valid` keys at its level, or all."""
    import difflib

    if not valid:
        return f"unknown key; every key is listed in {EXAMPLE_FILE}"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {close[0]!r}? (every key: {EXAMPLE_FILE})"
    return f"unknown key; valid here: {', '.join(valid)} (every key: {EXAMPLE_FILE})"


def _keys_at(path: tuple[Any, ...], root: type[BaseModel]) -> list[str]:
    """The keys of the section at `path` (a validation error's location, from `root`), []
    if unknown."""
    model: type[BaseModel] | None = root
    for part in path:
        if isinstance(part, int):
            continue
        if part in _ENTRY_TAGS:
            model = BackendConfig if part == "listed" else DiscoveryConfig
            continue
        field = model.model_fields.get(str(part)) if model else None
        model = _section_model(field.annotation) if field else None
        if model is None:
            return []
    return sorted(model.model_fields) if model else []


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The config section a field holds: its model, inside Optional or list if need be."""
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_model(arg)
        if found is not None:
            return found
    return None


def load_config(
    file: str | os.PathLike[str] | None = None,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    """Build the config from a YAML file, then WARMROUTE_* env vars, then flags (last wins)."""
    tree: dict[str, Any] = {}
    for _, layer in config_layers(file, flags, env):
        tree = _merge(tree, layer)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None


def config_layers(
    file: str | os.PathLike[str] | None = None,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """(source, keys it sets) for each layer, lowest first: the standard OTEL_* variables,
    the YAML file, WARMROUTE_* variables, flags. load_config merges them in this order."""
    env = os.environ if env is None else env
    file = file or env.get(ENV_PREFIX + "CONFIG")
    try:  # the standard OTEL_* variables, under everything of warmroute's own
        otel = {"telemetry": otel_env.telemetry_defaults(env)}
    except otel_env.OtelEnvError as e:
        raise ConfigError(str(e)) from None
    return [
        ("OTEL_* environment", otel),
        (f"config file {file}", _read_yaml(Path(file)) if file else {}),
        ("WARMROUTE_* environment", _env_overrides(env)),
        ("flags", _flag_tree(flags or {})),
    ]


def _flag_tree(flags: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in flags.items():
        if value is None:
            continue
        if name == "backends":
            if value:
                tree["backends"] = [{"url": u} for u in value]
        elif name in FLAT_KEYS:
            _set(tree, FLAT_KEYS[name], value)
        else:
            raise ConfigError(f"unknown option {name!r}")
    return tree


def telemetry_sources(
    file: str | os.PathLike[str] | None = None,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Where each `telemetry:` key's value comes from: the OTEL_* variable, the config file,
    the WARMROUTE_* variable or the flag that set it last, else `default`."""
    env = os.environ if env is None else env
    otel = {k: var for k, (_, var) in otel_env.telemetry_settings(env).items()}
    sources = dict.fromkeys(TelemetryConfig.model_fields, "default")
    for source, layer in config_layers(file, flags, env):
        for key in layer.get("telemetry") or {}:
            if key not in sources:
                continue
            if source.startswith("OTEL_"):
                sources[key] = f"env {otel[key]}"
            elif source.startswith("WARMROUTE_"):
                sources[key] = f"env {_env_var_of(env, key)}"
            elif source == "flags":
                sources[key] = "flag --" + _flag_of(key).replace("_", "-")
            else:
                sources[key] = source
    return sources


def _env_var_of(env: Mapping[str, str], key: str) -> str:
    """The WARMROUTE_* variable that sets telemetry.`key`."""
    flat = [name for name, dotted in FLAT_KEYS.items() if dotted == f"telemetry.{key}"]
    for var in [ENV_PREFIX + name.upper() for name in flat]:
        if var in env:
            return var
    return f"{ENV_PREFIX}TELEMETRY__{key.upper()}"


def _flag_of(key: str) -> str:
    return next((n for n, d in FLAT_KEYS.items() if d == f"telemetry.{key}"), key)
