"""`localllm bench`: prefill and decode speed on a model, as llama-bench measures them.

Prompts are random token ids (as llama-bench uses), so the numbers do not depend on a tokenizer
or a text. With `depth` tokens already in the KV cache (llama-bench's -d, default 0), each
repetition times a prefill of `n_prompt` tokens and then a decode of `n_gen` tokens after that
prompt; the cache is trimmed back to the depth between repetitions, so the depth is prefilled
only once. One warm-up run first loads the Numba kernels from their cache (or compiles them) and
touches the weights.

Decode is memory-bound: besides tok/s the result gives the GB/s of weights it streams (the bytes
one token reads, times tok/s) and two ceilings, measured here with the same threads, so that the
fraction of each that decode reaches is printed beside it: the machine's read bandwidth (an
anonymous buffer), and a plain read of the model's own weights where decode reads them, in the
file's memory map (page-cache pages, which read slower than the anonymous buffer on the VMs
measured: 29 against 37-40 GB/s).
"""

from __future__ import annotations

import resource
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

from localllm.errors import LocalLLMError
from localllm.models import load_model

BANDWIDTH_BYTES = 1 << 30  # read-bandwidth buffer: far beyond any cache


@dataclass
class BenchResult:
    model: str
    threads: int
    load_s: float
    prefill_tok_s: float  # median over repetitions
    decode_tok_s: float  # median over repetitions
    peak_rss_mb: float
    prompt_tokens: int
    gen_tokens: int
    depth: int  # tokens in the KV cache before the prompt
    repetitions: int
    device: str
    weight_gb_per_token: float  # bytes of weights one decode step reads, in GB (1e9)
    decode_weight_gb_s: float  # weight_gb_per_token x decode tok/s
    read_bandwidth_gb_s: float  # this machine's read bandwidth with these threads (0: not run)
    mapped_read_gb_s: float  # a plain read of the weights in the file's map (0: not run)

    def as_dict(self) -> dict:
        return asdict(self)


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB.

    On Linux from VmHWM, which starts afresh at exec: getrusage's ru_maxrss survives exec, so a
    child of a big process (a test runner) would report its parent's size.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024 if sys.platform != "darwin" else kib / 2**20


@njit(parallel=True, cache=True)
def _sum_rows(words):
    """Sum of uint64[n_rows, n] words, a thread per row at a time: a read-bandwidth probe
    (a plain loop over one row vectorizes; bounds computed per chunk did not, and ran at half
    the speed)."""
    partial = np.zeros(words.shape[0], np.uint64)
    for r in prange(words.shape[0]):
        row = words[r]
        total = np.uint64(0)
        for i in range(row.size):
            total += row[i]
        partial[r] = total
    return partial.sum()


def read_bandwidth_gb_s(n_threads: int, n_bytes: int | None = None, rounds: int = 5) -> float:
    """The best GB/s at which n_threads Numba threads read an n_bytes buffer (faulted in first)."""
    n_rows = 64
    words = np.ones((n_rows, (n_bytes or BANDWIDTH_BYTES) // 8 // n_rows), np.uint64)
    return plain_read_gb_s([words], n_threads, rounds)


def mapped_read_gb_s(tensors: dict, n_threads: int, rounds: int = 3) -> float:
    """The best GB/s at which n_threads threads read the weight matrices decode reads, in place
    in the file's map, one after another as decode's matvecs do (tensors of 64 KiB and more,
    whole 512-byte runs of each: the rate, not the total, is what counts)."""
    n_rows = 64
    words = []
    for name, t in tensors.items():
        skip = name == "token_embd.weight" and "output.weight" in tensors
        if skip or "_exps." in name or t.n_bytes < 1 << 16:
            continue
        flat = t.data.reshape(-1)
        whole = flat[: flat.size // (8 * n_rows) * 8 * n_rows]
        words.append(whole.view(np.uint64).reshape(n_rows, -1))
    return plain_read_gb_s(words, n_threads, rounds) if words else 0.0


def plain_read_gb_s(arrays: list, n_threads: int, rounds: int) -> float:
    """The best GB/s at which n_threads Numba threads read all the arrays (uint64[n_rows, n],
    one after another, each row a thread's at a time): the ceiling of a kernel streaming them."""
    previous = numba.get_num_threads()
    numba.set_num_threads(max(1, min(n_threads, numba.config.NUMBA_NUM_THREADS)))
    try:
        _sum_rows(arrays[0][:, :16])  # compile or load from cache
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for words in arrays:
                _sum_rows(words)
            best = min(best, time.perf_counter() - t0)
    finally:
        numba.set_num_threads(previous)
    return sum(words.nbytes for words in arrays) / best / 1e9


def weight_bytes_per_token(tensors, n_experts: int = 0, n_used: int = 0) -> int:
    """Bytes of weights one decode step reads: every tensor but the embedding table, of which a
    token reads one row, unless the output head is tied to it (then it is read whole); of a MoE
    layer's expert tensors (ffn_*_exps), the n_used experts of n_experts a token runs."""
    total = 0
    for name, t in tensors.items():
        experts = "_exps." in name and n_experts > 0
        total += t.n_bytes * n_used // n_experts if experts else t.n_bytes
    if "output.weight" in tensors and "token_embd.weight" in tensors:
        total -= tensors["token_embd.weight"].n_bytes
    return total


def bench(
    path: str | Path,
    label: str,
    n_prompt: int = 512,
    n_gen: int = 128,
    repetitions: int = 3,
    n_threads: int | None = None,
    device: str = "auto",
    depth: int = 0,
    bandwidth: bool = True,
) -> BenchResult:
    """Load the model; with `depth` tokens in the cache, time a prefill of n_prompt tokens and a
    decode of n_gen tokens after it, `repetitions` times (medians count)."""
    start = time.perf_counter()
    n_ctx = depth + n_prompt + n_gen + 1
    model = load_model(path, n_ctx=n_ctx, n_threads=n_threads, device=device)
    load_s = time.perf_counter() - start
    try:
        model.check_generates()  # an embedding model has no decode to time
    except LocalLLMError:
        model.close()
        raise
    transformer = model.transformer
    cache = transformer.cache
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    context = rng.integers(0, vocab, size=depth).tolist()
    prompt = rng.integers(0, vocab, size=max(n_prompt, 1)).tolist()

    def forward(tokens: list[int], pos: int) -> np.ndarray:
        with transformer.backend.step(len(tokens)):
            return transformer.forward(tokens, pos)  # records the tokens in the cache

    def run(n_p: int, n_g: int) -> tuple[float, float]:
        """(prefill tok/s, decode tok/s) from the depth: the prompt, then decode after it."""
        cache.trim(depth)
        t0 = time.perf_counter()
        logits = forward(prompt[: max(n_p, 1)], depth)
        prefill = n_p / (time.perf_counter() - t0)
        pos = depth + max(n_p, 1)
        t0 = time.perf_counter()
        for i in range(n_g):
            logits = forward([int(np.argmax(logits))], pos + i)
        decode = n_g / (time.perf_counter() - t0) if n_g else 0.0
        return prefill, decode

    try:
        cache.clear()
        for i in range(0, depth, 512):  # the depth once, in prefill-sized chunks
            forward(context[i : i + 512], i)
        run(min(n_prompt, 32), min(n_gen, 4))  # warm-up
        runs = [run(n_prompt, n_gen) for _ in range(repetitions)]
        threads = getattr(transformer.backend, "n_threads", 0)
        c = model.config
        per_token = weight_bytes_per_token(model.gguf.tensors, c.n_experts, c.n_experts_used)
        per_token /= 1e9
        rss = peak_rss_mb()  # before the probe below, which may touch pages decode did not
        measure = bandwidth and transformer.backend.name == "cpu"
        mapped = mapped_read_gb_s(model.gguf.tensors, threads or 1) if measure else 0.0
    finally:
        model.close()
    decode_tok_s = statistics.median(d for _, d in runs)
    return BenchResult(
        model=label,
        threads=threads,
        load_s=round(load_s, 3),
        prefill_tok_s=round(statistics.median(p for p, _ in runs), 2) if n_prompt else 0.0,
        decode_tok_s=round(decode_tok_s, 2),
        peak_rss_mb=round(rss, 1),
        prompt_tokens=n_prompt,
        gen_tokens=n_gen,
        depth=depth,
        repetitions=repetitions,
        device=transformer.backend.name,
        weight_gb_per_token=round(per_token, 4),
        decode_weight_gb_s=round(per_token * decode_tok_s, 2),
        read_bandwidth_gb_s=round(read_bandwidth_gb_s(threads or 1), 2) if measure else 0.0,
        mapped_read_gb_s=round(mapped, 2),
    )


@dataclass
class ParallelResult:
    model: str
    threads: int
    streams: int  # concurrent sequences, each its own prompt
    prompt_tokens: int  # per stream
    gen_tokens: int  # per stream
    seconds: float  # wall time from the submission of all to the last token
    aggregate_tok_s: float  # tokens generated by all streams / seconds
    decode_tok_s: float  # tokens after each stream's first / time after the first tokens
    ttft_s: list[float]  # time to first token of each stream, in order of submission

    def as_dict(self) -> dict:
        return asdict(self)


def bench_parallel(
    path: str | Path,
    label: str,
    streams: list[int],
    n_prompt: int = 128,
    n_gen: int = 128,
    n_threads: int | None = None,
    device: str = "auto",
    repetitions: int = 1,
) -> list[ParallelResult]:
    """Like llama-batched-bench: for each count in `streams`, that many greedy sequences (random
    prompts of n_prompt tokens, n_gen tokens each) submitted at once to the server's engine,
    which runs all their steps as one batched pass; aggregate tok/s and each one's time to first
    token. With repetitions, the counts run in turn that many times (a noisy neighbour slows
    all alike) and each count's fastest run counts."""
    from localllm.server_engine import _END, Engine, Sequence

    n_ctx = n_prompt + n_gen + 1
    model = load_model(path, n_ctx=n_ctx, n_threads=n_threads, device=device)
    try:
        model.check_generates()
        transformer = model.transformer
        rng = np.random.default_rng(0)
        vocab = model.config.vocab_size
        threads = getattr(transformer.backend, "n_threads", 0)
        engine = Engine(parallel=max(streams), max_queue=0)

        def greedy(prompt: list[int]):
            cache = transformer.new_cache()
            logits = transformer.forward(prompt, 0, cache=cache)
            for i in range(n_gen):
                token = int(np.argmax(logits))
                yield token
                if i + 1 < n_gen:
                    logits = transformer.forward([token], n_prompt + i, cache=cache)

        def run(count: int) -> ParallelResult:
            prompts = [rng.integers(0, vocab, size=max(n_prompt, 1)).tolist() for _ in range(count)]
            ended = threading.Semaphore(0)  # released once per stream, at its end
            firsts: list[float] = [0.0] * count
            errors: list[BaseException] = []

            def emitter(k: int):
                def emit(item) -> None:  # on the engine thread
                    if item is _END or isinstance(item, BaseException):
                        if item is not _END:
                            errors.append(item)
                        ended.release()
                    elif not firsts[k]:
                        firsts[k] = time.perf_counter()

                return emit

            t0 = time.perf_counter()
            for k, prompt in enumerate(prompts):
                engine.submit(Sequence(partial(greedy, prompt), emitter(k)))
            for _ in prompts:
                ended.acquire()
            end = time.perf_counter()
            if errors:
                raise errors[0]
            ttft = [f - t0 for f in firsts]
            after = end - max(firsts)
            return ParallelResult(
                model=label,
                threads=threads,
                streams=count,
                prompt_tokens=n_prompt,
                gen_tokens=n_gen,
                seconds=round(end - t0, 3),
                aggregate_tok_s=round(count * n_gen / (end - t0), 2),
                decode_tok_s=round(count * (n_gen - 1) / after, 2) if after > 0 else 0.0,
                ttft_s=[round(t, 3) for t in ttft],
            )

        try:
            run(min(streams))  # warm-up: the kernels' cache, the weights' pages
            rounds = [[run(count) for count in streams] for _ in range(repetitions)]
            return [max(runs, key=lambda r: r.aggregate_tok_s) for runs in zip(*rounds)]
        finally:
            engine.stop()
    finally:
        model.close()
