"""Threads: how many the kernels use by default, how they wait, and fewer when the cores are busy.

Numba's parallel kernels fork and join at every parallel region (a few hundred per decoded token),
so a step waits for its slowest thread. When another process holds one of the cores, the thread
that shares it with that process is descheduled for whole time slices, and every region waits
for it: on 2 cores with a busy loop on one, 2 threads decoded qwen2.5-0.5b at 12-26 tok/s where
1 thread gave 41. No setting of the threading layer removes that: waiting passively (sleeping at
once) made the busy case as fast as 1 thread but cost a third of the speed on idle cores, where
spinning briefly is what keeps the regions back to back. So the default count is measured as it
runs (`ThreadTuner`): steps run on the count that has been fastest lately, and the other counts
are tried now and then, or at once when a step gets much slower than usual. An explicit -t is
taken as it is.

`configure_environment()` runs when localllm is imported, before Numba starts its thread pool:
the OpenMP threads spin for a bounded time (then sleep) instead of libgomp's default, which keeps
a waiting thread burning its core for milliseconds; numpy's BLAS, which localllm does not use for
its kernels, gets one thread instead of one per core.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# ~0.2-0.5 ms of spinning before a waiting OpenMP thread sleeps: the gap between two kernels of a
# token is far shorter, the gap between tokens or requests is not (libgomp's default: 300,000).
GOMP_SPINCOUNT = "20000"
FIRST_EXPLORATION = 3  # steps before the tuner first tries another count


def configure_environment(environ: dict | None = None) -> None:
    """Thread-pool settings read by the libraries when they start; the user's own settings win."""
    environ = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" not in environ:
        environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
        environ.setdefault("KMP_BLOCKTIME", "1")  # the same for Intel's OpenMP (milliseconds)
    for name in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        environ.setdefault(name, "1")


def physical_cores(
    cpus: set[int] | None = None, sysfs: Path = Path("/sys/devices/system/cpu")
) -> int:
    """Physical cores among the CPUs this process may run on (SMT siblings count once)."""
    if cpus is None:
        try:
            cpus = os.sched_getaffinity(0)
        except AttributeError:  # not on Linux
            return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            siblings = (topology / "thread_siblings_list").read_text().strip()
            package = (topology / "physical_package_id").read_text().strip()
        except OSError:
            return len(cpus) or 1  # no topology (containers, other systems): every CPU counts
        cores.add((package, siblings))
    return len(cores) or 1


class ThreadTuner:
    """Chooses how many of `max_threads` each step runs on, by timing the steps.

    Decode (one token) and prefill (a chunk of tokens) are timed apart, per token, as a moving
    average per thread count. A step runs on the fastest count (prefill, until it has its own
    figures, on decode's choice: a busy core slows both). Now and then a step tries another
    count: after FIRST_EXPLORATION steps, then at an interval that doubles, up to
    `max_interval`, while the tries confirm the choice, and at once when a step takes `slowdown`
    times its count's average (the machine got busier). Results do not depend on the count:
    each output row is computed by one thread (tested).
    """

    def __init__(
        self,
        max_threads: int,
        set_threads: Callable[[int], None],
        clock: Callable[[], float] = time.perf_counter,
        base_interval: int = 32,
        max_interval: int = 256,
        slowdown: float = 1.5,
        tune: bool = True,
    ) -> None:
        """tune=False: always max_threads (an explicit -t)."""
        counts = {1, max(1, max_threads // 2), max_threads} if tune else {max_threads}
        self.candidates = sorted(counts)
        self._set_threads = set_threads
        self._clock = clock
        self.base_interval, self.max_interval = base_interval, max_interval
        self.slowdown = slowdown
        self._average: dict[tuple[bool, int], float] = {}  # (prefill, threads) -> s per token
        self._steps = {False: 0, True: 0}  # steps since the last try, per kind
        self._interval = {False: FIRST_EXPLORATION, True: FIRST_EXPLORATION}
        self._tries = {False: 0, True: 0}  # tries so far, so that the other counts take turns
        self._current: tuple[int, int] | None = None  # (thread, count): Numba's is per thread

    def best(self, prefill: bool) -> int:
        """The count with the lowest average time per token (none measured: the most)."""
        known = {
            n: self._average[prefill, n] for n in self.candidates if (prefill, n) in self._average
        }
        if prefill and len(known) < len(self.candidates) and self._measured_all(False):
            return self.best(False)  # decode's choice, until prefill has its own figures
        return min(known, key=known.__getitem__) if known else self.candidates[-1]

    def _measured_all(self, prefill: bool) -> bool:
        return all((prefill, n) in self._average for n in self.candidates)

    def _choose(self, prefill: bool) -> tuple[int, bool]:
        """(threads for the next step, whether it is a try of another count)."""
        best = self.best(prefill)
        if len(self.candidates) == 1 or self._steps[prefill] < self._interval[prefill]:
            self._steps[prefill] += 1
            return best, False
        self._steps[prefill] = 0
        self._tries[prefill] += 1
        others = [n for n in reversed(self.candidates) if n != best]
        return others[self._tries[prefill] % len(others)], True

    @contextmanager
    def step(self, n_tokens: int) -> Iterator[int]:
        """Run one step of n_tokens (decode: 1) on the chosen count; yields that count."""
        prefill = n_tokens > 1
        before = self.best(prefill)
        n, trying = self._choose(prefill)
        current = (threading.get_ident(), n)
        if current != self._current:
            self._set_threads(n)
            self._current = current
        start = self._clock()
        yield n
        per_token = (self._clock() - start) / n_tokens
        key = (prefill, n)
        average = self._average.get(key)
        if average is None:
            self._average[key] = per_token
        elif trying:  # a stale figure: mostly replaced by what the machine does now
            self._average[key] = 0.3 * average + 0.7 * per_token
        else:
            if per_token > self.slowdown * average:  # the machine changed: try the others now
                self._interval[prefill] = self._steps[prefill] = 0
            self._average[key] = 0.7 * average + 0.3 * per_token
        if trying:  # a try that confirms the choice makes the next one wait twice as long
            interval = self._interval[prefill]
            if self.best(prefill) == before:
                interval = min(max(2 * interval, self.base_interval), self.max_interval)
            else:
                interval = self.base_interval
            self._interval[prefill] = interval
