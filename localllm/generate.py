"""Generation: generate_step (token ids) -> stream_generate (text pieces) -> generate (a string).

Every front end (the CLI, the chat REPL, the server) loops over `stream_generate`; none of them
decodes on its own.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from localllm.errors import LocalLLMError
from localllm.kv_cache import KVCache
from localllm.models import Model
from localllm.sampling import LogitsProcessor, Sampler, make_sampler
from localllm.tokenizer import StreamDecoder


@dataclass
class GenerationResponse:
    """One step of a generation: the text it added and the running statistics."""

    text: str  # new text since the previous response (may be "")
    token: int | None  # the token sampled at this step (None for a final flush)
    finish_reason: str | None  # None while generating; then "stop" or "length"
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float
    cached_tokens: int = 0  # prompt tokens whose K/V were reused from the cache
    logits: np.ndarray | None = None  # float32[vocab], the distribution the token came from


class Cancelled(Exception):
    """The caller's `should_stop()` turned true: the generation was abandoned (a client left)."""


@contextmanager
def _interruptions(should_stop: Callable[[], bool] | None) -> Iterator[Callable[[], None]]:
    """A check, called between steps and between the layers of a long prompt, that raises
    KeyboardInterrupt after Ctrl-C and Cancelled once `should_stop()` is true.

    Ctrl-C only sets a flag. Python's own handler raises KeyboardInterrupt wherever the
    interpreter next checks for signals, and that can be inside a Numba kernel call, which then
    fails ("returned a result with an exception set") or leaves native code in a bad state.
    Checking the flag before every layer stops a 2,000-token prompt within one layer's work
    instead of after the whole prefill, and cleanly. Only the main thread can own signal
    handlers; elsewhere (the server's engine thread) only `should_stop` is checked.
    """
    received: list[int] = []

    def check() -> None:
        if received:
            received.clear()
            raise KeyboardInterrupt
        if should_stop is not None and should_stop():
            raise Cancelled("the generation was cancelled")

    if threading.current_thread() is not threading.main_thread():
        yield check
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)


def generate_step(
    model: Model,
    prompt_ids: Sequence[int],
    sampler: Sampler,
    logits_processors: Sequence[LogitsProcessor] = (),
    cache: KVCache | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (token, logits) forever, or until the context is full.

    The prompt is prefilled in chunks; the part of it already in the KV cache (the conversation so
    far, in a chat) is not computed again. Ctrl-C raises KeyboardInterrupt, and `should_stop()`
    turning true raises Cancelled, within one layer of work, even in the middle of a long prompt.
    """
    model.check_generates()
    transformer = model.transformer
    cache = transformer.cache if cache is None else cache
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        raise LocalLLMError("the prompt is empty")
    if len(prompt_ids) > cache.n_ctx:
        raise LocalLLMError(
            f"the prompt is {len(prompt_ids)} tokens, longer than the context size of "
            f"{cache.n_ctx}; use a larger -c/--ctx-size or a shorter prompt"
        )
    n_reused = cache.reusable_prefix(prompt_ids)
    with _interruptions(should_stop) as check:
        logits = transformer.forward(prompt_ids[n_reused:], n_reused, cache=cache, interrupt=check)
        history = prompt_ids
        while True:
            check()
            for process in logits_processors:
                logits = process(history, logits)
            token = sampler(logits)
            yield token, logits
            history.append(token)
            if cache.n_past >= cache.n_ctx:
                return
            logits = transformer.forward([token], cache.n_past, cache=cache, interrupt=check)


def prompt_logits(
    model: Model,
    prompt_ids: Sequence[int],
    cache: KVCache,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[np.ndarray]:
    """float32[vocab] after each prompt token but the last: the distribution the next prompt
    token is scored against (the prompt's own logprobs: completions' echo). Prefills `cache`
    with all of the prompt but its last token, so that a generation on it only runs that one."""
    transformer = model.transformer
    n = len(prompt_ids) - 1
    with _interruptions(should_stop) as check:
        for first in range(0, n, transformer.n_batch):
            chunk = list(prompt_ids[first : min(first + transformer.n_batch, n)])
            yield from transformer.forward(
                chunk, first, all_logits=True, cache=cache, interrupt=check
            )


def _stop_cut(text: str, stop: Sequence[str]) -> tuple[int, int]:
    """(index of the first complete stop string or -1, length of text safe to emit)."""
    first = -1
    for s in stop:
        i = text.find(s)
        if i >= 0 and (first < 0 or i < first):
            first = i
    if first >= 0:
        return first, first
    # Hold back a tail that could still grow into a stop string.
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return -1, len(text) - hold


def stream_generate(
    model: Model,
    prompt: str | Sequence[int],
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    logits_processors: Sequence[LogitsProcessor] = (),
    stop: Sequence[str] = (),
    cache: KVCache | None = None,
    add_special: bool = True,
    parse_special: bool = True,
    return_logits: bool = False,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[GenerationResponse]:
    """Generate from a prompt (text, or token ids), yielding text as it becomes printable.

    Stops at an end-of-generation token ("stop"), a stop string ("stop"; the string is not
    emitted), max_tokens or a full context ("length"). The last response has a finish_reason.
    Ctrl-C (KeyboardInterrupt) and `should_stop()` (Cancelled) stop it at once, prefill included.
    """
    model.check_generates()
    tokenizer = model.tokenizer
    if isinstance(prompt, str):
        prompt_ids = tokenizer.encode(prompt, add_special=add_special, parse_special=parse_special)
    else:
        prompt_ids = list(prompt)
    sampler = sampler or make_sampler(temperature=0.0)
    cache = model.transformer.cache if cache is None else cache
    decoder = StreamDecoder(tokenizer)
    n_prompt = len(prompt_ids)
    n_cached = cache.reusable_prefix(prompt_ids)
    start = time.perf_counter()
    prompt_time = 0.0
    pending = ""  # decoded text not yet emitted (held back for stop strings)
    n_generated = 0

    def response(text, token, finish, logits=None):
        now = time.perf_counter()
        gen_time = now - start - prompt_time
        return GenerationResponse(
            text=text,
            token=token,
            finish_reason=finish,
            prompt_tokens=n_prompt,
            generation_tokens=n_generated,
            prompt_tps=(n_prompt - n_cached) / prompt_time if prompt_time > 0 else 0.0,
            generation_tps=(n_generated - 1) / gen_time
            if n_generated > 1 and gen_time > 0
            else 0.0,
            cached_tokens=n_cached,
            logits=logits if return_logits else None,
        )

    if max_tokens <= 0:
        yield response("", None, "length")
        return
    steps = generate_step(model, prompt_ids, sampler, logits_processors, cache, should_stop)
    finish, token, logits = "length", None, None
    stopped_by_string = False
    try:
        for token, logits in steps:
            if n_generated == 0:
                prompt_time = time.perf_counter() - start
            if token in tokenizer.eog_ids:
                finish, token = "stop", None
                break
            n_generated += 1
            pending += decoder.add(token)
            if stop:
                hit, safe = _stop_cut(pending, stop)
                if hit >= 0:
                    pending = pending[:hit]
                    finish, stopped_by_string = "stop", True
                    break
            else:
                safe = len(pending)
            if n_generated >= max_tokens:
                break
            text, pending = pending[:safe], pending[safe:]
            yield response(text, token, None, logits)
        else:
            token = None  # the context filled up: the last token was already yielded
    finally:
        steps.close()
    if not stopped_by_string:
        pending += decoder.flush()
        hit, _ = _stop_cut(pending, stop) if stop else (-1, 0)
        if hit >= 0:
            pending, finish = pending[:hit], "stop"
    # The last response carries the last sampled token (None after an end-of-generation token).
    yield response(pending, token, finish, logits)


def generate(model: Model, prompt: str | Sequence[int], **kwargs) -> str:
    """The whole completion as one string."""
    return "".join(r.text for r in stream_generate(model, prompt, **kwargs))
