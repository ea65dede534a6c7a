"""Thinking models: thoughts apart from the answer, in a stream cut anywhere; --think/--no-think
reach the template as enable_thinking; the history keeps the answer only."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import pytest

from localllm import thinking
from localllm.chat_template import ChatTemplate
from localllm.cli import _print_reply
from localllm.conversation import Conversation
from localllm.models import load_model
from localllm.thinking import ThinkingDisplay, ThinkingSplitter

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "architectures"

# The end of Qwen3's template, as its GGUF files have it: with enable_thinking false the
# generation prompt closes an empty think block, so the model answers at once.
QWEN3_LIKE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# A template that opens the think block itself (DeepSeek-R1 distills, QwQ)
OPENS_THINK = QWEN3_LIKE.replace("assistant\\n' }}", "assistant\\n<think>\\n' }}")

REPLY = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello! How can I help?"


def feed_in_pieces(text: str, cuts: list[int], inside: bool = False) -> tuple[str, str]:
    splitter = ThinkingSplitter(inside)
    parts = {thinking.THINKING: "", thinking.CONTENT: ""}
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        for kind, piece in splitter.feed(text[a:b]):
            parts[kind] += piece
    for kind, piece in splitter.flush():
        parts[kind] += piece
    return parts[thinking.THINKING], parts[thinking.CONTENT]


def test_a_whole_reply_splits_into_thoughts_and_answer():
    assert thinking.split(REPLY) == ("The user greets me.\nI greet back.", "Hello! How can I help?")


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7])
def test_a_stream_cut_anywhere_splits_the_same(step):
    cuts = list(range(step, len(REPLY), step))
    thoughts, answer = feed_in_pieces(REPLY, cuts)
    assert thoughts.strip() == "The user greets me.\nI greet back."
    assert answer == "Hello! How can I help?"


def test_a_stream_that_starts_inside_the_think_block():
    text = "hmm, a greeting</think>\n\nHi!"
    assert feed_in_pieces(text, [3, 16, 20], inside=True) == ("hmm, a greeting", "Hi!")


def test_a_reply_without_think_tags_is_all_answer():
    for text in ("Hello <think>not a thought</think>", "\n\nPlain answer", "<thin"):
        assert feed_in_pieces(text, [1, 4]) == ("", text)


def test_the_display_sets_thoughts_apart_or_leaves_them_out():
    shown, hidden, dim = io.StringIO(), io.StringIO(), io.StringIO()
    for out, kwargs in ((shown, {"show": True}), (hidden, {"show": False})):
        display = ThinkingDisplay(out.write, **kwargs)
        for i in range(0, len(REPLY), 4):
            display.write(REPLY[i : i + 4])
        display.close()
    thoughts = "Thinking...\nThe user greets me.\nI greet back.\n...done thinking.\n\n"
    assert shown.getvalue() == thoughts + "Hello! How can I help?"
    assert hidden.getvalue() == "Hello! How can I help?"
    display = ThinkingDisplay(dim.write, show=True, dim=True)
    display.write(REPLY)
    display.close()
    assert dim.getvalue().startswith(thinking.DIM + "Thinking...")
    assert thinking.RESET + "Hello!" in dim.getvalue()


@dataclass
class Piece:
    text: str


def test_a_pipe_gets_the_answer_only_unless_asked():
    piped = io.StringIO()
    pieces = iter([Piece(REPLY[:9]), Piece(REPLY[9:])])
    _print_reply(pieces, piped, thinks=True, show_thinking=False)
    assert piped.getvalue() == "Hello! How can I help?\n"
    asked = io.StringIO()
    _print_reply(iter([Piece(REPLY)]), asked, thinks=True, show_thinking=True)
    assert asked.getvalue().startswith("Thinking...\n") and asked.getvalue().endswith("help?\n")
    # a model that does not think: "<think>" in its text is just text
    plain = io.StringIO()
    _print_reply(iter([Piece(REPLY)]), plain, thinks=False, show_thinking=False)
    assert plain.getvalue() == REPLY + "\n"


@pytest.fixture(scope="module")
def model():
    loaded = load_model(FIXTURES / "qwen3.gguf", n_ctx=256, n_threads=1)
    yield loaded
    loaded.close()


def with_template(model, source: str) -> Conversation:
    model.extra["chat_template"] = ChatTemplate(source)
    return Conversation(model)


def test_no_think_reaches_the_template_as_enable_thinking(model):
    conversation = with_template(model, QWEN3_LIKE)
    assert conversation.thinks
    decode = model.tokenizer.decode
    conversation.messages.append({"role": "user", "content": "hi"})
    assert not decode(conversation.prompt_ids()).endswith("</think>\n\n")  # the model's default
    conversation.think = False
    assert decode(conversation.prompt_ids()).endswith("<think>\n\n</think>\n\n")
    assert not conversation.reply_opens_thinking
    conversation.think = True
    assert not decode(conversation.prompt_ids()).endswith("</think>\n\n")


def test_a_template_that_opens_the_think_block(model):
    conversation = with_template(model, OPENS_THINK)
    conversation.messages.append({"role": "user", "content": "hi"})
    conversation.prompt_ids()
    assert conversation.reply_opens_thinking


def test_the_history_keeps_the_answer_without_the_thoughts(model):
    conversation = with_template(model, QWEN3_LIKE)
    conversation.messages.append({"role": "user", "content": "hi"})
    conversation.prompt_ids()
    conversation._record(REPLY)
    assert conversation.messages[-1] == {"role": "assistant", "content": "Hello! How can I help?"}
    plain = with_template(model, "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not plain.thinks
