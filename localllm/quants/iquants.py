"""I-quants: weights are indices into a fixed non-uniform grid of levels, scaled per block.

Layouts (little-endian, from ggml-common.h / gguf-py quants.py):

    IQ4_NL   18 B per 32: d f16 | qs[16] 4-bit          w = d * KVALUES_IQ4NL[q]
    IQ4_XS  136 B per 256: d f16 | scales_h u16 | scales_l[4] | qs[128] 4-bit
                            w = d * (ls - 32) * KVALUES_IQ4NL[q] per 32 weights, ls 6 bits:
                            low 4 in nibble j % 2 of scales_l[j // 2], high 2 at bit 2j of scales_h
    IQ3_S   110 B per 256: d f16 | qs[64] | qh[8] | signs[32] | scales[4]
                            w = d * (1 + 2 * scale) * IQ3S_GRID[index][t] * sign, see below

In a 32-weight block (IQ4_NL) or sub-block j (IQ4_XS, bytes qs[16j:16j + 16]), weight i < 16
is the low nibble of byte i and weight 16 + i its high nibble, as in Q4_0.

The row dequantizers mirror gguf-py's float32 operation order (IQ4_XS: (d * (ls - 32)) * level),
so they are bit-exact. The matvec kernels (the float path, for CPUs without the integer kernels
of intdot.py) accumulate into 32 lanes per row as legacy.py does, looking the levels up in a
float32 table.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .float import check_shapes, f16_to_f32, hide_constant, load_f16

QK_K = 256

# ggml's kvalues_iq4nl: the 16 levels of a 4-bit index, a non-uniform int8 grid
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_LEVELS = np.array(KVALUES_IQ4NL, np.float32)  # a constant array in the compiled code


# ---- IQ4_NL ----


@njit
def dequantize_row_iq4_nl(row, out):
    """IQ4_NL row uint8[n_cols // 32 * 18] -> out float32[n_cols]."""
    n16 = hide_constant(16)  # keeps the loop below vectorizable
    for b in range(out.shape[0] // 32):
        o, e = b * 18, b * 32
        d = load_f16(row, o)
        for i in range(n16):
            q = row[o + 2 + i]
            out[e + i] = d * _LEVELS[q & 15]
            out[e + i + 16] = d * _LEVELS[q >> 4]


@njit(parallel=True, cache=True)
def matvec_iq4_nl(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols]."""
    check_shapes(w, x, out, 32, 18)
    n_rows, row_bytes = w.shape
    for r in prange(n_rows):
        wr = w[r]
        acc = np.empty(32, np.float32)  # hoisted out of the loop by Numba: one per thread
        acc[:] = 0.0
        for b in range(row_bytes // 18):
            o, e = b * 18, b * 32
            d = load_f16(wr, o)
            for i in range(16):
                q = wr[o + 2 + i]
                acc[i] += d * _LEVELS[q & 15] * x[e + i]
                acc[i + 16] += d * _LEVELS[q >> 4] * x[e + i + 16]
        out[r] = acc.sum()


# ---- IQ4_XS: 8 sub-blocks of 32 with 6-bit scales ----


@njit(cache=True)
def _iq4_xs_scale(row, o, j):
    """The signed scale ls - 32 of sub-block j of the block at row[o]."""
    low = (np.int32(row[o + 4 + (j >> 1)]) >> (4 * (j & 1))) & 15
    scales_h = np.int32(row[o + 2]) | (np.int32(row[o + 3]) << 8)
    return (low | (((scales_h >> (2 * j)) & 3) << 4)) - 32


@njit
def dequantize_row_iq4_xs(row, out):
    """IQ4_XS row uint8[n_cols // 256 * 136] -> out float32[n_cols]."""
    n16 = hide_constant(16)  # keeps the loop below vectorizable
    for b in range(out.shape[0] // QK_K):
        o = b * 136
        d = load_f16(row, o)
        for j in range(8):
            dl = d * np.float32(_iq4_xs_scale(row, o, j))
            q_at = o + 8 + 16 * j
            e = b * QK_K + 32 * j
            for i in range(n16):
                q = row[q_at + i]
                out[e + i] = dl * _LEVELS[q & 15]
                out[e + i + 16] = dl * _LEVELS[q >> 4]


@njit(parallel=True, cache=True)
def matvec_iq4_xs(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols]."""
    check_shapes(w, x, out, QK_K, 136)
    n_rows, row_bytes = w.shape
    for r in prange(n_rows):
        wr = w[r]
        acc = np.empty(32, np.float32)  # hoisted: one per thread
        acc[:] = 0.0
        for b in range(row_bytes // 136):
            o = b * 136
            d = load_f16(wr, o)
            for j in range(8):
                dl = d * np.float32(_iq4_xs_scale(wr, o, j))
                q_at = o + 8 + 16 * j
                e = b * QK_K + 32 * j
                for i in range(16):
                    q = wr[q_at + i]
                    acc[i] += dl * _LEVELS[q & 15] * x[e + i]
                    acc[i + 16] += dl * _LEVELS[q >> 4] * x[e + i + 16]
        out[r] = acc.sum()


# ---- IQ3_S: 9-bit indices into a grid of 512 x 4 odd levels, a sign bit per weight ----


def _iq3s_grid() -> np.ndarray:
    """ggml's iq3s_grid as uint8[512, 4]: entry i holds the levels (1, 3, .., 15) of 4 weights.
    gguf-py carries the table (packed, as hex); the GGUF blocks index it."""
    from gguf.quants import IQ3_S

    IQ3_S.init_grid()
    return np.ascontiguousarray(IQ3_S.grid.reshape(512, 4).astype(np.uint8))


IQ3S_GRID = _iq3s_grid()
_IQ3S_LEVELS = IQ3S_GRID.astype(np.float32)  # a constant array in the compiled code


@njit(cache=True)
def _iq3_s_weight(row, o, db, j, k):
    """Weight k (< 32) of sub-block j of the IQ3_S block at row[o], its scale db applied:
    (db * level) * sign, gguf-py's order (a multiply, not a negation: NaNs stay as numpy has
    them)."""
    m = 8 * j + (k >> 2)  # its grid index: qs[m] and bit m % 8 of qh[j] as bit 8
    index = np.int32(row[o + 2 + m]) | (((np.int32(row[o + 66 + j]) >> (k >> 2)) & 1) << 8)
    w = 32 * j + k
    negative = (row[o + 74 + (w >> 3)] >> (w & 7)) & 1
    return db * _IQ3S_LEVELS[index, k & 3] * (np.float32(-1.0) if negative else np.float32(1.0))


@njit
def dequantize_row_iq3_s(row, out):
    """IQ3_S row uint8[n_cols // 256 * 110] -> out float32[n_cols]. Block: d f16 | qs[64] (low 8
    bits of the grid indices) | qh[8] (their 9th bits) | signs[32] | scales[4] (4 bits per 32
    weights): w = d * (1 + 2 * scale) * level * sign."""
    for b in range(out.shape[0] // QK_K):
        o = b * 110
        d = load_f16(row, o)
        for j in range(8):
            scale = (np.int32(row[o + 106 + (j >> 1)]) >> (4 * (j & 1))) & 15
            db = d * np.float32(1 + 2 * scale)
            for k in range(32):
                out[b * QK_K + 32 * j + k] = _iq3_s_weight(row, o, db, j, k)


@njit(parallel=True, cache=True)
def matvec_iq3_s(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols] (the float path: a lookup per weight,
    for CPUs without the integer kernels)."""
    check_shapes(w, x, out, QK_K, 110)
    n_rows, row_bytes = w.shape
    for r in prange(n_rows):
        wr = w[r]
        acc = np.empty(32, np.float32)  # hoisted: one per thread
        acc[:] = 0.0
        for b in range(row_bytes // 110):
            o = b * 110
            d = load_f16(wr, o)
            for j in range(8):
                scale = (np.int32(wr[o + 106 + (j >> 1)]) >> (4 * (j & 1))) & 15
                db = d * np.float32(1 + 2 * scale)
                e = b * QK_K + 32 * j
                for k in range(32):
                    acc[k] += _iq3_s_weight(wr, o, db, j, k) * x[e + k]
        out[r] = acc.sum()


# ---- IQ3_XXS: 8-bit indices into a grid of 256 x 4 levels, 7 sign bits per 8 weights ----


def _iq3xxs_grid() -> np.ndarray:
    """ggml's iq3xxs_grid as uint8[256, 4] (levels 4..62), from gguf-py's packed table."""
    from gguf.quants import IQ3_XXS

    IQ3_XXS.init_grid()
    return np.ascontiguousarray(IQ3_XXS.grid.reshape(256, 4).astype(np.uint8))


IQ3XXS_GRID = _iq3xxs_grid()
_IQ3XXS_LEVELS = IQ3XXS_GRID.astype(np.float32)


@njit(cache=True)
def ksign(index):
    """ggml's ksigns_iq2xs[index]: 7 stored sign bits and their parity as the 8th (an even
    number of the 8 weights is negative)."""
    parity = index ^ (index >> 4)
    parity ^= parity >> 2
    parity ^= parity >> 1
    return index | ((parity & 1) << 7)


@njit(cache=True)
def _u32(row, offset):
    return (
        np.int64(row[offset])
        | (np.int64(row[offset + 1]) << 8)
        | (np.int64(row[offset + 2]) << 16)
        | (np.int64(row[offset + 3]) << 24)
    )


@njit(cache=True)
def _iq3_xxs_weight(row, o, db, aux, j, k):
    """Weight k (< 32) of sub-block j of the IQ3_XXS block at row[o], its scale db applied:
    (db * level) * sign, gguf-py's order. Weight 8l + t takes its sign from bit t of
    ksign(bits 7l.. of aux), its level from grid entry qs[8j + k // 4]."""
    index = np.int32(row[o + 2 + 8 * j + (k >> 2)])
    signs = ksign(np.int32((aux >> (7 * (k >> 3))) & 127))
    negative = (signs >> (k & 7)) & 1
    return db * _IQ3XXS_LEVELS[index, k & 3] * (np.float32(-1.0) if negative else np.float32(1.0))


@njit
def dequantize_row_iq3_xxs(row, out):
    """IQ3_XXS row uint8[n_cols // 256 * 98] -> out float32[n_cols]. Block: d f16 | qs[64] (grid
    indices) | 8 x u32 (per 32 weights: 4 x 7 sign bits, a 4-bit scale s in bits 28-31):
    w = d * (0.5 + s) * 0.5 * level * sign."""
    for b in range(out.shape[0] // QK_K):
        o = b * 98
        d = load_f16(row, o)
        for j in range(8):
            aux = _u32(row, o + 66 + 4 * j)
            db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.5)
            for k in range(32):
                out[b * QK_K + 32 * j + k] = _iq3_xxs_weight(row, o, db, aux, j, k)


@njit(parallel=True, cache=True)
def matvec_iq3_xxs(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols] (the float path)."""
    check_shapes(w, x, out, QK_K, 98)
    n_rows, row_bytes = w.shape
    for r in prange(n_rows):
        wr = w[r]
        acc = np.empty(32, np.float32)  # hoisted: one per thread
        acc[:] = 0.0
        for b in range(row_bytes // 98):
            o = b * 98
            d = load_f16(wr, o)
            for j in range(8):
                aux = _u32(wr, o + 66 + 4 * j)
                db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.5)
                e = b * QK_K + 32 * j
                for k in range(32):
                    acc[k] += _iq3_xxs_weight(wr, o, db, aux, j, k) * x[e + k]
        out[r] = acc.sum()


# ---- IQ2_XXS, IQ2_XS, IQ2_S: indices into grids of 8 levels (8, 25, 43), sign bits ----


def _grid8(name: str, n: int) -> np.ndarray:
    """ggml's iq2xxs_grid (256), iq2xs_grid (512) or iq2s_grid (1024) as uint8[n, 8]."""
    from gguf import quants

    cls = getattr(quants, name)
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(n, 8).astype(np.uint8))


IQ2XXS_GRID, IQ2XS_GRID, IQ2S_GRID = (
    _grid8("IQ2_XXS", 256),
    _grid8("IQ2_XS", 512),
    _grid8("IQ2_S", 1024),
)
_IQ2XXS_LEVELS, _IQ2XS_LEVELS, _IQ2S_LEVELS = (
    IQ2XXS_GRID.astype(np.float32),
    IQ2XS_GRID.astype(np.float32),
    IQ2S_GRID.astype(np.float32),
)


@njit(cache=True)
def _signed(value, signs, t):
    """value * (-1 if bit t of signs else 1): a multiply, as in gguf-py (NaNs keep their sign)."""
    return value * (np.float32(-1.0) if (signs >> t) & 1 else np.float32(1.0))


@njit(cache=True)
def _iq2_xxs_weights(row, o, j, out, e):
    """The 32 weights of sub-block j of the IQ2_XXS block at row[o] into out[e:e + 32]. Per 32
    weights: u32 of 4 grid indices, u32 of 4 x 7 sign bits (ksign) and a 4-bit scale s (bits
    28-31): w = d * (0.5 + s) * 0.25 * level * sign."""
    d = load_f16(row, o)
    aux = _u32(row, o + 2 + 8 * j + 4)
    db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.25)
    for k in range(32):
        index = np.int32(row[o + 2 + 8 * j + (k >> 3)])
        signs = ksign(np.int32((aux >> (7 * (k >> 3))) & 127))
        out[e + k] = _signed(db * _IQ2XXS_LEVELS[index, k & 7], signs, k & 7)


@njit(cache=True)
def _iq2_xs_weights(row, o, j, out, e):
    """IQ2_XS (d f16 | qs u16[32] | scales[8]): per 8 weights a u16 of a 9-bit grid index and
    7 sign bits (ksign), per 16 a 4-bit scale s: w = d * (0.5 + s) * 0.25 * level * sign."""
    d = load_f16(row, o)
    for k in range(32):
        g = 4 * j + (k >> 3)  # the u16 of these 8 weights
        q = np.int32(row[o + 2 + 2 * g]) | (np.int32(row[o + 3 + 2 * g]) << 8)
        s = (np.int32(row[o + 66 + j]) >> (4 * (k >> 4))) & 15
        db = d * (np.float32(0.5) + np.float32(s)) * np.float32(0.25)
        out[e + k] = _signed(db * _IQ2XS_LEVELS[q & 511, k & 7], ksign(q >> 9), k & 7)


@njit(cache=True)
def _iq2_s_weights(row, o, j, out, e):
    """IQ2_S (d f16 | qs[32] | signs[32] | qh[8] | scales[8]): per 8 weights a 10-bit grid index
    (qs, and 2 bits of qh), a sign bit per weight, per 16 a 4-bit scale s:
    w = d * (0.5 + s) * 0.25 * level * sign."""
    d = load_f16(row, o)
    for k in range(32):
        g = 4 * j + (k >> 3)
        high = (np.int32(row[o + 66 + j]) >> (2 * (k >> 3))) & 3
        index = np.int32(row[o + 2 + g]) | (high << 8)
        s = (np.int32(row[o + 74 + j]) >> (4 * (k >> 4))) & 15
        db = d * (np.float32(0.5) + np.float32(s)) * np.float32(0.25)
        signs = np.int32(row[o + 34 + 4 * j + (k >> 3)])
        out[e + k] = _signed(db * _IQ2S_LEVELS[index, k & 7], signs, k & 7)


# IQ1_S / IQ1_M: 11-bit indices into a grid of 2048 x 8 levels -1, 0, 1, each shifted by
# +-IQ1_DELTA (a sign bit per 32 or per 8 weights), odd 3-bit scales
IQ1_DELTA = np.float32(0.125)


def _iq1_grid() -> np.ndarray:
    """ggml's iq1s_grid as int8[2048, 8] of -1, 0, 1 (gguf-py's packed table)."""
    from gguf.quants import IQ1_S

    IQ1_S.init_grid()
    return np.ascontiguousarray(IQ1_S.grid.reshape(2048, 8).astype(np.int8))


IQ1_GRID = _iq1_grid()
_IQ1_LEVELS = IQ1_GRID.astype(np.float32)


@njit(cache=True)
def _iq1_s_weights(row, o, j, out, e):
    """IQ1_S (d f16 | qs[32] | qh u16[8]): per 32 weights a u16 of 4 x 3 high index bits, a
    3-bit scale s (bits 12-14) and the delta's sign (bit 15); w = d * (2s + 1) * (level +-
    IQ1_DELTA), gguf-py's order."""
    d = load_f16(row, o)
    qh = np.int32(row[o + 34 + 2 * j]) | (np.int32(row[o + 35 + 2 * j]) << 8)
    dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
    delta = -IQ1_DELTA if qh & 0x8000 else IQ1_DELTA
    for k in range(32):
        g = k >> 3
        index = np.int32(row[o + 2 + 4 * j + g]) | (((qh >> (3 * g)) & 7) << 8)
        out[e + k] = dl * (_IQ1_LEVELS[index, k & 7] + delta)


@njit(cache=True)
def _iq1_m_weights(row, o, j, out, e):
    """IQ1_M (qs[32] | qh[16] | scales u16[4], the f16 d in their top 4 bits): per 8 weights a
    nibble of qh (3 high index bits, the delta's sign), per 16 a 3-bit scale s;
    w = d * (2s + 1) * (level +- IQ1_DELTA), gguf-py's order."""
    sc = [np.int32(row[o + 48 + 2 * i]) | (np.int32(row[o + 49 + 2 * i]) << 8) for i in range(4)]
    bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0xF0) | ((sc[2] >> 4) & 0xF00) | (sc[3] & 0xF000)
    d = f16_to_f32(bits)
    for k in range(32):
        group = 2 * j + (k >> 4)  # 16 weights per scale
        scale = (sc[group >> 2] >> (3 * (group & 3))) & 7
        dl = d * np.float32(2 * scale + 1)
        i = 4 * j + (k >> 3)  # 8 weights per index
        nibble = (np.int32(row[o + 32 + (i >> 1)]) >> (4 * (i & 1))) & 15
        index = np.int32(row[o + i]) | ((nibble & 7) << 8)
        delta = -IQ1_DELTA if nibble & 8 else IQ1_DELTA
        out[e + k] = dl * (_IQ1_LEVELS[index, k & 7] + delta)


@njit(cache=True)
def _grid8_chunk(kind, row, o, j, out, e):
    """The 32 weights of sub-block j of the block at row[o], of type kind (0: IQ2_XXS, 1: IQ2_XS,
    2: IQ2_S, 3: IQ1_S, 4: IQ1_M), into out[e:e + 32]. A branch per 32 weights, not a closure per
    type: kernels that close over a compiled function are never found in Numba's cache again
    (see kernels.py)."""
    if kind == 0:
        _iq2_xxs_weights(row, o, j, out, e)
    elif kind == 1:
        _iq2_xs_weights(row, o, j, out, e)
    elif kind == 2:
        _iq2_s_weights(row, o, j, out, e)
    elif kind == 3:
        _iq1_s_weights(row, o, j, out, e)
    else:
        _iq1_m_weights(row, o, j, out, e)


@njit(cache=True)
def _dequantize_grid8(row, out, kind, type_size):
    for b in range(out.shape[0] // QK_K):
        for j in range(8):
            _grid8_chunk(kind, row, b * type_size, j, out, b * QK_K + 32 * j)


@njit(parallel=True, cache=True)
def _matvec_grid8(w, x, out, kind, type_size):
    check_shapes(w, x, out, QK_K, type_size)
    n_rows, row_bytes = w.shape
    for r in prange(n_rows):
        wr = w[r]
        chunk = np.empty(32, np.float32)  # hoisted: one per thread
        acc = np.zeros(32, np.float32)
        for b in range(row_bytes // type_size):
            for j in range(8):
                e = b * QK_K + 32 * j
                _grid8_chunk(kind, wr, b * type_size, j, chunk, 0)
                for k in range(32):
                    acc[k] += chunk[k] * x[e + k]
        out[r] = acc.sum()


@njit
def dequantize_row_iq2_xxs(row, out):
    """IQ2_XXS row uint8[n_cols // 256 * 66] -> out float32[n_cols]."""
    _dequantize_grid8(row, out, 0, 66)


@njit
def dequantize_row_iq2_xs(row, out):
    """IQ2_XS row uint8[n_cols // 256 * 74] -> out float32[n_cols]."""
    _dequantize_grid8(row, out, 1, 74)


@njit
def dequantize_row_iq2_s(row, out):
    """IQ2_S row uint8[n_cols // 256 * 82] -> out float32[n_cols]."""
    _dequantize_grid8(row, out, 2, 82)


@njit(cache=True)
def matvec_iq2_xxs(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols] (the float path)."""
    _matvec_grid8(w, x, out, 0, 66)


@njit(cache=True)
def matvec_iq2_xs(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols] (the float path)."""
    _matvec_grid8(w, x, out, 1, 74)


@njit(cache=True)
def matvec_iq2_s(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols] (the float path)."""
    _matvec_grid8(w, x, out, 2, 82)


@njit
def dequantize_row_iq1_s(row, out):
    """IQ1_S row uint8[n_cols // 256 * 50] -> out float32[n_cols]."""
    _dequantize_grid8(row, out, 3, 50)


@njit
def dequantize_row_iq1_m(row, out):
    """IQ1_M row uint8[n_cols // 256 * 56] -> out float32[n_cols]."""
    _dequantize_grid8(row, out, 4, 56)


@njit(cache=True)
def matvec_iq1_s(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols] (the float path)."""
    _matvec_grid8(w, x, out, 3, 50)


@njit(cache=True)
def matvec_iq1_m(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols] (the float path)."""
    _matvec_grid8(w, x, out, 4, 56)
