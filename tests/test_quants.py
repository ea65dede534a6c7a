"""Quant kernels against gguf-py: dequantizers bit for bit, matvec/matmul to float tolerance."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from random_blocks import ggml_id, random_weights, read_only
from real_models import model_path

from localllm.errors import LocalLLMError
from localllm.gguf import GGUFFile, read_gguf
from localllm.quants import QUANT_TYPES, dequantize, get_quant_type, matmul, matvec

ALL_TYPES = [qt.name for qt in QUANT_TYPES.values()]
# the types each real model stores its weights in
REAL_TYPES = {
    "smollm2-135m": ["F32", "Q4_1", "Q8_0"],
    "gemma3-270m": ["F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"],
    "qwen2.5-coder-0.5b": ["F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"],
}


def assert_bit_exact(ours: np.ndarray, ref: np.ndarray) -> None:
    """Same float32 bits everywhere, except that NaN payloads need not match."""
    ref = np.asarray(ref, dtype=np.float32)
    assert ours.dtype == np.float32
    assert ours.shape == ref.shape
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(ours), nan)
    mismatch = ours.view(np.uint32)[~nan] != ref.view(np.uint32)[~nan]
    assert not mismatch.any(), f"{mismatch.sum()} of {mismatch.size} values differ"


def assert_close(ours: np.ndarray, w: np.ndarray, x: np.ndarray, rtol: float = 1e-4) -> None:
    """ours ~ x @ w.T computed in float64, relative to sum |w| |x| (so cancellation is fair)."""
    w64, x64 = w.astype(np.float64), x.astype(np.float64)
    expected = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T
    err = np.abs(ours.astype(np.float64) - expected)
    assert (err <= rtol * scale + 1e-30).all(), f"max rel err {(err / (scale + 1e-30)).max():.2e}"


# ---- the registry ----


def test_registry_matches_gguf_block_sizes():
    assert len(QUANT_TYPES) == 25
    for ggml_type, qt in QUANT_TYPES.items():
        gtype = GGMLQuantizationType(ggml_type)
        assert qt.ggml_type == ggml_type and qt.name == gtype.name
        assert (qt.block_size, qt.type_size) == GGML_QUANT_SIZES[gtype]
        assert get_quant_type(ggml_type) is qt


@pytest.mark.parametrize(
    ("ggml_type", "expected"),
    [(99, "99"), (int(GGMLQuantizationType.Q8_K), "Q8_K")],
)
def test_unsupported_type_names_type_and_tensor(ggml_type, expected):
    with pytest.raises(LocalLLMError) as info:
        get_quant_type(ggml_type, "blk.3.ffn_up.weight")
    message = str(info.value)
    assert expected in message
    assert "blk.3.ffn_up.weight" in message
    assert "Q4_K" in message and "Q8_0" in message  # lists what is supported
    with pytest.raises(LocalLLMError, match=expected):
        dequantize(np.zeros((1, 66), np.uint8), ggml_type)


# ---- dequantizers, bit for bit ----


@pytest.mark.parametrize("name", ALL_TYPES)
def test_dequantize_random_blocks_bit_exact(name):
    rng = np.random.default_rng(ggml_id(name))
    qt = get_quant_type(ggml_id(name))
    n_cols = 3 * qt.block_size if qt.block_size > 1 else 67
    raw = read_only(random_weights(name, 9, n_cols, rng))
    ours = dequantize(raw, qt.ggml_type)
    assert ours.shape == (9, n_cols)
    assert_bit_exact(ours, gguf.quants.dequantize(raw, GGMLQuantizationType(qt.ggml_type)))


@pytest.mark.parametrize("name", [n for n in ALL_TYPES if n not in ("F32", "F16", "BF16")])
def test_dequantize_arbitrary_bytes_bit_exact(name):
    """Any bytes at all, including inf/NaN/subnormal scales."""
    qt = get_quant_type(ggml_id(name))
    raw = np.random.default_rng(1).integers(0, 256, size=(5, 4 * qt.type_size), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # gguf-py multiplies inf scales by 0
        expected = gguf.quants.dequantize(raw, GGMLQuantizationType(qt.ggml_type))
    assert_bit_exact(dequantize(raw, qt.ggml_type), expected)


@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_dequantize_every_16_bit_pattern(name):
    raw = np.arange(2**16, dtype=np.uint16).view(np.uint8).reshape(64, 2048)
    gtype = GGMLQuantizationType[name]
    assert_bit_exact(dequantize(raw, int(gtype)), gguf.quants.dequantize(raw, gtype))


def test_every_f16_scale_bit_pattern():
    """Q8_0 blocks with every possible scale and quants of 1: the dequantized values are d."""
    raw = np.ones((2**16, 34), np.uint8)
    raw[:, :2] = np.arange(2**16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    raw = raw.reshape(64, -1)
    ours = dequantize(raw, ggml_id("Q8_0"))
    assert_bit_exact(ours, gguf.quants.dequantize(raw, GGMLQuantizationType.Q8_0))
    scales = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)
    assert_bit_exact(ours.reshape(-1, 32)[:, 0].copy(), scales)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16", "F16"])
def test_dequantize_gguf_quantized_floats(name):
    gtype = GGMLQuantizationType[name]
    floats = np.random.default_rng(2).standard_normal((7, 128)).astype(np.float32)
    raw = np.ascontiguousarray(gguf.quants.quantize(floats, gtype)).view(np.uint8)
    ours = dequantize(raw, int(gtype))
    assert_bit_exact(ours, gguf.quants.dequantize(raw, gtype))
    assert np.abs(ours - floats).max() < 0.3  # and it is the data that went in


def test_dequantize_keeps_leading_dims():
    rng = np.random.default_rng(3)
    raw = random_weights("Q8_0", 6, 64, rng).reshape(2, 3, -1)
    ours = dequantize(raw, ggml_id("Q8_0"))
    assert ours.shape == (2, 3, 64)
    np.testing.assert_array_equal(ours.reshape(6, 64), dequantize(raw.reshape(6, -1), 8))
    # an F32 vector in its own dtype, like a norm weight from the reader
    norm = rng.standard_normal(576).astype(np.float32)
    np.testing.assert_array_equal(dequantize(norm, 0), norm)


# ---- real tensors from the real models ----


@functools.cache
def _reader(model: str) -> GGUFFile:
    # Our reader, not gguf-py's: the bytes are the same (test_gguf.py compares the two readers),
    # and gguf-py takes ~10 s to parse the vocabularies of gemma3 and qwen2.5.
    return read_gguf(model_path(model))


def real_tensor(model: str, name: str, max_rows: int = 256):
    """(tensor name, raw uint8[n_rows, row_bytes]) of the first tensor of that type in the model."""
    for tensor in _reader(model).tensors.values():
        if tensor.type_name == name:
            data = tensor.data
            rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
            return tensor.name, rows[:max_rows]
    raise AssertionError(f"{model} has no {name} tensor")


@pytest.mark.parametrize(
    ("model", "name"), [(model, name) for model, names in REAL_TYPES.items() for name in names]
)
def test_real_tensors(model, name):
    tensor_name, raw = real_tensor(model, name)
    gtype = GGMLQuantizationType[name]
    ours = dequantize(raw, int(gtype))
    assert_bit_exact(ours, gguf.quants.dequantize(raw, gtype).reshape(ours.shape))
    assert np.isfinite(ours).all(), tensor_name
    if raw.shape[0] > 1:  # a weight matrix (F32 tensors are norm vectors)
        x = np.random.default_rng(4).standard_normal((3, ours.shape[1])).astype(np.float32)
        assert_close(matvec(raw, int(gtype), x[0]), ours, x[0])
        assert_close(matmul(raw, int(gtype), x), ours, x)


# ---- matvec / matmul kernels against dequantize + float64 ----

KERNEL_SHAPES = {"F32": 67, "F16": 67, "BF16": 67}  # n_cols: a tail after the 32-lane chunks


@pytest.mark.parametrize("name", ALL_TYPES)
def test_kernels_match_dequantized_float64(name):
    rng = np.random.default_rng(10 + ggml_id(name))
    qt = get_quant_type(ggml_id(name))
    n_rows = 37  # odd, and not a multiple of the matmul row tile
    n_cols = KERNEL_SHAPES.get(name, 3 * qt.block_size)  # several blocks per row
    raw = read_only(random_weights(name, n_rows, n_cols, rng))
    weights = dequantize(raw, qt.ggml_type)  # float32[n_rows, n_cols], bit-exact (tested above)

    x = rng.standard_normal(n_cols).astype(np.float32)
    out = np.full(n_rows, np.nan, np.float32)
    qt.matvec(raw, x, out)
    assert_close(out, weights, x)

    for n_tokens in (1, 3, 17):
        xs = rng.standard_normal((n_tokens, n_cols)).astype(np.float32)
        out = np.full((n_tokens, n_rows), np.nan, np.float32)
        qt.matmul(raw, xs, out)
        assert_close(out, weights, xs)


def test_kernels_check_shapes():
    qt = get_quant_type(ggml_id("Q4_0"))
    raw = read_only(random_weights("Q4_0", 4, 64, np.random.default_rng(5)))
    with pytest.raises(ValueError):
        qt.matvec(raw, np.zeros(32, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ValueError):
        qt.matmul(raw, np.zeros((2, 64), np.float32), np.zeros((3, 4), np.float32))


def test_wrappers_allocate_convert_and_check():
    rng = np.random.default_rng(6)
    raw = random_weights("Q4_K", 5, 512, rng)  # writable: the wrapper makes a read-only view
    weights = dequantize(raw, ggml_id("Q4_K"))
    x64 = rng.standard_normal((4, 512))  # float64, converted by the wrapper
    assert_close(matmul(raw, 12, x64), weights, x64)
    assert_close(matvec(raw, 12, x64[1]), weights, x64[1])
    assert_close(matmul(raw, 12, x64[2:3]), weights, x64[2:3])  # one token goes through matvec
    out = np.empty(5, np.float32)
    assert matvec(raw, 12, x64[0], out) is out
    with pytest.raises(ValueError):
        matvec(raw, 12, x64[0, :256])
    with pytest.raises(ValueError):
        matvec(raw[:, :100], 12, x64[0])  # not whole blocks
    assert raw.flags.writeable  # the caller's array is untouched
