"""Continuous batching: the forward passes of concurrent sequences run as one pass per step.

Each sequence on the server's engine runs its generator (stream_generate, unchanged) in a
greenlet of its own on the engine thread. When the generator needs the model,
`Transformer.forward` hands its tokens to the `Batcher` of that greenlet and switches back to
the engine; once every live sequence is waiting so, `Batcher.step` runs them through
`Transformer.forward_batch` in one pass, which reads each weight block once for all of them, and
resumes each sequence whose tokens are done with its logits. A sequence's generator never
knows: its code is the code `localllm run` runs alone, so a batched answer is the answer alone.
That needs a row's result not to depend on the rows beside it, which the integer kernels give
(`Transformer.batches_exactly`); a model with float-kernel matrices runs its sequences one pass
each, chunks cut where `forward` cuts them.

A prompt longer than the batch is fed in chunks, decode tokens first: a long new prompt holds
the running streams back by at most one chunk per step (chunked prefill). Tokens take pages of
the model's KV pool as they run; when a hard pool (the server's) has none left, the newest
sequence waits, or, where an older one needs the page, gives its pages back and later runs
its tokens again (preemption by recompute, as vLLM), so the oldest always advances.

Everything stays on one thread, as the Transformer's scratch buffers and Numba's threading
layer require; greenlets only switch where a sequence waits for the model.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from greenlet import getcurrent

from localllm.kv_cache import KVCache, PoolFull


def current() -> Batcher | None:
    """The batcher of the sequence running now, or None outside a sequence (a plain call)."""
    return getattr(getcurrent(), "batcher", None)


_arrivals = itertools.count()


@dataclass
class Request:
    """A sequence's tokens waiting for the model: they run in one or more steps."""

    transformer: object
    token_ids: np.ndarray  # int64[n], already checked against the vocabulary and the cache
    start_pos: int
    cache: KVCache
    interrupt: Callable[[], None] | None
    greenlet: object  # the sequence's, parked in `Batcher.forward` until resumed
    done: int = 0  # tokens run so far
    order: int = field(default_factory=lambda: next(_arrivals))  # this call's: turns rotate
    age: int = 0  # when its sequence first called: the older keeps the KV pool's pages
    preempted: bool = False  # its pages were taken back: all its tokens run again

    def preempt(self) -> None:
        """Give the cache's pages back (they stay in the prefix cache) and make the request
        run every token the cache held, then the rest of its own: recomputed, as vLLM does,
        from as many cached pages as are still there when it runs again."""
        cache = self.cache
        ids = cache.tokens[: self.start_pos + self.done] + self.token_ids[self.done :].tolist()
        cache.release()
        self.token_ids = np.asarray(ids, np.int64)
        self.start_pos, self.done, self.preempted = 0, 0, True

    def restart(self) -> None:
        """A preempted request about to run: start from the cached pages of its tokens."""
        self.done = self.cache.adopt(self.token_ids.tolist())
        self.preempted = False

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.done

    def resume(self, logits=None, error: BaseException | None = None):
        """Switch back into the sequence with its logits (or raise error there); what its
        greenlet switches back with (it emitted an item, waits again, or has ended)."""
        self.greenlet.parked = None
        if error is not None:
            return self.greenlet.throw(error)
        return self.greenlet.switch(logits)


# Tokens per batched pass (decode tokens and prompt chunks together): a long new prompt holds
# the running streams back by one pass of this many tokens per step. A sequence alone prefills
# in the transformer's own chunks (Transformer.n_batch), which may be larger.
STEP_TOKENS = 64

# Steps in a row with requests waiting for KV pages and none running, after which the oldest
# is told the pool is full (only a pool smaller than a context, or caches held but unused).
STALLED_STEPS = 100
POOL_FULL = "the KV cache has no room for this request; retry later, or use a larger --kv-size"


class Batcher:
    """Collects the requests of the sequences of one engine; `step` runs them, at most
    `step_tokens` tokens per pass (and never more than a transformer's n_batch)."""

    def __init__(self, engine_greenlet, step_tokens: int = STEP_TOKENS) -> None:
        self._engine = engine_greenlet  # where a waiting sequence switches to
        self.requests: list[Request] = []
        self.step_tokens = step_tokens
        self._stalled = 0  # steps in a row that ran nothing for want of KV pages

    def forward(self, transformer, token_ids, start_pos, cache, interrupt) -> np.ndarray:
        """Called in a sequence's greenlet: wait for the step that runs these tokens, and
        return the logits after the last one (or raise what stopped it)."""
        me = getcurrent()
        request = Request(transformer, token_ids, start_pos, cache, interrupt, me)
        if getattr(me, "age", None) is None:
            me.age = request.order
        request.age = me.age
        me.parked = request
        self.requests.append(request)
        return self._engine.switch(request)

    def step(self) -> list[tuple[Request, object]]:
        """One pass per model over the waiting requests: each model's decode tokens first
        (but at most half its batch size while prompt tokens wait), then prompt chunks, oldest
        first, up to its batch size; a decode token left out goes first next step. A request
        whose last tokens ran is resumed with its logits, one whose interrupt raises (a client
        gone) with the error. Returns (request, what the switch into its sequence returned)
        for each resumed."""
        waiting, self.requests = self.requests, []
        resumed: list[tuple[Request, object]] = []
        for transformer in {id(r.transformer): r.transformer for r in waiting}.values():
            group = [r for r in waiting if r.transformer is transformer]
            self._run(transformer, group, resumed)
        return resumed

    def _run(self, transformer, group: list[Request], resumed: list) -> None:
        live = []
        for request in group:
            try:
                if request.interrupt is not None:
                    request.interrupt()
            except BaseException as e:  # Cancelled: the sequence stops where it waits
                resumed.append((request, request.resume(error=e)))
            else:
                if request.preempted:
                    request.restart()
                live.append(request)
        if not getattr(transformer, "batches_exactly", True):
            # rows whose results depend on the rows beside them (float kernels): each sequence
            # runs alone, a chunk per step, cut where `forward` cuts it
            for request in sorted(live, key=lambda r: r.order):
                n = min(request.remaining, transformer.n_batch - request.done % transformer.n_batch)
                self._pass(transformer, self._with_pages([(request, n)], live, resumed), resumed)
            return
        budget, taken = min(transformer.n_batch, self.step_tokens), []
        # Decode tokens first, but never all of the budget while a prompt waits: half of it
        # stays for prompt chunks, so neither starves however many sequences run.
        prompt_tokens = sum(r.remaining for r in live if r.remaining > 1)
        decode_budget = budget - min(prompt_tokens, budget // 2)
        for request in sorted(live, key=lambda r: (r.remaining > 1, r.order)):
            n = min(request.remaining, budget)
            if request.remaining == 1:
                n = min(n, decode_budget)
                decode_budget -= n
            if n == 0:
                self.requests.append(request)  # next step (a decode token: ahead of later ones)
                continue
            taken.append((request, n))
            budget -= n
        taken = self._with_pages(taken, live, resumed)
        if taken:
            self._pass(transformer, taken, resumed)

    def _with_pages(self, taken: list[tuple[Request, int]], live: list, resumed: list) -> list:
        """taken, less what the KV pool has no pages for now, oldest first served: a request
        that finds the pool full takes the pages of the newest request waiting after it (which
        will run its tokens again), or, being the newest, waits for the next step."""
        ready: list[tuple[Request, int]] = []
        waiting: list[Request] = []
        for request, n in sorted(taken, key=lambda item: item[0].age):
            if request.preempted:
                self.requests.append(request)  # taken back by an older one this step
                continue
            start = request.start_pos + request.done
            while True:
                try:
                    request.cache.trim(start)
                    request.cache.prepare(start, n)
                except PoolFull:
                    newer = [
                        r for r in live
                        if r.age > request.age and not r.preempted and r.cache.n_pages
                    ]  # fmt: skip
                    if newer:
                        max(newer, key=lambda r: r.age).preempt()
                        continue
                    waiting.append(request)  # the newest: waits for pages
                else:
                    ready.append((request, n))
                break
        self._stalled = 0 if ready or not waiting else self._stalled + 1
        if self._stalled > STALLED_STEPS:
            # Nothing runs and nothing will: the pages are held by caches no sequence uses
            # (dropped but not yet collected), or a context is larger than the pool.
            gc.collect()
            oldest = min(waiting, key=lambda r: r.age)
            waiting.remove(oldest)
            resumed.append((oldest, oldest.resume(error=PoolFull(POOL_FULL))))
            self._stalled = 0
        self.requests += waiting
        return ready

    def _pass(self, transformer, taken: list[tuple[Request, int]], resumed: list) -> None:
        """One forward pass for the next n tokens of each request."""
        if not taken:
            return
        parts = []
        for request, n in taken:
            ids = request.token_ids[request.done : request.done + n]
            last = n == request.remaining
            parts.append((request.cache, request.start_pos + request.done, ids, last))
        try:
            outs = transformer.forward_batch(parts)
        except Exception as e:  # nothing a sequence did: all of this pass's sequences fail
            for request, _ in taken:
                resumed.append((request, request.resume(error=e)))
            return
        for (request, n), logits in zip(taken, outs, strict=True):
            request.done += n
            if request.remaining == 0:
                resumed.append((request, request.resume(logits)))
            else:
                self.requests.append(request)  # its next chunk runs in the next step
