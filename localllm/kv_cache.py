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
        return reusable_prefix(self.tokens, token_ids)


def reusable_prefix(held: list[int], token_ids: list[int]) -> int:
    """How many leading token_ids match `held` (the tokens some KV holds), at most all but the
    last of them (see KVCache.reusable_prefix)."""
    n = 0
    for cached, new in zip(held, token_ids[:-1]):
        if cached != new:
            break
        n += 1
    return n


class PrefixCache:
    """The KV caches of finished sequences, kept for requests that start with the same tokens.

    A chat client resends its whole history each turn, and many requests share a system
    prompt: `take` hands a new sequence the idle cache holding the longest prefix of its
    prompt, so only the rest is prefilled (the sequence's own code reuses what
    `KVCache.reusable_prefix` says). Like llama-server's per-slot prompt cache, at most
    `capacity` idle caches are kept (one per slot by default), and the least recently used
    goes first; their memory is what that many sequences would hold while running.
    """

    def __init__(self, new_cache, capacity: int = 4) -> None:
        self._new_cache = new_cache  # () -> an empty KVCache of the model's context
        self.capacity = capacity
        self._idle: list[KVCache] = []  # least recently used first

    def take(self, token_ids: list[int]) -> KVCache:
        """A cache for a sequence with this prompt: the idle one that holds the longest prefix
        of it; without any, a fresh one (or the least recently used, when all are kept)."""
        held = [c.reusable_prefix(token_ids) for c in self._idle]
        if held and max(held) > 0:
            return self._idle.pop(held.index(max(held)))
        if self._idle and len(self._idle) >= self.capacity:
            return self._idle.pop(0)
        return self._new_cache()

    def give(self, cache: KVCache) -> None:
        """A sequence has ended: keep its cache (the most recently used) for the next ones."""
        if self.capacity <= 0:
            return
        self._idle.append(cache)
        while len(self._idle) > self.capacity:
            self._idle.pop(0)

    @property
    def cached_tokens(self) -> int:
        return sum(c.n_past for c in self._idle)
