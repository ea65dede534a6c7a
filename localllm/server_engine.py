"""The server's engine: one thread that runs every model step, for all requests at once.

Calls on one Transformer must not overlap (they share its scratch buffers), and Numba's default
threading layer must not be entered from two threads at once, so all model work — loading and
every prefill or decode step of every request — happens on this one thread. Each request's
generator runs in a greenlet of its own there; where it needs the model it waits, and the
engine runs the tokens of every waiting sequence in one batched pass (`batching.Batcher`), so
concurrent requests share each read of the weights, and a long new prompt is fed in chunks
between the decode steps of the others. A cancelled request stops within one step: its
greenlet gets the exception where it waits, so its generators' `finally` blocks run.

The event loop talks to the engine through `Generation`, an async iterator over one request's
steps; dropping or cancelling it cancels the request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from greenlet import greenlet

from localllm.batching import STEP_TOKENS, Batcher, Request
from localllm.generate import Cancelled

_END = object()  # emitted after a sequence's last item
_STEPPED = object()  # a sequence's greenlet emitted one item
_DONE = object()  # a sequence's greenlet has ended (its last emit was _END or an error)


def cancel_check() -> Callable[[], bool]:
    """Whether the sequence being stepped has been cancelled, as a check to call later.

    Called inside a sequence's generator (on the engine thread), it binds to that sequence, so
    that work within one step (the prefill of a long prompt) can stop as soon as the client
    leaves instead of at the end of the step. Elsewhere it never says stop."""
    seq = getattr(greenlet.getcurrent(), "seq", None)
    if seq is None:
        return lambda: False
    return lambda: seq.cancelled


class EngineBusy(Exception):
    """More requests than the engine runs plus its queue holds: the client should retry later."""


class _SequenceGreenlet(greenlet):
    """A sequence's greenlet; `batching.current()` and `cancel_check()` read these."""

    def __init__(self, run, parent, seq: Sequence, batcher: Batcher) -> None:
        super().__init__(run, parent)
        self.seq = seq
        self.batcher = batcher
        self.parked: Request | None = None  # the model call it waits for, if any


class Sequence:
    """One request's generation on the engine thread: a generator built when it first runs."""

    def __init__(self, start: Callable[[], Iterator[Any]], emit: Callable[[Any], None]) -> None:
        self.start: Callable[[], Iterator[Any]] | None = start
        self.emit = emit  # called on the engine thread with each item, an exception, or _END
        self.greenlet: _SequenceGreenlet | None = None  # made when it first runs
        # Set from any thread; the engine reads it before each step (a plain bool is atomic).
        self.cancelled = False

    def run(self, engine: greenlet) -> Any:
        """The greenlet's body: emit each item of the generator, switching back to the engine
        after each; an exception ends it (and is emitted)."""
        try:
            with contextlib.closing(self.start()) as steps:
                for item in steps:
                    self.emit(item)
                    engine.switch(_STEPPED)
        except Exception as e:  # including generate.Cancelled, for a client that left
            self.emit(e)
        else:
            self.emit(_END)
        finally:
            self.start = None  # let go of the model (an unload waits for its last reference)
        return _DONE

    @property
    def waiting(self) -> bool:
        """Whether it waits in a model call (the batcher resumes it)."""
        return self.greenlet is not None and self.greenlet.parked is not None


class Engine:
    """Runs sequences on one worker thread, `parallel` at a time, with `max_queue` more waiting."""

    def __init__(self, parallel: int = 4, max_queue: int = 32, step_tokens: int = STEP_TOKENS):
        if parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {parallel}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be at least 1, got {step_tokens}")
        self.parallel = parallel
        self.max_queue = max_queue
        self.step_tokens = step_tokens  # tokens per batched pass (batching.STEP_TOKENS)
        self._cond = threading.Condition()
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._waiting: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._batcher: Batcher | None = None  # made on the engine thread

    # -- the event-loop side ----------------------------------------------------------------

    def check_room(self, count: int = 1) -> None:
        """Raise EngineBusy now if `count` new sequences would be refused (before costly
        preparation)."""
        with self._cond:
            self._check_room(count)

    def submit(self, seq: Sequence) -> None:
        """Queue a sequence, or raise EngineBusy when `parallel + max_queue` are already in."""
        with self._cond:
            self._ensure_thread()
            self._check_room()
            self._waiting.append(seq)
            self._cond.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the engine thread between two steps (model loading); its future result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._ensure_thread()
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def stats(self) -> dict[str, int]:
        """How many requests are running and waiting right now."""
        with self._cond:
            self._purge_cancelled()
            active = sum(not s.cancelled for s in self._active)
            return {"active": active, "waiting": len(self._waiting)}

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the worker (sequences still running get an error); False if it is still busy
        with a step after `timeout` seconds."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    # -- the engine thread ------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._stopping:
            raise EngineBusy("the server is shutting down")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="localllm-engine", daemon=True)
            self._thread.start()

    def _check_room(self, count: int = 1) -> None:
        self._purge_cancelled()
        # A cancelled sequence still in _active leaves at its next step: it takes no room.
        running = sum(not s.cancelled for s in self._active)
        if running + len(self._waiting) + count > self.parallel + self.max_queue:
            raise EngineBusy(
                f"the server is busy ({self.parallel} requests running, {self.max_queue} "
                "queued); retry later"
            )

    def _purge_cancelled(self) -> None:
        # A cancelled request that never started costs nothing: drop it from the queue now.
        if any(s.cancelled for s in self._waiting):
            self._waiting = deque(s for s in self._waiting if not s.cancelled)

    def _run(self) -> None:
        self._batcher = Batcher(greenlet.getcurrent(), self.step_tokens)
        while True:
            with self._cond:
                while not (self._calls or self._waiting or self._active or self._stopping):
                    self._cond.wait()
                if self._stopping:
                    break
                self._purge_cancelled()
                while self._waiting and len(self._active) < self.parallel:
                    self._active.append(self._waiting.popleft())
                calls = list(self._calls)
                self._calls.clear()
                active = list(self._active)
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as e:
                        future.set_exception(e)
            # Each sequence not waiting for the model runs until it emits an item or waits,
            # then one pass runs the tokens of all that wait (which resumes them). No loop
            # variable outlives the step: an unload waits for the model's last reference.
            finished = [s for s in active if not s.waiting and self._advance(s)]
            finished += [r.greenlet.seq for r, out in self._batcher.step() if out is _DONE]
            if finished:
                with self._cond:
                    self._active = [s for s in self._active if s not in finished]
        with self._cond:
            leftover = self._active + list(self._waiting)
            self._active, self._waiting = [], deque()
        for seq in leftover:
            self._stop(seq, EngineBusy("the server is shutting down"))

    def _advance(self, seq: Sequence) -> bool:
        """Run a sequence until it emits an item, waits for the model, or ends; True when it
        has ended. A cancelled one gets Cancelled where it stands."""
        if seq.cancelled:
            self._stop(seq, Cancelled("the generation was cancelled"))
            return True
        if seq.greenlet is None:
            seq.greenlet = _SequenceGreenlet(seq.run, greenlet.getcurrent(), seq, self._batcher)
            return seq.greenlet.switch(greenlet.getcurrent()) is _DONE
        return seq.greenlet.switch() is _DONE

    def _stop(self, seq: Sequence, error: BaseException) -> None:
        """End a sequence: a started one gets `error` where it stands (its `finally` blocks
        run and it emits the error); one that never ran is told directly."""
        g = seq.greenlet
        if g is not None and not g.dead:
            if g.parked is not None:
                with contextlib.suppress(ValueError):
                    self._batcher.requests.remove(g.parked)
                g.parked = None
            g.throw(error)
        elif g is None:
            seq.emit(error)


def _emit_to(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Callable[[Any], None]:
    # Deliberately a closure over the queue only, not the Generation: the engine holding it must
    # not keep the Generation alive, so that dropping the Generation cancels the sequence.
    def emit(item: Any) -> None:
        # RuntimeError: the event loop is closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(queue.put_nowait, item)

    return emit


class Generation:
    """The request side of a sequence: `async for item in Generation(engine, start)`.

    Submits on creation (raising EngineBusy when full). `cancel()`, or dropping the object
    unfinished, stops the sequence within one engine step.
    """

    def __init__(self, engine: Engine, start: Callable[[], Iterator[Any]]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._seq = Sequence(start, _emit_to(asyncio.get_running_loop(), self._queue))
        self._done = False
        engine.submit(self._seq)

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            self._done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def cancel(self) -> None:
        """Stop the sequence (idempotent; a no-op once it has finished)."""
        self._seq.cancelled = True

    def __del__(self) -> None:
        # E.g. a streaming response whose body never started because the client left at once.
        self._seq.cancelled = True
