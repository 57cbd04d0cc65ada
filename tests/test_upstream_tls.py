"""TLS to the backends (upstream.tls_*): a local CA, server and client certificates made by the
`openssl` command, asyncio and uvicorn TLS servers on loopback.

The forwarder's client (proxy/upstream/pool.py) and the health client take the same context
(client_ssl_context), so each setting is checked on the client alone and then through the
proxy, where the health checks must pass for the proxy to be ready.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.bench.mock import MockBackend
from proxy.config import Config, TimeoutsConfig, UpstreamConfig
from proxy.server.app import create_app
from proxy.upstream.pool import Upstream, UpstreamConnectError, UpstreamError, client_ssl_context
from tests.support import ServerThread

MODEL = "test-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl command")


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed none of these


def _openssl(workdir: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=workdir, check=True, capture_output=True)


def _make_ca(d: Path, name: str) -> None:
    _openssl(
        d, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
        "-subj", f"/CN=warmroute test {name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip


def _make_leaf(d: Path, name: str, usage: str, san: str) -> None:
    _openssl(
        d, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=warmroute {name}",
    )  # fmt: skip
    ext = d / f"{name}.ext"
    ext.write_text(
        f"subjectAltName={san}\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n"
        f"extendedKeyUsage={usage}\nauthorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n"
    )
    _openssl(
        d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", str(ext),
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    _make_ca(d, "ca")
    _make_ca(d, "other")
    _make_leaf(d, "server", "serverAuth", "IP:127.0.0.1")
    _make_leaf(d, "client", "clientAuth", "DNS:warmroute-client")
    return Pki(
        d / "ca.pem",
        d / "server.pem",
        d / "server.key",
        d / "client.pem",
        d / "client.key",
        d / "other.pem",
    )


def server_context(pki: Pki, require_client_cert: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki.server_cert, pki.server_key)
    if require_client_cert:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(pki.ca)
    return ctx


Seen = list[dict[str, Any]]


async def with_tls_server(
    pki: Pki,
    require_client_cert: bool,
    body: Callable[[int, Seen], Awaitable[None]],
) -> Seen:
    """An HTTPS server on loopback answering every request with the client certificate's
    subject it saw; returns what each request looked like to it."""
    seen: Seen = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            writer.close()
            return
        length = next(
            (int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
             if ln.lower().startswith(b"content-length:")),
            0,
        )  # fmt: skip
        await reader.readexactly(length)
        cert = writer.get_extra_info("peercert") or {}
        subject = dict(x[0] for x in cert.get("subject", ()))
        seen.append({"client_cn": subject.get("commonName")})
        reply = json.dumps(seen[-1]).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(reply), reply)
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(
        handler, "127.0.0.1", 0, ssl=server_context(pki, require_client_cert)
    )
    try:
        await body(server.sockets[0].getsockname()[1], seen)
    finally:
        server.close()
    return seen


async def post(port: int, cfg: UpstreamConfig, host: str = "127.0.0.1") -> dict[str, Any]:
    """One request with the forwarder's client under these TLS settings."""
    client = Upstream(
        TimeoutsConfig(connect_s=5, first_byte_s=5), ssl_context=client_ssl_context(cfg)
    )
    await client.start()
    try:
        resp = await client.post(client.url(f"https://{host}:{port}", "/v1/x"), b"{}", {})
        try:
            assert resp.status == 200
            return dict(json.loads(await resp.read()))
        finally:
            resp.release()
    finally:
        await client.close()


# -- the forwarder's client -----------------------------------------------------------------------


async def test_a_backend_certificate_from_the_configured_ca_is_accepted(pki: Pki) -> None:
    async def body(port: int, seen: Seen) -> None:
        assert await post(port, UpstreamConfig(tls_ca_file=str(pki.ca))) == {"client_cn": None}

    assert len(await with_tls_server(pki, False, body)) == 1


async def test_a_certificate_from_another_ca_is_refused_before_anything_is_sent(pki: Pki) -> None:
    async def body(port: int, seen: Seen) -> None:
        for cfg in (UpstreamConfig(), UpstreamConfig(tls_ca_file=str(pki.other_ca))):
            with pytest.raises(UpstreamConnectError, match="certificate verify failed"):
                await post(port, cfg)

    assert await with_tls_server(pki, False, body) == []  # no request reached it


async def test_a_certificate_for_another_name_is_refused(pki: Pki) -> None:
    async def body(port: int, seen: Seen) -> None:
        # the certificate names 127.0.0.1 only
        with pytest.raises(UpstreamConnectError, match="certificate verify failed"):
            await post(port, UpstreamConfig(tls_ca_file=str(pki.ca)), host="localhost")

    assert await with_tls_server(pki, False, body) == []


async def test_with_verify_off_any_certificate_is_accepted(pki: Pki) -> None:
    async def body(port: int, seen: Seen) -> None:
        off = UpstreamConfig(tls_verify=False)
        assert await post(port, off) == {"client_cn": None}
        assert await post(port, off, host="localhost") == {"client_cn": None}

    assert len(await with_tls_server(pki, False, body)) == 2


async def test_a_backend_that_requires_a_client_certificate_gets_the_configured_one(
    pki: Pki,
) -> None:
    mutual = UpstreamConfig(
        tls_ca_file=str(pki.ca),
        tls_cert_file=str(pki.client_cert),
        tls_key_file=str(pki.client_key),
    )

    async def body(port: int, seen: Seen) -> None:
        assert await post(port, mutual) == {"client_cn": "warmroute client"}
        # Without one the server ends the handshake: an upstream error, never an answer.
        with pytest.raises(UpstreamError):
            await post(port, UpstreamConfig(tls_ca_file=str(pki.ca)))

    assert len(await with_tls_server(pki, True, body)) == 1


# -- through the proxy: health checks and forwarding share the settings ------------------------


@pytest.fixture
def mutual_tls_backend(pki: Pki) -> Iterator[str]:
    """The mock OpenAI backend under uvicorn, serving HTTPS to client certificates only."""
    server = ServerThread(
        MockBackend(chunks=3, models=(MODEL,)),
        ssl_certfile=str(pki.server_cert),
        ssl_keyfile=str(pki.server_key),
        ssl_ca_certs=str(pki.ca),
        ssl_cert_reqs=ssl.CERT_REQUIRED,
    ).start()
    yield f"https://127.0.0.1:{server.port}"
    server.stop()


@pytest.mark.e2e
def test_the_proxy_checks_and_forwards_to_a_mutual_tls_backend(
    pki: Pki, mutual_tls_backend: str
) -> None:
    upstream = {
        "tls_ca_file": str(pki.ca),
        "tls_cert_file": str(pki.client_cert),
        "tls_key_file": str(pki.client_key),
    }
    config = Config.model_validate(
        {"backends": [{"url": mutual_tls_backend, "models": [MODEL]}], "upstream": upstream}
    )
    with ServerThread(create_app(config)) as proxy:
        ready = httpx.get(proxy.url + "/ready", timeout=10)
        assert ready.status_code == 200, ready.text  # the health client got through
        r = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


@pytest.mark.e2e
def test_without_the_client_certificate_the_backend_is_down_for_both_clients(
    pki: Pki, mutual_tls_backend: str
) -> None:
    config = Config.model_validate(
        {
            "backends": [{"url": mutual_tls_backend, "models": [MODEL]}],
            "upstream": {"tls_ca_file": str(pki.ca)},
        }
    )
    with ServerThread(create_app(config)) as proxy:
        assert httpx.get(proxy.url + "/ready", timeout=10).status_code == 503
        r = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "server_error"
