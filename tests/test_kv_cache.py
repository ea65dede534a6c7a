"""The paged KV pool: pages follow the sequences' lengths, full pages are shared through the
prefix cache by the hash of their tokens, shared pages are copied before a write, cached pages
go least recently used first, and a hard pool that is full says so."""

import numpy as np
import pytest
from real_models import model_path

from localllm.kv_cache import KVCache, KVPool, PoolFull
from localllm.models import load_model

P = 4  # positions per page in these pools


def _pool(capacity=64, hard=False) -> KVPool:
    return KVPool(n_layers=2, n_kv_heads=1, head_dim=2, page_tokens=P, capacity=capacity,
                  hard=hard)  # fmt: skip


def _write(cache: KVCache, tokens: list[int]) -> None:
    """Append tokens as a forward pass would: K = V = the token id in every row."""
    start = cache.n_past
    cache.prepare(start, len(tokens))
    page, heads, row = cache.positions(start + len(tokens))
    for layer in range(2):
        for pool in (cache.pool.k, cache.pool.v):
            pool[layer][page[start:], heads, row[start:]] = np.array(tokens)[:, None, None]
    cache.extend(tokens)


def _rows(cache: KVCache) -> list[int]:
    """The K values a cache's positions hold (what its tokens wrote)."""
    return [int(x) for x in cache.pool.k[1][cache.positions(cache.n_past)][:, 0, 0]]


def test_pages_follow_the_length_and_go_back():
    pool = _pool()
    cache = KVCache(pool, n_ctx=40)
    _write(cache, list(range(1, 10)))
    assert cache.n_pages == 3 and pool.pages_held == 3  # 9 positions in pages of 4
    cache.trim(5)
    assert cache.n_pages == 2 and pool.pages_held == 2
    assert _rows(cache) == [1, 2, 3, 4, 5]
    other = KVCache(pool, n_ctx=40)
    _write(other, [7])
    del other  # dropped without release: its page comes back all the same
    assert pool.pages_held == 2


def test_a_prompt_reuses_the_cached_pages_of_its_longest_prefix():
    pool = _pool()
    first = KVCache(pool, n_ctx=40)
    history = list(range(1, 12))  # two full pages and 3 positions of a third
    _write(first, history)
    first.release()
    assert pool.pages_held == 0 and pool.cached_tokens() == 11
    # the next turn: the history and more; its partial page is taken over
    turn = KVCache(pool, n_ctx=40)
    assert turn.adopt(history + [20, 21]) == 11
    assert _rows(turn) == history
    _write(turn, [20, 21])
    assert _rows(turn) == history + [20, 21]
    # a prompt that leaves the history inside the second page: the first page only
    other = KVCache(pool, n_ctx=40)
    assert other.adopt([1, 2, 3, 4, 5, 6, 99, 98]) == 4
    assert other.pages[0] == turn.pages[0]  # one page, held by both
    assert other.adopt([2, 3, 4, 5, 6]) == 0  # the same tokens at other positions: no


def test_a_shared_page_is_copied_before_a_write():
    pool = _pool()
    a = KVCache(pool, n_ctx=40)
    _write(a, list(range(1, 9)))  # two full pages, both cached while a runs
    b = KVCache(pool, n_ctx=40)
    # the whole prompt is cached; its last token runs again, into a copy of the page
    assert b.adopt(list(range(1, 9))) == 7
    assert b.pages[1] == a.pages[1]
    _write(b, [50])
    assert b.pages[0] == a.pages[0] and b.pages[1] != a.pages[1]
    assert _rows(a) == list(range(1, 9)) and _rows(b) == [1, 2, 3, 4, 5, 6, 7, 50]


def test_cached_pages_go_least_recently_used_first_and_a_full_hard_pool_says_so():
    pool = _pool(capacity=4, hard=True)
    for start in (10, 20):  # two finished sequences of two full pages each
        done = KVCache(pool, n_ctx=16)
        _write(done, list(range(start, start + 8)))
        done.release()
    touch = KVCache(pool, n_ctx=16)
    assert touch.adopt(list(range(10, 19))) == 8  # the first one, used again
    touch.release()
    new = KVCache(pool, n_ctx=16)
    _write(new, [1, 2, 3, 4, 5])  # two pages: the second sequence's are the oldest
    assert KVCache(pool, n_ctx=16).adopt(list(range(10, 19))) == 8
    assert KVCache(pool, n_ctx=16).adopt(list(range(20, 29))) == 0
    held = KVCache(pool, n_ctx=16)
    _write(held, list(range(10, 18)))  # holds the first's two pages again: all four held
    with pytest.raises(PoolFull, match="--kv-size"):
        _write(new, [6, 7, 8, 9])
    assert new.n_past == 5  # nothing recorded for the failed write


def test_a_soft_pool_grows_and_keeps_what_it_holds():
    pool = _pool(capacity=2)
    caches = [KVCache(pool, n_ctx=64) for _ in range(3)]
    for i, cache in enumerate(caches):
        _write(cache, [i + 1] * 30)  # 8 pages each: far past the capacity
    assert pool.n_pages >= 24
    assert all(_rows(c) == [i + 1] * 30 for i, c in enumerate(caches))


def test_logits_from_cached_pages_equal_those_computed_afresh():
    """A chat's next turn on the pages its history left: the same logits, bit for bit, as the
    whole prompt run in a fresh cache; and the history's pages are really reused."""
    model = load_model(model_path("smollm2-135m"), n_ctx=512, device="cpu")
    try:
        t = model.transformer
        rng = np.random.default_rng(3)
        history = rng.integers(0, 1000, 150).tolist()
        turn = history + rng.integers(0, 1000, 20).tolist()
        first = t.new_cache()
        t.forward(history, 0, cache=first)
        first.release()
        cache = t.new_cache()
        n = cache.adopt(turn)
        assert n == 150
        reused = t.forward(turn[n:], n, cache=cache)
        fresh = t.forward(turn, 0, cache=t.new_cache())
        assert np.array_equal(reused, fresh)
    finally:
        model.close()
