"""Each weight type's blocks as integers, in LLVM IR: what the integer kernels multiply.

A block reader (one per type, named by its registry record's `dot_unpacker`) is a generator
called with a `BlockReader` `e`, a pointer to one GGUF block and the index of its first 32-weight
chunk in the row. It yields the block's chunks, then a `BlockEnd`:

    Chunk(index, u, offset, scale)   32 weights: integer weight = u - offset (see Chunk)
    BlockEnd(index, d, mins, dmin, fmin)

and every kernel computes, per weight row and token, with the activations' int8 quants x and
scales dx (activations.py), one block after another:

    S   = sum over chunks of scale * sum(weight * x)            exact, in int32
    acc = fma(float(S), d * dx, acc)
    M   = sum over sub-blocks of mins * sum(x)                  exact (k-quants' minimums)
    acc = fma(float(M), dmin * dx, acc)
    acc = fma(fmin, xs, acc)                                    (Q4_1/Q5_1: xs = ggml's f16 sum)

The integer sums are the same whatever order the SIMD lanes add them in, and the float steps
are the same scalar operations in every kernel: a token gets bit-identical results from the
matvec tiles (intdot.py, weights in the lanes) and the prefill tiles (gemm.py, tokens in the
lanes), alone or in any batch.

Each reader's `layout` says how its scales fall (Layout): gemm.py lays the unpacked blocks out
by it. The readers follow ggml's block structs (ggml-common.h) and its vec_dot kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba.core import cgutils

from .cpu import (
    BIT_SHUFFLES,
    BYTE_PERMUTES,
    INSTRUCTION_SET,
    MASK_REGISTERS,
    SLOW_GATHERS,
    TILE_LANES,
)
from .iquants import (
    IQ1_GRID,
    IQ2S_GRID,
    IQ2XS_GRID,
    IQ2XXS_GRID,
    IQ3S_GRID,
    IQ3XXS_GRID,
    KVALUES_IQ4NL,
)

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()
V4I32 = ir.VectorType(I32, 4)
V8I8, V16I8, V32I8, V64I8 = (ir.VectorType(I8, n) for n in (8, 16, 32, 64))
V8I32, V8F32, V16I32 = ir.VectorType(I32, 8), ir.VectorType(F32, 8), ir.VectorType(I32, 16)
V32I16 = ir.VectorType(I16, 32)
ONE = ir.Constant(I32, 1)
ZMM = TILE_LANES == 16  # 512-bit registers in use: a reader may yield 64-weight chunks (halves)
# The grid types' entries by permutes of registers (grid_codes) rather than gathers from memory
# where gathers are slow (cpu.SLOW_GATHERS), and IQ2_XXS's and IQ3_XXS's signs a block at a time
# (_block_aux) wherever the instructions are
PERMUTED_GRIDS = ZMM and BYTE_PERMUTES and SLOW_GATHERS
BLOCK_SIGNS = ZMM and BYTE_PERMUTES and BIT_SHUFFLES
# Grid entries by scalar loads, as ggml's AVX2 kernels take them, where the CPU's ymm gathers are
# slow (Zen 2/3, without 512-bit registers). The readers then go a chunk (32 weights) at a time,
# each index computed in general registers from the block's bytes (_scalar_indices), IQ2_XXS's,
# IQ2_XS's and IQ3_XXS's signs from ggml's table of sign bytes (_ksign_chunk): Zen 3's four
# vector pipes, which every other instruction of the kernel needs, no longer move each index out
# of a vector register (vpextrd) nor compute the signs' parity. Zen 3, one thread, in cache, the
# one-token matvec alternating in one process, G MAC/s: vpgather -> indices from vector
# registers -> these readers: IQ2_XXS 7.0 -> 9.0 -> 13.2, IQ2_XS 7.0 -> 8.8 -> 12.1, IQ3_XXS 7.0
# -> 7.7 -> 9.5, IQ1_M 8.5 -> 10.1 -> 13.3, IQ1_S 9.3 -> 12.1 -> 14.0, IQ3_S 7.3 -> 7.9 -> 8.5,
# IQ2_S 8.4 -> 8.1-9.8 -> 7.4-12.8 (noisy; llvm-mca -mcpu=znver3 on the 4-row loop: 352 -> 237
# cycles).
SCALAR_LOOKUPS = SLOW_GATHERS and not ZMM


def splat(vec_type, value):
    """A constant vector of one value."""
    return ir.Constant(vec_type, [value] * vec_type.count)


SIGNED = -1  # the offset of a chunk of int8 weights (Q8_0): u holds the weights themselves


class Signs:
    """The offset of a chunk of unsigned levels whose weights carry a sign of their own (the grid
    types): `bits` <32 x i1> is set where the weight is negative, or `bytes` <32 x i8> is -1
    there and 1 elsewhere (a vpsignb operand, from a table: _ksign_entries)."""

    def __init__(self, bits=None, bytes=None):
        self.bits, self.bytes = bits, bytes


class ScalePair(NamedTuple):
    """A chunk's scale as intdot's AVX2 kernels take it: <8 x i32> lanes, each the int16 scale
    in both halves (see BlockReader.lanes_each)."""

    lanes: ir.Value


class Chunk(NamedTuple):
    """32 weights, columns 32 index .. 32 index + 31 of the row. u <32 x i8> holds levels; the
    integer weight is u - offset for an int offset (an i32 value, or an <8 x i32> per lane of 4
    weights), u itself for SIGNED, u negated where Signs.bits is set. scale: None (1), an i32, or
    an <8 x i32> per lane whose lanes 0-3 and 4-7 hold the scales of the two 16-weight halves
    (or what the kernel's lanes_each gave the reader: intdot's scale in memory)."""

    index: ir.Value
    u: ir.Value
    offset: object
    scale: ir.Value | None = None


def halves(e, chunk):
    """A 64-weight chunk (u <64 x i8>: chunks index and index + 1, which the one-token kernel
    takes in one zmm) as its two 32-weight chunks; a 32-weight chunk alone."""
    if chunk.u.type.count == 32:
        return (chunk,)
    b = e.b

    def half(v, h):
        n = v.type.count // 2
        return b.shuffle_vector(
            v, v, ir.Constant(ir.VectorType(I32, n), list(range(h * n, h * n + n)))
        )

    def part(v, h):
        if isinstance(v, Signs):
            return Signs(half(v.bits, h))
        return half(v, h) if isinstance(v, ir.Value) and isinstance(v.type, ir.VectorType) else v

    return tuple(
        Chunk(
            e.chunk_index(chunk.index, h),
            half(chunk.u, h),
            part(chunk.offset, h),
            part(chunk.scale, h),
        )  # fmt: skip
        for h in (0, 1)
    )


class BlockEnd(NamedTuple):
    """The end of a block whose first chunk is `index`: d (f32) multiplies its integer sum S.
    mins (<8 x i32> per 32 weights or <16 x i32> per 16, the block's sub-blocks in order) times
    the activation sums of their columns, times dmin (f32), is the k-quants' minimum term; fmin
    (f32) times the activations' stored block sum is Q4_1/Q5_1's."""

    index: ir.Value
    d: ir.Value
    mins: ir.Value | None = None
    dmin: ir.Value | None = None
    fmin: ir.Value | None = None


@dataclass(frozen=True)
class Layout:
    """How a reader's scales fall: columns per integer scale (16 or 32; 0: none, the chunks'
    scale is None), per integer minimum (BlockEnd.mins; 0: none), and whether BlockEnd has fmin.
    narrow: every integer weight (u - offset, or u with its sign) is within +-64, so that a
    lane's 4 products with int8 activations (|x| <= 127) sum within int16 and its scale can
    multiply it in vpmaddwd (intdot.py). paired (narrow types only): with 512-bit registers
    the one-token kernel takes the scaled chunks two to a zmm; measured, it pays where a chunk's
    offset and 16-weight scales cost as much as its unpacking (Q6_K 23 -> 36 G MAC/s, Q2_K 27 ->
    34, one thread), and loses where the unpacking is a byte op or two (Q4_K 34 -> 30) or a grid
    gather with ymm-only sign steps (IQ2_XS 15 -> 11). short_scales: every scale is within
    0..65535 already, so the kernels need not mask it to 16 bits for vpmaddwd. magnitude: no
    integer weight is beyond +-magnitude and every scale fits int16 (0: not known so); unsigned:
    every integer weight is u itself, 0..magnitude (no offset, no sign). AVX2's prefill tiles
    (gemm.py) add such weights' int16 products over several columns before widening them, and
    multiply unsigned ones with vpmaddubsw as they are, without ggml's sign trick."""

    sub_cols: int = 0
    min_cols: int = 0
    float_min: bool = False
    narrow: bool = False
    paired: bool = False
    short_scales: bool = False
    magnitude: int = 0
    unsigned: bool = False


def layout(**fields):
    """Decorator: the reader's Layout."""

    def mark(reader):
        reader.layout = Layout(**fields)
        return reader

    return mark


class BlockReader:
    """IR helpers to read a block's bytes (`b` is the llvmlite IRBuilder)."""

    def __init__(self, builder):
        self.b = builder

    def load(self, base, offset, ty):
        if isinstance(offset, int):
            offset = ir.Constant(I64, offset)
        return self.b.load(self.b.bitcast(self.b.gep(base, [offset]), ty.as_pointer()), align=1)

    def f16(self, block, offset):
        """The IEEE half at block + offset as float (vcvtph2ps)."""
        half = self.b.bitcast(self.load(block, offset, I16), ir.HalfType())
        return self.b.fpext(half, F32)

    def byte(self, block, offset):
        """An unsigned byte of the block as i32."""
        return self.b.zext(self.load(block, offset, I8), I32)

    def chunk_index(self, c, k):
        return self.b.add(c, ir.Constant(c.type, k))

    def nibbles(self, v):
        """(low, high) nibbles of a byte vector."""
        return self.b.and_(v, splat(v.type, 15)), self.b.lshr(v, splat(v.type, 4))

    def nibble_halves(self, block, offset, masked=True):
        """<32 x u8>: the low nibbles of the 16 bytes at block + offset, then their high
        nibbles: the bytes loaded into both halves of a ymm (vbroadcasti128, a load), the high
        half's dwords shifted by 4 (vpsrlvd) and one mask: two instructions, where nibbles and
        a concatenation took four. Unmasked, each byte's low nibble is right and its high one
        garbage (for a lookup that reads only the low bits)."""
        b = self.b
        both = self.load(block, offset, V16I8)
        both = b.shuffle_vector(both, both, ir.Constant(ir.VectorType(I32, 32), [*range(16)] * 2))
        shifts = ir.Constant(V8I32, [0] * 4 + [4] * 4)
        shifted = b.bitcast(b.lshr(b.bitcast(both, V8I32), shifts), V32I8)
        return b.and_(shifted, splat(V32I8, 15)) if masked else shifted

    def concat(self, lo, hi):
        n = lo.type.count
        mask = ir.Constant(ir.VectorType(I32, 2 * n), list(range(2 * n)))
        return self.b.shuffle_vector(lo, hi, mask)

    def bits_to_16(self, qh32):
        """i32 whose bit i is bit 4 of weight i -> <32 x i8> of 0 or 16."""
        mask = self.b.bitcast(qh32, ir.VectorType(ir.IntType(1), 32))
        return self.b.select(mask, splat(V32I8, 16), ir.Constant(V32I8, None))

    def splat8i(self, value):
        """An i32 broadcast to <8 x i32>."""
        return self.spread(value, [0] * 8)

    def spread(self, values, picks):
        """<len(picks) x T>: values[picks[k]] (a vector's elements of type T, or a scalar of type
        T, repeated or reordered)."""
        if not isinstance(values.type, ir.VectorType):
            one = ir.VectorType(values.type, 1)
            values = self.b.insert_element(ir.Constant(one, None), values, ir.Constant(I32, 0))
        picks = ir.Constant(ir.VectorType(I32, len(picks)), picks)
        return self.b.shuffle_vector(values, ir.Constant(values.type, None), picks)

    def lanes_each(self, values, spread):
        """(k) -> chunk k's scale, values[k] (<n x i32>, made once a block) in every lane:
        spread(k), a shuffle each (intdot's _Emitter reads them from memory instead, or with
        AVX2 takes ScalePair(spread(k, pair=True)), the scale in both int16 halves)."""
        return spread

    def words(self, block, offset, ty, n):
        """<n x i32>: n unsigned integers of type ty (i8, i16, i32) at block + offset."""
        v = self.load(block, offset, ir.VectorType(ty, n))
        return v if ty == I32 else self.b.zext(v, ir.VectorType(I32, n))

    def intrinsic(self, name, result, *operands):
        fnty = ir.FunctionType(result, [v.type for v in operands])
        return self.b.call(cgutils.get_or_insert_function(self.b.module, fnty, name), operands)

    def lookup(self, table, indices):
        """<32 x i8>: table[indices] per 128-bit half (vpshufb), indices < 16."""
        return self.intrinsic("llvm.x86.avx2.pshuf.b", V32I8, table, indices)

    def sign(self, v, s):
        """v negated where s < 0, zeroed where s == 0 (vpsignb)."""
        return self.intrinsic("llvm.x86.avx2.psign.b", V32I8, v, s)

    def table(self, name, values, element=I32, writable=False):
        """A global array of this module (one per module, by name): of integers, or of vectors
        when `element` is a vector type (each value a sequence). Constant, or writable, which
        LLVM must load rather than fold (other modules could change it): a shuffle mask kept as
        the operand of the instruction it is written for, where a constant would be rewritten
        into other shuffles."""
        module = self.b.module
        if name not in module.globals:
            table_type = ir.ArrayType(element, len(values))
            table = ir.GlobalVariable(module, table_type, name)
            table.linkage = "linkonce_odr" if writable else "internal"
            table.global_constant = not writable
            if isinstance(element, ir.VectorType):
                items = [ir.Constant(element, [int(v) for v in row]) for row in values]
            else:
                items = [int(v) for v in values]
            table.initializer = ir.Constant(table_type, items)
        return module.globals[name]

    def gather(self, table, indices, element=I32):
        """<n x element>: table[indices[k]] for <n x i32> indices, element i32 or i64: one ymm
        gather (vpgatherdd of 8, vpgatherdq of 4), or twice that many in one zmm gather where
        512-bit registers are in use, else in two ymm ones (where SCALAR_LOOKUPS, the readers
        take `entries` instead)."""
        b = self.b
        n, size = indices.type.count, element.width // 8
        per_ymm = 32 // size
        if n == 2 * per_ymm and not ZMM:
            halves = [self.spread(indices, list(range(h, h + per_ymm))) for h in (0, per_ymm)]
            return self.concat(*(self.gather(table, h, element) for h in halves))
        base = b.bitcast(table, I8.as_pointer())
        result = ir.VectorType(element, n)
        if n == 2 * per_ymm:
            mask = ir.Constant(ir.VectorType(ir.IntType(1), n), [1] * n)
            args = (ir.Constant(result, None), base, indices, mask, ir.Constant(I32, size))
            name = {4: "dpi", 8: "dpq"}[size]
            return self.intrinsic(f"llvm.x86.avx512.mask.gather.{name}.512", result, *args)
        args = (ir.Constant(result, None), base, indices, splat(result, -1), ir.Constant(I8, size))
        name = {4: "d.d", 8: "d.q"}[size]
        return self.intrinsic(f"llvm.x86.avx2.gather.{name}.256", result, *args)

    def entries(self, table, indices):
        """<n x element>: table[i] (a `table` of integers) for the n scalar integers i of
        `indices`, a load each (into a vector register, no gather)."""
        b = self.b
        element = table.value_type.element
        base = b.bitcast(table, element.as_pointer())
        v = ir.Constant(ir.VectorType(element, len(indices)), None)
        for k, i in enumerate(indices):
            i = b.zext(i, I64) if i.type != I64 else i
            v = b.insert_element(v, b.load(b.gep(base, [i])), ir.Constant(I32, k))
        return v

    def apply_signs(self, v, signs):
        """<32 x i8> v negated where `signs` (Signs) says: vpsignb by its bytes, or a blend
        with -v by its bits."""
        return self.negate(v, signs.bits) if signs.bytes is None else self.sign(v, signs.bytes)

    def sign_bits(self, bits):
        """<n x i1>: bit k of `bits`, an i32 or i64 or n / 8 bytes (<n/8 x i8>). With AVX-512BW a
        mask register (kmov); elsewhere each byte spread to 8 lanes and tested against its bit
        (vpshufb, vpand, vpcmpeqb, as ggml's AVX2 kernels): LLVM would take the bits one by one
        from a bitcast (10x slower)."""
        b = self.b
        if not isinstance(bits.type, ir.VectorType):
            bits = b.bitcast(bits, ir.VectorType(I8, bits.type.width // 8))
        n = 8 * bits.type.count
        if MASK_REGISTERS:
            return b.bitcast(b.bitcast(bits, ir.IntType(n)), ir.VectorType(ir.IntType(1), n))
        spread = self.spread(bits, [k // 8 for k in range(n)])
        bit_of = ir.Constant(ir.VectorType(I8, n), [1 << (k % 8) for k in range(n)])
        return b.icmp_unsigned("!=", b.and_(spread, bit_of), ir.Constant(spread.type, None))

    def negate(self, v, bits):
        """<n x i8> v negated where bits (<n x i1>) is set: one masked blend with -v."""
        return self.b.select(bits, self.b.sub(ir.Constant(v.type, None), v), v)

    def lanes_of(self, values, k):
        """<8 x i32> per lane from a vector of per-16-weight values: value k in lanes 0-3,
        value k + 1 in lanes 4-7 (a chunk's two halves)."""
        lanes = ir.Constant(V8I32, [k] * 4 + [k + 1] * 4)
        return self.b.shuffle_vector(values, ir.Constant(values.type, None), lanes)


# ---- legacy types: one block = one 32-weight chunk


@layout(magnitude=8)
def q4_0(e, blk, c):
    yield Chunk(c, e.nibble_halves(blk, 2), 8)
    yield BlockEnd(c, e.f16(blk, 0))


@layout(float_min=True, magnitude=15, unsigned=True)
def q4_1(e, blk, c):
    yield Chunk(c, e.nibble_halves(blk, 4), 0)
    yield BlockEnd(c, e.f16(blk, 0), fmin=e.f16(blk, 2))


@layout(magnitude=16)
def q5_0(e, blk, c):
    u = e.b.or_(e.nibble_halves(blk, 6), e.bits_to_16(e.load(blk, 2, I32)))
    yield Chunk(c, u, 16)
    yield BlockEnd(c, e.f16(blk, 0))


@layout(float_min=True, magnitude=31, unsigned=True)
def q5_1(e, blk, c):
    u = e.b.or_(e.nibble_halves(blk, 8), e.bits_to_16(e.load(blk, 4, I32)))
    yield Chunk(c, u, 0)
    yield BlockEnd(c, e.f16(blk, 0), fmin=e.f16(blk, 2))


@layout()
def q8_0(e, blk, c):
    yield Chunk(c, e.load(blk, 2, V32I8), SIGNED)
    yield BlockEnd(c, e.f16(blk, 0))


# ---- k-quants: 256-weight super-blocks = 8 chunks


def _scales_mins_k4(e, blk):
    """(scales, mins): <8 x i32> each, the 6-bit scales and mins of the 8 sub-blocks from the 12
    packed bytes at offset 4, unpacked with ggml's 32-bit masks (vec_dot_q4_K_q8_K) on the words
    w0, w1, w2 all at once, in one <4 x i32>: [scales 0-3, scales 4-7, mins 0-3, mins 4-7]
    (a third of the instructions of the scalar words)."""
    b = e.b
    v = e.load(blk, 4, V4I32)  # w0 w1 w2, and the first 4 quant bytes (unused)

    def c(*values):
        return ir.Constant(V4I32, list(values))

    zero = ir.Constant(V4I32, None)
    m1, m2, m3 = 0x3F3F3F3F, 0x0F0F0F0F, 0x03030303
    # low 6 bits of w0 and w1; low nibbles of w2 and its high ones
    low = b.shuffle_vector(v, zero, ir.Constant(V4I32, [0, 2, 1, 2]))
    low = b.and_(b.lshr(low, c(0, 0, 0, 4)), c(m1, m2, m1, m2))
    # the top 2 bits of each byte of w0 and w1, as bits 4-5 of scales 4-7 and mins 4-7
    top = b.shuffle_vector(v, zero, ir.Constant(V4I32, [4, 0, 4, 1]))
    top = b.shl(b.and_(b.lshr(top, c(6, 6, 6, 6)), c(m3, m3, m3, m3)), c(4, 4, 4, 4))
    packed = b.bitcast(b.or_(low, top), V16I8)

    def eight_bytes(first):
        lanes = ir.Constant(ir.VectorType(I32, 8), list(range(first, first + 8)))
        return b.zext(b.shuffle_vector(packed, packed, lanes), V8I32)

    both = b.shuffle_vector(packed, packed, ir.Constant(ir.VectorType(I32, 32), [*range(16)] * 2))

    def scale_lanes(k, pair=False):  # <8 x i32>: scale k in every lane (pair: in both of its
        # int16 halves), by one vpshufb (its mask loaded: LLVM had turned a constant byte
        # shuffle into an extract and a broadcast, two uops)
        every = 2 if pair else 4
        picks = e.table(
            f"k4_scale_picks_{every}",
            [[k if j % every == 0 else -128 for j in range(32)] for k in range(8)],
            V32I8,
            writable=True,
        )
        mask = b.load(b.gep(picks, [ir.Constant(I32, 0), ir.Constant(I32, k)]), align=32)
        return b.bitcast(e.intrinsic("llvm.x86.avx2.pshuf.b", V32I8, both, mask), V8I32)

    return e.lanes_each(eight_bytes(0), scale_lanes), eight_bytes(8)


def _k_asymmetric(e, blk, c0, quants_at, high_bits_at):
    """Q4_K / Q5_K: w = d * sc * q - dmin * m per 32-weight sub-block, 6-bit sc and m."""
    b = e.b
    scale_lanes, mins = _scales_mins_k4(e, blk)
    qh = e.load(blk, high_bits_at, V32I8) if high_bits_at else None
    for j in range(4):
        lo, hi = e.nibbles(e.load(blk, quants_at + 32 * j, V32I8))
        for k, u in ((2 * j, lo), (2 * j + 1, hi)):
            if qh is not None:  # bit k of qh[l] is bit 4 of weight 32k + l
                bit = b.and_(b.lshr(qh, splat(V32I8, k)), splat(V32I8, 1))
                u = b.or_(u, b.shl(bit, splat(V32I8, 4)))
            yield Chunk(e.chunk_index(c0, k), u, 0, scale_lanes(k))
    yield BlockEnd(c0, e.f16(blk, 0), mins, b.fneg(e.f16(blk, 2)))


@layout(sub_cols=32, min_cols=32, narrow=True, short_scales=True, magnitude=15, unsigned=True)
def q4_k(e, blk, c0):
    return _k_asymmetric(e, blk, c0, quants_at=16, high_bits_at=0)


@layout(sub_cols=32, min_cols=32, narrow=True, short_scales=True, magnitude=31, unsigned=True)
def q5_k(e, blk, c0):
    return _k_asymmetric(e, blk, c0, quants_at=48, high_bits_at=16)


@layout(sub_cols=16, narrow=True, paired=True, magnitude=32)
def q6_k(e, blk, c0):
    """ql[128] | qh[64] | scales int8[16] | d f16: w = d * sc * (q - 32), 16-weight scales."""
    b = e.b
    scales = b.sext(e.load(blk, 192, V16I8), V16I32)  # the 16 scales, once
    two_bits = splat(V32I8, 0x30)
    for h in range(2):
        ql0, ql1 = e.load(blk, 64 * h, V32I8), e.load(blk, 64 * h + 32, V32I8)
        qh = e.load(blk, 128 + 32 * h, V32I8)
        lo0, hi0 = e.nibbles(ql0)
        lo1, hi1 = e.nibbles(ql1)
        for g, low in enumerate((lo0, lo1, hi0, hi1)):
            # bits 2g, 2g + 1 of qh are bits 4-5 of the weight: one shift and one mask
            shift = 4 - 2 * g
            if shift > 0:
                top = b.shl(qh, splat(V32I8, shift))
            elif shift < 0:
                top = b.lshr(qh, splat(V32I8, -shift))
            else:
                top = qh
            u = b.or_(low, b.and_(top, two_bits))
            k = 8 * h + 2 * g
            yield Chunk(e.chunk_index(c0, 4 * h + g), u, 32, e.lanes_of(scales, k))
    yield BlockEnd(c0, e.f16(blk, 208))


def _crumbs(e, blk, offset, h, j):
    """2-bit fields j of the 32 bytes at offset + 32h: the low bits of chunk 4h + j."""
    q = e.load(blk, offset + 32 * h, V32I8)
    return e.b.and_(e.b.lshr(q, splat(V32I8, 2 * j)), splat(V32I8, 3))


@layout(sub_cols=16, min_cols=16, narrow=True, paired=True, magnitude=3, unsigned=True)
def q2_k(e, blk, c0):
    """scales[16] (4-bit scale | 4-bit min << 4) | qs[64] | d f16 | dmin f16:
    w = d * sc * q - dmin * m per 16 weights, q 2 bits."""
    b = e.b
    packed = e.words(blk, 0, I8, 16)
    scales = b.and_(packed, splat(V16I32, 15))
    for h in range(2):
        for j in range(4):
            k = 8 * h + 2 * j
            yield Chunk(e.chunk_index(c0, 4 * h + j), _crumbs(e, blk, 16, h, j), 0,
                        e.lanes_of(scales, k))  # fmt: skip
    mins = b.lshr(packed, splat(V16I32, 4))
    yield BlockEnd(c0, e.f16(blk, 80), mins, b.fneg(e.f16(blk, 82)))


def _q3_k_scales(e, blk):
    """<16 x i32>: the 16 6-bit scales from the 12 packed bytes at offset 96, minus 32, with
    ggml's masks on the words aux0, aux1, tmp all at once (as _scales_mins_k4): [aux0, aux1,
    aux0 >> 4, aux1 >> 4] & 0x0F0F0F0F | ((tmp >> [0, 2, 4, 6]) & 0x03030303) << 4."""
    b = e.b
    v4 = ir.VectorType(I32, 4)
    words = e.load(blk, 96, ir.VectorType(I32, 3))  # aux0, aux1, tmp (12 bytes: the block's)

    def c(*values):
        return ir.Constant(v4, list(values))

    low = b.shuffle_vector(words, words, ir.Constant(v4, [0, 1, 0, 1]))
    low = b.and_(b.lshr(low, c(0, 0, 4, 4)), c(*[0x0F0F0F0F] * 4))
    top = b.shuffle_vector(words, words, ir.Constant(v4, [2, 2, 2, 2]))
    top = b.shl(b.and_(b.lshr(top, c(0, 2, 4, 6)), c(*[0x03030303] * 4)), c(4, 4, 4, 4))
    packed = b.zext(b.bitcast(b.or_(low, top), V16I8), V16I32)
    return b.sub(packed, splat(V16I32, 32))


@layout(sub_cols=16, narrow=True, paired=True, magnitude=4)
def q3_k(e, blk, c0):
    """hmask[32] | qs[64] | scales[12] (16 x 6 bits) | d f16: w = d * (sc - 32) * (q - 4) per 16
    weights, q = 2 low bits | (hmask bit) << 2."""
    b = e.b
    hmask = e.load(blk, 0, V32I8)
    scales = _q3_k_scales(e, blk)
    for h in range(2):
        for j in range(4):
            bit = b.and_(b.lshr(hmask, splat(V32I8, 4 * h + j)), splat(V32I8, 1))
            u = b.or_(_crumbs(e, blk, 32, h, j), b.shl(bit, splat(V32I8, 2)))
            yield Chunk(e.chunk_index(c0, 4 * h + j), u, 4, e.lanes_of(scales, 8 * h + 2 * j))
    yield BlockEnd(c0, e.f16(blk, 108))


# ---- i-quants: 4-bit indices into ggml's non-uniform grid kvalues_iq4nl


def _iq4_levels(e, blk, offset, grid=KVALUES_IQ4NL):
    """(u, offset) of 32 weights from the 16 bytes of 4-bit indices at blk + offset (low
    nibbles, then high): the int8 levels of `grid` looked up with vpshufb, which indexes each
    128-bit half of the table separately, so the 16 levels sit in both halves (or with vpermb,
    which reads 5 index bits of the whole table). For vpdpbusd the table holds the levels + 128
    (unsigned, 128 subtracted through the lane sums); AVX2 takes the int8 levels with ggml's
    sign trick."""
    if INSTRUCTION_SET == "vnni":
        levels, level_offset = [v + 128 for v in grid], 128
    else:
        levels, level_offset = list(grid), SIGNED
    table = ir.Constant(V32I8, [v if v < 128 else v - 256 for v in levels * 2])
    if BYTE_PERMUTES:  # vpermb of 32 bytes reads 5 index bits: the table twice covers bit 4
        indices = e.nibble_halves(blk, offset, masked=False)
        return e.intrinsic("llvm.x86.avx512.permvar.qi.256", V32I8, table, indices), level_offset
    return e.lookup(table, e.nibble_halves(blk, offset)), level_offset


@layout()
def iq4_nl(e, blk, c):
    """d f16 | qs[16]: w = d * level[q], as Q4_0 with a grid for q - 8."""
    u, offset = _iq4_levels(e, blk, 2)
    yield Chunk(c, u, offset)
    yield BlockEnd(c, e.f16(blk, 0))


# MXFP4: the e2m1 grid doubled (as int8), and the E8M0 exponent halved as the scale
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _e8m0_half(e, exponent):
    """float 2^(exponent - 128) from an i32 byte, as ggml_e8m0_to_fp32_half builds its bits:
    0x00200000 << e below 2 (subnormals), else (e - 1) << 23."""
    b = e.b
    small = b.shl(ir.Constant(I32, 0x00200000), exponent)
    normal = b.shl(b.sub(exponent, ONE), ir.Constant(I32, 23))
    below = b.icmp_unsigned("<", exponent, ir.Constant(I32, 2))
    return b.bitcast(b.select(below, small, normal), F32)


@layout()
def mxfp4(e, blk, c):
    """e u8 | qs[16]: w = 2^(e - 128) * grid[q], as IQ4_NL with the MXFP4 grid and an E8M0
    scale (ggml's vec_dot_mxfp4_q8_0)."""
    u, offset = _iq4_levels(e, blk, 1, KVALUES_MXFP4)
    yield Chunk(c, u, offset)
    yield BlockEnd(c, _e8m0_half(e, e.byte(blk, 0)))


@layout(sub_cols=32)
def iq4_xs(e, blk, c0):
    """d f16 | scales_h u16 | scales_l[4] | qs[128]: w = d * (ls - 32) * level[q] per 32
    weights (ggml's vec_dot_iq4_xs_q8_K)."""
    b = e.b
    # the 8 scales at once: nibble j of scales_l (bits 4j..4j+3 of its word), crumb j of scales_h
    low = b.lshr(e.splat8i(e.load(blk, 4, I32)), ir.Constant(V8I32, [4 * j for j in range(8)]))
    high = b.lshr(e.splat8i(e.words(blk, 2, I16, 1)), ir.Constant(V8I32, [2 * j for j in range(8)]))
    ls = b.or_(b.and_(low, splat(V8I32, 15)), b.shl(b.and_(high, splat(V8I32, 3)), splat(V8I32, 4)))
    scales = b.sub(ls, splat(V8I32, 32))  # each chunk takes its lane (intdot's wide sums put
    # the 8 back together into this vector, which LLVM sees through)
    for j in range(8):
        u, offset = _iq4_levels(e, blk, 8 + 16 * j)
        yield Chunk(e.chunk_index(c0, j), u, offset, b.extract_element(scales, ir.Constant(I32, j)))
    yield BlockEnd(c0, e.f16(blk, 0))


# ---- grid types: indices into ggml's tables of 4 or 8 levels, a sign bit per weight


class GridCodes(NamedTuple):
    """A grid of levels (uint8[entries, weights]) as one integer code per entry: level k's rank
    among the grid's levels at bit `bits` * k. An entry of 8 levels of 3 (IQ2) fits 16 bits, one
    of 4 levels of 8 (IQ3_XXS, IQ3_S) 12."""

    codes: np.ndarray  # uint16[entries]
    bits: int
    levels: tuple  # the levels by rank

    @classmethod
    def of(cls, grid):
        levels = np.unique(grid)
        bits = max(1, int(len(levels) - 1).bit_length())
        ranks = np.searchsorted(levels, grid).astype(np.uint32)
        codes = (ranks << (bits * np.arange(grid.shape[1], dtype=np.uint32))).sum(axis=1)
        return cls(codes.astype(np.uint16), bits, tuple(int(v) for v in levels))


IQ2XXS_CODES, IQ2XS_CODES = GridCodes.of(IQ2XXS_GRID), GridCodes.of(IQ2XS_GRID)
IQ3XXS_CODES, IQ3S_CODES = GridCodes.of(IQ3XXS_GRID), GridCodes.of(IQ3S_GRID)


def grid_codes(e, grid, indices):
    """<32 x i16>: the codes of grid entries `indices` (<32 x i16>, each below the entry count, a
    multiple of 64), the table held in the instructions: one vpermi2w per 64 entries (it reads
    6 index bits), their results picked by the index bits above (vptestmw, vpblendmw). Zen 4's
    gathers cost about as much as all the rest of a grid type's kernel (IQ2_XXS in cache: 3.7
    GB/s with them, 6.9 with its levels taken from anywhere else); with these lookups, one
    thread, in cache: IQ2_XXS 3.6 -> 4.8-5.0 GB/s, IQ2_XS (512 entries) 4.1 -> 4.7-4.8, IQ3_XXS
    3.7-3.8 -> 6.4-6.5, IQ3_S (512) 3.8 -> 6.4-6.6. IQ2_S (1024) and IQ1_S / IQ1_M (2048) keep
    their gathers."""
    b = e.b

    def words(values):
        return ir.Constant(V32I16, [int(v) - 65536 if v >= 32768 else int(v) for v in values])

    codes, parts = grid.codes, []
    for k in range(0, len(codes), 64):
        low, high = words(codes[k : k + 32]), words(codes[k + 32 : k + 64])
        parts.append(e.intrinsic("llvm.x86.avx512.vpermi2var.hi.512", V32I16, low, indices, high))
    bit = 64
    while len(parts) > 1:
        high = b.icmp_unsigned("!=", b.and_(indices, splat(V32I16, bit)), ir.Constant(V32I16, None))
        parts = [b.select(high, parts[k + 1], parts[k]) for k in range(0, len(parts), 2)]
        bit *= 2
    return parts[0]


def grid_levels(e, grid, codes, picks):
    """<64 x i8>: the levels of 64 weights from codes (<32 x i16>, grid_codes): qword j of the
    result from the codes picks[j] (one per qword for 8-level entries, two for 4-level ones),
    their fields cut out by one vpmultishiftqb and made levels by one vpermb (whose table repeats
    the levels by rank, so the bits above a field do not matter)."""
    b = e.b
    per_qword = len(picks) // 8
    words = [picks[j * per_qword + (w % 4) % per_qword] for j in range(8) for w in range(4)]
    spread = b.shuffle_vector(codes, codes, ir.Constant(ir.VectorType(I32, 32), words))
    weights_per_code = 8 // per_qword
    shifts = [16 * (k // weights_per_code) + grid.bits * (k % weights_per_code) for k in range(8)]
    fields = e.intrinsic("llvm.x86.avx512.pmultishift.qb.512", V64I8,
                         ir.Constant(V64I8, shifts * 8), b.bitcast(spread, V64I8))  # fmt: skip
    ranks = len(grid.levels)
    table = [grid.levels[i % (1 << grid.bits)] if i % (1 << grid.bits) < ranks else 0
             for i in range(64)]  # fmt: skip
    return e.intrinsic("llvm.x86.avx512.permvar.qi.512", V64I8, ir.Constant(V64I8, table), fields)


def _grid_table(e, name, grid):
    """A grid (uint8[entries, 4 or 8]) as a table of one i32 or i64 per entry."""
    width = grid.shape[1]
    return e.table(name, grid.view(f"<u{width}").reshape(-1), {4: I32, 8: I64}[width])


def _parity_signs():
    """ggml's keven_signs_q2xs as int64: entry i (< 128) the 8 sign bytes of 7 sign bits i and
    their parity as the 8th, each -1 where the bit is set, else 1 (a vpsignb operand)."""
    rows = []
    for i in range(128):
        bits = i | (bin(i).count("1") % 2) << 7
        rows.append([0xFF if bits >> k & 1 else 1 for k in range(8)])
    return np.array(rows, np.uint8).view("<i8").reshape(-1)


KEVEN_SIGNS = _parity_signs()


def _ksign_entries(e, fields):
    """Signs(bytes) of the 32 weights whose 4 x 7 sign bits are `fields` (4 scalars < 128): four
    table loads, ggml's AVX2 way."""
    table = e.table("keven_signs", KEVEN_SIGNS, I64)
    return Signs(bytes=e.b.bitcast(e.entries(table, fields), V32I8))


def _ksign_chunk(e, aux):
    """_ksign_entries of the 4 x 7 sign bits in aux's bits 0-27 (an i32)."""
    b = e.b
    fields = [b.and_(b.lshr(aux, ir.Constant(I32, 7 * k)), ir.Constant(I32, 127)) for k in range(4)]
    return _ksign_entries(e, fields)


def _scalar_indices(e, blk, low_at, n, high_at, high_type, bits):
    """n grid indices as i32 scalars (SCALAR_LOOKUPS): index k the byte at blk + low_at + k, and
    as its bits 8 and up the `bits` bits of the integer at blk + high_at (of high_type) from bit
    bits * k."""
    b = e.b
    high = b.zext(e.load(blk, high_at, high_type), I32)
    mask, eight = ir.Constant(I32, (1 << bits) - 1), ir.Constant(I32, 8)
    fields = [b.and_(b.lshr(high, ir.Constant(I32, bits * k)), mask) for k in range(n)]
    return [b.or_(e.byte(blk, low_at + k), b.shl(field, eight)) for k, field in enumerate(fields)]


def _aux_chunks(e, blk, c0, table, n, aux_at, auxes):
    """IQ2_XXS's and IQ3_XXS's chunks with SCALAR_LOOKUPS: chunk j's n grid indices the bytes at
    blk + 2 + 8j, its aux word (4 x 7 sign bits, the scale s in bits 28-31) at blk + aux_at(j),
    lane j of `auxes` (<8 x i32>), its scale 2s + 1 (the block's 8 made at once)."""
    b = e.b
    odds = b.or_(b.lshr(auxes, splat(V8I32, 27)), splat(V8I32, 1))
    for j in range(8):
        levels = e.entries(table, [e.byte(blk, 2 + 8 * j + k) for k in range(n)])
        signs = _ksign_chunk(e, e.load(blk, aux_at(j), I32))
        yield Chunk(e.chunk_index(c0, j), b.bitcast(levels, V32I8), signs, e.spread(odds, [j] * 8))


@layout(sub_cols=32, narrow=True)
def iq3_s(e, blk, c0):
    """d f16 | qs[64] | qh[8] | signs[32] | scales[4]: w = d * (1 + 2 * scale) * level * sign
    (see iquants.py). Per 64 weights: 16 9-bit grid indices -> their 16 x 4 levels (one gather,
    or grid_codes for the block's 64), the 64 sign bits; as ggml's vec_dot_iq3_s_q8_K."""
    b = e.b
    if SCALAR_LOOKUPS:
        table = _grid_table(e, "iq3s_grid", IQ3S_GRID)
        odds = _nibble_odds(e, blk, 106, 8)
        for j in range(8):
            levels = e.entries(table, _scalar_indices(e, blk, 2 + 8 * j, 8, 66 + j, I8, 1))
            signs = Signs(e.sign_bits(e.load(blk, 74 + 4 * j, I32)))
            yield Chunk(e.chunk_index(c0, j), b.bitcast(levels, V32I8), signs,
                        e.spread(odds, [j] * 8))  # fmt: skip
        yield BlockEnd(c0, e.f16(blk, 0))
        return
    if PERMUTED_GRIDS:  # the codes of entries 0-31 and 32-63: index bit 8 from qh's bits
        halves = []
        for h in (0, 1):
            low = b.zext(e.load(blk, 2 + 32 * h, V32I8), V32I16)
            high = b.bitcast(e.load(blk, 66 + 4 * h, I32), ir.VectorType(ir.IntType(1), 32))
            indices = b.or_(low, b.select(high, splat(V32I16, 256), ir.Constant(V32I16, None)))
            halves.append(grid_codes(e, IQ3S_CODES, indices))
    else:
        table = _grid_table(e, "iq3s_grid", IQ3S_GRID)
    odds = _nibble_odds(e, blk, 106, 8)
    for p in range(4):
        if PERMUTED_GRIDS:
            first = 16 * (p % 2)
            levels = grid_levels(e, IQ3S_CODES, halves[p // 2], list(range(first, first + 16)))
        else:
            low = e.words(blk, 2 + 16 * p, I8, 16)
            if MASK_REGISTERS:  # index bit 8 by a mask of qh's 16 bits (kmovw), a masked or
                high = b.bitcast(e.load(blk, 66 + 2 * p, I16), ir.VectorType(ir.IntType(1), 16))
                high = b.select(high, splat(V16I32, 256), ir.Constant(V16I32, None))
            else:
                qh = e.spread(e.words(blk, 66 + 2 * p, I16, 1), [0] * 16)
                high = b.and_(b.lshr(qh, ir.Constant(V16I32, list(range(16)))), splat(V16I32, 1))
                high = b.shl(high, splat(V16I32, 8))
            levels = b.bitcast(e.gather(table, b.or_(low, high)), V64I8)
        signs = Signs(e.sign_bits(e.load(blk, 74 + 8 * p, V8I8)))
        odd = e.spread(odds, [2 * p] * 8 + [2 * p + 1] * 8)
        yield Chunk(e.chunk_index(c0, 2 * p), levels, signs, odd)
    yield BlockEnd(c0, e.f16(blk, 0))


def _ksigns(e, word, shifts):
    """Signs of 32 weights, 8 per 7 sign bits of the integer `word` (i32 or i64) at bit positions
    `shifts`; the 8th sign is their parity (ggml's ksigns_iq2xs). With GFNI and BITALG four
    instructions: the word in 4 lanes of i64, each shifted to its field, one vgf2p8affineqb
    (each lane's low byte: its 7 bits, their parity as bit 7) and one vpshufbitqmb (those bytes'
    32 bits as a mask)."""
    b = e.b
    v4i64 = ir.VectorType(I64, 4)
    lanes = b.lshr(e.spread(b.zext(word, I64) if word.type != I64 else word, [0] * 4),
                   ir.Constant(v4i64, shifts))  # fmt: skip
    return _ksign_mask(e, lanes)


# Bit 7 of byte i: the parity of i's 4 bits (a vpshufb table, in both 128-bit halves)
NIBBLE_PARITY = [0x80 * (bin(i % 16).count("1") % 2) for i in range(32)]


def _ksign_bytes(e, words, shifts):
    """Signs of 64 weights (<64 x i1>) without GFNI: as _ksigns_wide, in ymm steps for both
    words at once. The 8 fields to dwords (one vpermd, one vpsrlvd: a field never crosses a
    dword), the parity of each field's 7 bits from two lookups of nibble parity (vpshufb, as
    ggml's AVX2 vec_dot_iq2_xs_q8_K), and each 32 weights' sign bytes spread to their bytes by
    one vpshufb, tested against each byte's bit. Lane order: fields 0, 1 of both words in the
    low 128 bits, fields 2, 3 in the high ones, so that each spread stays in its half. Zen 3,
    one thread, in cache: where vpopcntd's emulation and a byte spread per 32 weights took
    twice the instructions (ctpop.v4i32 without vpopcntd is a dozen), G MAC/s: IQ3_XXS 4.8 ->
    7.6, IQ2_XS 5.7 -> 8.8, IQ2_XXS 5.8 -> 8.8."""
    b = e.b
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]  # (word, field)
    dwords = b.bitcast(words, V4I32)
    lanes = e.spread(dwords, [2 * j + shifts[k] // 32 for j, k in order])
    lanes = b.lshr(lanes, ir.Constant(V8I32, [shifts[k] % 32 for _, k in order]))
    fields = b.bitcast(b.and_(lanes, splat(V8I32, 127)), V32I8)
    table = ir.Constant(V32I8, NIBBLE_PARITY)
    high = b.bitcast(b.lshr(b.bitcast(fields, V8I32), splat(V8I32, 4)), V32I8)
    parity = b.xor(e.lookup(table, fields), e.lookup(table, high))
    signs = b.or_(fields, parity)  # each dword's low byte: 8 signs
    bit_of = ir.Constant(V32I8, [1 << (i % 8) for i in range(32)])
    bits = []
    for j in (0, 1):  # word j's sign bytes: dwords 2j, 2j + 1 of each 128-bit half
        picks = ir.Constant(V32I8, ([8 * j] * 8 + [8 * j + 4] * 8) * 2)
        spread = b.and_(e.lookup(signs, picks), bit_of)
        bits.append(b.icmp_unsigned("!=", spread, ir.Constant(V32I8, None)))
    both = ir.Constant(ir.VectorType(I32, 64), list(range(64)))
    return Signs(b.shuffle_vector(bits[0], bits[1], both))


def _ksigns_wide(e, words, shifts):
    """Signs of 64 weights (<64 x i1>): _ksigns of words[0] (weights 0-31) and words[1] (<2 x
    i64>), in one zmm each step where there are 512-bit registers; without GFNI
    _ksign_bytes."""
    b = e.b
    if not BIT_SHUFFLES:
        return _ksign_bytes(e, words, shifts)
    if not ZMM:
        first, second = (_ksigns(e, b.extract_element(words, ir.Constant(I32, k)), shifts)
                         for k in (0, 1))  # fmt: skip
        both = ir.Constant(ir.VectorType(I32, 64), list(range(64)))
        return Signs(b.shuffle_vector(first.bits, second.bits, both))
    lanes = b.shuffle_vector(words, words, ir.Constant(V8I32, [0] * 4 + [1] * 4))
    return _ksign_mask(e, b.lshr(lanes, ir.Constant(ir.VectorType(I64, 8), shifts * 2)))


def _ksign_mask(e, lanes):
    """Signs (<8n x i1>) of n lanes of i64 (n = 4 or 8) whose low bytes hold 7 sign bits each:
    one vgf2p8affineqb writes their parity as bit 7, one vpshufbitqmb takes the bytes' bits."""
    n = lanes.type.count
    v_i8 = ir.VectorType(I8, 8 * n)
    with_parity = e.intrinsic(
        f"llvm.x86.vgf2p8affineqb.{64 * n}", v_i8, e.b.bitcast(lanes, v_i8),
        e.b.bitcast(splat(lanes.type, KSIGNS_AFFINE), v_i8), ir.Constant(I8, 0),
    )  # fmt: skip
    bit_of = ir.Constant(v_i8, list(range(8)) * n)
    bits = ir.VectorType(ir.IntType(1), 8 * n)
    return Signs(e.intrinsic(f"llvm.x86.avx512.vpshufbitqmb.{64 * n}", bits, with_parity, bit_of))


# vgf2p8affineqb's matrix for ksigns: output bit i (< 7) is input bit i (matrix byte 7 - i holds
# 1 << i), output bit 7 the parity of input bits 0-6 (byte 0: 0x7F)
KSIGNS_AFFINE = 0x010204081020407F


def _block_aux(e, words, shift):
    """(Signs, 2s + 1 as <16 x i32>) of each 64 weights of an IQ2_XXS / IQ3_XXS block from its 8
    aux words, one in each lane of `words` (<8 x i64>) from bit `shift` on: 4 x 7 sign bits, the
    scale s in the word's top 4 bits. The block's 32 sign fields at once (with VBMI and GFNI):
    one vpmultishiftqb cuts them out, one vgf2p8affineqb writes their parity as bit 7 (ggml's
    ksigns), and _sign_masks makes each 64 weights' mask from those bytes; where _ksigns_wide
    took four instructions per 64 weights. The scales likewise: two instructions for the block,
    one spread per 64 weights. One thread, in cache: IQ2_XXS 4.8-5.0 -> 5.4 GB/s, IQ3_XXS
    6.4-6.5 -> 7.3."""
    b = e.b
    v8i64 = ir.VectorType(I64, 8)
    control = ir.Constant(V64I8, [shift + 7 * (k % 4) for k in range(8)] * 8)
    fields = e.intrinsic("llvm.x86.avx512.pmultishift.qb.512", V64I8, control,
                         b.bitcast(words, V64I8))  # fmt: skip
    matrix = b.bitcast(splat(v8i64, KSIGNS_AFFINE), V64I8)
    signs = e.intrinsic("llvm.x86.vgf2p8affineqb.512", V64I8, fields, matrix, ir.Constant(I8, 0))
    # byte k of qword j: the signs of entry k (< 4) of word j
    masks = _sign_masks(e, signs, lambda p, g: 8 * (2 * p + g // 4) + g % 4)
    # 2s + 1 in the low half of each lane, spread from there (no vpmovqd)
    odd = b.bitcast(b.or_(b.lshr(words, splat(v8i64, shift + 27)), splat(v8i64, 1)), V16I32)
    for p in range(4):
        yield masks[p], e.spread(odd, [4 * p] * 8 + [4 * p + 2] * 8)


def _sign_masks(e, signs, byte_of):
    """The Signs of a block's 4 x 64 weights from the bytes of `signs` (<64 x i8>) whose bits are
    the signs of 8 weights each, byte_of(p, g) that of the g-th 8 of the p-th 64: transposed by
    one vpermb (byte p of qword g that byte), each 64's mask is one vpshufbitqmb that picks
    bits 8p .. 8p + 7 of every qword. Moving 64 bits from a vector to a mask register otherwise
    takes an extract to a general register and a kmovq, both on port 5 on Intel (one thread,
    in cache, Sapphire Rapids: IQ3_XXS 5.5 -> 6.2 GB/s)."""
    picks = [byte_of(p % 4, g) for g in range(8) for p in range(8)]
    by_chunk = e.b.shuffle_vector(signs, signs, ir.Constant(ir.VectorType(I32, 64), picks))
    mask = ir.VectorType(ir.IntType(1), 64)
    return [
        Signs(e.intrinsic("llvm.x86.avx512.vpshufbitqmb.512", mask, by_chunk,
                          ir.Constant(V64I8, [8 * p + k % 8 for k in range(64)])))
        for p in range(4)
    ]  # fmt: skip


def _nibble_odds(e, blk, offset, n):
    """<n x i32> (n = 8 or 16): 2s + 1 of the n nibbles s of the n / 2 bytes at blk + offset
    (nibble m: byte m // 2, low half first), each chunk's scales a spread of these: a block's
    scales made once, not once a chunk."""
    b = e.b
    vec = ir.VectorType(I32, n)
    words = e.words(blk, offset, I32, n // 8) if n == 16 else e.load(blk, offset, I32)
    lanes = e.spread(words, [m // 8 for m in range(n)])
    nibbles = b.lshr(lanes, ir.Constant(vec, [4 * (m % 8) for m in range(n)]))
    return b.or_(b.shl(b.and_(nibbles, splat(vec, 15)), splat(vec, 1)), splat(vec, 1))


def _high_index_bits(e, blk, offset, shifts, mask):
    """<8 x i32>: (word >> shifts[k]) & mask << 8 in lane k, word the u32 at blk + offset (with
    VBMI: the u32 broadcast from memory, one vpmultishiftqb cuts each field into its lane's second
    byte, where a broadcast, variable shift, and and shift took four instructions)."""
    b = e.b
    word = e.spread(e.load(blk, offset, I32), [0] * 8)
    if not BYTE_PERMUTES:
        high = b.and_(b.lshr(word, ir.Constant(V8I32, shifts)), splat(V8I32, mask))
        return b.shl(high, splat(V8I32, 8))
    control = ir.Constant(V32I8, [shifts[k // 4] % 32 if k % 4 == 1 else 0 for k in range(32)])
    fields = e.intrinsic("llvm.x86.avx512.pmultishift.qb.256", V32I8, control,
                         b.bitcast(word, V32I8))  # fmt: skip
    return b.and_(b.bitcast(fields, V8I32), splat(V8I32, mask << 8))


def _odd_top(e, aux):
    """<16 x i32>: 2s + 1 of the scales s in bits 28-31 of aux[0] (lanes 0-7, the first chunk)
    and aux[1] (lanes 8-15); aux >> 27 is 2s plus a bit that the | 1 covers."""
    b = e.b
    top = b.lshr(e.spread(aux, [0] * 8 + [1] * 8), splat(V16I32, 27))
    return b.or_(top, splat(V16I32, 1))


@layout(sub_cols=32, narrow=True)
def iq3_xxs(e, blk, c0):
    """d f16 | qs[64] | 8 x u32 (4 x 7 sign bits, scale s in bits 28-31): w = d * (2s + 1) / 4 *
    level * sign (see iquants.py): one gather of 16 grid entries per 64 weights (or grid_codes
    for the block's 64), the sign bytes' parity as in ggml's vec_dot_iq3_xxs_q8_K."""
    b = e.b
    if SCALAR_LOOKUPS:
        table = _grid_table(e, "iq3xxs_grid", IQ3XXS_GRID)
        auxes = e.load(blk, 66, V8I32)
        yield from _aux_chunks(e, blk, c0, table, 8, lambda j: 66 + 4 * j, auxes)
        yield BlockEnd(c0, b.fmul(e.f16(blk, 0), ir.Constant(F32, 0.25)))
        return
    if PERMUTED_GRIDS:  # the codes of entries 0-31 and 32-63
        halves = [grid_codes(e, IQ3XXS_CODES, b.zext(e.load(blk, 2 + 32 * h, V32I8), V32I16))
                  for h in (0, 1)]  # fmt: skip
    else:
        table = _grid_table(e, "iq3xxs_grid", IQ3XXS_GRID)
    if BLOCK_SIGNS:
        aux = b.zext(e.load(blk, 66, V8I32), ir.VectorType(I64, 8))
        signs_scales = list(_block_aux(e, aux, 0))
    for p in range(4):
        if PERMUTED_GRIDS:
            first = 16 * (p % 2)
            levels = grid_levels(e, IQ3XXS_CODES, halves[p // 2], list(range(first, first + 16)))
        else:
            levels = b.bitcast(e.gather(table, e.words(blk, 2 + 16 * p, I8, 16)), V64I8)
        if BLOCK_SIGNS:
            signs, odd = signs_scales[p]
        else:
            aux = e.words(blk, 66 + 8 * p, I32, 2)
            signs = _ksigns_wide(e, b.zext(aux, ir.VectorType(I64, 2)), [0, 7, 14, 21])
            odd = _odd_top(e, aux)
        yield Chunk(e.chunk_index(c0, 2 * p), levels, signs, odd)
    yield BlockEnd(c0, e.b.fmul(e.f16(blk, 0), ir.Constant(F32, 0.25)))


@layout(sub_cols=32, narrow=True)
def iq2_xxs(e, blk, c0):
    """d f16 | 8 x (u32 of 4 grid indices, u32 of 4 x 7 sign bits and a scale s in bits 28-31):
    w = d * (2s + 1) / 8 * level * sign. Per 64 weights one gather of 8 grid entries of 8
    levels (or grid_codes for the block's 32); as ggml's vec_dot_iq2_xxs_q8_K."""
    b = e.b
    if SCALAR_LOOKUPS:
        table = _grid_table(e, "iq2xxs_grid", IQ2XXS_GRID)
        auxes = e.spread(e.load(blk, 2, V16I32), list(range(1, 16, 2)))  # qs' odd words
        yield from _aux_chunks(e, blk, c0, table, 4, lambda j: 6 + 8 * j, auxes)
        yield BlockEnd(c0, b.fmul(e.f16(blk, 0), ir.Constant(F32, 0.125)))
        return
    qs = e.load(blk, 2, V64I8)  # the block after d: qword j = indices of chunk j | aux j << 32
    if PERMUTED_GRIDS:  # the block's 32 indices (bytes 8j .. 8j + 3) as words
        picks = [k for g in range(32) for k in (8 * (g // 4) + g % 4, 64)]  # 64: a zero byte
        both = b.shuffle_vector(qs, ir.Constant(V64I8, None),
                                ir.Constant(ir.VectorType(I32, 64), picks))  # fmt: skip
        codes = grid_codes(e, IQ2XXS_CODES, b.bitcast(both, V32I16))
    else:
        table = _grid_table(e, "iq2xxs_grid", IQ2XXS_GRID)
    if BLOCK_SIGNS:
        signs_scales = list(_block_aux(e, b.bitcast(qs, ir.VectorType(I64, 8)), 32))
    for p in range(4):
        pair = e.load(blk, 2 + 16 * p, V16I8)  # indices 0-3, aux 0, indices 4-7, aux 1
        if PERMUTED_GRIDS:
            levels = grid_levels(e, IQ2XXS_CODES, codes, list(range(8 * p, 8 * p + 8)))
        else:
            indices = b.zext(e.spread(pair, [0, 1, 2, 3, 8, 9, 10, 11]), V8I32)
            levels = b.bitcast(e.gather(table, indices, I64), V64I8)
        if BLOCK_SIGNS:
            signs, odd = signs_scales[p]
        else:
            signs = _ksigns_wide(e, b.bitcast(pair, ir.VectorType(I64, 2)), [32, 39, 46, 53])
            odd = _odd_top(e, e.spread(b.bitcast(pair, V4I32), [1, 3]))
        yield Chunk(e.chunk_index(c0, 2 * p), levels, signs, odd)
    yield BlockEnd(c0, b.fmul(e.f16(blk, 0), ir.Constant(F32, 0.125)))


@layout(sub_cols=16, narrow=True)
def iq2_xs(e, blk, c0):
    """d f16 | qs u16[32] (9-bit grid index | 7 sign bits << 9, per 8 weights) | scales[8] (4
    bits per 16 weights): w = d * (2s + 1) / 8 * level * sign."""
    b = e.b
    if SCALAR_LOOKUPS:
        table = _grid_table(e, "iq2xs_grid", IQ2XS_GRID)
        odds = _nibble_odds(e, blk, 66, 16)
        for j in range(8):
            q = [b.zext(e.load(blk, 2 + 8 * j + 2 * k, I16), I32) for k in range(4)]
            levels = e.entries(table, [b.and_(v, ir.Constant(I32, 511)) for v in q])
            signs = _ksign_entries(e, [b.lshr(v, ir.Constant(I32, 9)) for v in q])
            odd = e.spread(odds, [2 * j] * 4 + [2 * j + 1] * 4)
            yield Chunk(e.chunk_index(c0, j), b.bitcast(levels, V32I8), signs, odd)
        yield BlockEnd(c0, b.fmul(e.f16(blk, 0), ir.Constant(F32, 0.125)))
        return
    qs = e.load(blk, 2, V32I16)
    if PERMUTED_GRIDS:
        codes = grid_codes(e, IQ2XS_CODES, b.and_(qs, splat(V32I16, 511)))
    else:
        table = _grid_table(e, "iq2xs_grid", IQ2XS_GRID)
    if BLOCK_SIGNS:  # the 32 sign fields' bytes (each word >> 9) with their parity as bit 7
        matrix = b.bitcast(splat(ir.VectorType(I64, 8), KSIGNS_AFFINE), V64I8)
        fields = b.bitcast(b.lshr(qs, splat(V32I16, 9)), V64I8)
        signs = e.intrinsic("llvm.x86.vgf2p8affineqb.512", V64I8, fields, matrix,
                            ir.Constant(I8, 0))  # fmt: skip
        masks = _sign_masks(e, signs, lambda p, g: 2 * (8 * p + g))
    odds = _nibble_odds(e, blk, 66, 16)
    for p in range(4):
        if PERMUTED_GRIDS:
            levels = grid_levels(e, IQ2XS_CODES, codes, list(range(8 * p, 8 * p + 8)))
        else:
            q = e.words(blk, 2 + 16 * p, I16, 8)
            levels = b.bitcast(e.gather(table, b.and_(q, splat(V8I32, 511)), I64), V64I8)
        if BLOCK_SIGNS:
            signs = masks[p]
        else:
            words = e.load(blk, 2 + 16 * p, ir.VectorType(I64, 2))
            signs = _ksigns_wide(e, words, [9, 25, 41, 57])
        odd = e.spread(odds, [4 * p + k // 4 for k in range(16)])
        yield Chunk(e.chunk_index(c0, 2 * p), levels, signs, odd)
    yield BlockEnd(c0, b.fmul(e.f16(blk, 0), ir.Constant(F32, 0.125)))


@layout(sub_cols=16, narrow=True)
def iq2_s(e, blk, c0):
    """d f16 | qs[32] | signs[32] | qh[8] | scales[8]: per 8 weights a 10-bit grid index (qs,
    2 bits of qh), a sign bit per weight, 4-bit scales per 16: w = d * (2s + 1) / 8 * level *
    sign."""
    b = e.b
    table = _grid_table(e, "iq2s_grid", IQ2S_GRID)  # 1024 entries: grid_codes was no
    # faster here (16 permutes and 15 blends per 32 entries; in cache 4.5 -> 3.7-4.4 GB/s)
    odds = _nibble_odds(e, blk, 74, 16)
    if SCALAR_LOOKUPS:
        for j in range(8):
            levels = e.entries(table, _scalar_indices(e, blk, 2 + 4 * j, 4, 66 + j, I8, 2))
            signs = Signs(e.sign_bits(e.load(blk, 34 + 4 * j, I32)))
            odd = e.spread(odds, [2 * j] * 4 + [2 * j + 1] * 4)
            yield Chunk(e.chunk_index(c0, j), b.bitcast(levels, V32I8), signs, odd)
        yield BlockEnd(c0, b.fmul(e.f16(blk, 0), ir.Constant(F32, 0.125)))
        return
    for p in range(4):
        high = _high_index_bits(e, blk, 66 + 2 * p, list(range(0, 16, 2)), 3)  # qh's u16
        levels = e.gather(table, b.or_(e.words(blk, 2 + 8 * p, I8, 8), high), I64)
        signs = Signs(e.sign_bits(e.load(blk, 34 + 8 * p, V8I8)))
        odd = e.spread(odds, [4 * p + k // 4 for k in range(16)])
        yield Chunk(e.chunk_index(c0, 2 * p), b.bitcast(levels, V64I8), signs, odd)
    yield BlockEnd(c0, b.fmul(e.f16(blk, 0), ir.Constant(F32, 0.125)))


def _iq1_table(e, with_deltas=False):
    """iq1s_grid with each level -1, 0, 1 as 8 * (level + 1): 8 * (level +- 1/8) is that minus
    7 or 9, an integer offset (IQ1_DELTA = 1/8). with_deltas (IQ1_M): 4096 entries, the 2048
    plus 2 (delta +1/8, so that the weight is u - 9), then the 2048 as they are (-1/8)."""
    levels = ((IQ1_GRID.astype(np.int16) + 1) * 8).astype(np.uint8)
    if with_deltas:
        both = np.concatenate([levels + 2, levels])
        return e.table("iq1m_grid", both.view("<u8").reshape(-1), I64)
    return e.table("iq1_grid", levels.view("<u8").reshape(-1), I64)


@layout(sub_cols=32, min_cols=32, narrow=True)
def iq1_s(e, blk, c0):
    """d f16 | qs[32] | qh u16[8] (4 x 3 high index bits, scale s, the delta's sign): w = d *
    (2s + 1) * (level +- 1/8), here d / 8 * (2s + 1) * (8 * (level + 1) - (7 or 9)). The
    offsets 7 or 9 as the k-quants' minimums: (2s + 1) * (7 or 9) per 32 weights times their
    activations' sum, in the block's float steps (ggml sums the delta's term apart too), where an
    offset a chunk cost three instructions a row (its spread, negation and vpmaddwd)."""
    b = e.b
    table = _iq1_table(e)
    qh8 = e.words(blk, 34, I16, 8)  # each 32 weights' delta sign (bit 15) and scale (12-14)
    offsets = b.add(b.and_(b.lshr(qh8, splat(V8I32, 14)), splat(V8I32, 2)), splat(V8I32, 7))
    odds = b.or_(b.and_(b.lshr(qh8, splat(V8I32, 11)), splat(V8I32, 14)), splat(V8I32, 1))
    if SCALAR_LOOKUPS:  # a chunk at a time: qh's u16 holds its 4 x 3 high index bits
        for j in range(8):
            levels = e.entries(table, _scalar_indices(e, blk, 2 + 4 * j, 4, 34 + 2 * j, I16, 3))
            yield Chunk(e.chunk_index(c0, j), b.bitcast(levels, V32I8), 0, e.spread(odds, [j] * 8))
    else:
        for p in range(4):  # the two chunks' u16 in one word
            high = _high_index_bits(e, blk, 34 + 4 * p, [0, 3, 6, 9, 16, 19, 22, 25], 7)
            indices = b.or_(e.words(blk, 2 + 8 * p, I8, 8), high)
            levels = b.bitcast(e.gather(table, indices, I64), V64I8)
            odd = e.spread(odds, [2 * p] * 8 + [2 * p + 1] * 8)
            yield Chunk(e.chunk_index(c0, 2 * p), levels, 0, odd)
    d = b.fmul(e.f16(blk, 0), ir.Constant(F32, 0.125))
    yield BlockEnd(c0, d, b.mul(odds, offsets), b.fneg(d))  # offset 7, or 9: delta negative


@layout(sub_cols=16, min_cols=16, narrow=True)
def iq1_m(e, blk, c0):
    """qs[32] | qh[16] (per 8 weights a nibble: 3 high index bits, the delta's sign) | scales
    u16[4] (3-bit scales per 16 weights, the f16 d in the top nibbles): as IQ1_S, with the
    delta per 8 weights. The nibble's 4 bits above the index byte select an entry of a grid of
    4096: the 2048 levels 8 * (level + 1) + 2 (delta +1/8), then the same + 0 (-1/8), so that
    every weight is u - 9, the offset 9 a minimum per 16 weights (9 * (2s + 1)) as IQ1_S's;
    where a chunk's deltas and scales took ten instructions a row."""
    b = e.b
    table = _iq1_table(e, with_deltas=True)
    sc = e.words(blk, 48, I16, 4)
    top = b.and_(sc, splat(V4I32, 0xF000))
    bits = b.lshr(top, ir.Constant(V4I32, [12, 8, 4, 0]))
    bits = e.intrinsic("llvm.vector.reduce.or.v4i32", I32, bits)  # d's 4 nibbles in place
    d = b.fpext(b.bitcast(b.trunc(bits, I16), ir.HalfType()), F32)
    scales = b.lshr(e.spread(sc, [j // 4 for j in range(16)]),
                    ir.Constant(V16I32, [3 * (j % 4) for j in range(16)]))  # fmt: skip
    odds = b.or_(b.shl(b.and_(scales, splat(V16I32, 7)), splat(V16I32, 1)), splat(V16I32, 1))
    if SCALAR_LOOKUPS:  # a chunk at a time: qh's u16 holds its 4 high index nibbles
        for j in range(8):
            levels = e.entries(table, _scalar_indices(e, blk, 4 * j, 4, 32 + 2 * j, I16, 4))
            odd = e.spread(odds, [2 * j] * 4 + [2 * j + 1] * 4)
            yield Chunk(e.chunk_index(c0, j), b.bitcast(levels, V32I8), 0, odd)
    else:
        for p in range(4):
            high = _high_index_bits(e, blk, 32 + 4 * p, list(range(0, 32, 4)), 15)  # qh's nibbles
            indices = b.or_(e.words(blk, 8 * p, I8, 8), high)
            levels = b.bitcast(e.gather(table, indices, I64), V64I8)
            odd = e.spread(odds, [4 * p + k // 4 for k in range(16)])
            yield Chunk(e.chunk_index(c0, 2 * p), levels, 0, odd)
    d = b.fmul(d, ir.Constant(F32, 0.125))
    yield BlockEnd(c0, d, b.mul(odds, splat(V16I32, 9)), b.fneg(d))


# ---- ternary: w = d * (q - 1), q in 0..2, one scale per 256 weights


@layout()
def tq2_0(e, blk, c0):
    """qs[64] 2-bit | d f16: Q2_K's low bits without sub-block scales."""
    for h in range(2):
        for j in range(4):
            yield Chunk(e.chunk_index(c0, 4 * h + j), _crumbs(e, blk, 0, h, j), 1)
    yield BlockEnd(c0, e.f16(blk, 64))


def _trits(e, v, powers):
    """Trit 3^k of each byte of v (<n x i8>; `powers`: 3^k per byte): ((v * 3^k mod 256) * 3)
    >> 8, 0..2 (see ternary.py), in place in the bytes' 16-bit words. A byte moved to its word's
    high half (a shift for the even bytes, which LLVM folds into the multiply; a mask for the odd)
    times 3^k is (v * 3^k mod 256) << 8 (vpmullw); the high half of that times 3 is the trit, in
    the low byte (vpmulhuw), and times 3 << 8 the trit in the high byte above garbage, which one
    vpternlogq masks while it merges the two. ggml widens the bytes to words and packs them back
    (vpmovzxbw, vpmovwb: two uops a zmm on one port); in cache, 2 threads, TQ1_0 8.2 -> 16.4
    GB/s (Sapphire Rapids)."""
    b = e.b
    n = v.type.count
    words = ir.VectorType(I16, n // 2)
    w = b.bitcast(v, words)
    high = {0: b.shl(w, splat(words, 8)), 1: b.and_(w, splat(words, 0xFF00))}
    name = {16: "llvm.x86.avx2.pmulhu.w", 32: "llvm.x86.avx512.pmulhu.w.512"}[n // 2]
    trits = []
    for parity in (0, 1):
        scaled = b.mul(high[parity], ir.Constant(words, powers[parity::2]))
        trits.append(e.intrinsic(name, words, scaled, splat(words, 3 << (8 * parity))))
    return b.bitcast(b.or_(trits[0], b.and_(trits[1], splat(words, 0xFF00))), v.type)


# TQ1_0's 32-weight chunks as (bytes of [qs[0:32] | qs[32:48] | qh[0:4] four times], the power
# of 3 of each byte's trit): chunks 0-4 the trits of qs[0:32], 5-7 pair the 16-weight trits of
# qs[32:48], the last with qh's 16 weights (byte i's trit k is weight 240 + 4k + i)
_TQ1_CHUNKS = [(list(range(32)), [3**k] * 32) for k in range(5)] + [
    (list(range(32, 48)) * 2, [1] * 16 + [3] * 16),
    (list(range(32, 48)) * 2, [9] * 16 + [27] * 16),
    (list(range(32, 64)), [81] * 16 + [3 ** (j // 4) for j in range(16)]),
]


@layout()
def tq1_0(e, blk, c0):
    """qs[48] | qh[4] | d f16: five trits per byte of qs, four per byte of qh (see ternary.py),
    as _TQ1_CHUNKS; two chunks a zmm where 512-bit registers are in use."""
    b = e.b
    qh = e.spread(e.load(blk, 48, ir.VectorType(I8, 4)), [0, 1, 2, 3] * 4)
    source = e.concat(e.load(blk, 0, V32I8), e.concat(e.load(blk, 32, V16I8), qh))
    per = 2 if ZMM else 1
    for k in range(0, 8, per):
        picks = [i for j in range(k, k + per) for i in _TQ1_CHUNKS[j][0]]
        powers = [p for j in range(k, k + per) for p in _TQ1_CHUNKS[j][1]]
        v = b.shuffle_vector(source, source, ir.Constant(ir.VectorType(I32, len(picks)), picks))
        yield Chunk(e.chunk_index(c0, k), _trits(e, v, powers), 1)
    yield BlockEnd(c0, e.f16(blk, 52))
