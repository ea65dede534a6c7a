"""Tool calls: the tools go into the model's own chat template, the calls come out of its text.

Each family writes its calls its own way (llama.cpp's common/chat.cpp has the same parsers):

    hermes   Qwen2.5, Qwen3, Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3   Llama 3.1-3.3: {"name": ..., "parameters": {...}}, the whole reply (<|python_tag|>)
    mistral  Mistral: [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]

The family is read from the template (what it tells the model to write). OpenAI clients send a
call's `arguments` as a JSON string; templates want an object, so `template_messages` parses
them as llama.cpp does, and `role: tool` results go to the template as they are.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from localllm import harmony
from localllm.errors import LocalLLMError


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's wire format carries it
    id: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def family(template_source: str) -> str | None:
    """ "hermes", "llama3", "mistral", "harmony", or None when the template takes no tools."""
    if harmony.is_harmony(template_source):
        return "harmony"
    if "<tool_call>" in template_source:
        return "hermes"
    if "[TOOL_CALLS]" in template_source:
        return "mistral"
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return "llama3"
    return None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: each assistant tool call's arguments an object."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = dict(m)
            fixed = []
            for call in calls:
                function = dict(call.get("function") or {})
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        function["arguments"] = json.loads(arguments) if arguments else {}
                    except ValueError:
                        raise LocalLLMError(
                            f"the arguments of tool call {function.get('name')!r} are not JSON"
                        ) from None
                fixed.append({**call, "function": function, **function})
            m["tool_calls"] = fixed
        out.append(m)
    return out


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse(text: str, kind: str | None) -> tuple[str, list[ToolCall]]:
    """(content without the calls, the calls) of a finished reply."""
    if kind == "hermes" and "<tool_call>" in text:
        calls = [_call(body) for body in _HERMES.findall(text)]
        content = text[: text.index("<tool_call>")].strip()
        return content, [c for c in calls if c is not None]
    if kind == "hermes":  # small Qwen models often drop the tags: a bare or fenced call
        call = _bare_call(text)
        if call is not None:
            return "", [call]
    if kind == "mistral" and "[TOOL_CALLS]" in text:
        content, _, body = text.partition("[TOOL_CALLS]")
        try:
            items = json.loads(body.strip())
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_call(json.dumps(item)) for item in items if isinstance(item, dict)]
        return content.strip(), [c for c in calls if c is not None]
    if kind == "harmony":  # calls as harmony.HarmonySplitter passes them on
        content, found = harmony.calls(text)
        return content, [
            ToolCall(name, arguments, f"call_{uuid.uuid4().hex[:24]}") for name, arguments in found
        ]
    if kind == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            call = _call(body)
            if call is not None:
                return "", [call]
    return text, []


_FENCED = re.compile(r"```(?:json)?\s*(\{.*\})\s*```", re.DOTALL)


def _bare_call(text: str) -> ToolCall | None:
    """A reply that is only {"name": ..., "arguments": {...}}, maybe in a ```json fence: a call,
    as llama.cpp's Hermes parser also takes it."""
    body = text.strip()
    fenced = _FENCED.fullmatch(body)
    body = fenced.group(1) if fenced else body
    try:
        item = json.loads(body) if body.startswith("{") else None
    except ValueError:
        return None
    if isinstance(item, dict) and isinstance(item.get("arguments"), dict):
        return _call(body)
    return None


def _call(body: str) -> ToolCall | None:
    try:
        item = json.loads(body)
    except ValueError:
        return None
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(item["name"], arguments, f"call_{uuid.uuid4().hex[:24]}")


def could_start_call(text: str, kind: str | None) -> bool:
    """Whether a streamed reply may still turn into a tool call (so it is held back)."""
    if kind == "harmony":
        return harmony.starts_harmony(text) or not text.strip()
    if kind == "hermes":
        stripped = text.lstrip()
        fence = "```json"
        if stripped.startswith(("{", fence)) or fence.startswith(stripped):
            return True  # maybe a bare or fenced call (see parse)
        marker = "<tool_call>"
    elif kind == "mistral":
        marker = "[TOOL_CALLS]"
    elif kind == "llama3":
        stripped = text.lstrip()
        return not stripped or stripped.startswith(("{", "<|python_tag|>"[: len(stripped)]))
    else:
        return False
    stripped = text.lstrip()
    return marker in text or marker.startswith(stripped[: len(marker)])
