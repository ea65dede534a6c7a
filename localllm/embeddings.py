"""Embeddings: a text's pooled final hidden state, as llama.cpp's embeddings give it.

Pooling follows the file's `{arch}.pooling_type` (llama.cpp's enum: 1 mean, 2 cls = the first
token, 3 last); a model without one (a chat model, not an embedding model) is pooled at its last
token, which is what a causal model's last position has seen of the whole text. Vectors are
L2-normalized, as Ollama's /api/embed and llama-server's embeddings return them. Each text runs
in a KV cache of its own, so nothing of one text leaks into another or into a chat; an embedding
model's (bert, nomic-bert) in one bidirectional pass of its encoder (models/encoder.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from localllm.errors import LocalLLMError
from localllm.models import Model

POOLING = {1: "mean", 2: "cls", 3: "last"}


def pooling(model: Model) -> str:
    """ "mean", "cls" or "last": how this model's token states become one vector."""
    arch = model.metadata.get("general.architecture", "")
    kind = model.metadata.get(f"{arch}.pooling_type")
    return POOLING.get(kind, "last") if isinstance(kind, int) else "last"


def embed_ids(model: Model, ids: Sequence[int], normalize: bool = True) -> np.ndarray:
    """float32[dim]: the pooled (and normalized) embedding of one token sequence."""
    if not ids:
        raise LocalLLMError("cannot embed an empty input")
    if len(ids) > model.n_ctx:
        raise LocalLLMError(
            f"the input is {len(ids)} tokens, more than the context of {model.n_ctx}"
        )
    states = model.transformer.hidden_states(list(ids))  # [n_tokens, dim]
    kind = pooling(model)
    if kind == "mean":
        vector = states.astype(np.float64).mean(axis=0)
    elif kind == "cls":
        vector = states[0].astype(np.float64)
    else:
        vector = states[-1].astype(np.float64)
    if normalize:
        norm = np.linalg.norm(vector)
        vector = vector / norm if norm > 0 else vector
    return vector.astype(np.float32)


def embed_texts(
    model: Model, texts: Sequence[str], truncate: bool = True
) -> tuple[list[np.ndarray], int]:
    """(one embedding per text, the tokens they took). A text longer than the context is cut
    to its first n_ctx tokens with `truncate` (Ollama's default), else refused."""
    vectors, n_tokens = [], 0
    for text in texts:
        ids = model.tokenizer.encode(text, add_special=True, parse_special=False)
        if truncate:
            ids = ids[: model.n_ctx]
        vectors.append(embed_ids(model, ids))
        n_tokens += len(ids)
    return vectors, n_tokens
