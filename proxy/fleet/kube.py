"""Kubernetes EndpointSlices as a fleet source: list them, then watch them, over httpx.

`KubernetesSource(cfg)` follows the EndpointSlices of one Service (the label
`kubernetes.io/service-name=<service>`, or the configured selector) in a namespace and reports
its whole set of engines (proxy/fleet/members.py) each time it changes:

- every endpoint whose `conditions.ready` is true, or unset (the API: nil means ready), is a
  Member, one per address, at the slice's port named `port_name` (default: its only port, or
  the first); an endpoint that is not ready but still `serving` (a terminating pod) is
  reported with serving=False, so it gets no new requests but finishes its streams; others
  are left out. An address in two slices is reported once (ready wins over draining).
- role, engine and weight come from the slice's labels `warmroute.io/role`,
  `warmroute.io/engine`, `warmroute.io/weight` (the EndpointSlice controller copies the
  Service's labels onto its slices); a bad value is logged once and ignored. Pods' own labels
  are not read (that would take `get pods` RBAC and a GET per pod): engines of different roles
  are behind one Service each.

The watch (as client-go's reflector does): LIST (paged) gives the slices and a
resourceVersion; WATCH from it with allowWatchBookmarks and timeoutSeconds, so the server
ends the watch every few minutes; every event (bookmarks too) moves the resourceVersion on, and
a watch that ends (timeout, a dropped connection) is opened again from it. 410 Gone (the
answer, or an ERROR event with code 410) means that version is compacted away: LIST again. The
API server away (connect errors, 5xx, 429): retry with jittered exponential backoff (0.5 s
doubling to 30 s; never sooner than a 429's or 503's Retry-After, which API Priority and
Fairness sends when it sheds load, up to RETRY_AFTER_MAX_S), report nothing (the fleet keeps
its last set), one warning when it starts and one info line when it is back. 401/403: an
error naming the RBAC the service account needs, and a slow retry
(deploy/kubernetes/overlays/discover-vllm has the Role).

Credentials: in-cluster (KUBERNETES_SERVICE_HOST/PORT, the service account's token re-read for
every request, as projected tokens rotate, its ca.crt and namespace), else a kubeconfig
(`kubeconfig:`, else $KUBECONFIG, else ~/.kube/config: the current context's cluster, CA,
token or client certificate; exec and auth-provider plugins are declined with a message).
`api_server:` overrides the URL (e.g. `kubectl proxy`'s http://127.0.0.1:8001, or a test).

Why not the `kubernetes` / `kubernetes_asyncio` client: list+watch of one resource is this
module; the library is a 48 MB install that brings aiohttp, urllib3, python-dateutil and six,
and measured on CPython 3.11 (a fresh interpreter, median of 5) `from kubernetes_asyncio
import client, config, watch` took ~700 ms and 72 MiB max RSS (1261 modules) against httpx's
~150 ms and 23 MiB (179 modules), which the proxy loads anyway. A watch is control traffic:
httpx is the proxy's client for it (docs/architecture.md); nothing here is on the hot path.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import os
import random
import ssl
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import httpx
import yaml

from proxy.config import DiscoveryConfig, Engine, KubernetesConfig, Role
from proxy.fleet.members import Member, Report
from proxy.upstream.conn import retry_after_s

log = logging.getLogger("warmroute.fleet")

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ROLE_LABEL = "warmroute.io/role"
ENGINE_LABEL = "warmroute.io/engine"
WEIGHT_LABEL = "warmroute.io/weight"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
API_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
LIST_PAGE = 500


class KubeError(Exception):
    """Credentials or a configuration that cannot work as they are; the message says why."""


class _Gone(Exception):
    """410: the resourceVersion is too old; list again."""


class _Unavailable(Exception):
    """The API server is away or overloaded (connect errors, 5xx, 429): back off, for at
    least its Retry-After when it sent one."""

    def __init__(self, message: str, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _Refused(Exception):
    """401/403 and other 4xx: fixed by someone, not by retrying soon."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Credentials:
    """How to reach and authenticate to the API server."""

    server: str
    verify: ssl.SSLContext | bool = True
    token: str | None = None
    token_file: Path | None = None  # re-read for every request (projected tokens rotate)
    namespace: str | None = None  # the pod's, or the kubeconfig context's

    def headers(self) -> dict[str, str]:
        token = self.token
        if self.token_file is not None:
            try:
                token = self.token_file.read_text().strip()
            except OSError as e:
                raise KubeError(f"cannot read the token {self.token_file}: {e}") from e
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers


def load_credentials(
    k: KubernetesConfig,
    *,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    env: Mapping[str, str] | None = None,
) -> Credentials:
    """In-cluster credentials, else the kubeconfig's; `api_server` overrides the URL."""
    env = os.environ if env is None else env
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    token_file = service_account_dir / "token"
    if k.kubeconfig is None and host and port and token_file.is_file():
        ca = service_account_dir / "ca.crt"
        ns_file = service_account_dir / "namespace"
        address = f"[{host}]" if ":" in host else host
        return Credentials(
            server=k.api_server or f"https://{address}:{port}",
            verify=_tls(cafile=str(ca)) if ca.is_file() else True,
            token_file=token_file,
            namespace=ns_file.read_text().strip() if ns_file.is_file() else None,
        )
    paths = [k.kubeconfig] if k.kubeconfig else env.get("KUBECONFIG", "").split(os.pathsep)
    files = [Path(p).expanduser() for p in paths if p]
    if not files:
        home = env.get("HOME")
        files = [Path(home) / ".kube/config"] if home else []
    files = [f for f in files if f.is_file()]
    if not files:
        if k.api_server:  # e.g. `kubectl proxy`: no credentials of our own
            return Credentials(server=k.api_server)
        if host:
            raise KubeError(
                f"in a pod, but no service account token at {token_file}: set "
                "automountServiceAccountToken: true on the pod (or its service account)"
            )
        raise KubeError(
            "no Kubernetes credentials: not in a pod with a service account token "
            "(KUBERNETES_SERVICE_HOST unset or no token), and no kubeconfig "
            "(kubernetes.kubeconfig, $KUBECONFIG, ~/.kube/config)"
        )
    return _from_kubeconfig(files, k.api_server)


def _merged(files: Sequence[Path]) -> dict[str, Any]:
    """$KUBECONFIG's files merged as kubectl does: the first to set a name or key wins."""
    out: dict[str, Any] = {"clusters": {}, "users": {}, "contexts": {}, "current-context": None}
    for f in files:
        try:
            doc = yaml.safe_load(f.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise KubeError(f"cannot read the kubeconfig {f}: {e}") from e
        out["current-context"] = out["current-context"] or doc.get("current-context")
        for kind, inner in (("clusters", "cluster"), ("users", "user"), ("contexts", "context")):
            for entry in doc.get(kind) or []:
                item = dict(entry.get(inner) or {})
                item["_dir"] = f.parent  # relative file names are relative to their file
                out[kind].setdefault(entry.get("name"), item)
    return out


def _from_kubeconfig(files: Sequence[Path], api_server: str | None) -> Credentials:
    where = os.pathsep.join(str(f) for f in files)
    kc = _merged(files)
    name = kc["current-context"]
    context = kc["contexts"].get(name)
    if context is None:
        raise KubeError(f"kubeconfig {where}: no current-context (or context {name!r} is absent)")
    cluster = kc["clusters"].get(context.get("cluster"))
    if cluster is None or not (api_server or cluster.get("server")):
        raise KubeError(f"kubeconfig {where}: context {name!r} names no cluster with a server")
    user = kc["users"].get(context.get("user")) or {}
    if "exec" in user or "auth-provider" in user:
        raise KubeError(
            f"kubeconfig {where}: user {context.get('user')!r} authenticates through an exec or "
            "auth-provider plugin (a cloud CLI), which warmroute does not run. Run the proxy "
            "in-cluster with a service account, give the user a token or client certificate, "
            "or run `kubectl proxy` and set kubernetes.api_server: http://127.0.0.1:8001"
        )
    verify: ssl.SSLContext | bool = True
    if cluster.get("insecure-skip-tls-verify"):
        verify = _tls(insecure=True)
    elif cluster.get("certificate-authority-data"):
        verify = _tls(cadata=_b64(cluster["certificate-authority-data"]))
    elif cluster.get("certificate-authority"):
        verify = _tls(cafile=str(cluster["_dir"] / cluster["certificate-authority"]))
    cert = _pem(user, "client-certificate")
    key = _pem(user, "client-key")
    if cert and key:
        if verify is True:
            verify = _tls()
        assert isinstance(verify, ssl.SSLContext)
        _load_chain(verify, cert, key)
    token_file = user.get("tokenFile")
    return Credentials(
        server=api_server or cluster["server"],
        verify=verify,
        token=user.get("token"),
        token_file=(user["_dir"] / token_file) if token_file else None,
        namespace=context.get("namespace"),
    )


def _b64(data: str) -> str:
    return base64.b64decode(data).decode()


def _pem(user: Mapping[str, Any], key: str) -> str | None:
    if user.get(f"{key}-data"):
        return _b64(user[f"{key}-data"])
    if user.get(key):
        try:
            return (user["_dir"] / user[key]).read_text()
        except OSError as e:
            raise KubeError(f"kubeconfig {key}: {e}") from e
    return None


def _tls(
    *, cafile: str | None = None, cadata: str | None = None, insecure: bool = False
) -> ssl.SSLContext:
    try:
        ctx = ssl.create_default_context(cafile=cafile, cadata=cadata)
    except (OSError, ssl.SSLError) as e:
        raise KubeError(f"cannot load the API server's CA ({cafile or 'inline data'}): {e}") from e
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str) -> None:
    """ssl loads a client certificate from files only: a private temp dir, removed at once."""
    with tempfile.TemporaryDirectory() as d:
        cert_path, key_path = Path(d, "cert.pem"), Path(d, "key.pem")
        for path, text in ((cert_path, cert), (key_path, key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        try:
            ctx.load_cert_chain(cert_path, key_path)
        except ssl.SSLError as e:
            raise KubeError(f"cannot load the kubeconfig's client certificate: {e}") from e


# What the labels on a slice may set, and the warnings already logged for bad values.
_ROLES = frozenset(get_args(Role))
_ENGINES = frozenset(get_args(Engine))


def _overrides(labels: Mapping[str, str], warned: set[tuple[str, str]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, key, ok in (
        (ROLE_LABEL, "role", lambda v: v in _ROLES),
        (ENGINE_LABEL, "engine", lambda v: v in _ENGINES),
        (WEIGHT_LABEL, "weight", _weight_ok),
    ):
        value = labels.get(label)
        if value is None:
            continue
        if ok(value):
            out[key] = float(value) if key == "weight" else value
        elif (label, value) not in warned:
            warned.add((label, value))
            allowed = {
                "role": " | ".join(sorted(_ROLES)),
                "engine": " | ".join(sorted(_ENGINES)),
                "weight": "a number > 0",
            }[key]
            log.warning("EndpointSlice label %s=%r ignored: must be %s", label, value, allowed)
    return out


def _weight_ok(value: str) -> bool:
    try:
        w = float(value)
    except ValueError:
        return False
    return math.isfinite(w) and w > 0


def _port(ports: Sequence[Mapping[str, Any]], name: str | None) -> int | None:
    """The slice's port named `name`, else its only (or first) one."""
    numbered = [p for p in ports if p.get("port")]
    if name is not None:
        numbered = [p for p in numbered if p.get("name") == name]
    return int(numbered[0]["port"]) if numbered else None


def members_of(
    cfg: DiscoveryConfig,
    slices: Mapping[str, Mapping[str, Any]],
    warned: set[tuple[str, str]] | None = None,
) -> list[Member]:
    """The engines the slices list (by name), as Members (pure but for once-only warnings)."""
    k = cfg.kubernetes
    assert k is not None
    warned = set() if warned is None else warned
    found: dict[str, Member] = {}
    for name in sorted(slices):
        s = slices[name]
        port = _port(s.get("ports") or [], k.port_name)
        if port is None:
            if ("port", name) not in warned:
                warned.add(("port", name))
                log.warning(
                    "EndpointSlice %s has no port%s: its endpoints are not used",
                    name,
                    f" named {k.port_name!r}" if k.port_name else "",
                )
            continue
        overrides = _overrides((s.get("metadata") or {}).get("labels") or {}, warned)
        for ep in s.get("endpoints") or []:
            conditions = ep.get("conditions") or {}
            ready = conditions.get("ready") is not False  # nil is ready
            if not ready and conditions.get("serving") is not True:
                continue
            for address in ep.get("addresses") or []:
                try:
                    m = Member(cfg.member(address, port, **overrides), serving=ready)
                except ValueError as e:  # pydantic's ValidationError is one
                    if ("address", address) not in warned:
                        warned.add(("address", address))
                        log.warning("EndpointSlice %s: address %r not used: %s", name, address, e)
                    continue
                if m.key not in found or (ready and not found[m.key].serving):
                    found[m.key] = m
    return list(found.values())


def _rv(obj: Mapping[str, Any]) -> str | None:
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return str(rv) if rv else None


class KubernetesSource:
    """The ready endpoints of a Service's EndpointSlices, followed by list+watch.

    `http`: a client to use (its TLS settings as they are); default, one of its own with the
    credentials' CA and client certificate. The in-cluster files' directory and the
    environment are injectable (tests), as are the backoff and the watch's length."""

    def __init__(
        self,
        cfg: DiscoveryConfig,
        http: httpx.AsyncClient | None = None,
        *,
        service_account_dir: Path = SERVICE_ACCOUNT_DIR,
        env: Mapping[str, str] | None = None,
        backoff_s: tuple[float, float] = (0.5, 30.0),  # first retry, and the cap
        refused_retry_s: float = 30.0,  # after 401/403/4xx: someone must fix RBAC
        watch_timeout_s: int = 300,  # the server ends each watch after about this long
    ) -> None:
        if cfg.kubernetes is None:
            raise ValueError("KubernetesSource needs a `kubernetes:` discovery entry")
        self.cfg = cfg
        self.k: KubernetesConfig = cfg.kubernetes
        self.name = cfg.source
        self._http = http
        self._sa_dir = service_account_dir
        self._env = env
        self._backoff = backoff_s
        self._refused_retry_s = refused_retry_s
        self._watch_timeout_s = watch_timeout_s
        self._slices: dict[str, dict[str, Any]] = {}
        self._reported: list[Member] | None = None
        self._warned: set[tuple[str, str]] = set()
        self._trouble: str | None = None  # what is failing now: logged once until it recovers
        self._attempt = 0  # failures in a row (the backoff's exponent)
        self._gone = 0  # 410s in a row with no event between them
        self.resource_version: str | None = None  # the last one seen; None: list first

    @property
    def selector(self) -> str:
        return self.k.selector or f"{SERVICE_NAME_LABEL}={self.k.service}"

    async def run(self, report: Report) -> None:
        namespace = self.k.namespace or "default"
        creds: Credentials | None = None  # loaded once (the token is re-read per request)
        own: httpx.AsyncClient | None = None
        try:
            while True:
                try:
                    if creds is None:
                        creds = load_credentials(
                            self.k, service_account_dir=self._sa_dir, env=self._env
                        )
                        namespace = self.k.namespace or creds.namespace or "default"
                        if self._http is None:
                            own = httpx.AsyncClient(verify=creds.verify)
                    http = self._http or own
                    assert http is not None
                    await self._follow(http, creds, namespace, report)
                except _Gone:
                    self.resource_version = None  # list again: at once, then slower
                    self._gone += 1
                    delay = 0.0 if self._gone == 1 else self._delay(self._gone - 1)
                except (httpx.TransportError, _Unavailable) as e:
                    why = repr(e) if isinstance(e, httpx.TransportError) else str(e)
                    self._fail("unavailable", f"the Kubernetes API server is unavailable ({why})")
                    self._attempt += 1
                    delay = self._delay(self._attempt)
                    if isinstance(e, _Unavailable):
                        delay = max(delay, e.retry_after_s)
                except _Refused as e:
                    self._fail(f"refused {e.status}", self._refused_message(e, namespace))
                    delay = self._refused_retry_s
                except KubeError as e:
                    self._fail("credentials", str(e))
                    delay = self._refused_retry_s
                except Exception as e:  # a bug must not end discovery: say so, and go on
                    self._fail("unexpected", f"{e!r}", exc_info=True)
                    self._attempt += 1
                    delay = self._delay(self._attempt)
                log.debug("%s: retrying in %.3fs", self.name, delay)
                await asyncio.sleep(delay)
        finally:
            if own is not None:
                await own.aclose()

    def _delay(self, attempt: int) -> float:
        first, cap = self._backoff
        return min(cap, first * 2 ** max(0, attempt - 1)) * random.uniform(0.5, 1.0)

    async def _follow(
        self, http: httpx.AsyncClient, creds: Credentials, namespace: str, report: Report
    ) -> None:
        """List (if there is no version to watch from), then watch, until something raises."""
        url = creds.server.rstrip("/") + API_PATH.format(namespace=namespace)
        while True:
            if self.resource_version is None:
                await self._list(http, creds, url)
                self._recovered()
                self._report(report, force=True)
            events = await self._watch(http, creds, url, report)
            if not events:  # ended without a word: not at once again (a server that hangs up)
                await asyncio.sleep(self._delay(1))

    async def _list(self, http: httpx.AsyncClient, creds: Credentials, url: str) -> None:
        slices: dict[str, dict[str, Any]] = {}
        params = {"labelSelector": self.selector, "limit": str(LIST_PAGE)}
        while True:
            r = await http.get(url, params=params, headers=creds.headers(), timeout=30.0)
            self._check(r.status_code, r.content, r.headers.get("retry-after"))
            try:
                body = r.json()
                items = {i["metadata"]["name"]: i for i in body.get("items") or []}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise _Unavailable(f"an unreadable EndpointSliceList ({e!r})") from e
            slices.update(items)
            meta = body.get("metadata") or {}
            if not meta.get("continue"):
                break
            params["continue"] = meta["continue"]
        self._slices = slices
        self.resource_version = _rv(body) or ""
        self._attempt = 0

    async def _watch(
        self, http: httpx.AsyncClient, creds: Credentials, url: str, report: Report
    ) -> int:
        """One watch from the last version: the number of events it carried."""
        params = {
            "labelSelector": self.selector,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "resourceVersion": self.resource_version or "",
            "timeoutSeconds": str(self._watch_timeout_s),
        }
        timeout = httpx.Timeout(30.0, read=self._watch_timeout_s + 30.0)
        events = 0
        request = http.build_request(
            "GET", url, params=params, headers=creds.headers(), timeout=timeout
        )
        try:
            r = await http.send(request, stream=True)
        except httpx.TransportError as e:
            raise _Unavailable(repr(e)) from e
        try:
            if r.status_code != 200:
                self._check(r.status_code, await r.aread(), r.headers.get("retry-after"))
            self._recovered()
            async for line in r.aiter_lines():
                if line.strip():
                    events += 1
                    if self._event(line):
                        self._report(report)
                    self._gone = self._attempt = 0  # an event applied: the backoff starts over
        except (httpx.ReadTimeout, httpx.RemoteProtocolError, httpx.ReadError) as e:
            log.debug("%s: watch dropped (%r); watching again", self.name, e)
        finally:
            await r.aclose()
        return events

    def _event(self, line: str) -> bool:
        """Apply one watch event; True if the slices changed."""
        try:
            event = json.loads(line)
            kind, obj = event["type"], event["object"]
        except (ValueError, KeyError, TypeError) as e:
            raise _Unavailable(f"an unreadable watch event: {line[:200]!r}") from e
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone(obj.get("message", ""))
            raise _Unavailable(f"watch error {obj.get('code')}: {obj.get('message', '')}")
        rv = _rv(obj)
        if rv:
            self.resource_version = rv
        name = (obj.get("metadata") or {}).get("name")
        if kind in ("ADDED", "MODIFIED") and name:
            self._slices[name] = obj
            return True
        if kind == "DELETED" and name:
            return self._slices.pop(name, None) is not None
        return False  # BOOKMARK: only the version moves on

    def _report(self, report: Report, *, force: bool = False) -> None:
        members = members_of(self.cfg, self._slices, self._warned)
        if force or members != self._reported:
            self._reported = members
            log.debug("%s: %d engines", self.name, len(members))
            report(members)

    def _check(self, status: int, body: bytes, retry_after: str | None = None) -> None:
        if status == 200:
            return
        try:
            message = str(json.loads(body).get("message", ""))
        except (ValueError, AttributeError):
            message = body[:200].decode(errors="replace")
        if status == 410:
            raise _Gone(message)
        if status == 429 or status >= 500:
            raise _Unavailable(f"{status} {message}".strip(), retry_after_s(retry_after))
        raise _Refused(status, f"{status} {message}".strip())

    def _refused_message(self, e: _Refused, namespace: str) -> str:
        if e.status in (401, 403):
            return (
                f"the Kubernetes API server refused to list EndpointSlices ({e}): the proxy's "
                f"service account needs a Role granting get, list and watch on "
                f"endpointslices (apiGroup discovery.k8s.io) in namespace {namespace}, bound "
                "to it by a RoleBinding (deploy/kubernetes/overlays/discover-vllm/rbac.yaml)"
                + (" -- and a valid token (401)" if e.status == 401 else "")
            )
        return f"the Kubernetes API server rejected the EndpointSlice query ({e})"

    def _fail(self, what: str, message: str, exc_info: bool = False) -> None:
        if self._trouble == what:
            return
        self._trouble = what
        level = logging.WARNING if what == "unavailable" else logging.ERROR
        log.log(
            level, "%s: %s; keeping the last fleet, retrying", self.name, message, exc_info=exc_info
        )

    def _recovered(self) -> None:
        if self._trouble is not None:
            self._trouble = None
            log.info("%s: the Kubernetes API server answers again", self.name)
