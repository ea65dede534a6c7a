"""Anthropic's Messages API on `localllm serve`, with the official anthropic client: a message,
a stream, a tool call and its result, and Anthropic's error shape."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from live_server import running_server
from real_models import model_path

QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m"
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server():
    with running_server(models=[str(model_path("qwen2.5-coder-0.5b"))], parallel=2) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)


def test_a_message_and_a_stream_say_the_same(client):
    kwargs = dict(
        model=QWEN,
        max_tokens=16,
        extra_body={"temperature": 0},  # this client version no longer takes it as an argument
        system="You answer in one short sentence.",
        messages=[{"role": "user", "content": "Say hello."}],
    )
    reply = client.messages.create(**kwargs)
    assert reply.role == "assistant" and reply.content[0].type == "text"
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.output_tokens > 0
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == reply.content[0].text and final.stop_reason == reply.stop_reason


def test_a_tool_call_and_its_result(client):
    ask = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    reply = client.messages.create(
        model=QWEN,
        max_tokens=60,
        extra_body={"temperature": 0},
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=ask,
    )
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and uses[0].name == "get_weather"
    assert "city" in uses[0].input
    follow_up = [
        *ask,
        {"role": "assistant", "content": [u.model_dump() for u in uses]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 C, clear sky"}
            ],
        },
    ]
    answer = client.messages.create(
        model=QWEN,
        max_tokens=40,
        extra_body={"temperature": 0},
        tools=[WEATHER],
        messages=follow_up,
    )
    assert answer.content and answer.content[0].type in ("text", "tool_use")


def test_errors_in_anthropics_shape(server, client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    for body in ({"model": QWEN, "messages": []}, {"model": QWEN, "max_tokens": 4}):
        response = httpx.post(f"{server}/v1/messages", json=body, timeout=60)
        assert response.status_code == 400
        assert response.json()["type"] == "error"
        assert response.json()["error"]["type"] == "invalid_request_error"
