"""One generation on the engine, shared by the OpenAI, Ollama and Anthropic routes: a validated
request (`Job`), the engine-side generator of its steps, collecting or streaming them, and
cancelling it when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from localllm.errors import LocalLLMError
from localllm.generate import prompt_logits, stream_generate
from localllm.models import Model
from localllm.sampling import Sampler
from localllm.server_engine import Engine, EngineBusy, Generation, cancel_check
from localllm.server_schema import APIError, now, token_entry, token_logprobs

if TYPE_CHECKING:
    from localllm.server import ModelPool, ServedModel

log = logging.getLogger("localllm.server")

# -- -------------------------------------------------------------------------


@dataclass
class Step:
    """What the engine sends back per step: new text, and the token's logprobs if asked."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: dict[str, Any] | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass
class Job:
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
    # Completions' echo with logprobs: the prompt's own logprobs with this many alternatives;
    # steps() fills prompt_entries (the first token's logprob None) before its first step.
    prompt_logprobs: int | None = None
    prompt_entries: list[dict[str, Any]] | None = None
    keep_alive: float | None = None  # seconds the model stays loaded after (None: the server's)


def steps(job: Job) -> Iterator[Step]:
    """The engine-side generator: stream_generate, one item per step, on a KV cache that
    starts with the pool's cached pages of the longest prefix of the prompt (only the rest is
    prefilled). A row's KV does not depend on what ran beside it, so the answer is the same
    either way."""
    cache = job.model.transformer.new_cache()
    try:
        cache.adopt(job.prompt_ids)
        yield from _steps(job, cache)
    finally:
        cache.release()  # its pages stay cached for the next request with this prefix


def _steps(job: Job, cache) -> Iterator[Step]:
    model = job.model
    want_logprobs = job.top_logprobs is not None
    should_stop = cancel_check()  # a client that leaves stops even a long prefill
    if job.prompt_logprobs is not None:
        job.prompt_entries = _prompt_entries(job, cache, should_stop)
    responses = stream_generate(
        model,
        job.prompt_ids,
        max_tokens=job.max_tokens,
        sampler=job.sampler,
        logits_processors=job.processors,
        stop=job.stop,
        cache=cache,  # holds the prompt but its last token when prompt_entries ran
        return_logits=want_logprobs,
        should_stop=should_stop,
    )
    with contextlib.closing(responses):
        for r in responses:
            logprobs = None
            if want_logprobs and r.token is not None and r.logits is not None:
                logprobs = token_logprobs(model.tokenizer, r.token, r.logits, job.top_logprobs)
            yield Step(
                r.text,
                r.finish_reason,
                r.prompt_tokens,
                r.generation_tokens,
                logprobs,
                r.cached_tokens,
            )
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


def _prompt_entries(job: Job, cache, should_stop) -> list[dict[str, Any]]:
    """Each prompt token's logprob under the tokens before it (the first has none), computed
    while prefilling `cache`, which the generation then reuses."""
    tokenizer, ids = job.model.tokenizer, job.prompt_ids
    entries = [{**token_entry(tokenizer, ids[0], None), "top_logprobs": None}]
    rows = prompt_logits(job.model, ids, cache, should_stop)
    for token, logits in zip(ids[1:], rows):
        entries.append(token_logprobs(tokenizer, token, logits, job.prompt_logprobs))
    return entries


def checked_out(pool: ModelPool, job: Job) -> Iterator[Step]:
    """steps on the model the pool holds when the sequence starts, checked back in when it
    ends, so that an unload never closes a model under a running sequence."""
    job.model = pool.checkout(job.served, job.keep_alive)
    try:
        yield from steps(job)
    finally:
        pool.checkin(job.served, job.keep_alive)


class State:
    """What the routes share: the engine and the models."""

    def __init__(self, engine: Engine, pool: ModelPool) -> None:
        self.engine = engine
        self.pool = pool


async def until_disconnected(request: Request) -> None:
    """Return when the client goes away (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(gen: Generation) -> tuple[str, Step, list[dict[str, Any]]]:
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


async def collect_or_cancel(
    request: Request, gens: Generation | list[Generation], reading=None
) -> Any:
    """The result of `reading` (a coroutine reading the generations; by default collect() of
    each: one result, or a list of them for a list), or None when the client disconnects
    first: then every generation is cancelled within one engine step."""
    every = gens if isinstance(gens, list) else [gens]
    if reading is None:
        reading = asyncio.gather(*map(collect, every)) if isinstance(gens, list) else collect(gens)
    task = asyncio.ensure_future(reading)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        task.cancel()
        for gen in every:  # also those still running when another one failed
            gen.cancel()
    return task.result() if task in done else None


def sse(data: dict[str, Any] | str) -> str:
    if not isinstance(data, str):
        data = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


async def guarded(events: AsyncIterator[str], gens: list[Generation]) -> AsyncIterator[str]:
    """The events of a chat or completion stream; an error after the headers went out is
    reported in-band, as OpenAI and vLLM do, and `gens` are cancelled however the stream ends
    (Starlette stops iterating when the client goes away)."""
    try:
        async for event in events:
            yield event
    except Exception as e:
        error = e if isinstance(e, APIError) else internal_error(e)
        yield sse(error.body())
        yield sse("[DONE]")
    finally:
        for gen in gens:
            gen.cancel()


def internal_error(e: Exception) -> APIError:
    if isinstance(e, EngineBusy):
        return APIError(503, str(e), type="server_error", code="server_busy")
    if isinstance(e, LocalLLMError):
        return APIError(500, str(e), type="server_error")
    log.exception("internal error", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


def event_stream(events: AsyncIterator[str], gens: list[Generation]) -> StreamingResponse:
    """The SSE response of a stream of `gens`' events (guarded: see guarded)."""
    return StreamingResponse(
        guarded(events, gens),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """The items of several async iterators as they come (n choices streamed together); an
    error in one ends the whole."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(end)
        except Exception as e:
            await queue.put(e)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is end:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
