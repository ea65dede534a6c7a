"""F32, F16 and BF16 weights, plus the helpers every quant family shares.

Every kernel takes the raw weight as uint8 rows (a view into the memory-mapped GGUF) and
reinterprets the bytes itself, so all 13 types have one signature. The helpers here:

- `load_f16(row, offset)`, `f16_to_f32(bits)`: an IEEE half widened to float32 exactly as numpy's
  `astype(np.float32)` does (NaN payloads included). Numba has no float16 on the CPU, so this is
  integer bit work plus one bitcast; `load_f16` reads every block scale in legacy and k-quants.
- `hide_constant(n)`: keeps short constant-length loops vectorizable (see there).
- `matmul_rows(rows, n, x, out, row0)`: the prefill half of every `matmul_*` kernel. Each kernel
  dequantizes a tile of weight rows once (bit-exact, with its own row dequantizer) into a small
  float32 buffer, then this helper multiplies that tile with every token.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

# Rows dequantized together by the matmul kernels (`matmul_rows` is written for exactly 4): each
# token's activations are loaded once per tile, and 4 rows x n_cols float32 stay in L2.
TILE_ROWS = 4
# Independent accumulator lanes in the matvec kernels. Without fastmath, LLVM will not vectorize a
# scalar float reduction; accumulating into 32 separate lanes (summed once per row) is
# element-wise work it does vectorize, and keeps the result deterministic.
LANES = 32

_F16_SUBNORMAL_STEP = np.float32(2.0**-24)


@intrinsic
def _bits_to_f32(typingctx, bits):
    """Reinterpret a 32-bit integer as float32 (a register bitcast, no memory round trip)."""
    if isinstance(bits, types.Integer) and bits.bitwidth == 32:

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())

        return types.float32(bits), codegen
    return None


@intrinsic
def hide_constant(typingctx, n):
    """n unchanged, but opaque to LLVM (an empty inline asm), like Rust's `black_box`.

    LLVM fully unrolls a loop with a small constant trip count and then leaves the unrolled
    stores of a row dequantizer scalar; `for i in range(hide_constant(16))` stays a loop, which
    its loop vectorizer handles (measured ~3x faster dequantization).
    """
    if isinstance(n, types.Integer):

        def codegen(context, builder, signature, args):
            value_type = context.get_value_type(signature.args[0])
            asm_type = ir.FunctionType(value_type, [value_type])
            return builder.asm(asm_type, "", "=r,0", [args[0]], side_effect=False)

        return n(n), codegen
    return None


@njit(cache=True)
def f16_to_f32(h):
    """IEEE half bits (an integer < 2**16) as float32, bit-exact with numpy (NaN payloads too).

    Written with selects instead of branches so that loops over F16 weights vectorize.
    """
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    magnitude = h & np.uint32(0x7FFF)
    # normal: rebias the exponent by 127 - 15 = 112; inf/NaN: by 224 more, reaching 255
    rebias = np.uint32(0x38000) if magnitude >= np.uint32(0x7C00) else np.uint32(0x1C000)
    widened = _bits_to_f32(np.uint32(sign | ((magnitude + rebias) << np.uint32(13))))
    # zero / subnormal: mantissa * 2^-24 is exact in float32
    small = np.float32(magnitude) * _F16_SUBNORMAL_STEP
    small = -small if sign else small
    return small if magnitude < np.uint32(0x400) else widened


@njit(cache=True)
def load_f16(row, offset):
    """Little-endian IEEE half at row[offset:offset+2] as float32, bit-exact with numpy.

    The same result as `f16_to_f32`, with branches: for one scale per block (always normal in
    practice, so perfectly predicted) this is ~10% faster than computing every case.
    """
    h = np.uint32(row[offset]) | (np.uint32(row[offset + 1]) << np.uint32(8))
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    magnitude = h & np.uint32(0x7FFF)
    if magnitude >= np.uint32(0x400):  # normal (+112 to the exponent), inf/NaN (+224 more)
        rebias = np.uint32(0x38000) if magnitude >= np.uint32(0x7C00) else np.uint32(0x1C000)
        return _bits_to_f32(np.uint32(sign | ((magnitude + rebias) << np.uint32(13))))
    small = np.float32(magnitude) * _F16_SUBNORMAL_STEP
    return -small if sign else small


@njit(cache=True)
def bf16_to_f32(h):
    """bfloat16 bits (an integer < 2**16) as float32: they are the top half of a float32."""
    return _bits_to_f32(np.uint32(np.uint32(h) << np.uint32(16)))


@njit(cache=True)
def check_shapes(w, x, out, block_size, type_size):
    """Raise unless w: uint8[n_rows, row_bytes], x: [..., n_cols], out: [..., n_rows] agree.

    The kernels do no bounds checking, so a shape slip would read or write past the arrays.
    """
    n_rows, row_bytes = w.shape
    if row_bytes % type_size != 0:
        raise ValueError("weight row bytes are not a whole number of blocks")
    n_cols = row_bytes // type_size * block_size
    if x.shape[-1] != n_cols or out.shape[-1] != n_rows:
        raise ValueError("x must have n_cols and out n_rows in the last dimension")
    if x.ndim == 2 and x.shape[0] != out.shape[0]:
        raise ValueError("x and out must have the same number of tokens")


@njit(cache=True, fastmath={"reassoc", "contract"})
def matmul_rows(rows, n, x, out, row0):
    """out[t, row0 + r] = rows[r] . x[t] for r < n and every token t.

    rows: float32[>= n, n_cols] (dequantized weights), x: float32[n_tokens, n_cols],
    out: float32[n_tokens, n_rows]. A full tile of 4 rows is multiplied with 4 tokens at a time:
    16 accumulators, so each loaded weight and activation feeds 4 multiply-adds (measured ~1.8x
    faster than 4 rows x 1 token). `reassoc` lets LLVM vectorize these dot products; their
    rounding order is not part of any contract.
    """
    n_tokens, n_cols = x.shape
    t = 0
    if n == 4:
        w0, w1, w2, w3 = rows[0], rows[1], rows[2], rows[3]
        while t + 4 <= n_tokens:
            x0, x1, x2, x3 = x[t], x[t + 1], x[t + 2], x[t + 3]
            a00 = a01 = a02 = a03 = np.float32(0.0)
            a10 = a11 = a12 = a13 = np.float32(0.0)
            a20 = a21 = a22 = a23 = np.float32(0.0)
            a30 = a31 = a32 = a33 = np.float32(0.0)
            for k in range(n_cols):
                v0, v1, v2, v3 = x0[k], x1[k], x2[k], x3[k]
                a00 += w0[k] * v0
                a01 += w0[k] * v1
                a02 += w0[k] * v2
                a03 += w0[k] * v3
                a10 += w1[k] * v0
                a11 += w1[k] * v1
                a12 += w1[k] * v2
                a13 += w1[k] * v3
                a20 += w2[k] * v0
                a21 += w2[k] * v1
                a22 += w2[k] * v2
                a23 += w2[k] * v3
                a30 += w3[k] * v0
                a31 += w3[k] * v1
                a32 += w3[k] * v2
                a33 += w3[k] * v3
            out[t, row0 : row0 + 4] = (a00, a10, a20, a30)
            out[t + 1, row0 : row0 + 4] = (a01, a11, a21, a31)
            out[t + 2, row0 : row0 + 4] = (a02, a12, a22, a32)
            out[t + 3, row0 : row0 + 4] = (a03, a13, a23, a33)
            t += 4
    for token in range(t, n_tokens):  # leftover tokens, or a last tile of fewer than 4 rows
        xt = x[token]
        for r in range(n):
            wr = rows[r]
            acc = np.float32(0.0)
            for k in range(n_cols):
                acc += wr[k] * xt[k]
            out[token, row0 + r] = acc


# ---- row dequantizers: raw row uint8[row_bytes] -> out float32[n_cols] ----


@njit(cache=True)
def dequantize_row_f16(row, out):
    """F16 row uint8[2 * n_cols] -> out float32[n_cols], bit-exact with numpy's astype."""
    halves = row.view(np.uint16)
    for i in range(out.shape[0]):
        out[i] = f16_to_f32(halves[i])


@njit(cache=True)
def dequantize_row_bf16(row, out):
    """BF16 row uint8[2 * n_cols] -> out float32[n_cols]."""
    halves = row.view(np.uint16)
    for i in range(out.shape[0]):
        out[i] = bf16_to_f32(halves[i])


# ---- F32 ----


@njit(cache=True)
def dequantize_f32(raw):
    """uint8[n_rows, 4 * n_cols] -> float32[n_rows, n_cols] (a copy of the bytes as float32)."""
    return raw.view(np.float32).copy()


@njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def matvec_f32(w, x, out):
    """out[n_rows] = w[n_rows, n_cols] @ x[n_cols], w given as raw float32 bytes."""
    check_shapes(w, x, out, 1, 4)
    wf = w.view(np.float32)  # float32[n_rows, n_cols]
    n_rows, n_cols = wf.shape
    for r in prange(n_rows):
        wr = wf[r]
        acc = np.float32(0.0)
        for k in range(n_cols):
            acc += wr[k] * x[k]
        out[r] = acc


@njit(parallel=True, cache=True)
def matmul_f32(w, x, out):
    """out[n_tokens, n_rows] = x[n_tokens, n_cols] @ w[n_rows, n_cols].T, w as float32 bytes."""
    check_shapes(w, x, out, 1, 4)
    wf = w.view(np.float32)  # float32[n_rows, n_cols]
    n_rows = wf.shape[0]
    for tile in prange((n_rows + TILE_ROWS - 1) // TILE_ROWS):
        # copied into the same writable tile the other types use: one compiled matmul_rows
        rows = np.empty((TILE_ROWS, x.shape[1]), np.float32)  # hoisted: one per thread
        row0 = tile * TILE_ROWS
        n = min(TILE_ROWS, n_rows - row0)
        for r in range(n):
            for k in range(wf.shape[1]):
                rows[r, k] = wf[row0 + r, k]
        matmul_rows(rows, n, x, out, row0)


# ---- F16 and BF16: same shape, different widening ----


@njit(cache=True)
def dequantize_f16(raw):
    """uint8[n_rows, 2 * n_cols] -> float32[n_rows, n_cols]."""
    out = np.empty((raw.shape[0], raw.shape[1] // 2), np.float32)
    for r in range(raw.shape[0]):
        dequantize_row_f16(raw[r], out[r])
    return out


@njit(parallel=True, cache=True)
def matvec_f16(w, x, out):
    """out[n_rows] = w[n_rows, n_cols] @ x[n_cols], w as raw F16 bytes."""
    check_shapes(w, x, out, 1, 2)
    w16 = w.view(np.uint16)  # uint16[n_rows, n_cols]
    n_rows, n_cols = w16.shape
    n_main = n_cols - n_cols % LANES
    for r in prange(n_rows):
        wr = w16[r]
        acc = np.empty(LANES, np.float32)  # hoisted out of the loop by Numba: one per thread
        acc[:] = 0.0
        for chunk in range(n_cols // LANES):
            k0 = chunk * LANES
            for lane in range(LANES):
                acc[lane] += f16_to_f32(wr[k0 + lane]) * x[k0 + lane]
        total = np.float32(0.0)
        for k in range(n_main, n_cols):
            total += f16_to_f32(wr[k]) * x[k]
        out[r] = total + acc.sum()


@njit(parallel=True, cache=True)
def matmul_f16(w, x, out):
    """out[n_tokens, n_rows] = x[n_tokens, n_cols] @ w.T, w as raw F16 bytes."""
    check_shapes(w, x, out, 1, 2)
    n_rows = w.shape[0]
    for tile in prange((n_rows + TILE_ROWS - 1) // TILE_ROWS):
        rows = np.empty((TILE_ROWS, x.shape[1]), np.float32)  # hoisted: one per thread
        row0 = tile * TILE_ROWS
        n = min(TILE_ROWS, n_rows - row0)
        for r in range(n):
            dequantize_row_f16(w[row0 + r], rows[r])
        matmul_rows(rows, n, x, out, row0)


@njit(cache=True)
def dequantize_bf16(raw):
    """uint8[n_rows, 2 * n_cols] -> float32[n_rows, n_cols]."""
    out = np.empty((raw.shape[0], raw.shape[1] // 2), np.float32)
    for r in range(raw.shape[0]):
        dequantize_row_bf16(raw[r], out[r])
    return out


@njit(parallel=True, cache=True)
def matvec_bf16(w, x, out):
    """out[n_rows] = w[n_rows, n_cols] @ x[n_cols], w as raw BF16 bytes."""
    check_shapes(w, x, out, 1, 2)
    w16 = w.view(np.uint16)  # uint16[n_rows, n_cols]
    n_rows, n_cols = w16.shape
    n_main = n_cols - n_cols % LANES
    for r in prange(n_rows):
        wr = w16[r]
        acc = np.empty(LANES, np.float32)  # hoisted: one per thread
        acc[:] = 0.0
        for chunk in range(n_cols // LANES):
            k0 = chunk * LANES
            for lane in range(LANES):
                acc[lane] += bf16_to_f32(wr[k0 + lane]) * x[k0 + lane]
        total = np.float32(0.0)
        for k in range(n_main, n_cols):
            total += bf16_to_f32(wr[k]) * x[k]
        out[r] = total + acc.sum()


@njit(parallel=True, cache=True)
def matmul_bf16(w, x, out):
    """out[n_tokens, n_rows] = x[n_tokens, n_cols] @ w.T, w as raw BF16 bytes."""
    check_shapes(w, x, out, 1, 2)
    n_rows = w.shape[0]
    for tile in prange((n_rows + TILE_ROWS - 1) // TILE_ROWS):
        rows = np.empty((TILE_ROWS, x.shape[1]), np.float32)  # hoisted: one per thread
        row0 = tile * TILE_ROWS
        n = min(TILE_ROWS, n_rows - row0)
        for r in range(n):
            dequantize_row_bf16(w[row0 + r], rows[r])
        matmul_rows(rows, n, x, out, row0)
