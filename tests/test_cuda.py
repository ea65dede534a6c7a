"""The CUDA backend: every kernel against its CPU twin, a whole tiny model CUDA vs CPU, and the
device selection with its errors.

Normally the kernels run on numba's CUDA simulator, which needs NUMBA_ENABLE_CUDASIM=1 before
numba is first imported (tests/conftest.py sets it). On a GPU machine, NUMBA_ENABLE_CUDASIM=0
runs the same tests on the GPU (scripts/device-check does). The simulator runs one Python thread
per CUDA thread, so shapes here are small, and the kernels are launched with few threads per row.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf_writer import write_gguf
from random_blocks import random_weights

from localllm import cuda as localllm_cuda
from localllm import ops
from localllm.backend import CPUBackend, make_backend
from localllm.errors import LocalLLMError
from localllm.gguf import TensorInfo, read_gguf
from localllm.models import model_config
from localllm.models.transformer import Transformer
from localllm.quants import QUANT_TYPES, dequantize

# ---- which CUDA runs the kernels: the simulator, a GPU, or none ----

if localllm_cuda.numba_cuda_installed():
    from numba import config as numba_config

    SIMULATED = bool(numba_config.ENABLE_CUDASIM)
    ON_GPU = not SIMULATED and localllm_cuda.gpu_available()
else:
    SIMULATED = ON_GPU = False

if not (SIMULATED or ON_GPU) and os.environ.get("CI") == "true":
    raise RuntimeError(
        "CI must run the CUDA tests on the simulator: install numba-cuda and set "
        "NUMBA_ENABLE_CUDASIM=1 before numba is imported (tests/conftest.py)"
    )
needs_cuda = pytest.mark.skipif(
    not (SIMULATED or ON_GPU),
    reason="no GPU, and numba's CUDA simulator is off (NUMBA_ENABLE_CUDASIM=1 before numba loads)",
)
# Threads per weight row / per norm or attention row: a warp and a full block on a GPU; on the
# simulator, where each thread is a Python thread, fewer (the kernels take the block shape from
# the launch, so the arithmetic is the same).
LANES, THREADS = (32, 128) if ON_GPU else (8, 8)


@pytest.fixture(scope="module", autouse=True)
def fast_simulator_threads():
    """The simulator hands control between its Python threads at every syncthreads; a shorter
    switch interval than the default 5 ms makes that several times faster."""
    old = sys.getswitchinterval()
    if SIMULATED:
        sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


def backend(lanes: int = LANES, threads: int = THREADS):
    return localllm_cuda.CUDABackend(lanes=lanes, threads=threads)


def to_device(a: np.ndarray):
    from numba import cuda

    return cuda.to_device(np.ascontiguousarray(a, dtype=np.float32))


# ---- weights in every supported type ----

# the types whose registry record says the CUDA backend has them
TYPES = [qt.name for qt in QUANT_TYPES.values() if qt.cuda]


def random_raw(name: str, n_rows: int, n_cols: int, rng, scale: float = 0.05) -> np.ndarray:
    """Random valid raw rows uint8[n_rows, row_bytes]: random quant bytes, block scales uniform
    in [-scale, scale] (some zero, some subnormal), MXFP4 exponents near 1/64."""
    return random_weights(name, n_rows, n_cols, rng, (-scale, scale))


def tensor_info(name: str, ggml_type: int, raw: np.ndarray, n_cols: int) -> TensorInfo:
    raw = np.ascontiguousarray(raw)
    raw.flags.writeable = False  # like a view of the read-only map
    return TensorInfo(name, ggml_type, (raw.shape[0], n_cols), 0, raw.nbytes, raw)


def assert_dot_close(ours: np.ndarray, w: np.ndarray, x: np.ndarray, rtol: float = 1e-5) -> None:
    """ours ~ x @ w.T computed in float64, relative to sum |w| |x| (so cancellation is fair)."""
    w64, x64 = w.astype(np.float64), x.astype(np.float64)
    err = np.abs(ours.astype(np.float64) - x64 @ w64.T)
    scale = np.abs(x64) @ np.abs(w64).T
    assert (err <= rtol * scale + 1e-30).all(), f"max rel err {(err / (scale + 1e-30)).max():.2e}"


@needs_cuda
@pytest.mark.parametrize("name", TYPES)
def test_cuda_linear_and_embed_every_type(name):
    """matvec (1 token), matmul (two token tiles) and embed against gguf-exact dequantization."""
    rng = np.random.default_rng(sum(map(ord, name)))
    ggml_type = int(GGMLQuantizationType[name])
    block_size = GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]
    # float rows need not be whole 32-weight chunks; K-quant rows are whole 256-weight blocks
    n_rows, n_cols = 5, (40 if block_size == 1 else max(block_size, 64))
    raw = random_raw(name, n_rows, n_cols, rng)
    w_ref = dequantize(raw, ggml_type)  # float32[n_rows, n_cols], bit-exact with gguf-py
    b = backend()
    w = b.weight(tensor_info("w", ggml_type, raw, n_cols))
    assert (w.n_rows, w.n_cols) == (n_rows, n_cols)

    x = rng.standard_normal((9, n_cols)).astype(np.float32)
    out = b.zeros((9, n_rows))
    assert_dot_close(b.to_host(b.linear(to_device(x), w, out)), w_ref, x)
    one = b.zeros((1, n_rows))
    assert_dot_close(b.to_host(b.linear(to_device(x[3:4]), w, one)), w_ref, x[3:4])

    ids = np.array([4, 0, 4])
    rows = b.to_host(b.embed(w, ids, b.zeros((3, n_cols))))
    np.testing.assert_array_equal(rows.view(np.uint32), w_ref[ids].view(np.uint32))


@needs_cuda
def test_cuda_linear_one_lane_and_a_full_warp_agree():
    """The reduction over lanes: 1 lane per row (no reduction) vs 32 (five tree steps)."""
    rng = np.random.default_rng(1)
    n_cols = 64 * 32  # 64 chunks per row: every one of 32 lanes gets two
    raw = random_raw("Q8_0", 5, n_cols, rng)
    w_ref = dequantize(raw, 8)
    x = rng.standard_normal((2, n_cols)).astype(np.float32)
    for lanes in (1, 32):
        b = backend(lanes=lanes)
        w = b.weight(tensor_info("w", 8, raw, n_cols))
        assert_dot_close(b.to_host(b.linear(to_device(x), w, b.zeros((2, 5)))), w_ref, x)
        assert_dot_close(b.to_host(b.linear(to_device(x[:1]), w, b.zeros((1, 5)))), w_ref, x[:1])


@needs_cuda
def test_cuda_f16_scales_decode_exactly():
    """f16 block scales of every exponent (subnormals, zero, the largest) and sign, as Q8_0
    scales with q = 1: the kernels' integer decoding of halves equals numpy's."""
    mantissas = np.array([0, 1, 341, 1023], dtype=np.uint16)
    halves = (np.arange(31, dtype=np.uint16)[:, None] << 10 | mantissas).reshape(-1)
    halves = np.concatenate([halves, halves | 0x8000])  # float16[248] as bits, all finite
    raw = np.zeros((len(halves), 34), np.uint8)
    raw[:, :2] = halves.view(np.uint8).reshape(-1, 2)
    raw[:, 2:] = 1
    b = backend()
    w = b.weight(tensor_info("w", 8, raw, 32))
    rows = b.to_host(b.embed(w, np.arange(len(halves)), b.zeros((len(halves), 32))))
    np.testing.assert_array_equal(rows[:, 0], halves.view(np.float16).astype(np.float32))


@needs_cuda
def test_cuda_weight_rejects_unsupported_type(monkeypatch):
    """A type localllm does not know: the registry's error; one without CUDA kernels: the CUDA
    backend's, naming the tensor, the type and what it runs."""
    raw = np.zeros((2, 36), np.uint8)
    with pytest.raises(LocalLLMError, match="blk.0.attn_q.weight.*Q8_1"):
        backend().weight(tensor_info("blk.0.attn_q.weight", 9, raw, 64))  # Q8_1: activations only
    from localllm.cuda import kernels

    monkeypatch.setattr(kernels, "SUPPORTED_TYPES", (0, 8))
    raw = np.zeros((2, 66), np.uint8)
    with pytest.raises(LocalLLMError, match=r"blk.0.attn_q.weight .*IQ2_XXS.*runs F32, Q8_0\)"):
        backend().weight(tensor_info("blk.0.attn_q.weight", 16, raw, 256))


# ---- norms, RoPE, attention, element-wise ----


@needs_cuda
def test_cuda_rmsnorm_rows_heads_and_in_place():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 40)).astype(np.float32) * 3
    weight = rng.standard_normal(40).astype(np.float32)
    expected = np.empty_like(x)
    ops.rmsnorm(x, weight, np.float32(1e-5), expected)
    b = backend()
    dx = to_device(x)
    got = b.to_host(b.rmsnorm(dx, to_device(weight), 1e-5, b.zeros((3, 40))))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    b.rmsnorm(dx, to_device(weight), 1e-5, dx)  # out is x, as the post-norms call it
    np.testing.assert_allclose(b.to_host(dx), expected, rtol=1e-5, atol=1e-6)

    x3 = rng.standard_normal((2, 3, 16)).astype(np.float32)
    w16 = rng.standard_normal(16).astype(np.float32)
    d3 = to_device(x3)
    b.rmsnorm_heads(d3, to_device(w16), 1e-6)
    ops.rmsnorm_heads(x3, w16, np.float32(1e-6))
    np.testing.assert_allclose(b.to_host(d3), x3, rtol=1e-5, atol=1e-6)


@needs_cuda
def test_cuda_layernorm_rows_and_in_place():
    rng = np.random.default_rng(12)
    x = (rng.standard_normal((3, 40)) * 3 + 1).astype(np.float32)
    weight, bias = rng.standard_normal((2, 40)).astype(np.float32)
    expected = np.empty_like(x)
    ops.layernorm(x, weight, bias, np.float32(1e-12), expected)
    b = backend()
    dx, dw, db = to_device(x), to_device(weight), to_device(bias)
    got = b.to_host(b.layernorm(dx, dw, db, 1e-12, b.zeros((3, 40))))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    b.layernorm(dx, dw, db, 1e-12, dx)  # out is x, as the encoder calls it
    np.testing.assert_allclose(b.to_host(dx), expected, rtol=1e-5, atol=1e-5)


@needs_cuda
@pytest.mark.parametrize("neox", [False, True])
def test_cuda_rope_both_styles(neox):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 2, 16)).astype(np.float32)
    positions = np.array([5, 6, 7], dtype=np.int64)
    b = backend()
    # rope_dim < head_dim: a partial rotation; YaRN scaling and frequency factors
    scaling = ops.RopeScaling(freq_scale=0.5, ext_factor=1.0, attn_factor=0.9, n_ctx_orig=4)
    factors = np.linspace(1.0, 8.0, 6, dtype=np.float32)
    cos, sin = b.rope_tables(positions, 12, 10000.0, scaling, factors)
    cos_ref, sin_ref = ops.rope_tables(positions, 12, 10000.0, scaling, factors)
    np.testing.assert_array_equal(b.to_host(cos), cos_ref)
    np.testing.assert_array_equal(b.to_host(sin), sin_ref)
    dx = to_device(x)
    b.rope(dx, cos, sin, neox)
    ops.rope(x, cos_ref, sin_ref, neox)
    np.testing.assert_allclose(b.to_host(dx), x, rtol=1e-6, atol=1e-6)


@needs_cuda
@pytest.mark.parametrize(
    ("window", "start_pos", "n_tokens", "softcap"),
    [(0, 0, 5, 0.0), (3, 0, 5, 0.0), (4, 6, 2, 0.0), (4, 6, 2, 1.5)],
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_cuda_attention_gqa_causal_windows(window, start_pos, n_tokens, softcap, causal):
    """4 query heads over 2 KV heads; a prefill from 0, a windowed one, a chunk after a cache,
    the same with Gemma 2's softcap; each causal and bidirectional (encoders)."""
    rng = np.random.default_rng(4)
    n_ctx, n_heads, n_kv_heads, head_dim = 12, 4, 2, 8
    q = rng.standard_normal((n_tokens, n_heads, head_dim)).astype(np.float32)
    # The CPU's cache holds half bits, the device's float32: the same halves in both.
    k_half = rng.standard_normal((n_ctx, n_kv_heads, head_dim)).astype(np.float16)
    v_half = rng.standard_normal((n_ctx, n_kv_heads, head_dim)).astype(np.float16)
    k_cache, v_cache = k_half.astype(np.float32), v_half.astype(np.float32)
    expected = np.empty_like(q)
    cpu = CPUBackend(n_threads=1, llama_cpp_rounding=False)
    halves = (k_half.view(np.uint16), v_half.view(np.uint16))
    cpu.attention(q.copy(), *halves, start_pos, window, 0.35, softcap, expected, causal=causal)
    b = backend()
    out = b.zeros(q.shape)
    dq, dk, dv = to_device(q), to_device(k_cache), to_device(v_cache)
    b.attention(dq, dk, dv, start_pos, window, 0.35, softcap, out, causal=causal)
    np.testing.assert_allclose(b.to_host(out), expected, rtol=1e-5, atol=1e-6)
    sinks = rng.standard_normal(n_heads).astype(np.float32)  # gpt-oss's sink logits
    cpu.attention(q.copy(), *halves, start_pos, window, 0.35, softcap, expected, sinks, causal)
    b.attention(dq, dk, dv, start_pos, window, 0.35, softcap, out, to_device(sinks), causal)
    np.testing.assert_allclose(b.to_host(out), expected, rtol=1e-5, atol=1e-6)


@needs_cuda
def test_cuda_gather_and_scatter_rows():
    """A MoE expert's rows: gathered from the tokens, scattered back weighted; and in place."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((5, 12)).astype(np.float32)
    rows, factors = np.array([3, 0, 4]), np.array([0.5, -2.0, 3.0], dtype=np.float32)
    b, cpu = backend(), CPUBackend()
    gathered = b.gather_rows(to_device(x), rows, b.zeros((3, 12)))
    np.testing.assert_array_equal(b.to_host(gathered), x[rows])
    expected = np.zeros((6, 12), np.float32)
    cpu.scatter_rows(x[rows], rows + 1, factors, expected)
    out = b.zeros((6, 12))
    b.scatter_rows(to_device(x[rows]), rows + 1, factors, out)
    np.testing.assert_array_equal(b.to_host(out), expected)
    assert np.abs(expected[rows + 1] - x[rows] * factors[:, None]).max() == 0
    d = to_device(x[:3])
    b.scatter_rows(d, np.arange(3), factors, d)  # in place: each row scaled
    np.testing.assert_array_equal(b.to_host(d), x[:3] * factors[:, None])


@needs_cuda
def test_cuda_elementwise_ops():
    rng = np.random.default_rng(5)
    gate, up = rng.standard_normal((2, 3, 20)).astype(np.float32) * 3
    bias = rng.standard_normal(20).astype(np.float32)
    b = backend()
    silu = gate.copy()
    ops.silu_mul(silu, up)
    # The CPU's GeGLU looks gelu up in ggml's half-precision table; the GPU computes it exactly.
    inner = np.sqrt(2 / np.pi) * (gate + 0.044715 * gate.astype(np.float64) ** 3)
    gelu = (0.5 * gate * (1 + np.tanh(inner)) * up).astype(np.float32)
    for op, expected in [(b.silu_mul, silu), (b.gelu_mul, gelu)]:
        d = to_device(gate)
        op(d, to_device(up))
        np.testing.assert_allclose(b.to_host(d), expected, rtol=1e-5, atol=1e-5)
    d = to_device(gate)
    b.gelu(d)
    plain = (0.5 * gate * (1 + np.tanh(inner))).astype(np.float32)
    np.testing.assert_allclose(b.to_host(d), plain, rtol=1e-5, atol=1e-5)
    d = to_device(gate)
    b.add(d, to_device(up))
    np.testing.assert_array_equal(b.to_host(d), gate + up)
    b.add_bias(d, to_device(bias))
    np.testing.assert_array_equal(b.to_host(d), gate + up + bias)
    b.scale(d, 0.5)
    np.testing.assert_array_equal(b.to_host(d), (gate + up + bias) * np.float32(0.5))
    table, ids = rng.standard_normal((4, 20)).astype(np.float32), np.array([3, 0, 3])
    b.add_bias_rows(d, to_device(table), ids)  # each row its expert's bias
    np.testing.assert_array_equal(b.to_host(d), (gate + up + bias) * np.float32(0.5) + table[ids])


@needs_cuda
def test_cuda_zeros_and_write_kv():
    """A pool of 2 pages of 6 positions (2 K/V heads of 4): the rows land in the sequence's page
    (page 1), each head's rows together."""
    b = backend()
    k_pool, v_pool = b.kv_zeros((2, 2, 6, 4)), b.kv_zeros((2, 2, 6, 4))
    np.testing.assert_array_equal(b.to_host(k_pool), 0)
    k = np.arange(16, dtype=np.float32).reshape(2, 2, 4)
    b.write_kv(k_pool, v_pool, np.array([1], np.int32), 3, to_device(k), to_device(-k))
    expected = np.zeros((2, 2, 6, 4), np.float32)
    expected[1, :, 3:5] = k.transpose(1, 0, 2)
    np.testing.assert_array_equal(b.to_host(k_pool), expected)
    np.testing.assert_array_equal(b.to_host(v_pool), -expected)


@needs_cuda
def test_cuda_pool_copies_a_pages_first_rows():
    """KVPool.copy on device pages (a sequence writing into a cached page writes into a copy):
    the first rows of every head, the rest left zero."""
    from localllm.kv_cache import KVPool

    b = backend()
    pool = KVPool(1, 2, 4, 6, capacity=4, zeros=b.kv_zeros)
    page = pool.allocate()
    k = np.arange(48, dtype=np.float32).reshape(6, 2, 4)
    b.write_kv(pool.k[0], pool.v[0], np.array([page], np.int32), 0, to_device(k), to_device(-k))
    new = pool.copy(page, 4)
    expected = np.zeros((2, 6, 4), np.float32)
    expected[:, :4] = k[:4].transpose(1, 0, 2)
    np.testing.assert_array_equal(b.to_host(pool.k[0])[new], expected)
    np.testing.assert_array_equal(b.to_host(pool.v[0])[new], -expected)


# ---- a whole tiny model, CUDA vs CPU ----

DIM, N_HEADS, N_KV_HEADS, FFN, VOCAB = 32, 4, 2, 256, 64
# per layer and tensor: the types of the real test models, and K-quants where a row holds 256
LAYER_TYPES = [
    {"attn_q": "Q8_0", "attn_k": "Q5_0", "attn_v": "Q4_1", "attn_output": "Q4_0",
     "ffn_gate": "Q8_0", "ffn_up": "F16", "ffn_down": "Q4_K"},
    {"attn_q": "Q4_1", "attn_k": "Q8_0", "attn_v": "F32", "attn_output": "Q5_0",
     "ffn_gate": "Q5_0", "ffn_up": "Q4_1", "ffn_down": "Q6_K"},
]  # fmt: skip


def quantized(name: str, w: np.ndarray, rng):
    """(ggml_type, shape, raw bytes) for a float32 weight; K-quants (which gguf-py cannot
    quantize) get random blocks with scales small enough for weights of about w's size."""
    gtype = GGMLQuantizationType[name]
    if name in ("Q4_K", "Q6_K"):
        return int(gtype), w.shape, random_raw(name, *w.shape, rng, scale=0.002).tobytes()
    return int(gtype), w.shape, np.ascontiguousarray(gguf.quants.quantize(w, gtype)).tobytes()


def tiny_qwen2(path) -> dict:
    """A random two-layer qwen2 GGUF (llama's block plus Q/K/V biases and NeoX RoPE); returns
    its metadata."""
    rng = np.random.default_rng(6)
    head_dim = DIM // N_HEADS

    def normal(*shape, scale=0.1):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors = {
        "token_embd.weight": quantized("Q8_0", normal(VOCAB, DIM, scale=1.0), rng),
        "output_norm.weight": (0, (DIM,), 1 + normal(DIM)),
        "output.weight": quantized("Q8_0", normal(VOCAB, DIM), rng),
    }
    shapes = {
        "attn_q": (N_HEADS * head_dim, DIM),
        "attn_k": (N_KV_HEADS * head_dim, DIM),
        "attn_v": (N_KV_HEADS * head_dim, DIM),
        "attn_output": (DIM, N_HEADS * head_dim),
        "ffn_gate": (FFN, DIM),
        "ffn_up": (FFN, DIM),
        "ffn_down": (DIM, FFN),
    }
    for i, types in enumerate(LAYER_TYPES):
        for name, shape in shapes.items():
            tensors[f"blk.{i}.{name}.weight"] = quantized(types[name], normal(*shape), rng)
        for name in ("attn_q", "attn_k", "attn_v"):
            tensors[f"blk.{i}.{name}.bias"] = (0, (shapes[name][0],), normal(shapes[name][0]))
        tensors[f"blk.{i}.attn_norm.weight"] = (0, (DIM,), 1 + normal(DIM))
        tensors[f"blk.{i}.ffn_norm.weight"] = (0, (DIM,), 1 + normal(DIM))
    metadata = {
        "general.architecture": "qwen2",
        "qwen2.block_count": len(LAYER_TYPES),
        "qwen2.embedding_length": DIM,
        "qwen2.feed_forward_length": FFN,
        "qwen2.attention.head_count": N_HEADS,
        "qwen2.attention.head_count_kv": N_KV_HEADS,
        "qwen2.context_length": 64,
        "qwen2.attention.layer_norm_rms_epsilon": 1e-5,
    }
    write_gguf(path, metadata, tensors)
    return metadata


class ExactLinearCPU(CPUBackend):
    """The CPU backend with its products as dequantize-then-float-dot (what the CUDA kernels do)
    and, as on CUDA, float32 activations and KV cache (no f16 rounding of K, V and q), so that
    the comparison below does not depend on how the CPU rounds activations."""

    def __init__(self):
        super().__init__(llama_cpp_rounding=False)

    def linear_many(self, x, weights, outs):
        x64 = x.astype(np.float64)
        for w, out in zip(weights, outs, strict=True):
            out[:] = x64 @ dequantize(w.raw, w.qtype.ggml_type).astype(np.float64).T
        return tuple(outs)


@pytest.mark.slow
@needs_cuda
def test_cuda_forward_matches_cpu(tmp_path):
    """Prefill in two chunks (all logits), then a cached decode step: CUDA logits vs the CPU's."""
    path = tmp_path / "tiny.gguf"
    config = model_config(tiny_qwen2(path), VOCAB)
    logits = {}
    gpu = backend(lanes=1, threads=4) if SIMULATED else backend()
    for name, b in [("exact", ExactLinearCPU()), ("cpu", CPUBackend()), ("cuda", gpu)]:
        file = read_gguf(path)
        model = Transformer(file, config, b, n_ctx=8, n_batch=2)
        prefill = model.forward([5, 17, 63], 0, all_logits=True)
        logits[name] = np.vstack([prefill, model.forward([7], 3)])
        file.close()
    exact, cpu, cuda = logits["exact"], logits["cpu"], logits["cuda"]
    assert exact.shape == (4, VOCAB) and np.isfinite(exact).all()
    assert exact.std() > 0.3  # a model with something to say, not all-zero logits
    np.testing.assert_allclose(cuda, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())
    # the real CPU backend: as close as its own rounding of activations allows
    np.testing.assert_allclose(cuda, cpu, atol=0.05 * np.abs(exact).max())


ARCH_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "architectures"
# the families whose particulars have CUDA code paths of their own (softcap, fused views, MoE,
# attention sinks and MXFP4 experts...)
ARCH_CASES = ["gemma2", "gpt-oss", "granite", "olmo2", "phi3", "qwen2moe", "qwen3moe", "smollm3"]


@pytest.mark.slow
@needs_cuda
@pytest.mark.parametrize("name", ARCH_CASES)
def test_cuda_runs_each_architecture_as_the_cpu_does(name):
    """Each random architecture model (tests/fixtures/architectures): a two-chunk prefill and a
    decode step on CUDA, against the CPU backend without llama.cpp's roundings (float32
    activations, as the CUDA kernels keep them)."""
    path = ARCH_FIXTURES / f"{name}.gguf"
    logits = {}
    gpu = backend(lanes=1, threads=4) if SIMULATED else backend()
    for label, b in (("cpu", CPUBackend(llama_cpp_rounding=False)), ("cuda", gpu)):
        file = read_gguf(path)
        config = model_config(file.metadata, len(file.metadata["tokenizer.ggml.tokens"]))
        model = Transformer(file, config, b, n_ctx=8, n_batch=2)
        prefill = model.forward([5, 17, 63], 0, all_logits=True)
        logits[label] = np.vstack([prefill, model.forward([7], 3)])
        file.close()
    cpu, cuda = logits["cpu"], logits["cuda"]
    assert cpu.std() > 1.0
    np.testing.assert_allclose(cuda, cpu, rtol=1e-4, atol=1e-5 * np.abs(cpu).max())


@pytest.mark.slow
@needs_cuda
@pytest.mark.parametrize("name", ["bert", "nomic-bert"])
def test_cuda_runs_each_encoder_as_the_cpu_does(name):
    """The embedding encoders (LayerNorm, GELU, bidirectional attention, RoPE for nomic-bert):
    the hidden states of one input on CUDA against the CPU backend in float32."""
    from localllm.models.encoder import Encoder

    path = ARCH_FIXTURES / f"{name}.gguf"
    states = {}
    gpu = backend(lanes=1, threads=4) if SIMULATED else backend()
    for label, b in (("cpu", CPUBackend(llama_cpp_rounding=False)), ("cuda", gpu)):
        file = read_gguf(path)
        config = model_config(file.metadata, len(file.metadata["tokenizer.ggml.tokens"]))
        states[label] = Encoder(file, config, b, n_ctx=8).hidden_states([2, 17, 63, 40, 3])
        file.close()
    cpu, cuda = states["cpu"], states["cuda"]
    assert cpu.shape == (5, 64) and cpu.std() > 0.5
    np.testing.assert_allclose(cuda, cpu, rtol=1e-4, atol=1e-4)


def test_numpy_without_row_stack_gets_the_alias_numba_cuda_needs():
    """NumPy 2.5 has no row_stack; numba-cuda 0.30.4 looks it up at its first kernel compile."""
    from types import SimpleNamespace

    from localllm.cuda.kernels import numpy_compat

    numpy_2_5 = SimpleNamespace(vstack=np.vstack)
    numpy_compat(numpy_2_5)
    assert numpy_2_5.row_stack is np.vstack
    older = SimpleNamespace(vstack=np.vstack, row_stack=np.concatenate)
    numpy_compat(older)
    assert older.row_stack is np.concatenate  # left alone where it exists


# ---- device selection ----


def test_cuda_package_imports_without_numba_cuda():
    """`from localllm import cuda` must not import numba.cuda (auto asks it cheaply)."""
    import importlib
    import subprocess

    code = (
        "import sys; import localllm.cuda as c; c.gpu_available(); "
        "print('numba_cuda' in sys.modules or 'numba.cuda' in sys.modules)"
    )
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # without a driver nothing loads numba.cuda; with a GPU, gpu_available may (and must) use it
    assert done.stdout.strip() == ("True" if ON_GPU else "False")
    assert importlib.import_module("localllm.cuda") is localllm_cuda


def test_cuda_never_chosen_for_the_simulator(monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    assert not localllm_cuda.gpu_available()
    assert isinstance(make_backend("auto"), CPUBackend)
    with pytest.raises(LocalLLMError, match="simulator"):
        make_backend("cuda")


def test_cuda_without_driver_or_device(monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")
    if SIMULATED:  # numba itself was loaded with the simulator on; pretend it was not
        monkeypatch.setattr("numba.config.ENABLE_CUDASIM", 0)
    monkeypatch.setattr(localllm_cuda, "numba_cuda_installed", lambda: True)
    monkeypatch.setattr(localllm_cuda, "_load_driver", lambda: None)
    assert isinstance(make_backend("auto"), CPUBackend)
    with pytest.raises(LocalLLMError, match="no NVIDIA driver") as info:
        make_backend("cuda")
    assert "--device cpu" in str(info.value)

    class NoDevices:
        def cuInit(self, flags):
            return 0

        def cuDeviceGetCount(self, count):
            return 0  # leaves the count at 0

    monkeypatch.setattr(localllm_cuda, "_load_driver", NoDevices)
    assert isinstance(make_backend("auto"), CPUBackend)
    with pytest.raises(LocalLLMError, match="reports no GPU"):
        make_backend("cuda")

    class BrokenDriver(NoDevices):
        def cuInit(self, flags):
            return 999

    monkeypatch.setattr(localllm_cuda, "_load_driver", BrokenDriver)
    with pytest.raises(LocalLLMError, match="CUDA error 999"):
        make_backend("cuda")


def test_cuda_without_numba_cuda_installed(monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")
    if SIMULATED:
        monkeypatch.setattr("numba.config.ENABLE_CUDASIM", 0)
    monkeypatch.setitem(sys.modules, "numba_cuda", None)  # `import numba_cuda` now fails
    assert not localllm_cuda.numba_cuda_installed()
    assert isinstance(make_backend("auto"), CPUBackend)
    with pytest.raises(LocalLLMError, match=r"pip install 'localllm\[cuda\]'"):
        make_backend("cuda")


def test_cuda_package_itself_unimportable(monkeypatch):
    """make_backend's own fallback when localllm.cuda cannot be imported at all."""
    monkeypatch.setitem(sys.modules, "localllm.cuda", None)
    monkeypatch.delattr("localllm.cuda", raising=False)
    assert isinstance(make_backend("auto"), CPUBackend)
    with pytest.raises(LocalLLMError, match=r"pip install 'localllm\[cuda\]'"):
        make_backend("cuda")


@pytest.mark.skipif(not localllm_cuda.numba_cuda_installed(), reason="needs numba-cuda")
def test_cuda_backend_rejects_bad_launch_shapes():
    for lanes, threads in [(3, 8), (64, 8), (8, 0), (8, 256)]:
        with pytest.raises(ValueError, match="power of two"):
            localllm_cuda.CUDABackend(lanes=lanes, threads=threads)
