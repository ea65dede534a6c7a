"""`localllm serve`: an OpenAI-compatible HTTP API on localhost (FastAPI + uvicorn).

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}], GET /health,
and of Ollama's API what `localllm ps`/`stop` use (`server_ollama`).
Requests are validated here, prompts built by `localllm.prompt`, sampling set up by
`localllm.sampling`, and every model step runs on the engine thread (`server_engine`), which
interleaves concurrent requests token by token, each with its own KV cache.

Security defaults: bind 127.0.0.1; on a loopback bind the Host header must name the loopback
(DNS rebinding) and a browser Origin must be local or listed with --cors-origin (CORS is off
unless origins are listed); bodies are capped; an optional API key is required on every endpoint
but /health; nothing a request says ever becomes a file path.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match

from localllm import server_anthropic, server_ollama, tool_calls
from localllm.errors import LocalLLMError
from localllm.generate import stream_generate
from localllm.models import DEFAULT_CTX, Model, load_model
from localllm.prompt import chat_prompt_ids, chat_template, raw_prompt_ids
from localllm.sampling import Sampler, make_logits_processors, make_sampler
from localllm.server_cors import CORSPolicy, cors_warning
from localllm.server_engine import Engine, EngineBusy, Generation, cancel_check
from localllm.server_schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    chat_messages,
    check_common,
    completion_id,
    legacy_logprobs,
    now,
    stop_strings,
    token_logprobs,
    usage,
)

# Not the default of Ollama (11434), llama.cpp (8080), LM Studio (1234), vLLM (8000), nor of
# the usual web tools (3000, 5000, 7860, 8000, 8080, 8888), nor in /etc/services.
DEFAULT_PORT = 8357
DEFAULT_PARALLEL = 4  # sequences decoded in turn; each holds a KV cache
DEFAULT_MAX_QUEUE = 32  # requests waiting beyond those (no cache yet); past it, 503
MAX_BODY_BYTES = 4 * 1024 * 1024
REPEAT_LAST_N = 64  # penalty window, llama.cpp's default (the one `localllm run` uses)
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})

log = logging.getLogger("localllm.server")


# -- models ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServedModel:
    """A model the server answers for: its id in the API and its GGUF file."""

    id: str
    path: Path


@dataclass(frozen=True)
class LoadedModel:
    """A model in memory, as GET /api/ps reports it (taken when it is loaded)."""

    id: str
    path: Path
    architecture: str
    n_params: int
    quant: str | None
    n_ctx: int
    nbytes: int  # the file plus the KV cache of one full context
    device: str  # the backend's name: "cpu" or "cuda"
    stopping_since: datetime | None = None  # set while an unload waits for running requests

    @classmethod
    def of(cls, model_id: str, model: Model) -> LoadedModel:
        from localllm.store import detect_quant

        transformer = model.transformer
        return cls(
            id=model_id,
            path=model.path,
            architecture=str(model.metadata.get("general.architecture", "")),
            n_params=sum(math.prod(t.shape) for t in model.gguf.tensors.values()),
            quant=detect_quant(model.path),
            n_ctx=model.n_ctx,
            nbytes=model.gguf.file_size + transformer.kv_nbytes,
            device=getattr(transformer.backend, "name", "cpu"),
        )


class ModelPool:
    """The served models, loaded on first use (on the engine thread) and kept loaded.

    With `specs` (names of installed models, or .gguf paths given by the operator) only those
    are served; without, every model installed in the store is. A request's model name is only
    ever looked up, never opened as a path, and nothing is pulled.
    """

    def __init__(
        self,
        specs: list[str],
        engine: Engine,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        device: str = "auto",
    ) -> None:
        self._engine = engine
        self._load_args = (n_ctx, n_threads, device)
        self._loaded: dict[str, Model] = {}
        self._ctx_lengths: dict[str, int] = {}
        self._fixed: dict[str, ServedModel] | None = None
        # What /api/ps reports and unloading needs (see the methods after context_length).
        self._lock = threading.Lock()  # guards _info, _stopping and _digests
        self._info: dict[str, LoadedModel] = {}  # id -> the loaded model, as /api/ps says
        self._stopping: dict[str, datetime] = {}  # id -> when its unload was asked for
        self._running: dict[str, int] = {}  # id -> sequences using it (engine thread only)
        self._digests: dict[Path, str] = {}
        if specs:
            self._fixed = {}
            from localllm.store import find_model

            for spec in specs:
                found = find_model(spec)  # never pulls
                # A file given by path is served under its name without .gguf.
                served_id = found.name if found.installed else found.path.name.removesuffix(".gguf")
                served = ServedModel(served_id, found.path)
                self._fixed.setdefault(served.id, served)
                self._fixed.setdefault(spec, served)  # the name as given is accepted too

    def find(self, name: str) -> ServedModel | None:
        """The model a request names, or None (-> 404)."""
        if self._fixed is not None:
            return self._fixed.get(name)
        from localllm.store import Store, is_path

        if not isinstance(name, str) or is_path(name):
            return None
        try:
            installed = Store().resolve(name)
        except LocalLLMError:  # not a valid model name
            return None
        return None if installed is None else ServedModel(installed.name, installed.path)

    def list(self) -> list[ServedModel]:
        """Every model this server answers for, once each."""
        if self._fixed is not None:
            return list({m.id: m for m in self._fixed.values()}.values())
        from localllm.store import Store

        return [ServedModel(m.name, m.path) for m in Store().list() if m.path.is_file()]

    async def load(self, served: ServedModel) -> Model:
        """The loaded model (loading it on the engine thread the first time)."""
        model = self._loaded.get(served.id)
        if model is None:
            future = self._engine.call(partial(self._load_on_engine, served))
            model = await asyncio.wrap_future(future)
        return model

    def _load_on_engine(self, served: ServedModel) -> Model:
        # Loads run one at a time on the engine thread, so a model is never loaded twice;
        # the backend's thread count is also per thread in Numba, and this is the thread
        # that runs the model.
        model = self._loaded.get(served.id)
        if model is None:
            n_ctx, n_threads, device = self._load_args
            model = load_model(served.path, n_ctx=n_ctx, n_threads=n_threads, device=device)
            self._loaded[served.id] = model
            with self._lock:
                self._info[served.id] = LoadedModel.of(served.id, model)
            log.info("loaded %s (context %d) in %.1f s", served.id, model.n_ctx, model.load_seconds)
        return model

    def context_length(self, served: ServedModel) -> int:
        """The context size the model has or will have once loaded (reads the GGUF header)."""
        if served.id in self._loaded:
            return self._loaded[served.id].n_ctx
        n_ctx = self._load_args[0]
        if n_ctx is not None:
            return n_ctx
        if served.id not in self._ctx_lengths:
            from localllm.gguf import read_gguf

            gguf = read_gguf(served.path)
            try:
                arch = gguf.metadata.get("general.architecture")
                # load_model's default: min(training context, DEFAULT_CTX).
                n_train = int(gguf.metadata.get(f"{arch}.context_length", 2048))
            finally:
                gguf.close()
            self._ctx_lengths[served.id] = min(n_train, DEFAULT_CTX)
        return self._ctx_lengths[served.id]

    # Unloading. A model is only closed on the engine thread, between two steps, and only when
    # no sequence is using it: asked while requests run on it, the unload waits for the last of
    # them to end (new ones may still join; /api/ps shows it as stopping meanwhile). A sequence
    # takes the model from the pool when it starts, so one that was queued behind an unload
    # loads the model again instead of running on a closed one.

    def checkout(self, served: ServedModel) -> Model:
        """The loaded model for a sequence starting now (engine thread; loads it if needed)."""
        model = self._load_on_engine(served)
        self._running[served.id] = self._running.get(served.id, 0) + 1
        return model

    def checkin(self, served: ServedModel) -> None:
        """A sequence is done with its model (engine thread); a pending unload happens now."""
        self._running[served.id] -= 1
        if not self._running[served.id] and served.id in self._stopping:
            self._unload_now(served.id)

    async def unload(self, served: ServedModel) -> None:
        """Unload a model now, or once the requests running on it end (a no-op if not loaded)."""
        future = self._engine.call(partial(self._unload_on_engine, served.id))
        await asyncio.wrap_future(future)

    def _unload_on_engine(self, model_id: str) -> None:
        if model_id not in self._loaded:
            return
        if self._running.get(model_id, 0):
            with self._lock:
                self._stopping.setdefault(model_id, datetime.now(timezone.utc))
            log.info("%s will be unloaded when its running requests end", model_id)
        else:
            self._unload_now(model_id)

    def _unload_now(self, model_id: str) -> None:
        with self._lock:
            self._info.pop(model_id, None)
            self._stopping.pop(model_id, None)
        self._running.pop(model_id, None)
        model = self._loaded.pop(model_id)
        # The map goes once the last reference does; requests still holding the model object
        # (built but not started) drop it when they start (see checkout).
        model.close()
        log.info("unloaded %s", model_id)

    def loaded(self) -> list[LoadedModel]:
        """The models loaded now, in load order, with `stopping_since` set for those whose
        unload waits for running requests."""
        with self._lock:
            return [
                replace(info, stopping_since=self._stopping.get(model_id))
                for model_id, info in self._info.items()
            ]

    def digest(self, path: Path) -> str:
        """The file's sha256: the store's record when it knows the file, else hashed once
        (a .gguf path given to --model). Blocking: call it off the event loop."""
        with self._lock:
            digest = self._digests.get(path)
        if digest is not None:
            return digest
        from localllm.store import Store, sha256_file

        try:
            records = (m.sha256 for m in Store().list() if m.path.resolve() == path.resolve())
            digest = next(records, None)
        except LocalLLMError:  # a damaged manifest: hashing still works
            digest = None
        digest = digest or sha256_file(path)
        with self._lock:
            self._digests[path] = digest
        return digest

    def close(self) -> None:
        """Unmap every loaded model (after the engine has stopped)."""
        for model in self._loaded.values():
            model.close()
        self._loaded.clear()
        with self._lock:
            self._info.clear()
            self._stopping.clear()


# -- one generation -------------------------------------------------------------------------


@dataclass
class _Step:
    """What the engine sends back per step: new text, and the token's logprobs if asked."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: dict[str, Any] | None = None


@dataclass
class _Job:
    """A validated request, ready for the engine."""

    served: ServedModel
    model: Model
    prompt_ids: list[int]
    max_tokens: int
    sampler: Sampler
    processors: list
    stop: list[str]
    top_logprobs: int | None  # None: no logprobs
    id: str = ""
    created: int = field(default_factory=now)


def _steps(job: _Job) -> Iterator[_Step]:
    """The engine-side generator: stream_generate on a fresh KV cache, one item per step."""
    model = job.model
    want_logprobs = job.top_logprobs is not None
    responses = stream_generate(
        model,
        job.prompt_ids,
        max_tokens=job.max_tokens,
        sampler=job.sampler,
        logits_processors=job.processors,
        stop=job.stop,
        # Each request its own sequence: a fresh cache, so that answers never depend on what
        # else the server has run (the pages are only touched as positions fill).
        cache=model.transformer.new_cache(),
        return_logits=want_logprobs,
        should_stop=cancel_check(),  # a client that leaves stops even a long prefill
    )
    with contextlib.closing(responses):
        for r in responses:
            logprobs = None
            if want_logprobs and r.token is not None and r.logits is not None:
                logprobs = token_logprobs(model.tokenizer, r.token, r.logits, job.top_logprobs)
            yield _Step(r.text, r.finish_reason, r.prompt_tokens, r.generation_tokens, logprobs)
            if r.finish_reason is not None:
                log.info(
                    "%s %s: %d prompt tokens (%.0f t/s), %d generated (%.1f t/s), %s",
                    job.id,
                    job.served.id,
                    r.prompt_tokens,
                    r.prompt_tps,
                    r.generation_tokens,
                    r.generation_tps,
                    r.finish_reason,
                )


def _checked_out(pool: ModelPool, job: _Job) -> Iterator[_Step]:
    """_steps on the model the pool holds when the sequence starts, checked back in when it
    ends, so that an unload never closes a model under a running sequence."""
    job.model = pool.checkout(job.served)
    try:
        yield from _steps(job)
    finally:
        pool.checkin(job.served)


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


class _State:
    """What the routes share: the engine and the models."""

    def __init__(self, engine: Engine, pool: ModelPool) -> None:
        self.engine = engine
        self.pool = pool


async def _prepare(
    state: _State,
    req: ChatCompletionRequest | CompletionRequest,
    build_ids: Callable[[Model], list[int]],
    what: str,
    requested_max: int | None,
    top_logprobs: int | None,
    id_prefix: str,
    json_schema: Any = False,
    forced_tools: list[dict[str, Any]] | None = None,
) -> tuple[_Job, Generation]:
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
    job = _Job(
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
    return job, Generation(state.engine, partial(_checked_out, state.pool, job))


async def _until_disconnected(request: Request) -> None:
    """Return when the client goes away (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(gen: Generation) -> tuple[str, _Step, list[dict[str, Any]]]:
    """All text, the last step and the logprob entries of a non-streaming request."""
    texts, entries, last = [], [], None
    try:
        async for step in gen:
            texts.append(step.text)
            if step.logprobs is not None:
                entries.append(step.logprobs)
            last = step
    finally:
        gen.cancel()
    if last is None:
        raise APIError(500, "the generation ended without a result", type="server_error")
    return "".join(texts), last, entries


async def _collect_or_cancel(request: Request, gen: Generation, collect=None) -> Any:
    """The result of `collect` (a coroutine reading gen; default _collect(gen)), or None when
    the client disconnects first: then gen is cancelled within one engine step."""
    collect = asyncio.ensure_future(_collect(gen) if collect is None else collect)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():
            collect.cancel()
            gen.cancel()
    return collect.result() if collect in done else None


def _sse(data: dict[str, Any] | str) -> str:
    if not isinstance(data, str):
        data = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


async def _stream(
    gen: Generation, chunk: Callable[..., dict[str, Any]], include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events: an opening chunk (if chunk(None, None, None) gives one), then
    chunk(text, logprobs, None) per step, a finish chunk, a usage chunk when asked, and
    `data: [DONE]`. Starlette cancels it when the client goes away, which cancels `gen`."""
    last = None
    opening = chunk(None, None, None)
    if opening is not None:
        yield _sse(opening)
    async for step in gen:
        last = step
        if step.text or step.logprobs is not None:
            yield _sse(chunk(step.text, step.logprobs, None))
    if last is not None:
        yield _sse(chunk(None, None, last.finish_reason))
        if include_usage:
            totals = usage(last.prompt_tokens, last.completion_tokens)
            yield _sse(chunk(None, None, None, totals=totals))
    yield _sse("[DONE]")


async def _guarded(events: AsyncIterator[str], gen: Generation) -> AsyncIterator[str]:
    """The events of a chat or completion stream; an error after the headers went out is
    reported in-band, as OpenAI and vLLM do, and `gen` is cancelled however the stream ends
    (Starlette stops iterating when the client goes away)."""
    try:
        async for event in events:
            yield event
    except Exception as e:
        error = e if isinstance(e, APIError) else _internal_error(e)
        yield _sse(error.body())
        yield _sse("[DONE]")
    finally:
        gen.cancel()


def _internal_error(e: Exception) -> APIError:
    if isinstance(e, EngineBusy):
        return APIError(503, str(e), type="server_error", code="server_busy")
    if isinstance(e, LocalLLMError):
        return APIError(500, str(e), type="server_error")
    log.exception("internal error", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


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
        return _sse(body)

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
        yield _sse("[DONE]")
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
        yield _sse(body)
    yield _sse("[DONE]")


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
    state: _State = request.app.state.localllm
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
            return _event_stream(_stream_tool_calls(gen, base, kind[0], include_usage), gen)
        result = await _collect_or_cancel(request, gen)
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

        return _event_stream(_stream(gen, chunk, include_usage), gen)
    result = await _collect_or_cancel(request, gen)
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
    state: _State = request.app.state.localllm
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

        return _event_stream(_stream(gen, chunk, include_usage), gen)
    result = await _collect_or_cancel(request, gen)
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


def _event_stream(events: AsyncIterator[str], gen: Generation) -> StreamingResponse:
    """The SSE response of a stream of `gen`'s events (guarded: see _guarded)."""
    return StreamingResponse(
        _guarded(events, gen),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
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
    state: _State = request.app.state.localllm
    served = await asyncio.to_thread(state.pool.list)
    data = [await _model_card(state, m) for m in served]
    return JSONResponse({"object": "list", "data": data})


async def get_model(request: Request, model_id: str) -> JSONResponse:
    """GET /v1/models/{model_id}."""
    state: _State = request.app.state.localllm
    served = await asyncio.to_thread(state.pool.find, model_id)
    if served is None:
        raise APIError(
            404, f"The model `{model_id}` does not exist", param="model", code="model_not_found"
        )
    return JSONResponse(await _model_card(state, served))


async def _model_card(state: _State, served: ServedModel) -> dict[str, Any]:
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


async def health(request: Request) -> JSONResponse:
    """GET /health: up, and how many requests are running and waiting."""
    state: _State = request.app.state.localllm
    return JSONResponse({"status": "ok", **state.engine.stats()})


# -- the guard: host, origin, key, body size ------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_header_ok(value: str) -> bool:
    # "localhost:8357" / "127.0.0.1" / "[::1]:80": the name without the port must be loopback.
    value = value.strip().lower()
    name = value[: value.find("]") + 1] if value.startswith("[") else value.rsplit(":", 1)[0]
    return name in LOOPBACK_HOSTS


def _origin_ok(origin: str) -> bool:
    try:
        host = urlsplit(origin).hostname or ""
    except ValueError:
        return False
    return host in ("localhost", "127.0.0.1", "::1")


class _Guard:
    """ASGI middleware run before routing: DNS-rebinding and browser cross-origin checks on a
    loopback bind, CORS for the origins listed with --cors-origin (OPTIONS is answered here),
    the API key, and the request body cap (413)."""

    def __init__(
        self, app, *, loopback: bool, api_key: str | None, max_body: int, cors: CORSPolicy
    ) -> None:
        self.app = app
        self.loopback = loopback
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body
        self.cors = cors

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        listed = self.cors.allows(origin)
        if listed:  # every response to it, errors and streams included, says so
            send = _adding_headers(send, self.cors.response_headers(origin))
        error = self._check(scope, headers, listed)
        if error is not None:
            await _error_response(error)(scope, receive, send)
            return
        if scope["method"] == "OPTIONS":
            await self._options(scope, headers, listed)(scope, receive, send)
            return
        received = 0
        max_body = self.max_body

        async def limited_receive():
            # Bodies without a Content-Length (chunked) are counted as they arrive. FastAPI
            # re-raises an HTTPException from reading the body, so this becomes the 413.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_body:
                    raise HTTPException(413, _too_large(max_body))
            return message

        await self.app(scope, limited_receive, send)

    def _check(self, scope, headers: Headers, listed: bool) -> APIError | None:
        if self.loopback and not _host_header_ok(headers.get("host", "")):
            return APIError(
                403,
                "this server only answers requests addressed to localhost, 127.0.0.1 or [::1]",
                code="invalid_host",
            )
        origin = headers.get("origin")
        if self.loopback and origin is not None and not listed and not _origin_ok(origin):
            return _origin_refused(origin)
        if scope["method"] == "OPTIONS":
            return None  # browsers send preflights without the key; OPTIONS reveals nothing
        if self.api_key is not None and scope["path"] != "/health":
            auth = headers.get("authorization", "")
            scheme, _, key = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                key.strip().encode(), self.api_key
            ):
                return APIError(
                    401,
                    "Incorrect API key provided."
                    if auth
                    else "Missing API key: send "
                    "'Authorization: Bearer KEY' (the key given to --api-key).",
                    code="invalid_api_key",
                )
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return APIError(400, "invalid Content-Length header")
            if int(length) > self.max_body:
                return APIError(413, _too_large(self.max_body), code="request_too_large")
        return None

    def _options(self, scope, headers: Headers, listed: bool) -> Response:
        """A CORS preflight (204 for a listed origin, else 403), or a plain OPTIONS (204 with
        the path's methods in Allow)."""
        origin = headers.get("origin")
        if origin is not None and "access-control-request-method" in headers:
            if not listed:
                return _error_response(_origin_refused(origin))
            return Response(status_code=204, headers=self.cors.preflight_headers(headers))
        methods = set()
        for route in getattr(scope.get("app"), "routes", []):
            if isinstance(route, BaseRoute) and route.matches(scope)[0] != Match.NONE:
                methods |= getattr(route, "methods", None) or set()
        if not methods:
            return _error_response(APIError(404, f"no such endpoint: OPTIONS {scope['path']}"))
        return Response(
            status_code=204, headers={"Allow": ", ".join(sorted(methods | {"OPTIONS"}))}
        )


def _origin_refused(origin: str) -> APIError:
    return APIError(
        403,
        f"cross-origin requests from {origin} are refused; to let a web page at that origin use "
        f"this server, start it with --cors-origin {origin}",
        code="invalid_origin",
    )


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), error.status, headers=error.headers)


def _adding_headers(send, extra: list[tuple[bytes, bytes]]):
    """`send`, with `extra` headers added to the start of the response."""

    async def send_with_headers(message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return send_with_headers


def _too_large(max_body: int) -> str:
    return f"the request body is larger than the limit of {max_body} bytes"


# -- errors ---------------------------------------------------------------------------------


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 becomes OpenAI's 400, naming the first offending field."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        error = bad_request(f"the request body is not valid JSON: {detail}".rstrip(": "))
    elif not loc:
        error = bad_request(f"the request body must be a JSON object ({first['msg']})")
    else:
        param = ""
        for p in loc:
            param += f"[{p}]" if isinstance(p, int) else (f".{p}" if param else str(p))
        error = bad_request(f"{param}: {first['msg']}", param=param)
    return JSONResponse(error.body(), 400)


def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), exc.status, headers=exc.headers)


def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    code = "request_too_large" if exc.status_code == 413 else None
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
    error = APIError(exc.status_code, message, code=code)
    return JSONResponse(error.body(), exc.status_code, headers=getattr(exc, "headers", None))


def _busy(request: Request, exc: EngineBusy) -> JSONResponse:
    error = APIError(503, str(exc), type="server_error", code="server_busy")
    return JSONResponse(error.body(), 503, headers={"Retry-After": "1"})


def _server_error(request: Request, exc: Exception) -> JSONResponse:
    error = _internal_error(exc)
    response = JSONResponse(error.body(), error.status)
    # Starlette sends this from outside every middleware, so the guard cannot add CORS to it.
    cors: CORSPolicy = request.app.state.cors
    origin = request.headers.get("origin")
    if cors.allows(origin):
        response.raw_headers.extend(cors.response_headers(origin))
    return response


# -- the app and the command ----------------------------------------------------------------


def create_app(
    models: list[str] | None = None,
    host: str = "127.0.0.1",
    api_key: str | None = None,
    n_ctx: int | None = None,
    n_threads: int | None = None,
    device: str = "auto",
    parallel: int = DEFAULT_PARALLEL,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body: int = MAX_BODY_BYTES,
    cors_origins: list[str] | None = None,
) -> FastAPI:
    """The ASGI app. `models`: installed model names or .gguf paths (none: every installed
    model); `host`: the address it will be bound to (a loopback one turns on the Host and
    Origin checks); `cors_origins`: browser origins allowed to read responses (none: CORS off).
    Raises LocalLLMError for a model that is not there or an origin that is not one."""
    cors = CORSPolicy(cors_origins or [])
    engine = Engine(parallel=parallel, max_queue=max_queue)
    pool = ModelPool(list(models or []), engine, n_ctx, n_threads, device)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # Unmapping the weights under a step still running would crash: only once it is done.
        if engine.stop():
            pool.close()

    app = FastAPI(
        title="localllm",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
    )
    app.state.localllm = _State(engine, pool)
    app.state.cors = cors
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/api/ps", server_ollama.ps, methods=["GET"])
    app.add_api_route("/api/generate", server_ollama.generate, methods=["POST"])
    app.add_api_route("/api/chat", server_ollama.chat, methods=["POST"])
    app.add_api_route("/api/tags", server_ollama.tags, methods=["GET"])
    app.add_api_route("/api/show", server_ollama.show, methods=["POST"])
    app.add_api_route("/api/version", server_ollama.version, methods=["GET"])
    app.add_api_route("/api/embed", server_ollama.embed, methods=["POST"])
    app.add_api_route("/api/pull", server_ollama.pull, methods=["POST"])
    app.add_api_route("/api/delete", server_ollama.delete, methods=["DELETE"])
    app.add_api_route("/api/embeddings", server_ollama.embeddings_legacy, methods=["POST"])
    app.add_api_route("/v1/embeddings", embeddings, methods=["POST"])
    app.add_api_route("/v1/messages", server_anthropic.messages, methods=["POST"])
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(EngineBusy, _busy)
    app.add_exception_handler(Exception, _server_error)
    app.add_middleware(
        _Guard, loopback=is_loopback(host), api_key=api_key or None, max_body=max_body, cors=cors
    )
    return app


def serve(
    models: list[str] | None = None,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    n_ctx: int | None = None,
    n_threads: int | None = None,
    device: str = "auto",
    parallel: int = DEFAULT_PARALLEL,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body: int = MAX_BODY_BYTES,
    log_level: str = "info",
    cors_origins: list[str] | None = None,
) -> None:
    """Serve the API until interrupted (blocking). Startup messages go to stderr."""
    import uvicorn

    app = create_app(
        models, host, api_key, n_ctx, n_threads, device, parallel, max_queue, max_body, cors_origins
    )
    sock = _listen(host, port)
    for warning in (exposure_warning(host, port, api_key), cors_warning(app.state.cors.origins)):
        if warning:
            print(warning, file=sys.stderr)
    # One line per request with its speed, in the same style as uvicorn's own log lines.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    log.addHandler(handler)
    log.setLevel(log_level.upper())
    pool: ModelPool = app.state.localllm.pool
    names = ", ".join(m.id for m in pool.list()) or "(none installed yet)"
    shown = f"[{host}]" if ":" in host else host
    print(f"localllm: serving {names} at http://{shown}:{port}/v1", file=sys.stderr)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])


def exposure_warning(host: str, port: int, api_key: str | None) -> str | None:
    """The loud warning for a server others can reach without a key, or None."""
    if is_loopback(host) or api_key:
        return None
    return (
        "\n"
        + "!" * 78
        + "\nWARNING: localllm is listening on a non-loopback address without --api-key."
        f"\nWARNING: anyone who can reach {host}:{port} can use your models and your CPU."
        "\nWARNING: pass --api-key KEY (clients send it as their OpenAI API key),"
        " or bind 127.0.0.1.\n" + "!" * 78 + "\n"
    )


def _listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket, so that a busy port is one clear error, not a traceback."""
    try:
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        raise LocalLLMError(
            f"cannot listen on {host}:{port}: {e.strerror or e}; is another server using "
            "the port? pick another with --port"
        ) from None
    sock.set_inheritable(True)
    return sock
