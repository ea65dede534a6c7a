"""OpenAI's API: /v1/chat/completions, /v1/completions, /v1/embeddings and /v1/models."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from localllm import server_ollama, tool_calls
from localllm.errors import LocalLLMError
from localllm.models import Model
from localllm.prompt import chat_prompt_ids, chat_template, raw_prompt_ids
from localllm.sampling import Sampler, make_logits_processors, make_sampler
from localllm.server_jobs import (
    Generation,
    Job,
    State,
    checked_out,
    collect_or_cancel,
    event_stream,
    sse,
)
from localllm.server_schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    chat_messages,
    check_common,
    completion_id,
    legacy_logprobs,
    stop_strings,
    usage,
)

if TYPE_CHECKING:
    from localllm.server import ServedModel

REPEAT_LAST_N = 64  # penalty window, llama.cpp's default (the one `localllm run` uses)


def _sampling(req: ChatCompletionRequest | CompletionRequest) -> tuple[Sampler, list]:
    """Sampler and penalties from the request, with OpenAI's defaults (temperature 1, top_p 1,
    no top-k or min-p) for what it leaves out, as vLLM does."""
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    top_k = 0 if req.top_k is None or req.top_k < 0 else req.top_k
    min_p = 0.0 if req.min_p is None else req.min_p
    # OpenAI takes any 64-bit seed; numpy's generator wants a non-negative one.
    seed = None if req.seed is None else req.seed % 2**64
    try:
        sampler = make_sampler(temperature, top_k, top_p, min_p, seed)
        processors = make_logits_processors(
            repeat_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            repeat_last_n=REPEAT_LAST_N,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
        )
    except LocalLLMError as e:
        raise bad_request(str(e)) from None
    return sampler, processors


def _max_tokens(requested: int | None, n_prompt: int, n_ctx: int, what: str) -> int:
    """max_tokens, bounded by the context: what is left of it when not given; a 400 when the
    prompt and the completion asked for do not fit (as OpenAI and vLLM answer; never truncated)."""
    param = "messages" if what == "messages" else "prompt"
    if requested is None:
        if n_prompt >= n_ctx:
            raise bad_request(
                f"This model's maximum context length is {n_ctx} tokens. However, your {what} "
                f"resulted in {n_prompt} tokens, which leaves no room for a completion. "
                f"Please reduce the length of the {what}.",
                param=param,
                code="context_length_exceeded",
            )
        return n_ctx - n_prompt
    if n_prompt + requested > n_ctx:
        raise bad_request(
            f"This model's maximum context length is {n_ctx} tokens. However, you requested "
            f"{n_prompt + requested} tokens ({n_prompt} in the {what}, {requested} in the "
            f"completion). Please reduce the length of the {what} or completion.",
            param=param,
            code="context_length_exceeded",
        )
    return requested


async def _prepare(
    state: State,
    req: ChatCompletionRequest | CompletionRequest,
    build_ids: Callable[[Model], list[int]],
    what: str,
    requested_max: int | None,
    top_logprobs: int | None,
    id_prefix: str,
    json_schema: Any = False,
    forced_tools: list[dict[str, Any]] | None = None,
) -> tuple[Job, Generation]:
    """Find and load the model, build the prompt off the event loop, check it fits, and
    start the generation on the engine."""
    check_common(req)
    served = state.pool.find(req.model)
    if served is None:
        raise APIError(
            404,
            f"The model `{req.model}` does not exist or is not served here; "
            "GET /v1/models lists the served models.",
            param="model",
            code="model_not_found",
        )
    state.engine.check_room()
    sampler, processors = _sampling(req)
    model = await state.pool.load(served)
    try:
        prompt_ids = await asyncio.to_thread(build_ids, model)
    except LocalLLMError as e:  # e.g. the chat template rejected the conversation
        raise bad_request(str(e), param="messages" if what == "messages" else "prompt") from None
    if not prompt_ids:
        raise bad_request(f"the {what} is empty", param="prompt")
    if json_schema is not False:  # JSON output: llguidance masks the logits at every step
        from localllm.constrained import json_processor

        try:
            constraint = await asyncio.to_thread(json_processor, model, json_schema)
        except LocalLLMError as e:
            raise bad_request(str(e), param="response_format") from None
        processors = [*processors, constraint]
    if forced_tools:  # tool_choice required or named: the reply is one call of these tools
        from localllm.constrained import grammar_processor, tool_call_grammar

        try:
            grammar = tool_call_grammar(forced_tools)
            constraint = await asyncio.to_thread(grammar_processor, model, grammar)
        except LocalLLMError as e:
            raise bad_request(str(e), param="tools") from None
        processors = [*processors, constraint]
    max_tokens = _max_tokens(requested_max, len(prompt_ids), model.n_ctx, what)
    job = Job(
        served,
        model,
        prompt_ids,
        max_tokens,
        sampler,
        processors,
        stop_strings(req.stop),
        top_logprobs,
        id=completion_id(id_prefix),
    )
    return job, Generation(state.engine, partial(checked_out, state.pool, job))


async def _stream(
    gen: Generation, chunk: Callable[..., dict[str, Any]], include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events: an opening chunk (if chunk(None, None, None) gives one), then
    chunk(text, logprobs, None) per step, a finish chunk, a usage chunk when asked, and
    `data: [DONE]`. Starlette cancels it when the client goes away, which cancels `gen`."""
    last = None
    opening = chunk(None, None, None)
    if opening is not None:
        yield sse(opening)
    async for step in gen:
        last = step
        if step.text or step.logprobs is not None:
            yield sse(chunk(step.text, step.logprobs, None))
    if last is not None:
        yield sse(chunk(None, None, last.finish_reason))
        if include_usage:
            totals = usage(last.prompt_tokens, last.completion_tokens)
            yield sse(chunk(None, None, None, totals=totals))
    yield sse("[DONE]")


# -- the routes -----------------------------------------------------------------------------


def _tools(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, bool]:
    """(the tools the template gets, or None; whether the reply must be a call of them), from
    tools and tool_choice (auto, none, required, or {"type": "function", "function": {name}})."""
    if not req.tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None, False
    for i, tool in enumerate(req.tools):
        function = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(
                "each tool must be {type: function, function: {name, ...}}", param=f"tools[{i}]"
            )
    choice = req.tool_choice or "auto"
    if choice == "none":
        return None, False
    if choice == "auto":
        return req.tools, False
    if choice == "required":
        return req.tools, True
    if isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        name = choice["function"]["name"]
        named = [t for t in req.tools if t["function"]["name"] == name]
        if not named:
            raise bad_request(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        return named, True
    raise bad_request("tool_choice must be none, auto, required or a function", "tool_choice")


async def _stream_tool_calls(
    gen: Generation, base: dict[str, Any], kind: str | None, include_usage: bool
) -> AsyncIterator[str]:
    """A streamed reply that may be tool calls: text is streamed as content once it cannot be
    the start of a call; a call is held until the reply ends, then sent as tool_calls deltas
    with finish_reason "tool_calls"."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        body = {**base, "object": "chat.completion.chunk", "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    yield chunk({"role": "assistant", "content": ""})
    held, streaming, last = "", False, None
    async for step in gen:
        last = step
        if streaming:
            if step.text:
                yield chunk({"content": step.text})
            continue
        held += step.text
        if not tool_calls.could_start_call(held, kind):
            streaming = True
            yield chunk({"content": held})
    if last is None:
        yield sse("[DONE]")
        return
    finish = last.finish_reason
    if not streaming:
        content, calls = tool_calls.parse(held, kind)
        if calls:
            if content:
                yield chunk({"content": content})
            yield chunk({"tool_calls": [c.openai(i) for i, c in enumerate(calls)]})
            finish = "tool_calls"
        elif held:
            yield chunk({"content": held})
    yield chunk({}, finish)
    if include_usage:
        body = {**base, "object": "chat.completion.chunk", "choices": []}
        body["usage"] = usage(last.prompt_tokens, last.completion_tokens)
        yield sse(body)
    yield sse("[DONE]")


def _response_schema(response_format: dict[str, Any] | None) -> Any:
    """False for text; None for any JSON object (json_object); the schema of json_schema."""
    if not response_format:
        return False
    kind = response_format.get("type", "text")
    if kind == "text":
        return False
    if kind == "json_object":
        return None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad_request(
                "json_schema needs an object with a 'schema' object", param="response_format"
            )
        return spec.get("schema") or None
    raise bad_request(
        f"response_format type {kind!r} is not one of text, json_object, json_schema",
        param="response_format",
    )


async def chat_completions(request: Request, req: ChatCompletionRequest) -> Response:
    """POST /v1/chat/completions."""
    state: State = request.app.state.localllm
    json_schema = _response_schema(req.response_format)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    messages = chat_messages(req.messages)
    top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # max_completion_tokens is the newer name; it wins when both are given.
    requested = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    tools, forced = _tools(req)
    kind: list[str | None] = [None]  # the model's tool-call format, read with its template

    def build_ids(model: Model) -> list[int]:
        if tools is None:
            return chat_prompt_ids(model, tool_calls.template_messages(messages))
        kind[0] = tool_calls.family(chat_template(model).source)
        if kind[0] is None:
            raise LocalLLMError(f"{req.model}'s chat template does not take tools")
        if forced and kind[0] != "hermes":
            raise LocalLLMError(
                "tool_choice required or a named function needs a model that writes "
                "<tool_call> (Qwen, Hermes); use auto"
            )
        return chat_prompt_ids(model, tool_calls.template_messages(messages), tools=tools)

    job, gen = await _prepare(
        state,
        req,
        build_ids,
        "messages",
        requested,
        top_logprobs,
        "chatcmpl",
        json_schema,
        tools if forced else None,
    )
    base = {"id": job.id, "created": job.created, "model": job.served.id}
    if tools is not None:
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return event_stream(_stream_tool_calls(gen, base, kind[0], include_usage), gen)
        result = await collect_or_cancel(request, gen)
        if result is None:
            return Response(status_code=499)
        text, last, _entries = result
        content, calls = tool_calls.parse(text, kind[0])
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return JSONResponse(
            {
                **base,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": message if calls else {**message, "content": text},
                        "logprobs": None,
                        "finish_reason": "tool_calls" if calls else last.finish_reason,
                    }
                ],
                "usage": usage(last.prompt_tokens, last.completion_tokens),
            }
        )
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(text, logprobs, finish, totals=None):
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
            if text is None and logprobs is None and finish is None and totals is None:
                choice["delta"] = {"role": "assistant", "content": ""}  # the opening chunk
            elif text is not None or logprobs is not None:
                choice["delta"] = {"content": text or ""}
                if logprobs is not None:
                    choice["logprobs"] = {"content": [logprobs]}
            body = {**base, "object": "chat.completion.chunk"}
            body["choices"] = [] if totals is not None else [choice]
            if include_usage:
                body["usage"] = totals
            return body

        return event_stream(_stream(gen, chunk, include_usage), gen)
    result = await collect_or_cancel(request, gen)
    if result is None:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    text, last, entries = result
    return JSONResponse(
        {
            **base,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": {"content": entries} if top_logprobs is not None else None,
                    "finish_reason": last.finish_reason,
                }
            ],
            "usage": usage(last.prompt_tokens, last.completion_tokens),
        }
    )


async def completions(request: Request, req: CompletionRequest) -> Response:
    """POST /v1/completions: a raw prompt, no chat template."""
    state: State = request.app.state.localllm
    if req.echo:
        raise bad_request("echo is not supported", param="echo")
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != 1:
        raise bad_request("only best_of=1 is supported", param="best_of")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]

    def build_ids(model: Model) -> list[int]:
        if isinstance(prompt, str):
            return raw_prompt_ids(model, prompt)
        vocab = model.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise bad_request(f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
        return list(prompt)

    top_logprobs = req.logprobs
    job, gen = await _prepare(state, req, build_ids, "prompt", req.max_tokens, top_logprobs, "cmpl")
    base = {"id": job.id, "created": job.created, "model": job.served.id}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        offset = 0

        def chunk(text, logprobs, finish, totals=None):
            nonlocal offset
            if text is None and logprobs is None and finish is None and totals is None:
                return None  # completions streams have no opening chunk
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            if logprobs is not None:
                choice["logprobs"] = legacy_logprobs([logprobs], offset)
                offset += len(logprobs["token"])
            body = {**base, "object": "text_completion"}
            body["choices"] = [] if totals is not None else [choice]
            if include_usage:
                body["usage"] = totals
            return body

        return event_stream(_stream(gen, chunk, include_usage), gen)
    result = await collect_or_cancel(request, gen)
    if result is None:
        return Response(status_code=499)
    text, last, entries = result
    return JSONResponse(
        {
            **base,
            "object": "text_completion",
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": legacy_logprobs(entries) if top_logprobs is not None else None,
                    "finish_reason": last.finish_reason,
                }
            ],
            "usage": usage(last.prompt_tokens, last.completion_tokens),
        }
    )


async def embeddings(request: Request) -> JSONResponse:
    """POST /v1/embeddings {"model", "input": text or [texts]}: OpenAI's shape, the vectors of
    /api/embed (embeddings.py). Token-id inputs and `dimensions` are refused with 400."""
    try:
        body = json.loads(await request.body())
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad_request("model is required", param="model")
    value = body.get("input")
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise bad_request("input must be a string or a non-empty list of strings", param="input")
    if body.get("dimensions") is not None:
        raise bad_request("dimensions is not supported", param="dimensions")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):  # the openai client asks for base64
        raise bad_request("encoding_format must be float or base64", param="encoding_format")
    try:
        served, vectors, n_tokens, _total, _load = await server_ollama.run_embeddings(
            request, name, texts, truncate=False
        )
    except LookupError:
        raise APIError(
            404, f"The model `{name}` does not exist", param="model", code="model_not_found"
        ) from None
    except LocalLLMError as e:
        raise bad_request(str(e), param="input") from None

    def encoded(v):  # base64: the little-endian float32 bytes, as OpenAI sends them
        if encoding == "base64":
            return base64.b64encode(v.astype("<f4").tobytes()).decode()
        return v.tolist()

    data = [
        {"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)
    ]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": served.id,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
    )


async def list_models(request: Request) -> JSONResponse:
    """GET /v1/models, with each model's context length (vLLM's `max_model_len`)."""
    state: State = request.app.state.localllm
    served = await asyncio.to_thread(state.pool.list)
    data = [await _model_card(state, m) for m in served]
    return JSONResponse({"object": "list", "data": data})


async def get_model(request: Request, model_id: str) -> JSONResponse:
    """GET /v1/models/{model_id}."""
    state: State = request.app.state.localllm
    served = await asyncio.to_thread(state.pool.find, model_id)
    if served is None:
        raise APIError(
            404, f"The model `{model_id}` does not exist", param="model", code="model_not_found"
        )
    return JSONResponse(await _model_card(state, served))


async def _model_card(state: State, served: ServedModel) -> dict[str, Any]:
    try:
        n_ctx = await asyncio.to_thread(state.pool.context_length, served)
    except LocalLLMError as e:
        raise APIError(500, f"model {served.id}: {e}", type="server_error") from None
    return {
        "id": served.id,
        "object": "model",
        "created": int(served.path.stat().st_mtime) if served.path.exists() else 0,
        "owned_by": "localllm",
        "max_model_len": n_ctx,
        "context_length": n_ctx,  # the name LM Studio and OpenRouter use
    }
