"""`localllm bench`: prefill and decode speed on a model, in the spirit of llama-bench.

Prompts are random token ids (as llama-bench uses), so the numbers do not depend on a
tokenizer or a text; every repetition starts from an empty KV cache. One warm-up run first
loads the Numba kernels from their cache (or compiles them) and touches the weights.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from localllm.models import load_model


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
    repetitions: int
    device: str

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


def bench(
    path: str | Path,
    label: str,
    n_prompt: int = 128,
    n_gen: int = 64,
    repetitions: int = 3,
    n_threads: int | None = None,
    device: str = "auto",
) -> BenchResult:
    """Load the model, then time prefill of n_prompt tokens and decode of n_gen tokens."""
    start = time.perf_counter()
    model = load_model(path, n_ctx=n_prompt + n_gen + 1, n_threads=n_threads, device=device)
    load_s = time.perf_counter() - start
    transformer = model.transformer
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.config.vocab_size, size=max(n_prompt, 1)).tolist()

    def prefill() -> float:
        transformer.cache.clear()
        t0 = time.perf_counter()
        transformer.forward(prompt, 0)
        return len(prompt) / (time.perf_counter() - t0)

    def decode() -> float:
        transformer.cache.clear()
        token = prompt[0]
        t0 = time.perf_counter()
        for pos in range(n_gen):
            token = int(np.argmax(transformer.forward([token], pos)))
        return n_gen / (time.perf_counter() - t0)

    try:
        prefill(), decode()  # warm-up
        prefills = [prefill() for _ in range(repetitions)] if n_prompt > 0 else [0.0]
        decodes = [decode() for _ in range(repetitions)] if n_gen > 0 else [0.0]
    finally:
        model.close()
    return BenchResult(
        model=label,
        threads=getattr(transformer.backend, "n_threads", 0),
        load_s=round(load_s, 3),
        prefill_tok_s=round(statistics.median(prefills), 2),
        decode_tok_s=round(statistics.median(decodes), 2),
        peak_rss_mb=round(peak_rss_mb(), 1),
        prompt_tokens=n_prompt,
        gen_tokens=n_gen,
        repetitions=repetitions,
        device=transformer.backend.name,
    )
