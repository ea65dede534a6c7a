"""Prefill tiles: integer matrix products with the tokens in the SIMD lanes (vpdpbusd on zmm, or
ymm with AVX-VNNI alone; ymm for a batch of up to 8 tokens; with AVX2 alone, ymm and vpmaddubsw),
for prompts and batches.

intdot.py puts a weight row's columns in the lanes: each vpdpbusd multiplies 32 weights with one
token, and every 32 weights take a scale multiply and an add per token as well. Here a tile
holds LANES tokens per vector: four consecutive int8 weights of one row are broadcast to every
lane (an embedded broadcast, folded into vpdpbusd's memory operand), and one vpdpbusd gives 4
columns x LANES tokens. The scales then cost one multiply per 16 or 32 columns for all the
tile's tokens, and the dot products are nearly all the work: 216 G MAC/s on one Sapphire Rapids
core for 4 rows x 32 tokens, against intdot's 40-45.

Per row group (ROWS rows) and block of tokens:

1. unpack: each row's blocks, read by the type's block reader (blocks.py), become int8 weights
   s (u - offset, or the signed grid level), int32 scales and minimums, and per block the float
   d (and dmin, fmin) and the correction C = -128 * sum(scale * s), into the thread's scratch
   (the stream ahead prefetched, as intdot.py's matvec does; C's horizontal sums taken 8 at a
   time by transposing adds: at a few tokens per tile the unpacking is half the work);
2. tiles: the activations go in as unsigned bytes x + 128 (x ^ 0x80), packed [column group of
   4][token][4] (`_pack_tile`), so that vpdpbusd(u8 activations, i8 weights) gives
   sum(s * x) + 128 * sum(s), which C cancels: the block's exact integer sum S, as intdot.py
   computes it. The float steps after it are blocks.py's, the same operations lane by lane:
   a token's outputs are bit-identical to its decode, alone or in any batch. AVX2 has no
   vpdpbusd: the activations go in signed (no C), and 4 columns x 8 tokens are vpmaddubsw(|w|,
   x with w's sign) widened by vpmaddwd, ggml's sign trick (|w| <= 128, |x| <= 127: a pair of
   products stays within int16); where the weights are bounded (Layout.magnitude) the int16
   pairs are added up over several groups of columns before one vpmaddwd widens them, times the
   sub-block's scale, and unsigned weights (Layout.unsigned) skip the signs.

The unpacked rows are reused by every tile of the block of tokens (TILE_BLOCK_BYTES of packed
activations, which stay in L2), so a row's blocks are unpacked once per block of tokens.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import config, get_thread_id, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .blocks import (
    F32,
    I8,
    I16,
    I32,
    I64,
    SIGNED,
    V8I32,
    V32I8,
    BlockEnd,
    BlockReader,
    Chunk,
    Signs,
    halves,
    splat,
)
from .cpu import INSTRUCTION_SET, TILE_LANES
from .intdot import (
    float_steps,
    group_at,
    phadd,
    prefetch_stream,
    reduce_add,
    row_groups,
    sums_of_8,
)
from .kernels import SOURCE_KEY, depends_on

AVAILABLE = TILE_LANES > 0
# vpdpbusd (VNNI): activations stored unsigned, x ^ 0x80, corrected by C; else AVX2: signed, and
# each product by ggml's sign trick, vpmaddubsw(|w|, x with w's sign), exact since |w| <= 128
# and |x| <= 127 keep a pair's sum within int16 (see _Tile.dot)
VNNI = INSTRUCTION_SET == "vnni"
FLIP = np.uint32(0x80808080 if VNNI else 0)  # what _pack_tile xors 4 quants with
LANES = TILE_LANES or 16  # tokens per vector (16 only names the layout where there are no tiles)
ROWS = 4  # weight rows per tile
TILE_VECTORS = 2  # vectors of LANES tokens per tile: 4 x 2 x 16 = 128 int32 sums in 8 zmm
# Tile shapes (lanes, vectors), each a kernel of its own (one holding several compiles the
# wide one into slower code); a call takes the first that holds all its tokens, else the last.
# Up to 8 tokens (a few sequences' decode rows): one ymm, since the 256-bit vpdpbusd issues
# twice per cycle where the 512-bit one issues once (Q5_0 gate+up of qwen2.5-coder-0.5b, 8
# tokens, one thread: 0.45 ms against 0.59 in a zmm of 16 lanes); up to 16, one zmm (0.62 ms
# against 0.74 in two ymm tiles); more, TILE_VECTORS of LANES.
NARROW_LANES = 8
TILE_SHAPES = tuple(dict.fromkeys(((NARROW_LANES, 1), (LANES, 1), (LANES, TILE_VECTORS))))
# packed activations per block of tokens; whole tiles, at least MIN_TILES of them: a row's
# unpacking is paid once per block
TILE_BLOCK_BYTES = 1 << 20
MIN_TILES = 4
# a scratch per thread Numba may run (get_num_threads would keep the kernel out of the disk cache)
MAX_THREADS = config.NUMBA_NUM_THREADS


# ---- the thread's scratch: ROWS unpacked rows, sections of n_cols-dependent sizes


def _scratch_sections(n_cols):
    """(name, bytes per row) of the scratch, in order: s int8 per column, sc int32 and mn int16
    (room for int32) per 16 columns, then per 32-column unit (at most one block each) corr
    int32, d, dmin, fmin f32."""
    per16, per32 = n_cols // 16 * 4, n_cols // 32 * 4
    return (("s", n_cols), ("sc", per16), ("mn", per16), ("corr", per32), ("d", per32),
            ("dmin", per32), ("fmin", per32))  # fmt: skip


@njit(cache=True)
def scratch_bytes(n_cols):
    """Bytes of a row group's scratch: ROWS rows of the sections of _scratch_sections."""
    return ROWS * (n_cols + 2 * (n_cols // 16 * 4) + 4 * (n_cols // 32 * 4))


class _Scratch:
    """Typed pointers into one row group's scratch (i8* base) for a row count of n_cols (i64)."""

    TYPES = {"s": I8, "sc": I32, "mn": I16, "corr": I32, "d": F32, "dmin": F32, "fmin": F32}

    def __init__(self, builder, base, n_cols):
        self.b, self.base = builder, base
        self.offsets, offset = {}, ir.Constant(I64, 0)
        for name, _ in _scratch_sections(1):
            self.offsets[name] = offset
            size = {
                "s": n_cols,
                "sc": builder.udiv(n_cols, ir.Constant(I64, 4)),
                "mn": builder.udiv(n_cols, ir.Constant(I64, 4)),
            }.get(  # fmt: skip
                name, builder.udiv(n_cols, ir.Constant(I64, 8))
            )
            offset = builder.add(offset, builder.mul(size, ir.Constant(I64, ROWS)))
        self.n_cols = n_cols

    def at(self, name, row, index):
        """Pointer to element `index` (i64) of row `row` (int or i64) of section `name`."""
        b = self.b
        per_row = {
            "s": self.n_cols,
            "sc": b.udiv(self.n_cols, ir.Constant(I64, 4)),
            "mn": b.udiv(self.n_cols, ir.Constant(I64, 4)),
        }.get(  # fmt: skip
            name, b.udiv(self.n_cols, ir.Constant(I64, 8))
        )
        if isinstance(row, int):
            row = ir.Constant(I64, row)
        start = b.add(self.offsets[name], b.mul(per_row, row))
        section = b.bitcast(b.gep(self.base, [start]), self.TYPES[name].as_pointer())
        return b.gep(section, [index])


# ---- 1. unpack


class _Unpacker(BlockReader):
    """A block reader's chunks written out as int8 weights and int32 scales (see the module)."""

    def __init__(self, builder, scratch, row, layout, chunks_per_block):
        super().__init__(builder)
        self.scratch, self.row, self.layout = scratch, row, layout
        self.chunks_per_block = chunks_per_block
        self.chunks = []  # the block's chunks so far: (lane sums, scale) of each
        # blocks of one chunk: (its scaled lane sums, block index) until 8 of them are added up
        # together (flush)
        self.deferred = chunks_per_block == 1
        self.pending = []

    def weights(self, chunk):
        """<32 x i8>: the chunk's integer weights."""
        b, u, offset = self.b, chunk.u, chunk.offset
        if isinstance(offset, Signs):
            return self.apply_signs(u, offset)
        if isinstance(offset, ir.Value):
            if offset.type == I32:
                return b.sub(u, b.bitcast(self.splat8i(b.mul(offset, ir.Constant(I32, 0x01010101))),
                                          V32I8))  # fmt: skip
            bytes8 = b.trunc(offset, ir.VectorType(I8, 8))  # per lane of 4 weights
            spread = ir.Constant(ir.VectorType(I32, 32), [k // 4 for k in range(32)])
            return b.sub(u, b.shuffle_vector(bytes8, ir.Constant(bytes8.type, None), spread))
        if offset == SIGNED or offset == 0:
            return u
        return b.sub(u, splat(V32I8, offset))

    def take(self, item):
        if isinstance(item, Chunk):
            for chunk in halves(self, item):
                self.take_chunk(chunk)
        else:
            self.take_end(item)

    def take_chunk(self, item):
        b, s = self.b, self.scratch
        weights = self.weights(item)
        at = s.at("s", self.row, b.mul(item.index, ir.Constant(I64, 32)))
        b.store(weights, b.bitcast(at, V32I8.as_pointer()), align=1)
        if item.scale is not None:
            self.store_scale(item.index, item.scale)
        if not VNNI:  # C: only for the unsigned activations of vpdpbusd
            return
        # per lane: the sum of its 4 weights (vpdpbusd with unsigned ones); scaled at the
        # block's end
        ones = splat(V32I8, 1)
        args = [b.bitcast(v, V8I32) for v in (ir.Constant(V8I32, None), ones, weights)]
        sums = self.intrinsic("llvm.x86.avx512.vpdpbusd.256", V8I32, *args)
        self.chunks.append((sums, item.scale))

    def take_end(self, item):
        b, s = self.b, self.scratch
        block = b.udiv(item.index, ir.Constant(I64, self.chunks_per_block))
        if VNNI and self.deferred:
            ((sums, scale),) = self.chunks
            self.chunks = []
            self.pending.append((sums if scale is None else b.mul(sums, self.lanes(scale)), block))
        elif VNNI:
            correction = b.mul(self.block_sum(), ir.Constant(I32, -128))
            b.store(correction, s.at("corr", self.row, block))
        b.store(item.d, s.at("d", self.row, block))
        if item.mins is not None:
            n = item.mins.type.count
            at = s.at("mn", self.row, b.mul(block, ir.Constant(I64, n)))
            mins = b.trunc(item.mins, ir.VectorType(I16, n))  # 4-6 bits: pairs for vpdpwssd
            b.store(mins, b.bitcast(at, mins.type.as_pointer()), align=2)
            b.store(item.dmin, s.at("dmin", self.row, block))
        if item.fmin is not None:
            b.store(item.fmin, s.at("fmin", self.row, block))

    def lanes(self, scale):
        """<8 x i32>: a chunk's scale (one i32, or one per lane) in every lane."""
        return self.splat8i(scale) if scale.type == I32 else scale

    def block_sum(self):
        """i32: the sum over the block's chunks of scale x weight, from their lane sums. For 8
        chunks, the same integer as scaling each chunk's lanes and adding them up in fewer
        instructions: the chunks' sums by transposing adds, then one multiply by their
        scales."""
        b = self.b
        chunks, self.chunks = self.chunks, []
        sums = [lanes for lanes, _ in chunks]
        scales = [scale for _, scale in chunks]
        if scales[0] is None or len(chunks) != 8:
            total = ir.Constant(V8I32, None)
            for lanes, scale in chunks:
                total = b.add(total, lanes if scale is None else b.mul(lanes, self.lanes(scale)))
            return reduce_add(self, total)

        def lane(scale, k):  # the scale of lane k (a chunk's scale is one i32, or per lane)
            return scale if scale.type == I32 else b.extract_element(scale, ir.Constant(I32, k))

        def vector(values):
            v = ir.Constant(V8I32, None)
            for k, value in enumerate(values):
                v = b.insert_element(v, value, ir.Constant(I32, k))
            return v

        if self.layout.sub_cols == 32:  # lane k: chunk k's sum, times its scale
            return reduce_add(
                self, b.mul(sums_of_8(self, sums), vector([lane(s, 0) for s in scales]))
            )

        # 16-weight scales (lanes 0-3 of a chunk, and 4-7): vphaddd of vphaddd gives, for 4
        # chunks, [lanes 0-3 of each of them, lanes 4-7 of each]
        total = ir.Constant(V8I32, None)
        for four in (slice(0, 4), slice(4, 8)):
            v, sc = sums[four], scales[four]
            halves = phadd(self, phadd(self, v[0], v[1]), phadd(self, v[2], v[3]))
            factors = vector([lane(s, 0) for s in sc] + [lane(s, 4) for s in sc])
            total = b.add(total, b.mul(halves, factors))
        return reduce_add(self, total)

    def flush(self):
        """The corrections of the deferred blocks (consecutive): 8 by one transposing add and
        one vector store, fewer (a row's last) one by one."""
        b, s = self.b, self.scratch
        pending, self.pending = self.pending, []
        if len(pending) == 8:
            sums = sums_of_8(self, [lanes for lanes, _ in pending])
            at = s.at("corr", self.row, pending[0][1])
            b.store(b.mul(sums, splat(V8I32, -128)), b.bitcast(at, V8I32.as_pointer()), align=4)
            return
        for lanes, block in pending:
            correction = b.mul(reduce_add(self, lanes), ir.Constant(I32, -128))
            b.store(correction, s.at("corr", self.row, block))

    def store_scale(self, c, scale):
        b, s = self.b, self.scratch
        sub_cols = self.layout.sub_cols
        if sub_cols == 32:
            value = scale if scale.type == I32 else b.extract_element(scale, ir.Constant(I32, 0))
            b.store(value, s.at("sc", self.row, c))
            return
        for half in range(2):  # 16-weight scales: lanes 0-3 and 4-7
            value = scale
            if scale.type != I32:
                value = b.extract_element(scale, ir.Constant(I32, 4 * half))
            index = b.add(b.mul(c, ir.Constant(I64, 2)), ir.Constant(I64, half))
            b.store(value, s.at("sc", self.row, index))


@intrinsic
def _unpack(typingctx, ggml_type, w, r0, scratch):
    """Rows r0 .. r0 + ROWS - 1 of w (the last row again where w has fewer) into scratch
    (uint8[scratch_bytes(n_cols)])."""
    if not isinstance(ggml_type, types.IntegerLiteral):
        return None
    from . import QUANT_TYPES  # the registry imports this module

    qt = QUANT_TYPES[ggml_type.literal_value]
    read_block = qt.dot_unpacker
    chunks_per_block = qt.block_size // 32
    sig = types.void(ggml_type, w, r0, scratch)

    def codegen(context, builder, signature, args):
        b = builder
        w = context.make_array(signature.args[1])(context, b, args[1])
        r0 = context.cast(b, args[2], signature.args[2], types.int64)
        base = context.make_array(signature.args[3])(context, b, args[3]).data
        n_rows, row_bytes = (b.extract_value(w.shape, k) for k in (0, 1))
        n_blocks = b.udiv(row_bytes, ir.Constant(I64, qt.type_size))
        n_cols = b.mul(n_blocks, ir.Constant(I64, qt.block_size))
        scratch = _Scratch(b, base, n_cols)
        last = b.sub(n_rows, ir.Constant(I64, 1))
        with cgutils.for_range(b, ir.Constant(I64, ROWS)) as rows:  # one copy of the reader
            row = b.add(r0, rows.index)
            row = b.select(b.icmp_signed("<", row, n_rows), row, last)
            row_ptr = b.gep(w.data, [b.mul(row, row_bytes)])
            e = _Unpacker(b, scratch, rows.index, read_block.layout, chunks_per_block)

            def blocks(first_block, count):
                """count blocks from first_block on; the stream ahead of them prefetched first,
                as intdot's matvec does."""
                start = b.gep(row_ptr, [b.mul(first_block, ir.Constant(I64, qt.type_size))])
                prefetch_stream(b, start, count * qt.type_size)
                for k in range(count):
                    block = b.add(first_block, ir.Constant(I64, k))
                    block_ptr = b.gep(row_ptr, [b.mul(block, ir.Constant(I64, qt.type_size))])
                    first = b.mul(block, ir.Constant(I64, chunks_per_block))
                    for item in read_block(e, block_ptr, first):
                        e.take(item)
                e.flush()

            # 32-weight blocks go 8 at a time (one transposing add for their corrections)
            group = 8 if e.deferred else 1
            n_groups = b.udiv(n_blocks, ir.Constant(I64, group))
            with cgutils.for_range(b, n_groups) as loop:
                blocks(b.mul(loop.index, ir.Constant(I64, group)), group)
            if group > 1:  # the row's last blocks, one at a time
                done = b.mul(n_groups, ir.Constant(I64, group))
                with cgutils.for_range(b, b.sub(n_blocks, done)) as loop:
                    blocks(b.add(done, loop.index), 1)
        return context.get_dummy_value()

    return sig, codegen


# ---- 2. tiles


@njit(cache=True)
def tile_bytes(n_cols, lanes):
    """Bytes of one packed tile of `lanes` tokens: activations + 128 [n_cols // 4][lanes][4],
    then per 32 columns dx and xs (f32), the quants' sums of 16 columns in int16 pairs (one pair
    per 32 columns), and of 32 columns (a pair per 64), each [..][lanes] (see _pack_tile)."""
    n32, n64 = n_cols // 32, (n_cols + 63) // 64
    return lanes * (n_cols + n32 * 12 + n64 * 4)


@njit(cache=True)
def _pack_tile(xq, xd, xs, xb, t0, tile, lanes):
    """Tokens t0 .. t0 + lanes - 1 (zeros past the last) into one packed tile (tile_bytes), the
    quants xor FLIP (unsigned for vpdpbusd). The sums go in pairs of int16 (|sum| <= 32 * 127)
    per int32, for vpdpwssd with the minimums."""
    n_tokens, n_cols = xq.shape
    n32, n64 = n_cols // 32, (n_cols + 63) // 64
    quants = tile[: n_cols * lanes].view(np.uint32)  # 4 quants + 128 per lane and column group
    floats = tile[n_cols * lanes : n_cols * lanes + 8 * n32 * lanes].view(np.float32)
    pairs = tile[n_cols * lanes + 8 * n32 * lanes :].view(np.uint32)  # 16-col, then 32-col sums
    mask = np.uint32(0xFFFF)
    for lane in range(lanes):
        t = t0 + lane
        if t < n_tokens:
            row = xq[t].view(np.uint32)
            for g in range(n_cols // 4):
                quants[g * lanes + lane] = row[g] ^ FLIP
            for c in range(n32):
                floats[c * lanes + lane] = xd[t, c]
                floats[(n32 + c) * lanes + lane] = xs[t, c]
                low, high = np.uint32(xb[t, 2 * c]), np.uint32(xb[t, 2 * c + 1])
                pairs[c * lanes + lane] = (low & mask) | (high << np.uint32(16))
            for k in range(n64):
                low = np.uint32(xb[t, 4 * k] + xb[t, 4 * k + 1])
                high = np.uint32(0)
                if 4 * k + 3 < xb.shape[1]:
                    high = np.uint32(xb[t, 4 * k + 2] + xb[t, 4 * k + 3])
                pairs[(n32 + k) * lanes + lane] = (low & mask) | (high << np.uint32(16))
        else:  # x = 0: adds nothing, whatever the weights
            for g in range(n_cols // 4):
                quants[g * lanes + lane] = FLIP
            for c in range(n32):
                floats[c * lanes + lane] = 0.0
                floats[(n32 + c) * lanes + lane] = 0.0
                pairs[c * lanes + lane] = 0
            for k in range(n64):
                pairs[(n32 + k) * lanes + lane] = 0


def _tile_codegen(qt, n_vectors, lanes):
    """The codegen of `_tile` for a type and tile shape (see _tile)."""
    read_block = qt.dot_unpacker
    layout = read_block.layout
    block_cols = qt.block_size
    vi32, vf32 = ir.VectorType(I32, lanes), ir.VectorType(F32, lanes)
    dot_name = f"llvm.x86.avx512.vpdpbusd.{32 * lanes}"
    pairs_name = f"llvm.x86.avx512.vpdpwssd.{32 * lanes}"

    def codegen(context, builder, signature, args):
        b = builder
        e = BlockReader(b)  # for its IR helpers
        base = context.make_array(signature.args[1])(context, b, args[1]).data
        tiles = context.make_array(signature.args[2])(context, b, args[2])
        k0, n_cols, t0, t_end, r0, n_rows = (
            context.cast(b, args[i], signature.args[i], types.int64) for i in (3, 4, 6, 7, 8, 9)
        )
        out = context.make_array(signature.args[5])(context, b, args[5])
        scratch = _Scratch(b, base, n_cols)
        tile_size = b.extract_value(tiles.shape, 1)
        n32 = b.udiv(n_cols, ir.Constant(I64, 32))
        tile_ptrs = [b.gep(tiles.data, [b.mul(b.add(k0, ir.Constant(I64, v)), tile_size)])
                     for v in range(n_vectors)]  # fmt: skip

        def tile_vector(v, section, index, ty):
            """<lanes x ty> at element `index` (per lane group) of a tile section."""
            start = {"q": ir.Constant(I64, 0), "dx": b.mul(n_cols, ir.Constant(I64, lanes)),
                     "xs": b.add(b.mul(n_cols, ir.Constant(I64, lanes)),
                                 b.mul(n32, ir.Constant(I64, 4 * lanes))),
                     "p16": b.add(b.mul(n_cols, ir.Constant(I64, lanes)),
                                  b.mul(n32, ir.Constant(I64, 8 * lanes))),
                     "p32": b.add(b.mul(n_cols, ir.Constant(I64, lanes)),
                                  b.mul(n32, ir.Constant(I64, 12 * lanes)))}[section]  # fmt: skip
            at = b.add(start, b.mul(index, ir.Constant(I64, 4 * lanes)))
            return b.load(b.bitcast(b.gep(tile_ptrs[v], [at]), ty.as_pointer()), align=4)

        def broadcast(value, vtype):
            one = b.insert_element(ir.Constant(vtype, None), value, ir.Constant(I32, 0))
            mask = ir.Constant(ir.VectorType(I32, lanes), None)
            return b.shuffle_vector(one, ir.Constant(vtype, None), mask)

        i16 = ir.VectorType(I16, 2 * lanes)
        ones = splat(i16, 1)

        def pairs_dot(acc, x, y):
            """acc + per lane x's two int16 times y's (vpdpwssd)."""
            if VNNI:
                return e.intrinsic(pairs_name, vi32, acc, x, y)
            x, y = b.bitcast(x, i16), b.bitcast(y, i16)
            return b.add(acc, e.intrinsic("llvm.x86.avx2.pmadd.wd", vi32, x, y))

        acc = [[cgutils.alloca_once_value(b, ir.Constant(vf32, None)) for _ in range(n_vectors)]
               for _ in range(ROWS)]  # fmt: skip
        n_blocks = b.udiv(n_cols, ir.Constant(I64, block_cols))
        # a part: the columns one integer scale covers (16 or 32), or 32 of an unscaled block;
        # a runtime loop over a block's parts keeps the unrolled code (and its compile) small
        # (unscaled blocks by 16 columns with AVX2's 16 registers: 8 groups of 4 rows x 2 vectors
        # unrolled made LLVM spill; one thread, 128 tokens, Q8_0 and Q4_0 ~40 -> ~49 G MAC/s)
        part_cols = layout.sub_cols or (32 if VNNI else 16)
        n_parts = block_cols // part_cols
        # AVX2: vpmaddubsw's int16 pairs of `run` groups of 4 columns added up in int16 (within
        # +-2**15: one group where the weights' magnitude is not known, |w| <= 128), then widened
        # by one vpmaddwd (times the part's scale where one run covers the part); unsigned
        # weights go into vpmaddubsw as they are, the others by ggml's sign trick. VNNI: vpdpbusd.
        run = 0
        if not VNNI:
            run = 1
            if layout.magnitude:
                run = min(part_cols // 4, 32767 // (2 * 127 * layout.magnitude))
        scaled_runs = run == part_cols // 4 and layout.sub_cols
        with cgutils.for_range(b, n_blocks) as loop:
            blk = loop.index
            total = [[cgutils.alloca_once(b, vi32) for _ in range(n_vectors)] for _ in range(ROWS)]
            for r in range(ROWS):
                corr = ir.Constant(vi32, None)
                if VNNI:
                    corr = broadcast(b.load(scratch.at("corr", r, blk)), vi32)
                for v in range(n_vectors):
                    b.store(corr, total[r][v])
            with cgutils.for_range(b, ir.Constant(I64, n_parts)) as parts:
                part = b.add(b.mul(blk, ir.Constant(I64, n_parts)), parts.index)
                first_group = b.mul(part, ir.Constant(I64, part_cols // 4))
                zero = ir.Constant(vi32, None)
                isum = [[zero] * n_vectors for _ in range(ROWS)]
                scale = [None] * ROWS
                if layout.sub_cols:
                    scale = [broadcast(b.load(scratch.at("sc", r, part)), vi32)
                             for r in range(ROWS)]  # fmt: skip
                pairs = [[None] * n_vectors for _ in range(ROWS)]
                for g in range(part_cols // 4):
                    group = b.add(first_group, ir.Constant(I64, g))
                    a = [tile_vector(v, "q", group, vi32) for v in range(n_vectors)]
                    for r in range(ROWS):
                        at = scratch.at("s", r, b.mul(group, ir.Constant(I64, 4)))
                        w4 = b.load(b.bitcast(at, I32.as_pointer()), align=4)
                        w = broadcast(w4, vi32)
                        if run:
                            w8 = b.bitcast(w, V32I8)
                            magnitudes = w8 if layout.unsigned else e.sign(w8, w8)
                        for v in range(n_vectors):
                            if not run:
                                isum[r][v] = e.intrinsic(dot_name, vi32, isum[r][v], a[v], w)
                                continue
                            x = b.bitcast(a[v], V32I8)
                            x = x if layout.unsigned else e.sign(x, w8)
                            p = e.intrinsic("llvm.x86.avx2.pmadd.ub.sw", i16, magnitudes, x)
                            p = p if pairs[r][v] is None else b.add(pairs[r][v], p)
                            pairs[r][v] = p
                            if (g + 1) % run and g + 1 < part_cols // 4:
                                continue
                            times = ones
                            if scaled_runs:  # the scale in both int16 halves of each lane
                                low = b.and_(scale[r], splat(vi32, 0xFFFF))
                                both = b.or_(low, b.shl(scale[r], splat(vi32, 16)))
                                times = b.bitcast(both, i16)
                            widened = e.intrinsic("llvm.x86.avx2.pmadd.wd", vi32, p, times)
                            isum[r][v], pairs[r][v] = b.add(isum[r][v], widened), None
                for r in range(ROWS):
                    for v in range(n_vectors):
                        scaled = isum[r][v]
                        if scale[r] is not None and not scaled_runs:
                            scaled = b.mul(scaled, scale[r])
                        b.store(b.add(b.load(total[r][v]), scaled), total[r][v])
            total = [[b.load(total[r][v]) for v in range(n_vectors)] for r in range(ROWS)]
            unit = b.mul(blk, ir.Constant(I64, block_cols // 32))  # the sections are per 32
            dx = [tile_vector(v, "dx", unit, vf32) for v in range(n_vectors)]
            xs = [tile_vector(v, "xs", unit, vf32) for v in range(n_vectors)]
            for r in range(ROWS):
                for v in range(n_vectors):
                    end = BlockEnd(
                        blk, b.load(scratch.at("d", r, blk)),
                        mins=True if layout.min_cols else None,
                        dmin=b.load(scratch.at("dmin", r, blk)) if layout.min_cols else None,
                        fmin=b.load(scratch.at("fmin", r, blk)) if layout.float_min else None,
                    )  # fmt: skip

                    def mins_sum(_, r=r, v=v):
                        # pairs of minimums (int16) times pairs of activation sums: vpdpwssd
                        n_pairs = block_cols // layout.min_cols // 2
                        section = "p32" if layout.min_cols == 32 else "p16"
                        m_total = ir.Constant(vi32, None)
                        for k in range(n_pairs):
                            index = b.add(
                                b.mul(blk, ir.Constant(I64, n_pairs)), ir.Constant(I64, k)
                            )
                            at = scratch.at("mn", r, b.mul(index, ir.Constant(I64, 2)))
                            pair = b.load(b.bitcast(at, I32.as_pointer()), align=2)
                            sums = tile_vector(v, section, index, vi32)
                            m_total = pairs_dot(m_total, sums, broadcast(pair, vi32))
                        return m_total

                    value = float_steps(e, b.load(acc[r][v]), total[r][v], end, dx[v], mins_sum,
                                        xs[v])  # fmt: skip
                    b.store(value, acc[r][v])
        # out[t, r0 + r] for the tile's tokens t < t_end and rows r0 + r < n_rows
        for r in range(ROWS):
            row_ok = b.icmp_signed("<", ir.Constant(I64, r), n_rows)
            for v in range(n_vectors):
                values = b.load(acc[r][v])
                for lane in range(lanes):
                    t = b.add(t0, ir.Constant(I64, v * lanes + lane))
                    ok = b.and_(row_ok, b.icmp_signed("<", t, t_end))
                    with b.if_then(ok, likely=True):
                        width = b.extract_value(out.shape, 1)
                        at = b.add(b.mul(t, width), b.add(r0, ir.Constant(I64, r)))
                        value = b.extract_element(values, ir.Constant(I32, lane))
                        b.store(value, b.gep(out.data, [at]))
        return context.get_dummy_value()

    return codegen


@intrinsic
def _tile(typingctx, ggml_type, lanes, n_vectors, scratch, tiles, k0, n_cols, out, t0, t_end, r0,
          n_rows):  # fmt: skip
    """out[t0 + i, r0 + r] = the scratch's unpacked row r . token i of tiles k0 .. k0 +
    n_vectors - 1 (of `lanes` tokens each), for r < min(ROWS, n_rows) and t0 + i < t_end.
    ggml_type, lanes and n_vectors must be compile-time constants."""
    if not all(isinstance(v, types.IntegerLiteral) for v in (ggml_type, lanes, n_vectors)):
        return None
    from . import QUANT_TYPES  # the registry imports this module

    qt = QUANT_TYPES[ggml_type.literal_value]
    codegen = _tile_codegen(qt, n_vectors.literal_value, lanes.literal_value)
    args = (scratch, tiles, k0, n_cols, out, t0, t_end, r0, n_rows)
    sig = types.void(ggml_type, lanes, n_vectors, *args)

    def shifted(context, builder, signature, llargs):  # the codegen's indices skip 2 constants
        inner = types.void(*signature.args[2:])
        return codegen(context, builder, inner, llargs[2:])

    return sig, shifted


def gemm_kernel(ggml_type: int, name: str):
    """The tiled integer matmul for a type whose record names a `dot_unpacker`: the same call as
    intdot's matvec kernel, for any number of tokens, in the first of TILE_SHAPES that holds
    them all (each kernel compiles at its first call)."""
    kernels = [(lanes * n, _gemm_kernel(ggml_type, name, n, lanes)) for lanes, n in TILE_SHAPES]

    def gemm(ws, xq, xd, xs, xl, xb, outs):
        n_tokens = xq.shape[0]
        kernel = next((k for size, k in kernels if n_tokens <= size), kernels[-1][1])
        kernel(ws, xq, xd, xs, xl, xb, outs)

    gemm.__qualname__ = f"gemm_{name}"
    return gemm


def _gemm_kernel(ggml_type: int, name: str, n_vectors: int, lanes: int):
    source_key = SOURCE_KEY

    def gemm(ws, xq, xd, xs, xl, xb, outs):
        """outs[i] = x @ ws[i].T for weights of this type sharing the input (see intdot's
        matvec: the same arguments; xl is not used here)."""
        depends_on(source_key)
        n_tokens, n_cols = xq.shape
        # whole tile calls of n_vectors tiles: the last one padded with tokens of zeros
        n_tiles = (n_tokens + lanes * n_vectors - 1) // (lanes * n_vectors) * n_vectors
        size = tile_bytes(n_cols, lanes)
        per_block = max(MIN_TILES, TILE_BLOCK_BYTES // size // n_vectors * n_vectors)
        tiles = np.empty((min(per_block, n_tiles), size), np.uint8)
        scratch = np.empty((MAX_THREADS, scratch_bytes(n_cols)), np.uint8)
        bounds = row_groups(ws, ROWS)
        for kb in range(0, n_tiles, per_block):
            n_block = min(per_block, n_tiles - kb)
            for k in prange(n_block):
                _pack_tile(xq, xd, xs, xb, (kb + k) * lanes, tiles[k], lanes)
            for g in prange(bounds[len(ws)]):
                i, r0 = group_at(bounds, g, ROWS)
                w, out = ws[i], outs[i]
                own = scratch[get_thread_id()]
                _unpack(ggml_type, w, r0, own)
                n_rows = w.shape[0] - r0
                for k in range(0, n_block, n_vectors):
                    t0 = (kb + k) * lanes
                    _tile(ggml_type, lanes, n_vectors, own, tiles, k, n_cols, out, t0, n_tokens,
                          r0, n_rows)  # fmt: skip

    gemm.__qualname__ = f"gemm_{name}_{n_vectors}x{lanes}"
    return njit(parallel=True, cache=True)(gemm)
