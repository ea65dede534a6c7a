"""Activation rounding against numpy versions of ggml's quantize_row_q8_0 / q8_K."""

import numpy as np
import pytest

from localllm.quants.activations import round_activations, round_bf16, round_f16

rng = np.random.default_rng(5)


def test_round_f16_matches_numpy():
    values = np.concatenate(
        [
            rng.standard_normal(2000).astype(np.float32) * 10.0 ** rng.integers(-9, 5, 2000),
            np.array([0.0, -0.0, 65504.0, 65519.0, 1e-8, -3e-7, 6.1e-5], np.float32),
        ]
    ).astype(np.float32)
    ours = np.array([round_f16(v) for v in values], np.float32)
    np.testing.assert_array_equal(ours, values.astype(np.float16).astype(np.float32))


def test_round_bf16_ties_to_even():
    values = rng.standard_normal(1000).astype(np.float32)
    bits = values.view(np.uint32)
    expected = (
        ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    )
    np.testing.assert_array_equal(np.array([round_bf16(v) for v in values], np.float32), expected)


def _q8_0_reference(x):
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            block = x[t, b * 32 : b * 32 + 32]
            amax = np.abs(block).max()
            d = np.float32(np.float16(amax / np.float32(127)))
            inv = np.float32(127) / amax if amax else np.float32(0)
            out[t, b * 32 : b * 32 + 32] = d * np.rint(block * inv)
    return out


def _q8_k_reference(x):
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        for b in range(x.shape[1] // 256):
            block = x[t, b * 256 : b * 256 + 256]
            vmax = block[np.argmax(np.abs(block))]  # the first of largest magnitude
            if vmax == 0:  # ggml: d = 0, quants 0
                out[t, b * 256 : b * 256 + 256] = 0.0
                continue
            iscale = np.float32(-127) / vmax
            q = np.minimum(127, np.rint(iscale * block))
            out[t, b * 256 : b * 256 + 256] = (np.float32(1) / iscale) * q
    return out


@pytest.mark.parametrize("kind", ["q8_0", "q8_1", "q8_K"])
def test_q8_rounding_matches_ggml_formula(kind):
    x = rng.standard_normal((3, 512)).astype(np.float32)
    x[1, :32] = 0.0  # an all-zero block
    x[1, 256:] = 0.0  # an all-zero super-block
    x[0, 261], x[0, 356] = -9.0, 9.0  # the largest magnitude twice: Q8_K scales by the first
    x[2, 10], x[2, 20] = 9.0, -9.0
    out = round_activations(x, kind, np.empty_like(x))
    expected = _q8_k_reference(x) if kind == "q8_K" else _q8_0_reference(x)
    np.testing.assert_array_equal(out, expected)
    # The rounding is real: within one quantization step, never exact.
    assert 0 < np.abs(out - x).max() < np.abs(x).max() / 100
