"""The kernels every weight type gets from its row dequantizer, made by a factory from its record.

    dequantize_kernel(qt)   # (raw: uint8[n_rows, row_bytes]) -> float32[n_rows, n_cols]
    matmul_kernel(qt)       # (w, x: float32[n_tokens, n_cols], out: float32[n_tokens, n_rows])

A matmul dequantizes a tile of weight rows once (bit-exact, with the type's row dequantizer)
into a small float32 buffer, then `matmul_rows` multiplies that tile with every token.

Each kernel is one Numba function per type: the type id is a constant inside, and
`dequantize_row(ggml_type, row, out)` resolves it at compile time to the row dequantizer its
record names, so each kernel holds only its own type's code. Two things keep Numba's on-disk
cache right for kernels made here from functions defined elsewhere:

- The row dequantizer is reached through the type id, never held in the closure: Numba keys
  its cache on the closure's contents, and a compiled function pickles with a fresh id in every
  process, so such a kernel would never be found in the cache again.
- Numba notices only edits to the file that defines a kernel (this one), not to the functions
  it calls. So every kernel made here (and in intdot.py) carries SOURCE_KEY, a hash of the
  source of every file of this package, in its closure: an edit anywhere in localllm/quants
  gives new cache keys and a fresh compile. The row dequantizers themselves are not cached on
  disk, so they are compiled from the current source whenever a kernel is.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .float import check_shapes

if TYPE_CHECKING:
    from . import QuantType

# A hash of this package's source (see the module docstring); 60 bits, so an int64 constant.
SOURCE_KEY = int(
    hashlib.sha256(
        b"".join(path.read_bytes() for path in sorted(Path(__file__).parent.glob("*.py")))
    ).hexdigest()[:15],
    16,
)

# Rows dequantized together by the matmul kernels (`matmul_rows` is written for exactly 4): each
# token's activations are loaded once per tile, and 4 rows x n_cols float32 stay in L2.
TILE_ROWS = 4


@njit(cache=True)
def depends_on(source_key):
    """Nothing, at run time. A factory-made kernel calls it with SOURCE_KEY from its closure, so
    that the key is part of the closure and so of the kernel's cache key."""


def dequantize_row(ggml_type, row, out):
    """Dequantize one raw row with the row dequantizer of ggml_type's record (a compile-time
    constant): row uint8[row_bytes] -> out float32[n_cols]. Only callable from Numba code."""
    raise NotImplementedError("dequantize_row is resolved by Numba at compile time")


@overload(dequantize_row, prefer_literal=True)
def _dequantize_row(ggml_type, row, out):
    if not isinstance(ggml_type, types.IntegerLiteral):
        return None
    from . import QUANT_TYPES  # the registry imports this module

    row_dequantizer = QUANT_TYPES[ggml_type.literal_value].dequantize_row

    def impl(ggml_type, row, out):
        row_dequantizer(row, out)

    return impl


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


def _named(kernel, name: str):
    """kernel, renamed: Numba names its cache files after __qualname__, one set per type."""
    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def dequantize_kernel(qt: QuantType):
    """(raw: uint8[n_rows, row_bytes]) -> float32[n_rows, n_cols], row by row, for qt's type."""
    ggml_type, block_size, type_size = qt.ggml_type, qt.block_size, qt.type_size
    source_key = SOURCE_KEY

    def dequantize(raw):
        depends_on(source_key)
        out = np.empty((raw.shape[0], raw.shape[1] // type_size * block_size), np.float32)
        for r in range(raw.shape[0]):
            dequantize_row(ggml_type, raw[r], out[r])
        return out

    return njit(cache=True)(_named(dequantize, f"dequantize_{qt.name.lower()}"))


def matmul_kernel(qt: QuantType):
    """(w, x, out): out[n_tokens, n_rows] = x[n_tokens, n_cols] @ dequant(w).T for qt's type,
    one tile of TILE_ROWS rows at a time."""
    ggml_type, block_size, type_size = qt.ggml_type, qt.block_size, qt.type_size
    source_key = SOURCE_KEY

    def matmul(w, x, out):
        depends_on(source_key)
        check_shapes(w, x, out, block_size, type_size)
        n_rows = w.shape[0]
        for tile in prange((n_rows + TILE_ROWS - 1) // TILE_ROWS):
            rows = np.empty((TILE_ROWS, x.shape[1]), np.float32)  # hoisted: one per thread
            row0 = tile * TILE_ROWS
            n = min(TILE_ROWS, n_rows - row0)
            for r in range(n):
                dequantize_row(ggml_type, w[row0 + r], rows[r])
            matmul_rows(rows, n, x, out, row0)

    return njit(parallel=True, cache=True)(_named(matmul, f"matmul_{qt.name.lower()}"))
