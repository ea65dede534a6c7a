"""The conversation and the interactive chat: in-process with a scripted input, and on a real
pseudo-terminal with pexpect (a reply streams, Ctrl-C stops it, the next turn remembers, /bye)."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
from real_models import model_path

from localllm.chat import ChatSession, WordWrap, terminal_width
from localllm.conversation import ContextFull, Conversation
from localllm.describe import format_stats
from localllm.errors import LocalLLMError
from localllm.generate import generate, stream_generate
from localllm.models import load_model
from localllm.options import Options
from localllm.prompt import chat_prompt_ids

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smollm():
    model = load_model(model_path("smollm2-135m"), n_ctx=512, device="cpu")
    yield model
    model.close()


def greedy(n: int) -> Options:
    return Options(temperature=0.0, num_predict=n)


# ---------------------------------------------------------------------------------------------
# Options


def test_options_set_parses_and_validates():
    options = Options()
    options.set("temperature", "0.2")
    options.set("top_k", "5")
    options.set("seed", "7")
    options.set("num_predict", "-1")
    assert (options.temperature, options.top_k, options.seed, options.num_predict) == (
        0.2, 5, 7, -1,
    )  # fmt: skip
    options.set("seed", "none")
    assert options.seed is None
    for name, value in [
        ("temperature", "-1"),
        ("temperature", "hot"),
        ("temperature", "nan"),
        ("top_p", "0"),
        ("min_p", "1.5"),
        ("top_k", "2.5"),
        ("repeat_penalty", "0"),
        ("num_predict", "-5"),
        ("ctx", "4"),
    ]:
        with pytest.raises(LocalLLMError):
            options.set(name, value)
    assert options.temperature == 0.2  # a rejected value changes nothing
    assert Options(num_predict=-1).max_tokens(512) == 512
    assert Options(num_predict=7).max_tokens(512) == 7


# ---------------------------------------------------------------------------------------------
# Conversation


def test_a_turn_streams_what_generate_gives_and_is_recorded(smollm):
    conversation = Conversation(smollm, system="Answer briefly.", options=greedy(4))
    ids, dropped = conversation.ask("Name a colour.")
    assert dropped == 0
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a colour."},
    ]
    assert ids == chat_prompt_ids(smollm, messages)
    # Both from an empty cache: a batched prefill and a one-token step may round differently.
    smollm.transformer.cache.clear()
    reply = "".join(r.text for r in conversation.generate(ids))
    smollm.transformer.cache.clear()
    assert reply == generate(smollm, ids, max_tokens=4)
    assert conversation.messages == [messages[1], {"role": "assistant", "content": reply}]


def test_stopping_a_reply_keeps_the_partial_text_and_the_next_turn_reuses_the_cache(smollm):
    conversation = Conversation(smollm, options=greedy(50))
    first_ids, _ = conversation.ask("Write a story about a cat.")
    replies = conversation.generate(first_ids)
    partial = "".join(next(replies).text for _ in range(3))
    replies.close()  # what Ctrl-C does to the loop in ChatSession.respond
    assert partial
    assert conversation.messages[-1] == {"role": "assistant", "content": partial}

    conversation.options.num_predict = 1
    second = list(conversation.reply("What was its name?"))
    # Only the new turn is prefilled: the first prompt and the partial reply come from the cache.
    assert second[-1].cached_tokens > len(first_ids)
    assert [m["role"] for m in conversation.messages] == ["user", "assistant"] * 2


def test_a_conversation_run_before_starts_from_the_pools_pages(smollm):
    """Back to a conversation after another one (a /load of it): its history's pages come from
    the KV pool's prefix cache, not prefilled again, though the model's cache held the other."""
    story = "Tell me a long story about a lighthouse keeper, a storm and a lost ship. " * 4
    first = Conversation(smollm, options=greedy(3))
    list(first.reply(story))
    saved = first.to_json()
    other = Conversation(smollm, options=greedy(3))
    list(other.reply("Name a colour."))
    back = Conversation(smollm, options=greedy(1))
    back.load_json(saved)
    ids, _ = back.ask("And then?")
    shared_with_other = smollm.transformer.cache.reusable_prefix(ids)
    replies = list(back.generate(ids))
    assert replies[-1].cached_tokens >= 64 > shared_with_other  # a page at least
    n = replies[-1].generation_tokens  # (the saved options came back with the conversation)
    alone = stream_generate(smollm, ids, max_tokens=n, cache=smollm.transformer.new_cache())
    assert "".join(r.text for r in replies) == "".join(r.text for r in alone)  # from no pages


def test_stopping_before_any_text_drops_the_turn(smollm):
    conversation = Conversation(smollm, options=greedy(5))
    ids, _ = conversation.ask("Hello")
    conversation.generate(ids).close()  # stopped before its first token
    assert conversation.messages == []


def test_a_conversation_too_long_for_the_context_is_refused_or_truncated(smollm):
    conversation = Conversation(smollm, options=greedy(8))
    text = " ".join(f"item{i}" for i in range(400))
    with pytest.raises(ContextFull) as error:
        conversation.ask(text)
    assert error.value.n_ctx == 512 and error.value.n_tokens > 512
    assert conversation.messages == []  # the turn was not added

    ids, dropped = conversation.ask(text, truncate=True)
    assert dropped > 0 and len(ids) <= 512 - 8
    kept = conversation.messages[-1]["content"]
    assert text.endswith(kept.strip()) and "item399" in kept and "item0 " not in kept


def test_save_and_load_round_trip(smollm, tmp_path):
    conversation = Conversation(smollm, system="Be kind.", options=greedy(3))
    conversation.messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    conversation.options.set("top_k", "3")
    path = tmp_path / "chat.json"
    conversation.save(path)
    saved = json.loads(path.read_text())
    assert saved["messages"][0] == {"role": "system", "content": "Be kind."}

    other = Conversation(smollm)
    other.load(path)
    assert other.system == "Be kind." and other.messages == conversation.messages
    assert other.options == conversation.options

    for bad in ['{"messages": [{"role": "wizard", "content": "x"}]}', "[1, 2]", "{not json"]:
        path.write_text(bad)
        with pytest.raises(LocalLLMError):
            other.load(path)
    assert other.messages == conversation.messages  # a bad file changes nothing
    with pytest.raises(LocalLLMError, match="no such file"):
        other.load(tmp_path / "missing.json")


def test_raw_conversation_is_one_running_text(smollm):
    conversation = Conversation(smollm, raw=True, options=greedy(3))
    ids, _ = conversation.ask("The capital of France is")
    assert ids == smollm.tokenizer.encode("The capital of France is", parse_special=True)
    with pytest.raises(LocalLLMError):
        Conversation(smollm, raw=True, system="x")


def test_format_stats_reads_like_ollama(smollm):
    conversation = Conversation(smollm, options=greedy(3))
    last = list(conversation.reply("Hi"))[-1]
    stats = format_stats(last, 0.25, 1.5)
    assert re.search(r"^load duration: +250\.00ms$", stats, re.M)
    assert re.search(r"^prompt eval count: +\d+ token\(s\)", stats, re.M)
    assert re.search(r"^eval rate: +[\d.]+ tokens/s$", stats, re.M)


# ---------------------------------------------------------------------------------------------
# ChatSession with a scripted input


def session(conversation: Conversation, lines: list[str]) -> tuple[ChatSession, io.StringIO]:
    script = iter(lines)

    def read(prompt: str) -> str:
        out.write(prompt)
        try:
            return next(script)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    return ChatSession(conversation, "smollm", out=out, err=out, read=read), out


def test_slash_commands(smollm, tmp_path):
    conversation = Conversation(smollm, options=greedy(2))
    saved = tmp_path / "c.json"
    chat, out = session(
        conversation,
        [
            "/?",
            "/set temperature 0.5",
            "/set parameter top_k 7",
            "/set temperature lukewarm",
            "/set system You are terse.",
            "/show parameters",
            "/show system",
            "/show info",
            "/show nonsense",
            '"""first line',
            "second line",
            'third line"""',
            "/show history",
            f"/save {saved}",
            "/clear",
            "/show history",
            f"/load {saved}",
            "/frobnicate",
            "/bye",
            "never read",
        ],
    )
    chat.run()
    text = out.getvalue()
    assert "/set system TEXT" in text  # the help
    assert conversation.options.temperature == 0.5 and conversation.options.top_k == 7
    assert "Error: temperature needs a number" in text
    assert "You are terse." in text and "top_k           7" in text
    assert "architecture      llama" in text
    assert "Error: usage: /show" in text
    assert "user: first line\nsecond line\nthird line" in text  # the \"\"\" message, one turn
    after_clear = text.split("Cleared the conversation.")[1]
    assert after_clear.startswith("\n>>> system: You are terse.\n>>> Loaded 2 messages")
    assert "Unknown command '/frobnicate'" in text
    assert conversation.system == "You are terse."
    assert conversation.messages[0]["content"] == "first line\nsecond line\nthird line"
    assert len(conversation.messages) == 2  # loaded back after /clear
    assert json.loads(saved.read_text())["messages"][0]["role"] == "system"


def test_ctrl_d_ends_the_session_and_ctrl_c_at_the_prompt_does_not(smollm):
    conversation = Conversation(smollm, options=greedy(2))
    calls = []

    def read(prompt: str) -> str:
        calls.append(prompt)
        if len(calls) == 1:
            raise KeyboardInterrupt
        raise EOFError

    out = io.StringIO()
    ChatSession(conversation, "smollm", out=out, err=out, read=read).run()
    assert len(calls) == 2 and "Use Ctrl + d or /bye to exit." in out.getvalue()


def test_a_full_context_is_reported_and_clear_recovers():
    model = load_model(model_path("smollm2-135m"), n_ctx=48, device="cpu")
    try:
        conversation = Conversation(model, options=greedy(2))
        long_message = " ".join(["blue"] * 60)
        chat, out = session(conversation, [long_message, "/clear", "Hi"])
        chat.run()
        text = out.getvalue()
        assert "The context is full" in text and "/clear" in text
        assert [m["role"] for m in conversation.messages] == ["user", "assistant"]
        assert conversation.messages[0]["content"] == "Hi"
    finally:
        model.close()


# ---------------------------------------------------------------------------------------------
# The real thing, on a pseudo-terminal


def test_interactive_chat_on_a_terminal(smollm, tmp_path):
    import pexpect  # dev extra; the chat must be tested on a real terminal

    args = ["-m", "localllm", "run", str(model_path("smollm2-135m")), "-c", "512"]
    args += ["--device", "cpu", "--temperature", "0", "--verbose"]
    child = pexpect.spawn(
        sys.executable, args, cwd=str(ROOT), encoding="utf-8", timeout=120, dimensions=(40, 200)
    )
    child.logfile_read = sys.stdout  # the transcript, shown by pytest if the test fails
    try:
        child.expect_exact(">>> ")
        question = "Write a long story about a dragon."
        child.sendline(question)
        child.expect_exact("dragon.\r\n")  # the echo of what was typed
        child.expect(r"\w+ \w+ \w+")  # the reply is streaming
        child.sendintr()
        child.expect_exact("(stopped)")
        child.expect_exact(">>> ")

        child.sendline("/show history")
        child.expect(r"assistant: (\w[^\r\n]*)\r\n")
        partial = child.match.group(1)
        child.expect_exact(">>> ")

        child.sendline("/set num_predict 4")
        child.expect_exact(">>> ")
        child.sendline("What is the dragon's name?")
        child.expect(r"prompt eval count: +(\d+) token\(s\) \((\d+) cached\)")
        n_prompt, n_cached = int(child.match.group(1)), int(child.match.group(2))
        child.expect_exact(">>> ")
        # The second turn prefilled only what was new: the first prompt and the partial reply
        # were already in the KV cache.
        first_prompt = chat_prompt_ids(smollm, [{"role": "user", "content": question}])
        assert len(first_prompt) < n_cached < n_prompt

        saved = tmp_path / "chat.json"
        child.sendline(f"/save {saved}")
        child.expect_exact(">>> ")
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    messages = json.loads(saved.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2
    assert messages[1]["content"].strip() == partial.strip()
    assert messages[2]["content"] == "What is the dragon's name?"


def test_ctrl_d_exits_the_terminal_chat_with_0():
    import pexpect  # dev extra; the chat must be tested on a real terminal

    args = ["-m", "localllm", "run", str(model_path("smollm2-135m")), "-c", "64"]
    child = pexpect.spawn(
        sys.executable, [*args, "--device", "cpu"], cwd=str(ROOT), encoding="utf-8", timeout=60
    )
    try:
        child.expect_exact(">>> ")
        child.sendline("/show parameters")
        child.expect_exact("num_predict")
        child.expect_exact(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


# ---------------------------------------------------------------------------------------------
# Word wrap of a streamed reply


def wrapped(pieces: list[str], width: int) -> str:
    out = io.StringIO()
    wrap = WordWrap(out.write, width)
    for piece in pieces:
        wrap.write(piece)
    wrap.flush()
    return out.getvalue()


@pytest.mark.parametrize(
    ("pieces", "width", "expected"),
    [
        # pieces split words anywhere; lines break at spaces
        (["The qu", "ick brown", " fox jumps over the lazy dog."], 10,
         "The quick\nbrown fox\njumps over\nthe lazy\ndog."),
        (["a b c d e f g"], 3, "a b\nc d\ne f\ng"),
        (["exactly ten"], 7, "exactly\nten"),  # a word that fills the line exactly
        # newlines in the reply are kept, and indentation after them
        (["Hi!\n\n", "  - one\n  - two"], 20, "Hi!\n\n  - one\n  - two"),
        # a word longer than the line still breaks, at the line's end
        (["abcdefghijkl", "mnop"], 5, "abcde\nfghij\nklmno\np"),
        (["xx abcdefghijk yy"], 5, "xx\nabcde\nfghij\nk yy"),
    ],
)  # fmt: skip
def test_word_wrap_breaks_lines_at_spaces(pieces, width, expected):
    assert wrapped(pieces, width) == expected
    assert all(len(line) <= width for line in expected.splitlines())


def test_word_wrap_holds_the_word_back_until_it_ends():
    out = io.StringIO()
    wrap = WordWrap(out.write, 12)
    wrap.write("Hello wor")
    assert out.getvalue() == "Hello"  # "wor" may go on: it waits for a space or a newline
    wrap.write("ld, again")
    assert out.getvalue() == "Hello world,"
    wrap.write("\n")
    assert out.getvalue() == "Hello world,\nagain\n"


def test_the_chat_wraps_replies_at_the_width_and_only_on_a_terminal(smollm):
    conversation = Conversation(smollm, options=greedy(40))
    chat, out = session(conversation, ["Write a sentence about the sea."])
    chat.width = 20
    chat.run()
    reply = conversation.messages[-1]["content"]
    shown = out.getvalue().split(">>> ")[1].rstrip("\n")  # the reply, between two prompts
    assert len(reply) > 40 and "\n" in shown
    assert all(len(line) <= 20 for line in shown.splitlines())
    assert shown.split() == reply.split()  # no word was cut in two
    # Not a terminal and no width given: the reply is written as it came.
    assert terminal_width(io.StringIO()) is None
    conversation = Conversation(smollm, options=greedy(40))
    chat, out = session(conversation, ["Write a sentence about the sea."])
    chat.run()
    assert conversation.messages[-1]["content"] in out.getvalue()


def test_show_info_has_the_rows_of_show_and_the_quantization(smollm):
    from localllm.describe import describe_model, info_rows

    chat, out = session(Conversation(smollm, options=greedy(2)), ["/show info"])
    chat.run()
    text = out.getvalue()
    assert "  model             smollm\n" in text
    assert "  quantization      Q4_1\n" in text  # as `localllm show` reports it
    assert "  parameters        134.52M\n" in text
    assert re.search(r"^  context length    512 \(\d+ in use\)$", text, re.M)
    assert "  training context  8192\n" in text
    for label, _ in info_rows(describe_model(smollm.gguf)):
        assert f"\n  {label} " in text or label == "context length"
