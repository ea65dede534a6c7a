"""Integer dot-product kernels: quantized weights times 8-bit quantized activations.

This is what ggml does on the CPU, and why it is fast: the activation row is quantized once per
matmul (Q8_0 blocks of 32 with an f16 scale, Q8_1 adding f16(d * sum q), or Q8_K blocks of 256
with a float32 scale and sums per 16), then every weight block contributes an integer dot product
times one float scale. The weight offsets (-8 for Q4_0, the min for Q4_1 and the K-quants) are
folded into the activation sums instead of being subtracted per weight.

Shape of every kernel, `mm_<type>(w, xq, xd, xs, out)`:
    w   uint8[n_rows, row_bytes]   raw GGUF blocks (a view into the memory map)
    xq  int8[n_tokens, n_cols]     quantized activations
    xd  float32[n_tokens, n_cols // block]   activation block scales
    xs  Q8_1: float32[n_tokens, n_cols // 32] f16(d * sum q); Q8_K: int32[n_tokens, n_cols // 16]
        sums of q per 16; unused by Q8_0 users (pass xd)
    out float32[n_tokens, n_rows]
Threads split the rows; each (row, token) pair runs the same code whatever n_tokens is, so a token
gets bit-identical results decoded alone or inside a prefill batch.

Why the inner loops look as they do: a block's products go into per-position integer lanes
(`for i in range(hide_constant(16))`), and the float scale is applied lane-wise into float lanes,
so LLVM vectorizes each block's work across 16 or 32 positions and no horizontal sum happens
until the end of the row. (A scalar `isum += ...` per block leaves the loop scalar or pays a
horizontal reduction per block.) Numba would widen int32 products to int64; the explicit
np.int32 casts keep them 32-bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from localllm.quants.activations import round_f16
from localllm.quants.float import hide_constant, load_f16

i32 = np.int32
f32 = np.float32


# -- activation quantizers ------------------------------------------------------------------


@njit(cache=True)
def quantize_q8_0(x, xq, xd, xs):
    """Q8_0/Q8_1 blocks of 32: xq = rint(x * 127 / amax), xd = f16(amax / 127),
    xs = f16(d * sum q)."""
    n_tokens, n_cols = x.shape
    for t in range(n_tokens):
        for b in range(n_cols // 32):
            amax = f32(0.0)
            for j in range(b * 32, b * 32 + 32):
                amax = max(amax, abs(x[t, j]))
            d = amax / f32(127.0)
            inv = f32(127.0) / amax if amax != 0 else f32(0.0)
            total = 0
            for j in range(b * 32, b * 32 + 32):
                q = np.int32(np.rint(x[t, j] * inv))
                xq[t, j] = q
                total += q
            xd[t, b] = round_f16(d)
            xs[t, b] = round_f16(d * f32(total))


@njit(cache=True)
def quantize_q8_k(x, xq, xd, xs):
    """Q8_K blocks of 256: iscale = -127 / max, xq = min(127, rint(iscale * x)), xd = 1 / iscale,
    xs[16-group] = sum of xq in the group."""
    n_tokens, n_cols = x.shape
    for t in range(n_tokens):
        for b in range(n_cols // 256):
            amax = f32(0.0)
            vmax = f32(0.0)
            for j in range(b * 256, b * 256 + 256):
                if abs(x[t, j]) > amax:
                    amax = abs(x[t, j])
                    vmax = x[t, j]
            if amax == 0:
                xd[t, b] = 0.0
                for j in range(b * 256, b * 256 + 256):
                    xq[t, j] = 0
            else:
                iscale = f32(-127.0) / vmax
                xd[t, b] = f32(1.0) / iscale
                for j in range(b * 256, b * 256 + 256):
                    xq[t, j] = np.int32(min(f32(127.0), np.rint(iscale * x[t, j])))
            for g in range(b * 16, b * 16 + 16):
                total = 0
                for j in range(g * 16, g * 16 + 16):
                    total += xq[t, j]
                xs[t, g] = total


# -- legacy types (blocks of 32, Q8_0 / Q8_1 activations) -------------------------------------


@njit(cache=True)
def _dot_q4_0(wr, xq, xd, lanes):
    lanes[:] = 0.0
    n16 = hide_constant(16)
    for b in range(wr.shape[0] // 18):
        o, e = b * 18, b * 32
        s = load_f16(wr, o) * xd[b]
        for i in range(n16):
            q = i32(wr[o + 2 + i])
            p = i32(i32((q & 15) - 8) * i32(xq[e + i]) + i32((q >> 4) - 8) * i32(xq[e + 16 + i]))
            lanes[i] += s * f32(p)
    return lanes.sum()


@njit(cache=True)
def _dot_q4_1(wr, xq, xd, xs, lanes):
    lanes[:] = 0.0
    n16 = hide_constant(16)
    mins = f32(0.0)
    for b in range(wr.shape[0] // 20):
        o, e = b * 20, b * 32
        s = load_f16(wr, o) * xd[b]
        mins += load_f16(wr, o + 2) * xs[b]
        for i in range(n16):
            q = i32(wr[o + 4 + i])
            p = i32(i32(q & 15) * i32(xq[e + i]) + i32(q >> 4) * i32(xq[e + 16 + i]))
            lanes[i] += s * f32(p)
    return lanes.sum() + mins


@njit(cache=True)
def _load_u32(wr, o):
    """The little-endian 32-bit word at wr[o:o+4] (Q5's fifth bits), as int64."""
    return (
        np.int64(wr[o])
        | (np.int64(wr[o + 1]) << 8)
        | (np.int64(wr[o + 2]) << 16)
        | (np.int64(wr[o + 3]) << 24)
    )


@njit(cache=True)
def _dot_q5_0(wr, xq, xd, lanes):
    lanes[:] = 0.0
    n16 = hide_constant(16)
    for b in range(wr.shape[0] // 22):
        o, e = b * 22, b * 32
        s = load_f16(wr, o) * xd[b]
        # One word per block, shifted per lane (a vector shift), rather than a byte per weight.
        qh = i32(_load_u32(wr, o + 2) & 0xFFFF)
        qh_hi = i32(_load_u32(wr, o + 2) >> 16)
        for i in range(n16):
            q = i32(wr[o + 6 + i])
            lo = i32((q & 15) | (((qh >> i) & 1) << 4)) - 16
            hi = i32((q >> 4) | (((qh_hi >> i) & 1) << 4)) - 16
            lanes[i] += s * f32(i32(lo * i32(xq[e + i]) + hi * i32(xq[e + 16 + i])))
    return lanes.sum()


@njit(cache=True)
def _dot_q5_1(wr, xq, xd, xs, lanes):
    lanes[:] = 0.0
    n16 = hide_constant(16)
    mins = f32(0.0)
    for b in range(wr.shape[0] // 24):
        o, e = b * 24, b * 32
        s = load_f16(wr, o) * xd[b]
        mins += load_f16(wr, o + 2) * xs[b]
        qh = i32(_load_u32(wr, o + 4) & 0xFFFF)
        qh_hi = i32(_load_u32(wr, o + 4) >> 16)
        for i in range(n16):
            q = i32(wr[o + 8 + i])
            lo = i32((q & 15) | (((qh >> i) & 1) << 4))
            hi = i32((q >> 4) | (((qh_hi >> i) & 1) << 4))
            lanes[i] += s * f32(i32(lo * i32(xq[e + i]) + hi * i32(xq[e + 16 + i])))
    return lanes.sum() + mins


@njit(cache=True)
def _dot_q8_0(wr, xq, xd, lanes):
    lanes[:] = 0.0
    n16 = hide_constant(16)
    for b in range(wr.shape[0] // 34):
        o, e = b * 34, b * 32
        s = load_f16(wr, o) * xd[b]
        for i in range(n16):
            a = i32(np.int8(wr[o + 2 + i])) * i32(xq[e + i])
            c = i32(np.int8(wr[o + 18 + i])) * i32(xq[e + 16 + i])
            lanes[i] += s * f32(i32(a + c))
    return lanes.sum()


# -- K-quants (blocks of 256, Q8_K activations) -------------------------------------------------


@njit(cache=True)
def _scale_min_k4(j, sc, o):
    """The 6-bit scale and min of sub-block j from the 12 packed bytes at sc[o:o+12]."""
    if j < 4:
        return i32(sc[o + j] & 63), i32(sc[o + j + 4] & 63)
    scale = i32((sc[o + j + 4] & 15) | ((sc[o + j - 4] >> 6) << 4))
    m = i32((sc[o + j + 4] >> 4) | ((sc[o + j] >> 6) << 4))
    return scale, m


@njit(cache=True)
def _dot_q4_k(wr, xq, xd, xs, lanes, ilanes):
    lanes[:] = 0.0
    n32 = hide_constant(32)
    mins = f32(0.0)
    for b in range(wr.shape[0] // 144):
        o, e = b * 144, b * 256
        d = load_f16(wr, o) * xd[b]
        dmin = load_f16(wr, o + 2) * xd[b]
        ilanes[:] = 0
        msum = i32(0)
        for j in range(4):
            sc_lo, m_lo = _scale_min_k4(2 * j, wr, o + 4)
            sc_hi, m_hi = _scale_min_k4(2 * j + 1, wr, o + 4)
            msum += m_lo * i32(xs[b * 16 + 4 * j] + xs[b * 16 + 4 * j + 1])
            msum += m_hi * i32(xs[b * 16 + 4 * j + 2] + xs[b * 16 + 4 * j + 3])
            qo, xo = o + 16 + 32 * j, e + 64 * j
            for i in range(n32):
                q = i32(wr[qo + i])
                lo = i32(i32(q & 15) * i32(xq[xo + i]))
                hi = i32(i32(q >> 4) * i32(xq[xo + 32 + i]))
                ilanes[i] += i32(sc_lo * lo + sc_hi * hi)
        for i in range(n32):
            lanes[i] += d * f32(ilanes[i])
        mins += dmin * f32(msum)
    return lanes.sum() - mins


@njit(cache=True)
def _dot_q5_k(wr, xq, xd, xs, lanes, ilanes):
    lanes[:] = 0.0
    n32 = hide_constant(32)
    mins = f32(0.0)
    for b in range(wr.shape[0] // 176):
        o, e = b * 176, b * 256
        d = load_f16(wr, o) * xd[b]
        dmin = load_f16(wr, o + 2) * xd[b]
        ilanes[:] = 0
        msum = i32(0)
        for j in range(4):
            sc_lo, m_lo = _scale_min_k4(2 * j, wr, o + 4)
            sc_hi, m_hi = _scale_min_k4(2 * j + 1, wr, o + 4)
            msum += m_lo * i32(xs[b * 16 + 4 * j] + xs[b * 16 + 4 * j + 1])
            msum += m_hi * i32(xs[b * 16 + 4 * j + 2] + xs[b * 16 + 4 * j + 3])
            qo, ho, xo = o + 48 + 32 * j, o + 16, e + 64 * j
            for i in range(n32):
                q = i32(wr[qo + i])
                h = i32(wr[ho + i])
                lo = i32((q & 15) | (((h >> (2 * j)) & 1) << 4))
                hi = i32((q >> 4) | (((h >> (2 * j + 1)) & 1) << 4))
                ilanes[i] += i32(
                    sc_lo * i32(lo * i32(xq[xo + i])) + sc_hi * i32(hi * i32(xq[xo + 32 + i]))
                )
        for i in range(n32):
            lanes[i] += d * f32(ilanes[i])
        mins += dmin * f32(msum)
    return lanes.sum() - mins


@njit(cache=True)
def _dot_q6_k(wr, xq, xd, lanes, ilanes):
    lanes[:] = 0.0
    n16 = hide_constant(16)
    for b in range(wr.shape[0] // 210):
        o, e = b * 210, b * 256
        d = load_f16(wr, o + 208) * xd[b]
        ilanes[:] = 0
        for half in range(2):
            ql, qh, sc, xo = o + 64 * half, o + 128 + 32 * half, o + 192 + 8 * half, e + 128 * half
            for part in range(2):  # l in [16 part, 16 part + 16): scale index is = part
                s1 = i32(np.int8(wr[sc + part]))
                s2 = i32(np.int8(wr[sc + part + 2]))
                s3 = i32(np.int8(wr[sc + part + 4]))
                s4 = i32(np.int8(wr[sc + part + 6]))
                for i in range(n16):
                    l = 16 * part + i
                    a = i32(wr[ql + l])
                    c = i32(wr[ql + l + 32])
                    h = i32(wr[qh + l])
                    q1 = i32((a & 15) | ((h & 3) << 4)) - 32
                    q2 = i32((c & 15) | (((h >> 2) & 3) << 4)) - 32
                    q3 = i32((a >> 4) | (((h >> 4) & 3) << 4)) - 32
                    q4 = i32((c >> 4) | (((h >> 6) & 3) << 4)) - 32
                    p = i32(s1 * i32(q1 * i32(xq[xo + l])) + s2 * i32(q2 * i32(xq[xo + l + 32])))
                    p = i32(
                        p
                        + s3 * i32(q3 * i32(xq[xo + l + 64]))
                        + s4 * i32(q4 * i32(xq[xo + l + 96]))
                    )
                    ilanes[l] += p
        for i in range(hide_constant(32)):
            lanes[i] += d * f32(ilanes[i])
    return lanes.sum()


# -- the kernels: threads over rows, then tokens ------------------------------------------------


@njit(parallel=True, cache=True)
def mm_q4_0(w, xq, xd, xs, out):
    for r in prange(w.shape[0]):
        lanes = np.empty(16, np.float32)
        for t in range(xq.shape[0]):
            out[t, r] = _dot_q4_0(w[r], xq[t], xd[t], lanes)


@njit(parallel=True, cache=True)
def mm_q4_1(w, xq, xd, xs, out):
    for r in prange(w.shape[0]):
        lanes = np.empty(16, np.float32)
        for t in range(xq.shape[0]):
            out[t, r] = _dot_q4_1(w[r], xq[t], xd[t], xs[t], lanes)


@njit(parallel=True, cache=True)
def mm_q5_0(w, xq, xd, xs, out):
    for r in prange(w.shape[0]):
        lanes = np.empty(16, np.float32)
        for t in range(xq.shape[0]):
            out[t, r] = _dot_q5_0(w[r], xq[t], xd[t], lanes)


@njit(parallel=True, cache=True)
def mm_q5_1(w, xq, xd, xs, out):
    for r in prange(w.shape[0]):
        lanes = np.empty(16, np.float32)
        for t in range(xq.shape[0]):
            out[t, r] = _dot_q5_1(w[r], xq[t], xd[t], xs[t], lanes)


@njit(parallel=True, cache=True)
def mm_q8_0(w, xq, xd, xs, out):
    for r in prange(w.shape[0]):
        lanes = np.empty(16, np.float32)
        for t in range(xq.shape[0]):
            out[t, r] = _dot_q8_0(w[r], xq[t], xd[t], lanes)


@njit(parallel=True, cache=True)
def mm_q4_k(w, xq, xd, xs, out):
    for r in prange(w.shape[0]):
        lanes = np.empty(32, np.float32)
        ilanes = np.empty(32, np.int32)
        for t in range(xq.shape[0]):
            out[t, r] = _dot_q4_k(w[r], xq[t], xd[t], xs[t], lanes, ilanes)


@njit(parallel=True, cache=True)
def mm_q5_k(w, xq, xd, xs, out):
    for r in prange(w.shape[0]):
        lanes = np.empty(32, np.float32)
        ilanes = np.empty(32, np.int32)
        for t in range(xq.shape[0]):
            out[t, r] = _dot_q5_k(w[r], xq[t], xd[t], xs[t], lanes, ilanes)


@njit(parallel=True, cache=True)
def mm_q6_k(w, xq, xd, xs, out):
    for r in prange(w.shape[0]):
        lanes = np.empty(32, np.float32)
        ilanes = np.empty(32, np.int32)
        for t in range(xq.shape[0]):
            out[t, r] = _dot_q6_k(w[r], xq[t], xd[t], lanes, ilanes)


# GGML type id -> (kernel, activation format): "q8_0" (blocks of 32) or "q8_k" (blocks of 256).
INT_KERNELS = {
    2: (mm_q4_0, "q8_0"),
    3: (mm_q4_1, "q8_0"),
    6: (mm_q5_0, "q8_0"),
    7: (mm_q5_1, "q8_0"),
    8: (mm_q8_0, "q8_0"),
    12: (mm_q4_k, "q8_k"),
    13: (mm_q5_k, "q8_k"),
    14: (mm_q6_k, "q8_k"),
}


class QuantizedActivations:
    """Buffers for one activation matrix quantized both ways, reused across calls."""

    def __init__(self, n_tokens: int, n_cols: int):
        self.xq = np.empty((n_tokens, n_cols), np.int8)  # int8[n_tokens, n_cols]
        self.xd32 = np.empty((n_tokens, n_cols // 32), np.float32)
        self.xs32 = np.empty((n_tokens, n_cols // 32), np.float32)
        self.xqk = np.empty((n_tokens, n_cols), np.int8)
        self.xdk = np.empty((n_tokens, max(n_cols // 256, 1)), np.float32)
        self.xsk = np.empty((n_tokens, max(n_cols // 16, 1)), np.int32)

    def q8_0(self, x):
        quantize_q8_0(x, self.xq, self.xd32, self.xs32)
        return self.xq, self.xd32, self.xs32

    def q8_k(self, x):
        quantize_q8_k(x, self.xqk, self.xdk, self.xsk)
        return self.xqk, self.xdk, self.xsk
