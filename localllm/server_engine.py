"""The server's engine: one thread that runs every model step, round-robin over the requests.

Calls on one Transformer must not overlap (they share its scratch buffers), and Numba's default
threading layer must not be entered from two threads at once, so all model work — loading and
every prefill or decode step of every request — happens on this one thread. Each active request
advances by one step (one `next()` of its generator: a prefill, or one sampled token) per round,
so concurrent requests interleave token by token, and a cancelled one stops within one step; a
long prefill checks `cancel_check()` between layers, so a client that leaves stops it at once.

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

_END = object()  # emitted after a sequence's last item
_stepping = threading.local()  # .seq: the Sequence the engine thread is advancing right now


def cancel_check() -> Callable[[], bool]:
    """Whether the sequence being stepped has been cancelled, as a check to call later.

    Called inside a sequence's generator (on the engine thread), it binds to that sequence, so
    that work within one step (the prefill of a long prompt) can stop as soon as the client
    leaves instead of at the end of the step. Elsewhere it never says stop."""
    seq = getattr(_stepping, "seq", None)
    if seq is None:
        return lambda: False
    return lambda: seq.cancelled


class EngineBusy(Exception):
    """More requests than the engine runs plus its queue holds: the client should retry later."""


class Sequence:
    """One request's generation on the engine thread: a generator built when it first runs."""

    def __init__(self, start: Callable[[], Iterator[Any]], emit: Callable[[Any], None]) -> None:
        self.start: Callable[[], Iterator[Any]] | None = start
        self.emit = emit  # called on the engine thread with each item, an exception, or _END
        self.steps: Iterator[Any] | None = None
        # Set from any thread; the engine reads it before each step (a plain bool is atomic).
        self.cancelled = False

    def close(self) -> None:
        """Stop the generator (its `finally` blocks run) and drop it, freeing its KV cache."""
        steps, self.steps, self.start = self.steps, None, None
        if steps is not None and hasattr(steps, "close"):
            steps.close()


class Engine:
    """Runs sequences on one worker thread, `parallel` at a time, with `max_queue` more waiting."""

    def __init__(self, parallel: int = 4, max_queue: int = 32) -> None:
        if parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {parallel}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.parallel = parallel
        self.max_queue = max_queue
        self._cond = threading.Condition()
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._waiting: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._thread: threading.Thread | None = None
        self._stopping = False

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
            finished = [seq for seq in active if self._step(seq)]
            if finished:
                with self._cond:
                    self._active = [s for s in self._active if s not in finished]
        with self._cond:
            leftover = self._active + list(self._waiting)
            self._active, self._waiting = [], deque()
        for seq in leftover:
            seq.close()
            seq.emit(EngineBusy("the server is shutting down"))

    @staticmethod
    def _step(seq: Sequence) -> bool:
        """Advance one sequence by one item; True when it is over."""
        if seq.cancelled:
            seq.close()
            return True
        _stepping.seq = seq
        try:
            if seq.steps is None:
                seq.steps = seq.start()
            item = next(seq.steps)
        except StopIteration:
            seq.close()
            seq.emit(_END)
            return True
        except Exception as e:  # including generate.Cancelled, for a client that left
            seq.close()
            seq.emit(e)
            return True
        finally:
            _stepping.seq = None
        seq.emit(item)
        return False


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
