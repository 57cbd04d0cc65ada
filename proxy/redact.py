"""Keeping secrets and client bytes out of what warmroute prints.

Backend, Redis and OTLP URLs may carry credentials (`http://user:password@host`); they are
shown with the userinfo and query replaced by `***` wherever they are printed: views,
`serve --check`, log lines. Log messages also quote client input (a model name, a request
id), so control characters in a message are escaped: a newline in a model name cannot forge a
log line. A client's string is quoted only up to a short prefix and its size (`quote`), in
error bodies and log lines alike, and a client's `x-request-id` is kept only when it is a
short, printable one (`sane_request_id`): it travels to the response, logs, spans and the backend.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
# scheme://userinfo@ inside any text (a log line, an exception message)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/@\s'\"]+)@")
# control characters other than tab: C0, DEL and C1
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
# The most of a client's string (a model name, a JSON key, a path) that an error message or a
# log line quotes: a 15 MB model name came back as a 15 MB 404 body and log line.
QUOTE_CHARS = 128
# A client's x-request-id that is kept: 1-200 printable ASCII characters, no space (the rule
# of every path, proxy.edge.limits.request_id_of included: one precompiled match per request).
_REQUEST_ID = re.compile(r"[!-~]{1,200}")
log = logging.getLogger("warmroute.request")


def quote(text: str, limit: int = QUOTE_CHARS) -> str:
    """`text` as an error message or log line may quote it: whole when short, else its first
    `limit` characters and its size (`abc… (15728640 bytes)`)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text.encode('utf-8', 'surrogatepass'))} bytes)"


def sane_request_id(client: str | None) -> str:
    """The request's id: the client's `x-request-id` when it is a sane one, else a new one.

    Called once per request; the id it returns is the one the response header, the log
    lines, the spans and the upstream request carry.
    """
    if client is not None and _REQUEST_ID.fullmatch(client):
        return client
    new = os.urandom(16).hex()  # uuid4().hex: 3x the CPU
    if client is not None:
        log.info(
            "x-request-id %r replaced by %s: not 1-200 printable ASCII characters without spaces",
            quote(client, 64),
            new,
        )
    return new


def redact_url(url: str) -> str:
    """The URL with its userinfo and query masked: what may be shown of it."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return redact_text(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = MASK + "@" + netloc.rpartition("@")[2]
    query = MASK if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """`text` with the userinfo of every URL in it masked."""
    if "@" not in text:
        return text
    return _USERINFO.sub(lambda m: m["scheme"] + MASK + "@", text)


def escape_control(text: str) -> str:
    """Control characters (newline included) as visible escapes: `\\n`, `\\x1b`."""
    if not _CONTROL.search(text):
        return text
    return _CONTROL.sub(_escape_one, text)


def _escape_one(m: re.Match[str]) -> str:
    c = m.group()
    return {"\n": "\\n", "\r": "\\r"}.get(c) or f"\\x{ord(c):02x}"


def redacted_config(dump: Any) -> Any:
    """A config dump (Config.model_dump) with every string in it redacted: a URL's userinfo
    and query masked, and any URL inside other text too. Every value, not a list of keys:
    backend, Redis and OTLP endpoints, KV-event sockets, plugin settings, and whatever key
    holds a URL next."""
    if isinstance(dump, str):
        return redact_url(dump) if _is_url(dump) else redact_text(dump)
    if isinstance(dump, dict):
        return {k: redacted_config(v) for k, v in dump.items()}
    if isinstance(dump, list):
        return [redacted_config(v) for v in dump]
    return dump


def _is_url(text: str) -> bool:
    try:
        parts = urlsplit(text)
    except ValueError:
        return False
    return bool(parts.scheme and parts.netloc) and " " not in text


class SafeFormatter(logging.Formatter):
    """A Formatter whose messages carry no URL credentials and no raw control characters.

    Only the message is escaped: a traceback's own newlines stay as they are.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_control(redact_text(record.message))
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        return redact_text(super().formatException(ei))


def install_safe_formatter(fmt: str, level: str) -> None:
    """Log to stderr through SafeFormatter; the HTTP client's per-request lines are quieted.

    httpx logs every request's URL at INFO (the health checks: one line per backend every
    few seconds, with any credentials in it); its warnings still show.
    """
    root = logging.getLogger()
    handler = logging.StreamHandler()
    handler.setFormatter(SafeFormatter(fmt))
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
