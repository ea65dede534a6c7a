"""Integer dot-product kernels (8-bit activations, as ggml) against numpy references."""

import numpy as np
import pytest
from test_quants import ggml_id, random_weights, read_only

from localllm.quants import dequantize
from localllm.quants.activations import round_activations
from localllm.quants.intdot import INT_KERNELS, QuantizedActivations

NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def _quantize(x, kind):
    acts = QuantizedActivations(*x.shape)
    return acts.q8_0(x) if kind == "q8_0" else acts.q8_k(x)


def test_every_int_kernel_is_tested():
    assert set(NAMES) == set(INT_KERNELS)


@pytest.mark.parametrize("kind", ["q8_0", "q8_k"])
def test_quantized_activations_stand_for_the_rounded_ones(kind):
    x = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    xq, xd, xs = _quantize(x, kind)
    block = 32 if kind == "q8_0" else 256
    dequantized = xq.astype(np.float32) * np.repeat(xd, block, axis=1)
    rounded = round_activations(x, "q8_0" if kind == "q8_0" else "q8_K", np.empty_like(x))
    np.testing.assert_array_equal(dequantized, rounded)
    if kind == "q8_k":  # sums of q per 16, for the K-quant mins
        np.testing.assert_array_equal(xs, xq.reshape(3, -1, 16).astype(np.int32).sum(-1))
    else:  # f16(d * sum q) with the unrounded d, as ggml's Q8_1
        d = np.abs(x).reshape(3, -1, 32).max(-1) / np.float32(127)
        expected = (d * xq.reshape(3, -1, 32).sum(-1)).astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(xs, expected)


@pytest.mark.parametrize("ggml_type", sorted(NAMES))
def test_int_kernel_matches_dequantized_float64(ggml_type):
    rng = np.random.default_rng(ggml_type)
    kernel, kind = INT_KERNELS[ggml_type]
    n_rows, n_cols = 37, 512
    w = read_only(random_weights(NAMES[ggml_type], n_rows, n_cols, rng))
    x = rng.standard_normal((5, n_cols)).astype(np.float32)
    xq, xd, xs = _quantize(x, kind)
    out = np.empty((5, n_rows), np.float32)
    kernel(w, xq, xd, xs, out)
    block = 32 if kind == "q8_0" else 256
    x_used = (xq.astype(np.float64) * np.repeat(xd, block, axis=1)).astype(np.float64)
    w64 = dequantize(w, ggml_id(NAMES[ggml_type])).astype(np.float64)
    expected = x_used @ w64.T
    scale = np.abs(x_used) @ np.abs(w64).T
    # Q4_1/Q5_1 take the mins term from f16(d * sum q), as ggml does: ~1e-3 relative.
    rtol = 2e-3 if NAMES[ggml_type] in ("Q4_1", "Q5_1") else 1e-5
    assert (np.abs(out - expected) <= rtol * scale + 1e-30).all()
    # A token's result is the same to the bit whether it is alone or in a batch.
    for t in range(5):
        alone = np.empty((1, n_rows), np.float32)
        kernel(w, xq[t : t + 1], xd[t : t + 1], xs[t : t + 1], alone)
        np.testing.assert_array_equal(alone[0], out[t])
