"""Ternary weights (-1, 0, 1 times one scale per 256): TQ1_0 and TQ2_0, for BitNet-style models.

Layouts (little-endian, from ggml-common.h / gguf-py quants.py):

    TQ2_0  66 B: qs[64] 2-bit | d f16      w = d * (q - 1); weight 128 h + 32 k + i in bits 2k
                                           of qs[32 h + i], as Q2_K's low bits
    TQ1_0  54 B: qs[48] | qh[4] | d f16    five trits per byte of qs, four per byte of qh, stored
                                           as ceil(value * 256 / 243): trit k of byte v is
                                           ((v * 3^k mod 256) * 3) >> 8, so w = d * (that - 1)

TQ1_0's weights: 32k + i (k < 5) is trit k of qs[i], 160 + 16k + i (k < 5) trit k of qs[32 + i],
240 + 4k + i (k < 4) trit k of qh[i].

The row dequantizers mirror gguf-py's float32 order (d * float(q - 1)), so they are bit-exact; the
matvec kernels (the float path) accumulate into 32 lanes per row as kquants.py does.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .float import check_shapes, hide_constant, load_f16

QK_K = 256


@njit(cache=True)
def _trit(byte, power):
    """Trit `power` (1, 3, 9, 27 or 81) of a TQ1_0 byte, 0..2."""
    return np.int32(((np.int32(byte) * power) & 255) * 3 >> 8)


# ---- TQ2_0 ----


@njit
def dequantize_row_tq2_0(row, out):
    """TQ2_0 row uint8[n_cols // 256 * 66] -> out float32[n_cols]."""
    n32 = hide_constant(32)  # keeps the loop below vectorizable
    for b in range(out.shape[0] // QK_K):
        o = b * 66
        d = load_f16(row, o + 64)
        for h in range(2):
            e = b * QK_K + 128 * h
            for i in range(n32):
                q = np.int32(row[o + 32 * h + i])
                out[e + i] = d * np.float32((q & 3) - 1)
                out[e + 32 + i] = d * np.float32(((q >> 2) & 3) - 1)
                out[e + 64 + i] = d * np.float32(((q >> 4) & 3) - 1)
                out[e + 96 + i] = d * np.float32((q >> 6) - 1)


@njit(parallel=True, cache=True)
def matvec_tq2_0(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols]."""
    check_shapes(w, x, out, QK_K, 66)
    n_rows, row_bytes = w.shape
    for r in prange(n_rows):
        wr = w[r]
        acc = np.empty(32, np.float32)  # hoisted out of the loop by Numba: one per thread
        acc[:] = 0.0
        for b in range(row_bytes // 66):
            o = b * 66
            d = load_f16(wr, o + 64)
            for h in range(2):
                e = b * QK_K + 128 * h
                for i in range(32):
                    q = np.int32(wr[o + 32 * h + i])
                    acc[i] += (
                        d * np.float32((q & 3) - 1) * x[e + i]
                        + d * np.float32(((q >> 2) & 3) - 1) * x[e + 32 + i]
                    ) + (
                        d * np.float32(((q >> 4) & 3) - 1) * x[e + 64 + i]
                        + d * np.float32((q >> 6) - 1) * x[e + 96 + i]
                    )
        out[r] = acc.sum()


# ---- TQ1_0 ----


@njit
def dequantize_row_tq1_0(row, out):
    """TQ1_0 row uint8[n_cols // 256 * 54] -> out float32[n_cols]."""
    n32 = hide_constant(32)  # keeps the loops below vectorizable
    n16 = hide_constant(16)
    for b in range(out.shape[0] // QK_K):
        o = b * 54
        d = load_f16(row, o + 52)
        e = b * QK_K
        power = 1
        for k in range(5):
            for i in range(n32):
                out[e + 32 * k + i] = d * np.float32(_trit(row[o + i], power) - 1)
            for i in range(n16):
                out[e + 160 + 16 * k + i] = d * np.float32(_trit(row[o + 32 + i], power) - 1)
            if k < 4:
                for i in range(4):
                    out[e + 240 + 4 * k + i] = d * np.float32(_trit(row[o + 48 + i], power) - 1)
            power *= 3


@njit(parallel=True, cache=True)
def matvec_tq1_0(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols]."""
    check_shapes(w, x, out, QK_K, 54)
    n_rows, row_bytes = w.shape
    for r in prange(n_rows):
        wr = w[r]
        acc = np.empty(32, np.float32)  # hoisted: one per thread
        acc[:] = 0.0
        tail = np.float32(0.0)
        for b in range(row_bytes // 54):
            o = b * 54
            d = load_f16(wr, o + 52)
            e = b * QK_K
            power = 1
            for k in range(5):
                for i in range(32):
                    acc[i] += d * np.float32(_trit(wr[o + i], power) - 1) * x[e + 32 * k + i]
                for i in range(16):
                    q = _trit(wr[o + 32 + i], power) - 1
                    acc[i] += d * np.float32(q) * x[e + 160 + 16 * k + i]
                if k < 4:
                    for i in range(4):
                        q = _trit(wr[o + 48 + i], power) - 1
                        tail += d * np.float32(q) * x[e + 240 + 4 * k + i]
                power *= 3
        out[r] = acc.sum() + tail
