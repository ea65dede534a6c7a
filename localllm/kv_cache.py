"""The KV cache: one preallocated K and V array for every layer, and the tokens they hold."""

from __future__ import annotations

import numpy as np

from localllm.errors import LocalLLMError


class KVCache:
    """K/V for one sequence, allocated once for the whole context.

    `tokens` records which token ids the cache holds, so that a new prompt sharing a prefix
    with it (the next turn of a chat) only prefills what is new.
    """

    def __init__(self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim: int, zeros=np.zeros):
        """`zeros(shape)` allocates float32 zeros where the backend computes (host or device)."""
        self.n_ctx = n_ctx
        self.k = zeros((n_layers, n_ctx, n_kv_heads, head_dim))  # float32[layer, pos, kv_head, d]
        self.v = zeros((n_layers, n_ctx, n_kv_heads, head_dim))
        self.tokens: list[int] = []

    @property
    def n_past(self) -> int:
        """How many positions are filled."""
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def trim(self, n: int) -> None:
        """Forget everything from position n on (the data is simply overwritten later)."""
        del self.tokens[n:]

    def clear(self) -> None:
        self.tokens.clear()

    def common_prefix(self, token_ids: list[int]) -> int:
        """Length of the longest prefix of token_ids already in the cache."""
        n = 0
        for cached, new in zip(self.tokens, token_ids):
            if cached != new:
                break
            n += 1
        return n

    def check_room(self, n_new: int) -> None:
        """Raise a clear error when n_new more tokens would not fit in the context."""
        if self.n_past + n_new > self.n_ctx:
            raise LocalLLMError(
                f"the context is full: {self.n_past} + {n_new} tokens exceed the context size "
                f"of {self.n_ctx}; use a larger -c/--ctx-size or a shorter prompt"
            )
