"""The KV cache: one preallocated K and V array for every layer, and the tokens they hold."""

from __future__ import annotations

import numpy as np


class KVCache:
    """K/V for one sequence, allocated once for the whole context.

    `tokens` records which token ids the cache holds, so that a new prompt sharing a prefix
    with it (the next turn of a chat) only prefills what is new.
    """

    def __init__(self, n_layers: int, n_ctx: int, n_kv_heads: int, head_dim: int, zeros=np.zeros):
        """`zeros(shape)` allocates zeros where the backend computes, in the element type its
        attention reads: IEEE half bits (uint16) on the CPU, float32 on CUDA."""
        self.n_ctx = n_ctx
        self.k = zeros((n_layers, n_ctx, n_kv_heads, head_dim))  # [layer, pos, kv_head, d]
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

    def reusable_prefix(self, token_ids: list[int]) -> int:
        """How many leading token_ids the cache already holds and need not be computed again.

        At most len(token_ids) - 1: the last prompt token is always run, since its logits
        choose the next token."""
        n = 0
        for cached, new in zip(self.tokens, token_ids[:-1]):
            if cached != new:
                break
            n += 1
        return n
