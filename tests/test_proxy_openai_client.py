"""Through the proxy, the official openai client sees exactly what it sees directly."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.e2e


def _clients(url: str) -> tuple[openai.OpenAI, openai.AsyncOpenAI]:
    return (
        openai.OpenAI(base_url=url + "/v1", api_key="client-key", max_retries=0),
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="client-key", max_retries=0),
    )


MSG = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello chunks:7"}]


def test_sync_chat_and_completions_match_direct(fake_backends, proxy_server):
    [(_, backend)] = fake_backends(1)
    proxy = proxy_server([backend.url])
    direct, _ = _clients(backend.url)
    via, _ = _clients(proxy.url)
    for client_kwargs in ({}, {"stream": True}):
        d = direct.chat.completions.create(model="test-model", messages=MSG, **client_kwargs)
        v = via.chat.completions.create(model="test-model", messages=MSG, **client_kwargs)
        if client_kwargs:
            d_chunks = [ch.model_dump() for ch in d]
            v_chunks = [ch.model_dump() for ch in v]
            assert v_chunks == d_chunks
            assert "".join(
                c["choices"][0]["delta"]["content"] or "" for c in v_chunks if c["choices"]
            ) == "".join(
                f"{w}" for w in ["tok0 ", "tok1 ", "tok2 ", "tok3 ", "tok4 ", "tok5 ", "tok6 "]
            )
        else:
            assert v.model_dump() == d.model_dump()
    d = direct.completions.create(model="test-model", prompt="once chunks:4")
    v = via.completions.create(model="test-model", prompt="once chunks:4")
    assert v.model_dump() == d.model_dump()
    d_s = [
        c.model_dump()
        for c in direct.completions.create(model="test-model", prompt="once chunks:4", stream=True)
    ]
    v_s = [
        c.model_dump()
        for c in via.completions.create(model="test-model", prompt="once chunks:4", stream=True)
    ]
    assert v_s == d_s


async def test_async_client_streams_and_usage_when_asked(fake_backends, proxy_server):
    [(_, backend)] = fake_backends(1)
    proxy = proxy_server([backend.url])
    _, direct = _clients(backend.url)
    _, via = _clients(proxy.url)
    kwargs = {
        "model": "test-model",
        "messages": MSG,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    d = [c.model_dump() async for c in await direct.chat.completions.create(**kwargs)]
    v = [c.model_dump() async for c in await via.chat.completions.create(**kwargs)]
    assert v == d
    assert v[-1]["usage"]["completion_tokens"] == 7
    r = await via.chat.completions.create(model="test-model", messages=MSG)
    assert r.choices[0].message.content.startswith("tok0")
    await direct.close()
    await via.close()


def test_embeddings_and_models_pass_through(fake_backends, proxy_server):
    backends = fake_backends(2, models=("test-model", "embed-model"))
    proxy = proxy_server([s.url for _, s in backends])
    via, _ = _clients(proxy.url)
    e = via.embeddings.create(model="embed-model", input="hi")
    assert e.data[0].embedding == pytest.approx([0.1, 0.2, 0.3])
    ids = sorted(m.id for m in via.models.list())
    assert ids == ["embed-model", "test-model"]


def test_unknown_model_is_404_with_openai_error(fake_backends, proxy_server):
    [(_, backend)] = fake_backends(1)
    proxy = proxy_server([backend.url])
    via, _ = _clients(proxy.url)
    with pytest.raises(openai.NotFoundError) as err:
        via.chat.completions.create(model="gpt-nope", messages=MSG)
    assert err.value.body["code"] == "model_not_found"
    assert err.value.body["param"] == "model"
    assert "gpt-nope" in err.value.body["message"]


def test_usage_chunk_is_injected_upstream_and_stripped_when_client_did_not_ask(
    fake_backends, proxy_server
):
    import httpx

    [(backend_app, backend)] = fake_backends(1)
    proxy = proxy_server([backend.url])
    body = {"model": "test-model", "messages": MSG, "stream": True}
    direct = httpx.post(backend.url + "/v1/chat/completions", json=body).content
    via = httpx.post(proxy.url + "/v1/chat/completions", json=body).content
    assert via == direct  # byte-identical: the injected usage chunk was removed again
    sent = backend_app.rec.requests[-1]["body"]
    assert sent["stream_options"] == {"include_usage": True}
    assert b'"usage"' not in via
