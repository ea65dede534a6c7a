"""Integer dot products on x86 SIMD (AVX-512 VNNI, AVX-VNNI or AVX2), as ggml's CPU kernels do.

ggml quantizes each activation row to int8 blocks (Q8_0/Q8_1/Q8_K, see activations.py) and
multiplies them with the weight's integer quants, applying the float scales once per block. Here
that is done with `vpdpbusd` (unsigned x signed bytes, four products summed per int32 lane), on
the GGUF blocks exactly as they sit in the memory map: no repacking, no copy.

    qt = get_quant_type(ggml_type)                # its record names the unpacker used here
    quantize_q8(x, Q8_BLOCK_SIZE[qt.vec_dot_type], *xq)  # xq = activation_buffers(1, n_cols)
    qt.int_matvec((w,), *xq, (out,))              # w: uint8[n_rows, row_bytes], out: [1, n_rows]

The dot products are LLVM IR written with llvmlite and called from Numba as an intrinsic
(`_rows`), four weight rows at a time so that they share the activation loads, with a software
prefetch ahead of the weight stream. One 32-weight chunk at a time:

    u      <32 x u8>   the weight quants as unsigned levels (nibbles, plus high bits)
    x      <32 x i8>   the activation quants of the same 32 columns
    isum   <8 x i32>   vpdpbusd(init, u, x): lane l sums the 4 products of columns 4l..4l+3
    acc    <8 x f32>   += float(isum) * (weight scale * activation scale), per lane

Weights are w = d * (u - o) for the symmetric types (Q4_0: o = 8, Q5_0: 16, Q8_0: 128 after
flipping the sign bit, Q6_K: 32): `init = -o * xl` subtracts o * (sum of the 4 activations) per
lane in integers, from `xl`, computed once per activation row. The asymmetric types (w = d * u + m)
add m * xs per block instead, xs = d_x * sum(q_x) of the block.
IQ4_NL / IQ4_XS weights are levels of a fixed int8 grid: `vpshufb` looks the 4-bit indices up
(levels + 128, o = 128, for vpdpbusd).

`INSTRUCTION_SET` is chosen from the CPU features Numba compiles for that this CPU also has
(cpuid): "vnni" (vpdpbusd, AVX-512 VNNI+VL or the VEX-coded AVX-VNNI), "avx2" (vpmaddubsw +
vpmaddwd, with ggml's sign trick for Q8_0's full int8 range), or None, where `AVAILABLE` is
False and the float kernels in legacy.py/kquants.py run instead (any CPU Numba supports). The
tests run all three, the first two against a float64 reference and the float kernels, by
compiling for older targets (each where this CPU can execute it).
Decode (one token) runs here; prefill stays on the float kernels: a 4-row x 4-token VNNI tile
measured ~50 G MAC/s against ~100 G for the float tiles, which unpack a block once and then
multiply-add 16 floats per instruction.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.extending import intrinsic

from .activations import q8_scale, round_f16
from .iquants import (
    IQ1_GRID,
    IQ2S_GRID,
    IQ2XS_GRID,
    IQ2XXS_GRID,
    IQ3S_GRID,
    IQ3XXS_GRID,
    KVALUES_IQ4NL,
)
from .kernels import SOURCE_KEY, depends_on


def host_features() -> set[str]:
    """The features this CPU has, as LLVM reads them from cpuid (e.g. "avx512vnni", "avxvnni")."""
    return {name for name, present in llvm.get_host_cpu_features().items() if present}


def _target_features() -> set[str]:
    """The CPU features Numba compiles for: $NUMBA_CPU_FEATURES if set, else the host's."""
    if numba_config.CPU_FEATURES is not None:
        return {f[1:] for f in numba_config.CPU_FEATURES.split(",") if f.startswith("+")}
    return host_features()


def _instruction_set(features: set[str]) -> str | None:
    """ "vnni": vpdpbusd (AVX-512 VNNI with VL, or the VEX-coded AVX-VNNI); "avx2": vpmaddubsw +
    vpmaddwd, ggml's AVX2 way; None: neither, the float kernels run instead.

    Exact cpuid flags, never a CPU family: Zen 4 has AVX-512 VNNI but not AVX-VNNI, Alder Lake
    the reverse, and the 256-bit vpdpbusd exists in either encoding only with its own flag."""
    if {"avx512vnni", "avx512vl"} <= features or "avxvnni" in features:
        return "vnni"
    if {"avx2", "f16c"} <= features:
        return "avx2"
    return None


def choose_instruction_set(target: set[str], host: set[str]) -> str | None:
    """The instruction set for code compiled for `target` that runs on `host`: only what both
    have, so that a target that claims more than this CPU has ($NUMBA_CPU_FEATURES) never makes
    the kernels execute an instruction the CPU lacks (SIGILL)."""
    return _instruction_set(target & host)


INSTRUCTION_SET = choose_instruction_set(_target_features(), host_features())
AVAILABLE = INSTRUCTION_SET is not None

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_I64 = ir.IntType(64)
_V4I32 = ir.VectorType(_I32, 4)
_V16I8, _V32I8 = ir.VectorType(_I8, 16), ir.VectorType(_I8, 32)
_V8I32, _V8F32 = ir.VectorType(_I32, 8), ir.VectorType(_F32, 8)
_V16I32 = ir.VectorType(_I32, 16)


def _splat(vec_type, value):
    return ir.Constant(vec_type, [value] * vec_type.count)


SIGNED = -1  # the `offset` of a chunk of int8 weights (Q8_0)


class Signs:
    """The `offset` of a chunk of unsigned levels whose weights carry a sign of their own (the
    grid types): `mask` <32 x i8> is -1 where the weight is negative, 1 elsewhere; the
    activations are negated there (vpsignb) before the dot product, as ggml does."""

    def __init__(self, mask):
        self.mask = mask


PER_BLOCK = "per block"  # the `scale` of a chunk of a group: its own scale comes at GroupEnd


class GroupEnd(tuple):
    """Yielded by a grouped block writer (`grouped = True`, called with 8 blocks at once) after
    the 8 chunks of 8 consecutive 32-weight blocks, each yielded with scale PER_BLOCK: `scales`,
    an <8 x float>, holds the blocks' weight scales. Each block's integer sum times its scale and
    its activation scale goes into the float accumulator, the 8 of them in one vector: one
    conversion and one multiply-add per 8 blocks instead of one per block. Five fields."""

    def __new__(cls, chunk, scales):
        return super().__new__(cls, (chunk, None, None, scales, None))

    chunk = property(lambda self: self[0])
    scales = property(lambda self: self[3])


class BlockEnd(tuple):
    """Yielded by a block writer after chunks whose scales are integers (i32, or <8 x i32> per
    lane): the block's integer sum times `scale` (float, the super-block's d) and the activation
    scale of `chunk` (its first) goes into the float accumulator. `minimums`, if given, is an
    <8 x float> of the 8 chunks' minimums, each times its chunk's activation sum. Five fields,
    like a chunk."""

    def __new__(cls, chunk, scale, minimums=None):
        return super().__new__(cls, (chunk, None, None, scale, minimums))

    chunk = property(lambda self: self[0])
    scale = property(lambda self: self[3])
    minimums = property(lambda self: self[4])


class _Emitter:
    """IR helpers for the dot products of a few weight rows with one activation vector.

    The block writers (`_q4_0` ...) only unpack weights; `accumulate` multiplies an unpacked chunk
    with the activations, into one float accumulator per row.
    """

    def __init__(self, builder, n_rows, xq, xd, xs, xl):
        self.b = builder
        self.xq, self.xd, self.xs, self.xl = xq, xd, xs, xl  # i8*, float*, float*, i32*
        self.acc = [
            cgutils.alloca_once_value(builder, ir.Constant(_V8F32, None)) for _ in range(n_rows)
        ]
        self.accm = [
            cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(n_rows)
        ]
        # the integer sums of the blocks of a group, per row, until its GroupEnd
        self.pending = [[] for _ in range(n_rows)]
        # the integer sums of a super-block whose chunks have integer scales (see BlockEnd)
        self.iacc = [
            cgutils.alloca_once_value(builder, ir.Constant(_V8I32, None)) for _ in range(n_rows)
        ]

    # -- loads from a weight block (byte offsets)
    def load(self, base, offset, ty):
        if isinstance(offset, int):
            offset = ir.Constant(ir.IntType(64), offset)
        return self.b.load(self.b.bitcast(self.b.gep(base, [offset]), ty.as_pointer()), align=1)

    def f16(self, block, offset):
        """The IEEE half at block + offset as float (vcvtph2ps)."""
        half = self.b.bitcast(self.load(block, offset, _I16), ir.HalfType())
        return self.b.fpext(half, _F32)

    def byte(self, block, offset):
        """An unsigned byte of the block as i32."""
        return self.b.zext(self.load(block, offset, _I8), _I32)

    def chunk_index(self, c, k):
        return self.b.add(c, ir.Constant(c.type, k))

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

    def splat8i(self, value):
        """An i32 broadcast to <8 x i32>."""
        one = self.b.insert_element(ir.Constant(_V8I32, None), value, ir.Constant(_I32, 0))
        return self.b.shuffle_vector(one, ir.Constant(_V8I32, None), ir.Constant(_V8I32, [0] * 8))

    def splat8(self, value):
        """A float broadcast to <8 x float>."""
        one = self.b.insert_element(ir.Constant(_V8F32, None), value, ir.Constant(_I32, 0))
        return self.b.shuffle_vector(one, ir.Constant(_V8F32, None), ir.Constant(_V8I32, [0] * 8))

    def _intrinsic(self, name, result, *operands):
        fnty = ir.FunctionType(result, [v.type for v in operands])
        return self.b.call(cgutils.get_or_insert_function(self.b.module, fnty, name), operands)

    def dot(self, init, u, x):
        """init + (per lane of 4 bytes: the sum of u * x), u <32 x u8> (< 128 for avx2, which
        adds pairs in saturating int16), x <32 x i8> (> -128)."""
        u, x = self.b.bitcast(u, _V32I8), self.b.bitcast(x, _V32I8)
        if INSTRUCTION_SET == "vnni":
            args = [self.b.bitcast(v, _V8I32) for v in (init, u, x)]
            return self._intrinsic("llvm.x86.avx512.vpdpbusd.256", _V8I32, *args)
        pairs = self._intrinsic("llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(_I16, 16), u, x)
        ones = _splat(ir.VectorType(_I16, 16), 1)
        return self.b.add(init, self._intrinsic("llvm.x86.avx2.pmadd.wd", _V8I32, pairs, ones))

    def lookup(self, table, indices):
        """<32 x i8>: table[indices] per 128-bit half (vpshufb), indices < 16."""
        return self._intrinsic("llvm.x86.avx2.pshuf.b", _V32I8, table, indices)

    def sign(self, v, s):
        """v negated where s < 0, zeroed where s == 0 (vpsignb)."""
        return self._intrinsic("llvm.x86.avx2.psign.b", _V32I8, v, s)

    # -- one unpacked chunk times the activations
    def accumulate(self, row, chunk):
        """chunk = (c, u, offset, scale, minimum): 32 weights w = scale * (u - offset) + minimum
        at columns 32c.., u <32 x u8>; scale and minimum a float or <8 x float> (per lane of 4
        weights), minimum None if there is none, offset an int (0: none) or SIGNED: u holds
        int8 weights themselves."""
        b = self.b
        c, u, offset, scale, minimum = chunk
        if isinstance(chunk, BlockEnd):
            self.end_block(row, chunk)
            return
        if isinstance(chunk, GroupEnd):
            self.end_group(row, chunk)
            return
        x = self.load(self.xq, b.mul(c, ir.Constant(c.type, 32)), _V8I32)
        init = ir.Constant(_V8I32, None)
        if isinstance(offset, Signs):  # levels < 128: exact in either instruction set
            x = self.sign(b.bitcast(x, _V32I8), offset.mask)
            isum = self.dot(init, u, x)
        elif offset == SIGNED and INSTRUCTION_SET == "avx2":
            # ggml's sign trick: |w| * (x with w's sign), |w| <= 128 keeps the pairs in int16
            x = b.bitcast(x, _V32I8)
            isum = self.dot(ir.Constant(_V8I32, None), self.sign(u, u), self.sign(x, u))
        else:
            if offset == SIGNED:  # unsigned levels w + 128 for vpdpbusd, 128 subtracted below
                u, offset = b.xor(u, _splat(_V32I8, 0x80)), 128
            init = ir.Constant(_V8I32, None)
            if isinstance(offset, ir.Value):  # an offset of this chunk (i32) or of each lane
                if offset.type == _I32:
                    offset = self.splat8i(offset)
                init = b.mul(self.lane_sums(c), b.neg(offset))
            elif offset:  # -offset * (sum of the 4 activations of each lane)
                init = b.mul(self.lane_sums(c), _splat(_V8I32, -offset))
            isum = self.dot(init, u, b.bitcast(x, _V32I8))
        if isinstance(scale, str):  # PER_BLOCK: kept apart until the group's end
            self.pending[row].append(isum)
            return
        dx = b.load(b.gep(self.xd, [c]))
        if isinstance(scale.type, ir.IntType) or scale.type == _V8I32:
            # an integer scale (k-quants' sub-block scales): into the block's integer sum, which
            # end_block converts to float once (ggml's order: exact integers, one rounding)
            if isinstance(scale.type, ir.IntType):
                scale = b.shuffle_vector(
                    b.insert_element(ir.Constant(_V8I32, None), scale, ir.Constant(_I32, 0)),
                    ir.Constant(_V8I32, None),
                    ir.Constant(_V8I32, [0] * 8),
                )
            b.store(b.add(b.load(self.iacc[row]), b.mul(isum, scale)), self.iacc[row])
        elif isinstance(scale.type, ir.VectorType):
            scale = b.fmul(scale, self.splat8(dx))
        else:
            scale = self.splat8(b.fmul(scale, dx))
        if scale.type == _V8F32:
            prod = b.fmul(b.sitofp(isum, _V8F32), scale, flags=("contract",))
            b.store(b.fadd(b.load(self.acc[row]), prod, flags=("contract",)), self.acc[row])
        if minimum is None:
            return
        if isinstance(minimum.type, ir.VectorType):  # per lane: + minimum * (its 4 activations)
            sums = b.sitofp(self.lane_sums(c), _V8F32)
            term = b.fmul(sums, b.fmul(minimum, self.splat8(dx)), flags=("contract",))
            b.store(b.fadd(b.load(self.acc[row]), term, flags=("contract",)), self.acc[row])
        else:  # + minimum * (sum of the chunk's activations)
            term = b.fmul(minimum, b.load(b.gep(self.xs, [c])))
            b.store(b.fadd(b.load(self.accm[row]), term), self.accm[row])

    def end_block(self, row, end):
        """acc += d * dx * (the block's integer sum), then the integer sum starts again."""
        b = self.b
        dx = b.load(b.gep(self.xd, [end.chunk]))
        total = b.sitofp(b.load(self.iacc[row]), _V8F32)
        prod = b.fmul(total, self.splat8(b.fmul(end.scale, dx)), flags=("contract",))
        acc = b.fadd(b.load(self.acc[row]), prod, flags=("contract",))
        if end.minimums is not None:  # lane k: chunk k's minimum times its activation sum
            sums = b.load(b.bitcast(b.gep(self.xs, [end.chunk]), _V8F32.as_pointer()), align=4)
            acc = b.fadd(acc, b.fmul(end.minimums, sums), flags=("contract",))
        b.store(acc, self.acc[row])
        b.store(ir.Constant(_V8I32, None), self.iacc[row])

    def end_group(self, row, end):
        """acc += float(sum of block k) * scales[k] * dx[k], the 8 blocks in the 8 lanes."""
        b = self.b
        sums = self.pending[row]
        self.pending[row] = []

        def phadd(u, v):
            return self._intrinsic("llvm.x86.avx2.phadd.d", _V8I32, u, v)

        # per 128-bit half: pairs, then quads of lanes: u0 holds blocks 0-3 (lanes 0-3 their
        # columns 0-15, lanes 4-7 their columns 16-31), u1 blocks 4-7
        pairs = [phadd(sums[2 * k], sums[2 * k + 1]) for k in range(4)]
        u0, u1 = phadd(pairs[0], pairs[1]), phadd(pairs[2], pairs[3])
        low = b.shuffle_vector(u0, u1, ir.Constant(_V8I32, [0, 1, 2, 3, 8, 9, 10, 11]))
        high = b.shuffle_vector(u0, u1, ir.Constant(_V8I32, [4, 5, 6, 7, 12, 13, 14, 15]))
        totals = b.sitofp(b.add(low, high), _V8F32)
        dx = b.load(b.bitcast(b.gep(self.xd, [end.chunk]), _V8F32.as_pointer()), align=4)
        prod = b.fmul(totals, b.fmul(end.scales, dx), flags=("contract",))
        b.store(b.fadd(b.load(self.acc[row]), prod, flags=("contract",)), self.acc[row])

    def f16x8(self, block, offset, stride):
        """<8 x float>: the 8 IEEE halves at block + offset + k * stride (vcvtph2ps once)."""
        halves = ir.Constant(ir.VectorType(_I16, 8), None)
        for k in range(8):
            value = self.load(block, offset + k * stride, _I16)
            halves = self.b.insert_element(halves, value, ir.Constant(_I32, k))
        halves = self.b.bitcast(halves, ir.VectorType(ir.HalfType(), 8))
        return self.b.fpext(halves, _V8F32)

    def table(self, name, values, element=_I32):
        """A constant global array of this module (one per module, by name)."""
        module = self.b.module
        if name not in module.globals:
            table_type = ir.ArrayType(element, len(values))
            table = ir.GlobalVariable(module, table_type, name)
            table.linkage, table.global_constant = "internal", True
            table.initializer = ir.Constant(table_type, [int(v) for v in values])
        return module.globals[name]

    def gather(self, table, indices):
        """<8 x i32>: table[indices[k]] (vpgatherdd)."""
        base = self.b.bitcast(table, _I8.as_pointer())
        ones = _splat(_V8I32, -1)
        scale = ir.Constant(_I8, 4)
        args = (ir.Constant(_V8I32, None), base, indices, ones, scale)
        return self._intrinsic("llvm.x86.avx2.gather.d.d.256", _V8I32, *args)

    def gather64(self, table, indices):
        """<4 x i64>: table[indices[k]] for <4 x i32> indices (vpgatherdq)."""
        base = self.b.bitcast(table, _I8.as_pointer())
        v4i64 = ir.VectorType(_I64, 4)
        args = (ir.Constant(v4i64, None), base, indices, _splat(v4i64, -1), ir.Constant(_I8, 8))
        return self._intrinsic("llvm.x86.avx2.gather.d.q.256", v4i64, *args)

    def sign_mask(self, bits32):
        """<32 x i8>: -1 where bit k of the i32 bits32 is set, 1 elsewhere."""
        mask = self.b.bitcast(bits32, ir.VectorType(ir.IntType(1), 32))
        return self.b.select(mask, _splat(_V32I8, -1), _splat(_V32I8, 1))

    def lane_sums(self, c):
        """<8 x i32>: the sums of the 4 activation quants of each lane of chunk c."""
        lanes = self.b.gep(self.xl, [self.b.mul(c, ir.Constant(c.type, 8))])
        return self.b.load(self.b.bitcast(lanes, _V8I32.as_pointer()), align=4)

    def result(self, row):
        acc = self.b.load(self.acc[row])
        parts = [self.b.extract_element(acc, ir.Constant(_I32, k)) for k in range(8)]
        while len(parts) > 1:  # pairwise, as a tree
            parts = [self.b.fadd(parts[k], parts[k + 1]) for k in range(0, len(parts), 2)]
        return self.b.fadd(parts[0], self.b.load(self.accm[row]))


# Software prefetch this far ahead of the bytes being read. The hardware prefetchers alone left a
# weight matrix streaming from DRAM at ~7 GB/s (this project's 2-core VMs); prefetching 8 KiB ahead
# brought it to 25-35 GB/s. A thread reads its rows front to back, and the rows of a group are
# contiguous, so `block + PREFETCH_BYTES` from each row covers the stream ahead without gaps.
# 16 KiB rather than 8: Q6_K rows of 14336 weights (Llama-3.1-8B's ffn_down) streamed at 11.7 GB/s
# with 8 KiB and 16.4 with 16 KiB on one thread; the 8B shape decoded at 7.2-7.3 against 7.8-8.4
# tok/s on 2 threads, the 1.5B the same within noise.
PREFETCH_BYTES = 16384
GROUP = 8  # 32-weight blocks per step of the block loop


def _rows_typer(type_size, chunks_per_block, unpack_block, n_rows, n_tokens):
    """The typing function of a Numba intrinsic `rows(w, r0, t0, xq, xd, xs, xl, out)`:

        out[t0 + k, r0 + i] = w[r0 + i] . x[t0 + k]   for i < n_rows, k < n_tokens

    w: uint8[rows, row_bytes] (GGUF blocks); xq: int8[tokens, n_cols]; xd, xs: float32[tokens,
    n_cols // 32]; xl: int32[tokens, n_cols // 4]; out: float32[tokens, rows]; all C-contiguous.
    The rows advance block by block together, sharing the activation loads; each block is
    unpacked once for all n_tokens tokens (a tile of a prefill: the weights are read once per
    tile); unpack_block(e, block_ptr, first_chunk) yields a block's chunks (and, if it is
    `grouped`, unpack_block(e, block_ptr, first_chunk, GROUP) those of GROUP blocks). A token's dot
    products are computed in the same order whatever the tile, so that a token gets the same
    logits decoded alone or in a batch.
    """

    # 32-weight blocks go GROUP at a time: one loop step and one prefetch per cache line,
    # instead of a step and a prefetch per 18-34 byte block
    group = max(1, GROUP // chunks_per_block)
    grouped = getattr(unpack_block, "grouped", False)  # it takes GROUP blocks at once too

    def rows(typingctx, w, r0, t0, xq, xd, xs, xl, out):
        sig = types.void(w, r0, t0, xq, xd, xs, xl, out)

        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            arrays = {
                k: context.make_array(signature.args[k])(context, builder, args[k])
                for k in (0, 3, 4, 5, 6, 7)
            }
            r0 = context.cast(builder, args[1], signature.args[1], types.int64)
            t0 = context.cast(builder, args[2], signature.args[2], types.int64)
            row_bytes = builder.extract_value(arrays[0].shape, 1)
            rows = [
                builder.gep(
                    arrays[0].data, [builder.mul(builder.add(r0, ir.Constant(i64, i)), row_bytes)]
                )
                for i in range(n_rows)
            ]

            def token_row(k, tok):  # pointer to row t0 + tok of array k
                width = builder.extract_value(arrays[k].shape, 1)
                at = builder.mul(builder.add(t0, ir.Constant(i64, tok)), width)
                return builder.gep(arrays[k].data, [at])

            emitters = [
                _Emitter(builder, n_rows, *(token_row(k, tok) for k in (3, 4, 5, 6)))
                for tok in range(n_tokens)
            ]
            e = emitters[0]  # its weight-side helpers unpack the blocks for every token
            prefetch = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]),
                "llvm.prefetch.p0",
            )

            def blocks(first_block, count):
                """count blocks from first_block on, for every row, in each row's order."""
                offset0 = builder.mul(first_block, ir.Constant(i64, type_size))
                for i, row in enumerate(rows):
                    # every cache line of these blocks PREFETCH_BYTES ahead: read, keep in all
                    # cache levels, data
                    for line in range(0, count * type_size, 64):
                        at = builder.add(offset0, ir.Constant(i64, PREFETCH_BYTES + line))
                        flags = (ir.Constant(_I32, v) for v in (0, 3, 1))
                        builder.call(prefetch, [builder.gep(row, [at]), *flags])
                    if grouped and count == GROUP:  # one call for the whole group
                        calls = [(first_block, (count,))]
                    else:
                        calls = [
                            (builder.add(first_block, ir.Constant(i64, k)), ())
                            for k in range(count)
                        ]
                    for block, group_size in calls:
                        offset = builder.mul(block, ir.Constant(i64, type_size))
                        first = builder.mul(block, ir.Constant(i64, chunks_per_block))
                        block_ptr = builder.gep(row, [offset])
                        for chunk in unpack_block(e, block_ptr, first, *group_size):
                            for em in emitters:
                                em.accumulate(i, chunk)

            n_blocks = builder.udiv(row_bytes, ir.Constant(i64, type_size))
            n_groups = builder.udiv(n_blocks, ir.Constant(i64, group))
            with cgutils.for_range(builder, n_groups) as loop:
                blocks(builder.mul(loop.index, ir.Constant(i64, group)), group)
            if group > 1:  # the blocks after the last whole group
                start = builder.mul(n_groups, ir.Constant(i64, group))
                one = ir.Constant(i64, 1)
                with cgutils.for_range_slice(builder, start, n_blocks, one) as (index, _):
                    blocks(index, 1)
            for tok, em in enumerate(emitters):
                out_row = token_row(7, tok)
                for i in range(n_rows):
                    target = builder.gep(out_row, [builder.add(r0, ir.Constant(i64, i))])
                    builder.store(em.result(i), target)
            return context.get_dummy_value()

        return sig, codegen

    return rows


# ---- legacy types: one block = one 32-weight chunk. Each writer yields (chunk index, unsigned
# quants <32 x u8>, offset, scale, minimum): w = scale * (u - offset) + minimum.


def _q4_0(e, blk, c):
    lo, hi = e.nibbles(e.load(blk, 2, _V16I8))
    yield c, e.concat(lo, hi), 8, e.f16(blk, 0), None


def _q4_1(e, blk, c):
    lo, hi = e.nibbles(e.load(blk, 4, _V16I8))
    yield c, e.concat(lo, hi), 0, e.f16(blk, 0), e.f16(blk, 2)


def _q5_0(e, blk, c):
    lo, hi = e.nibbles(e.load(blk, 6, _V16I8))
    u = e.b.or_(e.concat(lo, hi), e.bits_to_16(e.load(blk, 2, _I32)))
    yield c, u, 16, e.f16(blk, 0), None


def _q5_1(e, blk, c):
    lo, hi = e.nibbles(e.load(blk, 8, _V16I8))
    u = e.b.or_(e.concat(lo, hi), e.bits_to_16(e.load(blk, 4, _I32)))
    yield c, u, 0, e.f16(blk, 0), e.f16(blk, 2)


def _q8_0(e, blk, c):
    yield c, e.load(blk, 2, _V32I8), SIGNED, e.f16(blk, 0), None


# ---- k-quants: 256-weight super-blocks = 8 chunks


def _scales_mins_k4(e, blk):
    """(scales, mins): <8 x i32> each, the 6-bit scales and mins of the 8 sub-blocks from the 12
    packed bytes at offset 4, unpacked with 32-bit masks as ggml's vec_dot_q4_K_q8_K does."""
    b = e.b
    w0, w1, w2 = (e.load(blk, 4 + 4 * i, _I32) for i in range(3))

    def c(v):
        return ir.Constant(_I32, v)

    m1, m2, m3 = c(0x3F3F3F3F), c(0x0F0F0F0F), c(0x03030303)
    scales_lo = b.and_(w0, m1)
    scales_hi = b.or_(b.and_(w2, m2), b.shl(b.and_(b.lshr(w0, c(6)), m3), c(4)))
    mins_lo = b.and_(w1, m1)
    mins_hi = b.or_(b.and_(b.lshr(w2, c(4)), m2), b.shl(b.and_(b.lshr(w1, c(6)), m3), c(4)))

    def eight_bytes(lo, hi):
        pair = b.insert_element(ir.Constant(ir.VectorType(_I32, 2), None), lo, c(0))
        pair = b.insert_element(pair, hi, c(1))
        return b.zext(b.bitcast(pair, ir.VectorType(_I8, 8)), _V8I32)

    return eight_bytes(scales_lo, scales_hi), eight_bytes(mins_lo, mins_hi)


def _k_asymmetric(e, blk, c0, quants_at, high_bits_at):
    """Q4_K / Q5_K: w = d * sc * u - dmin * mn per 32-weight sub-block. The 6-bit scales stay
    integers: d * dx multiplies the block's integer sum once, and the 8 minimums are applied
    together at the block's end (as ggml's vec_dot_q4_K_q8_K)."""
    b = e.b
    d, dmin = e.f16(blk, 0), e.f16(blk, 2)
    scales, mins = _scales_mins_k4(e, blk)
    qh = e.load(blk, high_bits_at, _V32I8) if high_bits_at else None
    for j in range(4):
        lo, hi = e.nibbles(e.load(blk, quants_at + 32 * j, _V32I8))
        for k, u in ((2 * j, lo), (2 * j + 1, hi)):
            if qh is not None:  # bit k of qh[l] is bit 4 of weight 32k + l
                bit = b.and_(b.lshr(qh, _splat(_V32I8, k)), _splat(_V32I8, 1))
                u = b.or_(u, b.shl(bit, _splat(_V32I8, 4)))
            sc = b.extract_element(scales, ir.Constant(_I32, k))
            yield e.chunk_index(c0, k), u, 0, sc, None
    minimums = b.fmul(b.uitofp(mins, _V8F32), e.splat8(b.fneg(dmin)))
    yield BlockEnd(c0, d, minimums)


def _q4_k(e, blk, c0):
    return _k_asymmetric(e, blk, c0, quants_at=16, high_bits_at=0)


def _q5_k(e, blk, c0):
    return _k_asymmetric(e, blk, c0, quants_at=48, high_bits_at=16)


def _q6_k(e, blk, c0):
    """ql[128] | qh[64] | scales int8[16] | d f16: w = d * sc * (q - 32), 16-weight scales,
    kept as integers (lanes 0-3 and 4-7 of a chunk) until the block's end."""
    b = e.b
    d = e.f16(blk, 208)
    # the 16 scales at once, widened to i32; each chunk takes its two into lanes 0-3 and 4-7
    scales = b.sext(e.load(blk, 192, ir.VectorType(_I8, 16)), ir.VectorType(_I32, 16))
    two_bits = _splat(_V32I8, 0x30)
    for h in range(2):
        ql0, ql1 = e.load(blk, 64 * h, _V32I8), e.load(blk, 64 * h + 32, _V32I8)
        qh = e.load(blk, 128 + 32 * h, _V32I8)
        lo0, hi0 = e.nibbles(ql0)
        lo1, hi1 = e.nibbles(ql1)
        for g, low in enumerate((lo0, lo1, hi0, hi1)):
            # bits 2g, 2g + 1 of qh are bits 4-5 of the weight: one shift and one mask
            shift = 4 - 2 * g
            if shift > 0:
                top = b.shl(qh, _splat(_V32I8, shift))
            elif shift < 0:
                top = b.lshr(qh, _splat(_V32I8, -shift))
            else:
                top = qh
            u = b.or_(low, b.and_(top, two_bits))
            k = 8 * h + 2 * g
            lanes = ir.Constant(_V8I32, [k] * 4 + [k + 1] * 4)
            per_lane = b.shuffle_vector(scales, ir.Constant(scales.type, None), lanes)
            yield e.chunk_index(c0, 4 * h + g), u, 32, per_lane, None
    yield BlockEnd(c0, d)


def _two_halves(e, low, high):
    """<8 x float>: lanes 0-3 low, lanes 4-7 high (a chunk's two 16-weight sub-blocks)."""
    pair = e.b.insert_element(ir.Constant(_V8F32, None), low, ir.Constant(_I32, 0))
    pair = e.b.insert_element(pair, high, ir.Constant(_I32, 1))
    lanes = ir.Constant(_V8I32, [0, 0, 0, 0, 1, 1, 1, 1])
    return e.b.shuffle_vector(pair, ir.Constant(_V8F32, None), lanes)


def _crumbs(e, blk, offset, h, j):
    """2-bit fields j of the 32 bytes at offset + 32h: the low bits of chunk 4h + j."""
    q = e.load(blk, offset + 32 * h, _V32I8)
    return e.b.and_(e.b.lshr(q, _splat(_V32I8, 2 * j)), _splat(_V32I8, 3))


def _q2_k(e, blk, c0):
    """scales[16] (4-bit scale | 4-bit min << 4) | qs[64] | d f16 | dmin f16:
    w = d * sc * q - dmin * m per 16 weights, q 2 bits."""
    b = e.b
    d, dmin = e.f16(blk, 80), e.f16(blk, 82)
    for h in range(2):
        for j in range(4):
            scales, mins = [], []
            for k in (8 * h + 2 * j, 8 * h + 2 * j + 1):
                packed = e.byte(blk, k)
                scales.append(b.fmul(d, b.uitofp(b.and_(packed, ir.Constant(_I32, 15)), _F32)))
                m = b.uitofp(b.lshr(packed, ir.Constant(_I32, 4)), _F32)
                mins.append(b.fneg(b.fmul(dmin, m)))
            u = _crumbs(e, blk, 16, h, j)
            yield e.chunk_index(c0, 4 * h + j), u, 0, _two_halves(e, *scales), _two_halves(e, *mins)


def _q3_k_scale(e, blk, k):
    """Scale k (of 16) from the 12 packed bytes at offset 96, as ggml unpacks them, minus 32."""
    b = e.b

    def byte(i):
        return e.byte(blk, 96 + i)

    def bits(v, shift, mask):
        return b.and_(b.lshr(v, ir.Constant(_I32, shift)), ir.Constant(_I32, mask))

    group, i = divmod(k, 4)
    low = bits(byte(4 * (group % 2) + i), 4 * (group // 2), 15)
    high = bits(byte(8 + i), 2 * group, 3)
    value = b.or_(low, b.shl(high, ir.Constant(_I32, 4)))
    return b.sitofp(b.sub(value, ir.Constant(_I32, 32)), _F32)


def _q3_k(e, blk, c0):
    """hmask[32] | qs[64] | scales[12] (16 x 6 bits) | d f16: w = d * (sc - 32) * (q - 4) per 16
    weights, q = 2 low bits | (hmask bit) << 2."""
    b = e.b
    d = e.f16(blk, 108)
    hmask = e.load(blk, 0, _V32I8)
    for h in range(2):
        for j in range(4):
            bit = b.and_(b.lshr(hmask, _splat(_V32I8, 4 * h + j)), _splat(_V32I8, 1))
            u = b.or_(_crumbs(e, blk, 32, h, j), b.shl(bit, _splat(_V32I8, 2)))
            k = 8 * h + 2 * j
            scales = [b.fmul(d, _q3_k_scale(e, blk, k + half)) for half in range(2)]
            yield e.chunk_index(c0, 4 * h + j), u, 4, _two_halves(e, *scales), None


# ---- i-quants: 4-bit indices into ggml's non-uniform grid kvalues_iq4nl


def _iq4_levels(e, packed, grid=KVALUES_IQ4NL):
    """(u, offset) of 32 weights from 16 bytes of 4-bit indices (low nibbles, then high): the
    int8 levels of `grid` looked up with vpshufb, which indexes each 128-bit half of the table
    separately, so the 16 levels sit in both halves. For vpdpbusd the table holds the levels
    + 128 (unsigned, 128 subtracted through the lane sums); AVX2 takes the int8 levels with
    ggml's sign trick."""
    lo, hi = e.nibbles(packed)
    if INSTRUCTION_SET == "vnni":
        levels, offset = [v + 128 for v in grid], 128
    else:
        levels, offset = list(grid), SIGNED
    table = ir.Constant(_V32I8, [v if v < 128 else v - 256 for v in levels * 2])
    return e.lookup(table, e.concat(lo, hi)), offset


def _iq4_nl(e, blk, c, count=1):
    """d f16 | qs[16]: w = d * level[q], as Q4_0 with a grid for q - 8. Called with one block
    or a group of 8 (see GroupEnd)."""
    if count == 1:
        u, offset = _iq4_levels(e, e.load(blk, 2, _V16I8))
        yield c, u, offset, e.f16(blk, 0), None
        return
    for k in range(count):
        u, offset = _iq4_levels(e, e.load(blk, 18 * k + 2, _V16I8))
        yield e.chunk_index(c, k), u, offset, PER_BLOCK, None
    yield GroupEnd(c, e.f16x8(blk, 0, 18))


_iq4_nl.grouped = True


# MXFP4: the e2m1 grid doubled (as int8), and the E8M0 exponent halved as the scale
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _e8m0_half(e, exponent):
    """float 2^(exponent - 128) from i32 bytes (or <8 x i32>), as ggml_e8m0_to_fp32_half builds
    its bits: 0x00200000 << e below 2 (subnormals), else (e - 1) << 23."""
    b, kind = e.b, exponent.type

    def const(v):
        return ir.Constant(_I32, v) if kind == _I32 else _splat(_V8I32, v)

    small = b.shl(const(0x00200000), exponent)
    normal = b.shl(b.sub(exponent, const(1)), const(23))
    below = b.icmp_unsigned("<", exponent, const(2))
    return b.bitcast(b.select(below, small, normal), _F32 if kind == _I32 else _V8F32)


def _mxfp4(e, blk, c, count=1):
    """e u8 | qs[16]: w = 2^(e - 128) * grid[q], as IQ4_NL with the MXFP4 grid and an E8M0
    scale (ggml's vec_dot_mxfp4_q8_0). One block or a group of 8 (see GroupEnd), whose 8
    scales are made in one vector."""
    if count == 1:
        u, offset = _iq4_levels(e, e.load(blk, 1, _V16I8), KVALUES_MXFP4)
        yield c, u, offset, _e8m0_half(e, e.byte(blk, 0)), None
        return
    exponents = ir.Constant(_V8I32, None)
    for k in range(count):
        u, offset = _iq4_levels(e, e.load(blk, 17 * k + 1, _V16I8), KVALUES_MXFP4)
        yield e.chunk_index(c, k), u, offset, PER_BLOCK, None
        exponents = e.b.insert_element(exponents, e.byte(blk, 17 * k), ir.Constant(_I32, k))
    yield GroupEnd(c, _e8m0_half(e, exponents))


_mxfp4.grouped = True


def _iq4_xs(e, blk, c0):
    """d f16 | scales_h u16 | scales_l[4] | qs[128]: w = d * (ls - 32) * level[q] per 32
    weights. The 6-bit scales stay integers until the block's end, as in ggml's
    vec_dot_iq4_xs_q8_K (and Q6_K here)."""
    b = e.b
    scales_h = b.zext(e.load(blk, 2, _I16), _I32)
    for j in range(8):
        low = b.lshr(e.byte(blk, 4 + j // 2), ir.Constant(_I32, 4 * (j % 2)))
        high = b.and_(b.lshr(scales_h, ir.Constant(_I32, 2 * j)), ir.Constant(_I32, 3))
        ls = b.or_(b.and_(low, ir.Constant(_I32, 15)), b.shl(high, ir.Constant(_I32, 4)))
        u, offset = _iq4_levels(e, e.load(blk, 8 + 16 * j, _V16I8))
        yield e.chunk_index(c0, j), u, offset, b.sub(ls, ir.Constant(_I32, 32)), None
    yield BlockEnd(c0, e.f16(blk, 0))


# ---- grid types: indices into ggml's tables of 4 levels, a sign bit per weight

_ONE = ir.Constant(_I32, 1)


def _iq3_s(e, blk, c0):
    """d f16 | qs[64] | qh[8] | signs[32] | scales[4]: w = d * (1 + 2 * scale) * level * sign
    (see iquants.py). Per 32 weights: 8 9-bit grid indices -> one vpgatherdd of 8 x 4 levels,
    the 32 sign bits -> the activations' signs; the scales 1 + 2 * scale stay integers to the
    block's end, as in ggml's vec_dot_iq3_s_q8_K."""
    b = e.b
    table = e.table("iq3s_grid", IQ3S_GRID.view("<u4").reshape(-1))
    bit_of = ir.Constant(_V8I32, list(range(8)))
    for j in range(8):
        low = b.zext(e.load(blk, 2 + 8 * j, ir.VectorType(_I8, 8)), _V8I32)
        qh = b.zext(e.load(blk, 66 + j, _I8), _I32)
        splat = b.shuffle_vector(
            b.insert_element(ir.Constant(_V8I32, None), qh, ir.Constant(_I32, 0)),
            ir.Constant(_V8I32, None),
            ir.Constant(_V8I32, [0] * 8),
        )
        high = b.shl(b.and_(b.lshr(splat, bit_of), _splat(_V8I32, 1)), _splat(_V8I32, 8))
        levels = b.bitcast(e.gather(table, b.or_(low, high)), _V32I8)
        signs = Signs(e.sign_mask(e.load(blk, 74 + 4 * j, _I32)))
        scale = b.and_(b.lshr(e.byte(blk, 106 + j // 2), ir.Constant(_I32, 4 * (j % 2))),
                       ir.Constant(_I32, 15))  # fmt: skip
        odd = b.add(b.shl(scale, ir.Constant(_I32, 1)), ir.Constant(_I32, 1))
        yield e.chunk_index(c0, j), levels, signs, odd, None
    yield BlockEnd(c0, e.f16(blk, 0))


def _splat4(e, value):
    """<4 x i32> of an i32."""
    one = e.b.insert_element(ir.Constant(_V4I32, None), value, ir.Constant(_I32, 0))
    return e.b.shuffle_vector(one, ir.Constant(_V4I32, None), ir.Constant(_V4I32, [0] * 4))


def _ksigns(e, fields):
    """Signs of 32 weights from 4 lanes of 7 sign bits (the low 7 bits of each lane of <4 x i32>
    fields, 8 weights each): the 8th bit is their parity (ggml's ksigns_iq2xs, vpopcntd)."""
    b = e.b
    fields = b.and_(fields, _splat(_V4I32, 127))
    parity = b.and_(e._intrinsic("llvm.ctpop.v4i32", _V4I32, fields), _splat(_V4I32, 1))
    signs = b.or_(fields, b.shl(parity, _splat(_V4I32, 7)))
    return Signs(e.sign_mask(b.bitcast(b.trunc(signs, ir.VectorType(_I8, 4)), _I32)))


def _odd_halves(e, byte):
    """<8 x i32>: 2s + 1 of the low nibble s of byte in lanes 0-3 (weights 0-15 of a chunk), of
    its high nibble in lanes 4-7."""
    b = e.b
    pair = b.insert_element(ir.Constant(ir.VectorType(_I32, 2), None), byte, ir.Constant(_I32, 0))
    pair = b.shuffle_vector(pair, pair, ir.Constant(_V8I32, [0] * 8))
    nibbles = b.and_(b.lshr(pair, ir.Constant(_V8I32, [0] * 4 + [4] * 4)), _splat(_V8I32, 15))
    return b.or_(b.shl(nibbles, _splat(_V8I32, 1)), _splat(_V8I32, 1))


def _iq3_xxs(e, blk, c0):
    """d f16 | qs[64] | 8 x u32 (4 x 7 sign bits, scale s in bits 28-31): w = d * (2s + 1) / 4 *
    level * sign (see iquants.py). Per 32 weights: one vpgatherdd of 8 grid entries; the 4
    sign bytes (7 bits and their parity, vpopcntd) as one 32-bit mask; 2s + 1 an integer to the
    block's end, the 1/4 on d, as in ggml's vec_dot_iq3_xxs_q8_K."""
    b = e.b
    table = e.table("iq3xxs_grid", IQ3XXS_GRID.view("<u4").reshape(-1))
    for j in range(8):
        indices = b.zext(e.load(blk, 2 + 8 * j, ir.VectorType(_I8, 8)), _V8I32)
        levels = b.bitcast(e.gather(table, indices), _V32I8)
        aux = e.load(blk, 66 + 4 * j, _I32)
        fields = b.lshr(_splat4(e, aux), ir.Constant(_V4I32, [0, 7, 14, 21]))
        odd = b.or_(b.shl(b.lshr(aux, ir.Constant(_I32, 28)), _ONE), _ONE)
        yield e.chunk_index(c0, j), levels, _ksigns(e, fields), odd, None
    yield BlockEnd(c0, e.b.fmul(e.f16(blk, 0), ir.Constant(_F32, 0.25)))


def _iq2_grid_table(e, name, grid):
    return e.table(name, grid.view("<u8").reshape(-1), _I64)


def _iq2_xxs(e, blk, c0):
    """d f16 | 8 x (u32 of 4 grid indices, u32 of 4 x 7 sign bits and a scale s in bits 28-31):
    w = d * (2s + 1) / 8 * level * sign. Per 32 weights one vpgatherdq of 4 grid entries of 8
    levels; as ggml's vec_dot_iq2_xxs_q8_K."""
    b = e.b
    table = _iq2_grid_table(e, "iq2xxs_grid", IQ2XXS_GRID)
    for j in range(8):
        indices = b.zext(e.load(blk, 2 + 8 * j, ir.VectorType(_I8, 4)), _V4I32)
        levels = b.bitcast(e.gather64(table, indices), _V32I8)
        aux = e.load(blk, 6 + 8 * j, _I32)
        fields = b.lshr(_splat4(e, aux), ir.Constant(_V4I32, [0, 7, 14, 21]))
        odd = b.or_(b.shl(b.lshr(aux, ir.Constant(_I32, 28)), _ONE), _ONE)
        yield e.chunk_index(c0, j), levels, _ksigns(e, fields), odd, None
    yield BlockEnd(c0, b.fmul(e.f16(blk, 0), ir.Constant(_F32, 0.125)))


def _iq2_xs(e, blk, c0):
    """d f16 | qs u16[32] (9-bit grid index | 7 sign bits << 9, per 8 weights) | scales[8] (4
    bits per 16 weights): w = d * (2s + 1) / 8 * level * sign."""
    b = e.b
    table = _iq2_grid_table(e, "iq2xs_grid", IQ2XS_GRID)
    for j in range(8):
        q = b.zext(e.load(blk, 2 + 8 * j, ir.VectorType(_I16, 4)), _V4I32)
        levels = b.bitcast(e.gather64(table, b.and_(q, _splat(_V4I32, 511))), _V32I8)
        signs = _ksigns(e, b.lshr(q, _splat(_V4I32, 9)))
        yield e.chunk_index(c0, j), levels, signs, _odd_halves(e, e.byte(blk, 66 + j)), None
    yield BlockEnd(c0, b.fmul(e.f16(blk, 0), ir.Constant(_F32, 0.125)))


def _iq2_s(e, blk, c0):
    """d f16 | qs[32] | signs[32] | qh[8] | scales[8]: per 8 weights a 10-bit grid index (qs,
    2 bits of qh), a sign bit per weight, 4-bit scales per 16: w = d * (2s + 1) / 8 * level *
    sign."""
    b = e.b
    table = _iq2_grid_table(e, "iq2s_grid", IQ2S_GRID)
    for j in range(8):
        low = b.zext(e.load(blk, 2 + 4 * j, ir.VectorType(_I8, 4)), _V4I32)
        qh = _splat4(e, e.byte(blk, 66 + j))
        high = b.and_(b.lshr(qh, ir.Constant(_V4I32, [0, 2, 4, 6])), _splat(_V4I32, 3))
        indices = b.or_(low, b.shl(high, _splat(_V4I32, 8)))
        levels = b.bitcast(e.gather64(table, indices), _V32I8)
        signs = Signs(e.sign_mask(e.load(blk, 34 + 4 * j, _I32)))
        yield e.chunk_index(c0, j), levels, signs, _odd_halves(e, e.byte(blk, 74 + j)), None
    yield BlockEnd(c0, b.fmul(e.f16(blk, 0), ir.Constant(_F32, 0.125)))


def _iq1_table(e):
    """iq1s_grid with each level -1, 0, 1 as 8 * (level + 1): 8 * (level +- 1/8) is that minus
    7 or 9, an integer offset (IQ1_DELTA = 1/8)."""
    levels = ((IQ1_GRID.astype(np.int16) + 1) * 8).astype(np.uint8)
    return e.table("iq1_grid", levels.view("<u8").reshape(-1), _I64)


def _iq1_s(e, blk, c0):
    """d f16 | qs[32] | qh u16[8] (4 x 3 high index bits, scale s, the delta's sign): w = d *
    (2s + 1) * (level +- 1/8), here d / 8 * (2s + 1) * (8 * (level + 1) - (7 or 9)), exact
    integers to the block's end (ggml's vec_dot_iq1_s_q8_K sums the delta apart)."""
    b = e.b
    table = _iq1_table(e)
    for j in range(8):
        qh = b.zext(e.load(blk, 34 + 2 * j, _I16), _I32)
        low = b.zext(e.load(blk, 2 + 4 * j, ir.VectorType(_I8, 4)), _V4I32)
        high = b.and_(b.lshr(_splat4(e, qh), ir.Constant(_V4I32, [0, 3, 6, 9])), _splat(_V4I32, 7))
        indices = b.or_(low, b.shl(high, _splat(_V4I32, 8)))
        levels = b.bitcast(e.gather64(table, indices), _V32I8)
        negative = b.and_(b.lshr(qh, ir.Constant(_I32, 15)), _ONE)
        offset = b.add(ir.Constant(_I32, 7), b.shl(negative, _ONE))
        scale = b.and_(b.lshr(qh, ir.Constant(_I32, 12)), ir.Constant(_I32, 7))
        odd = b.or_(b.shl(scale, _ONE), _ONE)
        yield e.chunk_index(c0, j), levels, offset, odd, None
    yield BlockEnd(c0, b.fmul(e.f16(blk, 0), ir.Constant(_F32, 0.125)))


def _iq1_m(e, blk, c0):
    """qs[32] | qh[16] (per 8 weights a nibble: 3 high index bits, the delta's sign) | scales
    u16[4] (3-bit scales per 16 weights, the f16 d in the top nibbles): as IQ1_S, with an offset
    per 8 weights (per pair of lanes) and a scale per 16 (lanes 0-3, 4-7)."""
    b = e.b
    table = _iq1_table(e)
    sc = [b.zext(e.load(blk, 48 + 2 * i, _I16), _I32) for i in range(4)]
    top = ir.Constant(_I32, 0xF000)
    bits = b.or_(
        b.or_(b.lshr(b.and_(sc[0], top), ir.Constant(_I32, 12)),
              b.lshr(b.and_(sc[1], top), ir.Constant(_I32, 8))),
        b.or_(b.lshr(b.and_(sc[2], top), ir.Constant(_I32, 4)), b.and_(sc[3], top)),
    )  # fmt: skip
    d = b.fpext(b.bitcast(b.trunc(bits, _I16), ir.HalfType()), _F32)
    for j in range(8):
        low = b.zext(e.load(blk, 4 * j, ir.VectorType(_I8, 4)), _V4I32)
        qh = _splat4(e, b.zext(e.load(blk, 32 + 2 * j, _I16), _I32))
        nibbles = b.and_(b.lshr(qh, ir.Constant(_V4I32, [0, 4, 8, 12])), _splat(_V4I32, 15))
        indices = b.or_(low, b.shl(b.and_(nibbles, _splat(_V4I32, 7)), _splat(_V4I32, 8)))
        levels = b.bitcast(e.gather64(table, indices), _V32I8)
        negative = b.lshr(nibbles, _splat(_V4I32, 3))
        offsets = b.add(_splat(_V4I32, 7), b.shl(negative, _splat(_V4I32, 1)))
        per_lane = ir.Constant(_V8I32, [0, 0, 1, 1, 2, 2, 3, 3])
        offsets = b.shuffle_vector(offsets, ir.Constant(_V4I32, None), per_lane)
        shifts = ir.Constant(_V8I32, [3 * (2 * (j % 2))] * 4 + [3 * (2 * (j % 2) + 1)] * 4)
        scales = b.and_(b.lshr(e.splat8i(sc[j // 2]), shifts), _splat(_V8I32, 7))
        odd = b.or_(b.shl(scales, _splat(_V8I32, 1)), _splat(_V8I32, 1))
        yield e.chunk_index(c0, j), levels, offsets, odd, None
    yield BlockEnd(c0, b.fmul(d, ir.Constant(_F32, 0.125)))


# ---- ternary: w = d * (q - 1), q in 0..2, one scale per 256 weights (integer sums to the end)


def _tq2_0(e, blk, c0):
    """qs[64] 2-bit | d f16: Q2_K's low bits without sub-block scales."""
    for h in range(2):
        for j in range(4):
            yield e.chunk_index(c0, 4 * h + j), _crumbs(e, blk, 0, h, j), 1, _ONE, None
    yield BlockEnd(c0, e.f16(blk, 64))


def _trits(e, v, power):
    """Trit `power` (3^k, or a list of one per byte) of each byte of v: ((v * 3^k mod 256) * 3)
    >> 8, 0..2 (see ternary.py), in 16-bit lanes as ggml does: v * (3^k << 8) mod 2^16 is
    (v * 3^k mod 256) << 8 (vpmullw), and its high half times 3 the trit (vpmulhuw)."""
    b = e.b
    n = v.type.count
    powers = [power] * n if isinstance(power, int) else power
    wide, wider = ir.VectorType(_I16, n), ir.VectorType(_I32, n)
    scaled = b.mul(b.zext(v, wide), ir.Constant(wide, [p << 8 for p in powers]))
    high = b.lshr(b.mul(b.zext(scaled, wider), _splat(wider, 3)), _splat(wider, 16))
    return b.trunc(high, v.type)


def _tq1_0(e, blk, c0):
    """qs[48] | qh[4] | d f16: five trits per byte of qs, four per byte of qh (see ternary.py).
    Chunks 0-4 are the trits of qs[0:32]; 5-7 pair the 16-weight trits of qs[32:48], the last
    with qh's 16 weights (byte i's trit k is weight 240 + 4k + i)."""
    b = e.b
    low = e.load(blk, 0, _V32I8)
    for k in range(5):
        yield e.chunk_index(c0, k), _trits(e, low, 3**k), 1, _ONE, None
    mid = e.load(blk, 32, _V16I8)
    halves = [_trits(e, mid, 3**k) for k in range(5)]
    qh = e.load(blk, 48, ir.VectorType(_I8, 4))
    spread = b.shuffle_vector(qh, qh, ir.Constant(_V16I32, [0, 1, 2, 3] * 4))
    halves.append(_trits(e, spread, [3**k for k in range(4) for _ in range(4)]))
    for j in range(3):
        u = e.concat(halves[2 * j], halves[2 * j + 1])
        yield e.chunk_index(c0, 5 + j), u, 1, _ONE, None
    yield BlockEnd(c0, e.f16(blk, 52))


# ---- the types, as the kernels see them

ROWS = 4  # rows per pass of the matvec kernels


@intrinsic
def _rows(typingctx, ggml_type, n_rows, n_tokens, w, r0, t0, xq, xd, xs, xl, out):
    """out[t0:t0 + n_tokens, r0:r0 + n_rows] = x[t0:t0 + n_tokens] . w[r0:r0 + n_rows] (see
    _rows_typer); ggml_type, n_rows and n_tokens must be compile-time constants."""
    if not all(isinstance(v, types.IntegerLiteral) for v in (ggml_type, n_rows, n_tokens)):
        return None
    from . import QUANT_TYPES  # the registry imports this module

    qt = QUANT_TYPES[ggml_type.literal_value]
    sizes = (qt.type_size, qt.block_size // 32, qt.dot_unpacker)
    typer = _rows_typer(*sizes, n_rows.literal_value, n_tokens.literal_value)
    args = (w, r0, t0, xq, xd, xs, xl, out)
    inner_sig, inner_codegen = typer(typingctx, *args)

    def codegen(context, builder, signature, llargs):
        return inner_codegen(context, builder, inner_sig, llargs[3:])

    return types.void(ggml_type, n_rows, n_tokens, *args), codegen


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
            d, inv, d_raw = q8_scale(x[t, lo:hi])
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


@njit(parallel=True, cache=True)
def quantize_q8_tokens(x, super_block, xq, xd, xs, xl):
    """quantize_q8 with the tokens spread over threads (a prefill's activations)."""
    for t in prange(x.shape[0]):
        quantize_q8(x[t : t + 1], super_block, xq[t : t + 1], xd[t : t + 1], xs[t : t + 1],
                    xl[t : t + 1])  # fmt: skip


def activation_buffers(n_tokens: int, n_cols: int) -> tuple:
    """Empty (xq, xd, xs, xl) for quantize_q8."""
    return (
        np.empty((n_tokens, n_cols), np.int8),
        np.empty((n_tokens, n_cols // 32), np.float32),
        np.empty((n_tokens, n_cols // 32), np.float32),
        np.empty((n_tokens, n_cols // 4), np.int32),
    )


# ---- kernels, one per weight type (the type is a constant inside, so each holds only its own
# code). They are made by a factory; each gets its own __qualname__, which is what Numba's
# on-disk cache files are named after, so that the types do not share one cache entry.

# Prefill tiles: TILE_TOKENS tokens share each unpacked weight block (4 rows x 2 tokens: 8 float
# and 8 integer accumulators, which AVX-512's 32 vector registers hold). Tokens go through in
# blocks of about ACTIVATION_BLOCK_BYTES of int8 activations, which stay in L2 while every row
# group of the weights streams past them.
TILE_TOKENS = 2
# Tokens by 4 first (4 rows x 4 tokens: the 16 float accumulators still fit AVX-512's 32
# registers): each unpacked block feeds twice the dot products. A batched step of 8 decode rows
# on qwen2.5-coder-0.5b, 2 threads: 66-67 -> 56-62 ms; pp256 142-152 -> 153-173 tok/s.
WIDE_TILE = 4
ACTIVATION_BLOCK_BYTES = 256 << 10


def matvec_kernel(ggml_type: int, name: str):
    """The integer matvec/matmul for a type whose record names a `dot_unpacker` (see _rows)."""
    source_key = SOURCE_KEY

    def matvec(ws, xq, xd, xs, xl, outs):
        """outs[i] = x @ ws[i].T for a tuple of weights of this type that share the input
        (Q/K/V, gate/up): one parallel region for all their rows per block of tokens.
        xq int8[n_tokens, n_cols], xd/xs float32[n_tokens, n_cols // 32], xl int32[n_tokens,
        n_cols // 4] (see quantize_q8); ws[i]: uint8[n_rows_i, row_bytes]; outs[i]:
        float32[n_tokens, n_rows_i]."""
        depends_on(source_key)  # the record read at compile time lives in another file
        n_tokens, n_cols = xq.shape
        bounds = np.empty(len(ws) + 1, np.int64)  # the row groups of ws[i]: bounds[i]..[i + 1]
        bounds[0] = 0
        for i in range(len(ws)):
            bounds[i + 1] = bounds[i] + (ws[i].shape[0] + ROWS - 1) // ROWS
        per_block = max(TILE_TOKENS, ACTIVATION_BLOCK_BYTES // n_cols // TILE_TOKENS * TILE_TOKENS)
        for b0 in range(0, n_tokens, per_block):
            b1 = min(n_tokens, b0 + per_block)
            tiled4 = b0 + (b1 - b0) // WIDE_TILE * WIDE_TILE
            tiled = tiled4 + (b1 - tiled4) // TILE_TOKENS * TILE_TOKENS
            for g in prange(bounds[len(ws)]):
                i = 0
                while g >= bounds[i + 1]:
                    i += 1
                w, out = ws[i], outs[i]
                n_rows = w.shape[0]
                r0 = (g - bounds[i]) * ROWS
                full = r0 + ROWS <= n_rows
                for t0 in range(b0, tiled4, WIDE_TILE):
                    if full:
                        _rows(ggml_type, ROWS, WIDE_TILE, w, r0, t0, xq, xd, xs, xl, out)
                    else:
                        for r in range(r0, n_rows):
                            _rows(ggml_type, 1, WIDE_TILE, w, r, t0, xq, xd, xs, xl, out)
                for t0 in range(tiled4, tiled, TILE_TOKENS):
                    if full:
                        _rows(ggml_type, ROWS, TILE_TOKENS, w, r0, t0, xq, xd, xs, xl, out)
                    else:
                        for r in range(r0, n_rows):
                            _rows(ggml_type, 1, TILE_TOKENS, w, r, t0, xq, xd, xs, xl, out)
                for t in range(tiled, b1):
                    if full:
                        _rows(ggml_type, ROWS, 1, w, r0, t, xq, xd, xs, xl, out)
                    else:
                        for r in range(r0, n_rows):
                            _rows(ggml_type, 1, 1, w, r, t, xq, xd, xs, xl, out)

    matvec.__qualname__ = f"matvec_{name}"
    return njit(parallel=True, cache=True)(matvec)
