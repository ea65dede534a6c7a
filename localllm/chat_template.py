"""The model's chat template: the GGUF's Jinja string, rendered in a locked-down sandbox.

`tokenizer.chat_template` is untrusted input: anyone can publish a GGUF file. It is rendered the
way Hugging Face transformers renders it (an `ImmutableSandboxedEnvironment` with loop controls,
`trim_blocks`, `lstrip_blocks`, transformers' `tojson`, `raise_exception`, `strftime_now`), plus
guards the Jinja sandbox lacks. The sandbox refuses private and dunder attributes, unsafe callables,
mutation of lists, dicts and sets, and `range()` over more than `MAX_RANGE` items; here touching
such an attribute stops the render at once, where plain Jinja hands back an undefined value. So
that a hostile template cannot exhaust memory or time either:

- `+`, `*`, `~` and `**` are checked before they compute: no string or list longer than
  `MAX_LENGTH`, no integer wider than `MAX_INT_BITS` bits;
- calls and filters take no integer argument above `MAX_LENGTH` (`center`, `indent`, ...) and
  return nothing longer than `MAX_LENGTH`;
- each entry into a block (loop iteration, branch, macro call) is a step, `MAX_STEPS` per render;
- the rendered text is at most `MAX_LENGTH` characters;
- `lipsum` is gone (no chat template needs it; its size argument is unbounded).

Everything a template does wrong becomes a `LocalLLMError`: syntax errors and sandbox violations
read "chat template is unsafe or invalid: ...", other failures "chat template error: ...".
The resource guards are best-effort: one call can still build a large value before its result is
checked, from a format width (`'%0999999999d' % 1`) or a filter over nested lists (`sum`).

BOS: `render` returns exactly the text the template writes. Hugging Face templates write
`bos_token` themselves (Gemma, Llama), ChatML ones do not, and the built-in templates here follow
the original templates of their families. Tokenize the text with special tokens parsed; to get one
BOS and never two, call `strip_leading_bos` first and prepend BOS if the template wrote one or the
model's `tokenizer.ggml.add_bos_token` asks for it. (llama.cpp adds BOS on top of what the
template wrote and warns about the double BOS; transformers adds none beyond the template's.)
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from localllm.errors import LocalLLMError

MAX_LENGTH = 1 << 24  # characters or items in any value a template builds, and in its output
MAX_INT_BITS = 4096  # integers beyond this only serve to burn CPU
MAX_STEPS = 1_000_000  # block entries per render: thousands of messages, never an endless loop

# Built-in templates for files that carry none, each following its family's original template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Gemma has no system role: the system prompt opens the first user turn, as in Gemma 3's template.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] | trim + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
LLAMA2_TEMPLATE = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% set content = (system if loop.first else '') + message['content'] %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content | trim + ' [/INST]' }}"
    "{% else %}{{ ' ' + content | trim + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

# Steps left in the current render; a ContextVar so that concurrent renders (server threads)
# each have their own budget.
_steps_left: ContextVar[list[int]] = ContextVar("chat_template_steps_left")


class ChatTemplate:
    """A compiled chat template. Compiling checks the syntax; rendering runs in the sandbox."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        is_builtin: bool = False,
        name: str = "gguf",
    ) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.is_builtin = is_builtin
        self.name = name  # "gguf" for the file's own template, else the built-in's family
        try:
            self._template = _ENV.from_string(source)
        except (jinja2.TemplateError, SecurityError, RecursionError, MemoryError) as e:
            raise LocalLLMError(f"chat template is unsafe or invalid: {e}") from None

    @classmethod
    def from_metadata(
        cls, metadata: Mapping[str, Any], tokens: Sequence[str] | None = None
    ) -> ChatTemplate:
        """The file's `tokenizer.chat_template`, or a built-in one chosen by architecture and vocab.

        `tokens` defaults to `metadata["tokenizer.ggml.tokens"]`; the BOS and EOS strings are the
        tokens at `tokenizer.ggml.bos_token_id` and `tokenizer.ggml.eos_token_id`.
        """
        if tokens is None:
            tokens = metadata.get("tokenizer.ggml.tokens") or []
        bos_token = _token_at(tokens, metadata.get("tokenizer.ggml.bos_token_id"))
        eos_token = _token_at(tokens, metadata.get("tokenizer.ggml.eos_token_id"))
        source = metadata.get("tokenizer.chat_template")
        if isinstance(source, bytes):
            source = source.decode("utf-8", errors="replace")
        if source:
            return cls(source, bos_token=bos_token, eos_token=eos_token)
        name, source = builtin_template(str(metadata.get("general.architecture", "")), tokens)
        return cls(source, bos_token=bos_token, eos_token=eos_token, is_builtin=True, name=name)

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render a conversation (dicts with "role" and "content") into the model's prompt text.

        `extra` adds or overrides template variables (tools, documents, date_string, ...).
        """
        variables = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "tools": None,
            "date_string": datetime.now().strftime("%d %b %Y"),
            **extra,
        }
        token = _steps_left.set([MAX_STEPS])
        try:
            chunks: list[str] = []
            length = 0
            # Streamed, so that an endless output is stopped at the cap, not after it is built.
            for chunk in self._template.generate(variables):
                length += len(chunk)
                if length > MAX_LENGTH:
                    raise SecurityError(f"output longer than {MAX_LENGTH} characters")
                chunks.append(chunk)
            return "".join(chunks)
        except LocalLLMError:
            raise
        except SecurityError as e:
            raise LocalLLMError(f"chat template is unsafe or invalid: {e}") from None
        except Exception as e:  # the template is untrusted code: any failure is its failure
            raise LocalLLMError(f"chat template error: {type(e).__name__}: {e}") from None
        finally:
            _steps_left.reset(token)


def builtin_template(architecture: str, tokens: Sequence[str]) -> tuple[str, str]:
    """(name, Jinja source) of the built-in template for a file without one.

    Gemma by architecture; otherwise by the vocabulary's turn markers: ChatML (`<|im_start|>`,
    qwen2 and SmolLM), Llama 3 (`<|start_header_id|>`), and Llama 2's `[INST]` for the rest.
    """
    if architecture.startswith("gemma"):
        return "gemma", GEMMA_TEMPLATE
    vocab = set(tokens)
    if "<|im_start|>" in vocab:
        return "chatml", CHATML_TEMPLATE
    if "<|start_header_id|>" in vocab:
        return "llama3", LLAMA3_TEMPLATE
    return "llama2", LLAMA2_TEMPLATE


def strip_leading_bos(text: str, bos_token: str) -> tuple[str, bool]:
    """Split a rendered prompt's leading BOS string off: (rest, whether the template wrote it).

    Tokenize `rest` and prepend the BOS id once if this says True or the model adds BOS.
    """
    if bos_token and text.startswith(bos_token):
        return text[len(bos_token) :], True
    return text, False


def _token_at(tokens: Sequence[str], token_id: Any) -> str:
    if token_id is None:
        return ""
    token_id = int(token_id)
    return str(tokens[token_id]) if 0 <= token_id < len(tokens) else ""


def _check_size(n_items: int) -> None:
    if n_items > MAX_LENGTH:
        raise SecurityError(f"a value longer than {MAX_LENGTH} items")


def _check_length(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, dict)):
        _check_size(len(value))
    return value


def _check_int_args(args: Iterable[Any]) -> None:
    for arg in args:
        if isinstance(arg, int) and abs(arg) > MAX_LENGTH:
            raise SecurityError(f"an integer argument above {MAX_LENGTH}")


def _size_of(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 1


class _GuardedCodeGenerator(CodeGenerator):
    """Jinja's code generator with two hooks no sandbox option offers."""

    def blockvisit(self, nodes: Iterable[nodes.Node], frame: Frame) -> None:
        # Every loop iteration, branch and macro body enters a block: one step each.
        self.writeline("environment.step()")
        super().blockvisit(nodes, frame)

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        # `a ~ b` otherwise joins strings of any size, out of reach of call_binop.
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _GuardedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with size, integer and step limits (see the module docstring)."""

    code_generator_class = _GuardedCodeGenerator
    # Intercepted operators are also never constant-folded, so `'a' * 10**10` fails at render
    # time instead of hanging the compiler.
    intercepted_binops = frozenset({"+", "*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        """Refuse an operation whose result would be too long or too wide, before computing it."""
        if isinstance(left, int) and isinstance(right, int):
            bits = left.bit_length(), right.bit_length()
            if operator == "*" and sum(bits) > MAX_INT_BITS:
                raise SecurityError(f"an integer wider than {MAX_INT_BITS} bits")
            if operator == "**" and abs(left) > 1 and right > 0 and bits[0] * right > MAX_INT_BITS:
                raise SecurityError(f"an integer wider than {MAX_INT_BITS} bits")
        elif operator == "*":
            count = left if isinstance(left, int) else right if isinstance(right, int) else 1
            _check_size(count * max(_size_of(left), _size_of(right)))
        elif operator == "+":
            _check_size(_size_of(left) + _size_of(right))
        return super().call_binop(context, operator, left, right)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        """Stop the render: a template reaching for `__globals__` and the like is hostile."""
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object")

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Call from template code, with integer arguments and the result's length capped."""
        _check_int_args(args)
        _check_int_args(kwargs.values())
        return _check_length(super().call(context, obj, *args, **kwargs))

    def concat(self, values: Iterable[Any]) -> str:
        """`a ~ b ~ ...`, refused before joining if the result would be too long."""
        strings = [str(value) for value in values]
        _check_size(sum(map(len, strings)))
        return "".join(strings)

    def step(self) -> None:
        """Spend one step of this render's budget."""
        steps = _steps_left.get()
        steps[0] -= 1
        if steps[0] < 0:
            raise SecurityError(f"more than {MAX_STEPS} steps")


def _capped_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    # The filtered value is data, where a large number is fine; the other arguments are widths
    # and counts, except for `format`, whose arguments are data too.
    first_parameter = 1 + hasattr(func, "jinja_pass_arg")
    check_parameters = name != "format"

    # functools.wraps copies `jinja_pass_arg`, so context-taking filters still get their context.
    @functools.wraps(func)
    def filter_(*args: Any, **kwargs: Any) -> Any:
        if check_parameters:
            _check_int_args(args[first_parameter:])
            _check_int_args(kwargs.values())
        return _check_length(func(*args, **kwargs))

    return filter_


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: Jinja's own escapes <, >, & and ' for HTML, which prompts must not see.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise LocalLLMError(f"chat template error: {message}")


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _make_environment() -> _GuardedEnvironment:
    env = _GuardedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _capped_filter(name, func) for name, func in env.filters.items()}
    env.globals.pop("lipsum", None)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_environment()
