"""The simulator's LoRA adapters, as vLLM serves them: listed with their parent, loaded and
unloaded at run time, their KV blocks keyed apart and named in the KV events."""

from __future__ import annotations

import logging
from collections.abc import Callable

import httpx
import openai
import pytest

from proxy.kvevents.view import KvCacheView
from proxy.kvevents.wire import BlockStored
from proxy.routing.prefix import chain_tokens, seed
from proxy.sim.config import SimConfig
from proxy.sim.kvcache import BlockPool
from tests.support import ServerThread, eventually
from tests.test_sim_http import chat, sim, text_of_tokens

PROMPT = text_of_tokens(400)


def _cached(client: httpx.Client, url: str, model: str) -> int:
    r = client.post(f"{url}/v1/chat/completions", json=chat(PROMPT, model=model))
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_adapters_are_listed_with_their_parent_and_loaded_and_unloaded_at_run_time() -> None:
    with sim(lora_modules="sql,chat=/models/chat-lora") as (url, _), httpx.Client() as c:
        cards = {m["id"]: m for m in c.get(f"{url}/v1/models").json()["data"]}
        assert cards["sim-8b"]["parent"] is None
        assert (cards["chat"]["parent"], cards["chat"]["root"]) == ("sim-8b", "/models/chat-lora")
        assert cards["sql"]["parent"] == "sim-8b"
        r = c.post(f"{url}/v1/chat/completions", json=chat("hi", model="math"))
        assert r.status_code == 404 and "math" in r.json()["error"]["message"]
        r = c.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": "/m"})
        assert r.status_code == 200 and "math" in r.text
        half = c.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x"})
        assert half.status_code == 400 and "lora_path" in half.text
        again = c.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": "/m"})
        assert again.status_code == 400 and "already been loaded" in again.text
        assert (
            c.post(f"{url}/v1/chat/completions", json=chat("hi", model="math")).status_code == 200
        )
        assert c.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
        gone = c.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert gone.status_code == 404 and "cannot be found" in gone.text
        ids = {m["id"] for m in c.get(f"{url}/v1/models").json()["data"]}
        assert ids == {"sim-8b", "chat", "math"}


def test_an_adapters_blocks_are_its_own() -> None:
    with sim(lora_modules="sql,chat") as (url, _), httpx.Client() as c:
        assert _cached(c, url, "sim-8b") == 0
        assert _cached(c, url, "sql") == 0  # the base model's blocks are not the adapter's
        assert _cached(c, url, "sql") > 300
        assert _cached(c, url, "chat") == 0
        assert _cached(c, url, "sim-8b") > 300


@pytest.mark.parametrize("modules", ["", "a,a", "sim-8b", ",=x"])
def test_a_bad_adapter_list_is_refused(modules: str) -> None:
    if not modules:
        SimConfig(lora_modules=modules)  # none: fine
        return
    with pytest.raises(ValueError, match="lora_modules"):
        SimConfig(lora_modules=modules)


def test_an_adapters_kv_events_name_it_and_key_as_the_proxy_keys_its_requests() -> None:
    """vLLM's layout: lora_name and lora_id on the event, the adapter's name in every block's
    extra keys (a first block's cache salt after it); the proxy's view rekeys them from
    seed(adapter, salt), as the router keys a request that names the adapter."""
    pool = BlockPool(8, block_size=4, record_events=True)
    tokens = list(range(8))
    pool.commit(0, 11, None, tokens[:4], "s1", ("sql", 3))
    pool.commit(1, 12, 11, tokens[4:], "", ("sql", 3))
    pool.commit(2, 13, None, tokens[:4], "", None)
    first, base = pool.take_events()
    assert isinstance(first, BlockStored) and isinstance(base, BlockStored)
    assert (first.lora_name, first.lora_id) == ("sql", 3)
    assert list(first.extra_keys or ()) == [("sql", "s1"), ("sql",)]
    assert base.lora_name is None and base.extra_keys == [None]
    view = KvCacheView("sim-8b", 4)
    view.apply([first, base])
    assert view.match(chain_tokens(seed("sql", "s1"), tokens, 4, 8)) == 2
    assert view.match(chain_tokens(seed("sim-8b"), tokens, 4, 8)) == 1
    assert view.match(chain_tokens(seed("sql"), tokens, 4, 8)) == 0  # salted apart


async def test_adapter_requests_go_only_where_the_adapter_is_served_and_a_load_is_no_restart(
    proxy_server: Callable[..., ServerThread], caplog: pytest.LogCaptureFixture
) -> None:
    """Through the real proxy: two engines, the adapter on one. Its requests all go there (the
    other would answer 404); once it is loaded on the other at run time, the proxy lists it
    there too, without taking the engine for a new one (its cache knowledge stays)."""
    with sim(lora_modules="sql", time_scale=50) as (a, _), sim(time_scale=50) as (b, _):
        fast = {"health": {"interval_s": 0.1, "idle_interval_s": 0.1, "models_refresh_s": 0.2}}
        proxy = proxy_server([a, b], config=fast)
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        async with httpx.AsyncClient(timeout=30) as h:
            for i in range(4):
                for model in ("sql", "sim-8b"):
                    done = await client.chat.completions.create(
                        model=model,
                        messages=[{"role": "user", "content": f"{i} " + text_of_tokens(60)}],
                        max_tokens=2,
                    )
                    assert done.usage is not None
            on_b = (await h.get(b + "/sim/received")).json()["requests"]
            on_a = (await h.get(a + "/sim/received")).json()["requests"]
            assert sum(r["body"]["model"] == "sql" for r in on_a) == 4
            assert all(r["body"]["model"] != "sql" for r in on_b)
            listed = (await h.get(proxy.url + "/v1/models")).json()["data"]
            assert {"id": "sql", "parent": "sim-8b"}.items() <= {
                **next(m for m in listed if m["id"] == "sql")
            }.items()
            body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
            caplog.set_level(logging.INFO, logger="warmroute")
            assert (await h.post(b + "/v1/load_lora_adapter", json=body)).status_code == 200

            async def on_both() -> bool:
                rows = (await h.get(proxy.url + "/admin/backends")).json()["backends"]
                return all(r["adapters"] == {"sql": "sim-8b"} for r in rows)

            await eventually(on_both, "the adapter listed on both engines")
    assert "LoRA adapters loaded: sql" in caplog.text
    assert "restarted" not in caplog.text  # (what a changed base model would log)
