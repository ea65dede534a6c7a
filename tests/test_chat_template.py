"""Chat templates: the real ones in the test models, the built-ins, and hostile templates."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import pytest
from jinja2.sandbox import MAX_RANGE
from real_models import model_path

from localllm.chat_template import (
    MAX_LENGTH,
    MAX_STEPS,
    ChatTemplate,
    builtin_template,
    strip_leading_bos,
)
from localllm.errors import LocalLLMError
from localllm.gguf import read_gguf

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]


@functools.cache
def file_metadata(name: str) -> dict[str, Any]:
    """The metadata of a real test model, read once per test session."""
    with read_gguf(model_path(name)) as gguf_file:
        return gguf_file.metadata


def render_source(source: str, messages: list[dict] | None = None, **extra: Any) -> str:
    return ChatTemplate(source).render(messages or [], **extra)


# --- the real templates -------------------------------------------------------------------------


def test_smollm2_template_from_file():
    template = ChatTemplate.from_metadata(file_metadata("smollm2-135m"))
    assert not template.is_builtin
    assert template.source == file_metadata("smollm2-135m")["tokenizer.chat_template"]
    assert (template.bos_token, template.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert template.render(CONVERSATION) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Without a system message SmolLM's template writes its own.
    assert template.render(CONVERSATION[1:2], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_qwen_template_from_file():
    template = ChatTemplate.from_metadata(file_metadata("qwen2.5-coder-0.5b"))
    assert not template.is_builtin
    assert (template.bos_token, template.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert template.render(CONVERSATION) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert template.render(CONVERSATION[1:2]) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    # Qwen writes no BOS and the file does not ask for one.
    assert strip_leading_bos(template.render(CONVERSATION), template.bos_token)[1] is False


def test_qwen_tools_use_transformers_tojson():
    """Non-ASCII and <>&' stay as they are, keys keep their order, separators are ', ' ': '."""
    template = ChatTemplate.from_metadata(file_metadata("qwen2.5-coder-0.5b"))
    tool = {
        "type": "function",
        "function": {"name": "weather", "description": "Météo <now> & 'here'", "parameters": {}},
    }
    messages = [
        {"role": "user", "content": "Zürich?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "weather", "arguments": {"z": 1, "city": "Zürich"}}}
            ],
        },
        {"role": "tool", "content": "12°C"},
    ]
    assert template.render(messages, tools=[tool]) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "weather", '
        '"description": "Météo <now> & \'here\'", "parameters": {}}}'
        "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nZürich?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": '
        '{"z": 1, "city": "Zürich"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n12°C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_long_conversation_fits_the_step_budget():
    template = ChatTemplate.from_metadata(file_metadata("qwen2.5-coder-0.5b"))
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}] * 5000
    text = template.render(turns)
    assert text.count("<|im_start|>") == 1 + 10_000 + 1


def test_gemma3_has_no_template_and_gets_the_builtin():
    metadata = file_metadata("gemma3-270m")
    assert "tokenizer.chat_template" not in metadata
    template = ChatTemplate.from_metadata(metadata)
    assert template.is_builtin and template.name == "gemma"
    text = template.render(CONVERSATION)
    # The system prompt opens the first user turn; the template writes BOS itself.
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\n2+2?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    rest, had_bos = strip_leading_bos(text, template.bos_token)
    assert had_bos and rest == text.removeprefix("<bos>")
    assert metadata["tokenizer.ggml.add_bos_token"] is True  # so the caller adds BOS: just once


# --- built-in templates -------------------------------------------------------------------------


def synthetic_metadata(architecture: str, tokens: list[str], bos: int, eos: int) -> dict:
    return {
        "general.architecture": architecture,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.bos_token_id": bos,
        "tokenizer.ggml.eos_token_id": eos,
    }


def test_builtin_chatml_for_im_start_vocab():
    metadata = synthetic_metadata("qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 0, 2)
    template = ChatTemplate.from_metadata(metadata)
    assert template.is_builtin and template.name == "chatml"
    assert template.render(CONVERSATION[:2]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_builtin_llama3_for_header_vocab():
    tokens = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|eot_id|>"]
    template = ChatTemplate.from_metadata(synthetic_metadata("llama", tokens, 0, 3))
    assert template.name == "llama3"
    assert template.render(CONVERSATION) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_builtin_llama2_otherwise():
    metadata = synthetic_metadata("llama", ["<unk>", "<s>", "</s>"], 1, 2)
    template = ChatTemplate.from_metadata(metadata)
    assert template.name == "llama2"
    assert template.render(CONVERSATION) == (
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] 2+2? [/INST]"
    )


def test_builtin_gemma_by_architecture_and_role_alternation():
    metadata = synthetic_metadata("gemma2", ["<pad>", "<eos>", "<bos>", "<|im_start|>"], 2, 1)
    template = ChatTemplate.from_metadata(metadata)
    assert template.name == "gemma"
    assert template.render(CONVERSATION[1:2], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n"
    )
    with pytest.raises(LocalLLMError, match="chat template error: Conversation roles must"):
        template.render([{"role": "assistant", "content": "first"}])


def test_builtin_choice_and_token_lookup():
    assert builtin_template("gemma3", [])[0] == "gemma"
    assert builtin_template("smollm", ["<|im_start|>"])[0] == "chatml"
    assert builtin_template("llama", ["<|start_header_id|>"])[0] == "llama3"
    assert builtin_template("mistral", ["<s>"])[0] == "llama2"
    # tokens given explicitly win; ids missing or out of range give empty strings
    metadata = {"general.architecture": "llama", "tokenizer.ggml.bos_token_id": 7}
    template = ChatTemplate.from_metadata(metadata, tokens=["<|im_start|>"])
    assert (template.name, template.bos_token, template.eos_token) == ("chatml", "", "")


def test_file_template_wins_over_builtin():
    metadata = synthetic_metadata("gemma3", ["<bos>"], 0, 0)
    metadata["tokenizer.chat_template"] = "{{ bos_token }}{{ messages[0]['content'] }}"
    template = ChatTemplate.from_metadata(metadata)
    assert not template.is_builtin and template.name == "gguf"
    assert template.render([{"role": "user", "content": "x"}]) == "<bos>x"


def test_strip_leading_bos():
    assert strip_leading_bos("<s>[INST] a [/INST]", "<s>") == ("[INST] a [/INST]", True)
    assert strip_leading_bos("a<s>", "<s>") == ("a<s>", False)
    assert strip_leading_bos("abc", "") == ("abc", False)


# --- the environment transformers provides ------------------------------------------------------


def test_trim_blocks_lstrip_blocks_and_loop_controls():
    source = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'skip' %}\n"
        "        {% continue %}\n"
        "    {% endif %}\n"
        "    {% if m.role == 'stop' %}{% break %}{% endif %}\n"
        "{{ m.content }}\n"
        "{% endfor %}\n"
    )
    roles = ["user", "skip", "user", "stop", "user"]
    messages = [{"role": role, "content": f"m{i}"} for i, role in enumerate(roles)]
    assert render_source(source, messages) == "m0\nm2\n"


def test_tojson_matches_transformers():
    value = {"b": "é<>&'", "a": [1, None, True]}
    assert render_source("{{ v | tojson }}", v=value) == json.dumps(value, ensure_ascii=False)
    assert render_source("{{ v | tojson(indent=2) }}", v=value) == json.dumps(
        value, ensure_ascii=False, indent=2
    )
    assert render_source("{{ v | tojson }}", v=value).startswith('{"b": "é<>&\'"')


def test_variables_and_helpers():
    assert render_source("{{ add_generation_prompt }} {{ tools }}") == "True None"
    before = datetime.now()
    date_string, year = render_source("{{ date_string }}|{{ strftime_now('%Y') }}").split("|")
    after = datetime.now()
    assert date_string in {before.strftime("%d %b %Y"), after.strftime("%d %b %Y")}
    assert year in {before.strftime("%Y"), after.strftime("%Y")}
    assert render_source("{{ date_string }}", date_string="26 Jul 2024") == "26 Jul 2024"
    assert render_source("{{ 'a' ~ n ~ none ~ [1] }}", n=2) == "a2None[1]"
    with pytest.raises(LocalLLMError, match="^chat template error: no system role$"):
        render_source("{{ raise_exception('no system role') }}")


def test_template_bugs_are_user_errors():
    with pytest.raises(LocalLLMError, match="chat template error: UndefinedError"):
        render_source("{{ messages[0].content.upper() }}")
    with pytest.raises(LocalLLMError, match="chat template error: RecursionError"):
        render_source("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}")


# --- hostile templates --------------------------------------------------------------------------

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for x in ().__class__.__base__.__subclasses__() %}{{ x }}{% endfor %}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ self.__init__.__globals__.__builtins__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__['__builtins__'] }}",
    "{{ range.__globals__ }}",
    "{{ messages.__class__ }}",
    "{{ ''|attr('__class__') }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ [].append.__self__ }}",
    "{% set x = [] %}{{ x.append(1) }}",
    "{{ messages.pop() }}",
    "{{ messages[0].update({'role': 'hacked'}) }}",
    "{{ lipsum.__globals__ }}",  # lipsum is gone, and its __globals__ would be refused
    "{{ config.items() }}",
]


@pytest.mark.parametrize("source", ESCAPES)
def test_sandbox_escapes_are_refused(source):
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(LocalLLMError, match="^chat template (is unsafe or invalid|error): "):
        ChatTemplate(source).render(messages)
    assert messages == [{"role": "user", "content": "x"}]


def test_unknown_globals_are_empty():
    # Names a web framework would expose do not exist here: they render as nothing.
    assert render_source("{{ config }}{{ request }}{{ settings }}") == ""


SHELL_PAYLOADS = [
    "{{ cycler.__init__.__globals__.os.popen('touch PATH').read() }}",
    "{{ joiner.__init__.__globals__.os.system('touch PATH') }}",
    "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch PATH') }}",
    "{{ lipsum.__globals__['os'].popen('touch PATH').read() }}",
    "{% for c in ''.__class__.__mro__[1].__subclasses__() %}"
    "{% if c.__name__ == 'Popen' %}{{ c('touch PATH', shell=True) }}{% endif %}{% endfor %}",
    "{{ raise_exception.__globals__['__builtins__']['__import__']('os').system('touch PATH') }}",
]


@pytest.mark.parametrize("source", SHELL_PAYLOADS)
def test_shell_payload_creates_no_file(source, tmp_path):
    target = tmp_path / "pwned"
    with pytest.raises(LocalLLMError):
        render_source(source.replace("PATH", str(target)))
    assert not target.exists()


RESOURCE_BOMBS = [
    "{{ 'a' * 10**10 }}",
    "{{ [0] * 10**10 }}",
    "{{ 10**10 * 'a' }}",
    "{{ 2 ** 100000 }}",
    "{{ (2 ** 4000) * (2 ** 4000) }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}",
    "{% set ns = namespace(s='a') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s.replace('a', 'aa') %}{% endfor %}",
    "{{ 'a'.center(10**10) }}",
    "{{ 'a' | center(1000000000) }}",
    "{{ 'a\nb' | indent(1000000000) }}",
    "{{ range(10**10) | length }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}",
]


@pytest.mark.parametrize("source", RESOURCE_BOMBS)
def test_resource_bombs_are_refused(source):
    with pytest.raises(LocalLLMError, match="^chat template is unsafe or invalid: "):
        render_source(source)


def test_limits_leave_room_for_real_work():
    assert render_source(f"{{{{ range({MAX_RANGE}) | length }}}}") == str(MAX_RANGE)
    with pytest.raises(LocalLLMError, match="Range too big"):
        render_source(f"{{{{ range({MAX_RANGE + 1}) | length }}}}")
    assert render_source(f"{{{{ ('ab' * {MAX_LENGTH // 2}) | length }}}}") == str(MAX_LENGTH)
    assert render_source("{{ '%d' | format(1700000000) }} {{ 1700000000 | string }}") == (
        "1700000000 1700000000"
    )
    # Each loop iteration is a step: 20 x 49,900 fit the budget, 20 x 50,001 do not.
    steps = "{% for i in range(20) %}{% for j in range(N) %}{% endfor %}{% endfor %}"
    assert render_source(steps.replace("N", str(MAX_STEPS // 20 - 100))) == ""
    with pytest.raises(LocalLLMError, match=f"more than {MAX_STEPS} steps"):
        render_source(steps.replace("N", str(MAX_STEPS // 20 + 1)))


@pytest.mark.parametrize(
    "source",
    [
        "{% for m in messages %}{{ m }}",
        "{{ raise_exception('ran') }}{% endfor %}",
        "{% import 'os' as os %}{{ os }}{% endfor %}",
        "{{ 'x' | no_such_filter }}",
    ],
)
def test_invalid_templates_fail_before_running(source):
    with pytest.raises(LocalLLMError, match="^chat template is unsafe or invalid: "):
        ChatTemplate(source)
    with pytest.raises(LocalLLMError, match="^chat template is unsafe or invalid: "):
        ChatTemplate.from_metadata({"tokenizer.chat_template": source})
