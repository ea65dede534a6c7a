"""Integer dot products on x86 SIMD (AVX-512 VNNI, AVX-VNNI or AVX2), as ggml's CPU kernels do:
the matvec tiles, weights in the SIMD lanes (decode, and small batches where gemm.py's tiles
would leave lanes empty).

ggml quantizes each activation row to int8 blocks (Q8_0/Q8_1/Q8_K, see activations.py) and
multiplies them with the weight's integer quants, applying the float scales once per block. Here
that is done with `vpdpbusd` (unsigned x signed bytes, four products summed per int32 lane), on
the GGUF blocks exactly as they sit in the memory map: no repacking, no copy.

    qt = get_quant_type(ggml_type)                # its record names the block reader
    quantize_q8(x, Q8_BLOCK_SIZE[qt.vec_dot_type], *xq)  # xq = activation_buffers(1, n_cols)
    qt.int_matvec((w,), *xq, (out,))              # w: uint8[n_rows, row_bytes], out: [1, n_rows]

The dot products are LLVM IR written with llvmlite and called from Numba as an intrinsic
(`_rows`), four weight rows at a time so that they share the activation loads (a token alone of
the types whose record says one_row: a row at a time, see matvec_kernel), with a software
prefetch ahead of the weight stream. One 32-weight chunk (blocks.py's Chunk) at a time:

    u      <32 x u8>   the weight's levels (nibbles, plus high bits, or grid entries)
    x      <32 x i8>   the activation quants of the same 32 columns
    isum   <8 x i32>   vpdpbusd(init, u, x): lane l sums the 4 products of columns 4l..4l+3
    iacc   <8 x i32>   += isum * scale, to the block's end

An offset o (w = u - o) is subtracted through `init = -o * xl`, the activations' sums of 4
computed once per token (for several rows' unscaled chunks, once for all rows at the block's
end: see accumulate). At the block's end the lanes are added into the block's exact integer
sum S, and the float steps of blocks.py follow, one accumulator per row and token (the rows'
in one vector, each lane the arithmetic gemm.py's tiles do per lane), so a token's result does
not depend on the kernel or the tile it is in. The sums go by transposing adds (vphaddd): a
super-block's S and M of the 4 rows at once, 32-weight blocks (Q8_0 ...) 8 of a row at once.

`INSTRUCTION_SET` (cpu.py) is "vnni" (vpdpbusd), "avx2" (vpmaddubsw + vpmaddwd, with ggml's sign
trick for Q8_0's full int8 range), or None, where `AVAILABLE` is False and the float kernels in
legacy.py/kquants.py run instead (any CPU Numba supports). The tests run all three, the first
two against a float64 reference and the float kernels, by compiling for older targets (each
where this CPU can execute it).
"""

from __future__ import annotations

from typing import NamedTuple

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .activations import q8_scale, round_f16
from .blocks import (
    F32,
    I8,
    I32,
    I64,
    SIGNED,
    V8I32,
    V32I8,
    BlockEnd,
    BlockReader,
    ScalePair,
    Signs,
    halves,
    splat,
)
from .cpu import EVEX_VNNI, INSTRUCTION_SET, TILE_LANES, choose_instruction_set, host_features
from .kernels import SOURCE_KEY, depends_on

__all__ = ["INSTRUCTION_SET", "AVAILABLE", "choose_instruction_set", "host_features"]

AVAILABLE = INSTRUCTION_SET is not None
llvm.initialize_native_asmparser()  # the inline vpdpwssd (_Emitter.scaled_pairs) is assembled
ZMM = TILE_LANES == 16  # 512-bit registers usable (Layout.paired)
_V16I32 = ir.VectorType(I32, 16)


def reduce_add(e, v):
    """The sum of an integer vector's lanes (exact)."""
    return e.intrinsic(f"llvm.vector.reduce.add.v{v.type.count}i32", I32, v)


def phadd(e, u, v):
    """vphaddd of two <8 x i32>: [u0+u1, u2+u3, v0+v1, v2+v3, u4+u5, u6+u7, v4+v5, v6+v7]."""
    return e.intrinsic("llvm.x86.avx2.phadd.d", V8I32, u, v)


def sums_of_8(e, vectors):
    """<8 x i32>: lane k the sum of the lanes of vectors[k] (8 <8 x i32>), exact: vphaddd per
    128-bit half (pairs, then quads; u0 holds vectors 0-3, u1 vectors 4-7, each half of their
    lanes), then the halves added. A transposing add: a sixth of 8 reduce_adds' instructions."""
    b = e.b
    pairs = [phadd(e, vectors[2 * k], vectors[2 * k + 1]) for k in range(4)]
    u0, u1 = phadd(e, pairs[0], pairs[1]), phadd(e, pairs[2], pairs[3])
    low = b.shuffle_vector(u0, u1, ir.Constant(V8I32, [0, 1, 2, 3, 8, 9, 10, 11]))
    high = b.shuffle_vector(u0, u1, ir.Constant(V8I32, [4, 5, 6, 7, 12, 13, 14, 15]))
    return b.add(low, high)


def lane_totals(e, vectors):
    """<8 x i32>: lane j the sum of the lanes of vectors[j] (at most 8 <8 x i32>; the lanes past
    them 0), exact: sums_of_8 with zeros."""
    assert len(vectors) <= 8, "at most 8 blocks of a row, or 4 rows (ROWS) with their mins"
    return sums_of_8(e, vectors + [ir.Constant(V8I32, None)] * (8 - len(vectors)))


def _half_bits(value):
    """The i16 bits of a half that `value` converts to float (blocks.py's f16), or None."""
    if isinstance(value, ir.CastInstr) and value.opname == "fpext":
        half = value.operands[0]
        if isinstance(half, ir.CastInstr) and half.opname == "bitcast":
            return half.operands[0]
    return None


def fma(e, a, b, c):
    """a * b + c with one rounding, in every kernel alike (never left to LLVM's contraction)."""
    name = "llvm.fma.f32" if a.type == F32 else f"llvm.fma.v{a.type.count}f32"
    return e.intrinsic(name, a.type, a, b, c)


def float_steps(e, acc, total, end, dx, sums, xs):
    """blocks.py's float steps of one block: acc (f32 or a vector over tokens), the block's
    integer sum `total` (i32 or vector, as acc), its BlockEnd, the activation scale dx (as acc),
    `sums`: (mins) -> their integer sum M, called only if the block has mins, and xs (as acc, or
    None unless the block has fmin). Both kernel kinds call this, so that it is one sequence of
    operations; a scalar d or mins factor is broadcast to acc's lanes."""
    b = e.b

    def like_acc(v):
        if v.type == acc.type:
            return v
        one = b.insert_element(ir.Constant(acc.type, None), v, ir.Constant(I32, 0))
        lanes = ir.VectorType(I32, acc.type.count)
        return b.shuffle_vector(one, ir.Constant(acc.type, None), ir.Constant(lanes, None))

    acc = fma(e, b.sitofp(total, acc.type), b.fmul(like_acc(end.d), dx), acc)
    if end.mins is not None:
        acc = fma(e, b.sitofp(sums(end.mins), acc.type), b.fmul(like_acc(end.dmin), dx), acc)
    if end.fmin is not None:
        acc = fma(e, like_acc(end.fmin), xs, acc)
    return acc


class _SlotScale(NamedTuple):
    """A chunk's scale read from memory: the k-th i32 of `slot` (a stack slot of the block's
    scales, each in both 16-bit halves), broadcast by the instruction that multiplies by it."""

    slot: ir.Value
    k: int


class _Emitter(BlockReader):
    """The dot products of a few weight rows with one token's activations: a block reader's
    chunks in, one float per row out (`result`)."""

    def __init__(self, builder, n_rows, xq, xd, xs, xl, xb, deferred, layout):
        super().__init__(builder)
        self.narrow = layout.narrow  # scaled chunks' lane sums fit int16
        self.short_scales = layout.short_scales  # and their scales need no mask
        self.paired = ZMM and layout.paired  # and go two to a zmm
        self.xq, self.xd, self.xs, self.xl, self.xb = xq, xd, xs, xl, xb  # i8*, f32*, f32*, i32*
        self.iacc = [cgutils.alloca_once_value(builder, ir.Constant(V8I32, None))
                     for _ in range(n_rows)]  # fmt: skip
        # a second accumulator for every other chunk of scales from memory: two chains of
        # vpdpwssd (latency 5) a block, not one
        self.iacc_odd = [cgutils.alloca_once_value(builder, ir.Constant(V8I32, None))
                         for _ in range(n_rows)]  # fmt: skip
        self.odd = [False] * n_rows
        rows_type = ir.VectorType(F32, n_rows)  # the rows' float accumulators
        self.acc = cgutils.alloca_once_value(builder, ir.Constant(rows_type, None))
        builder.store(ir.Constant(rows_type, [0.0] * n_rows), self.acc)
        if ZMM:  # pairs of chunks: their sums, and a chunk waiting for its pair
            self.iacc16 = [cgutils.alloca_once_value(builder, ir.Constant(_V16I32, None))
                           for _ in range(n_rows)]  # fmt: skip
            self.held = [None] * n_rows
        # blocks ended: (lanes, BlockEnd) each, until flush (32-weight blocks: up to 8 a row)
        self.deferred = deferred
        self.pending = [[] for _ in range(n_rows)]
        self.scaled = [[] for _ in range(n_rows)]  # wide chunk sums and their i32 scales
        self.offsets = [[] for _ in range(n_rows)]  # unscaled chunks' offset terms (init)

    def take(self, row, item):
        if isinstance(item, BlockEnd):
            self.end_block(row, item)
        elif ZMM and item.u.type.count == 64:
            self.accumulate(row, item)
        else:
            for chunk in halves(self, item):
                self.accumulate(row, chunk)

    def dot(self, init, u, x):
        """init + (per lane of 4 bytes: the sum of u * x), u <32 x u8> (< 128 for avx2, which
        adds pairs in saturating int16), x <32 x i8> (> -128); or, paired, <16 x i32> init and
        <64 x i8> u and x: two chunks in one zmm."""
        b = self.b
        n = init.type.count
        if INSTRUCTION_SET == "vnni":
            vec = ir.VectorType(I32, n)
            args = [b.bitcast(v, vec) for v in (init, u, x)]
            return self.intrinsic(f"llvm.x86.avx512.vpdpbusd.{32 * n}", vec, *args)
        u, x = b.bitcast(u, V32I8), b.bitcast(x, V32I8)
        pairs = self.intrinsic("llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(ir.IntType(16), 16), u, x)
        ones = splat(ir.VectorType(ir.IntType(16), 16), 1)
        return b.add(init, self.intrinsic("llvm.x86.avx2.pmadd.wd", V8I32, pairs, ones))

    def lane_sums(self, c, lanes_type=V8I32):
        """<8 x i32> (or <16 x i32>): the sums of the 4 activation quants of each lane of chunk c
        (and c + 1)."""
        lanes = self.b.gep(self.xl, [self.b.mul(c, ir.Constant(c.type, 8))])
        return self.b.load(self.b.bitcast(lanes, lanes_type.as_pointer()), align=4)

    def operands(self, chunk):
        """(init, u, x) of a chunk (of 32 weights, or 64 in one zmm), whose integer dot product
        is dot(init, u, x)."""
        b = self.b
        c, u, offset, _ = chunk
        lanes_type = ir.VectorType(I32, u.type.count // 4)
        x = self.load(self.xq, b.mul(c, ir.Constant(c.type, 32)), lanes_type)
        x = b.bitcast(x, ir.VectorType(I8, u.type.count))
        zero = ir.Constant(lanes_type, None)
        if isinstance(offset, Signs):  # levels < 128: exact in either instruction set
            return zero, u, self.apply_signs(x, offset)
        if offset == SIGNED and INSTRUCTION_SET == "avx2":
            # ggml's sign trick: |w| * (x with w's sign), |w| <= 128 keeps the pairs in int16
            return zero, self.sign(u, u), self.sign(x, u)
        if offset == SIGNED:  # unsigned levels w + 128 for vpdpbusd, 128 subtracted below
            u, offset = b.xor(u, splat(V32I8, 0x80)), 128
        if isinstance(offset, ir.Value):  # an offset of this chunk (i32) or of each lane
            if offset.type == I32:
                offset = self.splat8i(offset)
            # a lane's sum of 4 activations (|s| <= 508) and the offset fit int16: vpmaddwd
            return self.scale_add(zero, self.lane_sums(c, lanes_type), b.neg(offset)), u, x
        if offset:  # -offset * (sum of the 4 activations of each lane)
            return b.mul(self.lane_sums(c, lanes_type), splat(lanes_type, -offset)), u, x
        return zero, u, x

    def accumulate(self, row, chunk):
        """iacc += scale * (the chunk's weights . the activations), in integers. A paired type's
        scaled chunks go two at a time, each pair one 512-bit dot product."""
        b = self.b
        init, u, x = self.operands(chunk)
        scale = chunk.scale
        if isinstance(scale, ScalePair):
            assert isinstance(init, ir.Constant), "pairs_scaled takes chunks of offset 0"
            b.store(self.pairs_scaled(b.load(self.iacc[row]), u, x, scale.lanes), self.iacc[row])
            return
        if isinstance(scale, _SlotScale):
            assert isinstance(init, ir.Constant), "scaled_pairs takes chunks of offset 0"
            self.odd[row] = not self.odd[row]
            iacc = self.iacc_odd[row] if self.odd[row] else self.iacc[row]
            b.store(self.scaled_pairs(b.load(iacc), u, x, scale), iacc)
            return
        if scale is not None and scale.type == I32 and not self.narrow:
            # wide sums (IQ4_XS): the block's chunks scaled together at its end
            self.scaled[row].append((self.dot(init, u, x), scale))
            return
        if scale is not None and scale.type == I32:
            scale = self.splat8i(scale)
        wide = u.type.count == 64  # a reader's 64-weight chunk (narrow and scaled, or TQ1_0)
        iacc = self.iacc16[row] if wide else self.iacc[row]
        if scale is None and len(self.iacc) > 1:
            # the dot product into iacc itself, its offset term added at the block's end: the
            # same instructions for every row, which LLVM computes once (streamed, 2 threads:
            # Q4_0 16.5 -> 20 GB/s, IQ4_NL 17.7 -> 20.3, TQ2_0 19.4 -> 22; a row alone gains
            # nothing so, and Q8_0 lost 24 -> 21)
            b.store(self.dot(b.load(iacc), u, x), iacc)
            if not isinstance(init, ir.Constant):
                self.offsets[row].append(init)
            return
        if scale is None or not self.narrow:
            isum = self.dot(init, u, x)
            b.store(b.add(b.load(iacc), isum if scale is None else b.mul(isum, scale)), iacc)
            return
        if self.paired and not wide:
            held, self.held[row] = self.held[row], None
            if held is None:
                self.held[row] = (init, u, x, scale)
                return
            init, u, x, scale = (self.concat(a, c) for a, c in zip(held, (init, u, x, scale)))
        iacc = self.iacc16[row] if self.paired or wide else self.iacc[row]
        if INSTRUCTION_SET == "avx2" and isinstance(init, ir.Constant):
            b.store(self.pairs_scaled(b.load(iacc), u, x, self.scale_pair(scale)), iacc)
            return
        b.store(self.scale_add(b.load(iacc), self.dot(init, u, x), scale), iacc)

    def scale_pair(self, scale):
        """<8 x i32>: the int16 scale of each lane in both of its halves. Of a reader's spread of
        the block's scales (a shufflevector), the spread of their pairs: made once a block, as
        the shift and or are the same instructions for every chunk (LLVM merges them), where
        LLVM left them after the spread, per chunk (Q2_K)."""
        b = self.b
        if isinstance(scale, ir.instructions.ShuffleVector):
            values, _, picks = scale.operands
            if isinstance(values.type, ir.VectorType) and values.type.element == I32:
                pairs = self.scale_pair(values)
                return b.shuffle_vector(pairs, ir.Constant(pairs.type, None), picks)
        low = scale if self.short_scales else b.and_(scale, splat(scale.type, 0xFFFF))
        return b.or_(low, b.shl(scale, splat(scale.type, 16)))

    def pairs_scaled(self, acc, u, x, pair):
        """AVX2: acc + scale * (u . x) per lane of 4 bytes, for a narrow chunk of offset 0, `pair`
        (<8 x i32>) the int16 scale in both halves of each lane: the products summed in int16
        pairs (vpmaddubsw, within +-2**15 as narrow says), the pairs times the scale (vpmaddwd).
        One vpmaddwd where widening the pairs first (vpmaddwd by ones) and then scale_add took
        two: Zen 3, one thread, in cache, alternating in one process, Q4_K 19.1 -> 23.3 G MAC/s,
        Q5_K 17.4 -> 20.4. The pair comes from the reader (ScalePair: Q4_K's and Q5_K's vpshufb
        writes the scale's byte twice) or from scale_pair."""
        b = self.b
        v16 = ir.VectorType(ir.IntType(16), 16)
        pairs = self.intrinsic("llvm.x86.avx2.pmadd.ub.sw", v16, b.bitcast(u, V32I8), x)
        both = b.bitcast(pair, v16)
        return b.add(acc, self.intrinsic("llvm.x86.avx2.pmadd.wd", V8I32, pairs, both))

    def scale_add(self, acc, isum, scale):
        """acc + isum * scale per lane (<8 or 16 x i32>), for |isum| < 2**15 and int16 scales:
        the scale as the low half of an int16 pair whose high half is 0, so that vpmaddwd
        multiplies it with isum's low half (isum's high half, its sign, meets the 0). Two uops
        where vpmulld + vpaddd take three (LLVM emits these for vpdpwssd too)."""
        b = self.b
        n = acc.type.count
        v_i16 = ir.VectorType(ir.IntType(16), 2 * n)
        if not self.short_scales:
            scale = b.and_(scale, splat(acc.type, 0xFFFF))
        pair = b.bitcast(scale, v_i16)
        name = "llvm.x86.avx2.pmadd.wd" if n == 8 else "llvm.x86.avx512.pmaddw.d.512"
        return b.add(acc, self.intrinsic(name, acc.type, b.bitcast(isum, v_i16), pair))

    def lanes_each(self, values, spread):
        """(k) -> chunk k's scale, values[k] (blocks.BlockReader.lanes_each): with EVEX VNNI
        read from memory by scaled_pairs (values < 2**15, offsets 0), with AVX2 in both int16
        halves of each lane for pairs_scaled, else spread(k)."""
        if INSTRUCTION_SET == "avx2":
            return lambda k: ScalePair(spread(k, pair=True))
        if not EVEX_VNNI:
            return spread
        b = self.b
        slot = cgutils.alloca_once(b, values.type)
        b.store(b.or_(values, b.shl(values, splat(values.type, 16))), slot)
        return lambda k: _SlotScale(slot, k)

    def scaled_pairs(self, acc, u, x, scale):
        """acc + scale * (u . x) per lane of 4 bytes, for a _SlotScale and an offset of 0: the
        products summed in int16 pairs (vpmaddubsw: |u| < 128, two products within +-2**15),
        the pairs times the scale in both halves of its dword, from memory (vpdpwssd with an
        embedded broadcast). Two instructions and no shuffle, where vpdpbusd into a zeroed
        register, the scale's spread, vpmaddwd and vpaddd took five (Q4_K and Q5_K, rows a thread
        at a time, 8960x1536 streamed on 2 threads, medians: 21.8 -> 22.8 and 20.2 -> 22.7
        GB/s). Inline assembly: LLVM would split vpdpwssd into vpmaddwd + vpaddd in a chain (its
        machine combiner, on CPUs not tuned fast-dpwssd) and take the scale from the store
        rather than from memory."""
        b = self.b
        v16 = ir.VectorType(ir.IntType(16), 16)
        pairs = self.intrinsic("llvm.x86.avx2.pmadd.ub.sw", v16, b.bitcast(u, V32I8), x)
        fnty = ir.FunctionType(V8I32, [V8I32, scale.slot.type, V8I32])
        code = f"vpdpwssd {4 * scale.k}($2){{1to8}}, $1, $0"
        # ~{memory}: the asm reads the slot (the backend keeps the slot's store before it)
        args = [b.bitcast(pairs, V8I32), scale.slot, acc]
        return b.asm(fnty, code, "=v,v,r,0,~{memory}", args, False)

    def end_block(self, row, end):
        b = self.b
        lanes = b.add(b.load(self.iacc[row]), b.load(self.iacc_odd[row]))
        b.store(ir.Constant(V8I32, None), self.iacc[row])
        b.store(ir.Constant(V8I32, None), self.iacc_odd[row])
        self.odd[row] = False
        scaled, self.scaled[row] = self.scaled[row], []
        offsets, self.offsets[row] = self.offsets[row], []
        totals = {}  # by lane count, summed apart from the row's own sums: the same for every row
        for init in offsets:
            n = init.type.count
            totals[n] = b.add(totals[n], init) if n in totals else init
        if 8 in totals:
            lanes = b.add(lanes, totals[8])
        if len(scaled) == 8:  # lane k: chunk k's sum (a transposing add), times its scale
            sums = sums_of_8(self, [isum for isum, _ in scaled])
            lanes = b.add(lanes, b.mul(sums, self.vector_of(scale for _, scale in scaled)))
        else:
            for isum, scale in scaled:
                lanes = b.add(lanes, b.mul(isum, self.splat8i(scale)))
        if ZMM:
            assert self.held[row] is None, "a paired type's blocks hold an even number of chunks"
            wide = b.load(self.iacc16[row])
            b.store(ir.Constant(_V16I32, None), self.iacc16[row])
            if 16 in totals:  # 64-weight chunks' (TQ1_0): folded with the 16-lane sums below
                wide = b.add(wide, totals[16])
            parts = [self.spread(wide, list(range(h, h + 8))) for h in (0, 8)]
            lanes = b.add(lanes, b.add(*parts))
        self.pending[row].append((lanes, end))

    def activation_sums(self, c, count):
        """<count x i32>: the activations' sums over the sub-blocks (of 16 or 32 columns) of the
        block whose first chunk is c."""
        b = self.b
        at = b.gep(self.xb, [b.mul(c, ir.Constant(c.type, 2))])  # sums of 16, from chunk c
        sums = b.load(b.bitcast(at, _V16I32.as_pointer()), align=4)
        if count == 8:  # per 32: pairs of sums of 16
            even, odd = ([2 * k + i for k in range(8)] for i in (0, 1))
            undef = ir.Constant(_V16I32, None)
            sums = b.add(b.shuffle_vector(sums, undef, ir.Constant(V8I32, even)),
                         b.shuffle_vector(sums, undef, ir.Constant(V8I32, odd)))  # fmt: skip
        return sums

    def flush(self):
        """The float steps of the rows' waiting blocks (each row the same columns, in order),
        one vector over the rows per block. Integer sums by transposing adds: of 32-weight
        blocks (up to 8 a row), each row's blocks at once; of super-blocks (one a row), the
        rows' sums S and mins sums M at once."""
        b = self.b
        pending, self.pending = self.pending, [[] for _ in self.pending]
        n = len(pending)
        if self.deferred:
            sums = [lane_totals(self, [lanes for lanes, _ in blocks]) for blocks in pending]
            for k in range(len(pending[0])):
                s = self.vector_of(b.extract_element(v, ir.Constant(I32, k)) for v in sums)
                self.rows_step([blocks[k][1] for blocks in pending], s, None)
            return
        for k in range(len(pending[0])):
            ends = [blocks[k][1] for blocks in pending]
            vectors = [blocks[k][0] for blocks in pending]
            mins = ends[0].mins
            if mins is not None:
                sums = self.activation_sums(ends[0].index, mins.type.count)
                for end in ends:
                    products = b.mul(end.mins, sums)
                    if products.type.count == 16:  # per 16 columns: the halves added
                        parts = [self.spread(products, list(range(h, h + 8))) for h in (0, 8)]
                        products = b.add(*parts)
                    vectors.append(products)
            totals = lane_totals(self, vectors)
            m = None if mins is None else self.spread(totals, list(range(n, 2 * n)))
            self.rows_step(ends, self.spread(totals, list(range(n))), m)

    def vector_of(self, values):
        """<n x T>: the n values (one per row, or per chunk) as a vector. Halves converted to
        float (BlockEnd's d ...) are put together in a general register, then converted at
        once: a shift and an or each there, where the vector unit took a vpinsrw each, in a
        chain (IQ4_NL in cache 10.5 -> 15.3 GB/s; a gather of the 4 halves: 14.0)."""
        b = self.b
        values = list(values)
        halves = [_half_bits(v) for v in values]
        if all(h is not None for h in halves) and len(halves) <= 4:
            word = ir.IntType(16 * len(halves))
            bits = ir.Constant(word, 0)
            for k, h in enumerate(halves):
                bits = b.or_(bits, b.shl(b.zext(h, word), ir.Constant(word, 16 * k)))
            vector = b.bitcast(bits, ir.VectorType(ir.HalfType(), len(halves)))
            return b.fpext(vector, ir.VectorType(F32, len(halves)))
        v = ir.Constant(ir.VectorType(values[0].type, len(values)), None)
        for k, value in enumerate(values):
            v = self.b.insert_element(v, value, ir.Constant(I32, k))
        return v

    def rows_step(self, ends, s, m):
        """blocks.py's float steps of one block of each row (BlockEnds `ends`, the same
        columns), their integer sums s and mins sums m (<n_rows x i32>) given."""
        b = self.b
        n = len(ends)
        c = ends[0].index

        def field(name):
            if getattr(ends[0], name) is None:
                return None
            return self.vector_of(getattr(end, name) for end in ends)

        end = BlockEnd(c, field("d"), ends[0].mins, field("dmin"), field("fmin"))
        dx = self.spread(b.load(b.gep(self.xd, [c])), [0] * n)
        xs = None if end.fmin is None else self.spread(b.load(b.gep(self.xs, [c])), [0] * n)
        acc = float_steps(self, b.load(self.acc), s, end, dx, lambda _: m, xs)
        b.store(acc, self.acc)

    def result(self, row):
        return self.b.extract_element(self.b.load(self.acc), ir.Constant(I32, row))


# Software prefetch this far ahead of the bytes being read. The hardware prefetchers alone left a
# weight matrix streaming from DRAM at ~7 GB/s (this project's 2-core VMs); prefetching 8 KiB ahead
# brought it to 25-35 GB/s. A thread reads its groups of rows front to back, the rows of a group
# together: the far prefetch is PREFETCH_BYTES ahead in that stream (stream_ahead).
# 16 KiB rather than 8: Q6_K rows of 14336 weights (Llama-3.1-8B's ffn_down) streamed at 11.7 GB/s
# with 8 KiB and 16.4 with 16 KiB on one thread; the 8B shape decoded at 7.2-7.3 against 7.8-8.4
# tok/s on 2 threads, the 1.5B the same within noise.
PREFETCH_BYTES = 16384
# In two steps: the far prefetch into L2 only (prefetcht2), a near one NEAR_PREFETCH_BYTES ahead
# from L2 into L1 (prefetcht0). A prefetch into L1 holds one of the core's few L1 fill buffers
# until its line arrives, so all of them from DRAM capped the lines in flight: 400 MB of random
# blocks, 2 threads, the plain read of the same bytes at 31-34 GB/s, streamed Q6_K 24.7 -> 28.9
# GB/s and Q4_K 21.2 -> 24.0; the real 1.5B decoded 19.1 / 20.1 -> 20.7 / 21.2 tok/s. Further (32,
# 64 KiB) or nearer (256 B to 2 KiB) was no better.
NEAR_PREFETCH_BYTES = 512
L2, ALL_LEVELS = 1, 3  # llvm.prefetch's locality: prefetcht2, prefetcht0

GROUP = 8  # 32-weight blocks per step of the block loop


def prefetch(builder, address, locality=ALL_LEVELS):
    """Software prefetch of the cache line at `address` (i8*): read, data, into the caches
    `locality` names (ALL_LEVELS, or L2 and beyond)."""
    fn = cgutils.get_or_insert_function(
        builder.module,
        ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]),
        "llvm.prefetch.p0",
    )
    builder.call(fn, [address, *(ir.Constant(I32, v) for v in (0, locality, 1))])


def prefetch_stream(builder, start, n_bytes, far=None):
    """Prefetch what follows the n_bytes of weights at `start` (i8*) in a thread's stream: each
    of their cache lines from `far` on (by default PREFETCH_BYTES ahead of start, where the
    thread reads one row at a time) into L2, and NEAR_PREFETCH_BYTES ahead into L1."""
    if far is None:
        far = builder.gep(start, [ir.Constant(I64, PREFETCH_BYTES)])
    for line in range(0, n_bytes, 64):
        prefetch(builder, builder.gep(far, [ir.Constant(I64, line)]), L2)
        prefetch(builder, builder.gep(start, [ir.Constant(I64, NEAR_PREFETCH_BYTES + line)]))


def stream_ahead(builder, offset, row_bytes, n_rows):
    """The offset from each row of a group that the rows read together (a thread's rows r ..
    r + n_rows - 1, then r + n_rows ...; each row at `offset` now) will read PREFETCH_BYTES
    of the thread's stream later: PREFETCH_BYTES / n_rows further along the same row, or, past
    its end, along the same row of a later group, whole groups of n_rows rows on. Taking
    PREFETCH_BYTES along the row itself, as for one row, missed the stream where rows are long:
    for rows of 14336 weights it fetched other rows of the group a few lines ahead of their
    reads, and never the next group's rows 2-3. Llama-3.1-8B shape, 2 threads, decode: its Q4_K
    ffn_down 29.1 / 30.4 -> 32.6 / 33.9 GB/s, Q6_K ffn_down 31.7 / 35.4 -> 33.0 / 45.3, gate/up
    33.1 / 33.9 -> 34.9 / 37.8; 6.7 / 7.2 -> 7.1 / 8.1 tok/s (alternating runs)."""
    far = builder.add(offset, ir.Constant(I64, PREFETCH_BYTES // n_rows))
    groups_on = builder.udiv(far, row_bytes)
    rows_on = builder.mul(groups_on, ir.Constant(I64, n_rows - 1))
    return builder.add(far, builder.mul(rows_on, row_bytes))


def _rows_typer(type_size, chunks_per_block, read_block, n_rows, n_tokens):
    """The typing function of a Numba intrinsic `rows(w, r0, t0, xq, xd, xs, xl, xb, out)`:

        out[t0 + k, r0 + i] = w[r0 + i] . x[t0 + k]   for i < n_rows, k < n_tokens

    (rows r0 + i past w's last are left out: one variant serves a matrix's last rows too).
    w: uint8[rows, row_bytes] (GGUF blocks); xq: int8[tokens, n_cols]; xd, xs: float32[tokens,
    n_cols // 32]; xl: int32[tokens, n_cols // 4]; xb: int32[tokens, n_cols // 16]; out:
    float32[tokens, rows]; all C-contiguous. The rows advance block by block together, sharing
    the activation loads; each block is read once for all n_tokens tokens (a tile of a batch:
    the weights are read once per tile); read_block(e, block_ptr, first_chunk) is the type's
    block reader (blocks.py).
    """

    # 32-weight blocks go GROUP at a time: one loop step and one prefetch per cache line,
    # instead of a step and a prefetch per 18-34 byte block
    group = max(1, GROUP // chunks_per_block)

    def rows(typingctx, w, r0, t0, xq, xd, xs, xl, xb, out):
        sig = types.void(w, r0, t0, xq, xd, xs, xl, xb, out)

        def codegen(context, builder, signature, args):
            arrays = {
                k: context.make_array(signature.args[k])(context, builder, args[k])
                for k in (0, 3, 4, 5, 6, 7, 8)
            }
            r0 = context.cast(builder, args[1], signature.args[1], types.int64)
            t0 = context.cast(builder, args[2], signature.args[2], types.int64)
            total_rows, row_bytes = (builder.extract_value(arrays[0].shape, k) for k in (0, 1))
            last = builder.sub(total_rows, ir.Constant(I64, 1))

            def row_index(i):  # rows past the last read the last one again (never stored)
                row = builder.add(r0, ir.Constant(I64, i))
                return builder.select(builder.icmp_signed("<", row, total_rows), row, last)

            rows = [builder.gep(arrays[0].data, [builder.mul(row_index(i), row_bytes)])
                    for i in range(n_rows)]  # fmt: skip

            def token_row(k, tok):  # pointer to row t0 + tok of array k
                width = builder.extract_value(arrays[k].shape, 1)
                at = builder.mul(builder.add(t0, ir.Constant(I64, tok)), width)
                return builder.gep(arrays[k].data, [at])

            emitters = [
                _Emitter(
                    builder,
                    n_rows,
                    *(token_row(k, tok) for k in (3, 4, 5, 6, 7)),
                    deferred=chunks_per_block == 1,
                    layout=read_block.layout,
                )  # fmt: skip
                for tok in range(n_tokens)
            ]
            e = emitters[0]  # its block reader unpacks the blocks for every token

            def blocks(first_block, count):
                """count blocks from first_block on, for every row, in each row's order."""
                offset0 = builder.mul(first_block, ir.Constant(I64, type_size))
                far = stream_ahead(builder, offset0, row_bytes, n_rows)
                for i, row in enumerate(rows):
                    prefetch_stream(builder, builder.gep(row, [offset0]), count * type_size,
                                    builder.gep(row, [far]))  # fmt: skip
                    for k in range(count):
                        block = builder.add(first_block, ir.Constant(I64, k))
                        offset = builder.mul(block, ir.Constant(I64, type_size))
                        first = builder.mul(block, ir.Constant(I64, chunks_per_block))
                        for item in read_block(e, builder.gep(row, [offset]), first):
                            for em in emitters:
                                em.take(i, item)
                for em in emitters:
                    em.flush()

            n_blocks = builder.udiv(row_bytes, ir.Constant(I64, type_size))
            n_groups = builder.udiv(n_blocks, ir.Constant(I64, group))
            with cgutils.for_range(builder, n_groups) as loop:
                blocks(builder.mul(loop.index, ir.Constant(I64, group)), group)
            if group > 1:  # the blocks after the last whole group: 4, 2, 1 as the count has
                # them, each few added up together (one block at a time cost 2.2 grouped ones)
                start = cgutils.alloca_once_value(
                    builder, builder.mul(n_groups, ir.Constant(I64, group))
                )
                rest = builder.urem(n_blocks, ir.Constant(I64, group))
                size = group // 2
                while size >= 1:
                    bit = builder.and_(rest, ir.Constant(I64, size))
                    with builder.if_then(builder.icmp_unsigned("!=", bit, ir.Constant(I64, 0))):
                        first = builder.load(start)
                        blocks(first, size)
                        builder.store(builder.add(first, ir.Constant(I64, size)), start)
                    size //= 2
            for tok, em in enumerate(emitters):
                out_row = token_row(8, tok)
                for i in range(n_rows):
                    row = builder.add(r0, ir.Constant(I64, i))
                    with builder.if_then(builder.icmp_signed("<", row, total_rows), likely=True):
                        builder.store(em.result(i), builder.gep(out_row, [row]))
            return context.get_dummy_value()

        return sig, codegen

    return rows


ROWS = 4  # rows per pass of the matvec kernels over a tile of tokens: they share its loads


@intrinsic
def _rows(typingctx, ggml_type, n_rows, n_tokens, w, r0, t0, xq, xd, xs, xl, xb, out):
    """out[t0:t0 + n_tokens, r0:r0 + n_rows] = x[t0:t0 + n_tokens] . w[r0:r0 + n_rows] (see
    _rows_typer); ggml_type, n_rows and n_tokens must be compile-time constants."""
    if not all(isinstance(v, types.IntegerLiteral) for v in (ggml_type, n_rows, n_tokens)):
        return None
    from . import QUANT_TYPES  # the registry imports this module

    qt = QUANT_TYPES[ggml_type.literal_value]
    sizes = (qt.type_size, qt.block_size // 32, qt.dot_unpacker)
    typer = _rows_typer(*sizes, n_rows.literal_value, n_tokens.literal_value)
    args = (w, r0, t0, xq, xd, xs, xl, xb, out)
    inner_sig, inner_codegen = typer(typingctx, *args)

    def codegen(context, builder, signature, llargs):
        return inner_codegen(context, builder, inner_sig, llargs[3:])

    return types.void(ggml_type, n_rows, n_tokens, *args), codegen


# ---- activations: int8 quants, per-chunk scales and sums


@njit(cache=True)
def quantize_q8(x, super_block, xq, xd, xs, xl, xb):
    """x: float32[n_tokens, n_cols] -> ggml's Q8_0/Q8_1 (super_block 32) or Q8_K (256) quants.

    xq: int8[n_tokens, n_cols]; per 32-column chunk xd (the scale d), xs (d * sum(q); f16-rounded
    for Q8_1 as ggml stores it): float32[n_tokens, n_cols // 32]; sums of the quants: xl of 4
    consecutive ones, int32[n_tokens, n_cols // 4], xb of 16 (ggml's Q8_K bsums), int32[n_tokens,
    n_cols // 16]. The same rounding as activations.round_activations."""
    n_tokens, n_cols = x.shape
    u = np.uint64  # indices as unsigned: Numba's wraparound of a negative index would make the
    # loops' loads and stores gathers and scatters (10x slower); views cost a refcount each
    for t in range(n_tokens):
        row, quants, fours, sixteens = x[t], xq[t], xl[t], xb[t]
        for s in range(n_cols // super_block):
            lo, hi = s * super_block, (s + 1) * super_block
            d, inv, d_raw = q8_scale(row[lo:hi])
            for j in range(lo, hi):
                quants[u(j)] = np.int8(min(np.float32(127.0), np.rint(row[u(j)] * inv)))
            for i in range(lo // 4, hi // 4):
                j = u(4 * i)
                fours[u(i)] = (
                    np.int32(quants[j])
                    + np.int32(quants[j + u(1)])
                    + np.int32(quants[j + u(2)])
                    + np.int32(quants[j + u(3)])
                )
            for i in range(lo // 16, hi // 16):
                j = u(4 * i)
                sixteens[u(i)] = fours[j] + fours[j + u(1)] + fours[j + u(2)] + fours[j + u(3)]
            for c in range(lo // 32, hi // 32):
                total = sixteens[u(2 * c)] + sixteens[u(2 * c + 1)]
                xd[t, c] = d
                xs[t, c] = round_f16(d_raw * np.float32(total)) if super_block == 32 else d * total


@njit(parallel=True, cache=True)
def quantize_q8_tokens(x, super_block, xq, xd, xs, xl, xb):
    """quantize_q8 with the tokens spread over threads (a prefill's activations)."""
    for t in prange(x.shape[0]):
        quantize_q8(x[t : t + 1], super_block, xq[t : t + 1], xd[t : t + 1], xs[t : t + 1],
                    xl[t : t + 1], xb[t : t + 1])  # fmt: skip


def activation_buffers(n_tokens: int, n_cols: int) -> tuple:
    """Empty (xq, xd, xs, xl, xb) for quantize_q8."""
    return (
        np.empty((n_tokens, n_cols), np.int8),
        np.empty((n_tokens, n_cols // 32), np.float32),
        np.empty((n_tokens, n_cols // 32), np.float32),
        np.empty((n_tokens, n_cols // 4), np.int32),
        np.empty((n_tokens, n_cols // 16), np.int32),
    )


# ---- kernels, one per weight type (the type is a constant inside, so each holds only its own
# code). They are made by a factory; each gets its own __qualname__, which is what Numba's
# on-disk cache files are named after, so that the types do not share one cache entry.

# Tiles of a batch: TILE_TOKENS tokens share each unpacked weight block (4 rows x 2 tokens: 8
# float and 8 integer accumulators, which AVX-512's 32 vector registers hold). Tokens go through
# in blocks of about ACTIVATION_BLOCK_BYTES of int8 activations, which stay in L2 while every
# row group of the weights streams past them.
TILE_TOKENS = 2
# Tokens by 4 first (4 rows x 4 tokens): each unpacked block feeds twice the dot products. A
# batched step of 8 decode rows on qwen2.5-coder-0.5b, 2 threads: 66-67 -> 56-62 ms.
WIDE_TILE = 4
ACTIVATION_BLOCK_BYTES = 256 << 10


@njit(cache=True, inline="always")
def row_groups(ws, rows):
    """int64[len(ws) + 1]: the groups of `rows` rows of ws[i] (its last one maybe short) are
    bounds[i] .. bounds[i + 1] - 1, numbered through all of ws (one parallel loop over them)."""
    bounds = np.empty(len(ws) + 1, np.int64)
    bounds[0] = 0
    for i in range(len(ws)):
        bounds[i + 1] = bounds[i] + (ws[i].shape[0] + rows - 1) // rows
    return bounds


@njit(cache=True, inline="always")
def group_at(bounds, g, rows):
    """(i, r0): row group g (see row_groups) is ws[i]'s rows r0 .. r0 + rows - 1."""
    i = 0
    while g >= bounds[i + 1]:
        i += 1
    return i, (g - bounds[i]) * rows


# A token alone (decode) goes through the rows of the types whose record says one_row a row at a
# time, so that a thread's weights are one stream, front to back, where 4 rows together are 4
# streams a row apart, which the memory fed more slowly than the kernels lost by loading the
# activations once per row. Sapphire Rapids VM, 2 threads, alternating runs, decode: the real
# Qwen2.5-Coder-1.5B Q4_K_M 16.9-17.1 -> 18.6-18.9 tok/s (another hour 18.3-18.5 -> 20.0-20.6),
# the Llama-3.2-3B shape Q4_K_M 5.7-6.0 -> 7.0-7.2. The streamed matvec of 8960x1536
# (bench-quant-types --rounds 5, 3 runs each), GB/s: Q4_K 17.9-18.8 -> 20.7-21.0, IQ4_XS 19.2 ->
# 20.9-21.5, Q5_K 17.3-17.7 -> 19.7-21.2, Q6_K 21.0-22.0 -> 25.5-26.4, Q8_0 20.2-21.3 -> 24.5,
# Q5_0 16.8-17.2 -> 19.8-19.9. The others stay at 4 rows: one at a time, the compute-bound types
# below 4 bits lost 10-25% (Q3_K 17.4-17.8 -> 15.9-16.0, TQ2_0 20.4-22.8 -> 17.0-18.3, IQ1_S
# 7.5-8.3 -> 5.8-6.9), and so did the 32-weight types of 20 bytes or fewer per float step, whose
# one accumulator chain (an FMA a block, bit for bit the tiles' order) then binds: Q4_0 17.2-17.4
# -> 16.2-16.5, IQ4_NL 17.7-18.1 -> 16.8-17.2, Q4_1 16.6-19.0 -> 15.2, Q5_1 17.1-17.9 -> 16.2-16.8.
def matvec_kernel(ggml_type: int, name: str, one_row: bool):
    """The integer matvec/matmul for a type whose record names a `dot_unpacker` (see _rows);
    one_row: a token alone goes a row at a time (above)."""
    source_key = SOURCE_KEY
    one_token_rows = 1 if one_row else ROWS

    def matvec(ws, xq, xd, xs, xl, xb, outs, each=False):
        """outs[i] = x @ ws[i].T for a tuple of weights of this type that share the input
        (Q/K/V, gate/up): one parallel region for all their rows per block of tokens.
        xq, xd, xs, xl, xb: see quantize_q8; ws[i]: uint8[n_rows_i, row_bytes]; outs[i]:
        float32[n_tokens, n_rows_i]. each: token i alone goes through ws[i], into row i of
        outs[i] (a MoE token's experts, each on its own input), as a token alone does."""
        depends_on(source_key)  # the record read at compile time lives in another file
        n_tokens, n_cols = xq.shape
        bounds = row_groups(ws, ROWS)
        if each:
            for g in prange(bounds[len(ws)]):
                i, r0 = group_at(bounds, g, ROWS)
                w, out = ws[i], outs[i]
                for r in range(r0, min(r0 + ROWS, w.shape[0]), one_token_rows):
                    _rows(ggml_type, one_token_rows, 1, w, r, i, xq, xd, xs, xl, xb, out)
            return
        per_block = max(TILE_TOKENS, ACTIVATION_BLOCK_BYTES // n_cols // TILE_TOKENS * TILE_TOKENS)
        for b0 in range(0, n_tokens, per_block):
            b1 = min(n_tokens, b0 + per_block)
            tiled4 = b0 + (b1 - b0) // WIDE_TILE * WIDE_TILE
            tiled = tiled4 + (b1 - tiled4) // TILE_TOKENS * TILE_TOKENS
            for g in prange(bounds[len(ws)]):
                i, r0 = group_at(bounds, g, ROWS)
                w, out = ws[i], outs[i]
                for t0 in range(b0, tiled4, WIDE_TILE):
                    _rows(ggml_type, ROWS, WIDE_TILE, w, r0, t0, xq, xd, xs, xl, xb, out)
                for t0 in range(tiled4, tiled, TILE_TOKENS):
                    _rows(ggml_type, ROWS, TILE_TOKENS, w, r0, t0, xq, xd, xs, xl, xb, out)
                for t in range(tiled, b1):  # a token alone (decode): one_row
                    for r in range(r0, min(r0 + ROWS, w.shape[0]), one_token_rows):
                        _rows(ggml_type, one_token_rows, 1, w, r, t, xq, xd, xs, xl, xb, out)

    matvec.__qualname__ = f"matvec_{name}"
    return njit(parallel=True, cache=True)(matvec)


def experts_kernel(ggml_type: int, name: str, one_row: bool):
    """The integer matmul of a MoE's experts (llama.cpp's mul_mat_id) with few rows each, for a
    type whose record names a `dot_unpacker`: each expert's rows of x through that expert's
    matrix, one parallel region for all of them (CPUBackend.linear_experts: the experts of a
    prompt with fewer than TILE_MIN_TOKENS rows, or of a batch of a few decode rows), where a
    call per expert cost a few tokens' dot products their own calls' overhead."""
    source_key = SOURCE_KEY
    one_token_rows = 1 if one_row else ROWS

    def experts(w3, ids, spans, xq, xd, xs, xl, xb, out):
        """out[a:b] = x[a:b] @ w3[ids[i]].T for each i, (a, b) = spans[i]: x's rows sorted by
        expert, xq, xd, xs, xl, xb (see quantize_q8) their quants; w3: uint8[n_experts, n_rows,
        row_bytes]; ids: int64[n_used]; spans: int64[n_used, 2]; out: float32[n_x_rows,
        n_rows]. The same tiles as matvec: a row's result does not depend on the rows beside
        it."""
        depends_on(source_key)
        n_used, n_rows = len(ids), w3.shape[1]
        for g in prange(n_used * ((n_rows + ROWS - 1) // ROWS)):
            # expert-minor: each thread takes every expert's share of rows (the experts' spans
            # differ in length)
            i, r0 = g % n_used, g // n_used * ROWS
            w = w3[ids[i]]
            b0, b1 = spans[i, 0], spans[i, 1]
            tiled4 = b0 + (b1 - b0) // WIDE_TILE * WIDE_TILE
            tiled = tiled4 + (b1 - tiled4) // TILE_TOKENS * TILE_TOKENS
            for t0 in range(b0, tiled4, WIDE_TILE):
                _rows(ggml_type, ROWS, WIDE_TILE, w, r0, t0, xq, xd, xs, xl, xb, out)
            for t0 in range(tiled4, tiled, TILE_TOKENS):
                _rows(ggml_type, ROWS, TILE_TOKENS, w, r0, t0, xq, xd, xs, xl, xb, out)
            for t in range(tiled, b1):
                for r in range(r0, min(r0 + ROWS, n_rows), one_token_rows):
                    _rows(ggml_type, one_token_rows, 1, w, r, t, xq, xd, xs, xl, xb, out)

    experts.__qualname__ = f"experts_{name}"
    return njit(parallel=True, cache=True)(experts)
