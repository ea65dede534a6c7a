"""OpenAI's harmony format (gpt-oss): the analysis channel as thinking, the final channel as the
answer, function calls from the commentary channel, on the gpt-oss fixture's tokenizer and its
harmony chat template, through the OpenAI routes' reply shaping."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from localllm import harmony, thinking, tool_calls
from localllm.models import load_model
from localllm.prompt import chat_prompt_ids, chat_template
from localllm.server_jobs import Step
from localllm.server_openai import _chat_choice, _chat_choice_stream, _Reply

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "architectures" / "gpt-oss.gguf"
REPLY = (
    "<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?"
)
CALL = (
    "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}'
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def pieces(text: str, step: int) -> tuple[str, str]:
    splitter = thinking.ThinkingSplitter()
    out = []
    for i in range(0, len(text), step):
        out += splitter.feed(text[i : i + step])
    out += splitter.flush()
    thought = "".join(p for kind, p in out if kind == thinking.THINKING)
    return thought, "".join(p for kind, p in out if kind == thinking.CONTENT)


@pytest.mark.parametrize("step", [1, 2, 5, 11, 1000])
def test_channels_split_into_thoughts_and_answer_cut_anywhere(step):
    assert pieces(REPLY, step) == ("The user greets; answer briefly.", "Hello! How can I help?")
    assert thinking.split(REPLY) == ("The user greets; answer briefly.", "Hello! How can I help?")


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_function_call_passes_whole_and_parses(step):
    thought, content = pieces(CALL, step)
    assert thought == "Need the weather tool."
    rest, calls = tool_calls.parse(content, "harmony")
    assert rest == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    # the recipient may also come before the channel
    other = CALL.replace(
        "assistant<|channel|>commentary to=functions.get_weather",
        "assistant to=functions.get_weather<|channel|>commentary",
    )
    _, calls = tool_calls.parse(thinking.split(other)[1], "harmony")
    assert [c.name for c in calls] == ["get_weather"]


def test_not_harmony_is_left_alone():
    assert thinking.split("<b>Hi</b>") == ("", "<b>Hi</b>")
    assert thinking.split("<think>x</think>Hi") == ("x", "Hi")
    assert harmony.calls("Just text.") == ("Just text.", [])
    assert not tool_calls.could_start_call("Hello", "harmony")
    assert tool_calls.could_start_call("<|sta", "harmony")


@pytest.fixture(scope="module")
def model():
    model = load_model(FIXTURE, n_ctx=512, device="cpu")
    yield model
    model.close()


def test_the_tokenizer_renders_harmonys_structure(model):
    tok = model.tokenizer
    ids = {text: tok.encode(text, add_special=False, parse_special=True)[0] for text in (
        "<|channel|>", "<|message|>", "<|start|>", "<|constrain|>", "<|end|>", "<|return|>",
        "<|call|>")}  # fmt: skip
    shown = tok.decode(list(ids.values()), skip_special=True)
    # as llama.cpp renders them; <|return|> and <|call|> end the generation, unseen
    assert shown == "<|channel|><|message|><|start|><|constrain|><|end|>"
    assert ids["<|return|>"] in tok.eog_ids and ids["<|call|>"] in tok.eog_ids
    assert ids["<|end|>"] not in tok.eog_ids


def test_the_files_template_is_harmony(model):
    source = chat_template(model).source
    assert harmony.is_harmony(source) and thinking.template_thinks(source)
    assert tool_calls.family(source) == "harmony"
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "get_weather", "content": '{"temp": 18}'},
    ]
    ids = chat_prompt_ids(model, tool_calls.template_messages(messages), tools=[WEATHER])
    text = model.tokenizer.decode(ids)
    assert "namespace functions" in text and "type get_weather" in text
    assert 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}' in text
    assert text.endswith("<|start|>assistant")
    assert not thinking.prompt_opens_thinking(model.tokenizer, ids)


def test_openai_reply_shapes_reasoning_and_calls():
    reply = _Reply(tools=True, kind="harmony", thinks=True)
    choice = _chat_choice(0, (CALL, Step("", "stop", 9, 9), []), None, reply)
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "Need the weather tool."
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    plain = _chat_choice(0, (REPLY, Step("", "stop", 9, 9), []), None, _Reply(thinks=True))
    assert plain["message"]["content"] == "Hello! How can I help?"


class Pieces:
    def __init__(self, texts):
        self.texts = texts

    def __aiter__(self):
        return self._steps()

    async def _steps(self):
        for i, text in enumerate(self.texts):
            yield Step(text, "stop" if i == len(self.texts) - 1 else None, 5, i + 1)


def test_openai_stream_of_a_harmony_call():
    texts = [CALL[i : i + 7] for i in range(0, len(CALL), 7)]
    reply = _Reply(tools=True, kind="harmony", thinks=True)

    async def run():
        return [c async for c in _chat_choice_stream(Pieces(texts), 0, reply, [None])]

    deltas = [c["delta"] for c in asyncio.run(run())]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the weather tool."
    assert not "".join(d.get("content", "") for d in deltas)
    [calls] = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "get_weather"
