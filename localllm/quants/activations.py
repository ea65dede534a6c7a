"""Activations rounded the way llama.cpp rounds them before a quantized dot product.

ggml never multiplies a quantized weight by a float32 activation: it first quantizes the
activation row to the weight type's `vec_dot_type` (Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1,
Q8_K for the K-quants, F16 for F16 weights) and takes integer dot products per block. The rounding
this adds moves logits by a few tenths; to give llama.cpp's tokens we round the same way.

`round_activations(x, kind, out)` writes the float32 values those quantized activations stand
for (d * q), so any dot-product kernel sees exactly what ggml's integer kernels see, up to the
order of float additions. Rounding follows ggml's x86 code: Q8_0/Q8_1 scale by 127/amax, round
half to even, and store the block scale d = amax/127 as f16; Q8_K uses iscale = -127/max (max the
signed value of largest magnitude), round half to even, clamp to 127, and keeps d = 1/iscale as
float32.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from localllm.quants.cpu import HARDWARE_HALF
from localllm.quants.float import _bits_to_f32, f16_to_f32

# vec_dot_type names (each weight type's record names its own, see quants/__init__.py)
NONE, F16, BF16, Q8_0, Q8_1, Q8_K = "none", "f16", "bf16", "q8_0", "q8_1", "q8_K"
# values per scale of the integer activation types (ggml's QK8_0, QK8_1, QK_K)
Q8_BLOCK_SIZE = {Q8_0: 32, Q8_1: 32, Q8_K: 256}


@intrinsic
def _f32_bits(typingctx, v):
    """The bits of a float32 as uint32 (a register bitcast)."""
    if isinstance(v, types.Float) and v.bitwidth == 32:

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return types.uint32(v), codegen
    return None


@intrinsic
def _round_half(typingctx, v):
    """float32 -> IEEE half (round to nearest even, inf past 65504) -> float32: vcvtps2ph and
    vcvtph2ps (F16C) or ARMv8's fcvt."""
    if v == types.float32:

        def codegen(context, builder, signature, args):
            return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

        return types.float32(v), codegen
    return None


@njit(cache=True)
def f16_bits(v):
    """The IEEE half nearest to float32 v (ties to even), as its 16 bits; |v| < 65520."""
    v = np.float32(v)
    bits = _f32_bits(v)
    sign = (bits >> np.uint32(16)) & np.uint32(0x8000)
    a = abs(v)
    if a < np.float32(6.103515625e-05):  # zero or subnormal: multiples of 2^-24
        return sign | np.uint32(np.rint(a / np.float32(5.960464477539063e-08)))
    rounded = bits + np.uint32(0x0FFF) + ((bits >> np.uint32(13)) & np.uint32(1))
    exponent = (rounded >> np.uint32(23)) & np.uint32(0xFF)
    mantissa = (rounded >> np.uint32(13)) & np.uint32(0x3FF)
    return sign | ((exponent - np.uint32(112)) << np.uint32(10)) | mantissa


@njit(cache=True)
def round_f16(v):
    """float32 v rounded to the nearest IEEE half (ties to even), returned as float32."""
    v = np.float32(v)
    if HARDWARE_HALF:  # a constant: the other branch is not compiled in
        return _round_half(v)
    a = abs(v)
    if a >= np.float32(65520.0):  # rounds to inf in f16
        return np.float32(np.inf) if v > 0 else np.float32(-np.inf)
    return f16_to_f32(f16_bits(v))


@njit(cache=True)
def round_bf16(v):
    """float32 v rounded to the nearest bfloat16 (ties to even), returned as float32."""
    bits = _f32_bits(v)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(
        0xFFFF0000
    )
    return _bits_to_f32(np.uint32(rounded))


_SMALLEST_F32 = np.float32(1e-45)  # the least subnormal: max(amax, it) is amax unless amax is 0


@njit(cache=True, inline="always")
def q8_scale(block):
    """(d, inv, d_raw) of one activation block as ggml quantizes it: quant = min(127,
    rint(x * inv)) stands for d * quant. block: float32[32] -> Q8_0/Q8_1, scaled by 127/amax, d
    stored as f16 (d_raw: before that rounding); float32[256] -> Q8_K, scaled by -127/max (the
    value of largest magnitude), d = 1/iscale kept as float32. An all-zero block gives zeros.
    Inlined, with no early return and no branch in its divisors: each of those made it 3x
    slower (a call, or loops LLVM no longer vectorized), for a block's few nanoseconds of work."""
    # the largest |x| by its bits (sign cleared: for floats other than NaN, integer order is
    # magnitude order), a reduction LLVM vectorizes where a float max needs fast-math
    n = block.shape[0]
    bits = np.uint32(0)
    for j in range(n):
        bits = max(bits, _f32_bits(block[j]) & np.uint32(0x7FFFFFFF))
    amax = _bits_to_f32(np.uint32(bits))
    zero = amax == 0
    if n == 32:
        d_raw = amax / np.float32(127.0)
        d, inv = round_f16(d_raw), np.float32(127.0) / max(amax, _SMALLEST_F32)
    else:  # the first of largest magnitude, as ggml's strict > keeps (a min reduction)
        first = n - 1
        for j in range(n):
            first = min(first, j if _f32_bits(block[j]) & np.uint32(0x7FFFFFFF) == bits else n)
        vmax = block[first]
        inv = np.float32(-127.0) / (np.float32(1.0) if zero else vmax)
        d = d_raw = np.float32(1.0) / inv
    if zero:
        d = inv = d_raw = np.float32(0.0)
    return d, inv, d_raw


@njit(cache=True)
def _q8_rows(x, out, super_block):
    n_tokens, n_cols = x.shape
    u = np.uint64  # unsigned indices: no wraparound, so no gathers and scatters (quantize_q8)
    for t in range(n_tokens):
        row, rounded = x[t], out[t]
        for lo in range(0, n_cols, super_block):
            d, inv, _ = q8_scale(row[lo : lo + super_block])
            for j in range(lo, lo + super_block):
                q = min(np.float32(127.0), np.rint(row[u(j)] * inv))
                rounded[u(j)] = d * np.float32(q)


@njit(parallel=True, cache=True)
def _round_each(x, out, to_bf16):
    n_tokens, n_cols = x.shape
    for t in prange(n_tokens):
        for j in range(n_cols):
            out[t, j] = round_bf16(x[t, j]) if to_bf16 else round_f16(x[t, j])


def round_activations(x: np.ndarray, kind: str, out: np.ndarray) -> np.ndarray:
    """out = x as ggml's `kind` quantization represents it. x, out: float32[n_tokens, n_cols]."""
    if kind == NONE:
        out[:] = x
    elif kind in Q8_BLOCK_SIZE:
        # Q8_1 differs from Q8_0 only in also storing d * sum(q), which a kernel can recompute.
        _q8_rows(x, out, Q8_BLOCK_SIZE[kind])
    elif kind in (F16, BF16):
        _round_each(x, out, kind == BF16)
    else:
        raise ValueError(f"unknown activation type {kind!r}")
    return out
