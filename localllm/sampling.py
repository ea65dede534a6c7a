"""Samplers and logits processors, as closures (the mlx-lm shape).

The chain follows llama.cpp's default order: penalties, top-k, top-p, min-p, temperature, draw.
Top-p and min-p therefore see the untempered distribution, as in llama.cpp. Temperature 0 is argmax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from localllm.errors import LocalLLMError

Sampler = Callable[[np.ndarray], int]
LogitsProcessor = Callable[[Sequence[int], np.ndarray], np.ndarray]

# llama.cpp's defaults (`llama-cli`); Ollama's differ slightly (top_p 0.9, repeat_penalty 1.1).
DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0)


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(), dtype=np.float64)
    return e / e.sum()


def make_sampler(
    temperature: float = 0.8,
    top_k: int = 40,
    top_p: float = 0.95,
    min_p: float = 0.05,
    seed: int | None = None,
) -> Sampler:
    """A function from logits float32[vocab] to a token id."""
    if temperature < 0:
        raise LocalLLMError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise LocalLLMError(f"top-p must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise LocalLLMError(f"min-p must be in [0, 1], got {min_p}")
    if top_k < 0:
        raise LocalLLMError(f"top-k must be >= 0 (0 disables it), got {top_k}")
    if temperature == 0:
        return lambda logits: int(np.argmax(logits))
    rng = np.random.default_rng(seed)

    def sample(logits: np.ndarray) -> int:
        # Candidates, most likely first.
        if 0 < top_k < len(logits):
            ids = np.argpartition(-logits, top_k - 1)[:top_k]
        else:
            ids = np.arange(len(logits))
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        values = logits[ids].astype(np.float64)
        if top_p < 1.0:
            cumulative = np.cumsum(_softmax(values))
            keep = int(np.searchsorted(cumulative, top_p)) + 1
            ids, values = ids[:keep], values[:keep]
        if min_p > 0.0:
            probs = _softmax(values)
            keep = max(1, int(np.count_nonzero(probs >= min_p * probs[0])))
            ids, values = ids[:keep], values[:keep]
        probs = _softmax(values / temperature)
        return int(ids[rng.choice(len(ids), p=probs)])

    return sample


def make_logits_processors(
    repeat_penalty: float = 1.0,
    repeat_last_n: int = 64,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> list[LogitsProcessor]:
    """Penalties over the last repeat_last_n tokens (prompt included), as llama.cpp applies them:
    a positive logit is divided by repeat_penalty and a negative one multiplied, then
    count * frequency_penalty + presence_penalty is subtracted from every token seen."""
    if repeat_penalty <= 0:
        raise LocalLLMError(f"repeat penalty must be > 0, got {repeat_penalty}")
    if repeat_penalty == 1.0 and presence_penalty == 0.0 and frequency_penalty == 0.0:
        return []

    def penalize(history: Sequence[int], logits: np.ndarray) -> np.ndarray:
        recent = history[-repeat_last_n:] if repeat_last_n > 0 else []
        if not recent:
            return logits
        ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
        logits = logits.copy()
        values = logits[ids]
        values = np.where(values > 0, values / repeat_penalty, values * repeat_penalty)
        values -= counts * frequency_penalty + presence_penalty
        logits[ids] = values
        return logits

    return [penalize]
