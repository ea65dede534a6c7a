"""CUDABackend: the transformer's ops on an NVIDIA GPU through numba-cuda.

Weights go to the device once, still in their GGUF blocks; activations, scratch buffers and the
KV cache live there too. Per forward pass only the token ids, the RoPE tables (a few hundred
floats, computed on the host exactly as the CPU backend does) and the last logits cross the bus.
All launches go to the default stream, so they run in order; `to_host` waits for them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import cuda
from numba.cuda.core import config as cuda_config

from localllm import ops, quants
from localllm.cuda import kernels
from localllm.errors import LocalLLMError
from localllm.gguf import TensorInfo
from localllm.kv_cache import page_spans

ELEMENTWISE_THREADS = 256


@dataclass(frozen=True)
class CUDAWeight:
    """A 2-D weight on the device, still in its GGUF blocks: uint8[n_rows, row_bytes]."""

    name: str
    raw: object  # numba DeviceNDArray, uint8[n_rows, row_bytes], bytes as in the file
    ggml_type: int
    n_rows: int
    n_cols: int


@dataclass(frozen=True)
class CUDAStack:
    """A MoE's experts' matrices, each uploaded as its own CUDAWeight."""

    name: str
    experts: list


def _blocks(n: int, per_block: int) -> int:
    return (n + per_block - 1) // per_block


def _flat_launch(n: int) -> tuple[int, int]:
    """(blocks, threads) for one thread per element of n; no idle threads for small n."""
    threads = max(1, min(n, ELEMENTWISE_THREADS))
    return _blocks(n, threads), threads


def _check_power_of_two(value: int, name: str, most: int) -> None:
    if value < 1 or value > most or value & (value - 1):
        raise ValueError(f"{name} must be a power of two from 1 to {most}, got {value}")


class CUDABackend:
    """The CPUBackend's interface, on the GPU. Arrays it hands out are numba device arrays.

    lanes: threads per weight row in matvec/matmul (a warp on a GPU); threads: threads per row
    in rmsnorm and attention. Both are powers of two; the tests run the simulator with small
    values, which changes the launch shape, not the arithmetic.
    """

    name = "cuda"

    def __init__(self, lanes: int = 32, threads: int = 128):
        _check_power_of_two(lanes, "lanes", kernels.MAX_LANES)
        _check_power_of_two(threads, "threads", kernels.MAX_BLOCK)
        self.lanes = lanes
        self.rows_per_block = kernels.MAX_BLOCK // lanes  # 4 rows of a warp each on a GPU
        self.threads = threads
        self._scores = None  # attention scratch, float32[jobs, keys], grown on demand
        self._no_sinks = cuda.device_array(0, dtype=np.float32)
        # A decode step launches small grids by nature; numba-cuda would warn at each of them.
        cuda_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0

    def step(self, n_tokens: int):
        """A context for one forward chunk (the CPU backend picks its threads there)."""
        return contextlib.nullcontext()

    # -- weights -------------------------------------------------------------------------

    def weight_stack(self, tensor: TensorInfo) -> CUDAStack:
        """Each expert's matrix uploaded as `weight` does it."""
        return CUDAStack(tensor.name, [self.weight(matrix) for matrix in tensor.matrices()])

    def weight(self, tensor: TensorInfo) -> CUDAWeight:
        """A matrix used by `linear` or `embed`, uploaded once, still quantized."""
        if tensor.ggml_type not in kernels.SUPPORTED_TYPES:
            quants.get_quant_type(tensor.ggml_type, tensor.name)  # unknown types: its message
            supported = ", ".join(GGMLQuantizationType(t).name for t in kernels.SUPPORTED_TYPES)
            raise LocalLLMError(
                f"tensor {tensor.name} uses GGML type {tensor.type_name}, which the CUDA backend "
                f"cannot run (it runs {supported}); use --device cpu"
            )
        if len(tensor.shape) != 2:
            raise LocalLLMError(f"tensor {tensor.name} should be 2-D, has shape {tensor.shape}")
        n_rows, n_cols = tensor.shape
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.ggml_type)]
        raw = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(n_rows, -1)
        if n_cols % block_size or raw.shape[1] != n_cols // block_size * type_size:
            raise LocalLLMError(f"tensor {tensor.name} has a row size that does not fit its type")
        return CUDAWeight(tensor.name, cuda.to_device(raw), tensor.ggml_type, n_rows, n_cols)

    def vector(self, tensor: TensorInfo):
        """A 1-D float32 tensor (norm weights, biases) on the device: float32[n]."""
        if tensor.ggml_type == 0:
            host = tensor.data.view(np.float32).reshape(-1)
        else:
            host = quants.dequantize(tensor.data.reshape(1, -1), tensor.ggml_type).reshape(-1)
        return cuda.to_device(np.ascontiguousarray(host, dtype=np.float32))

    # -- memory -----------------------------------------------------------------------------

    def zeros(self, shape: tuple[int, ...]):
        """float32 zeros on the device (scratch buffers, the KV cache)."""
        x = cuda.device_array(shape, dtype=np.float32)
        flat = x.reshape(x.size)
        if x.size:
            kernels.fill_zero[_flat_launch(x.size)](flat)
        return x

    def kv_zeros(self, shape: tuple[int, ...]):
        """float32 zeros on the device for the KV cache (kernels.attention reads float32)."""
        return self.zeros(shape)

    def to_host(self, x) -> np.ndarray:
        """A host copy of the device array x, e.g. the logits; waits for the queued work."""
        return np.asarray(x.copy_to_host(), dtype=np.float32)

    def kv_page_tokens(self, n_ctx: int) -> int:
        """A page holds a whole context: kernels.attention reads a sequence's keys as one
        array (sequences run one pass each here, see exact_rows)."""
        return n_ctx

    def write_kv(self, k_pool, v_pool, pages, start_pos: int, k, v) -> None:
        """Store k, v (device float32[n_tokens, n_kv_heads, head_dim]) at start_pos.. (pages
        [n_kv_heads, page_tokens, head_dim])."""
        for page, row, first, n in page_spans(pages, k_pool.shape[2], start_pos, k.shape[0]):
            launch = _flat_launch(n * k.shape[1] * k.shape[2])
            kernels.write_rows[launch](k_pool[page], k[first : first + n], row)
            kernels.write_rows[launch](v_pool[page], v[first : first + n], row)

    # -- ops --------------------------------------------------------------------------------

    def linear(self, x, w: CUDAWeight, out):
        """out = x @ w.T. x: float32[n_tokens, n_cols]; out: float32[n_tokens, n_rows]."""
        n_tokens = x.shape[0]
        rows = min(self.rows_per_block, w.n_rows)  # no idle threads for tiny matrices
        block = (self.lanes, rows)
        grid_rows = _blocks(w.n_rows, rows)
        shared = 4 * self.lanes * rows  # bytes: one float32 per thread
        if n_tokens == 1:
            kernels.matvec[grid_rows, block, 0, shared](w.raw, w.ggml_type, x, out)
        else:
            grid = (grid_rows, _blocks(n_tokens, kernels.TOKEN_TILE))
            shared *= kernels.TOKEN_TILE  # and per token of a tile
            kernels.matmul[grid, block, 0, shared](w.raw, w.ggml_type, x, out)
        return out

    def linear_many(self, x, weights, outs) -> tuple:
        """outs[i] = x @ weights[i].T (the CPU backend shares the rounding of x among them)."""
        return tuple(self.linear(x, w, out) for w, out in zip(weights, outs, strict=True))

    def linear_experts(self, x, stacks, ids, spans, outs):
        """One linear per expert and stack, on the expert's rows."""
        for i, e in enumerate(ids):
            rows = slice(int(spans[i]), int(spans[i + 1]))
            for stack, out in zip(stacks, outs, strict=True):
                self.linear(x[rows], stack.experts[e], out[rows])
        return tuple(outs)

    def linear_each(self, x, weights, out):
        """out[i] = x[i] @ weights[i].T: one matvec a row."""
        for i, w in enumerate(weights):
            self.linear(x[i : i + 1], w, out[i : i + 1])
        return out

    def embed(self, w: CUDAWeight, token_ids: np.ndarray, out):
        """out = rows token_ids of the embedding matrix: float32[n_tokens, n_cols]."""
        ids = cuda.to_device(np.ascontiguousarray(token_ids, dtype=np.int64))
        n_jobs = len(token_ids) * _blocks(w.n_cols, kernels.CHUNK)
        kernels.embed[_flat_launch(n_jobs)](w.raw, w.ggml_type, ids, out)
        return out

    def rmsnorm(self, x, weight, eps: float, out):
        kernels.rmsnorm[x.shape[0], self.threads, 0, 4 * self.threads](
            x, weight, np.float32(eps), out
        )
        return out

    def layernorm(self, x, weight, bias, eps: float, out):
        kernels.layernorm[x.shape[0], self.threads, 0, 4 * self.threads](
            x, weight, bias, np.float32(eps), out
        )
        return out

    def rmsnorm_heads(self, x, weight, eps: float) -> None:
        """QK-norm: RMSNorm of each head in place. x: float32[n_tokens, n_heads, head_dim]."""
        n_tokens, n_heads, head_dim = x.shape
        rows = x.reshape(n_tokens * n_heads, head_dim)
        kernels.rmsnorm[n_tokens * n_heads, self.threads, 0, 4 * self.threads](
            rows, weight, np.float32(eps), rows
        )

    def rope(self, x, cos, sin, neox: bool) -> None:
        n_tokens, n_heads, _ = x.shape
        kernels.rope[_flat_launch(n_tokens * n_heads * cos.shape[1])](x, cos, sin, bool(neox))

    def rope_tables(
        self,
        positions: np.ndarray,
        rope_dim: int,
        theta_base: float,
        scaling: ops.RopeScaling,
        freq_factors: np.ndarray | None,
    ):
        """(cos, sin): float32[n_tokens, rope_dim // 2] each on the device; computed on the host
        with the CPU backend's function (scaling and frequency factors included), so both
        backends rotate by the same angles."""
        cos, sin = ops.rope_tables(positions, rope_dim, theta_base, scaling, freq_factors)
        return cuda.to_device(cos), cuda.to_device(sin)

    def exact_rows(self, w) -> bool:
        """Not established for the CUDA kernels: sequences take turns, one pass each."""
        return False

    def attention_sequences(
        self, q, k_pool, v_pool, tables, starts, first_rows, window, scale, softcap, out,
        sinks=None,
    ):  # fmt: skip
        """Each sequence's rows in turn over its one page (the kernels are asynchronous
        launches)."""
        if tables.shape[1] != 1:
            raise ValueError("a CUDA KV cache is one page per sequence (kv_page_tokens)")
        for seq, page in enumerate(tables[:, 0]):
            r = slice(int(first_rows[seq]), int(first_rows[seq + 1]))
            k, v = k_pool[int(page)], v_pool[int(page)]  # [n_kv_heads, n_ctx, head_dim]
            self._attention(
                q[r], k, v, True, int(starts[seq]), window, scale, softcap, out[r], sinks, True
            )
        return out

    def attention(
        self,
        q,
        k_cache,
        v_cache,
        start_pos: int,
        window: int,
        scale: float,
        softcap: float,
        out,
        sinks=None,
        causal: bool = True,
    ):
        """Causal (or, for an encoder, bidirectional) GQA attention over k_cache, v_cache:
        [n_keys, n_kv_heads, head_dim]; see kernels.attention."""
        return self._attention(
            q, k_cache, v_cache, False, start_pos, window, scale, softcap, out, sinks, causal
        )

    def _attention(
        self, q, k_cache, v_cache, heads_first, start_pos, window, scale, softcap, out, sinks,
        causal,
    ):  # fmt: skip
        n_tokens, n_heads, _ = q.shape
        n_jobs, n_keys = n_tokens * n_heads, start_pos + n_tokens
        if self._scores is None or self._scores.shape[0] < n_jobs or self._scores.shape[1] < n_keys:
            # one allocation for the largest chunk and context seen so far
            old = (0, 0) if self._scores is None else self._scores.shape
            n_ctx = k_cache.shape[1 if heads_first else 0]
            self._scores = cuda.device_array((max(n_jobs, old[0]), max(n_ctx, old[1])), np.float32)
        kernels.attention[(n_heads, n_tokens), self.threads, 0, 4 * self.threads](
            q,
            k_cache,
            v_cache,
            bool(heads_first),
            start_pos,
            window,
            np.float32(scale),
            np.float32(softcap),
            self._no_sinks if sinks is None else sinks,
            self._scores,
            out,
            bool(causal),
        )
        return out

    def _elementwise(self, kernel, x, *args) -> None:
        kernel[_flat_launch(x.shape[0] * x.shape[1])](x, *args)

    def add_bias(self, x, bias) -> None:
        self._elementwise(kernels.add_bias, x, bias)

    def add_bias_rows(self, x, biases, ids: np.ndarray) -> None:
        ids = cuda.to_device(np.ascontiguousarray(ids, dtype=np.int64))
        self._elementwise(kernels.add_bias_rows, x, biases, ids)

    def add(self, x, y) -> None:
        self._elementwise(kernels.add, x, y)

    def silu_mul(self, gate, up) -> None:
        self._elementwise(kernels.silu_mul, gate, up)

    def gelu_mul(self, gate, up) -> None:
        self._elementwise(kernels.gelu_mul, gate, up)

    def swiglu_oai_mul(self, gate, up) -> None:
        self._elementwise(kernels.swiglu_oai_mul, gate, up)

    def gelu(self, x) -> None:
        self._elementwise(kernels.gelu, x)

    def scale(self, x, factor: float) -> None:
        self._elementwise(kernels.scale, x, np.float32(factor))

    def gather_rows(self, x, rows: np.ndarray, out):
        rows = cuda.to_device(np.ascontiguousarray(rows, dtype=np.int64))
        self._elementwise(kernels.gather_rows, out, x, rows)
        return out

    def scatter_rows(self, x, rows: np.ndarray, factors: np.ndarray, out) -> None:
        rows = cuda.to_device(np.ascontiguousarray(rows, dtype=np.int64))
        factors = cuda.to_device(np.ascontiguousarray(factors, dtype=np.float32))
        self._elementwise(kernels.scatter_rows, x, rows, factors, out)
