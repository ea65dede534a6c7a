"""The AVX-512 VNNI integer kernels against the float kernels and a float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from test_quants import ggml_id, random_weights, read_only

from localllm.quants import dequantize, get_quant_type, vnni
from localllm.quants.activations import VEC_DOT_TYPES, round_activations

pytestmark = pytest.mark.skipif(not vnni.AVAILABLE, reason="this CPU lacks AVX-512 VNNI")

TYPES = {get_quant_type(t).name: t for t in vnni.MATVEC}
ASYMMETRIC_LEGACY = {"Q4_1", "Q5_1"}  # w = d * q + m, with m an f16 at byte 2 of each block


def quantized(x: np.ndarray, ggml_type: int) -> tuple:
    xq = vnni.activation_buffers(*x.shape)
    vnni.quantize_q8(x, vnni.SUPER_BLOCK[ggml_type], *xq)
    return xq


def reference(raw: np.ndarray, ggml_type: int, x: np.ndarray, xq: tuple) -> np.ndarray:
    """ggml's dot products in float64: dequantized weights times the quantized activations. For
    Q4_1/Q5_1, ggml takes sum(x) from the f16-rounded block sum xs (as quantize_q8 stores it)."""
    w = dequantize(raw, ggml_type).astype(np.float64)  # bit-exact, tested in test_quants
    q, d, s, _ = (a.astype(np.float64) for a in xq)
    xr = q * np.repeat(d, 32, axis=1)
    out = xr @ w.T
    qt = get_quant_type(ggml_type)
    if qt.name in ASYMMETRIC_LEGACY:
        blocks = raw.reshape(raw.shape[0], -1, qt.type_size)
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        exact_sums = xr.reshape(x.shape[0], -1, 32).sum(axis=2)
        out += (s - exact_sums) @ m.T
    return out


def test_quantize_q8_equals_round_activations():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 512)).astype(np.float32) * np.float32(3.0)
    x[1, :256] = 0.0  # an all-zero super-block
    x[2, 7] = -40.0  # the largest magnitude negative (Q8_K scales by it)
    for ggml_type, kind in ((8, "q8_0"), (3, "q8_1"), (12, "q8_K")):
        xq, xd, xs, xl = quantized(x, ggml_type)
        rounded = round_activations(x, kind, np.empty_like(x))
        np.testing.assert_array_equal(xq * np.repeat(xd, 32, axis=1), rounded)
        q = xq.astype(np.int64)
        np.testing.assert_array_equal(xl, q.reshape(3, -1, 4).sum(axis=2))
        sums = q.reshape(3, -1, 32).sum(axis=2) * xd.astype(np.float64)
        if kind != "q8_K":  # stored as f16 (Q8_1 in ggml), from the unrounded scale
            np.testing.assert_allclose(xs, sums, rtol=2e-3, atol=1e-6)
        else:
            np.testing.assert_allclose(xs, sums, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("n_rows", [1, 3, 4, 37])
def test_matvec_matches_reference(name, n_rows):
    ggml_type = TYPES[name]
    rng = np.random.default_rng(n_rows * 100 + ggml_type)
    n_cols = 512 if get_quant_type(ggml_type).block_size == 256 else 96
    raw = read_only(random_weights(name, n_rows, n_cols, rng))
    x = rng.standard_normal((1, n_cols)).astype(np.float32)
    xq = quantized(x, ggml_type)
    expected = reference(raw, ggml_type, x, xq)
    out = np.full((1, n_rows), np.nan, np.float32)
    vnni.MATVEC[ggml_type](raw, *xq, out)
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-6 * np.abs(expected).max())


@pytest.mark.parametrize("name", sorted(TYPES))
def test_integer_and_float_kernels_agree(name):
    """The two paths a CPU may take: the integer one here, the float one on rounded activations
    (what a CPU without VNNI runs)."""
    ggml_type = TYPES[name]
    rng = np.random.default_rng(ggml_id(name))
    qt = get_quant_type(ggml_type)
    raw = read_only(random_weights(name, 64, 4 * 256, rng))
    x = rng.standard_normal((1, 4 * 256)).astype(np.float32)
    xq = quantized(x, ggml_type)
    ours = np.empty(64, np.float32)
    vnni.MATVEC[ggml_type](raw, *xq, ours[None])
    theirs = np.empty(64, np.float32)
    qt.matvec(raw, round_activations(x, VEC_DOT_TYPES[ggml_type], np.empty_like(x))[0], theirs)
    # equal up to float summation order, and the f16 block sums of Q8_1
    tol = 2e-3 if name in ASYMMETRIC_LEGACY else 2e-5
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=tol * np.abs(theirs).max())
