"""One group of a bench run: its plan, its conversations' histories, its requests in flight
and their streams, each chunk timed the moment its read returns (before any parsing)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import orjson
from tqdm import tqdm

from proxy.bench.results import RequestResult
from proxy.bench.workloads import Message, RequestSpec, Workload
from proxy.sse import data_of

_ERROR_BODY_LIMIT = 2000


class GroupRun:
    """State of one run: plan, conversation histories, results, progress."""

    def __init__(
        self,
        targets: list[str],
        workload: Workload,
        plan: list[RequestSpec],
        *,
        model: str,
        endpoint: str,
        session: aiohttp.ClientSession,
        extra_body: dict[str, Any] | None,
        headers: dict[str, str],
        pbar: tqdm[Any] | None,
        affinity: str = "round-robin",
    ) -> None:
        self.targets = targets
        self.affinity = affinity
        self.workload = workload
        self.plan = plan
        self.model = model
        self.endpoint = endpoint
        self.session = session
        self.extra_body = extra_body or {}
        self.headers = headers
        self.pbar = pbar
        self.results: dict[int, RequestResult] = {}
        self.t0 = 0.0
        self.history: dict[int, list[Message]] = {}
        self.turn_done: dict[tuple[int, int], asyncio.Event] = {
            (s.conversation, s.turn): asyncio.Event() for s in plan if s.conversation is not None
        }
        self.failed_conversations: set[int] = set()

    def target_for(self, spec: RequestSpec) -> str:
        if self.affinity == "system" and spec.system_id is not None:
            # Static affinity: system prompt i always on target i mod N, so each target's cache
            # holds only its share of the prompts; the bound a cache-aware router is judged by.
            return self.targets[spec.system_id % len(self.targets)]
        # Round-robin by conversation keeps a conversation on one backend, as a cache-aware
        # proxy would; single requests (and, with affinity "system", requests without a
        # system prompt) are spread by index.
        key = spec.conversation if spec.conversation is not None else spec.index
        return self.targets[key % len(self.targets)]

    async def issue(self, spec: RequestSpec) -> None:
        r = RequestResult(
            index=spec.index,
            target=self.target_for(spec),
            kind=spec.kind,
            conversation=spec.conversation,
            turn=spec.turn,
            system_id=spec.system_id,
        )
        conv = spec.conversation
        try:
            if conv is not None and spec.turn > 0:
                # A later turn carries the earlier reply, so it cannot start before it exists.
                await self.turn_done[(conv, spec.turn - 1)].wait()
            self.results[spec.index] = r
            if conv is not None and conv in self.failed_conversations:
                r.error_kind, r.error = "dependency", "an earlier turn of this conversation failed"
                return
            history = self.history.get(conv, []) if conv is not None else []
            reply = await self._send(spec, r, history)
            if conv is not None:
                if r.ok:
                    self.history[conv] = [
                        *history,
                        {"role": "user", "content": self.workload.user_text(spec)},
                        {"role": "assistant", "content": reply},
                    ]
                else:
                    self.failed_conversations.add(conv)
        finally:
            if conv is not None:
                self.turn_done[(conv, spec.turn)].set()
            if self.pbar is not None:
                self.pbar.update(1)

    def _payload(self, spec: RequestSpec, history: list[Message]) -> tuple[str, bytes]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "completions":
            body["prompt"] = self.workload.prompt(spec, history)
            path = "/v1/completions"
        else:
            body["messages"] = self.workload.messages(spec, history)
            path = "/v1/chat/completions"
        if (user := self.workload.user(spec)) is not None:
            body["user"] = user  # what session-sticky routing keys on
        body.update(self.extra_body)
        return path, orjson.dumps(body)

    async def _send(self, spec: RequestSpec, r: RequestResult, history: list[Message]) -> str:
        path, data = self._payload(spec, history)
        chat = self.endpoint != "completions"
        reply: list[str] = []
        perf = time.perf_counter
        start = perf()
        r.start = start - self.t0
        last = start
        done = False
        try:
            async with self.session.post(r.target + path, data=data, headers=self.headers) as resp:
                r.http_status = resp.status
                if resp.status != 200:
                    body = await resp.content.read(_ERROR_BODY_LIMIT)
                    r.error_kind, r.error = f"http_{resp.status}", _error_message(body, resp)
                    return ""
                buf = b""
                async for raw in resp.content.iter_any():
                    now = perf()
                    buf += raw.replace(b"\r\n", b"\n") if b"\r" in raw else raw
                    while (cut := buf.find(b"\n\n")) >= 0:
                        event, buf = buf[:cut], buf[cut + 2 :]
                        payload = data_of(event)  # comments, pings, other fields: None
                        if payload is None:
                            continue
                        if payload == b"[DONE]":
                            done = True
                            continue
                        obj = orjson.loads(payload)
                        if not isinstance(obj, dict):
                            continue
                        if obj.get("error") and not obj.get("choices"):
                            r.error_kind, r.error = "stream_error", _short(obj["error"])
                            return "".join(reply)
                        text = _absorb(obj, r, chat)
                        if text is None:
                            continue
                        # An output-bearing chunk: the only kind TTFT and ITL are made of.
                        if r.output_chunks == 0:
                            r.ttft = now - start
                        else:
                            r.itl.append(now - last)
                        last = now
                        r.output_chunks += 1
                        r.output_chars += len(text)
                        reply.append(text)
        except aiohttp.ClientConnectorError as e:
            r.error_kind, r.error = "connect", str(e.os_error or e)
            return ""
        except TimeoutError:
            r.error_kind, r.error = "timeout", "request timed out (--request-timeout)"
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as e:
            r.error_kind, r.error = "disconnected", f"{type(e).__name__}: {e}"
        except aiohttp.ClientError as e:
            r.error_kind, r.error = "client_error", f"{type(e).__name__}: {e}"
        except orjson.JSONDecodeError as e:
            r.error_kind, r.error = "bad_json", str(e)
        if r.error_kind is None:
            if r.output_chunks == 0:
                r.error_kind, r.error = "no_output", "the stream carried no output chunk"
            elif not done and r.finish_reason is None:
                r.error_kind, r.error = "truncated", "stream ended without finish_reason/[DONE]"
            else:
                r.ok = True
        if r.output_chunks:
            r.e2e = last - start
        return "".join(reply)


def _absorb(obj: dict[str, Any], r: RequestResult, chat: bool) -> str | None:
    """Record usage and finish reason; return the chunk's output text, None if it carries none
    (role-only and usage-only chunks do not count, docs/measurement.md)."""
    usage = obj.get("usage")
    if usage:
        r.prompt_tokens = usage.get("prompt_tokens", r.prompt_tokens)
        r.completion_tokens = usage.get("completion_tokens", r.completion_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            r.cached_tokens = details["cached_tokens"]
    choices = obj.get("choices")
    if not choices:
        return None
    choice = choices[0]
    if choice.get("finish_reason"):
        r.finish_reason = choice["finish_reason"]
    if not chat:
        return choice.get("text") or None
    delta = choice.get("delta") or {}
    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    if text:
        return str(text)
    if delta.get("tool_calls"):
        return ""  # output, but no text to add to the history
    return None


def _short(err: Any) -> str:
    if isinstance(err, dict):
        err = err.get("message") or err
    return str(err)[:300]


def _error_message(body: bytes, resp: aiohttp.ClientResponse) -> str:
    with contextlib.suppress(orjson.JSONDecodeError):
        obj = orjson.loads(body)
        if isinstance(obj, dict) and obj.get("error"):
            return _short(obj["error"])
    return (body.decode("utf-8", "replace").strip() or resp.reason or "")[:300]
