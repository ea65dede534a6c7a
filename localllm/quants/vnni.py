"""Integer dot products on AVX-512 VNNI, the way ggml's CPU kernels compute them.

ggml quantizes each activation row to int8 blocks (Q8_0/Q8_1/Q8_K, see activations.py) and
multiplies them with the weight's integer quants, applying the float scales once per block. Here
that is done with `vpdpbusd` (unsigned x signed bytes, four products summed per int32 lane), on
the GGUF blocks exactly as they sit in the memory map: no repacking, no copy.

The row dot products are LLVM IR written with llvmlite and called from Numba as intrinsics
(`_dot_<type>`). One 32-weight chunk at a time:

    u      <32 x u8>   the weight quants as unsigned levels (nibbles, plus high bits)
    x      <32 x i8>   the activation quants of the same 32 columns
    isum   <8 x i32>   vpdpbusd(init, u, x): lane l sums the 4 products of columns 4l..4l+3
    acc    <8 x f32>   += float(isum) * (weight scale * activation scale), per lane

Weights are w = d * (u - o) for the symmetric types (Q4_0: o = 8, Q5_0: 16, Q8_0: 128 after
flipping the sign bit, Q6_K: 32): `init = -o * xl` subtracts o * (sum of the 4 activations) per
lane in integers, from `xl`, computed once per activation row. The asymmetric types (w = d * u + m)
add m * xs per block instead, xs = d_x * sum(q_x) of the block.

Only CPUs with AVX-512 VNNI and VL get these kernels (`AVAILABLE`); the float kernels in
legacy.py/kquants.py are the portable path, and the tests hold the two against each other.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .activations import round_f16


def _host_has_vnni() -> bool:
    features = llvm.get_host_cpu_features()
    return all(features.get(f, False) for f in ("avx512vnni", "avx512vl", "avx512bw", "f16c"))


AVAILABLE = _host_has_vnni()

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_V16I8, _V32I8 = ir.VectorType(_I8, 16), ir.VectorType(_I8, 32)
_V8I32, _V8F32 = ir.VectorType(_I32, 8), ir.VectorType(_F32, 8)


def _splat(vec_type, value):
    return ir.Constant(vec_type, [value] * vec_type.count)


class _Emitter:
    """IR helpers for the dot products of a few rows: pointers to the activation arrays, one
    float accumulator per row (`use_row` picks the one `add_scaled` and `add_min` feed)."""

    def __init__(self, builder, n_rows, xq, xd, xs, xl):
        self.b = builder
        self.xq, self.xd, self.xs, self.xl = xq, xd, xs, xl  # i8*, float*, float*, i32*
        self.accs = [
            cgutils.alloca_once_value(builder, ir.Constant(_V8F32, None)) for _ in range(n_rows)
        ]
        self.accms = [
            cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(n_rows)
        ]
        self.acc, self.accm = self.accs[0], self.accms[0]
        fnty = ir.FunctionType(_V8I32, [_V8I32, _V8I32, _V8I32])
        self.vpdpbusd = cgutils.get_or_insert_function(
            builder.module, fnty, "llvm.x86.avx512.vpdpbusd.256"
        )

    def use_row(self, i):
        self.acc, self.accm = self.accs[i], self.accms[i]

    # -- loads from a weight block (byte offsets) and the activation arrays (chunk index)
    def load(self, base, offset, ty):
        if isinstance(offset, int):
            offset = ir.Constant(ir.IntType(64), offset)
        return self.b.load(self.b.bitcast(self.b.gep(base, [offset]), ty.as_pointer()), align=1)

    def f16(self, block, offset):
        """A half at block + offset as float (put in a zeroed vector first: a scalar half load
        would merge into a live register and chain the blocks together)."""
        h = self.b.insert_element(
            ir.Constant(ir.VectorType(_I16, 8), None),
            self.load(block, offset, _I16),
            ir.Constant(_I32, 0),
        )
        halves = self.b.fpext(
            self.b.bitcast(h, ir.VectorType(ir.HalfType(), 8)), ir.VectorType(_F32, 8)
        )
        return self.b.extract_element(halves, ir.Constant(_I32, 0))

    def byte(self, block, offset):
        """An unsigned byte of the block as i32."""
        return self.b.zext(self.load(block, offset, _I8), _I32)

    def chunk_index(self, c, k):
        return self.b.add(c, ir.Constant(c.type, k))

    def x(self, c):
        return self.load(self.xq, self.b.mul(c, ir.Constant(c.type, 32)), _V32I8)

    def xd_at(self, c):
        return self.b.load(self.b.gep(self.xd, [c]))

    def xs_at(self, c):
        return self.b.load(self.b.gep(self.xs, [c]))

    def offset_init(self, c, o):
        """-o * (per-lane activation sums): the vpdpbusd start that removes the offset o."""
        ptr = self.b.gep(self.xl, [self.b.mul(c, ir.Constant(c.type, 8))])
        lanes = self.b.load(self.b.bitcast(ptr, _V8I32.as_pointer()), align=4)
        return self.b.mul(lanes, _splat(_V8I32, -o))

    # -- vector pieces
    def nibbles(self, v):
        """(low, high) nibbles of a byte vector."""
        return self.b.and_(v, _splat(v.type, 15)), self.b.lshr(v, _splat(v.type, 4))

    def concat(self, lo, hi):
        n = lo.type.count
        mask = ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n)))
        return self.b.shuffle_vector(lo, hi, mask)

    def bits_to_16(self, qh32):
        """i32 whose bit i is bit 4 of weight i -> <32 x i8> of 0 or 16."""
        mask = self.b.bitcast(qh32, ir.VectorType(ir.IntType(1), 32))
        return self.b.select(mask, _splat(_V32I8, 16), ir.Constant(_V32I8, None))

    def dot(self, init, u, x):
        args = [init, self.b.bitcast(u, _V8I32), self.b.bitcast(x, _V8I32)]
        return self.b.call(self.vpdpbusd, args)

    # -- accumulation
    def add_scaled(self, isum, scale):
        """acc += float(isum) * scale (a float, or <8 x f32> per lane)."""
        if not isinstance(scale.type, ir.VectorType):
            scale = self.b.shuffle_vector(
                self.b.insert_element(ir.Constant(_V8F32, None), scale, ir.Constant(_I32, 0)),
                ir.Constant(_V8F32, None),
                ir.Constant(_V8I32, [0] * 8),
            )
        prod = self.b.fmul(self.b.sitofp(isum, _V8F32), scale, flags=("contract",))
        self.b.store(self.b.fadd(self.b.load(self.acc), prod, flags=("contract",)), self.acc)

    def add_min(self, value):
        self.b.store(self.b.fadd(self.b.load(self.accm), value), self.accm)

    def result(self, i):
        acc = self.b.load(self.accs[i])
        parts = [self.b.extract_element(acc, ir.Constant(_I32, k)) for k in range(8)]
        while len(parts) > 1:  # pairwise, as a tree
            parts = [self.b.fadd(parts[k], parts[k + 1]) for k in range(0, len(parts), 2)]
        return self.b.fadd(parts[0], self.b.load(self.accms[i]))


# Software prefetch this far ahead of the bytes being read. The hardware prefetchers alone left a
# weight matrix streaming from DRAM at ~7 GB/s (this project's 2-core VMs); prefetching 8 KiB ahead
# brought it to 25-35 GB/s. A thread reads its rows front to back, and the rows of a group are
# contiguous, so `block + PREFETCH_BYTES` from each row covers the stream ahead without gaps.
PREFETCH_BYTES = 8192


def _dot_intrinsic(type_size, chunks_per_block, emit_block, n_rows):
    """A Numba intrinsic `dot(w, r0, xq, xd, xs, xl, out)`: out[r0 + i] = w[r0 + i] . x for
    i < n_rows, the rows interleaved block by block so that they share the activation loads.

    w: uint8[n_rows, row_bytes] C-contiguous (GGUF blocks); xq: int8[n_cols]; xd, xs:
    float32[n_cols // 32]; xl: int32[n_cols // 4]; out: float32[...]. emit_block(e, block_ptr,
    first_chunk) writes the IR of one block of the current row.
    """

    @intrinsic
    def dot(typingctx, w, r0, xq, xd, xs, xl, out):
        sig = types.void(w, r0, xq, xd, xs, xl, out)

        def codegen(context, builder, signature, args):
            arrays = {
                k: context.make_array(signature.args[k])(context, builder, args[k])
                for k in (0, 2, 3, 4, 5, 6)
            }
            i64 = ir.IntType(64)
            row_bytes = builder.extract_value(arrays[0].shape, 1)
            n_blocks = builder.udiv(row_bytes, ir.Constant(i64, type_size))
            r0 = context.cast(builder, args[1], signature.args[1], types.int64)
            rows = [
                builder.gep(
                    arrays[0].data, [builder.mul(builder.add(r0, ir.Constant(i64, i)), row_bytes)]
                )
                for i in range(n_rows)
            ]
            e = _Emitter(builder, n_rows, *(arrays[k].data for k in (2, 3, 4, 5)))
            prefetch = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]),
                "llvm.prefetch.p0",
            )
            ahead = ir.Constant(i64, PREFETCH_BYTES)
            with cgutils.for_range(builder, n_blocks) as loop:
                offset = builder.mul(loop.index, ir.Constant(i64, type_size))
                first = builder.mul(loop.index, ir.Constant(i64, chunks_per_block))
                for i, row in enumerate(rows):
                    target = builder.gep(row, [builder.add(offset, ahead)])
                    # read, keep in all cache levels, data
                    builder.call(prefetch, [target, *(ir.Constant(_I32, v) for v in (0, 3, 1))])
                    e.use_row(i)
                    emit_block(e, builder.gep(row, [offset]), first)
            for i in range(n_rows):
                target = builder.gep(arrays[6].data, [builder.add(r0, ir.Constant(i64, i))])
                builder.store(e.result(i), target)
            return context.get_dummy_value()

        return sig, codegen

    return dot


# ---- legacy types: one block = one 32-weight chunk


def _q4_0(e, blk, c):
    lo, hi = e.nibbles(e.load(blk, 2, _V16I8))
    isum = e.dot(e.offset_init(c, 8), e.concat(lo, hi), e.x(c))
    e.add_scaled(isum, e.b.fmul(e.f16(blk, 0), e.xd_at(c)))


def _q4_1(e, blk, c):
    lo, hi = e.nibbles(e.load(blk, 4, _V16I8))
    isum = e.dot(ir.Constant(_V8I32, None), e.concat(lo, hi), e.x(c))
    e.add_scaled(isum, e.b.fmul(e.f16(blk, 0), e.xd_at(c)))
    e.add_min(e.b.fmul(e.f16(blk, 2), e.xs_at(c)))


def _q5_0(e, blk, c):
    lo, hi = e.nibbles(e.load(blk, 6, _V16I8))
    u = e.b.or_(e.concat(lo, hi), e.bits_to_16(e.load(blk, 2, _I32)))
    isum = e.dot(e.offset_init(c, 16), u, e.x(c))
    e.add_scaled(isum, e.b.fmul(e.f16(blk, 0), e.xd_at(c)))


def _q5_1(e, blk, c):
    lo, hi = e.nibbles(e.load(blk, 8, _V16I8))
    u = e.b.or_(e.concat(lo, hi), e.bits_to_16(e.load(blk, 4, _I32)))
    isum = e.dot(ir.Constant(_V8I32, None), u, e.x(c))
    e.add_scaled(isum, e.b.fmul(e.f16(blk, 0), e.xd_at(c)))
    e.add_min(e.b.fmul(e.f16(blk, 2), e.xs_at(c)))


def _q8_0(e, blk, c):
    u = e.b.xor(e.load(blk, 2, _V32I8), _splat(_V32I8, 0x80))  # q + 128 as unsigned
    isum = e.dot(e.offset_init(c, 128), u, e.x(c))
    e.add_scaled(isum, e.b.fmul(e.f16(blk, 0), e.xd_at(c)))


# ---- k-quants: 256-weight super-blocks = 8 chunks


def _scale_min_k4(e, blk, j):
    """(scale, min) of sub-block j from the 12 packed bytes at offset 4 (ggml's
    get_scale_min_k4), as float."""
    b, s = e.b, lambda i: e.byte(blk, 4 + i)
    c63, c15 = ir.Constant(_I32, 63), ir.Constant(_I32, 15)
    if j < 4:
        sc, mn = b.and_(s(j), c63), b.and_(s(j + 4), c63)
    else:
        hi_sc = b.shl(b.lshr(s(j - 4), ir.Constant(_I32, 6)), ir.Constant(_I32, 4))
        hi_mn = b.shl(b.lshr(s(j), ir.Constant(_I32, 6)), ir.Constant(_I32, 4))
        sc = b.or_(b.and_(s(j + 4), c15), hi_sc)
        mn = b.or_(b.lshr(s(j + 4), ir.Constant(_I32, 4)), hi_mn)
    return b.uitofp(sc, _F32), b.uitofp(mn, _F32)


def _k_asymmetric(e, blk, c0, quants_at, high_bits_at):
    """Q4_K / Q5_K: w = d * sc * u - dmin * mn per 32-weight sub-block."""
    b = e.b
    d, dmin = e.f16(blk, 0), e.f16(blk, 2)
    qh = e.load(blk, high_bits_at, _V32I8) if high_bits_at else None
    for j in range(4):
        lo, hi = e.nibbles(e.load(blk, quants_at + 32 * j, _V32I8))
        for k, u in ((2 * j, lo), (2 * j + 1, hi)):
            if qh is not None:  # bit k of qh[l] is bit 4 of weight 32k + l
                bit = b.and_(b.lshr(qh, _splat(_V32I8, k)), _splat(_V32I8, 1))
                u = b.or_(u, b.shl(bit, _splat(_V32I8, 4)))
            c = e.chunk_index(c0, k)
            sc, mn = _scale_min_k4(e, blk, k)
            isum = e.dot(ir.Constant(_V8I32, None), u, e.x(c))
            e.add_scaled(isum, b.fmul(b.fmul(d, sc), e.xd_at(c)))
            e.add_min(b.fmul(b.fneg(b.fmul(dmin, mn)), e.xs_at(c)))


def _q4_k(e, blk, c0):
    _k_asymmetric(e, blk, c0, quants_at=16, high_bits_at=0)


def _q5_k(e, blk, c0):
    _k_asymmetric(e, blk, c0, quants_at=48, high_bits_at=16)


def _q6_k(e, blk, c0):
    """ql[128] | qh[64] | scales int8[16] | d f16: w = d * sc * (q - 32), 16-weight scales."""
    b = e.b
    d = e.f16(blk, 208)
    three = _splat(_V32I8, 3)
    for h in range(2):
        ql0, ql1 = e.load(blk, 64 * h, _V32I8), e.load(blk, 64 * h + 32, _V32I8)
        qh = e.load(blk, 128 + 32 * h, _V32I8)
        lo0, hi0 = e.nibbles(ql0)
        lo1, hi1 = e.nibbles(ql1)
        for g, low in enumerate((lo0, lo1, hi0, hi1)):
            top = b.and_(b.lshr(qh, _splat(_V32I8, 2 * g)), three)
            u = b.or_(low, b.shl(top, _splat(_V32I8, 4)))
            c = e.chunk_index(c0, 4 * h + g)
            isum = e.dot(e.offset_init(c, 32), u, e.x(c))
            dx = b.fmul(d, e.xd_at(c))
            scales = ir.Constant(_V8F32, None)
            for half in range(2):
                sc = b.sitofp(e.load(blk, 192 + 8 * h + 2 * g + half, _I8), _F32)
                scales = b.insert_element(scales, b.fmul(dx, sc), ir.Constant(_I32, half))
            lanes = ir.Constant(_V8I32, [0, 0, 0, 0, 1, 1, 1, 1])
            e.add_scaled(isum, b.shuffle_vector(scales, ir.Constant(_V8F32, None), lanes))


ROWS = 4  # rows per call of the wide intrinsics
_dot1_q4_0, _dot4_q4_0 = (_dot_intrinsic(18, 1, _q4_0, n) for n in (1, ROWS))
_dot1_q4_1, _dot4_q4_1 = (_dot_intrinsic(20, 1, _q4_1, n) for n in (1, ROWS))
_dot1_q5_0, _dot4_q5_0 = (_dot_intrinsic(22, 1, _q5_0, n) for n in (1, ROWS))
_dot1_q5_1, _dot4_q5_1 = (_dot_intrinsic(24, 1, _q5_1, n) for n in (1, ROWS))
_dot1_q8_0, _dot4_q8_0 = (_dot_intrinsic(34, 1, _q8_0, n) for n in (1, ROWS))
_dot1_q4_k, _dot4_q4_k = (_dot_intrinsic(144, 8, _q4_k, n) for n in (1, ROWS))
_dot1_q5_k, _dot4_q5_k = (_dot_intrinsic(176, 8, _q5_k, n) for n in (1, ROWS))
_dot1_q6_k, _dot4_q6_k = (_dot_intrinsic(210, 8, _q6_k, n) for n in (1, ROWS))


# ---- activations: int8 quants, per-chunk scales and sums


@njit(cache=True)
def quantize_q8(x, super_block, xq, xd, xs, xl):
    """x: float32[n_tokens, n_cols] -> ggml's Q8_0/Q8_1 (super_block 32) or Q8_K (256) quants.

    xq: int8[n_tokens, n_cols]; per 32-column chunk xd (the scale d), xs (d * sum(q); f16-rounded
    for Q8_1 as ggml stores it): float32[n_tokens, n_cols // 32]; xl: int32[n_tokens, n_cols // 4]
    sums of 4 consecutive quants. The same rounding as activations.round_activations."""
    n_tokens, n_cols = x.shape
    for t in range(n_tokens):
        for s in range(n_cols // super_block):
            lo, hi = s * super_block, (s + 1) * super_block
            amax = np.float32(0.0)
            vmax = np.float32(0.0)
            for j in range(lo, hi):
                if abs(x[t, j]) > amax:
                    amax = abs(x[t, j])
                    vmax = x[t, j]
            if super_block == 32:
                d_raw = amax / np.float32(127.0)
                d = round_f16(d_raw)
                inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            else:
                inv = np.float32(-127.0) / vmax if amax != 0 else np.float32(0.0)
                d = np.float32(1.0) / inv if amax != 0 else np.float32(0.0)
                d_raw = d
            for j in range(lo, hi):
                xq[t, j] = np.int8(min(np.float32(127.0), np.rint(x[t, j] * inv)))
            for c in range(lo // 32, hi // 32):
                total = 0
                for j in range(c * 32, c * 32 + 32):
                    total += np.int32(xq[t, j])
                xd[t, c] = d
                xs[t, c] = round_f16(d_raw * np.float32(total)) if super_block == 32 else d * total
            for i in range(lo // 4, hi // 4):
                xl[t, i] = (
                    np.int32(xq[t, 4 * i])
                    + np.int32(xq[t, 4 * i + 1])
                    + np.int32(xq[t, 4 * i + 2])
                    + np.int32(xq[t, 4 * i + 3])
                )


def activation_buffers(n_tokens: int, n_cols: int) -> tuple:
    """Empty (xq, xd, xs, xl) for quantize_q8."""
    return (
        np.empty((n_tokens, n_cols), np.int8),
        np.empty((n_tokens, n_cols // 32), np.float32),
        np.empty((n_tokens, n_cols // 32), np.float32),
        np.empty((n_tokens, n_cols // 4), np.int32),
    )


# ---- kernels: matvec (one token) and matmul (rows outer, tokens inner: a row stays in L1)

# GGML type id -> the code the kernels below dispatch on, and the activation super-block size
CODES = {2: 0, 3: 1, 6: 2, 7: 3, 8: 4, 12: 5, 13: 6, 14: 7}
SUPER_BLOCK = {2: 32, 3: 32, 6: 32, 7: 32, 8: 32, 12: 256, 13: 256, 14: 256}


@njit(cache=True, inline="always")
def _rows(code, w, r0, n, xq, xd, xs, xl, out):
    """out[r0:r0 + n] = w[r0:r0 + n] . x, n = 1 or ROWS, for the weight type with this code."""
    if n == 1:
        if code == 0:
            _dot1_q4_0(w, r0, xq, xd, xs, xl, out)
        elif code == 1:
            _dot1_q4_1(w, r0, xq, xd, xs, xl, out)
        elif code == 2:
            _dot1_q5_0(w, r0, xq, xd, xs, xl, out)
        elif code == 3:
            _dot1_q5_1(w, r0, xq, xd, xs, xl, out)
        elif code == 4:
            _dot1_q8_0(w, r0, xq, xd, xs, xl, out)
        elif code == 5:
            _dot1_q4_k(w, r0, xq, xd, xs, xl, out)
        elif code == 6:
            _dot1_q5_k(w, r0, xq, xd, xs, xl, out)
        else:
            _dot1_q6_k(w, r0, xq, xd, xs, xl, out)
    elif code == 0:
        _dot4_q4_0(w, r0, xq, xd, xs, xl, out)
    elif code == 1:
        _dot4_q4_1(w, r0, xq, xd, xs, xl, out)
    elif code == 2:
        _dot4_q5_0(w, r0, xq, xd, xs, xl, out)
    elif code == 3:
        _dot4_q5_1(w, r0, xq, xd, xs, xl, out)
    elif code == 4:
        _dot4_q8_0(w, r0, xq, xd, xs, xl, out)
    elif code == 5:
        _dot4_q4_k(w, r0, xq, xd, xs, xl, out)
    elif code == 6:
        _dot4_q5_k(w, r0, xq, xd, xs, xl, out)
    else:
        _dot4_q6_k(w, r0, xq, xd, xs, xl, out)


@njit(parallel=True, cache=True)
def matvec(code, w, xq, xd, xs, xl, out):
    """out[n_rows] = w @ x for one token's quantized activations (xq: int8[n_cols], ...)."""
    n_rows = w.shape[0]
    n_groups = (n_rows + ROWS - 1) // ROWS
    for g in prange(n_groups):
        r0 = g * ROWS
        if r0 + ROWS <= n_rows:
            _rows(code, w, r0, ROWS, xq, xd, xs, xl, out)
        else:
            for r in range(r0, n_rows):
                _rows(code, w, r, 1, xq, xd, xs, xl, out)


@njit(parallel=True, cache=True)
def matmul(code, w, xq, xd, xs, xl, out):
    """out[n_tokens, n_rows] = x @ w.T; xq: int8[n_tokens, n_cols], ..."""
    for r in prange(w.shape[0]):
        for t in range(xq.shape[0]):
            _rows(code, w, r, 1, xq[t], xd[t], xs[t], xl[t], out[t])
