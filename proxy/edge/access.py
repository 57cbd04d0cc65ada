"""Who may call what: client API keys, the admin token, and which listener serves admin.

Secrets are never stored: the config holds SHA-256 hex digests (`printf %s "$KEY" |
sha256sum`), a presented key is hashed and compared with every digest in constant time
(`hmac.compare_digest`), and only a key's configured name goes further (spans, metrics, the
prefix hash's tenant salt). docs/security.md has the model.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


def bearer(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (ASGI raw headers), if any."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


@dataclass(frozen=True)
class KeyRing:
    """Named SHA-256 digests of the accepted keys."""

    digests: tuple[tuple[str, bytes], ...]  # (name, raw 32-byte digest)

    @classmethod
    def from_hex(cls, named: Mapping[str, str] | Iterable[tuple[str, str]]) -> KeyRing:
        items = named.items() if isinstance(named, Mapping) else named
        return cls(tuple((name, bytes.fromhex(h)) for name, h in items))

    def __bool__(self) -> bool:
        return bool(self.digests)

    def match(self, presented: str | None) -> str | None:
        """The name of the key `presented` is, or None; compares against every digest."""
        if presented is None:
            return None
        digest = hashlib.sha256(presented.encode("utf-8", "surrogatepass")).digest()
        found = None
        for name, expected in self.digests:  # no early exit: the time does not say which
            if hmac.compare_digest(digest, expected) and found is None:
                found = name
        return found


@dataclass(frozen=True)
class AdminAccess:
    """Where /admin/* is served and what it needs.

    `mode` is "off" (not served), "serving" (on the serving port) or "listener" (only on
    the separate admin port); `token` (when set) is needed on whichever port serves it.
    """

    mode: str
    admin_port: int | None
    token: KeyRing

    @classmethod
    def from_settings(
        cls, port: int, admin_port: int | None, token_sha256: str | None
    ) -> AdminAccess:
        token = KeyRing.from_hex([("admin", token_sha256)] if token_sha256 else [])
        if admin_port is not None and admin_port != port:
            return cls("listener", admin_port, token)
        if admin_port is not None or token:
            return cls("serving", None, token)
        return cls("off", None, token)

    def on_admin_listener(self, server: tuple[str, int | None] | None) -> bool:
        """Whether a request arrived on the admin listener (ASGI scope["server"])."""
        return self.admin_port is not None and server is not None and server[1] == self.admin_port

    def refusal(self, on_admin_listener: bool, token: str | None) -> tuple[int, str, str] | None:
        """(status, message, code) when an admin request must be refused, else None."""
        if self.mode == "off" or (self.mode == "listener" and not on_admin_listener):
            return (
                404,
                "The admin endpoints are not served on this port. Set server.admin_port "
                "(a separate listener, loopback by default) or server.admin_token_sha256.",
                "not_found",
            )
        if self.token and self.token.match(token) is None:
            return (
                401,
                "The admin endpoints need `Authorization: Bearer <admin token>` "
                "(server.admin_token_sha256 holds its SHA-256).",
                "invalid_admin_token",
            )
        return None
