"""OpenAI's API: /v1/chat/completions, /v1/completions, /v1/embeddings and /v1/models."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
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
    Step,
    checked_out,
    collect_or_cancel,
    event_stream,
    merged,
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
from localllm.thinking import (
    CONTENT,
    THINKING,
    ThinkingSplitter,
    prompt_opens_thinking,
    split,
    template_thinks,
)

if TYPE_CHECKING:
    from localllm.server import ServedModel

REPEAT_LAST_N = 64  # penalty window, llama.cpp's default (the one `localllm run` uses)


def _sampling(
    req: ChatCompletionRequest | CompletionRequest, choice: int = 0
) -> tuple[Sampler, list]:
    """Sampler and penalties from the request, with OpenAI's defaults (temperature 1, top_p 1,
    no top-k or min-p) for what it leaves out, as vLLM does. Choice i of n draws with seed + i,
    so that a seeded request gives n different, repeatable answers."""
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    top_k = 0 if req.top_k is None or req.top_k < 0 else req.top_k
    min_p = 0.0 if req.min_p is None else req.min_p
    # OpenAI takes any 64-bit seed; numpy's generator wants a non-negative one.
    seed = None if req.seed is None else (req.seed + choice) % 2**64
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


def _logit_bias(bias: dict[str, float] | None, vocab_size: int):
    """OpenAI's logit_bias ({token id: -100..100}, added to the logits) as a logits processor,
    or None. -100 bans a token, 100 all but forces it."""
    if not bias:
        return None
    try:
        pairs = [(int(token), float(value)) for token, value in bias.items()]
    except (TypeError, ValueError):
        raise bad_request("logit_bias maps token ids to numbers", param="logit_bias") from None
    for token, value in pairs:
        if not 0 <= token < vocab_size:
            message = f"logit_bias: token id {token} is not in 0..{vocab_size - 1}"
            raise bad_request(message, param="logit_bias")
        if not -100 <= value <= 100:
            raise bad_request("logit_bias values must be in -100..100", param="logit_bias")
    ids = np.array([p[0] for p in pairs], dtype=np.int64)
    values = np.array([p[1] for p in pairs], dtype=np.float32)

    def add_bias(history, logits: np.ndarray) -> np.ndarray:
        logits = logits.copy()
        logits[ids] += values
        return logits

    return add_bias


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
    prompt_logprobs: int | None = None,
) -> tuple[list[Job], list[Generation]]:
    """Find and load the model, build the prompt off the event loop, check it fits, and
    start the request's n generations on the engine (one sequence each, prompt built once)."""
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
    n = req.n or 1
    state.engine.check_room(n)
    samplings = [_sampling(req, i) for i in range(n)]
    model = await state.pool.load(served)
    if model.embedding_only:
        try:
            model.check_generates()
        except LocalLLMError as e:
            raise bad_request(str(e), param="model") from None
    try:
        prompt_ids = await asyncio.to_thread(build_ids, model)
    except LocalLLMError as e:  # e.g. the chat template rejected the conversation
        raise bad_request(str(e), param="messages" if what == "messages" else "prompt") from None
    if not prompt_ids:
        raise bad_request(f"the {what} is empty", param="prompt")
    max_tokens = _max_tokens(requested_max, len(prompt_ids), model.n_ctx, what)
    bias = _logit_bias(req.logit_bias, model.tokenizer.vocab_size)
    grammar = None
    if forced_tools:  # tool_choice required or named: the reply is one call of these tools
        from localllm.constrained import tool_call_grammar

        try:
            grammar = tool_call_grammar(forced_tools)
        except LocalLLMError as e:
            raise bad_request(str(e), param="tools") from None
    jobs = []
    for sampler, processors in samplings:
        # Constraints keep a parser's state per sequence: one per choice.
        processors = [*processors, *([bias] if bias else [])]
        if json_schema is not False:  # JSON output: llguidance masks the logits at every step
            from localllm.constrained import json_processor

            try:
                constraint = await asyncio.to_thread(json_processor, model, json_schema)
            except LocalLLMError as e:
                raise bad_request(str(e), param="response_format") from None
            processors.append(constraint)
        if grammar is not None:
            from localllm.constrained import grammar_processor

            try:
                processors.append(await asyncio.to_thread(grammar_processor, model, grammar))
            except LocalLLMError as e:
                raise bad_request(str(e), param="tools") from None
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
            prompt_logprobs=prompt_logprobs,
        )
        jobs.append(job)
    for job in jobs[1:]:
        job.id, job.created = jobs[0].id, jobs[0].created  # one response, one id
    gens: list[Generation] = []
    try:
        for job in jobs:
            gens.append(Generation(state.engine, partial(checked_out, state.pool, job)))
    except BaseException:
        for gen in gens:
            gen.cancel()
        raise
    return jobs, gens


def _usage(lasts: list[Step | None]) -> dict[str, Any]:
    """One response's usage: the prompt once, the completions of every choice."""
    done = [s for s in lasts if s is not None]
    prompt = done[0].prompt_tokens if done else 0
    cached = min((s.cached_tokens for s in done), default=0)
    return usage(prompt, sum(s.completion_tokens for s in done), cached)


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


# -- chat completions -----------------------------------------------------------------------


@dataclass
class _Reply:
    """How a chat reply's text becomes a message: the model's tool-call format when tools are
    on (kind None: no tools), and whether its thoughts go to reasoning_content (`inside`: the
    prompt ends in an open think block)."""

    tools: bool = False
    kind: str | None = None
    thinks: bool = False
    inside: bool = False


def _chat_choice(index: int, result, top_logprobs: int | None, reply: _Reply) -> dict[str, Any]:
    """One choice of a whole chat reply: content, reasoning_content, tool_calls."""
    text, last, entries = result
    reasoning, text = split(text, reply.inside) if reply.thinks else ("", text)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish = last.finish_reason
    if reply.tools:
        content, calls = tool_calls.parse(text, reply.kind)
        if calls:
            message["content"] = content or None
            message["tool_calls"] = [c.openai() for c in calls]
            finish = "tool_calls"
    if reasoning:
        message["reasoning_content"] = reasoning
    return {
        "index": index,
        "message": message,
        "logprobs": {"content": entries} if top_logprobs is not None else None,
        "finish_reason": finish,
    }


async def _chat_choice_stream(
    gen: Generation, index: int, reply: _Reply, lasts: list[Step | None]
) -> AsyncIterator[dict[str, Any]]:
    """The `choices` items of one streamed chat choice: the opening delta, then content and
    reasoning_content as they come. With tools, text is streamed as content once it cannot be
    the start of a call; a call is held until the reply ends, then sent as tool_calls deltas
    with finish_reason "tool_calls"."""

    def item(delta: dict[str, Any], logprobs=None, finish: str | None = None) -> dict[str, Any]:
        entry = None if logprobs is None else {"content": [logprobs]}
        return {"index": index, "delta": delta, "logprobs": entry, "finish_reason": finish}

    yield item({"role": "assistant", "content": ""})
    splitter = ThinkingSplitter(reply.inside) if reply.thinks else None
    held, holding, last = "", reply.tools, None

    def delta_of(pieces: list[tuple[str, str]]) -> dict[str, Any]:
        nonlocal held, holding
        delta: dict[str, Any] = {}
        for kind, piece in pieces:
            if kind == THINKING:
                delta["reasoning_content"] = delta.get("reasoning_content", "") + piece
                continue
            if holding:
                held += piece
                if tool_calls.could_start_call(held, reply.kind):
                    continue
                holding, piece = False, held
            delta["content"] = delta.get("content", "") + piece
        return delta

    async for step in gen:
        last = lasts[index] = step
        pieces = splitter.feed(step.text) if splitter else [(CONTENT, step.text)]
        delta = delta_of(pieces)
        if delta or step.logprobs is not None:
            yield item(delta or {"content": ""}, step.logprobs)
    if last is None:
        return
    delta = delta_of(splitter.flush()) if splitter else {}
    if delta:
        yield item(delta)
    finish = last.finish_reason
    if holding and held:
        content, calls = tool_calls.parse(held, reply.kind)
        if calls:
            if content:
                yield item({"content": content})
            yield item({"tool_calls": [c.openai(i) for i, c in enumerate(calls)]})
            finish = "tool_calls"
        else:
            yield item({"content": held})
    yield item({}, None, finish)


async def _chat_events(
    gens: list[Generation], base: dict[str, Any], reply: _Reply, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events of a chat stream: every choice's chunks as they come, a usage chunk
    when asked, and `data: [DONE]`."""
    lasts: list[Step | None] = [None] * len(gens)
    streams = [_chat_choice_stream(g, i, reply, lasts) for i, g in enumerate(gens)]
    async for choice in merged(streams):
        body = {**base, "object": "chat.completion.chunk", "choices": [choice]}
        if include_usage:
            body["usage"] = None
        yield sse(body)
    if include_usage and any(lasts):
        body = {**base, "object": "chat.completion.chunk", "choices": []}
        yield sse({**body, "usage": _usage(lasts)})
    yield sse("[DONE]")


async def chat_completions(request: Request, req: ChatCompletionRequest) -> Response:
    """POST /v1/chat/completions."""
    state: State = request.app.state.localllm
    json_schema = _response_schema(req.response_format)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    if req.reasoning_format not in (None, "auto", "deepseek", "none"):
        raise bad_request("reasoning_format must be auto, deepseek or none", "reasoning_format")
    messages = chat_messages(req.messages)
    top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # max_completion_tokens is the newer name; it wins when both are given.
    requested = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    tools, forced = _tools(req)
    template_vars = dict(req.chat_template_kwargs or {})
    reply = _Reply(tools=tools is not None)

    def build_ids(model: Model) -> list[int]:
        template = chat_template(model)
        turns = tool_calls.template_messages(messages)
        if tools is None:
            ids = chat_prompt_ids(model, turns, **template_vars)
        else:
            reply.kind = tool_calls.family(template.source)
            if reply.kind is None:
                raise LocalLLMError(f"{req.model}'s chat template does not take tools")
            if forced and reply.kind != "hermes":
                raise LocalLLMError(
                    "tool_choice required or a named function needs a model that writes "
                    "<tool_call> (Qwen, Hermes); use auto"
                )
            ids = chat_prompt_ids(model, turns, tools=tools, **template_vars)
        if req.reasoning_format != "none" and template_thinks(template.source):
            reply.thinks = True
            reply.inside = prompt_opens_thinking(model.tokenizer, ids)
        return ids

    jobs, gens = await _prepare(
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
    base = {"id": jobs[0].id, "created": jobs[0].created, "model": jobs[0].served.id}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return event_stream(_chat_events(gens, base, reply, include_usage), gens)
    results = await collect_or_cancel(request, gens)
    if results is None:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    choices = [_chat_choice(i, r, top_logprobs, reply) for i, r in enumerate(results)]
    return JSONResponse(
        {
            **base,
            "object": "chat.completion",
            "choices": choices,
            "usage": _usage([r[1] for r in results]),
        }
    )


# -- completions ----------------------------------------------------------------------------


async def _completion_choice_stream(
    gen: Generation, job: Job, index: int, echo: str | None, lasts: list[Step | None]
) -> AsyncIterator[dict[str, Any]]:
    """The `choices` items of one streamed completion: the echoed prompt first (with its
    logprobs when asked), then the text of each step, then the finish."""
    offset, last = 0, None

    def item(text: str, logprobs=None, finish: str | None = None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    async for step in gen:
        if last is None and echo is not None:  # the prompt's logprobs are ready by now
            entries = job.prompt_entries
            yield item(echo, None if entries is None else legacy_logprobs(entries))
            offset = len(echo)
        last = lasts[index] = step
        if step.text or step.logprobs is not None:
            logprobs = None
            if step.logprobs is not None:
                logprobs = legacy_logprobs([step.logprobs], offset)
            yield item(step.text, logprobs)
        offset += len(step.text)
    if last is not None:
        yield item("", None, last.finish_reason)


async def _completion_events(
    gens: list[Generation],
    jobs: list[Job],
    base: dict[str, Any],
    echo: str | None,
    include_usage: bool,
) -> AsyncIterator[str]:
    lasts: list[Step | None] = [None] * len(gens)
    streams = [
        _completion_choice_stream(g, j, i, echo, lasts) for i, (g, j) in enumerate(zip(gens, jobs))
    ]
    async for choice in merged(streams):  # completions streams have no opening chunk
        body = {**base, "object": "text_completion", "choices": [choice]}
        if include_usage:
            body["usage"] = None
        yield sse(body)
    if include_usage and any(lasts):
        yield sse({**base, "object": "text_completion", "choices": [], "usage": _usage(lasts)})
    yield sse("[DONE]")


def _completion_choice(index: int, result, job: Job, echo: str | None, logprobs: bool):
    text, last, entries = result
    entry = None
    if logprobs:
        prompt = (job.prompt_entries or []) if echo is not None else []
        entry = legacy_logprobs([*prompt, *entries])
    return {
        "index": index,
        "text": text if echo is None else echo + text,
        "logprobs": entry,
        "finish_reason": last.finish_reason,
    }


async def completions(request: Request, req: CompletionRequest) -> Response:
    """POST /v1/completions: a raw prompt, no chat template. `echo` puts the prompt before
    the completion, and with `logprobs` the prompt tokens' own logprobs before its tokens'
    (the first prompt token has none), as OpenAI's legacy API and vLLM do."""
    state: State = request.app.state.localllm
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request("best_of must equal n (choices are not ranked)", param="best_of")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    echoed: list[str] = []

    def build_ids(model: Model) -> list[int]:
        if isinstance(prompt, str):
            ids = raw_prompt_ids(model, prompt)
            echoed.append(prompt)
            return ids
        vocab = model.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise bad_request(f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
        echoed.append(model.tokenizer.decode(list(prompt)))
        return list(prompt)

    top_logprobs = req.logprobs
    prompt_logprobs = top_logprobs if req.echo else None
    jobs, gens = await _prepare(
        state,
        req,
        build_ids,
        "prompt",
        req.max_tokens,
        top_logprobs,
        "cmpl",
        prompt_logprobs=prompt_logprobs,
    )
    echo = echoed[0] if req.echo else None
    base = {"id": jobs[0].id, "created": jobs[0].created, "model": jobs[0].served.id}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return event_stream(_completion_events(gens, jobs, base, echo, include_usage), gens)
    results = await collect_or_cancel(request, gens)
    if results is None:
        return Response(status_code=499)
    logprobs = top_logprobs is not None
    choices = [
        _completion_choice(i, r, j, echo, logprobs) for i, (r, j) in enumerate(zip(results, jobs))
    ]
    return JSONResponse(
        {
            **base,
            "object": "text_completion",
            "choices": choices,
            "usage": _usage([r[1] for r in results]),
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
