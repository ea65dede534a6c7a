"""The KV cache: one pool of K/V pages per model, and each sequence's table of the pages it holds.

A page holds the K and V rows of `page_tokens` consecutive positions, for every layer, each
K/V head's rows contiguous (attention reads one head at a time: whole runs of its rows stream
from memory at twice the speed of one head's slice of every position's row). A
sequence (`KVCache`) owns a list of pages, its page table, and attention reads through it
(ops.attention), so memory follows the sequences' actual lengths: the pool's arrays are zeros
that the OS only backs once written, and freed pages are handed out again first.

The pool is also the prefix cache, as vLLM's automatic prefix caching: a page that is full is
known by the hash of its tokens and of every token before it (`page_key`), and a new sequence
starts with the cached pages of the longest prefix of its prompt (`KVCache.adopt`), shared with
whoever else holds them. A sequence that ends leaves its pages cached, and its last, partial
page too, for the next turn of a chat that resends the history. A page that nobody holds stays
cached until its memory is needed, least recently used first. Cached or shared pages are never
written: a sequence that must write into one (its prompt ends or turns inside it) writes into
a copy.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from localllm.errors import LocalLLMError

PAGE_TOKENS = 64  # positions per page on the CPU (a multiple of ops.KV_BLOCK)
ROOT = b""  # the key before a sequence's first page


class PoolFull(LocalLLMError):
    """Every page of the pool is held by running sequences."""


def page_key(parent: bytes, tokens) -> bytes:
    """The prefix-cache key of a full page: its tokens and, through parent (the key of the
    page before it, ROOT for the first), every token before them."""
    data = np.asarray(tokens, dtype=np.int64).tobytes()
    return hashlib.blake2b(parent + data, digest_size=16).digest()


class KVPool:
    """The K/V pages of one model: k, v: [layer, page, kv_head, page_tokens, head_dim], in the
    element type the backend's attention reads (`zeros(shape)` allocates them).

    `capacity` pages are the pool's size: the arrays start with fewer and grow toward it as
    pages are needed. At capacity a page is found by evicting the least recently used cached
    page nobody holds; past that, a `hard` pool raises PoolFull (the server's --kv-size), while
    a soft one grows further (one user's `localllm run`, a benchmark's extra streams).
    """

    def __init__(
        self, n_layers: int, n_kv_heads: int, head_dim: int, page_tokens: int, capacity: int,
        zeros=np.zeros, hard: bool = False,
    ):  # fmt: skip
        if page_tokens < 1 or capacity < 1:
            raise ValueError(f"a pool of {capacity} pages of {page_tokens} tokens")
        self.page_tokens = page_tokens
        self.capacity = capacity
        self.hard = hard
        self._zeros = zeros
        self._rows = (n_layers, n_kv_heads, page_tokens, head_dim)
        self.k = self.v = None
        self._refs: list[int] = []  # per page: how many sequences hold it
        self._key: list[bytes | None] = []  # per page: its key, if cached as a full page
        self._tail: list[tuple[bytes, tuple] | None] = []  # or (parent key, tokens), as a tail
        self._free: list[int] = []  # pages that hold nothing, the last handed out first
        self._full: dict[bytes, int] = {}  # key -> the cached full page
        self._tails: dict[bytes, set[int]] = {}  # parent key -> cached partial pages after it
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unheld: least recent first
        self._returned: list[int] = []  # pages of caches dropped unreleased (see KVCache.__del__)
        self._grow(min(capacity, 16))

    # -- memory -------------------------------------------------------------------------------

    @property
    def n_pages(self) -> int:
        """The pages the arrays hold now."""
        return len(self._refs)

    @property
    def row_shape(self) -> tuple[int, int]:
        """(n_kv_heads, head_dim): one position's K (or V) row of one layer."""
        return self._rows[1], self._rows[3]

    @property
    def page_nbytes(self) -> int:
        """The bytes of one page, K and V."""
        return 2 * int(np.prod(self._rows)) * self.k.dtype.itemsize

    @property
    def pages_held(self) -> int:
        """Pages some sequence holds (the rest are free or cached)."""
        self._collect()
        return sum(r > 0 for r in self._refs)

    @property
    def pages_cached(self) -> int:
        """Pages kept for the prefix cache that no sequence holds."""
        self._collect()
        return len(self._idle)

    def grow(self, n_pages: int) -> None:
        """Make the arrays at least n_pages long."""
        if n_pages > self.n_pages:
            self._grow(n_pages)

    def _grow(self, n_pages: int) -> None:
        """Make the arrays n_pages long, keeping the pages handed out so far."""
        old, have = (self.k, self.v), self.n_pages
        n_layers, *page = self._rows
        self.k = self._zeros((n_layers, n_pages, *page))
        self.v = self._zeros((n_layers, n_pages, *page))
        if have:
            for new, was in zip((self.k, self.v), old, strict=True):
                for layer in range(n_layers):  # contiguous copies (host or device)
                    new[layer, :have] = was[layer, :have]
        self._refs += [0] * (n_pages - have)
        self._key += [None] * (n_pages - have)
        self._tail += [None] * (n_pages - have)
        self._free = list(range(n_pages - 1, have - 1, -1)) + self._free

    def allocate(self) -> int:
        """A page for one sequence to write (held once): a free one, else a new one while under
        capacity, else the least recently used cached one."""
        self._collect()
        if not self._free:
            if self.n_pages < self.capacity:
                self._grow(min(self.capacity, 2 * self.n_pages))
            elif self._idle:
                self._uncache(next(iter(self._idle)))
            elif not self.hard:
                self._grow(2 * self.n_pages)
            else:
                raise PoolFull(
                    f"the KV cache is full ({self.capacity * self.page_tokens} tokens, all held "
                    "by running sequences); retry later, or give the server a larger --kv-size"
                )
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def hold(self, page: int) -> None:
        if self._refs[page] == 0:
            self._idle.pop(page, None)
        self._refs[page] += 1

    def drop(self, page: int) -> None:
        """One holder lets go: a cached page stays (most recently used), another is free."""
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if self._key[page] is not None or self._tail[page] is not None:
                self._idle[page] = None
            else:
                self._free.append(page)

    def _collect(self) -> None:
        while self._returned:
            self.drop(self._returned.pop())

    def shared(self, page: int) -> bool:
        """Whether writing into the page would change what another holder or the prefix cache
        sees."""
        return self._refs[page] > 1 or self._key[page] is not None or self._tail[page] is not None

    def copy(self, page: int, rows: int) -> int:
        """A new page (held once) with the first `rows` positions of `page`."""
        new = self.allocate()
        for layer in range(self._rows[0]):
            self.k[layer, new, :, :rows] = self.k[layer, page, :, :rows]
            self.v[layer, new, :, :rows] = self.v[layer, page, :, :rows]
        return new

    # -- the prefix cache ---------------------------------------------------------------------

    def cache_full(self, page: int, key: bytes) -> None:
        """Cache a full page under its key (unless that key already has a page)."""
        if key not in self._full and self._key[page] is None:
            self._uncache(page, free=False)  # no longer a tail: now full
            self._full[key] = page
            self._key[page] = key

    def cache_tail(self, page: int, parent: bytes, tokens: list[int]) -> None:
        """Cache a sequence's last, partial page: its tokens follow the full page `parent`."""
        if self._key[page] is None and tokens:
            self._uncache(page, free=False)
            self._tail[page] = (parent, tuple(tokens))
            self._tails.setdefault(parent, set()).add(page)

    def _uncache(self, page: int, free: bool = True) -> None:
        """Forget the page's cache entry; an unheld page is then free."""
        key, tail = self._key[page], self._tail[page]
        if key is not None:
            del self._full[key]
            self._key[page] = None
        if tail is not None:
            tails = self._tails[tail[0]]
            tails.discard(page)
            if not tails:
                del self._tails[tail[0]]
            self._tail[page] = None
        if page in self._idle:
            del self._idle[page]
            if free:
                self._free.append(page)

    def lookup(self, key: bytes) -> int | None:
        """The cached full page with this key, or None."""
        self._collect()
        return self._full.get(key)

    def best_tail(self, parent: bytes, token_ids) -> tuple[int | None, int]:
        """(page, n): the cached partial page after `parent` whose tokens share the longest
        prefix, n tokens, with token_ids; (None, 0) if none shares any."""
        best, best_n = None, 0
        for page in self._tails.get(parent, ()):
            n = 0
            for held, new in zip(self._tail[page][1], token_ids):
                if held != new:
                    break
                n += 1
            if n > best_n:
                best, best_n = page, n
        return best, best_n

    def take_tail(self, page: int) -> None:
        """Hold a cached partial page, no longer cached, to write after its tokens."""
        self.hold(page)
        self._uncache(page, free=False)

    def cached_tokens(self) -> int:
        """Positions held by cached pages that no sequence holds."""
        self._collect()
        p = self.page_tokens
        return sum(p if self._key[i] is not None else len(self._tail[i][1]) for i in self._idle)


class KVCache:
    """One sequence's K/V: the pool's pages it holds, in order (`pages[:n_pages]`), and the
    token ids of its positions (`tokens`), so that a new prompt sharing a prefix with it (the
    next turn of a chat) only prefills what is new.
    """

    def __init__(self, pool: KVPool, n_ctx: int) -> None:
        self.pool = pool
        self.n_ctx = n_ctx
        self.pages = np.zeros(-(-n_ctx // pool.page_tokens), np.int32)  # the page table
        self.n_pages = 0
        self.tokens: list[int] = []
        self._keys: list[bytes] = []  # the keys of its full pages, in order

    def __del__(self) -> None:
        # A cache dropped without release (a test's, a benchmark stream's): its pages go back
        # at the pool's next use. A list append, safe from any thread and inside the pool.
        pool = getattr(self, "pool", None)
        if pool is not None and self.n_pages:
            pool._returned.extend(int(p) for p in self.pages[: self.n_pages])
            self.n_pages = 0

    @property
    def n_past(self) -> int:
        """How many positions are filled."""
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """The bytes of a full context of pages."""
        return len(self.pages) * self.pool.page_nbytes

    def trim(self, n: int) -> None:
        """Forget everything from position n on: pages past it are let go. (Pages prepared
        past the last position stay while nothing is forgotten.)"""
        if n < len(self.tokens):
            self._drop_from(n)

    def clear(self) -> None:
        """Forget every position and let go of every page."""
        self._drop_from(0)

    def _drop_from(self, n: int) -> None:
        del self.tokens[n:]
        del self._keys[n // self.pool.page_tokens :]
        keep = -(-n // self.pool.page_tokens)
        for page in self.pages[keep : self.n_pages]:
            self.pool.drop(int(page))
        self.n_pages = min(self.n_pages, keep)

    def reusable_prefix(self, token_ids: list[int]) -> int:
        """How many leading token_ids the cache already holds and need not be computed again.

        At most len(token_ids) - 1: the last prompt token is always run, since its logits
        choose the next token."""
        return reusable_prefix(self.tokens, token_ids)

    def prepare(self, start: int, n: int) -> None:
        """Make positions start..start + n - 1 writable (start at most n_past): the page they
        begin in made private (copied if shared), pages added after it. Raises PoolFull."""
        p = self.pool.page_tokens
        first = start // p
        if first < self.n_pages:
            page = int(self.pages[first])
            if self.pool.shared(page):  # the cached page stays as it is, for others
                self.pages[first] = self.pool.copy(page, start - first * p)
                self.pool.drop(page)
                del self._keys[first:]
        while self.n_pages * p < start + n:
            self.pages[self.n_pages] = self.pool.allocate()
            self.n_pages += 1

    def extend(self, token_ids) -> None:
        """Record the tokens just written after the last; pages they fill join the cache."""
        self.tokens.extend(int(t) for t in token_ids)
        p = self.pool.page_tokens
        while len(self._keys) < len(self.tokens) // p:
            i = len(self._keys)
            parent = self._keys[-1] if self._keys else ROOT
            key = page_key(parent, self.tokens[i * p : (i + 1) * p])
            self._keys.append(key)
            self.pool.cache_full(int(self.pages[i]), key)

    def _cached(self, token_ids: list[int]) -> tuple[list[tuple[bytes, int]], int | None, int]:
        """What the pool caches of token_ids' longest prefix, changing nothing: (key, page) of
        each full page in order, then the partial page after them that shares the most of the
        rest but the last token (None if none) and how many tokens it shares."""
        pool, p = self.pool, self.pool.page_tokens
        full, parent = [], ROOT
        while (len(full) + 1) * p <= len(token_ids):
            i = len(full)
            key = page_key(parent, token_ids[i * p : (i + 1) * p])
            page = pool.lookup(key)
            if page is None:
                break
            full.append((key, page))
            parent = key
        n = len(full) * p
        if n < len(token_ids) - 1:
            return full, *pool.best_tail(parent, token_ids[n:-1])
        return full, None, 0

    def cached_prefix(self, token_ids: list[int]) -> int:
        """How many leading token_ids `adopt` would find in the pool now (changing nothing)."""
        full, _, shared = self._cached(token_ids)
        n = len(full) * self.pool.page_tokens + shared
        return min(n, max(len(token_ids) - 1, 0))

    def reuse_best(self, token_ids: list[int]) -> int:
        """Keep what the cache holds of token_ids' prefix, or, where the pool's prefix cache
        holds more of it (a conversation run before, then left), start from that instead; the
        positions reused."""
        have = self.reusable_prefix(token_ids)
        if self.cached_prefix(token_ids) > have:
            self.release()
            return self.adopt(token_ids)
        return have

    def adopt(self, token_ids: list[int]) -> int:
        """Start from the prefix cache: hold the cached pages of the longest prefix of
        token_ids (a partial page taken over), and return how many positions now hold them
        (at most len(token_ids) - 1, see reusable_prefix)."""
        self.clear()
        pool = self.pool
        full, tail, shared = self._cached(token_ids)
        for key, page in full:
            pool.hold(page)
            self.pages[self.n_pages] = page
            self.n_pages += 1
            self._keys.append(key)
        self.tokens.extend(token_ids[: len(full) * pool.page_tokens + shared])
        if tail is not None:
            pool.take_tail(tail)
            self.pages[self.n_pages] = tail
            self.n_pages += 1
        self.trim(min(len(self.tokens), max(len(token_ids) - 1, 0)))
        return self.n_past

    def release(self) -> None:
        """The sequence has ended: its pages stay in the prefix cache (a last, partial page
        too), for the next request that starts with the same tokens."""
        p = self.pool.page_tokens
        n_full = len(self.tokens) // p
        rest = self.tokens[n_full * p :]
        if rest and self.n_pages > n_full and len(self._keys) == n_full:
            parent = self._keys[-1] if self._keys else ROOT
            self.pool.cache_tail(int(self.pages[n_full]), parent, rest)
        self.clear()

    def positions(self, n: int) -> tuple[np.ndarray, slice, np.ndarray]:
        """An index of positions 0..n - 1 into one layer's pages: `pool.k[layer][index]` are
        their K rows, [n, n_kv_heads, head_dim] (pages, every head, rows)."""
        at = np.arange(n)
        return self.pages[at // self.pool.page_tokens], slice(None), at % self.pool.page_tokens


def page_spans(pages, page_tokens: int, start: int, n: int):
    """(page, row, first, count) for positions start..start + n - 1 through a page table, split
    where a page ends: the count positions from item `first` go to rows row.. of page."""
    first = 0
    while first < n:
        pos = start + first
        row = pos % page_tokens
        count = min(page_tokens - row, n - first)
        yield int(pages[pos // page_tokens]), row, first, count
        first += count


def reusable_prefix(held: list[int], token_ids: list[int]) -> int:
    """How many leading token_ids match `held` (the tokens some KV holds), at most all but the
    last of them (see KVCache.reusable_prefix)."""
    n = 0
    for cached, new in zip(held, token_ids[:-1]):
        if cached != new:
            break
        n += 1
    return n
