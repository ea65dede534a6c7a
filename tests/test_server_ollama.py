"""Ollama's API on `localllm serve`, driven by the official `ollama` client on a real model:
tags, show, chat and generate (streamed and not), ps, version, and Ollama's error shape."""

from __future__ import annotations

import json

import httpx
import numpy as np
import ollama
import pytest
from live_server import N_CTX, running_server
from real_models import model_path

from localllm.generate import generate
from localllm.models import load_model
from localllm.prompt import chat_prompt_ids

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
HELLO = [{"role": "user", "content": "Say hello."}]
TOO_LONG = [{"role": "user", "content": "x " * 2000}]
GREEDY = {"temperature": 0, "repeat_penalty": 1.0, "num_predict": 12}


@pytest.fixture(scope="module")
def server():
    with running_server(parallel=2, max_queue=4) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server, timeout=120)


@pytest.fixture(scope="module")
def expected() -> str:
    """What greedy decoding of HELLO gives, run here without the server."""
    model = load_model(model_path("smollm2-135m"), n_ctx=N_CTX, device="cpu")
    try:
        ids = chat_prompt_ids(model, HELLO)
        return generate(model, ids, max_tokens=GREEDY["num_predict"])
    finally:
        model.close()


def test_tags_and_show(client):
    models = client.list().models
    assert [m.model for m in models] == [MODEL_ID]
    assert models[0].details.family == "llama" and models[0].details.quantization_level == "Q4_1"
    assert models[0].size > 90_000_000
    shown = client.show(MODEL_ID)
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 8192
    assert "completion" in shown.capabilities and shown.template
    assert shown.details.parameter_size.endswith("M")


def test_chat_not_streamed_is_the_greedy_reply(client, expected):
    reply = client.chat(MODEL_ID, messages=HELLO, options=GREEDY, stream=False)
    assert reply.message.role == "assistant" and reply.message.content == expected
    assert reply.done and reply.done_reason == "length"
    assert reply.eval_count == GREEDY["num_predict"] and reply.prompt_eval_count > 5
    assert reply.total_duration >= reply.eval_duration > 0


def test_chat_streamed_gives_the_same_text(client, expected):
    parts = list(client.chat(MODEL_ID, messages=HELLO, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == expected
    assert parts[-1].done_reason == "length"


def test_generate_with_and_without_the_template(client, expected):
    reply = client.generate(MODEL_ID, prompt="Say hello.", options=GREEDY, stream=False)
    assert reply.response == expected  # the prompt goes through the chat template
    streamed = list(client.generate(MODEL_ID, prompt="Say hello.", options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == expected
    raw = client.generate(MODEL_ID, prompt="Once upon a time", raw=True, options=GREEDY)
    assert raw.response and raw.response != expected
    stop = client.generate(MODEL_ID, prompt="Say hello.", options={**GREEDY, "stop": ["!"]})
    assert "!" not in stop.response and stop.done_reason == "stop"


def test_ps_version_and_unload(client):
    client.generate(MODEL_ID, prompt="Hi", options={**GREEDY, "num_predict": 1})
    assert [m.model for m in client.ps().models] == [MODEL_ID]
    assert client._client.get("/api/version").json()["version"]
    unloaded = client.generate(MODEL_ID, keep_alive=0)
    assert unloaded.done_reason == "unload"


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "not valid JSON"),
        ([1, 2], 400, "JSON object"),
        ({"model": "no-such-model", "messages": HELLO}, 404, "not found"),
        ({"model": MODEL_ID, "messages": "hi"}, 400, "messages must be a list"),
        ({"model": MODEL_ID, "messages": HELLO, "options": {"temperature": "hot"}}, 400, "number"),
        ({"model": MODEL_ID, "messages": HELLO, "stream": "yes"}, 400, "true or false"),
        ({"model": MODEL_ID, "messages": HELLO, "format": "yaml"}, 400, "format must be"),
        ({"model": MODEL_ID, "messages": HELLO, "format": {"type": "nope"}}, 400, "cannot be used"),
        ({"model": MODEL_ID, "messages": HELLO, "tools": [{"type": "function"}]}, 400, "tools"),
        ({"model": MODEL_ID, "messages": TOO_LONG}, 400, "context"),
    ],
)
def test_bad_chat_requests_get_ollamas_error_shape(server, body, status, message):
    content = body if isinstance(body, bytes) else json.dumps(body)
    response = httpx.post(f"{server}/api/chat", content=content, timeout=60)
    assert response.status_code == status, response.text
    assert list(response.json()) == ["error"] and message in response.json()["error"]


def test_the_client_raises_ollamas_errors(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat("no-such-model", messages=HELLO)
    assert e.value.status_code == 404


def test_embed_gives_unit_vectors_of_the_last_token_state(server, client):
    from localllm.embeddings import embed_texts

    result = client.embed(MODEL_ID, input=["Hello there", "The sky is blue."])
    vectors = np.array(result.embeddings)
    assert vectors.shape == (2, 576)  # SmolLM2-135M's embedding length
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    assert abs(float(vectors[0] @ vectors[1])) < 0.999  # two texts, two directions
    model = load_model(model_path("smollm2-135m"), n_ctx=N_CTX, device="cpu")
    try:
        local, n_tokens = embed_texts(model, ["Hello there", "The sky is blue."])
    finally:
        model.close()
    np.testing.assert_allclose(vectors, np.array(local), atol=1e-5)
    assert result.prompt_eval_count == n_tokens
    body = {"model": MODEL_ID, "prompt": "Hello there"}
    legacy = httpx.post(f"{server}/api/embeddings", json=body)
    np.testing.assert_allclose(legacy.json()["embedding"], vectors[0], atol=1e-6)
    # OpenAI's shape, the same vectors
    import openai

    openai_client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    answer = openai_client.embeddings.create(model=MODEL_ID, input=["Hello there"])
    np.testing.assert_allclose(answer.data[0].embedding, vectors[0], atol=1e-6)
    assert answer.usage.prompt_tokens > 0


def test_bad_embed_requests(server):
    for body, status in [
        ({"model": "no-such-model", "input": "x"}, 404),
        ({"model": MODEL_ID, "input": 5}, 400),
        ({"model": MODEL_ID, "input": []}, 400),
    ]:
        response = httpx.post(f"{server}/api/embed", json=body, timeout=60)
        assert response.status_code == status and list(response.json()) == ["error"]
    response = httpx.post(f"{server}/v1/embeddings", json={"model": MODEL_ID, "input": [1, 2]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"


def test_pull_streams_progress_and_delete_removes(client, monkeypatch):
    from fake_hub import DATA, FILE, REPO, FakeHub

    from localllm.store import Store

    hub = FakeHub()
    hub.files[f"{REPO}/{FILE}"] = DATA
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    try:
        name = f"hf.co/{REPO}:Q4_K_M"
        updates = list(client.pull(name, stream=True))
        assert updates[0].status.startswith("pulling") and updates[-1].status == "success"
        downloads = [u for u in updates if u.status == "downloading"]
        assert downloads and downloads[-1].completed == downloads[-1].total == len(DATA)
        assert Store().resolve(name) is not None
        client.delete(name)
        assert Store().resolve(name) is None
        with pytest.raises(ollama.ResponseError) as e:
            client.delete(name)
        assert e.value.status_code == 404
        with pytest.raises(ollama.ResponseError, match="not found"):
            client.pull(f"hf.co/{REPO}-missing:Q4_K_M")
    finally:
        hub.server.shutdown()
        hub.server.server_close()
