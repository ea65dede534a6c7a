"""Reasoning apart from the answer, for thinking models (Qwen3, SmolLM3, DeepSeek-R1 distills).

Such a model writes `<think>...</think>` before its answer (or starts inside it, when the chat
template ends the prompt with `<think>`). `ThinkingSplitter` cuts a stream of text into
("thinking", text) and ("content", text) pieces as it arrives, holding back only what could be
the start of a tag; a reply in OpenAI's harmony channels (gpt-oss) goes through harmony.py's
splitter instead. Whether a model thinks is read from its chat template, and `--think` /
`--no-think` reach the template as `enable_thinking`, as Ollama's `think` does for Qwen3.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from localllm.harmony import (
    HarmonySplitter,
    is_harmony,
    opens_harmony,
    partial_tag_length,
    starts_harmony,
)

OPEN, CLOSE = "<think>", "</think>"
THINKING, CONTENT = "thinking", "content"


def template_thinks(template_source: str) -> bool:
    """Whether a chat template is a thinking model's (it writes or switches the think tags, or
    writes harmony's channels: gpt-oss)."""
    return (
        OPEN in template_source
        or "enable_thinking" in template_source
        or is_harmony(template_source)
    )


def prompt_opens_thinking(tokenizer, prompt_ids: Sequence[int]) -> bool:
    """Whether the prompt ends inside a think block (the reply then starts with thoughts).
    The last 16 ids: "<think>" may be one token or 8 bytes."""
    return tokenizer.decode(prompt_ids[-16:]).rstrip().endswith(OPEN)


class ThinkingSplitter:
    """Splits streamed text into thinking and content; `inside` when the stream starts in a
    think block. Only the first think block counts: later tags are content."""

    def __init__(self, inside: bool = False) -> None:
        self.inside = inside
        self.done = False  # the think block has closed (or content came first)
        self._held = ""
        self._strip = False  # drop whitespace that starts the content after </think>
        self._harmony: HarmonySplitter | None = None  # a harmony reply (gpt-oss), once seen

    def feed(self, text: str) -> list[tuple[str, str]]:
        """The pieces of `text` that are certain; a possible partial tag is held back."""
        if self._harmony is not None:
            return self._harmony.feed(text)
        text = self._held + text
        self._held = ""
        if not self.done and not self.inside and starts_harmony(text):
            if opens_harmony(text):  # channels, not tags
                self._harmony = HarmonySplitter()
                return self._harmony.feed(text)
            self._held = text  # maybe the start of a channel header
            return []
        pieces: list[tuple[str, str]] = []
        while text:
            if self.done:
                if self._strip:
                    text = text.lstrip()
                    if not text:
                        break
                    self._strip = False
                pieces.append((CONTENT, text))
                break
            tag = CLOSE if self.inside else OPEN
            at = text.find(tag)
            if at >= 0:
                before, text = text[:at], text[at + len(tag) :]
                if self.inside:
                    pieces.append((THINKING, before))
                    self.inside, self.done, self._strip = False, True, True
                elif before.strip():  # content before any <think>: not a thinking reply
                    self.done = True
                    text = before + tag + text
                else:
                    self.inside = True
                continue
            keep = partial_tag_length(text, tag)
            if not self.inside and text[: len(text) - keep].strip():
                self.done = True  # the reply does not start with <think>
                continue
            body, self._held = text[: len(text) - keep], text[len(text) - keep :]
            if self.inside and body:
                pieces.append((THINKING, body))
            elif body:  # whitespace before <think>: held until we know
                self._held = body + self._held
            break
        return [(kind, piece) for kind, piece in pieces if piece]

    def flush(self) -> list[tuple[str, str]]:
        """What is held back, at the end of the stream."""
        if self._harmony is not None:
            return self._harmony.flush()
        held, self._held = self._held, ""
        if not held:
            return []
        return [(THINKING if self.inside else CONTENT, held)]


def split(text: str, inside: bool = False) -> tuple[str, str]:
    """(thinking, content) of a whole reply."""
    splitter = ThinkingSplitter(inside)
    parts = {THINKING: [], CONTENT: []}
    for kind, piece in [*splitter.feed(text), *splitter.flush()]:
        parts[kind].append(piece)
    return "".join(parts[THINKING]).strip(), "".join(parts[CONTENT])


DIM, RESET = "\x1b[2m", "\x1b[0m"


class ThinkingDisplay:
    """Writes a streamed reply with its thinking set apart, as Ollama's CLI does:
    "Thinking...", the thoughts, "...done thinking.", then the answer. With `dim` (a terminal)
    the thoughts are dimmed; without `show` they are left out.

    `write` takes the text (it may hold back a word, as the chat's word wrap does); `raw` takes
    the terminal's control codes, after `flush` has written what `write` holds. Unless `thinks`
    (a thinking model), everything is answer.
    """

    def __init__(
        self,
        write: Callable[[str], object],
        *,
        show: bool,
        thinks: bool = True,
        dim: bool = False,
        inside: bool = False,
        raw: Callable[[str], object] | None = None,
        flush: Callable[[], object] | None = None,
    ) -> None:
        self._write, self._raw = write, raw or write
        self._flush = flush or (lambda: None)
        self.show, self.dim = show, dim
        self._splitter = ThinkingSplitter(inside)
        self._splitter.done = not thinks
        self._state = "before"  # "thinking" once the header is out, "after" once the footer is
        self.last_char = ""  # of what was written

    def write(self, text: str) -> None:
        """A delta of the reply."""
        for kind, piece in self._splitter.feed(text):
            self._piece(kind, piece)

    def close(self) -> None:
        """The end of the reply (or its interruption): what was held back, and the footer."""
        for kind, piece in self._splitter.flush():
            self._piece(kind, piece)
        self._end_thinking()

    def _piece(self, kind: str, piece: str) -> None:
        if kind == THINKING:
            if not self.show:
                return
            if self._state == "before":
                self._emit_raw(DIM if self.dim else "")
                self._emit("Thinking...\n")
                self._state = "thinking"
                piece = piece.lstrip("\n")
            self._emit(piece)
            return
        self._end_thinking()
        self._emit(piece)

    def _end_thinking(self) -> None:
        if self._state != "thinking":
            return
        self._emit(("" if self.last_char == "\n" else "\n") + "...done thinking.\n\n")
        self._emit_raw(RESET if self.dim else "")
        self._state = "after"

    def _emit(self, text: str) -> None:
        if text:
            self._write(text)
            self.last_char = text[-1]

    def _emit_raw(self, code: str) -> None:
        if code:
            self._flush()
            self._raw(code)
