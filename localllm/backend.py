"""Backends: where the model's arithmetic runs. The model code calls only these methods.

A backend turns GGUF tensors into weights it can use (`weight`, `vector`) and provides the ops a
transformer block needs. The CPU backend keeps every quantized weight as a view into the memory
map and dequantizes blocks on the fly inside Numba kernels.
"""

from __future__ import annotations

import mmap
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numba
import numpy as np

from localllm import ops, quants
from localllm.errors import LocalLLMError
from localllm.gguf import TensorInfo, ask_for_huge_pages
from localllm.kv_cache import PAGE_TOKENS, page_spans
from localllm.quants import intdot
from localllm.quants.activations import Q8_BLOCK_SIZE, round_activations
from localllm.quants.cpu import HARDWARE_HALF
from localllm.threads import ThreadTuner, physical_cores

# From this many tokens on (a prompt chunk, a batch of sequences), the integer products take
# gemm.py's tiles, tokens in the SIMD lanes; below, intdot.py's, weights in the lanes (a tile
# mostly empty costs more than it saves). With a few tokens in one ymm tile, a batched step of
# 4 decode rows on qwen2.5-coder-0.5b (2 threads) takes 39.7 ms in tiles against 43.7 in the
# matvec; at 3 rows the two are even. Both give the same sums.
TILE_MIN_TOKENS = 4

Array = Any  # float32 arrays where the backend computes: numpy on the CPU, device arrays on CUDA


@runtime_checkable
class Backend(Protocol):
    """What the model (models/transformer.py, kv_cache.py) calls, and all it calls: CPUBackend
    and cuda.CUDABackend both provide it (tests/test_backend.py checks the signatures).

    Weights come from `weight`/`vector` and go back only into these methods; shapes are those of
    `Transformer`'s scratch buffers. Ops write into `out` (returned) or work in place.
    """

    name: str  # "cpu", "cuda": what `bench` reports

    def step(self, n_tokens: int) -> AbstractContextManager:
        """A context around one forward chunk of n_tokens (the CPU picks its threads there)."""
        ...

    def weight(self, tensor: TensorInfo) -> Any:
        """A 2-D weight for `linear`/`embed`, in whatever form the backend runs it."""
        ...

    def weight_stack(self, tensor: TensorInfo) -> Any:
        """A 3-D tensor of a MoE's experts' matrices (ffn_{gate,up,down}_exps) for
        `linear_experts`; its `experts` attribute: each expert's matrix as `weight` makes it."""
        ...

    def vector(self, tensor: TensorInfo) -> Array:
        """A 1-D tensor (norm weights, biases) as float32[n]."""
        ...

    def exact_rows(self, w: Any) -> bool:
        """Whether row t of `linear(x, w)` depends on row t of x alone, whatever the other rows
        and however many, so that sequences batched in one pass get what each gets alone."""
        ...

    def zeros(self, shape: tuple[int, ...]) -> Array:
        """float32 zeros: scratch buffers."""
        ...

    def kv_zeros(self, shape: tuple[int, ...]) -> Array:
        """Zeros for one of a KVPool's K/V arrays, in the element type `write_kv` stores and
        `attention` reads (f16 bits on the CPU)."""
        ...

    def kv_page_tokens(self, n_ctx: int) -> int:
        """Positions per page of the KV pool for sequences of n_ctx positions."""
        ...

    def to_host(self, x: Array) -> np.ndarray:
        """A host float32 copy of x (the logits)."""
        ...

    def write_kv(
        self, k_pool: Array, v_pool: Array, pages: np.ndarray, start_pos: int, k: Array, v: Array
    ) -> None:
        """Store k, v: float32[n_tokens, n_kv_heads, head_dim] at positions start_pos.. of one
        layer of a KVPool (k_pool, v_pool: [n_pages, n_kv_heads, page_tokens, head_dim]) through
        a sequence's page table."""
        ...

    def linear(self, x: Array, w: Any, out: Array) -> Array:
        """out = x @ w.T: x float32[n_tokens, n_cols], out float32[n_tokens, n_rows]."""
        ...

    def linear_many(self, x: Array, weights: Any, outs: Any) -> tuple:
        """outs[i] = x @ weights[i].T for weights that share the input x."""
        ...

    def linear_each(self, x: Array, weights: Any, out: Array) -> Array:
        """out[i] = x[i] @ weights[i].T, each row of x through its own weight (a token's MoE
        experts): x float32[n, n_cols], out float32[n, n_rows], the weights of one shape."""
        ...

    def linear_experts(
        self, x: Array, stacks: Any, ids: np.ndarray, spans: np.ndarray, outs: Any
    ) -> tuple:
        """outs[j][spans[i]:spans[i + 1]] = x[spans[i]:spans[i + 1]] @ expert ids[i] of
        stacks[j] (`weight_stack`s of one shape), .T: a prompt's MoE experts, x's rows sorted by
        expert. ids: host int64[n_used]; spans: host int64[n_used + 1], spans[-1] = len(x)."""
        ...

    def embed(self, w: Any, token_ids: np.ndarray, out: Array) -> Array:
        """out = rows token_ids of the embedding matrix: float32[n_tokens, n_cols]."""
        ...

    def rmsnorm(self, x: Array, weight: Array, eps: float, out: Array) -> Array: ...

    def layernorm(self, x: Array, weight: Array, bias: Array, eps: float, out: Array) -> Array:
        """LayerNorm of each row of x: float32[n_tokens, dim] with weight and bias (encoders)."""
        ...

    def rmsnorm_heads(self, x: Array, weight: Array, eps: float) -> None:
        """RMSNorm of each head in place, x: float32[n_tokens, n_heads, head_dim] (QK-norm)."""
        ...

    def rope(self, x: Array, cos: Array, sin: Array, neox: bool) -> None: ...

    def rope_tables(
        self,
        positions: np.ndarray,
        rope_dim: int,
        theta_base: float,
        scaling: ops.RopeScaling,
        freq_factors: np.ndarray | None,
    ) -> tuple[Array, Array]:
        """(cos, sin): float32[n_tokens, rope_dim // 2] each, for int64 positions, made on the
        host by ops.rope_tables (freq_factors: host float32[rope_dim // 2] or None)."""
        ...

    def attention(
        self,
        q: Array,
        k_cache: Array,
        v_cache: Array,
        start_pos: int,
        window: int,
        scale: float,
        softcap: float,
        out: Array,
        sinks: Array | None = None,
        causal: bool = True,
    ) -> Array:
        """Causal GQA attention of q: float32[n_tokens, n_heads, head_dim] over the cache;
        softcap > 0 caps the scaled scores at softcap * tanh(score / softcap) (Gemma 2); sinks
        (float32[n_heads]) add one logit per head to each softmax, weighting nothing (gpt-oss).
        Not causal: each token over all start_pos + n_tokens keys (encoders, whose K and V are
        float32[n_tokens, n_kv_heads, head_dim] scratch rather than a cache)."""
        ...

    def attention_sequences(
        self, q: Array, k_pool: Array, v_pool: Array, tables: np.ndarray, starts: np.ndarray,
        first_rows: np.ndarray, window: int, scale: float, softcap: float, out: Array,
        sinks: Array | None = None,
    ) -> Array:  # fmt: skip
        """`attention` for the rows of several sequences (a batched step) over one layer of a
        KVPool: rows first_rows[s]..first_rows[s + 1] - 1 of q are sequence s's tokens at
        positions starts[s].., its pages tables[s] (int32[n_seqs, pages], see ops.attention)."""
        ...

    def add_bias(self, x: Array, bias: Array) -> None: ...

    def add_bias_rows(self, x: Array, biases: Array, ids: np.ndarray) -> None:
        """x[r] += biases[ids[r]] for each row r (llama.cpp's ggml_add_id): each row's expert's
        bias, gpt-oss's MoE. biases: float32[n_experts, n]; ids: host int64[len(x)]."""
        ...

    def add(self, x: Array, y: Array) -> None: ...

    def silu_mul(self, gate: Array, up: Array) -> None: ...

    def gelu_mul(self, gate: Array, up: Array) -> None: ...

    def swiglu_oai_mul(self, gate: Array, up: Array) -> None:
        """gate = swiglu_oai(gate, up), in place: gpt-oss's clamped SwiGLU (ops.swiglu_oai)."""
        ...

    def gelu(self, x: Array) -> None:
        """x = gelu_tanh(x) in place (the encoders' GELU MLP)."""
        ...

    def scale(self, x: Array, factor: float) -> None: ...

    def gather_rows(self, x: Array, rows: np.ndarray, out: Array) -> Array:
        """out[i] = x[rows[i]]: the tokens a MoE expert runs on. rows: host int64[m]."""
        ...

    def scatter_rows(self, x: Array, rows: np.ndarray, factors: np.ndarray, out: Array) -> None:
        """out[rows[i]] = x[i] * factors[i]: an expert's outputs, weighted, back to their tokens.
        rows: host int64[m], distinct; factors: host float32[m]. out may be x (rows 0..m-1:
        each row scaled by its factor)."""
        ...


@dataclass(frozen=True)
class QuantWeight:
    """A 2-D weight still in its GGUF blocks: raw uint8[n_rows, row_bytes], a view of the map."""

    name: str
    raw: np.ndarray
    qtype: quants.QuantType
    n_rows: int
    n_cols: int


@dataclass(frozen=True)
class QuantStack:
    """A MoE's experts' matrices in their GGUF blocks: raw uint8[n_experts, n_rows, row_bytes],
    a view of the map; experts: each one's QuantWeight (views of raw)."""

    name: str
    raw: np.ndarray
    qtype: quants.QuantType
    experts: list


def default_threads() -> int:
    """Threads when -t is not given, at most: the physical cores this process may run on (an SMT
    sibling shares its core's load and store units, which decode is bound by)."""
    return physical_cores()


class CPUBackend:
    """Numba kernels on the memory-mapped weights."""

    name = "cpu"

    def __init__(self, n_threads: int | None = None, llama_cpp_rounding: bool = True):
        """llama_cpp_rounding: round activations as ggml does before each quantized product, and
        take GeGLU from ggml's half-precision table (the default; logits then track llama.cpp's).
        False keeps float32 activations and exact GeGLU: a little more precise, and the same for a
        token whether it is decoded alone or in a batch."""
        self.llama_cpp_rounding = llama_cpp_rounding
        n = n_threads or default_threads()
        if n < 1:
            raise LocalLLMError(f"--threads must be at least 1, got {n}")
        self.n_threads = min(n, numba.config.NUMBA_NUM_THREADS)  # at most
        # -t N runs on exactly N threads; the default measures how many help (see threads.py)
        tune = n_threads is None
        self.thread_tuner = ThreadTuner(self.n_threads, numba.set_num_threads, tune=tune)
        # Activation buffers, made for the most tokens seen so far and lent as views of their
        # first rows, so that a server's batches of every size share one set (keyed by token
        # count, they grew with each new size): rounded ones by (kind, n_cols), int8 ones by
        # (super block, n_cols).
        self._rounded: dict[tuple, np.ndarray] = {}
        self._quantized: dict[tuple, tuple] = {}
        # attention scratch: ((group, head_dim), ops.attention_scratch(...))
        self._attention: tuple | None = None
        # on an x86 CPU with AVX2 or VNNI: ggml's integer dot products (quants/intdot.py), for a
        # token decoded alone and for the tiles of a prefill alike
        self.integer_kernels = llama_cpp_rounding and intdot.AVAILABLE

    def step(self, n_tokens: int):
        """A context for one forward chunk of n_tokens: it runs on the threads chosen for it."""
        return self.thread_tuner.step(n_tokens)

    # -- weights -------------------------------------------------------------------------

    def weight(self, tensor: TensorInfo) -> QuantWeight:
        """A matrix used by `linear` or `embed`, left in its quantized blocks."""
        qtype = quants.get_quant_type(tensor.ggml_type, tensor.name)
        if len(tensor.shape) != 2:
            raise LocalLLMError(f"tensor {tensor.name} should be 2-D, has shape {tensor.shape}")
        n_rows, n_cols = tensor.shape
        return QuantWeight(tensor.name, tensor.data, qtype, n_rows, n_cols)

    def weight_stack(self, tensor: TensorInfo) -> QuantStack:
        experts = [self.weight(matrix) for matrix in tensor.matrices()]
        return QuantStack(tensor.name, tensor.data, experts[0].qtype, experts)

    def exact_rows(self, w: QuantWeight) -> bool:
        """Integer dot products are exact sums whatever the tile a token is in; the float
        kernels' sums go in an order that depends on the tile (matvec, 4 x 4 tiles)."""
        return self.integer_kernels and w.qtype.int_matvec is not None

    def vector(self, tensor: TensorInfo) -> np.ndarray:
        """A 1-D float32 tensor (norm weights, biases): float32[n], converted if stored as F16."""
        if tensor.ggml_type == 0:
            return tensor.data.view(np.float32).reshape(-1)
        return quants.dequantize(tensor.data.reshape(1, -1), tensor.ggml_type).reshape(-1)

    # -- memory -----------------------------------------------------------------------------

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        """float32 zeros; the pages are only touched (and counted in RSS) when written."""
        return np.zeros(shape, dtype=np.float32)

    def kv_zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        """uint16 zeros: the KV cache holds IEEE half bits, as llama.cpp's f16 cache (half the
        memory of float32, and half the bytes attention reads per token). Without
        llama_cpp_rounding, float32. In memory asked for huge pages (`huge_zeros`)."""
        return huge_zeros(shape, np.uint16 if self.llama_cpp_rounding else np.float32)

    def kv_page_tokens(self, n_ctx: int) -> int:
        return PAGE_TOKENS

    def to_host(self, x: np.ndarray) -> np.ndarray:
        """A host copy of x, e.g. the logits."""
        return np.array(x, dtype=np.float32)

    def write_kv(self, k_pool, v_pool, pages, start_pos: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v: float32[n_tokens, n_kv_heads, head_dim] at start_pos.. through the page
        table, as half bits (rounded to nearest even, as ggml converts to its f16 cache) in a
        uint16 pool, as they are in a float32 one."""
        halves = k_pool.dtype == np.uint16
        if halves and not HARDWARE_HALF:
            k, v = k.astype(np.float16).view(np.uint16), v.astype(np.float16).view(np.uint16)
        for page, row, first, n in page_spans(pages, k_pool.shape[2], start_pos, k.shape[0]):
            if halves and HARDWARE_HALF:
                last = first + n
                ops.write_half_rows(k_pool, v_pool, page, row, k[first:last], v[first:last])
            else:  # [n, n_kv_heads, head_dim] -> the page's [n_kv_heads, n, head_dim]
                k_pool[page, :, row : row + n] = k[first : first + n].transpose(1, 0, 2)
                v_pool[page, :, row : row + n] = v[first : first + n].transpose(1, 0, 2)

    # -- ops --------------------------------------------------------------------------------

    def linear(self, x: np.ndarray, w: QuantWeight, out: np.ndarray) -> np.ndarray:
        """out = x @ w.T. x: float32[n_tokens, n_cols]; out: float32[n_tokens, n_rows].

        x is first rounded as llama.cpp quantizes activations for this weight type, so that the
        products equal ggml's integer dot products (see quants/activations.py).
        """
        return self.linear_many(x, (w,), (out,))[0]

    def linear_many(self, x: np.ndarray, weights, outs) -> tuple:
        """outs[i] = x @ weights[i].T for weights sharing one input (Q/K/V, gate/up): x is
        rounded once per activation type rather than once per matrix. With integer kernels
        (`integer_kernels`) the types intdot has take ggml's integer dot products
        (`_integer_matmuls`); the other weights the float kernels on rounded activations."""
        pairs = list(zip(weights, outs, strict=True))
        if self.integer_kernels:
            integer = [(w, out) for w, out in pairs if w.qtype.int_matvec is not None]
            if integer:
                self._integer_matmuls(x, integer)
            if len(integer) == len(pairs):
                return tuple(outs)
            pairs = [(w, out) for w, out in pairs if w.qtype.int_matvec is None]
        rounded = {}
        for w, out in pairs:
            kind = w.qtype.vec_dot_type if self.llama_cpp_rounding else "none"
            xr = rounded.get(kind)
            if xr is None:
                key = (kind, x.shape[1])
                buffer = self._rounded.get(key)
                if buffer is None or buffer.shape[0] < x.shape[0]:
                    buffer = self._rounded[key] = np.empty(x.shape, np.float32)
                xr = rounded[kind] = round_activations(x, kind, buffer[: x.shape[0]])
            if x.shape[0] == 1:
                w.qtype.matvec(w.raw, xr[0], out[0])
            else:
                w.qtype.matmul(w.raw, xr, out)
        return tuple(outs)

    def linear_each(self, x: np.ndarray, weights, out: np.ndarray) -> np.ndarray:
        """out[i] = x[i] @ weights[i].T. Weights of one type with integer kernels: x quantized
        once, one kernel call for all (intdot's matvec, `each`); otherwise one linear a row."""
        types = {w.qtype for w in weights}
        qt = types.pop() if len(types) == 1 else None
        if qt is None or not self.integer_kernels or qt.int_matvec is None:
            for i, w in enumerate(weights):
                self.linear(x[i : i + 1], w, out[i : i + 1])
            return out
        if not out.flags.c_contiguous:  # the kernels address rows by the row length
            raise ValueError("the output of linear_each must be C-contiguous")
        xq = self._activation_quants(x, Q8_BLOCK_SIZE[qt.vec_dot_type])
        qt.int_matvec(tuple(w.raw for w in weights), *xq, (out,) * len(weights), True)
        return out

    def linear_experts(self, x: np.ndarray, stacks, ids, spans, outs) -> tuple:
        """With integer kernels: x quantized once per activation type; the experts with fewer
        than TILE_MIN_TOKENS rows (most of them in a batch of a few decode rows, many in a
        prompt chosen from many experts) in one kernel call per stack (intdot.experts_kernel),
        each other expert in one call for all the stacks through the tiles a prompt takes
        (int_matmul), as linear_many would. Without them, one linear_many per expert."""
        kernels = [s.qtype.int_experts if self.integer_kernels else None for s in stacks]
        if None in kernels or len({s.qtype for s in stacks}) > 1:
            for i, e in enumerate(ids):
                rows = slice(spans[i], spans[i + 1])
                self.linear_many(x[rows], [s.experts[e] for s in stacks], [o[rows] for o in outs])
            return tuple(outs)
        if not all(out.flags.c_contiguous for out in outs):
            raise ValueError("the outputs of linear_experts must be C-contiguous")
        qt = stacks[0].qtype
        xq = self._activation_quants(x, Q8_BLOCK_SIZE[qt.vec_dot_type])
        bounds = np.stack([spans[:-1], spans[1:]], axis=1)  # int64[n_used, 2]
        tiled = bounds[:, 1] - bounds[:, 0] >= TILE_MIN_TOKENS
        if qt.int_matmul is None:
            tiled[:] = False
        few = ~tiled
        if few.any():
            for stack, kernel, out in zip(stacks, kernels, outs, strict=True):
                kernel(stack.raw, ids[few], bounds[few], *xq, out)
        for i in np.flatnonzero(tiled):
            rows = slice(bounds[i, 0], bounds[i, 1])
            raws = tuple(s.raw[ids[i]] for s in stacks)
            qt.int_matmul(raws, *(a[rows] for a in xq), tuple(out[rows] for out in outs))
        return tuple(outs)

    def _integer_matmuls(self, x: np.ndarray, pairs) -> None:
        """out = x @ w.T for (w, out) pairs, x: float32[n_tokens, n_cols]: x quantized to int8
        once per super-block size, one kernel call for all the weights of a type. (Lean: a
        1.5B model's decode makes 113 of these calls a token, a few microseconds of Python
        each.)"""
        by_type: dict[int, tuple] = {}  # ggml_type -> (qt, raws, targets)
        for w, out in pairs:
            if not out.flags.c_contiguous:  # the kernels address rows by the row length
                raise ValueError(f"the output for {w.name} must be C-contiguous")
            group = by_type.get(w.qtype.ggml_type)
            if group is None:
                group = by_type[w.qtype.ggml_type] = (w.qtype, [], [])
            group[1].append(w.raw)
            group[2].append(out)
        quantized = {}
        n_tokens = x.shape[0]
        for qt, raws, targets in by_type.values():
            super_block = Q8_BLOCK_SIZE[qt.vec_dot_type]
            xq = quantized.get(super_block)
            if xq is None:
                xq = quantized[super_block] = self._activation_quants(x, super_block)
            kernel = qt.int_matvec
            if n_tokens >= TILE_MIN_TOKENS and qt.int_matmul is not None:
                kernel = qt.int_matmul  # the same sums, with the tokens in the SIMD lanes
            kernel(tuple(raws), *xq, tuple(targets))

    def _activation_quants(self, x: np.ndarray, super_block: int) -> tuple:
        """x quantized for the integer kernels (intdot.quantize_q8), in buffers kept per
        super-block size and width (and their first n_tokens rows' views, per n_tokens)."""
        n_tokens, n_cols = x.shape
        key = (super_block, n_cols)
        held = self._quantized.get(key)
        if held is None or held[0][0].shape[0] < n_tokens:
            held = self._quantized[key] = (intdot.activation_buffers(n_tokens, n_cols), {})
        buffers, views = held
        xq = views.get(n_tokens)
        if xq is None:
            xq = views[n_tokens] = tuple(a[:n_tokens] for a in buffers)
        if n_tokens < 16:  # microseconds: not worth waking the threads (a batch's decode rows;
            # under load a parallel launch cost ~1 ms)
            intdot.quantize_q8(x, super_block, *xq)
        else:
            intdot.quantize_q8_tokens(x, super_block, *xq)
        return xq

    def embed(self, w: QuantWeight, token_ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out = rows token_ids of the embedding matrix: float32[n_tokens, n_cols].

        Only those rows are read from the map."""
        out[:] = w.qtype.dequantize(np.ascontiguousarray(w.raw[token_ids]))
        return out

    def rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> np.ndarray:
        ops.rmsnorm(x, weight, np.float32(eps), out)
        return out

    def layernorm(
        self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float, out: np.ndarray
    ) -> np.ndarray:
        ops.layernorm(x, weight, bias, np.float32(eps), out)
        return out

    def rmsnorm_heads(self, x: np.ndarray, weight: np.ndarray, eps: float) -> None:
        ops.rmsnorm_heads(x, weight, np.float32(eps))

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> None:
        ops.rope(x, cos, sin, neox)

    def rope_tables(
        self,
        positions: np.ndarray,
        rope_dim: int,
        theta_base: float,
        scaling: ops.RopeScaling,
        freq_factors: np.ndarray | None,
    ):
        """(cos, sin): float32[n_tokens, rope_dim // 2] each, for int64 positions."""
        return ops.rope_tables(positions, rope_dim, theta_base, scaling, freq_factors)

    def attention(
        self, q, k_cache, v_cache, start_pos, window, scale, softcap, out, sinks=None, causal=True
    ) -> np.ndarray:
        """Attention of one sequence over k_cache, v_cache: [n_keys, n_kv_heads, head_dim], its
        positions 0.. as one page (an encoder's K and V, a test's cache), read in place: the
        page [n_kv_heads, n_keys, head_dim] is a strided view."""
        starts = np.array([start_pos], np.int64)
        rows = np.array([0, q.shape[0]], np.int64)
        k_page, v_page = (x.transpose(1, 0, 2)[None] for x in (k_cache, v_cache))
        return self._attention_pages(
            q, k_page, v_page, _ONE_PAGE, starts, rows, window, scale, softcap,
            out, sinks, causal,
        )  # fmt: skip

    def attention_sequences(
        self, q, k_pool, v_pool, tables, starts, first_rows, window, scale, softcap, out,
        sinks=None,
    ):  # fmt: skip
        """One parallel region for every sequence's rows (ops.attention), causal."""
        return self._attention_pages(
            q, k_pool, v_pool, tables, starts, first_rows, window, scale, softcap, out, sinks,
            True,
        )  # fmt: skip

    def _attention_pages(
        self, q, k_pool, v_pool, tables, starts, first_rows, window, scale, softcap, out, sinks,
        causal,
    ):  # fmt: skip
        """ops.attention, its scratch made once per model. With an f16 KV cache
        (llama_cpp_rounding), q and the softmax probabilities are rounded to half, as llama.cpp's
        matrix products with its f16 KV cache round them; float32 K and V (an encoder's, or the
        exact mode's cache) round nothing, as llama.cpp's products with float32 K and V do not.
        sinks: None, or float32[n_heads] sink logits (gpt-oss)."""
        f16 = self.llama_cpp_rounding and k_pool.dtype == np.uint16
        n_keys = tables.shape[1] * k_pool.shape[2]
        split, scratch = self._attention_scratch(q.shape, n_keys, k_pool.shape[1], window)
        ops.attention(
            q, k_pool, v_pool, tables, starts, first_rows, window, np.float32(scale),
            np.float32(softcap), _NO_SINKS if sinks is None else sinks, f16, f16, split, scratch,
            out, bool(causal),
        )  # fmt: skip
        return out

    def _attention_scratch(self, q_shape: tuple, n_ctx: int, n_kv_heads: int, window: int):
        """(split, scratch) for an attention call (see ops.attention): the scratch is made once
        per model, and again only when a call needs more slots (a longer context)."""
        n_rows, n_heads, head_dim = q_shape
        threads = numba.config.NUMBA_NUM_THREADS
        running = numba.get_num_threads()
        split = running if ops.split_jobs(n_rows, n_kv_heads, running) else 0
        slots = ops.attention_slots(n_rows if split else 0, n_kv_heads, n_ctx, window, threads)
        key = (n_heads // n_kv_heads, head_dim)
        have = self._attention
        if have is None or have[0] != key or have[1][0].shape[0] < slots:
            if have is not None and have[0] == key:
                slots = max(slots, have[1][0].shape[0])
            self._attention = have = (key, ops.attention_scratch(threads, *key, slots))
        return split, have[1]

    def add_bias(self, x: np.ndarray, bias: np.ndarray) -> None:
        x += bias

    def add_bias_rows(self, x: np.ndarray, biases: np.ndarray, ids: np.ndarray) -> None:
        ops.add_bias_rows(x, biases, np.ascontiguousarray(ids, dtype=np.int64))

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        ops.add_inplace(x, y)

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> None:
        ops.silu_mul(gate, up)

    def swiglu_oai_mul(self, gate: np.ndarray, up: np.ndarray) -> None:
        ops.swiglu_oai(gate, up)

    def gelu_mul(self, gate: np.ndarray, up: np.ndarray) -> None:
        if self.llama_cpp_rounding:  # ggml's half-precision table
            kernel = ops.gelu_tanh_mul if gate.shape[0] == 1 else ops.gelu_tanh_mul_rows
            kernel(gate, up, ops.GELU_TABLE)
        else:
            ops.gelu_tanh_mul_exact(gate, up)

    def gelu(self, x: np.ndarray) -> None:
        if self.llama_cpp_rounding:  # ggml's half-precision table
            ops.gelu_tanh_rows(x, ops.GELU_TABLE)
        else:
            ops.gelu_tanh_exact(x)

    def scale(self, x: np.ndarray, factor: float) -> None:
        x *= np.float32(factor)

    def gather_rows(self, x: np.ndarray, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        np.take(x, rows, axis=0, out=out)
        return out

    def scatter_rows(self, x: np.ndarray, rows, factors, out: np.ndarray) -> None:
        out[rows] = x * np.asarray(factors, dtype=np.float32)[:, None]


DEVICES = ("auto", "cpu", "cuda")
_NO_SINKS = np.zeros(0, np.float32)  # attention without sink logits


def huge_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeros in an anonymous map asked for transparent huge pages (Linux; elsewhere, or refused,
    plain pages): the OS backs them only when written, as np.zeros'. A decode step reads every
    layer's K/V pages right after the weights' matrix products have evicted the page tables from
    the caches: with 4 KiB pages each 4 KiB of K/V cost a page walk to memory (a 3B model's
    attention at 512 positions 250 -> 160 us a layer on a Zen 4 machine with 2 MiB pages)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.zeros(shape, dtype)
    n_bytes = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
    # private: a shared anonymous map is shmem, which follows shmem_enabled (often never)
    mapping = mmap.mmap(-1, n_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    ask_for_huge_pages(mapping)
    return np.frombuffer(mapping, dtype, count=int(np.prod(shape))).reshape(shape)


_ONE_PAGE = np.zeros((1, 1), np.int32)  # the page table of K and V given whole


def make_backend(device: str = "auto", n_threads: int | None = None) -> Backend:
    """The backend for --device: "cpu", "cuda" (an error when no usable GPU), or "auto" (CUDA
    when a real, usable GPU is present, never the simulator; else CPU)."""
    if device not in DEVICES:
        raise LocalLLMError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device == "cpu":
        return CPUBackend(n_threads)
    try:
        from localllm import cuda  # imported only when a GPU is asked for (auto asks, cheaply)
    except ImportError as e:
        if device == "auto":
            return CPUBackend(n_threads)
        raise LocalLLMError(
            f"the CUDA backend is not available ({e}); pip install 'localllm[cuda]'"
        ) from e
    if device == "auto":
        return cuda.CUDABackend() if cuda.gpu_available() else CPUBackend(n_threads)
    cuda.require_gpu()  # raises LocalLLMError saying what is missing
    return cuda.CUDABackend()
