"""F32, F16 and BF16 weights, plus the helpers every quant family shares.

Every kernel takes the raw weight as uint8 rows (a view into the memory-mapped GGUF) and
reinterprets the bytes itself, so all types have one signature. The helpers here:

- `load_f16(row, offset)`, `f16_to_f32(bits)`: an IEEE half widened to float32 exactly as numpy's
  `astype(np.float32)` does (NaN payloads included). Numba has no float16 on the CPU, so this is
  integer bit work plus one bitcast; `load_f16` reads every block scale in legacy and k-quants.
- `hide_constant(n)`: keeps short constant-length loops vectorizable (see there).
- `check_shapes(w, x, out, block_size, type_size)`: the guard every matvec/matmul starts with.

Row dequantizers here and in the other families are not cached on disk: the kernels made from
them (kernels.py) are, and compile them from the current source (see kernels.py).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

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


# ---- row dequantizers: raw row uint8[row_bytes] -> out float32[n_cols] ----


@njit
def dequantize_row_f32(row, out):
    """F32 row uint8[4 * n_cols] -> out float32[n_cols] (the bytes as float32)."""
    values = row.view(np.float32)
    for i in range(out.shape[0]):
        out[i] = values[i]


@njit
def dequantize_row_f16(row, out):
    """F16 row uint8[2 * n_cols] -> out float32[n_cols], bit-exact with numpy's astype."""
    halves = row.view(np.uint16)
    for i in range(out.shape[0]):
        out[i] = f16_to_f32(halves[i])


@njit
def dequantize_row_bf16(row, out):
    """BF16 row uint8[2 * n_cols] -> out float32[n_cols]."""
    halves = row.view(np.uint16)
    for i in range(out.shape[0]):
        out[i] = bf16_to_f32(halves[i])


# ---- matvec kernels: out[n_rows] = w[n_rows, n_cols] @ x[n_cols] ----


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


def _matvec_halves(bf16: bool, name: str):
    """The matvec kernel for raw F16 (bf16 False) or BF16 weights: the same loop, widened with
    f16_to_f32 or bf16_to_f32 (a constant branch, folded away when compiled)."""

    def matvec(w, x, out):
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
                    h = wr[k0 + lane]
                    acc[lane] += (bf16_to_f32(h) if bf16 else f16_to_f32(h)) * x[k0 + lane]
            total = np.float32(0.0)
            for k in range(n_main, n_cols):
                total += (bf16_to_f32(wr[k]) if bf16 else f16_to_f32(wr[k])) * x[k]
            out[r] = total + acc.sum()

    matvec.__name__ = matvec.__qualname__ = name  # Numba's cache files are named after it
    return njit(parallel=True, cache=True)(matvec)


matvec_f16 = _matvec_halves(False, "matvec_f16")
matvec_bf16 = _matvec_halves(True, "matvec_bf16")
