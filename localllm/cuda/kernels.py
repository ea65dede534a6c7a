"""The transformer's kernels for numba-cuda: quantized matvec/matmul, RMSNorm, RoPE, attention,
activations. The same code runs on a GPU and on numba's CUDA simulator (the tests).

Weights stay in their GGUF blocks on the device: uint8[n_rows, row_bytes], bytes as in the file.
Every weight kernel cuts a row into 32-weight chunks and asks `dequantize_chunk` for one chunk at
a time; it dispatches on the GGML type id (the same for every thread of a launch, so the branch
never diverges) to a small dequantizer per type. One compiled kernel per op then serves all types,
which keeps the first-run NVVM compile to a handful of kernels.

The dequantizers follow the float32 order of operations of gguf-py (see localllm/quants), so a
dequantized weight is bit-exact with it; dot products are summed in a different order than on
the CPU, so results agree to float32 rounding, not bit for bit.

The fixed grids of the I-quants and the 4-bit levels of IQ4_NL/IQ4_XS and MXFP4 are module-level
numpy arrays, which numba-cuda freezes into each kernel as constant memory. They are taken from
the CPU modules (localllm/quants), flattened, and the grids kept as uint8/int8: as float32 the six
grids would be 132 KiB, over the 64 KiB of constant memory a kernel may have.

Halves (block scales, F16/BF16 weights) and F32 weights are decoded from their bytes with integer
ops and `math.ldexp` (exact), so nothing depends on float16 loads or bit casts and one integer code
path runs on the GPU and in the simulator. Reductions go through shared memory because the
simulator has no warp shuffles.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, types

from localllm.quants import QUANT_TYPES, iquants, mxfp4


def numpy_compat(module=np) -> None:
    """numba-cuda (0.30.4, the pinned version) registers a kernel overload of np.row_stack
    when it compiles its first kernel, and NumPy 2.5 removed row_stack (an alias of vstack):
    every kernel then fails with an AttributeError (seen on a GPU machine with NumPy 2.5.2).
    Put the alias back where it is missing, before any kernel here compiles."""
    if not hasattr(module, "row_stack"):
        module.row_stack = module.vstack


numpy_compat()

# GGML type ids (gguf.constants.GGMLQuantizationType)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS = 16, 17, 18, 19, 20, 21, 22, 23
IQ1_M, TQ1_0, TQ2_0, MXFP4 = 29, 34, 35, 39
# the types dequantize_chunk has: those whose record (localllm.quants) says cuda=True
SUPPORTED_TYPES = tuple(t for t, qt in QUANT_TYPES.items() if qt.cuda)

CHUNK = 32  # weights per chunk: one legacy block, one K-quant sub-block (or two of 16)
TOKEN_TILE = 8  # tokens that share one dequantized chunk in matmul
# Most threads per block in the kernels that reduce in shared memory (matvec, matmul, rmsnorm,
# attention). The launch picks the block shape (threads per row, a power of two) and passes the
# shared memory as dynamic shared memory; neither is baked into the kernels, so the simulator can
# run the same code with a few threads per row. (Dynamic shared memory also sidesteps a race in
# the simulator's allocation of static shared arrays.)
MAX_BLOCK = 128
MAX_LANES = 32  # threads per weight row in matvec/matmul: at most a warp
GELU_C = np.float32(math.sqrt(2.0 / math.pi))

# Lookup tables, constant memory on the GPU (see above). Levels as float32, grids flat:
# grid entry g, level t is GRID[g * width + t] (width 4 or 8). numba-cuda makes a copy of a table
# at each place the source names it, so a dequantizer names its table once (bound to a local
# where it reads it twice), and the 16 KiB IQ1_GRID of IQ1_S and IQ1_M is named in one helper.
IQ4NL_LEVELS = np.array(iquants.KVALUES_IQ4NL, np.float32)  # float32[16]
MXFP4_LEVELS = np.ascontiguousarray(mxfp4.KVALUES, np.float32)  # float32[16], e2m1 doubled
IQ3XXS_GRID = iquants.IQ3XXS_GRID.reshape(-1)  # uint8[256 * 4]: levels 4..62
IQ3S_GRID = iquants.IQ3S_GRID.reshape(-1)  # uint8[512 * 4]: levels 1..15
IQ2XXS_GRID = iquants.IQ2XXS_GRID.reshape(-1)  # uint8[256 * 8]: levels 8, 25, 43
IQ2XS_GRID = iquants.IQ2XS_GRID.reshape(-1)  # uint8[512 * 8]
IQ2S_GRID = iquants.IQ2S_GRID.reshape(-1)  # uint8[1024 * 8]
IQ1_GRID = iquants.IQ1_GRID.reshape(-1)  # int8[2048 * 8]: levels -1, 0, 1
IQ1_DELTA = iquants.IQ1_DELTA  # float32: the shift of IQ1_S/IQ1_M levels


# ---- decoding bytes ----


@cuda.jit(device=True, cache=True)
def _float_from_bits(bits, exp_bits, man_bits):
    """An IEEE-style float (F16: 5/10, BF16: 8/7, F32: 8/23 bits) given as an int64 of its bits."""
    exp_max = (1 << exp_bits) - 1
    bias = (1 << (exp_bits - 1)) - 1
    exponent = (bits >> man_bits) & exp_max
    mantissa = bits & ((1 << man_bits) - 1)
    if exponent == exp_max:
        value = np.float32(math.inf) if mantissa == 0 else np.float32(math.nan)
    elif exponent == 0:  # zero or subnormal
        value = np.float32(math.ldexp(np.float32(mantissa), int(1 - bias - man_bits)))
    else:
        full = mantissa | (1 << man_bits)  # at most 24 bits: exact in float32
        value = np.float32(math.ldexp(np.float32(full), int(exponent - bias - man_bits)))
    return -value if (bits >> (exp_bits + man_bits)) & 1 else value


@cuda.jit(device=True, cache=True)
def _u16(w, r, o):
    """Little-endian 16-bit integer at byte o of row r, as int64."""
    return np.int64(w[r, o]) | (np.int64(w[r, o + 1]) << 8)


@cuda.jit(device=True, cache=True)
def _u32(w, r, o):
    """Little-endian 32-bit integer at byte o of row r, as int64."""
    return _u16(w, r, o) | (_u16(w, r, o + 2) << 16)


@cuda.jit(device=True, cache=True)
def _f16(w, r, o):
    """The IEEE half at byte o of row r, as float32 (exact)."""
    return _float_from_bits(_u16(w, r, o), 5, 10)


# ---- one dequantizer per type: buf[0:32] = weights 32 c .. 32 c + 31 of row r ----


@cuda.jit(device=True, cache=True)
def _chunk_float(w, r, c, n_cols, qtype, buf):
    """F32 / F16 / BF16, zeros past n_cols (float rows need not be whole chunks)."""
    for i in range(CHUNK):
        k = c * CHUNK + i
        if k >= n_cols:
            buf[i] = np.float32(0.0)
        elif qtype == F32:
            buf[i] = _float_from_bits(_u32(w, r, 4 * k), 8, 23)
        elif qtype == F16:
            buf[i] = _float_from_bits(_u16(w, r, 2 * k), 5, 10)
        else:
            buf[i] = _float_from_bits(_u16(w, r, 2 * k), 8, 7)


@cuda.jit(device=True, cache=True)
def _chunk_q4_0(w, r, c, buf):
    """18 B: d f16 | qs[16]; w = d * (q - 8), low nibbles first."""
    o = c * 18
    d = _f16(w, r, o)
    for i in range(16):
        q = np.int32(w[r, o + 2 + i])
        buf[i] = d * np.float32((q & 15) - 8)
        buf[i + 16] = d * np.float32((q >> 4) - 8)


@cuda.jit(device=True, cache=True)
def _chunk_q4_1(w, r, c, buf):
    """20 B: d f16 | m f16 | qs[16]; w = d * q + m."""
    o = c * 20
    d = _f16(w, r, o)
    m = _f16(w, r, o + 2)
    for i in range(16):
        q = np.int32(w[r, o + 4 + i])
        buf[i] = d * np.float32(q & 15) + m
        buf[i + 16] = d * np.float32(q >> 4) + m


@cuda.jit(device=True, cache=True)
def _chunk_q5_0(w, r, c, buf):
    """22 B: d f16 | qh u32 | qs[16]; w = d * (q - 16), bit 4 of weight i is bit i of qh."""
    o = c * 22
    d = _f16(w, r, o)
    qh = _u32(w, r, o + 2)
    for i in range(16):
        q = np.int64(w[r, o + 6 + i])
        lo = (q & 15) | (((qh >> i) & 1) << 4)
        hi = (q >> 4) | (((qh >> (i + 16)) & 1) << 4)
        buf[i] = d * np.float32(lo - 16)
        buf[i + 16] = d * np.float32(hi - 16)


@cuda.jit(device=True, cache=True)
def _chunk_q5_1(w, r, c, buf):
    """24 B: d f16 | m f16 | qh u32 | qs[16]; w = d * q + m."""
    o = c * 24
    d = _f16(w, r, o)
    m = _f16(w, r, o + 2)
    qh = _u32(w, r, o + 4)
    for i in range(16):
        q = np.int64(w[r, o + 8 + i])
        lo = (q & 15) | (((qh >> i) & 1) << 4)
        hi = (q >> 4) | (((qh >> (i + 16)) & 1) << 4)
        buf[i] = d * np.float32(lo) + m
        buf[i + 16] = d * np.float32(hi) + m


@cuda.jit(device=True, cache=True)
def _chunk_q8_0(w, r, c, buf):
    """34 B: d f16 | qs int8[32]; w = q * d."""
    o = c * 34
    d = _f16(w, r, o)
    for i in range(32):
        q = np.int32(w[r, o + 2 + i])
        buf[i] = np.float32(q - 256 if q > 127 else q) * d


@cuda.jit(device=True, cache=True)
def _scale_min_k4(w, r, o, j):
    """(scale, min) of sub-block j from the 12 packed 6-bit bytes at byte o (Q4_K, Q5_K)."""
    if j < 4:
        return np.int32(w[r, o + j]) & 63, np.int32(w[r, o + j + 4]) & 63
    scale = (np.int32(w[r, o + j + 4]) & 15) | ((np.int32(w[r, o + j - 4]) >> 6) << 4)
    minimum = (np.int32(w[r, o + j + 4]) >> 4) | ((np.int32(w[r, o + j]) >> 6) << 4)
    return scale, minimum


@cuda.jit(device=True, cache=True)
def _chunk_q2_k(w, r, c, buf):
    """84 B: scales[16] (low: scale, high: min) | qs[64] 2-bit | d | dmin. Sub-blocks 2p, 2p+1."""
    o, p = (c >> 3) * 84, c & 7
    d = _f16(w, r, o + 80)
    dmin = _f16(w, r, o + 82)
    q_at = o + 16 + (p >> 2) * 32
    shift = 2 * (p & 3)
    for half in range(2):
        sc = np.int32(w[r, o + 2 * p + half])
        dl = d * np.float32(sc & 15)
        ml = dmin * np.float32(sc >> 4)
        for i in range(16 * half, 16 * half + 16):
            buf[i] = dl * np.float32((np.int32(w[r, q_at + i]) >> shift) & 3) - ml


@cuda.jit(device=True, cache=True)
def _q3_k_scale(w, r, o, j):
    """Signed 6-bit scale of sub-block j from the 12 packed bytes at byte o (Q3_K)."""
    low = np.int32(w[r, o + (j & 7)])
    low = low & 15 if j < 8 else low >> 4
    high = (np.int32(w[r, o + 8 + (j & 3)]) >> (2 * (j >> 2))) & 3
    return (low | (high << 4)) - 32


@cuda.jit(device=True, cache=True)
def _chunk_q3_k(w, r, c, buf):
    """110 B: hmask[32] | qs[64] 2-bit | scales[12] | d. A clear hmask bit means "subtract 4"."""
    o, p = (c >> 3) * 110, c & 7
    d = _f16(w, r, o + 108)
    q_at = o + 32 + (p >> 2) * 32
    shift = 2 * (p & 3)
    for half in range(2):
        dl = d * np.float32(_q3_k_scale(w, r, o + 96, 2 * p + half))
        for i in range(16 * half, 16 * half + 16):
            q = ((np.int32(w[r, q_at + i]) >> shift) & 3) - 4
            q += 4 * ((np.int32(w[r, o + i]) >> p) & 1)
            buf[i] = dl * np.float32(q)


@cuda.jit(device=True, cache=True)
def _chunk_q4_k(w, r, c, buf):
    """144 B: d | dmin | scales[12] | qs[128] 4-bit. Chunk = sub-block j of super-block c >> 3."""
    o, j = (c >> 3) * 144, c & 7
    d = _f16(w, r, o)
    dmin = _f16(w, r, o + 2)
    sc, m = _scale_min_k4(w, r, o + 4, j)
    ds = d * np.float32(sc)
    dm = dmin * np.float32(m)
    q_at = o + 16 + (j >> 1) * 32
    shift = 4 * (j & 1)
    for i in range(32):
        buf[i] = ds * np.float32((np.int32(w[r, q_at + i]) >> shift) & 15) - dm


@cuda.jit(device=True, cache=True)
def _chunk_q5_k(w, r, c, buf):
    """176 B: d | dmin | scales[12] | qh[32] | qs[128] 4-bit; bit 4 of weight i: bit j of qh[i]."""
    o, j = (c >> 3) * 176, c & 7
    d = _f16(w, r, o)
    dmin = _f16(w, r, o + 2)
    sc, m = _scale_min_k4(w, r, o + 4, j)
    ds = d * np.float32(sc)
    dm = dmin * np.float32(m)
    q_at = o + 48 + (j >> 1) * 32
    shift = 4 * (j & 1)
    for i in range(32):
        q = (np.int32(w[r, q_at + i]) >> shift) & 15
        q |= ((np.int32(w[r, o + 16 + i]) >> j) & 1) << 4
        buf[i] = ds * np.float32(q) - dm


@cuda.jit(device=True, cache=True)
def _chunk_q6_k(w, r, c, buf):
    """210 B: ql[128] 4-bit | qh[64] 2-bit | scales int8[16] | d. Chunk = sub-blocks 2p, 2p+1."""
    o, p = (c >> 3) * 210, c & 7
    d = _f16(w, r, o + 208)
    h, k = p >> 2, p & 3
    ql_at = o + h * 64 + (k & 1) * 32
    ql_shift = 4 * (k >> 1)
    qh_at = o + 128 + h * 32
    for half in range(2):
        sc = np.int32(w[r, o + 192 + 2 * p + half])
        dl = d * np.float32(sc - 256 if sc > 127 else sc)
        for i in range(16 * half, 16 * half + 16):
            q = (np.int32(w[r, ql_at + i]) >> ql_shift) & 15
            q |= ((np.int32(w[r, qh_at + i]) >> (2 * k)) & 3) << 4
            buf[i] = dl * np.float32(q - 32)


# ---- I-quants, MXFP4, ternary. IQ4_NL and MXFP4: a chunk is one block; the others have blocks
# of 256 weights, and chunk c is sub-block c & 7 of block c >> 3 ----


@cuda.jit(device=True, cache=True)
def _chunk_iq4_nl(w, r, c, buf):
    """18 B: d f16 | qs[16]; w = d * IQ4NL_LEVELS[q], low nibbles first."""
    levels = IQ4NL_LEVELS
    o = c * 18
    d = _f16(w, r, o)
    for i in range(16):
        q = np.int32(w[r, o + 2 + i])
        buf[i] = d * levels[q & 15]
        buf[i + 16] = d * levels[q >> 4]


@cuda.jit(device=True, cache=True)
def _chunk_iq4_xs(w, r, c, buf):
    """136 B: d f16 | scales_h u16 | scales_l[4] | qs[128]; w = (d * (ls - 32)) * level, the
    6-bit ls of sub-block j: low 4 bits in nibble j % 2 of scales_l[j // 2], high 2 at bit 2j of
    scales_h."""
    levels = IQ4NL_LEVELS
    o, j = (c >> 3) * 136, c & 7
    d = _f16(w, r, o)
    low = (np.int32(w[r, o + 4 + (j >> 1)]) >> (4 * (j & 1))) & 15
    high = (np.int32(_u16(w, r, o + 2)) >> (2 * j)) & 3
    dl = d * np.float32((low | (high << 4)) - 32)
    q_at = o + 8 + 16 * j
    for i in range(16):
        q = np.int32(w[r, q_at + i])
        buf[i] = dl * levels[q & 15]
        buf[i + 16] = dl * levels[q >> 4]


@cuda.jit(device=True, cache=True)
def _chunk_mxfp4(w, r, c, buf):
    """17 B: e u8 | qs[16]; w = 2^(e - 128) * MXFP4_LEVELS[q] (exact: a power of two times a
    small integer), low nibbles first."""
    levels = MXFP4_LEVELS
    o = c * 17
    d = np.float32(math.ldexp(np.float32(1.0), int(np.int32(w[r, o]) - 128)))
    for i in range(16):
        q = np.int32(w[r, o + 1 + i])
        buf[i] = d * levels[q & 15]
        buf[i + 16] = d * levels[q >> 4]


@cuda.jit(device=True, cache=True)
def _ksign(index):
    """ggml's ksigns_iq2xs[index]: 7 stored sign bits, their parity as the 8th."""
    parity = index ^ (index >> 4)
    parity ^= parity >> 2
    parity ^= parity >> 1
    return index | ((parity & 1) << 7)


@cuda.jit(device=True, cache=True)
def _signed(value, signs, t):
    """value * (-1 if bit t of signs else 1): a multiply, as gguf-py does it."""
    return value * (np.float32(-1.0) if (signs >> t) & 1 else np.float32(1.0))


@cuda.jit(device=True, cache=True)
def _chunk_iq3_xxs(w, r, c, buf):
    """98 B: d f16 | qs[64] grid indices | aux u32[8]: per 32 weights 4 x 7 sign bits (ksign)
    and a 4-bit scale s (bits 28-31); w = d * (0.5 + s) * 0.5 * IQ3XXS_GRID level * sign."""
    o, j = (c >> 3) * 98, c & 7
    d = _f16(w, r, o)
    aux = _u32(w, r, o + 66 + 4 * j)
    db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.5)
    for g in range(8):  # 4 weights per grid entry
        entry = np.int32(w[r, o + 2 + 8 * j + g]) * 4
        signs = _ksign(np.int32((aux >> (7 * (g >> 1))) & 127))
        for t in range(4):
            k = 4 * g + t
            buf[k] = _signed(db * np.float32(IQ3XXS_GRID[entry + t]), signs, k & 7)


@cuda.jit(device=True, cache=True)
def _chunk_iq3_s(w, r, c, buf):
    """110 B: d f16 | qs[64] | qh[8] | signs[32] | scales[4]; a 9-bit grid index per 4 weights
    (qs, bit 8 from qh), a sign bit per weight, a 4-bit scale s per 32:
    w = d * (1 + 2 s) * IQ3S_GRID level * sign."""
    o, j = (c >> 3) * 110, c & 7
    d = _f16(w, r, o)
    scale = (np.int32(w[r, o + 106 + (j >> 1)]) >> (4 * (j & 1))) & 15
    db = d * np.float32(1 + 2 * scale)
    qh = np.int32(w[r, o + 66 + j])
    for g in range(8):
        entry = (np.int32(w[r, o + 2 + 8 * j + g]) | (((qh >> g) & 1) << 8)) * 4
        signs = np.int32(w[r, o + 74 + 4 * j + (g >> 1)])
        for t in range(4):
            k = 4 * g + t
            buf[k] = _signed(db * np.float32(IQ3S_GRID[entry + t]), signs, k & 7)


@cuda.jit(device=True, cache=True)
def _chunk_iq2_xxs(w, r, c, buf):
    """66 B: d f16 | per 32 weights: u32 of 4 grid indices, u32 aux of 4 x 7 sign bits (ksign)
    and a 4-bit scale s (bits 28-31); w = d * (0.5 + s) * 0.25 * IQ2XXS_GRID level * sign."""
    o, j = (c >> 3) * 66, c & 7
    d = _f16(w, r, o)
    aux = _u32(w, r, o + 6 + 8 * j)
    db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.25)
    for g in range(4):  # 8 weights per grid entry
        entry = np.int32(w[r, o + 2 + 8 * j + g]) * 8
        signs = _ksign(np.int32((aux >> (7 * g)) & 127))
        for t in range(8):
            buf[8 * g + t] = _signed(db * np.float32(IQ2XXS_GRID[entry + t]), signs, t)


@cuda.jit(device=True, cache=True)
def _chunk_iq2_xs(w, r, c, buf):
    """74 B: d f16 | qs u16[32]: a 9-bit grid index and 7 sign bits (ksign) per 8 weights |
    scales[8]: a 4-bit s per 16; w = d * (0.5 + s) * 0.25 * IQ2XS_GRID level * sign."""
    o, j = (c >> 3) * 74, c & 7
    d = _f16(w, r, o)
    for g in range(4):
        q = np.int32(_u16(w, r, o + 2 + 2 * (4 * j + g)))
        s = (np.int32(w[r, o + 66 + j]) >> (4 * (g >> 1))) & 15
        db = d * (np.float32(0.5) + np.float32(s)) * np.float32(0.25)
        entry = (q & 511) * 8
        signs = _ksign(q >> 9)
        for t in range(8):
            buf[8 * g + t] = _signed(db * np.float32(IQ2XS_GRID[entry + t]), signs, t)


@cuda.jit(device=True, cache=True)
def _chunk_iq2_s(w, r, c, buf):
    """82 B: d f16 | qs[32] | signs[32] | qh[8] | scales[8]; a 10-bit grid index per 8 weights
    (qs, 2 bits of qh), a sign bit per weight, a 4-bit s per 16;
    w = d * (0.5 + s) * 0.25 * IQ2S_GRID level * sign."""
    o, j = (c >> 3) * 82, c & 7
    d = _f16(w, r, o)
    for g in range(4):
        high = (np.int32(w[r, o + 66 + j]) >> (2 * g)) & 3
        entry = (np.int32(w[r, o + 2 + 4 * j + g]) | (high << 8)) * 8
        s = (np.int32(w[r, o + 74 + j]) >> (4 * (g >> 1))) & 15
        db = d * (np.float32(0.5) + np.float32(s)) * np.float32(0.25)
        signs = np.int32(w[r, o + 34 + 4 * j + g])
        for t in range(8):
            buf[8 * g + t] = _signed(db * np.float32(IQ2S_GRID[entry + t]), signs, t)


@cuda.jit(device=True, cache=True)
def _iq1_weights(entry, dl, delta, buf, at):
    """buf[at:at + 8] = dl * (level + delta) for the 8 levels of IQ1_GRID entry `entry`, gguf-py's
    order. IQ1_S and IQ1_M both call this: the 16 KiB grid is named here only."""
    for t in range(8):
        buf[at + t] = dl * (np.float32(IQ1_GRID[8 * entry + t]) + delta)


@cuda.jit(device=True, cache=True)
def _chunk_iq1_s(w, r, c, buf):
    """50 B: d f16 | qs[32] | qh u16[8]: per 32 weights 4 x 3 high index bits, a 3-bit scale s
    (bits 12-14), the delta's sign (bit 15); w = d * (2 s + 1) * (level +- IQ1_DELTA)."""
    o, j = (c >> 3) * 50, c & 7
    d = _f16(w, r, o)
    qh = np.int32(_u16(w, r, o + 34 + 2 * j))
    dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
    delta = -IQ1_DELTA if qh & 0x8000 else IQ1_DELTA
    for g in range(4):
        entry = np.int32(w[r, o + 2 + 4 * j + g]) | (((qh >> (3 * g)) & 7) << 8)
        _iq1_weights(entry, dl, delta, buf, 8 * g)


@cuda.jit(device=True, cache=True)
def _chunk_iq1_m(w, r, c, buf):
    """56 B: qs[32] | qh[16]: per 8 weights a nibble (3 high index bits, the delta's sign) |
    scales u16[4]: a 3-bit s per 16 weights, the f16 d in the top 4 bits of each;
    w = d * (2 s + 1) * (level +- IQ1_DELTA)."""
    o, j = (c >> 3) * 56, c & 7
    bits = (_u16(w, r, o + 48) >> 12) | ((_u16(w, r, o + 50) >> 8) & 0xF0)
    bits |= ((_u16(w, r, o + 52) >> 4) & 0xF00) | (_u16(w, r, o + 54) & 0xF000)
    d = _float_from_bits(bits, 5, 10)
    sc = np.int32(_u16(w, r, o + 48 + 2 * (j >> 1)))  # the scales of sub-blocks j and j ^ 1
    for g in range(4):
        scale = (sc >> (3 * (2 * (j & 1) + (g >> 1)))) & 7
        dl = d * np.float32(2 * scale + 1)
        i = 4 * j + g
        nibble = (np.int32(w[r, o + 32 + (i >> 1)]) >> (4 * (i & 1))) & 15
        entry = np.int32(w[r, o + i]) | ((nibble & 7) << 8)
        delta = -IQ1_DELTA if nibble & 8 else IQ1_DELTA
        _iq1_weights(entry, dl, delta, buf, 8 * g)


@cuda.jit(device=True, cache=True)
def _chunk_tq1_0(w, r, c, buf):
    """54 B: qs[48] | qh[4] 5 and 4 trits per byte | d f16; w = d * (trit - 1), trit k of byte v
    being ((v * 3^k mod 256) * 3) >> 8. Weight n < 160: trit n // 32 of qs[n % 32]; n < 240:
    trit (n - 160) // 16 of qs[32 + n % 16]; else trit (n - 240) // 4 of qh[n % 4]."""
    o, p = (c >> 3) * 54, c & 7
    d = _f16(w, r, o + 52)
    for i in range(32):
        n = 32 * p + i
        if n < 160:
            k, at = n >> 5, o + (n & 31)
        elif n < 240:
            k, at = (n - 160) >> 4, o + 32 + (n & 15)
        else:
            k, at = (n - 240) >> 2, o + 48 + (n & 3)
        power = 1
        for _ in range(k):
            power *= 3
        trit = (((np.int32(w[r, at]) * power) & 255) * 3) >> 8
        buf[i] = d * np.float32(trit - 1)


@cuda.jit(device=True, cache=True)
def _chunk_tq2_0(w, r, c, buf):
    """66 B: qs[64] 2-bit | d f16; w = d * (q - 1), weight 128 h + 32 k + i in bits 2k of
    qs[32 h + i] (as Q2_K's low bits)."""
    o, p = (c >> 3) * 66, c & 7
    d = _f16(w, r, o + 64)
    q_at = o + 32 * (p >> 2)
    shift = 2 * (p & 3)
    for i in range(32):
        buf[i] = d * np.float32(((np.int32(w[r, q_at + i]) >> shift) & 3) - 1)


@cuda.jit(device=True, cache=True)
def dequantize_chunk(w, r, c, n_cols, qtype, buf):
    """buf[0:32] = dequantized weights 32 c .. 32 c + 31 of row r of the raw weight w."""
    if qtype == Q4_0:
        _chunk_q4_0(w, r, c, buf)
    elif qtype == Q4_1:
        _chunk_q4_1(w, r, c, buf)
    elif qtype == Q5_0:
        _chunk_q5_0(w, r, c, buf)
    elif qtype == Q5_1:
        _chunk_q5_1(w, r, c, buf)
    elif qtype == Q8_0:
        _chunk_q8_0(w, r, c, buf)
    elif qtype == Q2_K:
        _chunk_q2_k(w, r, c, buf)
    elif qtype == Q3_K:
        _chunk_q3_k(w, r, c, buf)
    elif qtype == Q4_K:
        _chunk_q4_k(w, r, c, buf)
    elif qtype == Q5_K:
        _chunk_q5_k(w, r, c, buf)
    elif qtype == Q6_K:
        _chunk_q6_k(w, r, c, buf)
    elif qtype == IQ4_NL:
        _chunk_iq4_nl(w, r, c, buf)
    elif qtype == IQ4_XS:
        _chunk_iq4_xs(w, r, c, buf)
    elif qtype == MXFP4:
        _chunk_mxfp4(w, r, c, buf)
    elif qtype == IQ3_XXS:
        _chunk_iq3_xxs(w, r, c, buf)
    elif qtype == IQ3_S:
        _chunk_iq3_s(w, r, c, buf)
    elif qtype == IQ2_XXS:
        _chunk_iq2_xxs(w, r, c, buf)
    elif qtype == IQ2_XS:
        _chunk_iq2_xs(w, r, c, buf)
    elif qtype == IQ2_S:
        _chunk_iq2_s(w, r, c, buf)
    elif qtype == IQ1_S:
        _chunk_iq1_s(w, r, c, buf)
    elif qtype == IQ1_M:
        _chunk_iq1_m(w, r, c, buf)
    elif qtype == TQ1_0:
        _chunk_tq1_0(w, r, c, buf)
    elif qtype == TQ2_0:
        _chunk_tq2_0(w, r, c, buf)
    else:
        _chunk_float(w, r, c, n_cols, qtype, buf)


# ---- reductions ----


@cuda.jit(device=True, cache=True)
def _tree_reduce(partial, n_values, stride, base, lane, n_lanes, take_max):
    """For v < n_values: partial[v * stride + base] = sum (or max) of the n_lanes values from
    there on. partial: dynamic shared float32[n_values * stride], where each thread has written
    its values at v * stride + base + lane; n_lanes is a power of two. Every thread of the block
    must call this (it syncs).
    """
    cuda.syncthreads()
    step = n_lanes // 2
    while step > 0:
        if lane < step:
            for v in range(n_values):
                i = v * stride + base + lane
                a = partial[i]
                b = partial[i + step]
                partial[i] = max(a, b) if take_max else a + b
        cuda.syncthreads()
        step //= 2


# ---- weights ----


@cuda.jit(cache=True)
def matvec(w, qtype, x, out):
    """out[0, r] = dequant(w)[r] . x[0]: one token. w: uint8[n_rows, row_bytes] raw blocks,
    x: float32[1, n_cols], out: float32[1, n_rows].

    Threads: block (lanes, rows): threadIdx.y picks a weight row, its lanes take the row's
    chunks round-robin (lane l: chunks l, l + lanes, ...), so neighbouring lanes read
    neighbouring blocks; the partial dots are then summed in shared memory.
    """
    lane, y = cuda.threadIdx.x, cuda.threadIdx.y
    lanes = cuda.blockDim.x
    r = cuda.blockIdx.x * cuda.blockDim.y + y
    n_rows, n_cols = out.shape[1], x.shape[1]
    partial = cuda.shared.array(0, types.float32)  # float32[lanes * rows per block]
    buf = cuda.local.array(CHUNK, np.float32)
    acc = np.float32(0.0)
    if r < n_rows:  # no early return: every thread must reach the syncthreads below
        for c in range(lane, (n_cols + CHUNK - 1) // CHUNK, lanes):
            dequantize_chunk(w, r, c, n_cols, qtype, buf)
            e = c * CHUNK
            for i in range(min(CHUNK, n_cols - e)):
                acc += buf[i] * x[0, e + i]
    partial[y * lanes + lane] = acc
    _tree_reduce(partial, 1, 0, y * lanes, lane, lanes, False)
    if r < n_rows and lane == 0:
        out[0, r] = partial[y * lanes]


@cuda.jit(cache=True)
def matmul(w, qtype, x, out):
    """out[t, r] = dequant(w)[r] . x[t]. x: float32[n_tokens, n_cols], out: [n_tokens, n_rows].

    Threads: as matvec for the rows (grid x), and grid y over tiles of TOKEN_TILE tokens: each
    lane dequantizes a chunk once and uses it for every token of its tile, so prefill reads each
    weight once per tile instead of once per token.
    """
    lane, y = cuda.threadIdx.x, cuda.threadIdx.y
    lanes = cuda.blockDim.x
    r = cuda.blockIdx.x * cuda.blockDim.y + y
    t0 = cuda.blockIdx.y * TOKEN_TILE
    n_tokens, n_rows = out.shape
    n_cols = x.shape[1]
    n_tile = min(TOKEN_TILE, n_tokens - t0)
    stride = lanes * cuda.blockDim.y  # threads per block
    partial = cuda.shared.array(0, types.float32)  # float32[TOKEN_TILE * stride]
    buf = cuda.local.array(CHUNK, np.float32)
    acc = cuda.local.array(TOKEN_TILE, np.float32)
    for tt in range(TOKEN_TILE):
        acc[tt] = 0.0
    if r < n_rows:
        for c in range(lane, (n_cols + CHUNK - 1) // CHUNK, lanes):
            dequantize_chunk(w, r, c, n_cols, qtype, buf)
            e = c * CHUNK
            n = min(CHUNK, n_cols - e)
            for tt in range(n_tile):
                s = np.float32(0.0)
                for i in range(n):
                    s += buf[i] * x[t0 + tt, e + i]
                acc[tt] += s
    for tt in range(n_tile):
        partial[tt * stride + y * lanes + lane] = acc[tt]
    _tree_reduce(partial, n_tile, stride, y * lanes, lane, lanes, False)
    if r < n_rows and lane == 0:
        for tt in range(n_tile):
            out[t0 + tt, r] = partial[tt * stride + y * lanes]


@cuda.jit(cache=True)
def embed(w, qtype, token_ids, out):
    """out[t] = dequant(w)[token_ids[t]]; token_ids: int64[n_tokens], out: float32[n_tokens, dim].

    Threads: one per (token, 32-weight chunk).
    """
    n_tokens, n_cols = out.shape
    n_chunks = (n_cols + CHUNK - 1) // CHUNK
    job = cuda.grid(1)
    if job >= n_tokens * n_chunks:
        return
    t, c = job // n_chunks, job % n_chunks
    buf = cuda.local.array(CHUNK, np.float32)
    dequantize_chunk(w, token_ids[t], c, n_cols, qtype, buf)
    for i in range(min(CHUNK, n_cols - c * CHUNK)):
        out[t, c * CHUNK + i] = buf[i]


# ---- normalization, RoPE, attention ----


@cuda.jit(cache=True)
def rmsnorm(x, weight, eps, out):
    """out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * weight. x, out: float32[n_rows, dim] (out may
    be x); weight: float32[dim]. Per-head QK-norm is this on [n_tokens * n_heads, head_dim].

    Threads: one block per row; each thread sums the squares of a strided slice of the row.
    """
    row, tid, n_threads = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    dim = x.shape[1]
    partial = cuda.shared.array(0, types.float32)  # float32[n_threads]
    ss = np.float32(0.0)
    for j in range(tid, dim, n_threads):
        ss += x[row, j] * x[row, j]
    partial[tid] = ss
    _tree_reduce(partial, 1, 0, 0, tid, n_threads, False)
    scale = np.float32(1.0) / np.float32(math.sqrt(partial[0] / np.float32(dim) + eps))
    for j in range(tid, dim, n_threads):
        out[row, j] = x[row, j] * scale * weight[j]


@cuda.jit(cache=True)
def layernorm(x, weight, bias, eps, out):
    """out[i] = (x[i] - mean) / sqrt(var + eps) * weight + bias. x, out: float32[n_rows, dim]
    (out may be x); weight, bias: float32[dim]. Threads as rmsnorm: a block per row, the mean
    and then the variance each a strided sum reduced in shared memory."""
    row, tid, n_threads = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    dim = x.shape[1]
    partial = cuda.shared.array(0, types.float32)  # float32[n_threads]
    total = np.float32(0.0)
    for j in range(tid, dim, n_threads):
        total += x[row, j]
    partial[tid] = total
    _tree_reduce(partial, 1, 0, 0, tid, n_threads, False)
    mean = partial[0] / np.float32(dim)
    cuda.syncthreads()  # all have read the sum before partial is reused
    ss = np.float32(0.0)
    for j in range(tid, dim, n_threads):
        d = x[row, j] - mean
        ss += d * d
    partial[tid] = ss
    _tree_reduce(partial, 1, 0, 0, tid, n_threads, False)
    scale = np.float32(1.0) / np.float32(math.sqrt(partial[0] / np.float32(dim) + eps))
    for j in range(tid, dim, n_threads):
        out[row, j] = (x[row, j] - mean) * scale * weight[j] + bias[j]


@cuda.jit(cache=True)
def rope(x, cos, sin, neox):
    """Rotate every head of x: float32[n_tokens, n_heads, head_dim] in place; cos, sin:
    float32[n_tokens, n_pairs]. neox rotates (i, i + n_pairs), else adjacent pairs (2i, 2i + 1).

    Threads: one per (token, head, pair).
    """
    n_tokens, n_heads, _ = x.shape
    n_pairs = cos.shape[1]
    job = cuda.grid(1)
    if job >= n_tokens * n_heads * n_pairs:
        return
    t = job // (n_heads * n_pairs)
    h = (job // n_pairs) % n_heads
    i = job % n_pairs
    if neox:
        a, b = i, i + n_pairs
    else:
        a, b = 2 * i, 2 * i + 1
    x0 = x[t, h, a]
    x1 = x[t, h, b]
    x[t, h, a] = x0 * cos[t, i] - x1 * sin[t, i]
    x[t, h, b] = x0 * sin[t, i] + x1 * cos[t, i]


@cuda.jit(cache=True)
def attention(
    q, k_cache, v_cache, heads_first, start_pos, window, scale, softcap, sinks, scores, out, causal
):
    """Causal attention with grouped K/V heads and an optional sliding window, softmax inside;
    not `causal`, each token attends to all start_pos + n_tokens keys (encoders).

    q, out: float32[n_tokens, n_heads, head_dim] for positions start_pos + t;
    k_cache, v_cache: float32[n_kv_heads, n_ctx, head_dim] if heads_first (a KVPool's page),
    else float32[n_ctx, n_kv_heads, head_dim] (an encoder's K and V), filled up to
    start_pos + n_tokens;
    window > 0: key j is seen from position i only when i - j < window.
    softcap > 0: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2).
    sinks: float32[n_heads] sink logits (gpt-oss), or float32[0]: one more softmax term each.
    scores: float32[>= n_tokens * n_heads, >= start_pos + n_tokens] scratch, one row per job.

    Threads: one block per (head, token) (grid x, y). Its threads split the keys for the scores
    and the softmax sums, then split the head dimensions for the weighted sum of V.
    """
    h, t = cuda.blockIdx.x, cuda.blockIdx.y
    tid, n_threads = cuda.threadIdx.x, cuda.blockDim.x
    n_heads, head_dim = q.shape[1], q.shape[2]
    kv = h // (n_heads // k_cache.shape[0 if heads_first else 1])
    row = t * n_heads + h
    pos = start_pos + t if causal else start_pos + q.shape[0] - 1  # the last key seen
    first = 0
    if window > 0 and pos - window + 1 > 0:
        first = pos - window + 1
    partial = cuda.shared.array(0, types.float32)  # float32[n_threads]

    best = -np.float32(math.inf)
    for j in range(first + tid, pos + 1, n_threads):
        s = np.float32(0.0)
        for d in range(head_dim):
            s += q[t, h, d] * (k_cache[kv, j, d] if heads_first else k_cache[j, kv, d])
        s *= scale
        if softcap > 0:
            s = softcap * np.float32(math.tanh(s * (np.float32(1.0) / softcap)))
        scores[row, j] = s
        best = max(best, s)
    partial[tid] = best
    _tree_reduce(partial, 1, 0, 0, tid, n_threads, True)
    best = partial[0]
    if sinks.shape[0] > 0:
        best = max(best, sinks[h])
    cuda.syncthreads()  # all have read the max before partial is reused

    total = np.float32(0.0)
    for j in range(first + tid, pos + 1, n_threads):
        e = np.float32(math.exp(scores[row, j] - best))
        scores[row, j] = e
        total += e
    partial[tid] = total
    _tree_reduce(partial, 1, 0, 0, tid, n_threads, False)  # its syncs also publish the scores
    total = partial[0]
    if sinks.shape[0] > 0:
        total += np.float32(math.exp(sinks[h] - best))
    inv = np.float32(1.0) / total

    for d in range(tid, head_dim, n_threads):
        acc = np.float32(0.0)
        for j in range(first, pos + 1):
            acc += scores[row, j] * (v_cache[kv, j, d] if heads_first else v_cache[j, kv, d])
        out[t, h, d] = acc * inv


# ---- element-wise: one thread per element of float32[n_tokens, n] ----


@cuda.jit(cache=True)
def add(x, y):
    """x += y, both float32[n_tokens, n]."""
    i = cuda.grid(1)
    n = x.shape[1]
    if i < x.shape[0] * n:
        x[i // n, i % n] += y[i // n, i % n]


@cuda.jit(cache=True)
def add_bias(x, bias):
    """x[t] += bias for every token t. bias: float32[n]."""
    i = cuda.grid(1)
    n = x.shape[1]
    if i < x.shape[0] * n:
        x[i // n, i % n] += bias[i % n]


@cuda.jit(cache=True)
def add_bias_rows(x, biases, ids):
    """x[t] += biases[ids[t]] for every row t. biases: float32[n_experts, n]."""
    i = cuda.grid(1)
    n = x.shape[1]
    if i < x.shape[0] * n:
        x[i // n, i % n] += biases[ids[i // n], i % n]


@cuda.jit(cache=True)
def scale(x, factor):
    """x *= factor."""
    i = cuda.grid(1)
    n = x.shape[1]
    if i < x.shape[0] * n:
        x[i // n, i % n] *= factor


@cuda.jit(cache=True)
def write_rows(page, x, row):
    """page[h, row + t] = x[t, h]: K or V rows x: float32[n, n_kv_heads, head_dim] into a KVPool
    page [n_kv_heads, page_tokens, head_dim] (one thread per element of x)."""
    i = cuda.grid(1)
    n_kv_heads, head_dim = x.shape[1], x.shape[2]
    if i < x.shape[0] * n_kv_heads * head_dim:
        t, h, d = i // (n_kv_heads * head_dim), i // head_dim % n_kv_heads, i % head_dim
        page[h, row + t, d] = x[t, h, d]


@cuda.jit(cache=True)
def gather_rows(out, x, rows):
    """out[t] = x[rows[t]] (one thread per element of out)."""
    i = cuda.grid(1)
    n = out.shape[1]
    if i < out.shape[0] * n:
        out[i // n, i % n] = x[rows[i // n], i % n]


@cuda.jit(cache=True)
def scatter_rows(x, rows, factors, out):
    """out[rows[t]] = x[t] * factors[t] (one thread per element of x; rows are distinct)."""
    i = cuda.grid(1)
    n = x.shape[1]
    if i < x.shape[0] * n:
        t = i // n
        out[rows[t], i % n] = x[t, i % n] * factors[t]


@cuda.jit(cache=True)
def silu_mul(gate, up):
    """gate = silu(gate) * up (SwiGLU)."""
    i = cuda.grid(1)
    n = gate.shape[1]
    if i < gate.shape[0] * n:
        t, j = i // n, i % n
        g = gate[t, j]
        gate[t, j] = g / (np.float32(1.0) + np.float32(math.exp(-g))) * up[t, j]


@cuda.jit(cache=True)
def swiglu_oai_mul(gate, up):
    """gate = min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(up, -7, 7) + 1) (gpt-oss)."""
    i = cuda.grid(1)
    n = gate.shape[1]
    if i < gate.shape[0] * n:
        t, j = i // n, i % n
        x = min(gate[t, j], np.float32(7.0))
        y = min(max(up[t, j], np.float32(-7.0)), np.float32(7.0))
        sig = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(np.float32(-1.702) * x)))
        gate[t, j] = x * sig * (y + np.float32(1.0))


@cuda.jit(cache=True)
def gelu(x):
    """x = gelu_tanh(x) (the encoders' GELU MLP)."""
    i = cuda.grid(1)
    n = x.shape[1]
    if i < x.shape[0] * n:
        t, j = i // n, i % n
        g = x[t, j]
        inner = GELU_C * g * (np.float32(1.0) + np.float32(0.044715) * g * g)
        x[t, j] = np.float32(0.5) * g * (np.float32(1.0) + np.float32(math.tanh(inner)))


@cuda.jit(cache=True)
def gelu_mul(gate, up):
    """gate = gelu_tanh(gate) * up (GeGLU)."""
    i = cuda.grid(1)
    n = gate.shape[1]
    if i < gate.shape[0] * n:
        t, j = i // n, i % n
        g = gate[t, j]
        inner = GELU_C * g * (np.float32(1.0) + np.float32(0.044715) * g * g)
        gelu = np.float32(0.5) * g * (np.float32(1.0) + np.float32(math.tanh(inner)))
        gate[t, j] = gelu * up[t, j]


@cuda.jit(cache=True)
def fill_zero(x):
    """x[:] = 0 for a flat float32[n]."""
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] = 0.0
