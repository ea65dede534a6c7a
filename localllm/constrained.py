"""Constrained decoding: JSON, or JSON that follows a schema, through llguidance.

llguidance compiles a JSON schema into a grammar and gives, at each step, the mask of the tokens
that keep the output inside it; its tokenizer is built from the GGUF vocabulary's bytes (once
per model). `json_processor` is a logits processor (sampling.LogitsProcessor) for the one
generate loop: it feeds the tokens sampled since its last call to the matcher and sets every
other token's logit to -inf, so the reply is valid JSON of the schema and ends (end of text)
when the value is complete.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from localllm.errors import LocalLLMError
from localllm.models import Model

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # OpenAI's json_object, Ollama's "json"


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: token bytes (control tokens marked with a
    0xff prefix, as its llama.cpp bridge does), the end tokens and a tokenize function."""

    def __init__(self, model: Model) -> None:
        tokenizer = model.tokenizer
        tokens, special = [], []
        for i in range(tokenizer.vocab_size):
            piece = tokenizer.token_to_bytes(i)
            if tokenizer.is_special(i):
                special.append(i)
                piece = b"\xff" + piece
            tokens.append(piece)
        self.tokens = tokens
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = special
        self._tokenizer = tokenizer
        self.eog_ids = sorted(getattr(tokenizer, "eog_ids", None) or [self.eos_token_id])

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special=False, parse_special=False)


def lltokenizer(model: Model):
    """llguidance's tokenizer for this model, built once (about a second) and kept."""
    import llguidance

    cached = model.extra.get("lltokenizer")
    if cached is None:
        vocabulary = _Vocabulary(model)
        wrapper = llguidance.TokenizerWrapper(vocabulary)
        cached = llguidance.LLTokenizer(
            wrapper, n_vocab=model.config.vocab_size, eos_token=vocabulary.eog_ids
        )
        model.extra["lltokenizer"] = cached
    return cached


def json_grammar(schema: dict[str, Any] | None) -> str:
    """llguidance's grammar for JSON following `schema` (None: any JSON object).
    Raises LocalLLMError naming the problem when the schema cannot be compiled."""
    import llguidance

    if schema is not None and not isinstance(schema, dict):
        raise LocalLLMError("a JSON schema must be an object")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema if schema is not None else ANY_OBJECT)
        )
    except (ValueError, TypeError, RuntimeError) as e:
        raise LocalLLMError(f"the JSON schema cannot be used: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise LocalLLMError(f"the JSON schema cannot be used: {'; '.join(messages)}")
    return grammar


def json_processor(model: Model, schema: dict[str, Any] | None):
    """A logits processor that keeps one reply inside the schema's JSON (a fresh one per
    reply: it holds the matcher's state)."""
    return grammar_processor(model, json_grammar(schema))


def tool_call_grammar(tools: list[dict[str, Any]]) -> str:
    """A grammar for one Hermes-style call of one of `tools` (OpenAI's function tools):
    <tool_call>, {"name": ..., "arguments": {... the function's parameters}}, </tool_call>.
    What tool_choice "required" (or a named function) constrains a reply to."""
    import llguidance

    choices = []
    for tool in tools:
        function = tool.get("function") or {}
        parameters = function.get("parameters") or {"type": "object"}
        choices.append(
            {
                "type": "object",
                "properties": {"name": {"const": function.get("name")}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = choices[0] if len(choices) == 1 else {"anyOf": choices}
    lark = 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(schema)
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise LocalLLMError(f"the tools' parameters cannot be used: {'; '.join(messages)}")
    return grammar


def grammar_processor(model: Model, grammar: str):
    """A logits processor that keeps one reply inside an llguidance grammar (a fresh one per
    reply: it holds the matcher's state)."""
    import llguidance
    import llguidance.numpy as llnp

    tokenizer = lltokenizer(model)
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    if matcher.is_error():
        raise LocalLLMError(f"the grammar cannot be used: {matcher.get_error()}")
    mask = llnp.allocate_token_bitmask(1, tokenizer.vocab_size)  # int32[1, words], made once
    start: list[int] = []  # len(history) at the first call: the prompt

    def process(history: Sequence[int], logits: np.ndarray) -> np.ndarray:
        if not start:
            start.append(len(history))
        for token in history[start[0] :]:
            if not matcher.consume_token(token):
                raise LocalLLMError(f"constrained decoding failed: {matcher.get_error()}")
        start[0] = len(history)
        llnp.fill_next_token_bitmask(matcher, mask, 0)
        allowed = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: logits.shape[0]]
        return np.where(allowed.astype(bool), logits, np.float32(-np.inf)).astype(np.float32)

    return process
