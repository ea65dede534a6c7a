"""The conversation with a model: its messages, how they become a prompt, and its replies.

`Conversation` holds the messages and the generation options, turns them into prompt ids through
`localllm.prompt` and streams replies from `stream_generate`; the KV cache keeps the conversation
so far, so each turn prefills only its new tokens. It is what the one-shot `run` and the chat
(`localllm.chat.ChatSession`) both talk to.

A reply stopped early (Ctrl-C, or `Reply.close()`) stays in the conversation as far as it got
(as Ollama keeps it), so the model sees what it already said. A turn stopped before any text
appeared is dropped, question and all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError
from localllm.generate import GenerationResponse, stream_generate
from localllm.models import Model
from localllm.options import Options
from localllm.prompt import chat_prompt_ids, chat_template, raw_prompt_ids
from localllm.prompt_cache import PromptCache
from localllm.thinking import prompt_opens_thinking, template_thinks
from localllm.thinking import split as split_thinking

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
        model.check_generates()
        self.model = model
        self.system = system
        self.raw = raw
        self.options = options or Options()
        self.messages: list[dict[str, str]] = []  # user and assistant turns, alternating
        # Thinking models (thinking.py): None leaves thinking as the template has it; True or
        # False reach the template as enable_thinking (`--think` / `--no-think`, /set think).
        self.think: bool | None = None
        self.reply_opens_thinking = False  # the last prompt ended inside <think>
        # JSON output (constrained.py, `--format`): False for text, None for any JSON object,
        # else the JSON schema the replies follow.
        self.json_schema: Any = False
        # The prompt cache on disk (prompt_cache.py, `--prompt-cache`): None keeps none.
        self.prompt_cache: PromptCache | None = None

    def use_prompt_cache(self) -> None:
        """Read prompts back from the prompt cache on disk and write replies to it."""
        if PromptCache.usable(self.model.transformer.cache):
            self.prompt_cache = PromptCache(self.model.path, self.model.transformer.cache)

    def all_messages(self) -> list[dict[str, str]]:
        """The conversation as the template sees it: the system message first, if any."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.messages

    def prompt_ids(self) -> list[int]:
        """Token ids of the whole conversation, ready for the next reply."""
        if self.raw:
            return raw_prompt_ids(self.model, "".join(m["content"] for m in self.messages))
        extra = {"enable_thinking": self.think} if self.think is not None else {}
        ids = chat_prompt_ids(self.model, self.all_messages(), **extra)
        self.reply_opens_thinking = self.thinks and prompt_opens_thinking(self.model.tokenizer, ids)
        return ids

    @property
    def thinks(self) -> bool:
        """Whether the model is a thinking model (its chat template says so)."""
        return not self.raw and template_thinks(chat_template(self.model).source)

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
        processors = options.logits_processors()
        if self.json_schema is not False:
            from localllm.constrained import json_processor

            processors = [*processors, json_processor(self.model, self.json_schema)]
        # the pool's prefix cache: a conversation this session ran before (a /load of it, the
        # same system prompt after a different one) starts from its pages
        self.model.transformer.cache.reuse_best(prompt_ids)
        if self.prompt_cache is not None:
            self.prompt_cache.restore(self.model.transformer.cache, prompt_ids)
        responses = stream_generate(
            self.model,
            prompt_ids,
            max_tokens=options.max_tokens(self.model.n_ctx),
            sampler=options.sampler(),
            logits_processors=processors,
        )
        return Reply(self, responses)

    def _record(self, reply: str) -> None:
        if self.prompt_cache is not None:
            self.prompt_cache.store(self.model.transformer.cache)
        if reply and self.thinks:  # the history keeps the answer, as thinking templates expect
            reply = split_thinking(reply, self.reply_opens_thinking)[1]
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
