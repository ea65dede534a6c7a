"""Tool calls through `localllm serve` with the official openai client, on the real
Qwen2.5-Coder-0.5B (Hermes-style <tool_call> in its own template): a forced call and its round
trip, streamed calls, auto, and the errors."""

from __future__ import annotations

import json

import httpx
import ollama
import openai
import pytest
from live_server import running_server
from real_models import model_path

from localllm import tool_calls
from localllm.models import load_model
from localllm.prompt import chat_prompt_ids

MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def server():
    models = [str(model_path("qwen2.5-coder-0.5b")), str(model_path("smollm2-135m"))]
    with running_server(models=models, parallel=2, max_queue=4) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, **kwargs):
    kwargs.setdefault("messages", ASK)
    return client.chat.completions.create(
        model=MODEL, tools=[WEATHER], temperature=0, max_tokens=60, **kwargs
    )


def test_a_required_call_and_its_round_trip(client):
    reply = ask(client, tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and arguments["city"]
    follow_up = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": '{"temperature_c": 18, "sky": "clear"}',
        },
    ]
    answer = ask(client, messages=follow_up, tool_choice="none")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_a_named_call_streamed(client):
    stream = ask(
        client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True
    )
    deltas = [chunk.choices[0] for chunk in stream if chunk.choices]
    calls = [c for d in deltas if d.delta.tool_calls for c in d.delta.tool_calls]
    assert deltas[-1].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert "city" in json.loads(calls[0].function.arguments)


def test_auto_answers_either_way_and_well_formed(client):
    choice = ask(client, tool_choice="auto").choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls[0].function.name == "get_weather"
    else:
        assert choice.message.content


def test_bad_tool_requests(client):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        ask(client, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="each tool must be"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[{"type": "function"}])
    with pytest.raises(openai.BadRequestError, match="does not take tools"):
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1", messages=ASK, tools=[WEATHER]
        )


@pytest.mark.parametrize(
    ("text", "kind", "content", "names"),
    [
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "hermes", "", ["f"]),
        ('Sure.<tool_call>{"name": "f", "arguments": {}}</tool_call>', "hermes", "Sure.", ["f"]),
        ('[TOOL_CALLS] [{"name": "g", "arguments": {"x": "y"}}]', "mistral", "", ["g"]),
        ('<|python_tag|>{"name": "h", "parameters": {"q": 2}}', "llama3", "", ["h"]),
        ("Just text.", "hermes", "Just text.", []),
        # Untagged calls, as small Qwen models write them (and llama.cpp's parser takes):
        ('{"name": "f", "arguments": {"a": 1}}', "hermes", "", ["f"]),
        ('```json\n{"name": "f", "arguments": {}}\n```', "hermes", "", ["f"]),
        ('{"name": "Bob", "age": 3}', "hermes", '{"name": "Bob", "age": 3}', []),
    ],
)
def test_each_familys_calls_are_parsed(text, kind, content, names):
    parsed_content, calls = tool_calls.parse(text, kind)
    assert parsed_content == content and [c.name for c in calls] == names
    for call in calls:
        json.loads(call.arguments)


# -- Ollama's /api/chat with tools ------------------------------------------------------------

# A request the 0.5B model answers with a call (untagged JSON, which parse() takes).
CALL_ME = [{"role": "user", "content": "Use the get_weather tool to get the weather in Paris."}]
OLLAMA_GREEDY = {"temperature": 0, "num_predict": 60}


def test_ollama_chat_with_tools_and_the_round_trip(server):
    client = ollama.Client(host=server, timeout=120)
    reply = client.chat(MODEL, messages=CALL_ME, tools=[WEATHER], options=OLLAMA_GREEDY)
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments == {"city": "Paris"}  # an object, as Ollama sends it
    assert reply.message.content == "" and reply.done_reason == "stop"
    streamed = list(
        client.chat(MODEL, messages=CALL_ME, tools=[WEATHER], options=OLLAMA_GREEDY, stream=True)
    )
    calls = [c for part in streamed for c in (part.message.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"] and streamed[-1].done
    assert not "".join(part.message.content or "" for part in streamed)
    follow_up = [
        *CALL_ME,
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_name": "get_weather", "content": '{"temperature_c": 18}'},
    ]
    # Sent as JSON as it is: the ollama client would drop the schema's maxLength.
    body = {"model": MODEL, "messages": follow_up, "tools": [WEATHER], "stream": False}
    answer = httpx.post(f"{server}/api/chat", json={**body, "options": OLLAMA_GREEDY}, timeout=120)
    assert answer.status_code == 200 and answer.json()["done"]
    # (The 0.5B model only calls again.) The server rendered the call and its result into the
    # model's template: the prompt it ran is the one the template makes of that conversation.
    model = load_model(model_path("qwen2.5-coder-0.5b"), n_ctx=512, device="cpu")
    try:
        turns = [
            *CALL_ME,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", **call.model_dump()}],
            },
            {"role": "tool", "name": "get_weather", "content": '{"temperature_c": 18}'},
        ]
        ids = chat_prompt_ids(model, tool_calls.template_messages(turns), tools=[WEATHER])
        text = model.tokenizer.decode(ids)
    finally:
        model.close()
    assert "<tool_response>" in text and '{"temperature_c": 18}' in text and '"Paris"' in text
    assert answer.json()["prompt_eval_count"] == len(ids)


def test_ollama_tools_on_a_model_without_them(server):
    client = ollama.Client(host=server, timeout=120)
    with pytest.raises(ollama.ResponseError, match="does not support tools") as e:
        client.chat("SmolLM2-135M-Instruct.Q4_1", messages=CALL_ME, tools=[WEATHER])
    assert e.value.status_code == 400


def test_ollama_show_says_which_models_take_tools(server):
    client = ollama.Client(host=server, timeout=120)
    assert client.show(MODEL).capabilities == ["completion", "tools"]
    assert client.show("SmolLM2-135M-Instruct.Q4_1").capabilities == ["completion"]
