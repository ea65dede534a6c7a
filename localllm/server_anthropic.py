"""Anthropic's Messages API on the same server: POST /v1/messages, plain or streamed.

A request's `system`, `messages` (text, tool_use and tool_result blocks) and `tools`
(name, description, input_schema) become the chat template's conversation and tools, as the
OpenAI route builds them; the reply comes back as content blocks (text, tool_use) with Anthropic's
stop_reason (end_turn, max_tokens, stop_sequence, tool_use) and usage. Streams send Anthropic's
events: message_start, content_block_start / _delta / _stop, message_delta, message_stop.
Errors come in Anthropic's shape: {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from localllm import tool_calls
from localllm.errors import LocalLLMError


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status)


class _Bad(Exception):
    """A request Anthropic would answer 400."""


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text":
                raise _Bad(f"{where}[{i}]: only text blocks are supported here")
            texts.append(str(block.get("text", "")))
        return "\n".join(texts)
    raise _Bad(f"{where} must be a string or a list of blocks")


def _conversation(body: dict) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(template messages, OpenAI-style tools or None) from an Anthropic request."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _text_of(system, "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise _Bad("messages must be a non-empty list")
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
            raise _Bad(f"messages[{i}] must have the role user or assistant")
        content = turn.get("content")
        if isinstance(content, str):
            messages.append({"role": turn["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise _Bad(f"messages[{i}].content must be a string or a list of blocks")
        texts, calls = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and turn["role"] == "assistant":
                calls.append(
                    {
                        "id": block.get("id", ""),
                        "type": "function",
                        "function": {"name": block.get("name"), "arguments": block.get("input")},
                    }
                )
            elif kind == "tool_result" and turn["role"] == "user":
                result = block.get("content", "")
                text = result if isinstance(result, str) else _text_of(result, "tool_result")
                messages.append(
                    {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text}
                )
            else:
                raise _Bad(f"messages[{i}].content[{j}]: unsupported block type {kind!r}")
        if texts or calls:
            message: dict[str, Any] = {"role": turn["role"], "content": "\n".join(texts)}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    tools = body.get("tools")
    if tools is None:
        return messages, None
    if not isinstance(tools, list):
        raise _Bad("tools must be a list")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise _Bad(f"tools[{i}] needs a name")
        function = {
            "name": tool["name"],
            "description": tool.get("description", ""),
            "parameters": tool.get("input_schema") or {"type": "object"},
        }
        functions.append({"type": "function", "function": function})
    return messages, functions


def _forced_tools(choice: Any, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The tools one of which the reply must call: none for auto (or no choice), all for any,
    the named one for {"type": "tool", "name": ...}."""
    if choice is None:
        return []
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return []
    if not tools:
        raise _Bad("tool_choice needs tools")
    if kind == "any":
        return tools
    if kind == "tool":
        named = [t for t in tools if t["function"]["name"] == choice.get("name")]
        if not named:
            raise _Bad(f"tool_choice names {choice.get('name')!r}, which is not in tools")
        return named
    raise _Bad("tool_choice type must be auto, any, tool or none")


async def messages(request: Request) -> Response:
    """POST /v1/messages."""
    from localllm.prompt import chat_prompt_ids, chat_template
    from localllm.sampling import make_logits_processors, make_sampler
    from localllm.server_engine import Generation
    from localllm.server_jobs import Job, checked_out, collect_or_cancel

    try:
        body = json.loads(await request.body())
    except ValueError as e:
        return _error(400, f"the request body is not valid JSON: {e}")
    if not isinstance(body, dict):
        return _error(400, "the request body must be a JSON object")
    name, max_tokens = body.get("model"), body.get("max_tokens")
    if not isinstance(name, str) or not name:
        return _error(400, "model: field required")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        return _error(400, "max_tokens: a positive integer is required")
    try:
        turns, tools = _conversation(body)
        stop = body.get("stop_sequences") or []
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _Bad("stop_sequences must be a list of strings")
        temperature = body.get("temperature", 1.0)
        top_p, top_k = body.get("top_p", 1.0), body.get("top_k", 0)
        sampler = make_sampler(float(temperature), int(top_k), float(top_p), 0.0, None)
        processors = make_logits_processors()
    except (_Bad, LocalLLMError, TypeError, ValueError) as e:
        return _error(400, str(e))
    state = request.app.state.localllm
    served = await asyncio.to_thread(state.pool.find, name)
    if served is None:
        return _error(404, f"model: {name} not found", "not_found_error")
    state.engine.check_room()
    model = await state.pool.load(served)
    kind: list[str | None] = [None]

    def build_ids(model) -> list[int]:
        if tools is None:
            return chat_prompt_ids(model, tool_calls.template_messages(turns))
        kind[0] = tool_calls.family(chat_template(model).source)
        if kind[0] is None:
            raise LocalLLMError(f"{name}'s chat template does not take tools")
        return chat_prompt_ids(model, tool_calls.template_messages(turns), tools=tools)

    try:
        forced = _forced_tools(body.get("tool_choice"), tools)
        prompt_ids = await asyncio.to_thread(build_ids, model)
        if forced:  # tool_choice any / tool: the reply is one call (constrained.py)
            from localllm.constrained import grammar_processor, tool_call_grammar

            if kind[0] != "hermes":
                raise LocalLLMError("tool_choice any or tool needs a model that writes <tool_call>")
            grammar = tool_call_grammar(forced)
            processors = [*processors, await asyncio.to_thread(grammar_processor, model, grammar)]
    except (_Bad, LocalLLMError) as e:
        return _error(400, str(e))
    if len(prompt_ids) + max_tokens > model.n_ctx:
        return _error(
            400,
            f"prompt is too long: {len(prompt_ids)} tokens + {max_tokens} max_tokens > "
            f"the context of {model.n_ctx}",
        )
    job = Job(served, model, prompt_ids, max_tokens, sampler, processors, stop, None)
    gen = Generation(state.engine, partial(checked_out, state.pool, job))
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    if body.get("stream"):
        return StreamingResponse(
            _events(gen, message_id, served.id, kind[0], stop, len(prompt_ids)),
            media_type="text/event-stream",
        )
    result = await collect_or_cancel(request, gen)
    if result is None:
        return Response(status_code=499)
    text, last, _ = result
    content, reason = _blocks(text, kind[0], last.finish_reason, stop, tools is not None)
    return JSONResponse(
        {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": served.id,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": None,
            "usage": {"input_tokens": last.prompt_tokens, "output_tokens": last.completion_tokens},
        }
    )


def _blocks(
    text: str, kind: str | None, finish: str | None, stop: list[str], with_tools: bool
) -> tuple[list[dict[str, Any]], str]:
    """(content blocks, stop_reason) of a finished reply."""
    content, calls = tool_calls.parse(text, kind) if with_tools else (text, [])
    blocks: list[dict[str, Any]] = []
    if content or not calls:
        blocks.append({"type": "text", "text": content})
    for call in calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": "toolu_" + call.id.removeprefix("call_"),
                "name": call.name,
                "input": json.loads(call.arguments or "{}"),
            }
        )
    if calls:
        return blocks, "tool_use"
    if finish == "length":
        return blocks, "max_tokens"
    return blocks, "end_turn"


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _block_event(name: str, index: int, **fields: Any) -> str:
    return _event(name, {"type": name, "index": index, **fields})


async def _events(gen, message_id: str, model_id: str, kind, stop, n_prompt: int):
    """Anthropic's stream. Text streams as it comes unless it may be a tool call (then the reply
    is held and sent as blocks at its end)."""
    start = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model_id,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": n_prompt, "output_tokens": 0},
    }
    try:
        yield _event("message_start", {"type": "message_start", "message": start})
        held, streaming, last, index = "", False, None, 0
        async for step in gen:
            last = step
            if not streaming:
                held += step.text
                if kind is not None and tool_calls.could_start_call(held, kind):
                    continue
                streaming = True
                block = {"type": "text", "text": ""}
                yield _block_event("content_block_start", 0, content_block=block)
                step_text = held
            else:
                step_text = step.text
            if step_text:
                delta = {"type": "text_delta", "text": step_text}
                yield _block_event("content_block_delta", 0, delta=delta)
        finish = last.finish_reason if last is not None else "stop"
        if streaming:
            yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            reason = "max_tokens" if finish == "length" else "end_turn"
        else:
            blocks, reason = _blocks(held, kind, finish, stop, True)
            for index, block in enumerate(blocks):
                if block["type"] == "text":
                    opened = {"type": "text", "text": ""}
                    delta = {"type": "text_delta", "text": block["text"]}
                else:
                    opened = {**block, "input": {}}
                    delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                yield _block_event("content_block_start", index, content_block=opened)
                yield _block_event("content_block_delta", index, delta=delta)
                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
        output = last.completion_tokens if last is not None else 0
        yield _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": None},
                "usage": {"output_tokens": output},
            },
        )
        yield _event("message_stop", {"type": "message_stop"})
    except Exception as e:  # headers are sent: Anthropic's in-band error event
        error = {"type": "error", "error": {"type": "api_error", "message": str(e)}}
        yield _event("error", error)
    finally:
        gen.cancel()
