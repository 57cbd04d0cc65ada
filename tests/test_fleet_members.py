"""The membership core (proxy/fleet/members.py): whole-set reports in, changes out."""

from __future__ import annotations

import pytest

from proxy.config import BackendConfig
from proxy.fleet.members import Member, Membership


def m(port: int, serving: bool = True, **keys: object) -> Member:
    return Member(
        BackendConfig.model_validate({"url": f"http://127.0.0.1:{port}", **keys}), serving
    )


def kinds(changes: list) -> list[tuple[str, str]]:
    return [(c.kind, c.key) for c in changes]


def test_a_report_joins_what_is_new_and_leaves_what_is_gone() -> None:
    ms = Membership()
    assert kinds(ms.report("dns:x", [m(1), m(2)])) == [
        ("join", "127.0.0.1:1"),
        ("join", "127.0.0.1:2"),
    ]
    assert kinds(ms.report("dns:x", [m(2), m(3)])) == [
        ("leave", "127.0.0.1:1"),
        ("join", "127.0.0.1:3"),
    ]
    assert ms.report("dns:x", [m(3), m(2)]) == []  # the same set in another order: nothing
    assert ms.epoch == 2


def test_changed_keys_of_the_same_address_are_an_update_not_a_leave_and_join() -> None:
    ms = Membership()
    ms.report("config", [m(1)])
    changes = ms.report("config", [m(1, role="decode", weight=2)])
    assert kinds(changes) == [("update", "127.0.0.1:1")]
    assert changes[0].cfg.role == "decode"


def test_a_terminating_endpoint_drains_and_an_address_listed_twice_belongs_to_the_first() -> None:
    ms = Membership()
    ms.report("config", [m(1)])
    assert kinds(ms.report("kubernetes:llm/vllm", [m(1, weight=3), m(2)])) == [
        ("join", "127.0.0.1:2")
    ]
    assert ms.source_of("127.0.0.1:1") == "config"  # shadowed, not taken over
    assert kinds(ms.report("kubernetes:llm/vllm", [m(1, weight=3), m(2, serving=False)])) == [
        ("drain", "127.0.0.1:2")
    ]
    assert not ms.serving("127.0.0.1:2")
    # the first source drops it: the second's entry takes over, as an update
    changes = ms.report("config", [])
    assert kinds(changes) == [("update", "127.0.0.1:1")]
    assert ms.source_of("127.0.0.1:1") == "kubernetes:llm/vllm"


def test_a_new_endpoint_that_is_already_terminating_joins_drained() -> None:
    ms = Membership()
    assert kinds(ms.report("k", [m(1, serving=False)])) == [
        ("join", "127.0.0.1:1"),
        ("drain", "127.0.0.1:1"),
    ]


def test_an_admin_drain_holds_whatever_the_source_says_until_resumed() -> None:
    ms = Membership()
    ms.report("dns:x", [m(1)])
    assert kinds(ms.drain("127.0.0.1:1")) == [("drain", "127.0.0.1:1")]
    assert ms.report("dns:x", [m(1)]) == []  # still listed: still drained
    assert kinds(ms.resume("127.0.0.1:1")) == [("resume", "127.0.0.1:1")]
    assert ms.drain("127.0.0.1:9") == []  # not in the fleet: nothing to drain


def test_an_empty_report_is_a_real_empty_fleet_and_silence_keeps_the_last() -> None:
    # A failing source reports nothing at all (the fleet is kept); an empty set is a source
    # saying its fleet is empty now (scaled to zero).
    ms = Membership()
    ms.report("dns:x", [m(1)])
    assert ms.members().keys() == {"127.0.0.1:1"}
    assert kinds(ms.report("dns:x", [])) == [("leave", "127.0.0.1:1")]


def test_an_engine_counter_that_went_back_means_a_new_engine_at_the_address() -> None:
    from proxy.upstream.backends import counters_reset

    assert counters_reset({"prefix_queries": 900.0}, {"prefix_queries": 40.0}) == "prefix_queries"
    assert counters_reset({"prefix_queries": 40.0}, {"prefix_queries": 41.0}) is None
    assert counters_reset({}, {"prefix_queries": 1.0}) is None  # first scrape


async def test_a_changed_model_list_marks_the_backend_restarted() -> None:
    import httpx

    from proxy.config import load_config
    from proxy.upstream.backends import BackendRegistry

    served = ["llama-8b"]

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": m} for m in served]})
        return httpx.Response(200)

    cfg = load_config(flags={"backends": ["http://127.0.0.1:1#engine=vllm"]}, env={})
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        registry = BackendRegistry(cfg, http)
        restarts: list[tuple[str, str]] = []
        registry.on_restart = lambda b, why: restarts.append((b.name, why))
        b = registry["127.0.0.1:1"]
        await registry._check(b, discover=True)
        assert restarts == [] and b.models == {"llama-8b"}
        served[:] = ["qwen-7b"]  # another engine took the address
        await registry._check(b, discover=True)
        assert restarts == [("127.0.0.1:1", "its model list changed")]


async def test_lora_adapters_loaded_and_unloaded_are_not_a_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM lists an adapter as a model whose `parent` is the base; loading one at run time
    (load_lora_adapter, a LoRA resolver) keeps the engine and its cache."""
    import logging

    import httpx

    from proxy.config import load_config
    from proxy.upstream.backends import BackendRegistry

    base = {"id": "llama-8b", "parent": None}
    served = [base]

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": served})
        return httpx.Response(200)

    cfg = load_config(flags={"backends": ["http://127.0.0.1:1#engine=vllm"]}, env={})
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        registry = BackendRegistry(cfg, http)
        restarts: list[str] = []
        registry.on_restart = lambda b, why: restarts.append(why)
        b = registry["127.0.0.1:1"]
        await registry._check(b, discover=True)
        served.append({"id": "sql-lora", "parent": "llama-8b", "root": "/a/sql"})
        with caplog.at_level(logging.INFO, logger="warmroute"):
            await registry._check(b, discover=True)
        assert restarts == [] and b.models == {"llama-8b", "sql-lora"}
        assert b.adapters == {"sql-lora": "llama-8b"}
        assert "LoRA adapters loaded: sql-lora" in caplog.text
        assert {"id": "sql-lora", "object": "model", "created": 0, "owned_by": "warmroute",
                "parent": "llama-8b"} in registry.model_list()  # fmt: skip
        served[1:] = []  # unloaded
        await registry._check(b, discover=True)
        assert restarts == [] and b.models == {"llama-8b"} and b.adapters == {}
        # Another base model at the address is a new engine, adapters or not.
        served[:] = [{"id": "qwen-7b", "parent": None}, {"id": "x", "parent": "qwen-7b"}]
        await registry._check(b, discover=True)
        assert restarts == ["its model list changed"]
