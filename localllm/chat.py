"""The interactive chat on a terminal: the `>>> ` loop around a `Conversation`.

`ChatSession` reads a message or a slash command, streams the reply, and repeats: `\"\"\"`
multi-line input, Ctrl-C, and saving the conversation as JSON. Ctrl-C while a reply streams
stops it; the partial reply stays in the conversation (see `localllm.conversation`).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from localllm.conversation import ContextFull, Conversation
from localllm.describe import describe_model, format_stats, info_rows, printable
from localllm.errors import LocalLLMError
from localllm.prompt import chat_template
from localllm.thinking import ThinkingDisplay

HELP = """\
Available commands:
  /set system TEXT        Set the system prompt (/set system alone removes it)
  /set NAME VALUE         Set a parameter: temperature, top_k, top_p, min_p, repeat_penalty,
                          seed (none for random), num_predict (-1: no limit)
  /set verbose | quiet    Show or hide timing statistics after each reply
  /set think | nothink    Thinking models: think (thoughts shown dimmed) or answer directly
  /show [WHAT]            Show info, parameters, system, template, license or history
  /clear                  Forget the conversation (the system prompt and parameters stay)
  /save FILE              Save the conversation as JSON
  /load FILE              Load a conversation saved with /save
  /bye                    Exit (so does Ctrl-D)
  /?, /help               This help

Use \"\"\" to begin and end a multi-line message.
Ctrl-C stops a reply; what was written so far stays in the conversation.
"""


class WordWrap:
    """Writes streamed text wrapped at `width` columns, breaking lines at spaces.

    Text arrives in pieces that split words anywhere, so the current word (and the spaces before
    it) is held back until a space or newline ends it; then it goes on the current line if it
    fits, else on the next one, where the spaces that stood before it are dropped. Newlines in
    the text are kept; a word longer than the line is broken where the line ends.
    """

    def __init__(self, write: Callable[[str], object], width: int) -> None:
        self._write = write
        self.width = max(1, width)
        self.column = 0  # characters on the current line
        self._spaces = ""  # written before the held word, if it stays on this line
        self._word = ""
        self._breaking = False  # the held word continues one already broken at a line's end

    def write(self, text: str) -> None:
        for char in text:
            if char == "\n":
                self.flush()
                self._write("\n")
                self.column = 0
            elif char.isspace():
                self._place_word()
                self._breaking = False
                self._spaces += char
            else:
                self._word += char
                if len(self._word) > self.width:  # too long for any line: break it now
                    self._place_word()
                    self._breaking = True

    def flush(self) -> None:
        """Write the held word (at the end of a reply, or when it is stopped)."""
        self._place_word()
        self._spaces, self._breaking = "", False

    def _place_word(self) -> None:
        if not self._word:
            return
        text = self._spaces + self._word
        self._spaces = self._word = ""
        if self.column and not self._breaking and self.column + len(text) > self.width:
            self._write("\n")
            self.column = 0
            text = text.lstrip()
        while self.column + len(text) > self.width:
            cut = self.width - self.column
            self._write(text[:cut] + "\n")
            text, self.column = text[cut:], 0
        self._write(text)
        self.column += len(text)


def terminal_width(stream: TextIO) -> int | None:
    """The width to wrap a reply at: the terminal's, or None when `stream` is not a terminal."""
    try:
        if not stream.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    return shutil.get_terminal_size().columns


class ChatSession:
    """The `>>> ` loop: read a message or a slash command, stream the reply, repeat."""

    def __init__(
        self,
        conversation: Conversation,
        name: str,
        verbose: bool = False,
        out: TextIO | None = None,
        err: TextIO | None = None,
        read: Callable[[str], str] = input,
        width: int | None = None,
    ) -> None:
        """`width`: wrap replies at this many columns; by default at the terminal's width when
        `out` is a terminal (read again for each reply), else not at all."""
        self.conversation = conversation
        self.name = name
        self.verbose = verbose
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.read = read
        self.width = width

    def run(self) -> None:
        """Chat until /bye or Ctrl-D."""
        with contextlib.suppress(ImportError):  # not on every platform
            import readline  # noqa: F401  (line editing and history for input())
        self._say("Type a message, /? for help, /bye or Ctrl-D to exit.", self.err)
        while True:
            try:
                line = self._read_message()
            except EOFError:
                self.out.write("\n")
                return
            except KeyboardInterrupt:
                self._say("\nUse Ctrl + d or /bye to exit.", self.out)
                continue
            if line is None:
                continue
            if line.startswith("/"):
                try:
                    if not self.command(line):
                        return
                except LocalLLMError as e:
                    self._say(f"Error: {e}", self.err)
                continue
            self.respond(line)

    def _read_message(self) -> str | None:
        """One message: a line, or the lines between two \"\"\" marks; None for a blank line."""
        line = self.read(">>> ")
        if not line.lstrip().startswith('"""'):
            return line.strip() or None
        first = line.lstrip()[3:]
        if first.endswith('"""'):
            return first[:-3].strip() or None
        lines = [first] if first else []
        while True:
            more = self.read("... ")
            if more.rstrip().endswith('"""'):
                lines.append(more.rstrip()[:-3])
                return "\n".join(lines).strip() or None
            lines.append(more)

    def respond(self, text: str) -> None:
        """Stream the reply to `text`; Ctrl-C stops it, and a full context is reported."""
        conversation = self.conversation
        start = time.perf_counter()
        last = None
        width = self.width or terminal_width(self.out)
        wrap = WordWrap(self.out.write, width) if width else None
        write = self.out.write if wrap is None else wrap.write
        try:
            with contextlib.closing(conversation.reply(text)) as replies:
                # thoughts dimmed on a terminal, apart from the answer (not with /set nothink)
                display = ThinkingDisplay(
                    write,
                    thinks=conversation.thinks,
                    show=conversation.think is not False,
                    dim=self.out.isatty(),
                    inside=conversation.reply_opens_thinking,
                    raw=self.out.write,
                    flush=wrap.flush if wrap is not None else None,
                )
                try:
                    for last in replies:
                        display.write(last.text)
                        self.out.flush()
                finally:  # the word held back shows before "(stopped)" or an error
                    display.close()
                    if wrap is not None:
                        wrap.flush()
        except KeyboardInterrupt:
            self.out.write("\n")
            self._say("(stopped)", self.err)
            return
        except ContextFull as e:
            self._say(
                f"The context is full ({e.n_tokens} tokens with this message, the context size "
                f"is {e.n_ctx}). Use /clear to start a new conversation.",
                self.err,
            )
            return
        except LocalLLMError as e:
            self._say(f"\nError: {e}", self.err)
            return
        except Exception as e:  # a bug: report it and keep the conversation rather than crash
            self._say(f"\nError: {type(e).__name__}: {e}", self.err)
            return
        self.out.write("\n\n")
        self.out.flush()
        if last is not None and last.finish_reason == "length" and conversation.context_is_full():
            self._say(
                "The context is full, so the reply was cut short. "
                "Use /clear to start a new conversation.",
                self.err,
            )
        if self.verbose and last is not None:
            self._say(format_stats(last, None, time.perf_counter() - start) + "\n", self.err)

    def command(self, line: str) -> bool:
        """Run one slash command; False means exit."""
        word, _, rest = line.partition(" ")
        rest = rest.strip()
        conversation = self.conversation
        if word in ("/bye", "/exit", "/quit"):
            return False
        if word in ("/?", "/help"):
            self._say(HELP, self.out)
        elif word == "/clear":
            conversation.clear()
            self._say("Cleared the conversation.", self.out)
        elif word == "/set":
            self._set(rest)
        elif word == "/show":
            self._show(rest or "info")
        elif word in ("/save", "/load"):
            if not rest:
                raise LocalLLMError(f"usage: {word} FILE")
            path = Path(rest).expanduser()
            if word == "/save":
                conversation.save(path)
                self._say(f"Saved {len(conversation.messages)} messages to {path}.", self.out)
            else:
                conversation.load(path)
                self._say(f"Loaded {len(conversation.messages)} messages from {path}.", self.out)
        else:
            self._say(f"Unknown command {word!r}. Type /? for help.", self.err)
        return True

    def _set(self, rest: str) -> None:
        name, _, value = rest.partition(" ")
        value = value.strip()
        if name == "parameter":  # Ollama's spelling: /set parameter NAME VALUE
            name, _, value = value.partition(" ")
            value = value.strip()
        if name == "system":
            if self.conversation.raw and value:
                raise LocalLLMError("a system prompt needs the chat template (this is --raw)")
            self.conversation.system = value or None
            self._say("Set the system prompt." if value else "Removed the system prompt.", self.out)
        elif name in ("verbose", "quiet"):
            self.verbose = name == "verbose"
            self._say(f"Set {name} mode.", self.out)
        elif name in ("think", "nothink") and not value:
            if not self.conversation.thinks:
                raise LocalLLMError(f"{self.name} is not a thinking model")
            self.conversation.think = name == "think"
            self._say("Set 'think' mode." if name == "think" else "Set 'nothink' mode.", self.out)
        elif name and value:
            self.conversation.options.set(name, value)
            self._say(f"Set parameter {name!r} to {value!r}.", self.out)
        else:
            raise LocalLLMError("usage: /set system TEXT, /set NAME VALUE, /set verbose|quiet")

    def _show(self, what: str) -> None:
        conversation = self.conversation
        model = conversation.model
        if what == "info":
            # `show`'s rows, with the context this chat runs in next to the training one.
            rows = [("model", self.name)]
            for key, value in info_rows(describe_model(model.gguf)):
                if key == "context length":
                    in_use = model.transformer.cache.n_past
                    rows.append(("context length", f"{model.n_ctx} ({in_use} in use)"))
                    key = "training context"
                rows.append((key, value if value is not None else "-"))
            self._say("\n".join(f"  {k:<18}{printable(v)}" for k, v in rows), self.out)
        elif what == "parameters":
            options = asdict(conversation.options)
            self._say("\n".join(f"  {k:<16}{v}" for k, v in options.items()), self.out)
        elif what == "system":
            self._say(conversation.system or "No system prompt is set.", self.out)
        elif what == "template":
            template = "(none: --raw)" if conversation.raw else chat_template(model).source
            self._say("\n".join(printable(line) for line in template.splitlines()), self.out)
        elif what == "license":
            self._say(printable(model.metadata.get("general.license") or "No license."), self.out)
        elif what == "history":
            messages = conversation.all_messages()
            if not messages:
                self._say("The conversation is empty.", self.out)
            for m in messages:
                self._say(f"{m['role']}: {m['content']}", self.out)
        else:
            raise LocalLLMError("usage: /show [info|parameters|system|template|license|history]")

    @staticmethod
    def _say(text: str, stream: TextIO) -> None:
        stream.write(text + "\n")
        stream.flush()
