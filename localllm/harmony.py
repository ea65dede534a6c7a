"""OpenAI's harmony format (gpt-oss): a reply is a sequence of channel messages.

    <|channel|>analysis<|message|>...thoughts...<|end|>
    <|start|>assistant<|channel|>final<|message|>...the answer...            (ends at <|return|>)
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
                                                                             (ends at <|call|>)

The chat template (from the file) writes the prompt, ending in `<|start|>assistant`; the model
writes the rest, and generation stops at <|return|> or <|call|> (end-of-generation tokens; the
tokenizer renders <|channel|>, <|message|>, <|start|>, <|constrain|> and <|end|>, as llama.cpp
does for this vocabulary). `HarmonySplitter` turns the stream into the ("thinking", text) and
("content", text) pieces of thinking.py: the analysis channel is thinking, the final channel and
commentary preambles are content; a message to a function is passed on whole, headers
included, as content, for tool_calls.py to parse (`calls`).
"""

from __future__ import annotations

import json
import re

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
THINKING, CONTENT = "thinking", "content"
# A whole reply's function calls: the header (recipient, channel, content type), then the JSON.
_CALL = re.compile(
    r"(?:<\|start\|>assistant)?([^<]*)<\|channel\|>([^<]*?)(?:<\|constrain\|>[^<]*)?"
    r"<\|message\|>(.*?)(?=<\|end\|>|<\|call\|>|<\|start\|>|$)",
    re.DOTALL,
)
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def is_harmony(template_source: str) -> bool:
    """Whether a chat template writes harmony (gpt-oss)."""
    return CHANNEL in template_source and "<|message|>" in template_source


_OPENING_TAGS = (CHANNEL, START)


def opens_harmony(text: str) -> bool:
    """Whether a reply starts with a harmony channel header."""
    return text.lstrip().startswith(_OPENING_TAGS)


def starts_harmony(text: str) -> bool:
    """Whether a reply's start is (or may become) a harmony channel header."""
    stripped = text.lstrip()
    if not stripped:
        return False
    return opens_harmony(stripped) or any(tag.startswith(stripped) for tag in _OPENING_TAGS)


class HarmonySplitter:
    """Streamed harmony text -> thinking and content pieces (see the module docstring); the
    same interface as thinking.ThinkingSplitter. Only a header's end is waited for: bodies
    stream as they come, holding back only what could start the next tag."""

    def __init__(self) -> None:
        self._held = ""
        self._header: str | None = ""  # the header being read, or None inside a body
        self._kind = CONTENT
        self._raw = False  # a message to a function: passed on with its header

    def feed(self, text: str) -> list[tuple[str, str]]:
        text = self._held + text
        self._held = ""
        pieces: list[tuple[str, str]] = []
        while text:
            if self._header is not None:  # reading "<|start|>assistant ... <|message|>"
                text = self._header + text
                at = text.find(MESSAGE)
                if at < 0:
                    self._header = text
                    break
                header, text = text[: at + len(MESSAGE)], text[at + len(MESSAGE) :]
                self._header = None
                self._raw = "to=" in header
                channel = header.split(CHANNEL, 1)[-1]
                self._kind = THINKING if channel.startswith("analysis") else CONTENT
                if self._raw:
                    pieces.append((CONTENT, header))
                continue
            ends = [i for i in (text.find(END), text.find(START)) if i >= 0]
            if ends:  # the body ends; a header follows
                at = min(ends)
                pieces.append((CONTENT if self._raw else self._kind, text[:at]))
                if text.startswith(END, at):
                    at += len(END)
                text, self._header = text[at:], ""
                continue
            keep = max(partial_tag_length(text, END), partial_tag_length(text, START))
            body, self._held = text[: len(text) - keep], text[len(text) - keep :]
            pieces.append((CONTENT if self._raw else self._kind, body))
            break
        return [(kind, piece) for kind, piece in pieces if piece]

    def flush(self) -> list[tuple[str, str]]:
        held, self._held = self._held, ""
        if self._header:  # a header cut off: nothing the user should see
            self._header = ""
            return []
        return [(CONTENT if self._raw else self._kind, held)] if held else []


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def calls(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(the content that is not a call, [(function name, arguments JSON text)]) of a reply's
    content as HarmonySplitter passes it on (calls with their headers)."""
    found, kept = [], []
    last = 0
    for m in _CALL.finditer(text):
        recipient = _RECIPIENT.search(m.group(1) + " " + m.group(2))
        if recipient is None:
            continue
        body = m.group(3).strip()
        try:
            arguments = json.dumps(json.loads(body), ensure_ascii=False) if body else "{}"
        except ValueError:
            arguments = body  # passed on as written: the client sees what the model wrote
        found.append((recipient.group(1), arguments))
        kept.append(text[last : m.start()])
        last = m.end()
    kept.append(text[last:])
    return "".join(kept).strip() if found else text, found
