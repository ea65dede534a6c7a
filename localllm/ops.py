"""Transformer ops as Numba kernels: RMSNorm, LayerNorm, RoPE, attention, activations.

Each op works in place or into a buffer the caller allocated once at load (see models/), so a
decode step allocates nothing. For one token only attention runs threads: the element-wise ops
are a few microseconds of work, less than waking the thread pool costs (much less on a busy
machine, where a parallel region waits for a descheduled thread); prefill spreads its tokens
over threads (`*_rows`). Float order follows ggml's CPU code where that is cheap, so that
logits stay close to llama.cpp's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import get_thread_id, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from localllm.quants.activations import f16_bits, round_f16
from localllm.quants.cpu import HARDWARE_HALF
from localllm.quants.float import _bits_to_f32, f16_to_f32


@njit(cache=True)
def rmsnorm(x, weight, eps, out):
    """out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * weight, for every row i.

    x, out: float32[n_rows, dim]; weight: float32[dim]. out may be x.
    """
    n_rows, dim = x.shape
    for i in range(n_rows):
        # ggml sums squares in float (ggml_float = double on CPU) then scales in float32.
        ss = 0.0
        for j in range(dim):
            ss += np.float64(x[i, j]) * np.float64(x[i, j])
        scale = np.float32(1.0 / math.sqrt(np.float32(ss / dim) + eps))
        for j in range(dim):
            out[i, j] = x[i, j] * scale * weight[j]


@njit(cache=True)
def layernorm(x, weight, bias, eps, out):
    """out[i] = (x[i] - mean(x[i])) / sqrt(var(x[i]) + eps) * weight + bias, for every row i
    (the encoders' LayerNorm). x, out: float32[n_rows, dim]; weight, bias: float32[dim]. out
    may be x.

    As ggml_norm then build_norm's mul and add: the mean from a float64 sum, the variance of
    the float32 differences summed in float64, one float32 scale, then weight and bias.
    """
    n_rows, dim = x.shape
    for i in range(n_rows):
        total = 0.0
        for j in range(dim):
            total += np.float64(x[i, j])
        mean = np.float32(np.float32(total) / np.float32(dim))
        ss = 0.0
        for j in range(dim):
            d = x[i, j] - mean
            ss += np.float64(d * d)
        scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(ss / dim) + eps))
        for j in range(dim):
            out[i, j] = (x[i, j] - mean) * scale * weight[j] + bias[j]


@njit(cache=True)
def rmsnorm_heads(x, weight, eps):
    """RMSNorm of every head vector in place (QK-norm). x: float32[n_tokens, n_heads, head_dim]."""
    n_tokens, n_heads, head_dim = x.shape
    for t in range(n_tokens):
        for h in range(n_heads):
            ss = 0.0
            for j in range(head_dim):
                ss += np.float64(x[t, h, j]) * np.float64(x[t, h, j])
            scale = np.float32(1.0 / math.sqrt(np.float32(ss / head_dim) + eps))
            for j in range(head_dim):
                x[t, h, j] = x[t, h, j] * scale * weight[j]


@dataclass(frozen=True)
class RopeScaling:
    """How positions are stretched for a longer context: the parameters llama.cpp passes to
    ggml_rope_ext (see `rope_tables`; models/config.py reads them from the GGUF metadata).

    freq_scale: positions are multiplied by it (linear and YaRN scaling: 1 / rope.scaling.factor).
    ext_factor: YaRN's extrapolation mix (1 for yarn, 0 otherwise): pairs whose wavelength fits
    the original context n_ctx_orig keep their unscaled angle, the others are interpolated, with
    a linear ramp between the correction dims that beta_fast and beta_slow (rotations) give.
    attn_factor: cos and sin are multiplied by it (llama.cpp's yarn_attn_factor); with YaRN, ggml
    multiplies it again by 1 + 0.1 ln(1 / freq_scale).
    """

    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    n_ctx_orig: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0


NO_SCALING = RopeScaling()


def _logf(x) -> np.float32:
    """logf in float32, correctly rounded (as glibc's logf is)."""
    return np.float32(math.log(np.float32(x)))


def yarn_corr_dims(
    rope_dim: int, n_ctx_orig: int, theta_base: float, beta_fast: float, beta_slow: float
) -> tuple[np.float32, np.float32]:
    """The pairs YaRN's ramp runs between, in float32 as ggml_rope_yarn_corr_dims computes them:
    the pair index where a pair turns beta rotations over n_ctx_orig positions."""
    f32 = np.float32

    def corr_dim(n_rot):
        ratio = f32(n_ctx_orig) / f32(f32(f32(n_rot) * f32(2.0)) * f32(math.pi))
        return f32(f32(rope_dim) * _logf(ratio)) / f32(f32(2.0) * _logf(theta_base))

    start = f32(math.floor(corr_dim(beta_fast)))
    end = f32(math.ceil(corr_dim(beta_slow)))
    return max(f32(0.0), start), min(f32(rope_dim - 1), end)


def rope_tables(
    positions: np.ndarray,
    rope_dim: int,
    theta_base: float,
    scaling: RopeScaling = NO_SCALING,
    freq_factors: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin): float32[n_tokens, rope_dim // 2] each, for int64 positions, as ggml_rope_ext
    makes them. freq_factors: float32[rope_dim // 2] or None; pair i's angle is divided by
    freq_factors[i] (the file's rope_freqs.weight: Llama 3.1+'s llama3 scaling)."""
    s = scaling
    n_pairs = rope_dim // 2
    if freq_factors is None:
        freq_factors = np.ones(n_pairs, dtype=np.float32)
    low, high = np.float32(0.0), np.float32(0.0)
    mscale = np.float32(s.attn_factor)
    if s.ext_factor != 0.0:
        low, high = yarn_corr_dims(rope_dim, s.n_ctx_orig, theta_base, s.beta_fast, s.beta_slow)
        inverse = np.float32(np.float32(1.0) / np.float32(s.freq_scale))
        mscale = np.float32(mscale * np.float32(1.0 + np.float32(0.1) * _logf(inverse)))
    return rope_cos_sin(
        np.asarray(positions, dtype=np.int64),
        rope_dim,
        np.float32(theta_base),
        np.float32(s.freq_scale),
        np.ascontiguousarray(freq_factors, dtype=np.float32),
        np.float32(s.ext_factor),
        mscale,
        low,
        high,
    )


@njit(cache=True)
def rope_cos_sin(
    positions, rope_dim, theta_base, freq_scale, freq_factors, ext_factor, mscale, low, high
):
    """The tables of `rope_tables`, in float32 step by step as ggml's rope_yarn (ops.cpp).

    theta is built by repeated multiplication in float32, as ggml_rope does, rather than with
    pow per pair: the last bits of the angle then match llama.cpp's. Without YaRN (ext_factor 0)
    the angle is freq_scale * position * theta_scale**i / freq_factors[i]; with it, pairs below
    the correction dim `low` keep the unscaled angle and those above `high` the scaled one.
    """
    n_pairs = rope_dim // 2
    one = np.float32(1.0)
    theta_scale = np.float32(theta_base ** (-2.0 / rope_dim))
    cos = np.empty((positions.shape[0], n_pairs), dtype=np.float32)
    sin = np.empty((positions.shape[0], n_pairs), dtype=np.float32)
    for t in range(positions.shape[0]):
        theta = np.float32(positions[t])
        for i in range(n_pairs):
            extrap = np.float32(theta / freq_factors[i])
            angle = np.float32(freq_scale * extrap)
            if ext_factor != 0.0:
                y = np.float32((np.float32(i) - low) / max(np.float32(0.001), high - low))
                ramp = np.float32(one - min(one, max(np.float32(0.0), y)))
                mix = np.float32(ramp * ext_factor)
                angle = np.float32(angle * np.float32(one - mix) + np.float32(extrap * mix))
            cos[t, i] = np.float32(math.cos(angle)) * mscale
            sin[t, i] = np.float32(math.sin(angle)) * mscale
            theta = np.float32(theta * theta_scale)
    return cos, sin


@njit(cache=True)
def rope(x, cos, sin, neox):
    """Rotate every head of x in place. x: float32[n_tokens, n_heads, head_dim].

    neox=False rotates adjacent pairs (2i, 2i+1) (llama; the GGUF converter permutes Q/K for it);
    neox=True rotates (i, i + rope_dim/2) (qwen2, gemma3). Dims past rope_dim are left alone.
    """
    n_tokens, n_heads, _ = x.shape
    n_pairs = cos.shape[1]
    for t in range(n_tokens):
        for h in range(n_heads):
            for i in range(n_pairs):
                if neox:
                    a, b = i, i + n_pairs
                else:
                    a, b = 2 * i, 2 * i + 1
                x0 = x[t, h, a]
                x1 = x[t, h, b]
                x[t, h, a] = x0 * cos[t, i] - x1 * sin[t, i]
                x[t, h, b] = x0 * sin[t, i] + x1 * cos[t, i]


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c rounded once (llvm.fma, which LLVM vectorizes), for float32 arguments."""
    if all(isinstance(v, types.Float) and v.bitwidth == 32 for v in (a, b, c)):

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()] * 3)
            fma = builder.module.declare_intrinsic("llvm.fma", [ir.FloatType()], fnty)
            return builder.call(fma, args)

        return types.float32(a, b, c), codegen
    return None


@njit(cache=True, inline="always")
def _pow2(k):
    """2.0 ** k as float32 for an integer -126 <= k <= 127 (the exponent bits)."""
    return _bits_to_f32(np.uint32((k + 127) << 23))


@njit(cache=True, inline="always")
def expf(x):
    """exp(x) in float32 as ggml's SIMD code computes it (ggml_v_expf, from Arm's optimized
    routines: max error 1.45 + 0.5 ulp), written without branches or calls so that loops over
    it vectorize. x is first clamped to [-110, 100], which gives ggml's 0 below about -103.97
    and inf above 88.38 (its special case for |x| beyond the polynomial's range)."""
    x = min(max(np.float32(x), np.float32(-110.0)), np.float32(100.0))
    z = _fma(x, np.float32(1.4426950216293335), np.float32(12582912.0))  # 0x1.8p23 rounds
    n = z - np.float32(12582912.0)  # round(x / ln 2), within [-159, 145]
    b = _fma(-n, np.float32(1.428606765330187e-06), _fma(-n, np.float32(0.693145751953125), x))
    u = b * b
    j = _fma(
        _fma(
            _fma(np.float32(0.008247390389442444), b, np.float32(0.04189976677298546)),
            u,
            _fma(np.float32(0.16668395698070526), b, np.float32(0.4999912679195404)),
        ),
        u,
        _fma(np.float32(0.9999994039535522), b, np.float32(1.0)),
    )
    # j * 2**n, as _mm512_scalef_ps: two factors keep every 2**k a normal float
    k = np.int32(n)
    half = k >> 1
    return j * _pow2(half) * _pow2(k - half)


# HARDWARE_HALF (quants/cpu.py): half <-> float in one instruction where the compile target and
# the CPU both have one (x86 F16C, ARMv8); elsewhere LLVM would call a runtime helper Numba
# cannot link (__extendhfsf2), so the bit-exact integer version.


@intrinsic
def _half_bits_to_f32(typingctx, bits):
    """IEEE half bits (a 16-bit integer) as float32, by LLVM's fpext (vcvtph2ps)."""
    if isinstance(bits, types.Integer) and bits.bitwidth == 16:

        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

        return types.float32(bits), codegen
    return None


@intrinsic
def _f32_to_half_bits(typingctx, v):
    """float32 -> the bits of the nearest IEEE half (ties to even, inf past 65504), by LLVM's
    fptrunc (vcvtps2ph): numpy's astype(float16), NaN payloads aside."""
    if v == types.float32:

        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

        return types.uint16(v), codegen
    return None


@njit(cache=True)
def write_half_rows(k_pool, v_pool, page, row, k, v):
    """k_pool[page, h, row + i], v_pool[page, h, row + i] = k[i, h], v[i, h] as IEEE half bits,
    for the rows of k, v: float32[n, n_kv_heads, head_dim] (a K/V cache write, in one call:
    numpy's conversions and slice assignments cost 9 us a token and layer). Needs
    HARDWARE_HALF."""
    for h in range(k.shape[1]):
        for i in range(k.shape[0]):
            for d in range(k.shape[2]):
                k_pool[page, h, row + i, d] = _f32_to_half_bits(k[i, h, d])
                v_pool[page, h, row + i, d] = _f32_to_half_bits(v[i, h, d])


# ---- attention
#
# A token's keys are cut into chunks at multiples of KV_CHUNK positions. One pass over a chunk's K
# rows (each converted from half once for all the query heads of its K/V head) gives their
# scores, exp(score - the chunk's max) and their sum; the row's max and softmax sum come from its
# chunks' (each sum rescaled to the row's max); one pass over the chunk's V rows adds each
# probability times V; the chunks' outputs are added in order. The probabilities are those of
# llama.cpp's K*Q -> softmax -> V*KQ graph (exp(score - max) / sum, rounded to half with an f16
# cache), which the tests compare against. An online softmax (the output rescaled as the max
# grows) leaves them unrounded, up to 2^-12 off each: that moved a logit of the qwen2moe fixture by
# 1.1 (a near-tie of its router went the other way). Within one chunk the sums run in the order of
# the Numba kernel this replaced, bit for bit (`_block_scores`).
#
# For a few rows (decode) every chunk is a job of its own (flash decoding), so that all threads
# work even with 2 K/V heads; for many rows (prefill) one job runs a row's chunks in turn. A row's
# chunks depend only on its position and the window, and its sums are written out in IR in one
# order: batched or alone, split or not, on any number of threads, a row gets the same bits.

KV_CHUNK = 256  # keys per chunk (a multiple of KV_BLOCK)
KV_BLOCK = 32  # keys converted to float32 at a time (a multiple of 8), the block in L1
LANES = 16  # floats per vector of the IR kernels (one AVX-512 register, two AVX2 ones)

# Numba's loop vectorizer stops at 256 bits on AVX-512 CPUs and picks each loop's summation order
# for itself; the IR below holds 16 floats per vector and sums in one order whatever surrounds it.
_F32 = ir.FloatType()
_VF32 = ir.VectorType(_F32, LANES)
_I32, _I64 = ir.IntType(32), ir.IntType(64)


def _is_matrix(t) -> bool:
    """A C-contiguous float32[rows, cols] (the IR kernels' operands)."""
    return isinstance(t, types.Array) and (t.dtype, t.ndim, t.layout) == (types.float32, 2, "C")


class _Matrix:
    """A C-contiguous float32[rows, cols] in IR: its elements and 16-float vectors by (row, col)."""

    def __init__(self, context, builder, array_type, value):
        self.b = builder
        array = context.make_array(array_type)(context, builder, value)
        self.data = array.data
        self.rows, self.cols = cgutils.unpack_tuple(builder, array.shape, 2)

    def pointer(self, row, col):
        return self.b.gep(self.data, [self.b.add(self.b.mul(row, self.cols), col)])

    def load(self, row, col):
        return self.b.load(self.pointer(row, col))

    def load_vector(self, row, col):
        return self.b.load(self.b.bitcast(self.pointer(row, col), _VF32.as_pointer()), align=4)

    def store_vector(self, value, row, col):
        self.b.store(
            value, self.b.bitcast(self.pointer(row, col), value.type.as_pointer()), align=4
        )


def _int(value: int):
    return ir.Constant(_I64, value)


def _fmadd(builder, a, b, c):
    """a * b + c rounded once (vfmadd), for floats or vectors of them."""
    name = f"llvm.fma.v{a.type.count}f32" if isinstance(a.type, ir.VectorType) else "llvm.fma.f32"
    fma = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(a.type, [a.type] * 3), name
    )
    return builder.call(fma, [a, b, c])


def _halves_added(builder, vectors, sums, lanes):
    """Vectors of `sums` sums of `lanes` lanes each, halved until one lane per sum: pairs of
    vectors become one holding each sum's two halves added (lane l + lane l + lanes / 2), then
    the last vector's. Returns a <sums * len(vectors) x float>. A sum's lanes are added in the
    same order whatever the other sums hold."""

    def halves(a, c, parts):
        half = lanes // 2
        low = [part + i * lanes + k for part in parts for i in range(sums) for k in range(half)]
        mask = ir.VectorType(_I32, len(low))
        lo = builder.shuffle_vector(a, c, ir.Constant(mask, low))
        hi = builder.shuffle_vector(a, c, ir.Constant(mask, [k + half for k in low]))
        return builder.fadd(lo, hi)

    while len(vectors) > 1:
        vectors = [
            halves(a, c, (0, LANES)) for a, c in zip(vectors[::2], vectors[1::2], strict=True)
        ]
        sums, lanes = 2 * sums, lanes // 2
    v = vectors[0]
    while lanes > 1:
        v = halves(v, v, (0,))
        lanes //= 2
    return v


# The order of a q.k sum is that of the Numba loop these kernels replaced, which the tests'
# tolerances against llama.cpp were measured with (LLVM's vectorization of it): 4 accumulators of
# 8 lanes over each 32 dimensions, added a0 + a1 + a2 + a3, then lanes 4 + 4, 2 + 2, 1 + 1; the
# dimensions past the last 32 then 4 at a time (`_tail_products`), the last 0-3 one by one. Here
# the 4 accumulators are two 16-float vectors per key, [a0 | a1] and [a2 | a3].
_STEP = 2 * LANES


def _tail_products(b, mq, mx, ms, head, i0, at, start, dims):
    """s[head, at + k] += q[head, d] * x[i0 + k, d] for the 8 keys k, dimensions d = start..dims-1
    past the _STEP steps: 4 at a time in 4-lane chains ([s, 0, 0, 0] first, their lanes added
    (0 + 2) + (1 + 3) after), then the last one by one."""
    v4 = ir.VectorType(_F32, 4)
    n_fours = b.udiv(b.sub(dims, start), _int(4))
    with b.if_then(b.icmp_unsigned(">", n_fours, _int(0))):
        sums = []
        for k in range(8):
            sums.append(cgutils.alloca_once(b, v4))
            first = ms.load(head, b.add(at, _int(k)))
            b.store(
                b.insert_element(ir.Constant(v4, [0.0] * 4), first, ir.Constant(_I32, 0)), sums[-1]
            )
        with cgutils.for_range(b, n_fours) as four:
            d = b.add(start, b.mul(four.index, _int(4)))
            qv = b.load(b.bitcast(mq.pointer(head, d), v4.as_pointer()), align=4)
            for k, total in enumerate(sums):
                xv = b.load(b.bitcast(mx.pointer(b.add(i0, _int(k)), d), v4.as_pointer()), align=4)
                b.store(_fmadd(b, qv, xv, b.load(total)), total)
        for k, total in enumerate(sums):
            v = b.load(total)
            lanes = [b.extract_element(v, ir.Constant(_I32, i)) for i in range(4)]
            dot = b.fadd(b.fadd(lanes[0], lanes[2]), b.fadd(lanes[1], lanes[3]))
            b.store(dot, ms.pointer(head, b.add(at, _int(k))))
    rest = b.add(start, b.mul(n_fours, _int(4)))
    with cgutils.for_range_slice(b, rest, dims, _int(1)) as (d, _):
        qd = mq.load(head, d)
        for k in range(8):
            out = ms.pointer(head, b.add(at, _int(k)))
            b.store(_fmadd(b, qd, mx.load(b.add(i0, _int(k)), d), b.load(out)), out)


@intrinsic
def _block_scores(typingctx, qh, x, n, s, col, head_dim):
    """s[g, col + i] = qh[g, :head_dim] . x[i, :head_dim] for every query head g, i < n rounded
    up to 8.

    qh: float32[group, width], x: float32[rows, width], s: float32[group, cols]; x and s wide
    enough for n rounded up. Per head, 8 keys at a time share the loads of q; each key's
    products go into 2 vectors of multiply-add chains over the _STEP-dimension steps, reduced
    for the 8 keys together (`_halves_added`)."""
    if not (_is_matrix(qh) and _is_matrix(x) and _is_matrix(s)):
        return None

    def codegen(context, builder, signature, args):
        b = builder
        mq, mx, ms = (_Matrix(context, b, signature.args[i], args[i]) for i in (0, 1, 3))
        n_keys, first, dims = (
            context.cast(b, args[i], signature.args[i], types.intp) for i in (2, 4, 5)
        )
        n_steps = b.udiv(dims, _int(_STEP))
        sums = [[cgutils.alloca_once(b, _VF32) for _ in range(2)] for _ in range(8)]
        heads = cgutils.for_range(b, mq.rows)
        groups = cgutils.for_range(b, b.udiv(b.add(n_keys, _int(7)), _int(8)))
        low = ir.Constant(ir.VectorType(_I32, LANES), [*range(8), *range(16, 24)])
        high = ir.Constant(ir.VectorType(_I32, LANES), [*range(8, 16), *range(24, 32)])
        with heads as head, groups as group:
            i0 = b.mul(group.index, _int(8))
            for key in sums:
                for total in key:
                    b.store(ir.Constant(_VF32, None), total)
            with cgutils.for_range(b, n_steps) as step:
                for half in range(2):
                    at = b.add(b.mul(step.index, _int(_STEP)), _int(half * LANES))
                    qv = mq.load_vector(head.index, at)
                    for k, key in enumerate(sums):
                        xv = mx.load_vector(b.add(i0, _int(k)), at)
                        b.store(_fmadd(b, qv, xv, b.load(key[half])), key[half])
            pairs = []  # two keys' ((a0 + a1) + a2) + a3 each, 8 lanes
            for k in range(0, 8, 2):
                (z0, z1), (y0, y1) = ([b.load(v) for v in sums[j]] for j in (k, k + 1))
                total = b.fadd(b.shuffle_vector(z0, y0, low), b.shuffle_vector(z0, y0, high))
                total = b.fadd(total, b.shuffle_vector(z1, y1, low))
                pairs.append(b.fadd(total, b.shuffle_vector(z1, y1, high)))
            at = b.add(first, i0)
            ms.store_vector(_halves_added(b, pairs, 2, 8), head.index, at)
            _tail_products(b, mq, mx, ms, head.index, i0, at, b.mul(n_steps, _int(_STEP)), dims)
        return context.get_dummy_value()

    return types.void(qh, x, n, s, col, head_dim), codegen


def _is_page(t) -> bool:
    """One layer's KV page, [n_kv_heads, page_tokens, head_dim], of half bits or float32."""
    return isinstance(t, types.Array) and t.ndim == 3 and t.dtype in (types.uint16, types.float32)


class _Page:
    """A K/V head's rows of a page in IR, from position j0 on: rows by strides (the last
    dimension contiguous), LANES-element vectors of a row as float32 (half bits converted by
    vcvtph2ps)."""

    def __init__(self, context, builder, array_type, value, head, j0):
        self.b = builder
        array = context.make_array(array_type)(context, builder, value)
        head_stride, self.row_stride = (builder.extract_value(array.strides, i) for i in (0, 1))
        self.width = builder.extract_value(array.shape, 2)  # head_dim
        self.half = array_type.dtype == types.uint16
        self.element = ir.IntType(16) if self.half else _F32
        self.base = builder.gep(
            builder.bitcast(array.data, ir.IntType(8).as_pointer()),
            [builder.add(builder.mul(head, head_stride), builder.mul(j0, self.row_stride))],
        )

    def row(self, i):
        """A pointer to row j0 + i."""
        at = self.b.gep(self.base, [self.b.mul(i, self.row_stride)])
        return self.b.bitcast(at, self.element.as_pointer())

    def vector(self, row, at):
        """Elements at..at + LANES - 1 of a row as <LANES x float>."""
        b = self.b
        source = ir.VectorType(self.element, LANES).as_pointer()
        value = b.load(b.bitcast(b.gep(row, [at]), source), align=2)
        if self.half:
            value = b.fpext(b.bitcast(value, ir.VectorType(ir.HalfType(), LANES)), _VF32)
        return value


def _page_kernel_args(context, builder, signature, args):
    """(the two matrices, col, n, the page's rows of head kv from j0) of an intrinsic's
    arguments (matrix, matrix, col, page, j0, n, kv)."""
    m0, m1 = (_Matrix(context, builder, signature.args[i], args[i]) for i in (0, 1))
    first, j0, n_keys, head = (
        context.cast(builder, args[i], signature.args[i], types.intp) for i in (2, 4, 5, 6)
    )
    return m0, m1, first, n_keys, _Page(context, builder, signature.args[3], args[3], head, j0)


def _by_group(builder, n_heads, groups, emit):
    """emit(group) under a switch on n_heads (an i64) for each group size in `groups` (a
    kernel unrolled over the group's heads); other sizes do nothing."""
    b = builder
    switch = b.switch(n_heads, b.function.append_basic_block("group.other"))
    done = b.function.append_basic_block("group.done")
    for group in groups:
        case = b.function.append_basic_block(f"group.{group}")
        switch.add_case(ir.Constant(_I64, group), case)
        b.position_at_end(case)
        emit(group)
        b.branch(done)
    b.position_at_end(switch.default)
    b.branch(done)
    b.position_at_end(done)


# Query heads per K/V head that `_page_scores` takes, and the keys it runs together for each
# (2 accumulators a key and head: at most 24 of the 32 zmm registers).
_PAGE_SCORE_KEYS = {1: 8, 2: 4, 3: 4, 4: 2, 5: 2, 6: 2}
_MOST_SCORE_GROUP = max(_PAGE_SCORE_KEYS)


@intrinsic
def _page_scores(typingctx, qh, s, col, page, j0, n, kv):
    """s[g, col + i] = qh[g] . K row kv of position j0 + i of the page, for every query head g of
    the group (1-6) and i < n rounded up to the keys it runs together (the last row read again
    for those past n): _block_scores' sums, in its order (2 vectors of multiply-add chains a key
    over the _STEP-dimension steps, reduced a0 + a1 + a2 + a3, then lanes 4 + 4, 2 + 2, 1 + 1),
    with K read from the page itself, each vector converted once for all the group's heads.
    page: [n_kv_heads, page_tokens, head_dim], its last dimension contiguous; head_dim a
    multiple of _STEP."""
    if not (_is_matrix(qh) and _is_matrix(s) and _is_page(page)):
        return None

    def codegen(context, builder, signature, args):
        b = builder
        mq, ms, first, n_keys, rows = _page_kernel_args(context, b, signature, args)
        n_steps = b.udiv(mq.cols, _int(_STEP))
        last = b.sub(n_keys, _int(1))
        low = ir.Constant(ir.VectorType(_I32, LANES), [*range(8), *range(16, 24)])
        high = ir.Constant(ir.VectorType(_I32, LANES), [*range(8, 16), *range(24, 32)])

        def emit(group):
            keys = _PAGE_SCORE_KEYS[group]
            sums = [[[cgutils.alloca_once(b, _VF32) for _ in range(2)] for _ in range(keys)]
                    for _ in range(group)]  # fmt: skip
            n_groups = b.udiv(b.add(n_keys, _int(keys - 1)), _int(keys))
            with cgutils.for_range(b, n_groups) as block:
                i0 = b.mul(block.index, _int(keys))
                row = []
                for k in range(keys):
                    i = b.add(i0, _int(k))
                    row.append(rows.row(b.select(b.icmp_unsigned("<", i, n_keys), i, last)))
                for per_head in sums:
                    for key in per_head:
                        for total in key:
                            b.store(ir.Constant(_VF32, None), total)
                with cgutils.for_range(b, n_steps) as step:
                    for h in range(2):
                        at = b.add(b.mul(step.index, _int(_STEP)), _int(h * LANES))
                        qv = [mq.load_vector(_int(g), at) for g in range(group)]
                        for k in range(keys):
                            xv = rows.vector(row[k], at)
                            for g in range(group):
                                total = sums[g][k][h]
                                b.store(_fmadd(b, qv[g], xv, b.load(total)), total)
                at = b.add(first, i0)
                for g, per_head in enumerate(sums):
                    pairs = []  # two keys' ((a0 + a1) + a2) + a3 each, 8 lanes
                    for k in range(0, keys, 2):
                        (z0, z1), (y0, y1) = ([b.load(v) for v in per_head[j]] for j in (k, k + 1))
                        total = b.fadd(
                            b.shuffle_vector(z0, y0, low), b.shuffle_vector(z0, y0, high)
                        )
                        total = b.fadd(total, b.shuffle_vector(z1, y1, low))
                        pairs.append(b.fadd(total, b.shuffle_vector(z1, y1, high)))
                    ms.store_vector(_halves_added(b, pairs, 2, 8), _int(g), at)

        _by_group(b, mq.rows, _PAGE_SCORE_KEYS, emit)
        return context.get_dummy_value()

    return types.void(qh, s, col, page, j0, n, kv), codegen


@intrinsic
def _block_values(typingctx, acc, p, col, x, n):
    """acc[g] += p[g, col + i] * x[i] for every query head g, keys i = 0..n-1 in order.

    acc: float32[group, width], p: float32[group, cols], x: float32[rows, width]; width a
    multiple of LANES. Runs of 8, 4, then 1 vectors of a head's acc stay in registers over the
    keys: one multiply-add per lane and key, in key order, whichever run a lane is in."""
    if not (_is_matrix(acc) and _is_matrix(p) and _is_matrix(x)):
        return None

    def codegen(context, builder, signature, args):
        b = builder
        ma, mp, mx = (_Matrix(context, b, signature.args[i], args[i]) for i in (0, 1, 3))
        first, n_keys = (context.cast(b, args[i], signature.args[i], types.intp) for i in (2, 4))
        n_vectors = b.udiv(ma.cols, _int(LANES))
        done = cgutils.alloca_once(b, _I64)  # vectors of this head's acc done
        broadcast = ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES)
        with cgutils.for_range(b, ma.rows) as head:
            b.store(_int(0), done)
            for run in (8, 4, 1):
                sums = [cgutils.alloca_once(b, _VF32) for _ in range(run)]
                n_runs = b.udiv(b.sub(n_vectors, b.load(done)), _int(run))
                with cgutils.for_range(b, n_runs):
                    start = b.load(done)
                    cols = [b.mul(b.add(start, _int(k)), _int(LANES)) for k in range(run)]
                    for total, at in zip(sums, cols, strict=True):
                        b.store(ma.load_vector(head.index, at), total)
                    with cgutils.for_range(b, n_keys) as key:
                        pk = mp.load(head.index, b.add(first, key.index))
                        pv = b.insert_element(ir.Constant(_VF32, None), pk, ir.Constant(_I32, 0))
                        pv = b.shuffle_vector(pv, pv, broadcast)
                        for total, at in zip(sums, cols, strict=True):
                            xv = mx.load_vector(key.index, at)
                            b.store(_fmadd(b, pv, xv, b.load(total)), total)
                    for total, at in zip(sums, cols, strict=True):
                        ma.store_vector(b.load(total), head.index, at)
                    b.store(b.add(start, _int(run)), done)
        return context.get_dummy_value()

    return types.void(acc, p, col, x, n), codegen


# Query heads per K/V head that `_page_values` takes (accumulators in registers, its heads
# unrolled), and the vectors of a head's output it keeps for each group size: at most 24
# accumulators of the 32 zmm registers.
_PAGE_VALUE_RUNS = {1: 8, 2: 8, 3: 8, 4: 4, 5: 4, 6: 4, 7: 2, 8: 2}
_MOST_PAGE_GROUP = max(_PAGE_VALUE_RUNS)


@intrinsic
def _page_values(typingctx, acc, p, col, page, j0, n, kv):
    """acc[g] += p[g, col + i] * V row kv of position j0 + i of the page, for every query head g
    of the group (1-8) and keys i = 0..n-1 in order: _block_values' arithmetic (one multiply-add
    per lane and key, in key order), with V read from the page itself. Each run of a few vectors
    of V (IEEE half bits converted by vcvtph2ps, or float32) is loaded once per key for all the
    group's heads, whose accumulators stay in registers: where _block_values converts the rows
    to a float32 block and reloads it for every head. page: [n_kv_heads, page_tokens,
    head_dim], its last dimension contiguous, head_dim a multiple of LANES."""
    if not (_is_matrix(acc) and _is_matrix(p) and _is_page(page)):
        return None

    def codegen(context, builder, signature, args):
        b = builder
        ma, mp, first, n_keys, rows = _page_kernel_args(context, b, signature, args)
        n_vectors = b.udiv(ma.cols, _int(LANES))
        broadcast = ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES)

        def runs(group, run, n_parts, start):
            """n_parts runs of `run` vectors of every head's acc from vector `start` on."""
            sums = [[cgutils.alloca_once(b, _VF32) for _ in range(run)] for _ in range(group)]
            with cgutils.for_range(b, n_parts) as part:
                vector = b.add(start, b.mul(part.index, _int(run)))
                cols = [b.mul(b.add(vector, _int(k)), _int(LANES)) for k in range(run)]
                for g, totals in enumerate(sums):
                    for total, at in zip(totals, cols, strict=True):
                        b.store(ma.load_vector(_int(g), at), total)
                with cgutils.for_range(b, n_keys) as key:
                    row = rows.row(key.index)
                    probabilities = []  # each head's p of this key, broadcast
                    for g in range(group):
                        pk = mp.load(_int(g), b.add(first, key.index))
                        pv = b.insert_element(ir.Constant(_VF32, None), pk, ir.Constant(_I32, 0))
                        probabilities.append(b.shuffle_vector(pv, pv, broadcast))
                    for k, at in enumerate(cols):  # one vector of V live at a time
                        value = rows.vector(row, at)
                        for pv, totals in zip(probabilities, sums, strict=True):
                            b.store(_fmadd(b, pv, value, b.load(totals[k])), totals[k])
                for g, totals in enumerate(sums):
                    for total, at in zip(totals, cols, strict=True):
                        ma.store_vector(b.load(total), _int(g), at)

        def emit(group):
            run = _PAGE_VALUE_RUNS[group]
            n_runs = b.udiv(n_vectors, _int(run))
            runs(group, run, n_runs, _int(0))  # then the vectors after the last run, singly
            runs(group, 1, b.sub(n_vectors, b.mul(n_runs, _int(run))), b.mul(n_runs, _int(run)))

        _by_group(b, ma.rows, _PAGE_VALUE_RUNS, emit)
        return context.get_dummy_value()

    return types.void(acc, p, col, page, j0, n, kv), codegen


@intrinsic
def _rows_to_f32(typingctx, cache, j0, n, kv, x):
    """x[i, :head_dim] = cache[kv, j0 + i] for i < n, LANES elements per load: a page
    [n_kv_heads, page_tokens, head_dim] of IEEE half bits (converted, vcvtph2ps) or of float32,
    its last dimension contiguous (any strides else) and head_dim a multiple of LANES."""
    if not (_is_page(cache) and _is_matrix(x)):
        return None

    def codegen(context, builder, signature, args):
        b = builder
        first, count, head = (
            context.cast(b, args[i], signature.args[i], types.intp) for i in (1, 2, 3)
        )
        rows = _Page(context, b, signature.args[0], args[0], head, first)
        mx = _Matrix(context, b, signature.args[4], args[4])
        with cgutils.for_range(b, count) as row:
            start = rows.row(row.index)
            with cgutils.for_range(b, b.udiv(rows.width, _int(LANES))) as vector:
                at = b.mul(vector.index, _int(LANES))
                mx.store_vector(rows.vector(start, at), row.index, at)
        return context.get_dummy_value()

    return types.void(cache, j0, n, kv, x), codegen


def kv_value(x):
    """A KV cache element as float32: IEEE half bits (uint16) converted, float32 as it is."""


@overload(kv_value, inline="always")
def _kv_value(x):
    if isinstance(x, types.Integer) and x.bitwidth == 16:
        if HARDWARE_HALF:
            return lambda x: _half_bits_to_f32(x)
        return lambda x: f16_to_f32(x)
    if x == types.float32:
        return lambda x: x
    return None


def _converts_in_registers(dtype) -> bool:
    """Whether the IR kernels load K/V elements of this Numba dtype as vectors: float32, or IEEE
    half bits where the CPU converts them (HARDWARE_HALF)."""
    return dtype == types.float32 or HARDWARE_HALF


def vector_rows(kv, multiple):
    """Whether the IR kernels can read K/V rows of `kv` (pages, or a pool of them) as vectors:
    an element type they convert in registers, each row contiguous and its length a multiple of
    `multiple`."""


@overload(vector_rows, inline="always")
def _vector_rows(kv, multiple):
    if not _converts_in_registers(kv.dtype):
        return lambda kv, multiple: False
    last = kv.ndim - 1
    return lambda kv, multiple: (
        kv.shape[last] % multiple == 0 and kv.strides[last] == kv.itemsize
    )  # fmt: skip


def convert_rows(cache, j0, n, kv, x):
    """x[i, :head_dim] = K/V head kv of positions j0 + i of a page (cache: [n_kv_heads,
    page_tokens, head_dim]) as float32, for i < n."""


@njit(cache=True, inline="always")
def _convert_elements(cache, j0, n, kv, x):
    for i in range(n):
        for d in range(cache.shape[2]):
            x[i, d] = kv_value(cache[kv, j0 + i, d])


@overload(convert_rows, inline="always")
def _convert_rows(cache, j0, n, kv, x):
    if not _converts_in_registers(cache.dtype):  # _rows_to_f32 not compiled in
        return lambda cache, j0, n, kv, x: _convert_elements(cache, j0, n, kv, x)

    def rows(cache, j0, n, kv, x):
        if vector_rows(cache, LANES):
            _rows_to_f32(cache, j0, n, kv, x)
        else:
            _convert_elements(cache, j0, n, kv, x)

    return rows


@njit(cache=True, inline="always")
def _first_key(pos, window):
    """The first key the token at position pos sees (window: 0, or the sliding window)."""
    return pos - window + 1 if window > 0 and pos - window + 1 > 0 else 0


@njit(cache=True, inline="always")
def _n_chunks(pos, window):
    """How many chunks hold the keys the token at position pos sees."""
    return pos // KV_CHUNK - _first_key(pos, window) // KV_CHUNK + 1


@njit(cache=True, inline="always")
def _block_length(j0, hi, page_tokens):
    """How many keys from j0 (before hi) go into one block: KV_BLOCK, fewer at hi or at the
    end of j0's page (no block straddles two pages)."""
    return min(KV_BLOCK, hi - j0, page_tokens - j0 % page_tokens)


@njit(cache=True, inline="always")
def _page_rows(pool, table, j0, n, kv, x):
    """x[:n] = K/V head kv of positions j0..j0 + n - 1 (in one page) of the sequence whose page
    table is `table`, as float32. (Each head's rows of a page are one run of memory, which the
    CPU's own prefetchers stream: software prefetches ahead gained nothing.)"""
    p = pool.shape[2]
    convert_rows(pool[table[j0 // p]], j0 % p, n, kv, x)


def block_scores(qh, s, col, pool, table, j0, n, kv, x, head_dim):
    """s[g, col + i] = qh[g] . K row kv of position j0 + i (one page's, through the page table)
    for i < n: read in registers (_page_scores) where the rows and the group allow, else
    converted to the float32 block x (_block_scores). The same bits either way."""


@njit(cache=True, inline="always")
def _scores_by_block(qh, s, col, pool, table, j0, n, kv, x, head_dim):
    _page_rows(pool, table, j0, n, kv, x)
    _block_scores(qh, x, n, s, col, head_dim)


@overload(block_scores, inline="always")
def _block_scores_either(qh, s, col, pool, table, j0, n, kv, x, head_dim):
    def by_block(qh, s, col, pool, table, j0, n, kv, x, head_dim):
        _scores_by_block(qh, s, col, pool, table, j0, n, kv, x, head_dim)

    def either(qh, s, col, pool, table, j0, n, kv, x, head_dim):
        if qh.shape[0] <= _MOST_SCORE_GROUP and vector_rows(pool, _STEP):
            p = pool.shape[2]
            _page_scores(qh, s, col, pool[table[j0 // p]], j0 % p, n, kv)
        else:
            _scores_by_block(qh, s, col, pool, table, j0, n, kv, x, head_dim)

    # without the CPU's conversion, _page_scores is not compiled in
    return either if _converts_in_registers(pool.dtype) else by_block


def block_values(acc, p, col, pool, table, j0, n, kv, x):
    """acc[g] += p[g, col + i] * V row kv of position j0 + i (one page's) for i < n, in key
    order: read in registers (_page_values) where the rows and the group allow, else converted
    to the float32 block x (_block_values). The same bits either way."""


@njit(cache=True, inline="always")
def _values_by_block(acc, p, col, pool, table, j0, n, kv, x):
    _page_rows(pool, table, j0, n, kv, x)
    _block_values(acc, p, col, x, n)


@overload(block_values, inline="always")
def _block_values_either(acc, p, col, pool, table, j0, n, kv, x):
    def by_block(acc, p, col, pool, table, j0, n, kv, x):
        _values_by_block(acc, p, col, pool, table, j0, n, kv, x)

    def either(acc, p, col, pool, table, j0, n, kv, x):
        if acc.shape[0] <= _MOST_PAGE_GROUP and vector_rows(pool, LANES):
            page_tokens = pool.shape[2]
            _page_values(acc, p, col, pool[table[j0 // page_tokens]], j0 % page_tokens, n, kv)
        else:
            _values_by_block(acc, p, col, pool, table, j0, n, kv, x)

    # without the CPU's conversion, _page_values is not compiled in
    return either if _converts_in_registers(pool.dtype) else by_block


@njit(cache=True, inline="always")
def _chunk_scores(
    q, t, kv, k_pool, table, pos, chunk, window, scale, softcap, sinks, round_q, qh, x, s, stats,
):  # fmt: skip
    """One pass over the K rows of chunk `chunk` (positions chunk * KV_CHUNK.., within the keys
    ..pos of row t), for the group's query heads g of K/V head kv: stats[g] = (the max of the
    scaled (capped) scores, with the head's sink logit if any; the sum of exp(score - max)) and
    s[g, i] = exp(score - max) for the chunk's i-th key."""
    group, head_dim = s.shape[0], q.shape[2]
    h0 = kv * group
    lo = max(chunk * KV_CHUNK, _first_key(pos, window))
    hi = min((chunk + 1) * KV_CHUNK, pos + 1)
    for g in range(group):
        for d in range(head_dim):  # q in half where K is (llama.cpp's f16 K * Q product)
            qh[g, d] = round_f16(q[t, h0 + g, d]) if round_q else q[t, h0 + g, d]
    j0 = lo
    while j0 < hi:
        n = _block_length(j0, hi, k_pool.shape[2])
        block_scores(qh, s, j0 - lo, k_pool, table, j0, n, kv, x, head_dim)
        j0 += n
    inv_cap = np.float32(1.0 / softcap) if softcap > 0 else np.float32(0.0)
    for g in range(group):
        if softcap > 0:  # ggml_scale -> ggml_tanh -> ggml_scale
            for i in range(hi - lo):
                s[g, i] = softcap * np.float32(math.tanh(s[g, i] * scale * inv_cap))
        else:
            for i in range(hi - lo):
                s[g, i] *= scale
        best = sinks[h0 + g] if sinks.shape[0] else np.float32(-np.inf)
        for i in range(hi - lo):
            best = max(best, s[g, i])
        total = 0.0  # float64, as ggml's soft_max sums
        for i in range(hi - lo):
            e = expf(s[g, i] - best)
            s[g, i] = e
            total += e
        stats[g, 0] = best
        stats[g, 1] = total


@njit(cache=True, inline="always")
def _row_norm(stats, first, n, step, sinks, h0, norm):
    """norm[g] = (the row's max score, 1 / its softmax sum) from its n chunks' stats (slots
    first, first + step, ..), with the sink logits (if any) in the max and the sum."""
    for g in range(norm.shape[0]):
        best = np.float32(-np.inf)
        for c in range(n):
            best = max(best, np.float32(stats[first + c * step, g, 0]))
        if sinks.shape[0]:
            best = max(best, sinks[h0 + g])
        total = 0.0
        for c in range(n):  # a chunk's sum rescaled to the row's max (times 1 for one chunk)
            chunk = stats[first + c * step, g]
            total += chunk[1] * expf(np.float32(chunk[0]) - best)
        if sinks.shape[0]:
            total += expf(sinks[h0 + g] - best)
        norm[g, 0] = best
        norm[g, 1] = np.float32(1.0 / total)


@njit(cache=True, inline="always")
def _chunk_values(kv, v_pool, table, pos, chunk, window, stats, norm, f16_probs, s, x, acc):
    """One pass over the V rows of the chunk: acc[g] = the sum of p * v over its keys, p =
    exp(score - max) / sum from s = exp(score - the chunk's max), stats and norm (rounded to half
    if f16_probs, as llama.cpp's V*KQ product with its f16 V rounds them)."""
    group, width = acc.shape
    lo = max(chunk * KV_CHUNK, _first_key(pos, window))
    hi = min((chunk + 1) * KV_CHUNK, pos + 1)
    for g in range(group):
        # exp(chunk max - row max) / sum: 1 / sum exactly where the chunk holds the row's max
        factor = expf(np.float32(stats[g, 0]) - norm[g, 0]) * norm[g, 1]
        for i in range(hi - lo):
            p = s[g, i] * factor
            s[g, i] = round_f16(p) if f16_probs else p
        for d in range(width):
            acc[g, d] = 0.0
    j0 = lo
    while j0 < hi:
        n = _block_length(j0, hi, v_pool.shape[2])
        block_values(acc, s, j0 - lo, v_pool, table, j0, n, kv, x)
        j0 += n


@njit(cache=True, inline="always")
def _row_output(acc, first, n, step, t, kv, out):
    """out[t]'s heads of K/V head kv = the sum of the row's n chunk outputs (acc slots first,
    first + step, ..), added in order."""
    group, head_dim = acc.shape[1], out.shape[2]
    for g in range(group):
        for d in range(head_dim):
            out[t, kv * group + g, d] = acc[first, g, d]
    for c in range(1, n):
        for g in range(group):
            for d in range(head_dim):
                out[t, kv * group + g, d] += acc[first + c * step, g, d]


@njit(cache=True, inline="always")
def _attend_row(
    q, t, kv, k_pool, v_pool, table, pos, window, scale, softcap, sinks, round_q, f16_probs,
    scratch, out,
):  # fmt: skip
    """Row t's query heads of K/V head kv over its keys ..pos, chunk after chunk on this thread
    (its slots of the scratch)."""
    s, stats, norm, acc, qh, x = scratch
    thread = get_thread_id()
    base = thread * (s.shape[0] // x.shape[0])
    first, n = _first_key(pos, window) // KV_CHUNK, _n_chunks(pos, window)
    for c in range(n):
        _chunk_scores(
            q, t, kv, k_pool, table, pos, first + c, window, scale, softcap, sinks, round_q,
            qh[thread], x[thread], s[base + c], stats[base + c],
        )  # fmt: skip
    _row_norm(stats, base, n, 1, sinks, kv * s.shape[1], norm[base])
    for c in range(n):
        _chunk_values(
            kv, v_pool, table, pos, first + c, window, stats[base + c], norm[base], f16_probs,
            s[base + c], x[thread], acc[base + c],
        )  # fmt: skip
    _row_output(acc, base, n, 1, t, kv, out)


@njit(cache=True, inline="always")
def _row_key(t, seq, starts, first_rows, causal):
    """(sequence, last key) of row t of a batch of sequences (rows first_rows[s].. are sequence
    s's, from position starts[s]), searching from sequence `seq` on: rows come in order. The
    last key is the row's own position, or, not causal, its sequence's last."""
    while t >= first_rows[seq + 1]:
        seq += 1
    if not causal:
        return seq, starts[seq] + first_rows[seq + 1] - first_rows[seq] - 1
    return seq, starts[seq] + t - first_rows[seq]


@njit(cache=True)
def _chunk_job(job, starts, first_rows, window, n_kv_heads, causal):
    """(row t, its sequence, its last key, chunk, K/V head, the slot of the row's first chunk
    for that head) of a split job. Jobs (and slots) go row by row, chunk by chunk, head by
    head."""
    t, seq, first = 0, 0, 0
    while True:
        seq, pos = _row_key(t, seq, starts, first_rows, causal)
        n = _n_chunks(pos, window) * n_kv_heads
        if job < first + n:
            c, kv = (job - first) // n_kv_heads, (job - first) % n_kv_heads
            return t, seq, pos, c + _first_key(pos, window) // KV_CHUNK, kv, first + kv
        first += n
        t += 1


# reassoc: the softmax sums vectorize (a float sum is otherwise one serial chain); their order is
# not part of any contract, and the products' order is fixed in the IR kernels.
@njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def attention(
    q, k_pool, v_pool, tables, starts, first_rows, window, scale, softcap, sinks, round_q,
    f16_probs, split, scratch, out, causal,
):  # fmt: skip
    """Multi-head attention with grouped K/V heads for the rows of one or more sequences, each
    over its own keys in a paged f16 KV cache: causal, with an optional sliding window; or, not
    `causal`, every row over all its sequence's keys (the encoders' bidirectional attention,
    over their float32 K and V as one page).

    q: float32[n_rows, n_heads, head_dim]: rows first_rows[s]..first_rows[s + 1] - 1 are
    sequence s's tokens at positions starts[s]..
    k_pool, v_pool: uint16[n_pages, n_kv_heads, page_tokens, head_dim], IEEE half bits
    (llama.cpp's f16 KV cache: half the memory and bandwidth of float32), or float32
    (CPUBackend's exact mode), one layer of a KVPool; tables: int32[n_seqs, pages]: position j
    of sequence s is row j % page_tokens of page tables[s, j // page_tokens], filled up to its
    last row's position.
    window: 0 for global attention, else a key at position j is seen from position i only when
    i - j < window (llama.cpp's standard SWA mask).
    softcap: 0, or each scaled score s becomes softcap * tanh(s / softcap) before the softmax
    (Gemma 2's attention logit softcapping, as ggml_scale -> ggml_tanh -> ggml_scale computes it).
    sinks: float32[n_heads] or empty: each head's sink logit (gpt-oss), one more term of the
    softmax's max and sum that weights no value, as ggml_soft_max_ext with sinks computes it.
    round_q, f16_probs: q rounded to half before q.k, the probabilities before they weight V, as
    llama.cpp's K*Q and V*KQ products with its f16 KV cache round them.
    split: the threads running (get_num_threads()) to deal each chunk of each row to as a job
    of its own (decode), or 0: a job per row and K/V head (prefill); the same result (see
    KV_CHUNK). A row's arithmetic does not depend on the other rows, sequences or pages: a
    sequence gets the same bits batched as alone.
    scratch: `attention_scratch(...)`, allocated once by the caller.
    out: float32[n_rows, n_heads, head_dim]
    """
    n_rows = q.shape[0]
    n_kv_heads = k_pool.shape[1]
    if not split:
        for job in prange(n_rows * n_kv_heads):
            t, kv = job // n_kv_heads, job % n_kv_heads
            seq, pos = _row_key(t, 0, starts, first_rows, causal)
            _attend_row(
                q, t, kv, k_pool, v_pool, tables[seq], pos, window, scale, softcap, sinks,
                round_q, f16_probs, scratch, out,
            )  # fmt: skip
        return
    s, stats, norm, acc, qh, x = scratch
    n_jobs, seq = 0, 0
    for t in range(n_rows):
        seq, pos = _row_key(t, seq, starts, first_rows, causal)
        n_jobs += _n_chunks(pos, window) * n_kv_heads
    # the jobs dealt to the threads in turn: a row's last chunk (often a few keys) is among
    # its last jobs, which a split into halves gave one thread (2 K/V heads, 3 chunks, 2
    # threads: 3 chunks' keys on one thread against 1 on the other)
    n_workers = min(n_jobs, split)
    for worker in prange(n_workers):
        for job in range(worker, n_jobs, n_workers):
            t, seq, pos, c, kv, _ = _chunk_job(
                np.int64(job), starts, first_rows, window, n_kv_heads, causal
            )
            thread = get_thread_id()
            _chunk_scores(
                q, t, kv, k_pool, tables[seq], pos, c, window, scale, softcap, sinks, round_q,
                qh[thread], x[thread], s[job], stats[job],
            )  # fmt: skip
    slot, seq = 0, 0
    for t in range(n_rows):
        seq, pos = _row_key(t, seq, starts, first_rows, causal)
        n = _n_chunks(pos, window)
        for kv in range(n_kv_heads):
            _row_norm(stats, slot + kv, n, n_kv_heads, sinks, kv * s.shape[1], norm[slot + kv])
        slot += n * n_kv_heads
    for worker in prange(n_workers):
        for job in range(worker, n_jobs, n_workers):
            t, seq, pos, c, kv, first = _chunk_job(
                np.int64(job), starts, first_rows, window, n_kv_heads, causal
            )
            _chunk_values(
                kv, v_pool, tables[seq], pos, c, window, stats[job], norm[first], f16_probs,
                s[job], x[get_thread_id()], acc[job],
            )  # fmt: skip
    slot, seq = 0, 0
    for t in range(n_rows):
        seq, pos = _row_key(t, seq, starts, first_rows, causal)
        n = _n_chunks(pos, window)
        for kv in range(n_kv_heads):
            _row_output(acc, slot + kv, n, n_kv_heads, t, kv, out)
        slot += n * n_kv_heads


def split_jobs(n_rows: int, n_kv_heads: int, n_threads: int) -> bool:
    """Whether `attention` should make each chunk of a row a job of its own: where a job per row
    and K/V head would leave threads idle or unevenly loaded (decode). Not where those jobs are
    few but as many for each thread (a decode row's 2 K/V heads on 2 threads): one parallel
    region then, where the split takes two and a pass between them (20 of the 27 us of a
    Qwen2.5-1.5B layer's attention at 16 positions)."""
    jobs = n_rows * n_kv_heads
    return jobs < 2 * n_threads and jobs % n_threads != 0


def attention_slots(n_rows: int, n_kv_heads: int, n_ctx: int, window: int, n_threads: int) -> int:
    """The scratch slots (one chunk's scores, sums and output each) an `attention` call over
    n_rows rows needs, split or not: one per job split, every chunk of a row per thread not."""
    keys = min(n_ctx, window) if window > 0 else n_ctx
    chunks = (keys + KV_CHUNK - 2) // KV_CHUNK + 1  # the most chunks a row's keys touch
    return max(n_rows * n_kv_heads * chunks, n_threads * chunks)


def attention_scratch(n_threads: int, group: int, head_dim: int, n_slots: int) -> tuple:
    """`attention`'s scratch, for n_threads threads and group query heads per K/V head:
    per slot, s: float32[group, KV_CHUNK + 8] (a chunk's scores, then probabilities; 8 more, as
    _block_scores writes 8 keys at a time from any column), stats:
    float64[group, 2] (their max and sum), norm: float32[group, 2] (the row's max and 1 / sum),
    acc: float32[group, width] (the chunk's output); per thread, qh: float32[group, width] (the
    group's queries) and x: float32[KV_BLOCK, width] (K or V rows in float32). width: head_dim
    rounded up to LANES, the padding zero."""
    width = -(-head_dim // LANES) * LANES
    return (
        np.empty((n_slots, group, KV_CHUNK + 8), np.float32),
        np.empty((n_slots, group, 2), np.float64),
        np.empty((n_slots, group, 2), np.float32),
        np.empty((n_slots, group, width), np.float32),
        np.zeros((n_threads, group, width), np.float32),
        np.zeros((n_threads, KV_BLOCK, width), np.float32),
    )


@njit(cache=True)
def softmax_rows(x):
    """Softmax of every row in place, as ggml_soft_max computes it: expf of x - max, the sum in
    float64, then a multiplication by its float32 inverse. x: float32[n_rows, n] (MoE routers)."""
    n_rows, n = x.shape
    for i in range(n_rows):
        best = x[i, 0]
        for j in range(1, n):
            best = max(best, x[i, j])
        total = 0.0
        for j in range(n):
            e = expf(x[i, j] - best)
            x[i, j] = e
            total += e
        inv = np.float32(1.0 / total)
        for j in range(n):
            x[i, j] *= inv


# gpt-oss's SwiGLU: the gate clamped above, the linear part clamped both ways and shifted by 1
# (ggml_swiglu_oai with the alpha and limit llama.cpp's build_moe_ffn passes).
SWIGLU_OAI_ALPHA = np.float32(1.702)
SWIGLU_OAI_LIMIT = np.float32(7.0)


@njit(cache=True, error_model="numpy")
def swiglu_oai(gate, up):
    """gate = x * sigmoid(alpha * x) * (y + 1), in place, with x = min(gate, limit) and
    y = clamp(up, -limit, limit), as ggml computes it. gate, up: float32[n_tokens, ffn_dim]."""
    alpha, limit = SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
    for t in range(gate.shape[0]):
        g, u = gate[t], up[t]
        for i in range(g.shape[0]):
            x = min(g[i], limit)
            y = min(max(u[i], -limit), limit)
            g[i] = x / (np.float32(1.0) + expf(alpha * -x)) * (y + np.float32(1.0))


@njit(cache=True, error_model="numpy")  # numpy: no zero-division check, so the loop vectorizes
def _silu_mul_row(gate, up):
    for i in range(gate.shape[0]):
        g = gate[i]
        gate[i] = g / (np.float32(1.0) + expf(-g)) * up[i]


@njit(cache=True)
def silu_mul(gate, up):
    """gate = silu(gate) * up, in place. gate, up: float32[n_tokens, ffn_dim]. Vectorized (expf),
    ~3 ns per 16 values: a prefill's tokens are not worth spreading over threads."""
    for t in range(gate.shape[0]):
        _silu_mul_row(gate[t], up[t])


@njit(cache=True, inline="always")
def _gelu_tanh(g):
    """gelu_tanh of one float32, in float32."""
    inner = np.float32(0.7978845608028654) * g * (np.float32(1.0) + np.float32(0.044715) * g * g)
    return np.float32(0.5) * g * (np.float32(1.0) + np.float32(math.tanh(inner)))


@njit(cache=True)
def gelu_tanh_mul_exact(gate, up):
    """gate = gelu_tanh(gate) * up, in place, evaluated in float32 for every element."""
    n_tokens, n = gate.shape
    for t in range(n_tokens):
        for i in range(n):
            gate[t, i] = _gelu_tanh(gate[t, i]) * up[t, i]


def _gelu_table() -> np.ndarray:
    """gelu_tanh of every IEEE half, rounded to half, as float32[65536] (ggml's table)."""
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(all="ignore"):
        inner = (
            np.float32(0.7978845608028654) * x * (np.float32(1.0) + np.float32(0.044715) * x * x)
        )
        gelu = np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))
    return gelu.astype(np.float16).astype(np.float32)


GELU_TABLE = _gelu_table()  # float32[65536], indexed by the half bits of x


@njit(cache=True)
def _gelu_tanh_mul_row(gate, up, table):
    for i in range(gate.shape[0]):
        g = gate[i]
        if g <= np.float32(-10.0):
            value = np.float32(0.0)
        elif g >= np.float32(10.0):
            value = g
        else:
            value = table[f16_bits(g)]
        gate[i] = value * up[i]


@njit(cache=True)
def gelu_tanh_mul(gate, up, table):
    """gate = gelu_tanh(gate) * up, in place (Gemma's GeGLU). float32[n_tokens, ffn_dim].

    As ggml computes it on the CPU: x rounded to half and looked up in a table of gelu values
    (GELU_TABLE), 0 below -10 and x above 10. Same numbers as llama.cpp, and no tanh per element.
    """
    for t in range(gate.shape[0]):
        _gelu_tanh_mul_row(gate[t], up[t], table)


@njit(parallel=True, cache=True)
def gelu_tanh_mul_rows(gate, up, table):
    """gelu_tanh_mul with the tokens spread over threads (prefill)."""
    for t in prange(gate.shape[0]):
        _gelu_tanh_mul_row(gate[t], up[t], table)


@njit(parallel=True, cache=True)
def gelu_tanh_rows(x, table):
    """x = gelu_tanh(x) in place (the encoders' GELU MLP), from ggml's half-precision table as
    gelu_tanh_mul computes it. x: float32[n_tokens, ffn_dim]."""
    for t in prange(x.shape[0]):
        row = x[t]
        for i in range(row.shape[0]):
            g = row[i]
            if g <= np.float32(-10.0):
                row[i] = np.float32(0.0)
            elif g < np.float32(10.0):
                row[i] = table[f16_bits(g)]


@njit(cache=True)
def gelu_tanh_exact(x):
    """x = gelu_tanh(x) in place, evaluated in float32 for every element."""
    n_tokens, n = x.shape
    for t in range(n_tokens):
        for i in range(n):
            x[t, i] = _gelu_tanh(x[t, i])


@njit(parallel=True, cache=True)
def add_bias_rows(x, biases, ids):
    """x[r] += biases[ids[r]]: float32[n_rows, n] rows, float32[n_experts, n], int64[n_rows]."""
    for r in prange(x.shape[0]):
        x[r] += biases[ids[r]]


@njit(cache=True)
def add_inplace(x, y):
    """x += y for float32[n_tokens, dim] arrays."""
    n_tokens, dim = x.shape
    for t in range(n_tokens):
        for i in range(dim):
            x[t, i] += y[t, i]
