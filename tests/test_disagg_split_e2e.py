"""The pool split end to end: `disagg.mode: on` over six mixed simulated engines on loopback.
Long documents land in the prefill-heavy pool, chat streams in the decode-heavy pool, and a
document asked about again goes back to the prefill engine that holds it."""

from __future__ import annotations

import contextlib
from typing import Any

import httpx
import pytest

from tests.test_sim_http import sim, text_of_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ENGINES = 6  # with nothing measured yet, a quarter of the mixed engines take prefill: two


def _backend(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.headers["x-warmroute-backend"]


async def test_documents_go_to_the_prefill_pool_chats_to_the_decode_pool_with_affinity(
    proxy_server: Any,
) -> None:
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(sim("h100", time_scale=8))[0] for _ in range(ENGINES)]
        proxy = proxy_server(urls, config={"disagg": {"mode": "on", "threshold_tokens": 1024}})
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as h:
            pools = (await h.get("/admin/disagg")).json()["pools"]
            prefill, decode = set(pools["prefill"]), set(pools["decode"])
            assert len(prefill) == 2 and len(decode) == 4

            async def ask(content: str, max_tokens: int) -> str:
                body = {
                    "model": "sim-8b",
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "stream": True,
                }
                async with h.stream("POST", "/v1/chat/completions", json=body) as r:
                    await r.aread()
                    return _backend(r)

            # Documents (3,000 uncached tokens, a 16-token answer) until both prefill engines
            # hold some: where each landed first.
            homes: dict[str, str] = {}
            for i in range(20):
                doc = text_of_tokens(3000, f"document {i}")
                homes[doc] = await ask(doc + " Summarise it.", 16)
                if set(homes.values()) == prefill:
                    break
            assert set(homes.values()) == prefill  # every one in the prefill pool, both used
            # Chat streams: short prompts, long answers.
            chats = {await ask(f"hello number {i}, tell me a story", 200) for i in range(8)}
            assert chats <= decode
            # Each document again, with another question: back to the engine that holds it.
            for doc, home in homes.items():
                assert await ask(doc + " Now list its three main points.", 16) == home
            state = (await h.get("/admin/disagg")).json()
            stats = [(await h.get(u + "/sim/stats")).json() for u in urls]
    by_name = dict(zip((u.removeprefix("http://") for u in urls), stats, strict=True))
    # The decode engines never prefilled a document: their prompts were all short.
    for name in decode:
        assert all(r["prompt_tokens"] < 1024 for r in by_name[name]["requests"])
    # The repeated documents were served from the prefill engines' caches.
    hits = sum(r["cached_tokens"] >= 2900 for n in prefill for r in by_name[n]["requests"])
    assert hits == len(homes)
    assert state["requests"]["one:prefill"] == 2 * len(homes)
    assert state["requests"]["one:decode"] == 8
