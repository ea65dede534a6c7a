"""`localllm serve`: the live server on 127.0.0.1 driven by the official `openai` client.

The server runs uvicorn in a background thread on a free port with the real smollm2-135m model;
greedy answers are compared with what the library itself generates for the same prompt.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import math
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import greenlet
import httpx
import openai
import pytest
from live_server import N_CTX, running_server
from real_models import model_path

from localllm.batching import STEP_TOKENS, Batcher
from localllm.errors import LocalLLMError
from localllm.generate import generate
from localllm.models import load_model
from localllm.prompt import chat_prompt_ids, raw_prompt_ids
from localllm.server import create_app, exposure_warning, is_loopback, serve
from localllm.server_cors import CORSPolicy, cors_warning
from localllm.server_engine import Engine, EngineBusy, Generation
from localllm.server_ollama import keep_alive_seconds
from localllm.store import Store

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
KEY = "test-key"
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with running_server(api_key=KEY, parallel=4, max_queue=4) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local_model():
    """The same model, loaded in the test process, to say what the answers must be."""
    model = load_model(model_path("smollm2-135m"), n_ctx=N_CTX, device="cpu")
    yield model
    model.close()


def chat(client, messages=HELLO, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 16)
    return client.chat.completions.create(model=MODEL_ID, messages=messages, **kwargs)


def stream_chat(client, messages=HELLO, **kwargs) -> tuple[str, list]:
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 16)
    chunks = list(
        client.chat.completions.create(model=MODEL_ID, messages=messages, stream=True, **kwargs)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def post(url: str, body, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = body if isinstance(body, (bytes, str, Iterator)) else json.dumps(body)
    kwargs.setdefault("timeout", 60)
    return httpx.post(url, content=content, headers=headers, **kwargs)


def raw_post(url: str, length_header: str, body: bytes) -> tuple[int, dict]:
    """POST /v1/chat/completions over a bare socket; (status, error) of the answer. Lets a test
    send a body that the server refuses part-way without the client tripping over the close."""
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        f"{length_header}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    status_line, _, rest = answer.partition(b"\r\n")
    payload = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(payload)["error"]


def assert_envelope(response: httpx.Response, status: int, code=None, param=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


# -- the API through the official client ---------------------------------------------------


def test_models_list_and_retrieve(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_ID]
    assert models[0].model_extra["max_model_len"] == N_CTX
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID


def test_chat_matches_library_and_stream(client, local_model):
    ids = chat_prompt_ids(local_model, HELLO)
    expected = generate(local_model, ids, max_tokens=16, cache=local_model.transformer.new_cache())
    response = chat(client)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected
    assert choice.finish_reason == "length"
    assert response.object == "chat.completion" and response.model == MODEL_ID
    assert response.id.startswith("chatcmpl-")
    assert response.usage.prompt_tokens == len(ids)
    assert response.usage.completion_tokens == 16
    assert response.usage.total_tokens == len(ids) + 16

    text, chunks = stream_chat(client, stream_options={"include_usage": True})
    assert text == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == []
    # The same prompt again: the prefix cache held all of it but the last token (always run)
    streamed = chunks[-1].usage
    assert streamed.prompt_tokens_details.cached_tokens == len(ids) - 1
    assert streamed.model_dump(exclude={"prompt_tokens_details"}) == response.usage.model_dump(
        exclude={"prompt_tokens_details"}
    )


def test_stream_ends_with_done(server):
    with httpx.stream(
        "POST",
        f"{server}/v1/chat/completions",
        json={"model": MODEL_ID, "messages": HELLO, "max_tokens": 4, "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert "usage" not in json.loads(events[-2][6:])  # only with stream_options.include_usage


def test_text_parts_and_developer_role(client):
    plain = chat(client, [{"role": "system", "content": "Be brief."}, *HELLO]).choices[0]
    parts = chat(
        client,
        [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "Say hello."}]},
        ],
    ).choices[0]
    assert parts.message.content == plain.message.content


def test_stop_string(client):
    full = chat(client).choices[0].message.content
    words = full.split(" ")
    assert len(words) > 3, full
    stop = " " + words[2]
    response = chat(client, stop=[stop, "never-appears"])
    assert response.choices[0].message.content == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"
    text, _ = stream_chat(client, stop=stop)
    assert text == full[: full.index(stop)]


def test_logprobs(client):
    response = chat(client, max_tokens=8, logprobs=True, top_logprobs=3)
    choice = response.choices[0]
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens == 8
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == 3
        top = [alt.logprob for alt in t.top_logprobs]
        assert top == sorted(top, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
    assert chat(client, max_tokens=2).choices[0].logprobs is None
    # Streamed logprobs are the same entries, spread over the chunks.
    _, chunks = stream_chat(client, max_tokens=8, logprobs=True, top_logprobs=3)
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


def test_completions(client, local_model):
    prompt = "The capital of France is"
    ids = raw_prompt_ids(local_model, prompt)
    expected = generate(local_model, ids, max_tokens=8, cache=local_model.transformer.new_cache())
    response = client.completions.create(
        model=MODEL_ID, prompt=prompt, temperature=0, max_tokens=8, logprobs=2
    )
    choice = response.choices[0]
    assert response.object == "text_completion" and choice.text == expected
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == 8
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == 8
    assert all(len(alternatives) == 2 for alternatives in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset[0] == 0
    # The same prompt as token ids, and streamed.
    by_ids = client.completions.create(model=MODEL_ID, prompt=ids, temperature=0, max_tokens=8)
    assert by_ids.choices[0].text == expected
    stream = client.completions.create(
        model=MODEL_ID, prompt=prompt, temperature=0, max_tokens=8, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected
    # Legacy completions default to 16 tokens, as OpenAI's and vLLM's do.
    default = client.completions.create(model=MODEL_ID, prompt=prompt, temperature=0)
    assert default.usage.completion_tokens == 16


def test_max_completion_tokens(client):
    assert chat(client, max_completion_tokens=3).usage.completion_tokens == 3
    # The newer name wins over max_tokens, as in OpenAI's API.
    assert chat(client, max_tokens=6, max_completion_tokens=2).usage.completion_tokens == 2


def test_seed_makes_sampling_reproducible(client):
    a = chat(client, temperature=1.0, seed=1234, max_tokens=12).choices[0].message.content
    b = chat(client, temperature=1.0, seed=1234, max_tokens=12).choices[0].message.content
    assert a == b


def test_concurrent_requests_match_sequential(server, client):
    prompts = [
        "Say hello.",
        "Name a colour.",
        "What is two plus two?",
        "Write one word about the sea.",
    ]

    def ask(text: str) -> str:
        messages = [{"role": "user", "content": text}]
        return chat(client, messages, max_tokens=12).choices[0].message.content

    alone = [ask(p) for p in prompts]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = ask(prompts[i])
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    most_active = 0
    while any(t.is_alive() for t in threads):
        most_active = max(most_active, httpx.get(f"{server}/health").json()["active"])
        time.sleep(0.01)
    assert not errors, errors
    assert [results[i] for i in range(len(prompts))] == alone
    assert most_active >= 2  # they really ran at the same time, interleaved


# -- errors --------------------------------------------------------------------------------


def test_bad_requests_get_openai_errors(server, client):
    url = f"{server}/v1/chat/completions"
    good = {"model": MODEL_ID, "messages": HELLO, "max_tokens": 2, "temperature": 0}
    assert_envelope(post(url, b'{"model": "x", "messages": ['), 400)
    assert_envelope(post(url, {**good, "max_tokens": -5}), 400, param="max_tokens")
    assert_envelope(post(url, {**good, "n": 0}), 400, param="n")
    assert_envelope(post(url, {**good, "n": 17}), 400, param="n")
    assert_envelope(post(url, {"model": MODEL_ID}), 400, param="messages")
    assert_envelope(post(url, {**good, "temperature": 3}), 400, param="temperature")
    assert_envelope(post(url, [1, 2]), 400)
    assert_envelope(post(url, json.dumps(good), headers={"Content-Type": "text/plain"}), 400)
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    assert_envelope(
        post(url, {**good, "messages": [{"role": "user", "content": [image]}]}),
        400,
        param="messages[0].content[0]",
    )
    assert_envelope(post(url, {**good, "model": "no-such-model"}), 404, code="model_not_found")
    assert_envelope(post(url, {**good, "model": "../../etc/passwd.gguf"}), 404)
    assert_envelope(post(f"{server}/v1/nothing", good), 404)
    assert post(url, {**good, "padding": "x" * (64 << 10)}).status_code == 200  # under the cap
    # Over the 4 MiB cap: refused on the declared length, before any of it is read...
    status, error = raw_post(server, f"Content-Length: {5 << 20}", b"")
    assert (status, error["code"]) == (413, "request_too_large")
    # ...or, without a length (chunked), as soon as the bytes read pass the cap.
    over = (4 << 20) + 1
    status, error = raw_post(server, "Transfer-Encoding: chunked", b"%x\r\n" % over + b"x" * over)
    assert status == 413 and error["message"]
    assert_envelope(post(url, good, key="wrong"), 401, code="invalid_api_key")
    assert_envelope(post(url, good, key=None), 401, code="invalid_api_key")

    # The official client maps them to its exception types.
    with pytest.raises(openai.BadRequestError):
        chat(client, n=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HELLO)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()

    # ...and the server keeps serving.
    assert post(url, good).status_code == 200
    assert httpx.get(f"{server}/health").json() == {"status": "ok", "active": 0, "waiting": 0}


def test_context_overflow_is_an_error_not_a_truncation(server, client, local_model):
    url = f"{server}/v1/chat/completions"
    long_text = "the quick brown fox jumps over the lazy dog " * 80
    long_messages = [{"role": "user", "content": long_text}]
    assert len(chat_prompt_ids(local_model, long_messages)) > N_CTX
    error = assert_envelope(
        post(url, {"model": MODEL_ID, "messages": long_messages}),
        400,
        code="context_length_exceeded",
    )
    assert str(N_CTX) in error["message"]
    # A short prompt asking for more tokens than the context leaves is refused the same way.
    assert_envelope(
        post(url, {"model": MODEL_ID, "messages": HELLO, "max_tokens": N_CTX}),
        400,
        code="context_length_exceeded",
    )
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL_ID, prompt=long_text, max_tokens=4)
    assert raised.value.code == "context_length_exceeded"
    assert chat(client, max_tokens=2).choices[0].message.content


def test_host_and_origin_checks(server):
    url = f"{server}/v1/models"
    auth = {"Authorization": f"Bearer {KEY}"}
    for host in ["localhost:8357", "127.0.0.1", "[::1]:80", "LOCALHOST"]:
        assert httpx.get(url, headers={**auth, "Host": host}).status_code == 200, host
    for host in ["evil.example", "evil.example:8357", "127.0.0.1.evil.example", "localhost.:1"]:
        response = httpx.get(url, headers={**auth, "Host": host})
        assert_envelope(response, 403, code="invalid_host")
    origin = {**auth, "Origin": "http://localhost:3000"}
    assert httpx.get(url, headers=origin).status_code == 200
    for bad in ["http://evil.example", "null"]:
        response = httpx.get(url, headers={**auth, "Origin": bad})
        assert_envelope(response, 403, code="invalid_origin")
    # /health needs no key, but the Host check still applies.
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.get(f"{server}/health", headers={"Host": "evil.example"}).status_code == 403


def test_disconnect_cancels_and_queue_limit(monkeypatch):
    # Counting goes on until max_tokens: the request would run for a long time.
    body = {"model": MODEL_ID, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 400, "temperature": 0}
    steps = count_engine_steps(monkeypatch)
    with running_server(parallel=1, max_queue=0) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        completions = f"{url}/v1/completions"
        with httpx.stream("POST", completions, json={**body, "stream": True}, timeout=60) as r:
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            for _ in range(2):
                assert json.loads(next(events)[6:])["choices"][0]["finish_reason"] is None
            assert httpx.get(f"{url}/health").json()["active"] == 1
            # The one slot is taken and nothing may queue: 503, in the envelope.
            busy = post(completions, body, key=None)
            assert_envelope(busy, 503, code="server_busy")
            assert busy.headers["retry-after"] == "1"
        # The client hung up mid-stream: the sequence is dropped, not run to max_tokens.
        wait_until_idle(url)
        assert max(steps.values()) < body["max_tokens"], steps
        # ... and its slot is free again: with max_queue=0 a busy slot would answer 503.
        assert chat(client, max_tokens=4).usage.completion_tokens == 4

        # A non-streaming request whose client gives up is cancelled too.
        steps.clear()
        with pytest.raises(httpx.TimeoutException):
            post(completions, body, key=None, timeout=1.0)
        wait_until_idle(url)
        assert max(steps.values()) < body["max_tokens"], steps


def count_engine_steps(monkeypatch) -> collections.Counter:
    """How many model calls the engine runs for each sequence: one per generated token, so a
    cancelled sequence shows fewer than its max_tokens."""
    steps: collections.Counter = collections.Counter()
    forward = Batcher.forward

    def counted(self, *args):
        steps[greenlet.getcurrent().seq] += 1
        return forward(self, *args)

    monkeypatch.setattr(Batcher, "forward", counted)
    return steps


def wait_until_idle(url: str, limit: float = 60.0) -> None:  # the limit only guards a hang
    deadline = time.monotonic() + limit
    while httpx.get(f"{url}/health").json() != {"status": "ok", "active": 0, "waiting": 0}:
        assert time.monotonic() < deadline, "the cancelled sequence is still running"
        time.sleep(0.02)


def test_models_from_the_store():
    Store().register_file(model_path("smollm2-135m"))
    name = Store().list()[0].name
    with running_server(models=[]) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [name]
        response = client.chat.completions.create(model=name, messages=HELLO, max_tokens=2)
        assert response.model == name
        # A request never names a file: a path is just an unknown model.
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model=str(model_path("smollm2-135m")), messages=HELLO, max_tokens=2
            )


# -- pieces without the model --------------------------------------------------------------


def test_unknown_model_at_startup_and_busy_port():
    with pytest.raises(LocalLLMError, match="not installed"):
        create_app(["no-such-model"])
    with pytest.raises(LocalLLMError, match="not found"):
        create_app(["missing/file.gguf"])
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(LocalLLMError, match="cannot listen"):
            serve([str(model_path("smollm2-135m"))], port=taken.getsockname()[1])
    finally:
        taken.close()


def test_exposure_warning():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2")
    assert exposure_warning("127.0.0.1", 8357, None) is None
    assert exposure_warning("0.0.0.0", 8357, "key") is None
    assert "WARNING" in exposure_warning("0.0.0.0", 8357, None)


def test_engine_interleaves_and_cancels():
    """Round-robin: each sequence advances one step per round; cancelling stops it."""

    async def main():
        engine = Engine(parallel=2, max_queue=1)
        log: list[tuple[str, int]] = []

        def steps(name: str, n: int):
            for i in range(n):
                time.sleep(0.001)  # a model step takes time
                log.append((name, i))
                yield i

        gate, held = threading.Event(), threading.Event()

        def hold():
            held.set()
            gate.wait()

        # Hold the engine until all are queued, and queue them only once it holds: had its first
        # pass looked for sequences after a was queued but before b, a would run a step alone.
        engine.call(hold)
        assert held.wait(10)
        a = Generation(engine, lambda: steps("a", 3))
        b = Generation(engine, lambda: steps("b", 3))
        c = Generation(engine, lambda: steps("c", 1000))  # waits: parallel is 2
        with pytest.raises(EngineBusy):
            Generation(engine, lambda: steps("d", 1))
        gate.set()
        assert [x async for x in a] == [0, 1, 2]
        assert [x async for x in b] == [0, 1, 2]
        assert log[:4] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
        assert await c.__anext__() == 0
        c.cancel()
        n_at_cancel = len([x for x in log if x[0] == "c"])
        for _ in range(100):
            if engine.stats() == {"active": 0, "waiting": 0}:
                break
            await asyncio.sleep(0.01)
        assert engine.stats() == {"active": 0, "waiting": 0}
        # At most the step already running when the flag was set.
        assert len([x for x in log if x[0] == "c"]) <= n_at_cancel + 1

        def failing():
            yield 1
            raise LocalLLMError("boom")

        f = Generation(engine, failing)
        assert await f.__anext__() == 1
        with pytest.raises(LocalLLMError, match="boom"):
            await f.__anext__()
        engine.stop()

    asyncio.run(main())


def test_a_client_that_leaves_stops_a_long_prefill():
    """The prefill of a long prompt stops within a chunk once its client disconnects, instead
    of running to its end while the engine serves nobody else (counted in chunks, not time)."""
    with running_server(n_ctx=2048, parallel=1) as (url, app):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        chat(client, max_tokens=1)  # loads the model
        model = app.state.localllm.pool._loaded[MODEL_ID]
        transformer = model.transformer
        started, long_chunks = threading.Event(), []
        run_chunk = transformer._forward_chunk

        def counted(token_ids, *args):
            if len(token_ids) == STEP_TOKENS:  # a chunk of the long prompt (one pass's worth)
                long_chunks.append(1)
                started.set()
            return run_chunk(token_ids, *args)

        transformer._forward_chunk = counted
        prompt = "the quick brown fox jumps over the lazy dog " * 200
        n_chunks = len(model.tokenizer.encode(prompt)) // STEP_TOKENS  # 28
        body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 5, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60):
            assert started.wait(60)
        # With one slot, this waits until the engine has let go of the cancelled prefill.
        assert chat(client, max_tokens=1).usage.completion_tokens == 1
        transformer._forward_chunk = run_chunk
        assert 1 <= len(long_chunks) < n_chunks // 2, (len(long_chunks), n_chunks)


# -- Ollama's /api/ps and unloading (`localllm ps`, `localllm stop`) ----------------------


def loaded(url: str) -> list[dict]:
    """GET /api/ps: the models the server has loaded now."""
    response = httpx.get(f"{url}/api/ps", timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["models"]


def unload(url: str, name: str, **body) -> httpx.Response:
    """Ollama's unload request: POST /api/generate with keep_alive 0 and no prompt."""
    return post(f"{url}/api/generate", {"model": name, "keep_alive": 0, **body}, key=None)


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def wait_for(condition, what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit  # only against hangs
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def maps(path: Path) -> bool:
    """Whether this process has `path` memory-mapped (Linux)."""
    return str(path) in Path("/proc/self/maps").read_text()


def test_ps_lists_loaded_models_and_keep_alive_0_unloads(tmp_path, local_model):
    # A copy of the model: the test process's own `local_model` maps the original.
    path = tmp_path / "smol-copy.gguf"
    shutil.copy(model_path("smollm2-135m"), path)
    with running_server(models=[str(path)]) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert loaded(url) == []  # models load on first use
        client.chat.completions.create(model="smol-copy", messages=HELLO, max_tokens=2)
        [entry] = loaded(url)
        assert entry == {
            "name": "smol-copy",
            "model": "smol-copy",
            # The file and the KV cache of one full context.
            "size": path.stat().st_size + local_model.transformer.cache.nbytes,
            "digest": hashlib.sha256(path.read_bytes()).hexdigest(),
            "details": {
                "parent_model": "",
                "format": "gguf",
                "family": "llama",
                "families": ["llama"],
                "parameter_size": "134.52M",
                "quantization_level": "Q4_1",
            },
            "expires_at": entry["expires_at"],
            "size_vram": 0,
            "context_length": N_CTX,
        }
        # Kept loaded for the default keep-alive after the request: Ollama's 5 minutes.
        left = parse_time(entry["expires_at"]) - datetime.now(timezone.utc)
        assert timedelta(minutes=4) < left <= timedelta(minutes=5)
        on_linux = Path("/proc/self/maps").exists()
        assert maps(path) or not on_linux

        response = unload(url, "smol-copy")
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer == {
            "model": "smol-copy",
            "created_at": answer["created_at"],
            "response": "",
            "done": True,
            "done_reason": "unload",
        }
        assert abs(parse_time(answer["created_at"]) - datetime.now(timezone.utc)) < timedelta(1)
        assert loaded(url) == []
        if on_linux:  # the weights are really let go of
            wait_for(lambda: not maps(path), "the unloaded model is still mapped")

        # The next request loads it again; unloading a model that is not loaded is no error.
        client.chat.completions.create(model="smol-copy", messages=HELLO, max_tokens=2)
        assert [m["name"] for m in loaded(url)] == ["smol-copy"]
        assert unload(url, "smol-copy").status_code == 200
        assert unload(url, "smol-copy", keep_alive="0s").status_code == 200
        assert loaded(url) == []


def test_keep_alive_durations():
    assert keep_alive_seconds(None) is None
    assert keep_alive_seconds(0) == keep_alive_seconds("0") == keep_alive_seconds("0s") == 0
    assert keep_alive_seconds("0h0m0s") == 0
    assert keep_alive_seconds("5m") == keep_alive_seconds(300) == keep_alive_seconds("300") == 300
    assert keep_alive_seconds("1h30m") == 5400
    assert keep_alive_seconds("1.5s") == 1.5
    assert keep_alive_seconds(-1) == keep_alive_seconds("-1m") == math.inf
    for bad in ("abc", "5 minutes", "", True, [1], "m"):
        with pytest.raises(ValueError):
            keep_alive_seconds(bad)


def test_models_unload_after_their_keep_alive():
    api = "/api/generate"
    body = {"model": MODEL_ID, "prompt": "Hi", "options": {"num_predict": 1}, "stream": False}
    with running_server(keep_alive=1.0) as (url, _):  # the server's own keep-alive: 1 s
        assert post(url + api, body, key=None).status_code == 200
        [entry] = loaded(url)
        assert parse_time(entry["expires_at"]) <= datetime.now(timezone.utc) + timedelta(seconds=1)
        wait_for(lambda: loaded(url) == [], "the idle model outlived its keep-alive")
        # A request's own keep_alive wins: -1 keeps it loaded ("Forever")...
        assert post(url + api, {**body, "keep_alive": -1}, key=None).status_code == 200
        time.sleep(2.5)
        [entry] = loaded(url)
        assert parse_time(entry["expires_at"]) > datetime.now(timezone.utc) + timedelta(days=7300)
        # ...a duration counts from the end of the request, and 0 unloads as the answer ends.
        assert post(url + api, {**body, "keep_alive": "1m"}, key=None).status_code == 200
        left = parse_time(loaded(url)[0]["expires_at"]) - datetime.now(timezone.utc)
        assert timedelta(seconds=50) < left <= timedelta(minutes=1)
        assert post(url + api, {**body, "keep_alive": 0}, key=None).status_code == 200
        wait_for(lambda: loaded(url) == [], "keep_alive 0 did not unload the model")
        # A load request (no prompt) keeps the model as long as it asks.
        assert post(url + api, {"model": MODEL_ID, "keep_alive": "10m"}, key=None).json()["done"]
        left = parse_time(loaded(url)[0]["expires_at"]) - datetime.now(timezone.utc)
        assert timedelta(minutes=9) < left <= timedelta(minutes=10)
        bad = post(url + api, {**body, "keep_alive": "soon"}, key=None)
        assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]


def test_unload_waits_for_the_requests_running_on_the_model(local_model):
    prompt = "1, 2, 3, 4, 5,"
    ids = raw_prompt_ids(local_model, prompt)
    expected = generate(local_model, ids, max_tokens=120, cache=local_model.transformer.new_cache())
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 120, "temperature": 0}
    with running_server() as (url, _):
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            events = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
            texts = [json.loads(next(events))["choices"][0]["text"]]
            # Asked while the request runs (120 tokens take far longer than these two calls):
            # answered at once, and the model stays until the request ends, shown as stopping.
            assert unload(url, MODEL_ID).json()["done_reason"] == "unload"
            [entry] = loaded(url)
            assert parse_time(entry["expires_at"]) <= datetime.now(timezone.utc)
            rest = list(events)
        assert rest[-1] == "[DONE]"
        chunks = [json.loads(event) for event in rest[:-1]]
        assert not any("error" in chunk for chunk in chunks)
        texts += [c["choices"][0]["text"] for c in chunks if c["choices"]]
        assert "".join(texts) == expected  # the request ran to its end, undisturbed
        wait_for(lambda: loaded(url) == [], "the model was not unloaded after its request")
        # A request after the unload loads the model again.
        assert post(f"{url}/v1/completions", {**body, "max_tokens": 2}, key=None).status_code == 200
        assert [m["name"] for m in loaded(url)] == [MODEL_ID]


def test_api_generate_of_an_unknown_model_is_404(server):
    response = post(f"{server}/api/generate", {"model": "no-such-model", "keep_alive": 0})
    assert (response.status_code, response.json()) == (
        404,
        {"error": "model 'no-such-model' not found"},
    )


# -- CORS -----------------------------------------------------------------------------------

APP_ORIGIN = "http://app.example:5173"  # not local: only a listed origin gets through


def preflight(url: str, origin: str, **headers) -> httpx.Response:
    headers = {"Origin": origin, "Access-Control-Request-Method": "POST", **headers}
    return httpx.options(url, headers=headers)


def test_without_cors_options_is_answered_and_no_origin_is_allowed(server):
    chat_url = f"{server}/v1/chat/completions"
    response = httpx.options(chat_url)  # no key needed: OPTIONS reveals nothing
    assert response.status_code == 204 and response.headers["allow"] == "OPTIONS, POST"
    assert httpx.options(f"{server}/v1/models").headers["allow"] == "GET, OPTIONS"
    assert_envelope(httpx.options(f"{server}/v1/nothing"), 404)
    for origin in ["http://localhost:3000", "http://evil.example"]:
        response = preflight(chat_url, origin)
        assert_envelope(response, 403, code="invalid_origin")
        assert "access-control-allow-origin" not in response.headers
    auth = {"Authorization": f"Bearer {KEY}", "Origin": "http://localhost:3000"}
    response = httpx.get(f"{server}/v1/models", headers=auth)
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


def test_cors_for_listed_origins():
    with running_server(api_key=KEY, cors_origins=[APP_ORIGIN, "http://localhost:*"]) as (url, app):
        chat_url = f"{url}/v1/chat/completions"
        asked = "authorization, content-type, x-stainless-os, x-stainless-retry-count"
        response = preflight(
            chat_url,
            APP_ORIGIN,
            **{
                "Access-Control-Request-Headers": asked,
                "Access-Control-Request-Private-Network": "true",
            },
        )
        assert response.status_code == 204, response.text
        assert response.headers["access-control-allow-origin"] == APP_ORIGIN
        assert "POST" in response.headers["access-control-allow-methods"]
        allowed = response.headers["access-control-allow-headers"].lower().split(", ")
        assert set(asked.split(", ")) <= set(allowed)
        assert int(response.headers["access-control-max-age"]) > 0
        assert response.headers["access-control-allow-private-network"] == "true"
        assert "origin" in response.headers["vary"].lower()
        # A pattern, as OLLAMA_ORIGINS takes them.
        response = preflight(f"{url}/v1/models", "http://localhost:3000")
        assert response.headers["access-control-allow-origin"] == "http://localhost:3000"
        # An unlisted origin is refused, as without CORS.
        for request in (
            preflight(chat_url, "http://evil.example"),
            post(chat_url, {}, headers={"Origin": "http://evil.example"}),
        ):
            assert_envelope(request, 403, code="invalid_origin")
            assert "access-control-allow-origin" not in request.headers

        # Every answer to a listed origin says so: JSON, errors, streams.
        origin = {"Origin": APP_ORIGIN}
        good = {"model": MODEL_ID, "messages": HELLO, "max_tokens": 2}
        answers = [
            httpx.get(f"{url}/v1/models", headers={**origin, "Authorization": f"Bearer {KEY}"}),
            httpx.get(f"{url}/v1/models", headers=origin),  # 401
            post(chat_url, {**good, "model": "nope"}, headers=origin),  # 404
            post(chat_url, {**good, "n": 0}, headers=origin),  # 400
            post(f"{url}/api/generate", {"model": MODEL_ID, "prompt": 5}, headers=origin),  # 400
        ]
        assert [a.status_code for a in answers] == [200, 401, 404, 400, 400]
        for answer in answers:
            assert answer.headers["access-control-allow-origin"] == APP_ORIGIN
        with httpx.stream(
            "POST",
            chat_url,
            json={**good, "stream": True},
            headers={**origin, "Authorization": f"Bearer {KEY}"},
            timeout=60,
        ) as stream:
            assert stream.headers["access-control-allow-origin"] == APP_ORIGIN
            assert list(stream.iter_lines())[-2] == "data: [DONE]"

        # An unexpected error is answered outside the middleware; it says so too.
        def broken():
            raise RuntimeError("boom")

        app.state.localllm.engine.stats = broken
        response = httpx.get(f"{url}/health", headers=origin)
        assert_envelope(response, 500)
        assert response.headers["access-control-allow-origin"] == APP_ORIGIN


def test_cors_origins_are_checked():
    for bad in ["localhost:3000", "http://app.example/path", "http://", "file"]:
        with pytest.raises(LocalLLMError, match="not an origin"):
            create_app([str(model_path("smollm2-135m"))], cors_origins=[bad])
    policy = CORSPolicy(["HTTP://App.Example:5173/", "http://[::1]:3000", "https://*.example.org"])
    assert policy.origins == [
        "http://app.example:5173",
        "http://[::1]:3000",
        "https://*.example.org",
    ]
    assert policy.allows("http://app.example:5173") and policy.allows("http://[::1]:3000")
    assert policy.allows("https://a.b.example.org")
    for other in [
        None,
        "",
        "http://app.example",
        "http://app.example:51730",
        "https://example.org",
    ]:
        assert not policy.allows(other), other
    assert CORSPolicy([]).origins == [] and not CORSPolicy([" ", ""]).allows("http://a")
    assert CORSPolicy(["*"]).allows("http://anything.example")
    assert cors_warning(["http://a.example"]) is None
    assert "any web page" in cors_warning(["*"])


@pytest.mark.slow
def test_load_of_32_clients_ends_answered_or_refused_and_frees_its_sequences():
    """32 concurrent streaming clients (mixed prompt lengths, every fourth leaving after its
    second chunk) against --parallel 4 --max-queue 16: each ends in an answer, a client gone,
    or a clean 503; never a 500. Afterwards nothing runs or waits, and a second round grows
    the process's memory by no more than noise (the idle KV caches are reused)."""
    import psutil

    def client(url: str, k: int, results: list) -> None:
        words = " ".join(["tokens in a batch"] * (1 + k * 7 % 40))
        body = {
            "model": MODEL_ID, "messages": [{"role": "user", "content": words}],
            "max_tokens": 4 + k % 12, "stream": True, "temperature": 0,
        }  # fmt: skip
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
                if r.status_code != 200:
                    r.read()
                    results.append((r.status_code, r.json()["error"]["message"]))
                    return
                chunks, done = 0, False
                for line in r.iter_lines():
                    chunks += line.startswith("data: {")
                    done |= line == "data: [DONE]"
                    if k % 4 == 3 and chunks == 2:
                        results.append(("left", ""))
                        return
                results.append((200, "done" if done else "no [DONE]"))
        except httpx.HTTPError as e:
            results.append((type(e).__name__, str(e)))

    with running_server(parallel=4, max_queue=16) as (url, app):
        rss = []
        for _ in range(2):
            results: list = []
            threads = [threading.Thread(target=client, args=(url, k, results)) for k in range(32)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(180)
            statuses = collections.Counter(status for status, _ in results)
            assert len(results) == 32 and set(statuses) <= {200, 503, "left"}, results
            assert all("busy" in message for status, message in results if status == 503)
            assert all(m == "done" for status, m in results if status == 200)
            assert statuses[200] >= 4 and statuses["left"] >= 1
            engine = app.state.localllm.engine
            deadline = time.monotonic() + 30
            while engine.stats() != {"active": 0, "waiting": 0}:  # the ones that left, too
                assert time.monotonic() < deadline, engine.stats()
                time.sleep(0.05)
            rss.append(psutil.Process().memory_info().rss)
        assert rss[1] - rss[0] < 64 << 20, rss
