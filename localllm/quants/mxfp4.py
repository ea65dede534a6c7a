"""MXFP4 (ggml type 39): gpt-oss's expert weights, OCP microscaling 4-bit floats.

    MXFP4  17 B: e u8 | qs[16]   w = 2^(e - 128) * KVALUES[q]

KVALUES are the e2m1 values doubled (0, 0.5, 1, ... 6 become 0, 1, 2, ... 12) and the scale is
the E8M0 exponent halved (ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 127) / 2, exact for every e,
the two smallest as subnormals), so each weight is a small integer times a power of two:
exactly what gguf-py's dequantizer computes. Weight i of a block uses the low nibble of byte i
for i < 16 and the high nibble of byte i - 16 otherwise, as Q4_0. ggml's CPU dot product takes
Q8_0 activations.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .float import check_shapes, hide_constant

KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


@njit(cache=True)
def e8m0_half(e):
    """float32 2^(e - 128) for a uint8 exponent byte (ggml_e8m0_to_fp32_half)."""
    return np.float32(math.ldexp(1.0, np.int32(e) - 128))


@njit
def dequantize_row_mxfp4(row, out):
    """MXFP4 row uint8[n_cols // 32 * 17] -> out float32[n_cols]."""
    n16 = hide_constant(16)  # keeps the loop below vectorizable
    for b in range(out.shape[0] // 32):
        o, e = b * 17, b * 32
        d = e8m0_half(row[o])
        for i in range(n16):
            q = row[o + 1 + i]
            out[e + i] = d * KVALUES[q & 15]
            out[e + i + 16] = d * KVALUES[q >> 4]


@njit(parallel=True, cache=True)
def matvec_mxfp4(w, x, out):
    """out[n_rows] = dequant(w)[n_rows, n_cols] @ x[n_cols]."""
    check_shapes(w, x, out, 32, 17)
    n_rows, row_bytes = w.shape
    for r in prange(n_rows):
        wr = w[r]
        acc = np.empty(32, np.float32)  # hoisted out of the loop by Numba: one per thread
        acc[:] = 0.0
        for b in range(row_bytes // 17):
            o, e = b * 17, b * 32
            d = e8m0_half(wr[o])
            for i in range(16):
                q = wr[o + 1 + i]
                acc[i] += d * KVALUES[q & 15] * x[e + i]
                acc[i + 16] += d * KVALUES[q >> 4] * x[e + i + 16]
        out[r] = acc.sum()
