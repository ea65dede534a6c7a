"""K-quants: 256-weight super-blocks split into sub-blocks with their own 4/6/8-bit scales.

Layouts (little-endian, from ggml-common.h / gguf-py quants.py):

    Q2_K   84 B: scales[16] (lo nibble scale, hi nibble min) | qs[64] 2-bit | d f16 | dmin f16
    Q3_K  110 B: hmask[32] | qs[64] 2-bit | scales[12] (16 x 6-bit, offset 32) | d f16
    Q4_K  144 B: d f16 | dmin f16 | scales[12] (8 x 6-bit scale + 8 x 6-bit min) | qs[128] 4-bit
    Q5_K  176 B: d f16 | dmin f16 | scales[12] (as Q4_K) | qh[32] | qs[128] 4-bit
    Q6_K  210 B: ql[128] 4-bit | qh[64] 2-bit | scales int8[16] | d f16

Each row dequantizer walks the sub-blocks (16 or 32 weights sharing one scale), computes where
sub-block j's low and high bits live, and mirrors gguf-py's float32 order of operations
((d * sc) * q - (dmin * m)), so it is bit-exact.

The matvec kernels compute the same dequantized weights in registers and, as in legacy.py,
accumulate weight * x into 32 lanes per row, summed once per row. Their inner loops always run
over 32 consecutive quant bytes with constant shifts, taking every weight packed into those bytes
(e.g. all four 2-bit fields of a Q2_K byte) and picking each lane's sub-block scale with a select:
measured, loops of 16 iterations or with per-sub-block shift amounts did not vectorize and ran
3-8x slower.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .float import check_shapes, hide_constant, load_f16

QK_K = 256


@njit(cache=True)
def _scale_min_k4(row, offset, j):
    """(scale, min) of sub-block j from the 12 packed 6-bit bytes at row[offset] (Q4_K, Q5_K)."""
    if j < 4:
        return np.int32(row[offset + j] & 63), np.int32(row[offset + j + 4] & 63)
    scale = (row[offset + j + 4] & 15) | ((row[offset + j - 4] >> 6) << 4)
    minimum = (row[offset + j + 4] >> 4) | ((row[offset + j] >> 6) << 4)
    return np.int32(scale), np.int32(minimum)


@njit(cache=True)
def _q3_k_scale(row, offset, j):
    """Signed 6-bit scale of sub-block j from the 12 packed bytes at row[offset] (Q3_K)."""
    low = np.int32(row[offset + (j & 7)])
    low = low & 15 if j < 8 else low >> 4
    high = (np.int32(row[offset + 8 + (j & 3)]) >> (2 * (j >> 2))) & 3
    return np.int32(low | (high << 4)) - 32


# ---- Q2_K: 16 sub-blocks of 16 ----


@njit(cache=True)
def _q2_k_scale(row, offset, d, dmin):
    """(d * scale, dmin * min) of the Q2_K sub-block whose scale byte is row[offset]."""
    sc = row[offset]
    return d * np.float32(sc & 15), dmin * np.float32(sc >> 4)


@njit
def dequantize_row_q2_k(row, out):
    """Q2_K row uint8[n_cols // 256 * 84] -> out float32[n_cols]."""
    n16 = hide_constant(16)  # keeps the loop below vectorizable
    for b in range(out.shape[0] // QK_K):
        o = b * 84
        d = load_f16(row, o + 80)
        dmin = load_f16(row, o + 82)
        for h in range(2):
            for half in range(2):
                # byte qs[32 h + 16 half + i] holds weight 128 h + 32 k + 16 half + i in bits 2k,
                # in sub-block 8 h + 2 k + half; constant shifts, four weights per step
                s = o + 8 * h + half
                d0, m0 = _q2_k_scale(row, s, d, dmin)
                d1, m1 = _q2_k_scale(row, s + 2, d, dmin)
                d2, m2 = _q2_k_scale(row, s + 4, d, dmin)
                d3, m3 = _q2_k_scale(row, s + 6, d, dmin)
                q_at = o + 16 + 32 * h + 16 * half
                e = b * QK_K + 128 * h + 16 * half
                for i in range(n16):
                    q = row[q_at + i]
                    out[e + i] = d0 * np.float32(q & 3) - m0
                    out[e + 32 + i] = d1 * np.float32((q >> 2) & 3) - m1
                    out[e + 64 + i] = d2 * np.float32((q >> 4) & 3) - m2
                    out[e + 96 + i] = d3 * np.float32(q >> 6) - m3


@njit(parallel=True, cache=True)
def matvec_q2_k(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols]."""
    check_shapes(w, x, out, QK_K, 84)
    n_rows, row_bytes = w.shape
    for r in prange(n_rows):
        wr = w[r]
        acc = np.empty(32, np.float32)  # hoisted out of the loop by Numba: one per thread
        acc[:] = 0.0
        for b in range(row_bytes // 84):
            o = b * 84
            d = load_f16(wr, o + 80)
            dmin = load_f16(wr, o + 82)
            for h in range(2):
                # byte qs[32 h + i] holds weights 128 h + 32 k + i (k = 0..3, 2 bits each);
                # lanes i < 16 and i >= 16 belong to sub-blocks 8 h + 2 k and 8 h + 2 k + 1
                s = o + 8 * h
                d0a, m0a = _q2_k_scale(wr, s, d, dmin)
                d0b, m0b = _q2_k_scale(wr, s + 1, d, dmin)
                d1a, m1a = _q2_k_scale(wr, s + 2, d, dmin)
                d1b, m1b = _q2_k_scale(wr, s + 3, d, dmin)
                d2a, m2a = _q2_k_scale(wr, s + 4, d, dmin)
                d2b, m2b = _q2_k_scale(wr, s + 5, d, dmin)
                d3a, m3a = _q2_k_scale(wr, s + 6, d, dmin)
                d3b, m3b = _q2_k_scale(wr, s + 7, d, dmin)
                q_at = o + 16 + 32 * h
                e = b * QK_K + 128 * h
                for i in range(32):
                    a = i < 16
                    q = wr[q_at + i]
                    w0 = (d0a if a else d0b) * np.float32(q & 3) - (m0a if a else m0b)
                    w1 = (d1a if a else d1b) * np.float32((q >> 2) & 3) - (m1a if a else m1b)
                    w2 = (d2a if a else d2b) * np.float32((q >> 4) & 3) - (m2a if a else m2b)
                    w3 = (d3a if a else d3b) * np.float32(q >> 6) - (m3a if a else m3b)
                    acc[i] += (w0 * x[e + i] + w1 * x[e + 32 + i]) + (
                        w2 * x[e + 64 + i] + w3 * x[e + 96 + i]
                    )
        out[r] = acc.sum()


# ---- Q3_K: 16 sub-blocks of 16 ----


@njit
def dequantize_row_q3_k(row, out):
    """Q3_K row uint8[n_cols // 256 * 110] -> out float32[n_cols]."""
    n16 = hide_constant(16)  # keeps the loop below vectorizable
    for b in range(out.shape[0] // QK_K):
        o = b * 110
        d = load_f16(row, o + 108)
        for h in range(2):
            for half in range(2):
                # as Q2_K; the third bit of weight 128 h + 32 k + i is bit 4 h + k of hmask[i]
                j = 8 * h + half
                d0 = d * np.float32(_q3_k_scale(row, o + 96, j))
                d1 = d * np.float32(_q3_k_scale(row, o + 96, j + 2))
                d2 = d * np.float32(_q3_k_scale(row, o + 96, j + 4))
                d3 = d * np.float32(_q3_k_scale(row, o + 96, j + 6))
                q_at = o + 32 + 32 * h + 16 * half
                m_at = o + 16 * half
                e = b * QK_K + 128 * h + 16 * half
                for i in range(n16):
                    q = np.int32(row[q_at + i])
                    m = np.int32(row[m_at + i]) >> (4 * h)
                    # a clear hmask bit means "subtract 4"
                    out[e + i] = d0 * np.float32((q & 3) - 4 + ((m & 1) << 2))
                    out[e + 32 + i] = d1 * np.float32(((q >> 2) & 3) - 4 + ((m & 2) << 1))
                    out[e + 64 + i] = d2 * np.float32(((q >> 4) & 3) - 4 + (m & 4))
                    out[e + 96 + i] = d3 * np.float32((q >> 6) - 4 + ((m & 8) >> 1))


@njit(parallel=True, cache=True)
def matvec_q3_k(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols]."""
    check_shapes(w, x, out, QK_K, 110)
    n_rows, row_bytes = w.shape
    for r in prange(n_rows):
        wr = w[r]
        acc = np.empty(32, np.float32)  # hoisted: one per thread
        acc[:] = 0.0
        for b in range(row_bytes // 110):
            o = b * 110
            d = load_f16(wr, o + 108)
            for h in range(2):
                # as Q2_K, plus the third bit of weight 128 h + 32 k + i at bit 4 h + k of hmask[i]
                j = 8 * h
                d0a = d * np.float32(_q3_k_scale(wr, o + 96, j))
                d0b = d * np.float32(_q3_k_scale(wr, o + 96, j + 1))
                d1a = d * np.float32(_q3_k_scale(wr, o + 96, j + 2))
                d1b = d * np.float32(_q3_k_scale(wr, o + 96, j + 3))
                d2a = d * np.float32(_q3_k_scale(wr, o + 96, j + 4))
                d2b = d * np.float32(_q3_k_scale(wr, o + 96, j + 5))
                d3a = d * np.float32(_q3_k_scale(wr, o + 96, j + 6))
                d3b = d * np.float32(_q3_k_scale(wr, o + 96, j + 7))
                q_at = o + 32 + 32 * h
                e = b * QK_K + 128 * h
                for i in range(32):
                    a = i < 16
                    q = np.int32(wr[q_at + i])
                    m = np.int32(wr[o + i]) >> (4 * h)
                    # a clear hmask bit means "subtract 4"
                    q0 = (q & 3) - 4 + ((m & 1) << 2)
                    q1 = ((q >> 2) & 3) - 4 + ((m & 2) << 1)
                    q2 = ((q >> 4) & 3) - 4 + (m & 4)
                    q3 = (q >> 6) - 4 + ((m & 8) >> 1)
                    acc[i] += (
                        (d0a if a else d0b) * np.float32(q0) * x[e + i]
                        + (d1a if a else d1b) * np.float32(q1) * x[e + 32 + i]
                    ) + (
                        (d2a if a else d2b) * np.float32(q2) * x[e + 64 + i]
                        + (d3a if a else d3b) * np.float32(q3) * x[e + 96 + i]
                    )
        out[r] = acc.sum()


# ---- Q4_K: 8 sub-blocks of 32; sub-blocks 2p and 2p+1 share the 32 bytes qs[32p:32p+32] ----


@njit
def dequantize_row_q4_k(row, out):
    """Q4_K row uint8[n_cols // 256 * 144] -> out float32[n_cols]."""
    n32 = hide_constant(32)  # keeps the loop below vectorizable
    for b in range(out.shape[0] // QK_K):
        o = b * 144
        d = load_f16(row, o)
        dmin = load_f16(row, o + 2)
        for j in range(8):
            sc, m = _scale_min_k4(row, o + 4, j)
            ds = d * np.float32(sc)
            dm = dmin * np.float32(m)
            q_at = o + 16 + (j >> 1) * 32
            shift = 4 * (j & 1)
            e = b * QK_K + j * 32
            for i in range(n32):
                out[e + i] = ds * np.float32((row[q_at + i] >> shift) & 15) - dm


@njit(parallel=True, cache=True)
def matvec_q4_k(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols]."""
    check_shapes(w, x, out, QK_K, 144)
    n_rows, row_bytes = w.shape
    for r in prange(n_rows):
        wr = w[r]
        acc = np.empty(32, np.float32)  # hoisted: one per thread
        acc[:] = 0.0
        for b in range(row_bytes // 144):
            o = b * 144
            d = load_f16(wr, o)
            dmin = load_f16(wr, o + 2)
            for p in range(4):  # one pass over 32 bytes feeds both nibbles' sub-blocks
                sc, m = _scale_min_k4(wr, o + 4, 2 * p)
                ds_lo, dm_lo = d * np.float32(sc), dmin * np.float32(m)
                sc, m = _scale_min_k4(wr, o + 4, 2 * p + 1)
                ds_hi, dm_hi = d * np.float32(sc), dmin * np.float32(m)
                q_at = o + 16 + p * 32
                e = b * QK_K + p * 64
                for i in range(32):
                    q = wr[q_at + i]
                    acc[i] += (ds_lo * np.float32(q & 15) - dm_lo) * x[e + i] + (
                        ds_hi * np.float32(q >> 4) - dm_hi
                    ) * x[e + 32 + i]
        out[r] = acc.sum()


# ---- Q5_K: Q4_K plus a fifth bit: bit j of qh[i] belongs to sub-block j ----


@njit
def dequantize_row_q5_k(row, out):
    """Q5_K row uint8[n_cols // 256 * 176] -> out float32[n_cols]."""
    n32 = hide_constant(32)  # keeps the loop below vectorizable
    for b in range(out.shape[0] // QK_K):
        o = b * 176
        d = load_f16(row, o)
        dmin = load_f16(row, o + 2)
        for j in range(8):
            sc, m = _scale_min_k4(row, o + 4, j)
            ds = d * np.float32(sc)
            dm = dmin * np.float32(m)
            q_at = o + 48 + (j >> 1) * 32
            shift = 4 * (j & 1)
            e = b * QK_K + j * 32
            for i in range(n32):
                q = ((row[q_at + i] >> shift) & 15) | (((row[o + 16 + i] >> j) & 1) << 4)
                out[e + i] = ds * np.float32(q) - dm


@njit(parallel=True, cache=True)
def matvec_q5_k(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols]."""
    check_shapes(w, x, out, QK_K, 176)
    n_rows, row_bytes = w.shape
    for r in prange(n_rows):
        wr = w[r]
        acc = np.empty(32, np.float32)  # hoisted: one per thread
        acc[:] = 0.0
        for b in range(row_bytes // 176):
            o = b * 176
            d = load_f16(wr, o)
            dmin = load_f16(wr, o + 2)
            for p in range(4):
                sc, m = _scale_min_k4(wr, o + 4, 2 * p)
                ds_lo, dm_lo = d * np.float32(sc), dmin * np.float32(m)
                sc, m = _scale_min_k4(wr, o + 4, 2 * p + 1)
                ds_hi, dm_hi = d * np.float32(sc), dmin * np.float32(m)
                q_at = o + 48 + p * 32
                e = b * QK_K + p * 64
                for i in range(32):
                    q = wr[q_at + i]
                    h = wr[o + 16 + i] >> (2 * p)
                    q_lo = (q & 15) | ((h & 1) << 4)
                    q_hi = (q >> 4) | ((h & 2) << 3)
                    acc[i] += (ds_lo * np.float32(q_lo) - dm_lo) * x[e + i] + (
                        ds_hi * np.float32(q_hi) - dm_hi
                    ) * x[e + 32 + i]
        out[r] = acc.sum()


# ---- Q6_K: 16 sub-blocks of 16 with int8 scales ----
# Weight e = 128 h + 32 k + i (h < 2, k < 4, i < 32) has its low 4 bits in the
# (k >> 1) nibble of ql[64 h + 32 (k & 1) + i] and its high 2 bits at bit 2k of qh[32 h + i];
# its sub-block is 8 h + 2 k + (i >= 16).


@njit
def dequantize_row_q6_k(row, out):
    """Q6_K row uint8[n_cols // 256 * 210] -> out float32[n_cols]."""
    n16 = hide_constant(16)  # keeps the loop below vectorizable
    for b in range(out.shape[0] // QK_K):
        o = b * 210
        d = load_f16(row, o + 208)
        for h in range(2):
            for half in range(2):
                # bytes i = 16 half .. 16 half + 15 feed sub-blocks 8 h + 2 k + half (k = 0..3);
                # constant shifts, four weights per step (per-k shift amounts do not vectorize)
                s = o + 192 + 8 * h + half
                d0 = d * np.float32(np.int8(row[s]))
                d1 = d * np.float32(np.int8(row[s + 2]))
                d2 = d * np.float32(np.int8(row[s + 4]))
                d3 = d * np.float32(np.int8(row[s + 6]))
                ql_at = o + 64 * h + 16 * half
                qh_at = o + 128 + 32 * h + 16 * half
                e = b * QK_K + 128 * h + 16 * half
                for i in range(n16):
                    lo = np.int32(row[ql_at + i])
                    hi = np.int32(row[ql_at + 32 + i])
                    qh = np.int32(row[qh_at + i])
                    out[e + i] = d0 * np.float32(((lo & 15) | ((qh & 3) << 4)) - 32)
                    out[e + 32 + i] = d1 * np.float32(((hi & 15) | ((qh & 12) << 2)) - 32)
                    out[e + 64 + i] = d2 * np.float32(((lo >> 4) | (qh & 48)) - 32)
                    out[e + 96 + i] = d3 * np.float32(((hi >> 4) | ((qh & 192) >> 2)) - 32)


@njit(parallel=True, cache=True)
def matvec_q6_k(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols]."""
    check_shapes(w, x, out, QK_K, 210)
    n_rows, row_bytes = w.shape
    for r in prange(n_rows):
        wr = w[r]
        acc = np.empty(32, np.float32)  # hoisted: one per thread
        acc[:] = 0.0
        for b in range(row_bytes // 210):
            o = b * 210
            d = load_f16(wr, o + 208)
            for h in range(2):
                # ql[64 h + i], ql[64 h + 32 + i] and qh[32 h + i] hold weights 128 h + 32 k + i
                # (k = 0..3); lanes i < 16 and i >= 16 use the scales of sub-blocks 8 h + 2 k (+ 1)
                s = o + 192 + 8 * h
                d0a, d0b = d * np.float32(np.int8(wr[s])), d * np.float32(np.int8(wr[s + 1]))
                d1a, d1b = d * np.float32(np.int8(wr[s + 2])), d * np.float32(np.int8(wr[s + 3]))
                d2a, d2b = d * np.float32(np.int8(wr[s + 4])), d * np.float32(np.int8(wr[s + 5]))
                d3a, d3b = d * np.float32(np.int8(wr[s + 6])), d * np.float32(np.int8(wr[s + 7]))
                ql_at = o + 64 * h
                qh_at = o + 128 + 32 * h
                e = b * QK_K + 128 * h
                for i in range(32):
                    a = i < 16
                    lo = np.int32(wr[ql_at + i])
                    hi = np.int32(wr[ql_at + 32 + i])
                    qh = np.int32(wr[qh_at + i])
                    q0 = ((lo & 15) | ((qh & 3) << 4)) - 32
                    q1 = ((hi & 15) | ((qh & 12) << 2)) - 32
                    q2 = ((lo >> 4) | (qh & 48)) - 32
                    q3 = ((hi >> 4) | ((qh & 192) >> 2)) - 32
                    acc[i] += (
                        (d0a if a else d0b) * np.float32(q0) * x[e + i]
                        + (d1a if a else d1b) * np.float32(q1) * x[e + 32 + i]
                    ) + (
                        (d2a if a else d2b) * np.float32(q2) * x[e + 64 + i]
                        + (d3a if a else d3b) * np.float32(q3) * x[e + 96 + i]
                    )
        out[r] = acc.sum()
