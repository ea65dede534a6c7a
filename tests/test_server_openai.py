"""OpenAI's API beyond the basics, with the official client on a real model: n choices,
logit_bias, completions' echo (with the prompt's own logprobs) and reasoning_content."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import openai
import pytest
from live_server import N_CTX, running_server
from real_models import model_path

from localllm.chat_template import ChatTemplate
from localllm.models import load_model
from localllm.prompt import raw_prompt_ids
from localllm.server_jobs import Step
from localllm.server_openai import _chat_choice, _chat_choice_stream, _Reply

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
HELLO = [{"role": "user", "content": "Say hello."}]
# A thinking model's template (as Qwen3's ends an assistant prompt): the reply starts in thought.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def served():
    with running_server() as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local_model():
    model = load_model(model_path("smollm2-135m"), n_ctx=N_CTX, device="cpu")
    yield model
    model.close()


def test_n_choices_are_seeded_apart_and_streamed_together(client):
    kwargs = {"model": MODEL_ID, "messages": HELLO, "max_tokens": 8, "temperature": 1.5}
    three = client.chat.completions.create(n=3, seed=7, **kwargs)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert len(set(texts)) > 1  # each choice draws with its own seed (7, 8, 9)
    again = client.chat.completions.create(n=3, seed=7, **kwargs)
    assert [c.message.content for c in again.choices] == texts
    one = client.chat.completions.create(n=1, seed=8, **kwargs)
    assert one.choices[0].message.content == texts[1]
    # The prompt is counted once, the completions of every choice.
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens > one.usage.completion_tokens

    stream = client.chat.completions.create(
        n=3, seed=7, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    parts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    finishes, usage = {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts[choice.index].append(choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert ["".join(parts[i]) for i in range(3)] == texts
    assert set(finishes) == {0, 1, 2}
    assert usage.completion_tokens == three.usage.completion_tokens


def test_n_completions(client):
    result = client.completions.create(
        model=MODEL_ID, prompt="Once upon a time", max_tokens=6, n=2, seed=3, temperature=1.5
    )
    assert [c.index for c in result.choices] == [0, 1]
    assert result.choices[0].text != result.choices[1].text


def test_logit_bias_bans_and_forces_tokens(client, local_model):
    kwargs = {"model": MODEL_ID, "prompt": "The capital of France is", "max_tokens": 3}
    greedy = client.completions.create(temperature=0, logprobs=1, **kwargs)
    first = greedy.choices[0].logprobs.tokens[0]
    first_id = local_model.tokenizer.encode(first, add_special=False, parse_special=False)
    assert len(first_id) == 1
    banned = client.completions.create(
        temperature=0, logprobs=1, logit_bias={str(first_id[0]): -100}, **kwargs
    )
    assert banned.choices[0].logprobs.tokens[0] != first
    forced_id = local_model.tokenizer.encode(" banana", add_special=False, parse_special=False)
    forced = client.completions.create(temperature=0, logit_bias={str(forced_id[0]): 100}, **kwargs)
    assert forced.choices[0].text.startswith(local_model.tokenizer.decode(forced_id[:1]))
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(logit_bias={"999999999": 1}, **kwargs)


def log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def test_echo_gives_the_prompt_and_its_logprobs(client, local_model):
    prompt = "The quick brown fox jumps over"
    result = client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    plain = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=4, temperature=0)
    choice = result.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    ids = raw_prompt_ids(local_model, prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + result.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # Each prompt token's logprob under what came before it, as the model computes it.
    local_model.transformer.cache.trim(0)
    logits = local_model.transformer.forward(ids, 0, all_logits=True)
    expected = [log_softmax(logits[i])[ids[i + 1]] for i in range(len(ids) - 1)]
    assert np.allclose(lp.token_logprobs[1 : len(ids)], expected, atol=0.05)
    assert all(len(alts) == 2 for alts in lp.top_logprobs[1:])
    assert all(math.isfinite(x) for x in lp.token_logprobs[1:])

    stream = client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == choice.text
    tokens = client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=1, echo=True)
    assert tokens.choices[0].text.startswith(local_model.tokenizer.decode(ids))


def test_reasoning_content_for_a_thinking_template(served, client):
    url, app = served
    client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=1)  # loads it
    model = app.state.localllm.pool._loaded[MODEL_ID]
    model.extra["chat_template"] = ChatTemplate(THINKING_TEMPLATE)
    try:
        kwargs = {"model": MODEL_ID, "messages": HELLO, "max_tokens": 8, "temperature": 0}
        thought = client.chat.completions.create(**kwargs).choices[0].message
        # The prompt opened a think block, and 8 tokens do not close it: all of it is thought.
        assert thought.content == ""
        assert thought.model_extra["reasoning_content"]
        raw = client.chat.completions.create(extra_body={"reasoning_format": "none"}, **kwargs)
        # (the splitter drops the newline that follows a think tag)
        assert raw.choices[0].message.content.strip() == thought.model_extra["reasoning_content"]
        streamed = client.chat.completions.create(stream=True, **kwargs)
        reasoning = "".join(
            (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            for c in streamed
            if c.choices
        )
        assert reasoning.strip() == thought.model_extra["reasoning_content"]
        off = client.chat.completions.create(
            extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kwargs
        )
        assert off.choices[0].message.content  # the template closed the block: an answer
        assert "reasoning_content" not in (off.choices[0].message.model_extra or {})
    finally:
        model.extra.pop("chat_template")


class FakeGeneration:
    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def __aiter__(self):
        return self._steps()

    async def _steps(self):
        for i, text in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield Step(text, "stop" if last else None, 5, i + 1)


def streamed(pieces: list[str], reply: _Reply) -> list[dict]:
    async def run():
        lasts = [None]
        return [c async for c in _chat_choice_stream(FakeGeneration(pieces), 0, reply, lasts)]

    return asyncio.run(run())


def test_stream_splits_thoughts_cut_anywhere():
    pieces = ["<thi", "nk>Let me", " see.</th", "ink>Hel", "lo!"]
    chunks = streamed(pieces, _Reply(thinks=True))
    deltas = [c["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert (reasoning, content) == ("Let me see.", "Hello!")
    assert chunks[-1]["finish_reason"] == "stop"
    result = ("".join(pieces), Step("", "stop", 5, 5), [])
    whole = _chat_choice(0, result, None, _Reply(thinks=True))
    assert whole["message"] == {
        "role": "assistant",
        "content": "Hello!",
        "reasoning_content": "Let me see.",
    }


def test_stream_holds_a_tool_call_after_thoughts():
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    pieces = ["<think>plan</think>", call[:9], call[9:]]
    chunks = streamed(pieces, _Reply(tools=True, kind="hermes", thinks=True))
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "plan"
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls and calls[0][0]["function"]["name"] == "f"
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert not "".join(d.get("content", "") for d in deltas).strip()
