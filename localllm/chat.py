"""The conversation with a model, and the interactive chat on a terminal.

`Conversation` holds the messages and the generation options, turns them into prompt ids through
`localllm.prompt` and streams replies from `stream_generate`; the KV cache keeps the conversation
so far, so each turn prefills only its new tokens. `ChatSession` is the `>>> ` loop around it:
slash commands, `\"\"\"` multi-line input, Ctrl-C, and saving the conversation as JSON.

Ctrl-C while a reply streams stops it; the partial reply stays in the conversation (as Ollama
keeps it), so the model sees what it already said. A turn interrupted before any text appeared
is dropped, question and all.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TextIO

from localllm.errors import LocalLLMError
from localllm.generate import GenerationResponse, stream_generate
from localllm.gguf import GGUFFile
from localllm.models import Model
from localllm.prompt import chat_prompt_ids, chat_template, raw_prompt_ids
from localllm.sampling import DEFAULTS, LogitsProcessor, Sampler
from localllm.sampling import make_logits_processors as _make_logits_processors
from localllm.sampling import make_sampler as _make_sampler

ROLES = ("system", "user", "assistant")
SAVE_FORMAT = "localllm-conversation"


class ContextFull(LocalLLMError):
    """The conversation no longer fits in the model's context (n_tokens of n_ctx)."""

    def __init__(self, n_tokens: int, n_ctx: int, what: str = "the prompt") -> None:
        self.n_tokens, self.n_ctx = n_tokens, n_ctx
        super().__init__(
            f"{what} is {n_tokens} tokens, which leaves no room for a reply in the context of "
            f"{n_ctx} tokens; use a larger -c/--ctx-size, a shorter prompt, or --truncate to "
            "keep its end"
        )


# ---------------------------------------------------------------------------------------------
# Options


@dataclass
class Options:
    """Sampling and length settings: the `run` flags, changed in a chat with `/set NAME VALUE`."""

    temperature: float = DEFAULTS["temperature"]
    top_k: int = DEFAULTS["top_k"]
    top_p: float = DEFAULTS["top_p"]
    min_p: float = DEFAULTS["min_p"]
    repeat_penalty: float = DEFAULTS["repeat_penalty"]
    seed: int | None = None
    num_predict: int = -1  # tokens per reply at most; -1: until end of text or a full context

    def sampler(self) -> Sampler:
        """A fresh sampler (with a seed, each reply restarts the same random sequence)."""
        return _make_sampler(self.temperature, self.top_k, self.top_p, self.min_p, self.seed)

    def logits_processors(self) -> list[LogitsProcessor]:
        return _make_logits_processors(self.repeat_penalty)

    def max_tokens(self, n_ctx: int) -> int:
        """num_predict as stream_generate takes it: the context bounds an unlimited reply."""
        return n_ctx if self.num_predict < 0 else self.num_predict

    def set(self, name: str, value: str) -> None:
        """Set one option from text, validated; raises LocalLLMError for a bad name or value."""
        types = {f.name: f.type for f in fields(self)}
        if name not in types:
            raise LocalLLMError(f"unknown parameter {name!r}; one of: {', '.join(types)}")
        try:
            if name == "seed" and value.lower() in ("none", "random", "-1"):
                parsed: Any = None
            elif "int" in str(types[name]):
                parsed = int(value)
            else:
                parsed = float(value)
                if not math.isfinite(parsed):
                    raise ValueError(value)
        except ValueError:
            raise LocalLLMError(f"{name} needs a number, got {value!r}") from None
        if name == "num_predict" and parsed < -1:
            raise LocalLLMError("num_predict must be -1 (no limit) or more")
        candidate = Options(**{**asdict(self), name: parsed})
        candidate.sampler()  # the sampler's own checks say what is out of range
        candidate.logits_processors()
        setattr(self, name, parsed)


# ---------------------------------------------------------------------------------------------
# The conversation


class Conversation:
    """Messages exchanged with one model, and how they become a prompt.

    With `raw`, there is no chat template: the conversation is one running text (what was typed
    followed by what the model wrote), completed as it stands.
    """

    def __init__(
        self,
        model: Model,
        system: str | None = None,
        raw: bool = False,
        options: Options | None = None,
    ) -> None:
        if raw and system:
            raise LocalLLMError("a system prompt needs the chat template; drop --raw or --system")
        self.model = model
        self.system = system
        self.raw = raw
        self.options = options or Options()
        self.messages: list[dict[str, str]] = []  # user and assistant turns, alternating

    def all_messages(self) -> list[dict[str, str]]:
        """The conversation as the template sees it: the system message first, if any."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.messages

    def prompt_ids(self) -> list[int]:
        """Token ids of the whole conversation, ready for the next reply."""
        if self.raw:
            return raw_prompt_ids(self.model, "".join(m["content"] for m in self.messages))
        return chat_prompt_ids(self.model, self.all_messages())

    def ask(self, text: str, truncate: bool = False) -> tuple[list[int], int]:
        """Add a user turn; return (prompt ids, prompt tokens dropped to make it fit).

        A prompt that leaves no room in the context raises ContextFull (and the turn is not
        added), unless `truncate` is set: then the start of this turn's text is dropped so that
        the prompt leaves room for a reply (num_predict tokens, or a quarter of the context).
        """
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self.prompt_ids()
            n_ctx = self.model.n_ctx
            if not truncate:
                if len(ids) >= n_ctx:
                    what = "the conversation" if len(self.messages) > 1 else "the prompt"
                    raise ContextFull(len(ids), n_ctx, what)
                return ids, 0
            return self._truncate(ids, n_ctx - self._reply_room(n_ctx))
        except BaseException:
            self.messages.pop()
            raise

    def _reply_room(self, n_ctx: int) -> int:
        predict = self.options.num_predict
        return min(predict, n_ctx // 2) if predict > 0 else n_ctx // 4

    def _truncate(self, ids: list[int], budget: int) -> tuple[list[int], int]:
        """Drop the start of the last user turn's text until the prompt is at most `budget`."""
        if len(ids) <= budget:
            return ids, 0
        tokenizer = self.model.tokenizer
        turn = self.messages[-1]
        text_ids = tokenizer.encode(turn["content"], add_special=False, parse_special=False)
        keep = len(text_ids) - (len(ids) - budget)
        # Decoding a cut and re-rendering can shift the count by a token or two: shrink again.
        while keep > 0:
            turn["content"] = tokenizer.decode(text_ids[-keep:])
            ids = self.prompt_ids()
            if len(ids) <= budget:
                return ids, len(text_ids) - keep
            keep -= len(ids) - budget
        raise LocalLLMError(
            f"the context size of {self.model.n_ctx} is too small even for the template and "
            "system prompt around the text; use a larger -c/--ctx-size"
        )

    def generate(self, prompt_ids: list[int]) -> Reply:
        """Stream the reply to the turn `ask` just added; it is recorded when the stream ends.

        Stopped early (Ctrl-C, or `close()`), the text so far is kept as the reply; with no text
        yet, the unanswered turn is dropped.
        """
        options = self.options
        responses = stream_generate(
            self.model,
            prompt_ids,
            max_tokens=options.max_tokens(self.model.n_ctx),
            sampler=options.sampler(),
            logits_processors=options.logits_processors(),
        )
        return Reply(self, responses)

    def _record(self, reply: str) -> None:
        if reply:
            self.messages.append({"role": "assistant", "content": reply})
        elif self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()

    def reply(self, text: str) -> Reply:
        """Ask and stream the answer (raises ContextFull before streaming if it cannot fit)."""
        ids, _ = self.ask(text)
        return self.generate(ids)

    def context_is_full(self) -> bool:
        """Whether the KV cache has no room left (a reply that stopped there was cut short)."""
        cache = self.model.transformer.cache
        return cache.n_past >= cache.n_ctx

    def clear(self) -> None:
        """Forget the turns (the system prompt and options stay)."""
        self.messages.clear()

    # -- saving ---------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The conversation (system message first) and its options, as `/save` writes them."""
        return {
            "format": SAVE_FORMAT,
            "version": 1,
            "model": self.model.path.name,
            "raw": self.raw,
            "options": asdict(self.options),
            "messages": self.all_messages(),
        }

    def load_json(self, data: Any, where: str = "the conversation") -> None:
        """Replace the conversation with a saved one (or a plain list of messages)."""
        if isinstance(data, dict):
            messages = data.get("messages")
            options = data.get("options") or {}
        else:
            messages, options = data, {}
        if not isinstance(messages, list) or not isinstance(options, dict):
            raise LocalLLMError(f"{where} is not a saved conversation (no list of messages)")
        for i, m in enumerate(messages):
            is_message = isinstance(m, dict) and isinstance(m.get("content"), str)
            if not is_message or m.get("role") not in ROLES or (m["role"] == "system" and i != 0):
                raise LocalLLMError(
                    f"{where}: message {i + 1} is not a {{role, content}} pair with role "
                    "user or assistant (system only first)"
                )
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
        new_options = Options(**asdict(self.options))
        for name, value in options.items():
            new_options.set(str(name), str(value))
        if self.raw and system:
            raise LocalLLMError(f"{where} has a system prompt, which --raw cannot use")
        self.options = new_options
        self.system = system
        self.messages = [dict(m) for m in messages[1 if system is not None else 0 :]]

    def save(self, path: Path) -> None:
        try:
            path.write_text(json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n")
        except OSError as e:
            raise LocalLLMError(f"cannot write {path}: {e.strerror or e}") from None

    def load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise LocalLLMError(f"no such file: {path}") from None
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise LocalLLMError(f"cannot read {path} as JSON: {e}") from None
        self.load_json(data, str(path))


class Reply:
    """One reply as it streams: iterate for GenerationResponses. It records itself in the
    conversation when it ends, is closed, or is interrupted, even before its first token."""

    def __init__(self, conversation: Conversation, responses: Iterator[GenerationResponse]):
        self._conversation = conversation
        self._responses = responses
        self._pieces: list[str] = []
        self._closed = False

    def __iter__(self) -> Reply:
        return self

    def __next__(self) -> GenerationResponse:
        if self._closed:
            raise StopIteration
        try:
            response = next(self._responses)
        except BaseException:  # the end, an error, or Ctrl-C inside the model
            self.close()
            raise
        self._pieces.append(response.text)
        return response

    def close(self) -> None:
        """Stop generating and record the text so far (only once)."""
        if self._closed:
            return
        self._closed = True
        self._responses.close()
        self._conversation._record("".join(self._pieces))


# ---------------------------------------------------------------------------------------------
# Describing a model and a generation (shared by `localllm show`, `/show` and --verbose)


def describe_model(gguf: GGUFFile, quant: str | None = None) -> dict[str, Any]:
    """What `show` prints: architecture, parameter count (from tensor shapes), context length,
    quantization, tensor types, chat template and license, all from the GGUF itself."""
    metadata = gguf.metadata
    arch = str(metadata.get("general.architecture", ""))
    tensor_types: dict[str, int] = {}
    n_params = 0
    for tensor in gguf.tensors.values():
        n_params += math.prod(tensor.shape)
        try:
            type_name = tensor.type_name
        except ValueError:
            type_name = f"type {tensor.ggml_type}"
        tensor_types[type_name] = tensor_types.get(type_name, 0) + 1
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, bytes):
        template = template.decode("utf-8", errors="replace")
    if template:
        template_name = "gguf"
    else:
        from localllm.chat_template import builtin_template

        tokens = metadata.get("tokenizer.ggml.tokens") or []
        template_name, template = builtin_template(arch, tokens)
    return {
        "name": metadata.get("general.name"),
        "architecture": arch or None,
        "parameters": n_params,
        "context_length": metadata.get(f"{arch}.context_length"),
        "embedding_length": metadata.get(f"{arch}.embedding_length"),
        "layers": metadata.get(f"{arch}.block_count"),
        "quantization": quant,
        "tensor_types": dict(sorted(tensor_types.items(), key=lambda kv: -kv[1])),
        "chat_template": template,
        "chat_template_source": "file" if template_name == "gguf" else f"built-in {template_name}",
        "license": metadata.get("general.license"),
        "file": str(gguf.path),
        "file_size": gguf.file_size,
    }


def printable(value: Any) -> str:
    """Text from a model file with control characters escaped, never sent raw to a terminal."""
    text = str(value)
    return "".join(c if c.isprintable() or c == "\t" else repr(c)[1:-1] for c in text)


def format_count(n: int) -> str:
    """134515008 -> '134.52M' (parameter counts, as Ollama shows them)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def format_stats(
    response: GenerationResponse, load_seconds: float | None, total_seconds: float
) -> str:
    """Ollama's --verbose block: durations, token counts and rates of one generation."""
    n_prefilled = response.prompt_tokens - response.cached_tokens
    prompt_s = n_prefilled / response.prompt_tps if response.prompt_tps > 0 else 0.0
    n_timed = response.generation_tokens - 1  # the first token's time counts as prompt eval
    eval_s = n_timed / response.generation_tps if response.generation_tps > 0 else 0.0
    cached = f" ({response.cached_tokens} cached)" if response.cached_tokens else ""
    rows = [("total duration", _seconds(total_seconds))]
    if load_seconds is not None:
        rows.append(("load duration", _seconds(load_seconds)))
    rows += [
        ("prompt eval count", f"{response.prompt_tokens} token(s){cached}"),
        ("prompt eval duration", _seconds(prompt_s)),
        ("prompt eval rate", f"{response.prompt_tps:.2f} tokens/s"),
        ("eval count", f"{response.generation_tokens} token(s)"),
        ("eval duration", _seconds(eval_s)),
        ("eval rate", f"{response.generation_tps:.2f} tokens/s"),
    ]
    return "\n".join(f"{name + ':':<22}{value}" for name, value in rows)


def _seconds(s: float) -> str:
    return f"{s * 1000:.2f}ms" if s < 1 else f"{s:.3f}s"


# ---------------------------------------------------------------------------------------------
# The interactive session

HELP = """\
Available commands:
  /set system TEXT        Set the system prompt (/set system alone removes it)
  /set NAME VALUE         Set a parameter: temperature, top_k, top_p, min_p, repeat_penalty,
                          seed (none for random), num_predict (-1: no limit)
  /set verbose | quiet    Show or hide timing statistics after each reply
  /show [WHAT]            Show info, parameters, system, template, license or history
  /clear                  Forget the conversation (the system prompt and parameters stay)
  /save FILE              Save the conversation as JSON
  /load FILE              Load a conversation saved with /save
  /bye                    Exit (so does Ctrl-D)
  /?, /help               This help

Use \"\"\" to begin and end a multi-line message.
Ctrl-C stops a reply; what was written so far stays in the conversation.
"""


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
    ) -> None:
        self.conversation = conversation
        self.name = name
        self.verbose = verbose
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.read = read

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
        try:
            with contextlib.closing(conversation.reply(text)) as replies:
                for last in replies:
                    self.out.write(last.text)
                    self.out.flush()
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
        elif name and value:
            self.conversation.options.set(name, value)
            self._say(f"Set parameter {name!r} to {value!r}.", self.out)
        else:
            raise LocalLLMError("usage: /set system TEXT, /set NAME VALUE, /set verbose|quiet")

    def _show(self, what: str) -> None:
        conversation = self.conversation
        model = conversation.model
        if what == "info":
            info = describe_model(model.gguf)
            cache = model.transformer.cache
            rows = [
                ("model", self.name),
                ("architecture", info["architecture"]),
                ("parameters", format_count(info["parameters"])),
                ("context length", f"{model.n_ctx} ({cache.n_past} in use)"),
                ("training context", info["context_length"]),
            ]
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
