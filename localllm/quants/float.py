"""F32, F16 and BF16 weights, plus the helpers every quant family shares.

Every kernel takes the raw weight as uint8 rows (a view into the memory-mapped GGUF) and
reinterprets the bytes itself, so all 13 types have one signature. The helpers here:

- `load_f16(row, offset)`: an IEEE half at a byte offset, widened to float32 exactly as numpy's
  `astype(np.float32)` does (NaN payloads included). Numba has no float16 on the CPU, so this is
  integer bit work plus one bitcast; it is used for every block scale in legacy and k-quants.
- `matmul_rows(rows, n, x, out, row0)`: the prefill half of every `matmul_*` kernel. Each kernel
  dequantizes a tile of weight rows once (bit-exact, with its own row dequantizer) into a small
  float32 buffer, then this helper multiplies that tile with every token.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

# Rows dequantized together by the matmul kernels: each token's activations are loaded once per
# tile, and a tile of 4 rows x n_cols float32 stays in L1/L2 even for n_cols = 10k.
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
    """Little-endian IEEE half at row[offset:offset+2] as float32, bit-exact with numpy."""
    return f16_to_f32(np.uint32(row[offset]) | (np.uint32(row[offset + 1]) << np.uint32(8)))


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

    rows: float32[TILE_ROWS, n_cols] (dequantized weights), x: float32[n_tokens, n_cols],
    out: float32[n_tokens, n_rows]. Four rows share each load of x[t]; `reassoc` lets LLVM
    vectorize the long dot products (their rounding order is not part of any contract).
    """
    n_tokens, n_cols = x.shape
    for t in range(n_tokens):
        xt = x[t]
        if n == TILE_ROWS:
            r0, r1, r2, r3 = rows[0], rows[1], rows[2], rows[3]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for k in range(n_cols):
                xk = xt[k]
                a0 += r0[k] * xk
                a1 += r1[k] * xk
                a2 += r2[k] * xk
                a3 += r3[k] * xk
            out[t, row0] = a0
            out[t, row0 + 1] = a1
            out[t, row0 + 2] = a2
            out[t, row0 + 3] = a3
        else:
            for r in range(n):
                rr = rows[r]
                acc = np.float32(0.0)
                for k in range(n_cols):
                    acc += rr[k] * xt[k]
                out[t, row0 + r] = acc


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
        row0 = tile * TILE_ROWS
        n = min(TILE_ROWS, n_rows - row0)
        matmul_rows(wf[row0 : row0 + n], n, x, out, row0)


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
