"""From a conversation to prompt token ids, through the model's chat template.

The CLI's one-shot and chat modes and the server all build prompts here, so a conversation
turns into the same tokens everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from localllm.chat_template import ChatTemplate, strip_leading_bos
from localllm.models import Model


def chat_template(model: Model) -> ChatTemplate:
    """The model's template (from the file, else a built-in one), parsed once per model. An
    embedding model, which has none to generate with, is a LocalLLMError that says so."""
    model.check_generates()
    template = model.extra.get("chat_template")
    if template is None:
        template = ChatTemplate.from_metadata(model.metadata)
        model.extra["chat_template"] = template
    return template


def chat_prompt_ids(
    model: Model,
    messages: Sequence[dict],
    add_generation_prompt: bool = True,
    **template_vars: Any,
) -> list[int]:
    """Token ids for `messages` ({"role", "content"} dicts), ready to prefill.

    The template's text is tokenized with special tokens parsed; BOS appears once, at the start,
    when the template wrote it or the model's metadata asks for it. `template_vars` reach the
    template as variables (`enable_thinking`, ...).
    """
    template = chat_template(model)
    text = template.render(
        list(messages), add_generation_prompt=add_generation_prompt, **template_vars
    )
    text, had_bos = strip_leading_bos(text, template.bos_token)
    tokenizer = model.tokenizer
    ids = tokenizer.encode(text, add_special=False, parse_special=True)
    if (had_bos or tokenizer.add_bos) and tokenizer.bos_id is not None:
        ids.insert(0, tokenizer.bos_id)
    if tokenizer.add_eos and tokenizer.eos_id is not None and not add_generation_prompt:
        ids.append(tokenizer.eos_id)
    return ids


def raw_prompt_ids(model: Model, text: str) -> list[int]:
    """Token ids for plain completion (--raw): BOS/EOS as the metadata says, special text parsed
    as llama.cpp's completion mode does."""
    model.check_generates()
    return model.tokenizer.encode(text, add_special=True, parse_special=True)
