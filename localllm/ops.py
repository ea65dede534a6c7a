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
import platform
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import get_thread_id, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from localllm.quants.activations import f16_bits, round_f16
from localllm.quants.cpu import host_features
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


# Half to float in one instruction where the CPU has one (x86 F16C: every AVX2 CPU; ARMv8);
# elsewhere LLVM would call a runtime helper Numba cannot link, so the bit-exact integer version.
HARDWARE_HALF = "f16c" in host_features() or platform.machine().lower() in ("aarch64", "arm64")


@intrinsic
def _half_bits_to_f32(typingctx, bits):
    """IEEE half bits (a 16-bit integer) as float32, by LLVM's fpext (vcvtph2ps)."""
    if isinstance(bits, types.Integer) and bits.bitwidth == 16:

        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

        return types.float32(bits), codegen
    return None


@intrinsic
def prefetch(typingctx, array, index, offset):
    """Ask the CPU to start loading the cache line `offset` bytes into array[index] (index into
    the first dimension): a hint with no effect on the results."""
    if (
        isinstance(array, types.Array)
        and isinstance(index, types.Integer)
        and isinstance(offset, types.Integer)
    ):

        def codegen(context, builder, signature, args):
            arr = context.make_array(signature.args[0])(context, builder, args[0])
            stride = builder.extract_value(arr.strides, 0)
            i = context.cast(builder, args[1], signature.args[1], types.intp)
            byte = context.cast(builder, args[2], signature.args[2], types.intp)
            base = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
            at = builder.gep(base, [builder.add(builder.mul(i, stride), byte)])
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(ir.VoidType(), [at.type, i32, i32, i32]),
                "llvm.prefetch.p0",
            )
            builder.call(fn, [at, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return types.void(array, index, offset), codegen
    return None


# K/V rows this many positions ahead are prefetched while attention reads a long cache
KV_PREFETCH = 16


@njit(cache=True, inline="always")
def _prefetch_head_row(cache, position, row_start, row_end):
    """Prefetch bytes row_start..row_end (one K/V head) of cache[position], line by line."""
    for line in range(row_start, row_end, 64):
        prefetch(cache, position, line)


@njit(cache=True, inline="always")
def _head_row(cache, j, pos, kv, row_start, row_end, x):
    """x = K/V head kv of cache[j] as float32, with the row KV_PREFETCH positions on (up to
    pos) prefetched."""
    if j + KV_PREFETCH <= pos:
        _prefetch_head_row(cache, j + KV_PREFETCH, row_start, row_end)
    for d in range(cache.shape[2]):
        x[d] = kv_value(cache[j, kv, d])


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


# reassoc: lets LLVM vectorize the q.k dot products (a float sum is otherwise one serial chain,
# measured ~5x slower); their rounding order is not part of any contract.
@njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def attention(
    q, k_cache, v_cache, start_pos, window, scale, softcap, sinks, f16_probs, heads_per_job,
    scores, row, out, causal,
):  # fmt: skip
    """Causal multi-head attention over an f16 KV cache, with grouped K/V heads and an optional
    sliding window; or, not `causal`, every token over all start_pos + n_tokens keys (the
    encoders' bidirectional attention, over their float32 K and V).

    q: float32[n_tokens, n_heads, head_dim] for positions start_pos .. start_pos + n_tokens - 1
    k_cache, v_cache: uint16[n_ctx, n_kv_heads, head_dim], IEEE half bits (llama.cpp's f16 KV
    cache: half the memory and bandwidth of float32), or float32 (CPUBackend's exact mode),
    filled up to start_pos + n_tokens
    window: 0 for global attention, else a key at position j is seen from position i only when
    i - j < window (llama.cpp's standard SWA mask).
    softcap: 0, or each scaled score s becomes softcap * tanh(s / softcap) before the softmax
    (Gemma 2's attention logit softcapping, as ggml_scale -> ggml_tanh -> ggml_scale computes it).
    sinks: float32[n_heads] or empty: each head's sink logit (gpt-oss), one more term of the
    softmax's max and sum that weights no value, as ggml_soft_max_ext with sinks computes it.
    f16_probs: round the softmax probabilities to half before they weight V, as llama.cpp's
    K*Q -> softmax -> V*KQ graph does with its f16 KV cache (the V product takes f16 operands).
    heads_per_job: query heads of one K/V head that one job handles (a divisor of n_heads //
    n_kv_heads): each K and V row is converted from half once for all of them, not once per head.
    scores: float32[n_threads, heads_per_job, n_ctx] and row: float32[n_threads, head_dim],
    scratch per thread, allocated once by the caller (nothing is allocated here).
    out: float32[n_tokens, n_heads, head_dim]
    """
    n_tokens, n_heads, head_dim = q.shape
    n_keys = start_pos + n_tokens
    n_kv_heads = k_cache.shape[1]
    n_split = n_heads // n_kv_heads // heads_per_job
    for job in prange(n_tokens * n_kv_heads * n_split):
        t = job // (n_kv_heads * n_split)
        pos = start_pos + t if causal else n_keys - 1  # the last key this token sees
        _attend_job(
            q, t, job % (n_kv_heads * n_split), k_cache, v_cache, pos, window, scale, softcap,
            sinks, f16_probs, heads_per_job, scores, row, out,
        )  # fmt: skip


@njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def attention_sequences(
    q, k_caches, v_caches, starts, first_rows, window, scale, softcap, sinks, f16_probs,
    heads_per_job, scores, row, out,
):  # fmt: skip
    """`attention` for the rows of several sequences in one parallel region (a batched step):
    rows first_rows[s]..first_rows[s + 1] - 1 of q are sequence s's tokens at positions
    starts[s].., over its own cache k_caches[s], v_caches[s] (a tuple of one layer's caches,
    each filled up to its last row's position). Each row's arithmetic is `attention`'s, so a
    sequence gets the same result here as alone."""
    n_rows, n_heads, head_dim = q.shape
    n_kv_heads = k_caches[0].shape[1]
    n_split = n_heads // n_kv_heads // heads_per_job
    for job in prange(n_rows * n_kv_heads * n_split):
        t = job // (n_kv_heads * n_split)
        seq = 0
        while t >= first_rows[seq + 1]:
            seq += 1
        pos = starts[seq] + t - first_rows[seq]
        _attend_job(
            q, t, job % (n_kv_heads * n_split), k_caches[seq], v_caches[seq], pos, window,
            scale, softcap, sinks, f16_probs, heads_per_job, scores, row, out,
        )  # fmt: skip


@njit(cache=True, inline="always", fastmath={"reassoc", "contract"})
def _attend_job(
    q, t, part, k_cache, v_cache, pos, window, scale, softcap, sinks, f16_probs, heads_per_job,
    scores, row, out,
):  # fmt: skip
    """Row t of q, the query heads of K/V head part // n_split (the (part % n_split)-th
    heads_per_job of them), over keys ..pos of the cache (see `attention`)."""
    n_heads, head_dim = q.shape[1], q.shape[2]
    n_kv_heads = k_cache.shape[1]
    group = n_heads // n_kv_heads
    n_split = group // heads_per_job
    kv = part // n_split
    h0 = kv * group + part % n_split * heads_per_job
    inv_cap = np.float32(1.0 / softcap) if softcap > 0 else np.float32(0.0)
    first = 0
    if window > 0 and pos - window + 1 > 0:
        first = pos - window + 1
    thread = get_thread_id()
    s, x = scores[thread], row[thread]
    row_start = kv * head_dim * k_cache.itemsize  # bytes of this K/V head in a cache row
    row_end = row_start + head_dim * k_cache.itemsize
    for j in range(first, pos + 1):
        _head_row(k_cache, j, pos, kv, row_start, row_end, x)
        for g in range(heads_per_job):
            dot = np.float32(0.0)
            for d in range(head_dim):
                dot += q[t, h0 + g, d] * x[d]
            dot *= scale
            if softcap > 0:
                dot = softcap * np.float32(math.tanh(dot * inv_cap))
            s[g, j] = dot
    for g in range(heads_per_job):
        best = np.float32(-np.inf)
        for j in range(first, pos + 1):
            best = max(best, s[g, j])
        if sinks.shape[0]:
            best = max(best, sinks[h0 + g])
        total = 0.0  # float64, as ggml's soft_max sums
        for j in range(first, pos + 1):
            e = expf(s[g, j] - best)
            s[g, j] = e
            total += e
        if sinks.shape[0]:
            total += expf(sinks[h0 + g] - best)
        inv = np.float32(1.0 / total)
        for j in range(first, pos + 1):
            p = s[g, j] * inv
            s[g, j] = round_f16(p) if f16_probs else p
        for d in range(head_dim):
            out[t, h0 + g, d] = 0.0
    for j in range(first, pos + 1):
        _head_row(v_cache, j, pos, kv, row_start, row_end, x)
        for g in range(heads_per_job):
            p = s[g, j]
            for d in range(head_dim):
                out[t, h0 + g, d] += p * x[d]


def heads_per_job(n_tokens: int, n_heads: int, n_kv_heads: int, n_threads: int) -> int:
    """The most query heads per attention job (a divisor of the group) that still gives every
    thread a job: sharing a K/V row among more heads reads and converts it fewer times."""
    group = n_heads // n_kv_heads
    for split in range(1, group + 1):
        if group % split == 0 and n_tokens * n_kv_heads * split >= n_threads:
            return group // split
    return 1


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


@njit(cache=True)
def add_inplace(x, y):
    """x += y for float32[n_tokens, dim] arrays."""
    n_tokens, dim = x.shape
    for t in range(n_tokens):
        for i in range(dim):
            x[t, i] += y[t, i]
