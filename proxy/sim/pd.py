"""Prefill/decode disaggregation in the simulated engine: which leg a request is, the KV it
is handed, and SGLang's bootstrap rooms.

Two flows, as the engines speak them (`--pd` picks which a sim understands; the other's fields
are ignored, as a real engine ignores what it does not know):

- vLLM (NixlConnector style): a request with `kv_transfer_params.do_remote_decode` is a
  prefill leg (one token, then its blocks are offered in the answer's kv_transfer_params); one
  with `do_remote_prefill` and `remote_block_ids` is a decode leg that pulls those blocks.
- SGLang: the same body with `bootstrap_host/port/room` goes to a prefill and a decode engine
  at once; the decode engine long-polls the prefill engine's /sim/bootstrap/{room} until that
  room's prefill finished, then pulls its KV.

A pulled prompt costs link time for the blocks this engine does not already hold (the physics
in docs/physics.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from proxy.asgi import Scope
from proxy.sim.config import SimConfig
from proxy.sim.engine import Seq, kv_transfer_seconds
from proxy.sim.errors import HTTPError
from proxy.sim.kvcache import BlockPool, block_hashes

ROOM_TTL_S = 120.0


@dataclass(frozen=True, slots=True)
class Leg:
    """What a request is to this engine's P/D flow."""

    prefill: bool = False  # a prefill leg: one token, then the KV is offered
    external: int = 0  # prompt tokens whose KV comes from another engine (a decode leg)
    rooms: tuple[str, ...] = ()  # SGLang bootstrap rooms


@dataclass
class _Room:
    """SGLang-style bootstrap room: a decode leg waits here for its prefill leg."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    prompt_tokens: int = 0
    created: float = field(default_factory=time.monotonic)


class Disagg:
    """One engine's side of both flows: its rooms and the client it fetches KV with."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rooms: dict[str, _Room] = {}
        self.kv_waits = 0  # SGLang decode legs waiting for their prefill's KV now
        self._client: httpx.AsyncClient | None = None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def leg(self, body: dict[str, Any], prompt_tokens: int) -> Leg:
        """Which leg `body` is here; a decode leg's KV is fetched (SGLang) before it returns."""
        kvp = body.get("kv_transfer_params")
        if kvp is not None and not isinstance(kvp, dict):
            raise HTTPError(400, "kv_transfer_params must be an object", "kv_transfer_params")
        rooms = rooms_of(body.get("bootstrap_room"))
        cfg = self.cfg
        vllm, sglang = cfg.pd in ("both", "vllm"), cfg.pd in ("both", "sglang")
        if (vllm and bool(kvp and kvp.get("do_remote_decode"))) or (
            sglang and bool(rooms) and cfg.role == "prefill"
        ):
            return Leg(prefill=True, rooms=tuple(rooms))
        if vllm and kvp and kvp.get("do_remote_prefill"):
            blocks = kvp.get("remote_block_ids") or []
            return Leg(external=min(prompt_tokens, len(blocks) * cfg.block_size))
        if sglang and rooms and cfg.role == "decode":
            self.kv_waits += 1
            try:
                external = await self._fetch(body, rooms, prompt_tokens)
            finally:
                self.kv_waits -= 1
            return Leg(external=external, rooms=tuple(rooms))
        return Leg()

    def prefilled(self, rooms: tuple[str, ...]) -> Callable[[int], None]:
        """Callback for a finished prefill leg: wake the decode legs waiting on its rooms."""

        def done(prompt_tokens: int) -> None:
            for room in rooms:
                r = self._room(room)
                r.prompt_tokens = prompt_tokens
                r.event.set()

        return done

    def kv_params(self, scope: Scope, seq: Seq) -> dict[str, Any]:
        """A vLLM prefill leg's kv_transfer_params, as NixlConnector returns them."""
        host, port = scope.get("server") or ("127.0.0.1", 0)
        cfg = self.cfg
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(seq.last_blocks),
            "remote_engine_id": cfg.engine_id,
            "remote_request_id": seq.request_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": cfg.tensor_parallel_size,
        }

    async def transfer(self, pool: BlockPool, prompt: list[int], external: int, salt: int) -> None:
        """Pay the link time for the part of the prompt this engine does not already hold."""
        bs = self.cfg.block_size
        hit = pool.longest_hit(block_hashes(prompt[:external], bs, salt))
        missing = max(0, external - len(hit) * bs)
        if missing:
            await asyncio.sleep(kv_transfer_seconds(self.cfg, missing) / self.cfg.time_scale)

    async def wait(self, room: str) -> dict[str, Any]:
        """Long poll of a decode engine: answers once the prefill leg of `room` finished."""
        r = self._room(room)
        try:
            await asyncio.wait_for(r.event.wait(), self.cfg.bootstrap_timeout_s)
        except TimeoutError:
            raise HTTPError(404, f"bootstrap room {room} never prefilled here") from None
        self.rooms.pop(room, None)
        return {"room": room, "prompt_tokens": r.prompt_tokens, "engine": self.cfg.engine_id}

    def _room(self, room: str) -> _Room:
        now = time.monotonic()
        for key in [k for k, r in self.rooms.items() if now - r.created > ROOM_TTL_S]:
            del self.rooms[key]
        if room not in self.rooms:
            self.rooms[room] = _Room()
        return self.rooms[room]

    async def _fetch(self, body: dict[str, Any], rooms: list[str], prompt_tokens: int) -> int:
        """Wait for the prefill engine of every room (GET its /sim/bootstrap/{room}); the
        prompt tokens whose KV arrived (the fewest, for a batch)."""
        hosts = per_room(body.get("bootstrap_host"), len(rooms))
        ports = per_room(body.get("bootstrap_port"), len(rooms))
        if not all(hosts) or not all(ports):
            raise HTTPError(
                400, "bootstrap_room needs bootstrap_host and bootstrap_port", "bootstrap_host"
            )
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.cfg.bootstrap_timeout_s + 5)
        client = self._client

        async def fetch(host: Any, port: Any, room: str) -> int:
            h = str(host).strip("[]")
            host_part = f"[{h}]" if ":" in h else h
            r = await client.get(f"http://{host_part}:{int(port)}/sim/bootstrap/{room}")
            r.raise_for_status()
            return int(r.json().get("prompt_tokens", 0))

        try:
            got = await asyncio.gather(*map(fetch, hosts, ports, rooms))
        except (httpx.HTTPError, ValueError, TypeError) as e:
            raise HTTPError(500, f"KV transfer from the prefill engine failed: {e}") from None
        return min(min(got), prompt_tokens)


def rooms_of(value: Any) -> list[str]:
    """SGLang's bootstrap_room: one integer, or one per prompt of a batch."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(r, int) and not isinstance(r, bool) for r in items):
        raise HTTPError(
            400, "bootstrap_room must be an integer or a list of them", "bootstrap_room"
        )
    return [str(r) for r in items]


def per_room(value: Any, rooms: int) -> list[Any]:
    """A bootstrap field given once for all rooms, or as a list with one entry per room."""
    if isinstance(value, list):
        if len(value) != rooms:
            raise HTTPError(400, "bootstrap fields must have one entry per bootstrap_room")
        return value
    return [value] * rooms
