"""Numba ops against plain numpy references."""

import math

import numba
import numpy as np
import pytest
from numba import njit

from localllm import ops
from localllm.quants.activations import f16_bits
from localllm.quants.cpu import HARDWARE_HALF

rng = np.random.default_rng(0)


def test_rmsnorm_matches_numpy():
    x = rng.standard_normal((5, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    out = np.empty_like(x)
    ops.rmsnorm(x, w, np.float32(1e-5), out)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_layernorm_matches_numpy():
    x = (rng.standard_normal((5, 96)) * 3 + 2).astype(np.float32)
    w, b = rng.standard_normal((2, 96)).astype(np.float32)
    out = np.empty_like(x)
    ops.layernorm(x, w, b, np.float32(1e-12), out)
    x64 = x.astype(np.float64)
    centered = x64 - x64.mean(1, keepdims=True)
    ref = centered / np.sqrt((centered**2).mean(1, keepdims=True) + 1e-12) * w + b
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    ops.layernorm(x, w, b, np.float32(1e-12), x)  # in place
    np.testing.assert_array_equal(x, out)


def test_rmsnorm_heads_in_place():
    x = rng.standard_normal((3, 4, 32)).astype(np.float32)
    w = rng.standard_normal(32).astype(np.float32)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    ops.rmsnorm_heads(x, w, np.float32(1e-6))
    np.testing.assert_allclose(x, ref, rtol=1e-5, atol=1e-6)


def _rope_ref(x, positions, base, neox, rope_dim):
    out = x.astype(np.float64).copy()
    half = rope_dim // 2
    freqs = base ** (-np.arange(half) * 2.0 / rope_dim)
    for t, p in enumerate(positions):
        c, s = np.cos(p * freqs), np.sin(p * freqs)
        if neox:
            a, b = np.arange(half), np.arange(half) + half
        else:
            a, b = np.arange(0, rope_dim, 2), np.arange(1, rope_dim, 2)
        x0, x1 = out[t, :, a].copy(), out[t, :, b].copy()
        out[t, :, a] = x0 * c[:, None] - x1 * s[:, None]
        out[t, :, b] = x0 * s[:, None] + x1 * c[:, None]
    return out


@pytest.mark.parametrize("neox", [False, True])
def test_rope_matches_numpy(neox):
    x = rng.standard_normal((4, 3, 64)).astype(np.float32)
    positions = np.array([0, 1, 7, 300], dtype=np.int64)
    ref = _rope_ref(x, positions, 10000.0, neox, 64)
    cos, sin = ops.rope_tables(positions, 64, 10000.0)
    ops.rope(x, cos, sin, neox)
    np.testing.assert_allclose(x, ref, rtol=1e-4, atol=1e-4)


def _rope_tables_ref(positions, rope_dim, base, scaling, factors):
    """ggml_rope_ext's cos/sin in float64, from its formulas (rope_yarn, corr_dims)."""
    s = scaling
    i = np.arange(rope_dim // 2)
    extrap = positions[:, None] * base ** (-2.0 * i / rope_dim) / factors
    angle, mscale = s.freq_scale * extrap, s.attn_factor
    if s.ext_factor:

        def corr_dim(n_rot):
            return rope_dim * math.log(s.n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(0, math.floor(corr_dim(s.beta_fast)))
        high = min(rope_dim - 1, math.ceil(corr_dim(s.beta_slow)))
        mix = (1 - np.clip((i - low) / max(0.001, high - low), 0, 1)) * s.ext_factor
        angle = angle * (1 - mix) + extrap * mix
        mscale *= 1 + 0.1 * math.log(1 / s.freq_scale)
    return np.cos(angle) * mscale, np.sin(angle) * mscale


@pytest.mark.parametrize("kind", ["plain", "linear", "factors", "yarn"])
def test_rope_tables_scaling_and_factors(kind):
    """Linear scaling, per-pair frequency factors (rope_freqs) and YaRN against float64."""
    positions = np.array([0, 1, 63, 64, 150, 511], dtype=np.int64)
    factors = np.ones(16, np.float32)
    scaling = ops.RopeScaling()
    if kind == "linear":
        scaling = ops.RopeScaling(freq_scale=0.25)
    elif kind == "factors":
        factors = np.linspace(1.0, 32.0, 16, dtype=np.float32)
    elif kind == "yarn":
        scaling = ops.RopeScaling(freq_scale=0.25, ext_factor=1.0, attn_factor=0.95, n_ctx_orig=64)
        # ggml's ramp over pairs: floor/ceil of 32 ln(64 / (beta 2 pi)) / (2 ln 10000)
        assert ops.yarn_corr_dims(32, 64, 10000.0, 32.0, 1.0) == (0.0, 5.0)
    cos, sin = ops.rope_tables(positions, 32, 10000.0, scaling, factors)
    cos_ref, sin_ref = _rope_tables_ref(positions, 32, 10000.0, scaling, factors)
    np.testing.assert_allclose(cos, cos_ref, atol=2e-4)
    np.testing.assert_allclose(sin, sin_ref, atol=2e-4)
    if kind != "plain":  # and the scaling changed them
        plain_cos, _ = ops.rope_tables(positions, 32, 10000.0)
        assert np.abs(cos - plain_cos).max() > 0.1


def _attention_ref(q, k, v, start_pos, window, scale, softcap=0.0, causal=True, sinks=None):
    n_tokens, n_heads, head_dim = q.shape
    group = n_heads // k.shape[1]
    out = np.zeros_like(q, dtype=np.float64)
    for t in range(n_tokens):
        pos = start_pos + t if causal else start_pos + n_tokens - 1
        first = max(0, pos - window + 1) if window else 0
        for h in range(n_heads):
            keys = k[first : pos + 1, h // group].astype(np.float64)
            s = keys @ q[t, h] * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            best = s.max() if sinks is None else max(s.max(), sinks[h])
            p = np.exp(s - best)
            sink = 0.0 if sinks is None else np.exp(sinks[h] - best)
            out[t, h] = p @ v[first : pos + 1, h // group] / (p.sum() + sink)
    return out


def _scratch(n_rows, n_heads, n_kv_heads, head_dim, n_ctx, window):
    threads = numba.config.NUMBA_NUM_THREADS
    slots = ops.attention_slots(n_rows, n_kv_heads, n_ctx, window, threads)
    return ops.attention_scratch(threads, n_heads // n_kv_heads, head_dim, slots)


def _attention(q, k_cache, v_cache, start, window, softcap=0.0, sinks=None, split=False,
               causal=True, f16=False):  # fmt: skip
    """ops.attention's output, its scratch made as the backend makes it; f16: q and the
    probabilities rounded to half (as with the backend's f16 cache)."""
    n_tokens, n_heads, head_dim = q.shape
    n_ctx, n_kv_heads, _ = k_cache.shape
    scratch = _scratch(n_tokens, n_heads, n_kv_heads, head_dim, n_ctx, window)
    out = np.full_like(q, np.nan)
    sinks = np.zeros(0, np.float32) if sinks is None else sinks
    ops.attention(
        q, k_cache.transpose(1, 0, 2)[None], v_cache.transpose(1, 0, 2)[None],
        np.zeros((1, 1), np.int32), np.array([start]),
        np.array([0, n_tokens]), window, np.float32(1 / math.sqrt(head_dim)),
        np.float32(softcap), sinks, f16, f16, numba.get_num_threads() if split else 0, scratch,
        out, causal,
    )  # fmt: skip
    return out


def _paged(caches, page_tokens, n_pages):
    """Pools of n_pages pages holding each contiguous cache (K or V) at shuffled pages, and the
    page tables: (k_pool, v_pool, tables)."""
    n_kv, head_dim = caches[0][0].shape[1:]
    pools = [np.zeros((n_pages, n_kv, page_tokens, head_dim), caches[0][0].dtype) for _ in "kv"]
    width = max(-(-len(k) // page_tokens) for k, _ in caches)
    tables = np.zeros((len(caches), width), np.int32)
    free = list(rng.permutation(n_pages))
    for row, pair in enumerate(caches):
        for i in range(-(-len(pair[0]) // page_tokens)):
            tables[row, i] = page = free.pop()
            for pool, cache in zip(pools, pair, strict=True):
                part = cache[i * page_tokens : (i + 1) * page_tokens]
                pool[page, :, : len(part)] = part.transpose(1, 0, 2)
    return *pools, tables


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("half_bits", [True, False], ids=["f16-cache", "f32-cache"])
@pytest.mark.parametrize("split", [False, True], ids=["row-jobs", "chunk-jobs"])
@pytest.mark.parametrize("head_dim", [8, 32], ids=["dim8", "dim32"])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (3, 0.0), (0, 2.0), (3, 2.0)])
def test_attention_gqa_causal_window(window, softcap, head_dim, split, half_bits, causal):
    """GQA, causal, windowed; with softcap (Gemma 2) scores of ~3 units are capped near 2; and
    bidirectional (encoders): every token over all the keys. head_dim 32 runs the vector kernels
    (multiples of ops.LANES), 8 the element loops."""
    n_ctx, n_heads, n_kv, start, n = 16, 6, 2, 5, 4
    q = rng.standard_normal((n, n_heads, head_dim)).astype(np.float32) * 3 * math.sqrt(head_dim / 8)
    # The cache holds half bits (or float32 in exact mode); the reference takes the same halves.
    k = rng.standard_normal((n_ctx, n_kv, head_dim)).astype(np.float16)
    v = rng.standard_normal((n_ctx, n_kv, head_dim)).astype(np.float16)
    scale = 1 / math.sqrt(head_dim)
    if half_bits:
        k_cache, v_cache = k.view(np.uint16), v.view(np.uint16)
    else:
        k_cache, v_cache = k.astype(np.float32), v.astype(np.float32)
    k32, v32 = k.astype(np.float32), v.astype(np.float32)
    args = (k_cache, v_cache, start, window, softcap)
    out = _attention(q, *args, split=split, causal=causal)
    expected = _attention_ref(q, k32, v32, start, window, scale, softcap, causal)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    if softcap:  # and the cap changed the result
        assert np.abs(expected - _attention_ref(q, k32, v32, start, window, scale)).max() > 0.05
    # gpt-oss's sinks: one logit per head in each softmax (here around the scores' size)
    sinks = (4 + rng.standard_normal(n_heads) * 2).astype(np.float32)
    out = _attention(q, *args, sinks, split=split, causal=causal)
    with_sinks = _attention_ref(q, k32, v32, start, window, scale, softcap, causal, sinks)
    np.testing.assert_allclose(out, with_sinks, rtol=1e-4, atol=1e-5)
    assert np.abs(with_sinks - expected).max() > 0.05
    # q and the probabilities rounded to half, as llama.cpp's products with an f16 cache round
    # them (the probabilities by up to 2^-12 of themselves)
    out = _attention(q, *args, split=split, causal=causal, f16=True)
    q16 = q.astype(np.float16).astype(np.float32)
    rounded = _attention_ref(q16, k32, v32, start, window, scale, softcap, causal)
    np.testing.assert_allclose(out, rounded, rtol=1e-3, atol=1e-3)
    assert not np.array_equal(out, _attention(q, *args, split=split, causal=causal))


@pytest.mark.parametrize("head_dim", [64, 40], ids=["vectors", "elements"])
@pytest.mark.parametrize("window", [0, 300])
def test_attention_over_chunks_is_one_result(head_dim, window):
    """A long cache (several ops.KV_CHUNK chunks, their sums and outputs combined): the same bits
    whether a row's chunks run as jobs of their own (decode) or one after the other (prefill), on
    one thread or all, through pages, and for a sequence batched with others as alone;
    and near the float64 reference."""
    n_ctx, n_heads, n_kv, start, n = 3 * ops.KV_CHUNK + 40, 8, 2, 2 * ops.KV_CHUNK + 30, 5
    q = rng.standard_normal((n, n_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((n_ctx, n_kv, head_dim)).astype(np.float16)
    v = rng.standard_normal((n_ctx, n_kv, head_dim)).astype(np.float16)
    halves = (k.view(np.uint16), v.view(np.uint16), start, window)
    alone = _attention(q, *halves, split=False, f16=True)
    assert np.array_equal(_attention(q, *halves, split=True, f16=True), alone)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        assert np.array_equal(_attention(q, *halves, split=True, f16=True), alone)
        assert np.array_equal(_attention(q, *halves, split=False, f16=True), alone)
    finally:
        numba.set_num_threads(threads)
    q16 = q.astype(np.float16).astype(np.float32)
    scale = 1 / math.sqrt(head_dim)
    expected = _attention_ref(q16, k.astype(np.float32), v.astype(np.float32), start, window, scale)
    np.testing.assert_allclose(alone, expected, rtol=1e-3, atol=1e-3)
    # through pages of 64 and 32 positions (a window's first key mid-block: its block is cut at
    # the page's end): rows 0-1 of this sequence beside rows of another (a shorter one), then
    # rows 2-4 alone; the same bits as the contiguous cache's
    other = rng.standard_normal((3, n_heads, head_dim)).astype(np.float32)
    scratch = _scratch(5, n_heads, n_kv, head_dim, n_ctx, window)
    short = (k.view(np.uint16)[:100], v.view(np.uint16)[:100])
    for page_tokens in (64, 32):
        k_pool, v_pool, tables = _paged([short, halves[:2]], page_tokens, 40)
        for split in (False, True):
            rows = np.concatenate([other, q[:2]])
            out = np.full_like(rows, np.nan)
            ops.attention(
                rows, k_pool, v_pool, tables, np.array([50, start]), np.array([0, 3, 5]), window,
                np.float32(scale), np.float32(0.0), np.zeros(0, np.float32), True, True, split,
                scratch, out, True,
            )  # fmt: skip
            assert np.array_equal(out[3:], alone[:2])
            out = np.full_like(q[2:], np.nan)
            ops.attention(
                q[2:], k_pool, v_pool, tables[1:], np.array([start + 2]), np.array([0, 3]),
                window, np.float32(scale), np.float32(0.0), np.zeros(0, np.float32), True, True,
                split, scratch, out, True,
            )  # fmt: skip
            assert np.array_equal(out, alone[2:])
    rest = _attention(q[2:], *halves[:2], start + 2, window, split=True, f16=True)
    assert np.array_equal(rest, alone[2:])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 6, 7, 9])
@pytest.mark.parametrize("half_bits", [True, False], ids=["f16-cache", "f32-cache"])
def test_attention_reading_the_pages_in_registers_keeps_the_bits(group, head_dim, half_bits):
    """Pages whose rows are contiguous go through _page_scores / _page_values (K and V converted
    in registers for all the group's heads, up to 6 and 8 heads), others through the float32
    block and _block_scores / _block_values: the same bits, partial blocks and groups past those
    kernels' included."""
    if half_bits and not HARDWARE_HALF:
        pytest.skip("the CPU converts to half in software: the block path only")
    n_kv, page_tokens, start, n = 2, 32, 3 * 32 + 11, 3
    n_pages = (start + n) // page_tokens + 2
    shape = (n_pages, n_kv, page_tokens, head_dim)
    pools = [rng.standard_normal(shape).astype(np.float32) for _ in "kv"]
    if half_bits:
        pools = [pool.astype(np.float16).view(np.uint16) for pool in pools]
    # the same values with a stride between a row's elements: the block path
    strided = []
    for pool in pools:
        wide = np.zeros((*shape[:3], 2 * head_dim), pool.dtype)
        wide[..., ::2] = pool
        strided.append(wide[..., ::2])
    q = rng.standard_normal((n, n_kv * group, head_dim)).astype(np.float32)
    tables = rng.permutation(n_pages).astype(np.int32)[None]
    scratch = _scratch(n, n_kv * group, n_kv, head_dim, n_pages * page_tokens, 0)
    outs = []
    for k_pool, v_pool in (pools, strided):
        for split in (0, numba.get_num_threads()):
            out = np.full_like(q, np.nan)
            ops.attention(
                q, k_pool, v_pool, tables, np.array([start]), np.array([0, n]), 0,
                np.float32(1 / math.sqrt(head_dim)), np.float32(0.0), np.zeros(0, np.float32),
                half_bits, half_bits, split, scratch, out, True,
            )  # fmt: skip
            outs.append(out)
    assert not np.isnan(outs[0]).any()
    for out in outs[1:]:
        assert np.array_equal(out.view(np.uint32), outs[0].view(np.uint32))


def test_split_jobs_for_few_rows():
    assert ops.split_jobs(1, 2, 4)  # decode: 2 K/V heads would be 2 jobs for 4 threads
    assert ops.split_jobs(1, 1, 2) and ops.split_jobs(1, 3, 2)
    assert not ops.split_jobs(1, 2, 2)  # a job per thread
    assert not ops.split_jobs(512, 2, 2)  # prefill: a job per row and K/V head
    assert not ops.split_jobs(8, 8, 2)


def test_activations():
    g = rng.standard_normal((2, 50)).astype(np.float32) * 3
    u = rng.standard_normal((2, 50)).astype(np.float32)
    silu = g / (1 + np.exp(-g)) * u
    gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u
    a = g.copy()
    ops.silu_mul(a, u)
    np.testing.assert_allclose(a, silu, rtol=1e-5, atol=1e-6)
    exact = g.copy()
    ops.gelu_tanh_mul_exact(exact, u)
    np.testing.assert_allclose(exact, gelu, rtol=1e-5, atol=1e-6)
    b = g.copy()
    ops.gelu_tanh_mul(b, u, ops.GELU_TABLE)
    # ggml's way: gelu of x rounded to half, itself rounded to half (relative error < 2^-10)
    np.testing.assert_allclose(b, gelu, rtol=2e-3, atol=2e-3)
    g16 = g.astype(np.float16).astype(np.float32)
    table_gelu = (
        0.5
        * g16
        * (
            1
            + np.tanh(np.float32(np.sqrt(2 / np.pi)) * g16 * (1 + np.float32(0.044715) * g16 * g16))
        )
    )
    np.testing.assert_array_equal(b, table_gelu.astype(np.float16).astype(np.float32) * u)
    # the prefill variants, tokens spread over threads: the same numbers
    one, many = g.copy(), g.copy()
    ops.gelu_tanh_mul(one, u, ops.GELU_TABLE)
    ops.gelu_tanh_mul_rows(many, u, ops.GELU_TABLE)
    np.testing.assert_array_equal(one, many)
    # plain GELU (the encoders' MLP): GeGLU with an up of ones, table or exact
    ones = np.ones_like(g)
    for plain, gated in ((ops.gelu_tanh_rows, ops.gelu_tanh_mul), (None, None)):
        x, y = g.copy(), g.copy()
        if plain is None:
            ops.gelu_tanh_exact(x)
            ops.gelu_tanh_mul_exact(y, ones)
        else:
            plain(x, ops.GELU_TABLE)
            gated(y, ones, ops.GELU_TABLE)
        np.testing.assert_array_equal(x, y)


@njit
def _expf_each(x, out):
    for i in range(x.shape[0]):
        out[i] = ops.expf(x[i])


def test_expf_as_ggml():
    x = np.concatenate([np.linspace(-87, 88, 100_001), rng.uniform(-1, 1, 10_000)])  # normal range
    x = x.astype(np.float32)
    ours = np.empty_like(x)
    _expf_each(x, ours)
    exact = np.exp(x.astype(np.float64))
    # ggml_v_expf: max error 1.45 + 0.5 ulp (an ulp is at most 2**-23 of the value)
    assert (np.abs(ours - exact) / exact).max() < 2.0 * 2.0**-23
    edges = np.array([-np.inf, -200.0, -104.5, 0.0, 89.0, 200.0, np.inf], np.float32)
    out = np.empty_like(edges)
    _expf_each(edges, out)
    np.testing.assert_array_equal(out, [0.0, 0.0, 0.0, 1.0, np.inf, np.inf, np.inf])


def test_gelu_outside_the_table():
    g = np.array([[-30.0, -10.0, 10.0, 25.0]], np.float32)
    u = np.full_like(g, 2.0)
    ops.gelu_tanh_mul(g, u, ops.GELU_TABLE)
    np.testing.assert_array_equal(g, [[0.0, 0.0, 20.0, 50.0]])
    x = np.array([[-30.0, -10.0, 10.0, 25.0]], np.float32)
    ops.gelu_tanh_rows(x, ops.GELU_TABLE)
    np.testing.assert_array_equal(x, [[0.0, 0.0, 10.0, 25.0]])


def test_f16_bits_match_numpy():
    values = np.concatenate(
        [
            rng.standard_normal(5000).astype(np.float32) * 10.0 ** rng.integers(-9, 4, 5000),
            np.array([0.0, -0.0, 6.1e-5, -6.1e-5, 65504.0, 1e-8, 2.98e-8], np.float32),
        ]
    ).astype(np.float32)
    ours = np.array([f16_bits(v) for v in values], np.uint32)
    np.testing.assert_array_equal(ours, values.astype(np.float16).view(np.uint16))


@pytest.mark.skipif(not HARDWARE_HALF, reason="the CPU converts to half in software")
def test_kv_writes_store_numpys_halves():
    """CPUBackend.write_kv (ops.write_half_rows) stores numpy's float16 bits, across pages."""
    from localllm.backend import CPUBackend

    n_kv, head_dim, page_tokens = 2, 64, 4
    values = rng.standard_normal((6, n_kv, head_dim)) * 10.0 ** rng.integers(-9, 4, (6, n_kv, 1))
    k = values.astype(np.float32)
    k[0, 0, :8] = [0.0, -0.0, 65504.0, 65520.0, -1e6, 2.98e-8, 6.1e-5, np.inf]
    v = -k[::-1].copy()
    pools = [np.zeros((3, n_kv, page_tokens, head_dim), np.uint16) for _ in "kv"]
    CPUBackend(1).write_kv(*pools, np.array([2, 0, 1], np.int32), 1, k, v)
    for pool, x in zip(pools, (k, v), strict=True):
        rows = np.concatenate([pool[2], pool[0], pool[1]], axis=1)[:, 1:7]  # positions 1..6
        rows = rows.transpose(1, 0, 2)  # [position, head, head_dim]
        np.testing.assert_array_equal(rows, x.astype(np.float16).view(np.uint16))


def test_swiglu_oai_clamps_as_ggml():
    gate = np.array([[-9.0, -1.0, 0.0, 0.5, 3.0, 7.0, 12.0]], np.float32)
    up = np.array([[-9.0, 2.0, 1.0, -0.5, 8.0, 0.0, -12.0]], np.float32)
    x = np.minimum(gate.astype(np.float64), 7.0)
    y = np.clip(up.astype(np.float64), -7.0, 7.0)
    expected = x / (1.0 + np.exp(-1.702 * x)) * (y + 1.0)
    ops.swiglu_oai(gate, up)
    np.testing.assert_allclose(gate, expected, rtol=1e-6, atol=1e-6)
