"""The decoder-only transformer every supported architecture runs on, driven by ModelConfig.

Optional pieces are chosen by the tensors the file holds: Q/K/V biases (qwen2), post-norms
(gemma3), RoPE frequency factors (rope_freqs, Llama 3.1+; LongRoPE's rope_factors_long/short,
Phi-3), fused Q/K/V and gate/up matrices (Phi-3: split into row views of the one mapped tensor),
a separate output matrix (else the embedding is tied), a MoE's shared expert (qwen2moe). By the
config: mixture-of-experts FFNs (qwen3moe, qwen2moe: each expert a view of the 3-D tensors),
QK-norm per head (gemma3, qwen3) or across heads (olmo2), no pre-norms (olmo2), scaled residuals
and logits (granite), softcaps (gemma2), layers without RoPE (smollm3). All buffers are allocated
here, once; `forward` only fills them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from localllm import batching, ops
from localllm.errors import LocalLLMError
from localllm.gguf import GGUFFile
from localllm.kv_cache import KVCache, KVPool
from localllm.models.config import ModelConfig


@dataclass
class Layer:
    attn_norm: np.ndarray | None  # float32[dim]; None without pre-norms (olmo2)
    wq: object
    wk: object
    wv: object
    wo: object
    ffn_norm: np.ndarray | None  # float32[dim]
    w_gate: object  # None in a MoE layer without a shared expert, else its weights
    w_up: object
    w_down: object
    moe: MoE | None = None
    bq: np.ndarray | None = None  # float32[n_heads * head_dim]
    bk: np.ndarray | None = None  # float32[n_kv_heads * head_dim]
    bv: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # float32[head_dim], or [n_heads * head_dim] across heads
    k_norm: np.ndarray | None = None  # float32[head_dim], or [n_kv_heads * head_dim]
    post_attn_norm: np.ndarray | None = None  # float32[dim]
    post_ffn_norm: np.ndarray | None = None
    bo: np.ndarray | None = None  # float32[dim]: attn_output.bias (gpt-oss)
    sinks: np.ndarray | None = None  # float32[n_heads]: attn_sinks, a logit per head (gpt-oss)


@dataclass
class MoE:
    """A mixture-of-experts FFN's weights: the router and each expert's three matrices, views of
    the 3-D ffn_{gate,up,down}_exps tensors (only the chosen experts' bytes are read)."""

    router: object  # ffn_gate_inp: [n_experts, dim]
    experts: list[tuple]  # per expert: (w_gate [expert_ffn, dim], w_up, w_down [dim, expert_ffn])
    stacks: tuple  # (gate, up, down): the backend's weight_stack of each 3-D tensor
    shared_gate: object | None = None  # ffn_gate_inp_shexp as a [1, dim] weight (qwen2moe)
    router_bias: np.ndarray | None = None  # float32[n_experts] (gpt-oss)
    # ffn_{gate,up,down}_exps.bias (gpt-oss): float32[n_experts, expert_ffn] twice, then
    # [n_experts, dim]; a row per expert
    expert_biases: tuple | None = None


class Scratch:
    """Activation buffers for up to n_batch tokens; decode uses the first row of each."""

    def __init__(self, config: ModelConfig, n_batch: int, zeros):
        c = config
        self.x = zeros((n_batch, c.dim))  # residual stream
        self.h = zeros((n_batch, c.dim))  # normed input of a sub-block
        self.o = zeros((n_batch, c.dim))  # sub-block output
        self.q = zeros((n_batch, c.n_heads * c.head_dim))
        self.k = zeros((n_batch, c.n_kv_heads * c.head_dim))
        self.v = zeros((n_batch, c.n_kv_heads * c.head_dim))
        self.attn = zeros((n_batch, c.n_heads * c.head_dim))
        self.gate = zeros((n_batch, c.ffn_dim))
        self.up = zeros((n_batch, c.ffn_dim))
        self.logits = zeros((n_batch, c.vocab_size))  # only row 0 is used, except by all_logits
        if c.n_experts:  # an expert runs on the rows of the tokens that chose it
            self.router = zeros((n_batch, c.n_experts))
            # every (token, rank) pair's row, sorted by expert (Transformer._experts_of_tokens)
            rows = n_batch * c.n_experts_used
            self.expert_in = zeros((rows, c.dim))
            self.expert_gate = zeros((rows, c.expert_ffn_dim))
            self.expert_up = zeros((rows, c.expert_ffn_dim))
            self.expert_out = zeros((rows, c.dim))
            # weighted expert outputs by (rank, token), rank-major: block 0 becomes the sum
            self.expert_rows = zeros((c.n_experts_used * n_batch, c.dim))
            self.shared = zeros((n_batch, c.dim))  # the shared expert's output
            self.shared_gate = zeros((n_batch, 1))


class Transformer:
    """Weights (views into the GGUF map), scratch buffers, the KV pool and one KV cache."""

    def __init__(self, gguf: GGUFFile, config: ModelConfig, backend, n_ctx: int, n_batch: int = 64):
        self.config = config
        self.backend = backend
        self.n_batch = n_batch
        self._tensors = gguf.tensors
        b = backend
        self.token_embd = b.weight(self._tensor("token_embd.weight"))
        self.output_norm = b.vector(self._tensor("output_norm.weight"))
        # Tied embeddings: without output.weight the embedding matrix is the output head.
        out = self._tensors.get("output.weight")
        self.output = b.weight(out) if out is not None else self.token_embd
        self.layers = [self._layer(i) for i in range(config.n_layers)]
        self.rope_freqs = self._rope_freqs(n_ctx)  # host float32[rope_dim // 2] or None
        self._check_shapes()
        self.scratch = Scratch(config, n_batch, backend.zeros)
        self._n_ctx = n_ctx
        # every sequence's K/V pages; sized for one context, it grows when more are wanted
        # (see size_pool)
        page = backend.kv_page_tokens(n_ctx)
        pages = -(-n_ctx // page)
        self.pool = KVPool(
            config.n_layers, config.n_kv_heads, config.head_dim, page, pages, backend.kv_zeros
        )
        self.cache = self.new_cache(n_ctx)
        # Whether a row's result never depends on the rows beside it in a pass (integer dot
        # products all through): only then do several sequences share a pass (batching.py).
        self.batches_exactly = all(b.exact_rows(w) for w in self._matrices())

    def _matrices(self) -> list:
        """Every weight `linear` multiplies with."""
        found = [self.output]
        for layer in self.layers:
            found += [layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up]
            found.append(layer.w_down)
            if layer.moe is not None:
                found += [layer.moe.router, layer.moe.shared_gate]
                found += [w for expert in layer.moe.experts for w in expert]
        return [w for w in found if w is not None]

    def _tensor(self, name: str):
        tensor = self._tensors.get(name)
        if tensor is None:
            raise LocalLLMError(
                f"the model file lacks the tensor {name!r} that {self.config.arch} needs"
            )
        return tensor

    def _optional_vector(self, name: str) -> np.ndarray | None:
        tensor = self._tensors.get(name)
        return None if tensor is None else self.backend.vector(tensor)

    def _rope_freqs(self, n_ctx: int) -> np.ndarray | None:
        """The per-pair divisors of the RoPE angles, made into tables on the host: Llama 3.1+'s
        rope_freqs.weight (the converter's llama3 scaling), or LongRoPE's (Phi-3) factors, chosen
        as llama.cpp's get_rope_factors chooses them: rope_factors_long when the context is
        larger than the original one, else rope_factors_short. The context is llama.cpp's, the
        size asked for rounded up to a multiple of 256 (its n_ctx_seq)."""
        name = "rope_freqs.weight"
        if name not in self._tensors and "rope_factors_long.weight" in self._tensors:
            n_ctx_seq = -(-n_ctx // 256) * 256
            long = n_ctx_seq > self.config.n_ctx_orig
            name = "rope_factors_long.weight" if long else "rope_factors_short.weight"
        tensor = self._tensors.get(name)
        if tensor is None:
            return None
        n_pairs = self.config.rope_dim // 2
        if tensor.ggml_type != 0 or tensor.data.nbytes != 4 * n_pairs:
            raise LocalLLMError(
                f"tensor {name} should be {n_pairs} F32 values (rope_dim / 2), "
                f"is {tensor.type_name} {tensor.shape}; the file is inconsistent"
            )
        return np.ascontiguousarray(tensor.data.view(np.float32).reshape(-1))

    def _split(self, name: str, sizes: tuple[int, ...], parts: tuple[str, ...]) -> list:
        """The weights of a fused matrix's consecutive row blocks of `sizes` rows, each a view."""
        fused = self._tensor(name)
        if len(fused.shape) != 2 or fused.shape[0] != sum(sizes):
            raise LocalLLMError(
                f"tensor {name} has shape {fused.shape}, which does not fit the model's "
                f"metadata ({' + '.join(map(str, sizes))} rows); the file is inconsistent"
            )
        starts = np.cumsum((0, *sizes))
        return [
            self.backend.weight(fused.rows(int(start), int(start + size), f"{name}[{part}]"))
            for start, size, part in zip(starts, sizes, parts, strict=False)
        ]

    def _qkv(self, p: str) -> list:
        """wq, wk, wv: separate tensors, or row views of a fused attn_qkv (Phi-3)."""
        if p + "attn_qkv.weight" not in self._tensors:
            return [self.backend.weight(self._tensor(p + f"attn_{x}.weight")) for x in "qkv"]
        c = self.config
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        return self._split(p + "attn_qkv.weight", (q_dim, kv_dim, kv_dim), ("q", "k", "v"))

    def _gate_up(self, p: str) -> list:
        """w_gate, w_up: separate tensors, or the two halves of an ffn_up with no ffn_gate
        (Phi-3's gate_up_proj: gate rows first, as ggml_swiglu splits it)."""
        n = self.config.ffn_dim
        up = self._tensor(p + "ffn_up.weight")
        if p + "ffn_gate.weight" not in self._tensors and up.shape[0] == 2 * n:
            return self._split(p + "ffn_up.weight", (n, n), ("gate", "up"))
        return [self.backend.weight(self._tensor(p + "ffn_gate.weight")), self.backend.weight(up)]

    def _layer(self, i: int) -> Layer:
        b, p = self.backend, f"blk.{i}."
        c = self.config
        qk_norm, pre_norm = c.qk_norm != "none", c.pre_norm
        wq, wk, wv = self._qkv(p)
        moe, w_gate, w_up, w_down = None, None, None, None
        if c.n_experts:
            moe = self._moe(p)
            if p + "ffn_gate_shexp.weight" in self._tensors:
                w_gate, w_up, w_down = (
                    b.weight(self._tensor(p + f"ffn_{x}_shexp.weight"))
                    for x in ("gate", "up", "down")
                )
        else:
            w_gate, w_up = self._gate_up(p)
            w_down = b.weight(self._tensor(p + "ffn_down.weight"))
        ffn_norm = p + c.ffn_norm_tensor + ".weight"
        post_attn_norm = None
        if c.ffn_norm_tensor != "post_attention_norm":
            post_attn_norm = self._optional_vector(p + "post_attention_norm.weight")
        return Layer(
            attn_norm=b.vector(self._tensor(p + "attn_norm.weight")) if pre_norm else None,
            wq=wq,
            wk=wk,
            wv=wv,
            wo=b.weight(self._tensor(p + "attn_output.weight")),
            ffn_norm=b.vector(self._tensor(ffn_norm)) if pre_norm else None,
            w_gate=w_gate,
            w_up=w_up,
            w_down=w_down,
            moe=moe,
            bq=self._optional_vector(p + "attn_q.bias"),
            bk=self._optional_vector(p + "attn_k.bias"),
            bv=self._optional_vector(p + "attn_v.bias"),
            q_norm=b.vector(self._tensor(p + "attn_q_norm.weight")) if qk_norm else None,
            k_norm=b.vector(self._tensor(p + "attn_k_norm.weight")) if qk_norm else None,
            post_attn_norm=post_attn_norm,
            post_ffn_norm=self._optional_vector(p + "post_ffw_norm.weight"),
            bo=self._optional_vector(p + "attn_output.bias"),
            sinks=self._optional_vector(p + "attn_sinks.weight"),
        )

    def _moe(self, p: str) -> MoE:
        """The router and the experts (views of the 3-D expert tensors), checked against the
        metadata; the shared expert's gate (qwen2moe) when the file has one."""
        c, b = self.config, self.backend
        router = b.weight(self._tensor(p + "ffn_gate_inp.weight"))
        if (router.n_rows, router.n_cols) != (c.n_experts, c.dim):
            raise LocalLLMError(
                f"tensor {router.name} has shape ({router.n_rows}, {router.n_cols}), not "
                f"({c.n_experts}, {c.dim}) as the metadata says; the file is inconsistent"
            )
        stacks = {}
        for kind, shape in (
            ("gate", (c.expert_ffn_dim, c.dim)),
            ("up", (c.expert_ffn_dim, c.dim)),
            ("down", (c.dim, c.expert_ffn_dim)),
        ):
            tensor = self._tensor(p + f"ffn_{kind}_exps.weight")
            if tuple(tensor.shape) != (c.n_experts, *shape):
                raise LocalLLMError(
                    f"tensor {tensor.name} has shape {tensor.shape}, not {(c.n_experts, *shape)} "
                    "as the metadata says; the file is inconsistent"
                )
            stacks[kind] = tensor
        stacks = tuple(b.weight_stack(stacks[kind]) for kind in ("gate", "up", "down"))
        experts = [tuple(stack.experts[e] for stack in stacks) for e in range(c.n_experts)]
        shared_gate = self._tensors.get(p + "ffn_gate_inp_shexp.weight")
        if shared_gate is not None:  # [dim] (or [1, dim]): a one-row matrix
            if int(np.prod(shared_gate.shape)) != c.dim:
                raise LocalLLMError(f"tensor {shared_gate.name} should hold {c.dim} values")
            shared_gate = b.weight(
                dataclasses.replace(
                    shared_gate, shape=(1, c.dim), data=shared_gate.data.reshape(1, -1)
                )
            )
        router_bias = self._optional_vector(p + "ffn_gate_inp.bias")
        expert_biases = None
        if p + "ffn_gate_exps.bias" in self._tensors:  # gpt-oss: a bias row per expert
            biases = []
            widths = {"gate": c.expert_ffn_dim, "up": c.expert_ffn_dim, "down": c.dim}
            for kind, width in widths.items():
                tensor = self._tensor(p + f"ffn_{kind}_exps.bias")
                if int(np.prod(tensor.shape)) != c.n_experts * width:
                    raise LocalLLMError(
                        f"tensor {tensor.name} has shape {tensor.shape}, not "
                        f"{(c.n_experts, width)} as the metadata says; the file is inconsistent"
                    )
                biases.append(b.vector(tensor).reshape(c.n_experts, width))
            expert_biases = tuple(biases)
        return MoE(router, experts, stacks, shared_gate, router_bias, expert_biases)

    def _check_shapes(self) -> None:
        """Fail at load, with the tensor's name, rather than inside a kernel."""
        c = self.config
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        expected = [(self.token_embd, c.dim, None), (self.output, c.dim, c.vocab_size)]
        for layer in self.layers:
            expected += [
                (layer.wq, c.dim, q_dim),
                (layer.wk, c.dim, kv_dim),
                (layer.wv, c.dim, kv_dim),
                (layer.wo, q_dim, c.dim),
            ]
            if layer.w_gate is not None:  # a dense FFN or a MoE's shared expert
                expected += [
                    (layer.w_gate, c.dim, c.ffn_dim),
                    (layer.w_up, c.dim, c.ffn_dim),
                    (layer.w_down, c.ffn_dim, c.dim),
                ]
        for w, n_cols, n_rows in expected:
            if w.n_cols != n_cols or (n_rows is not None and w.n_rows != n_rows):
                raise LocalLLMError(
                    f"tensor {w.name} has shape ({w.n_rows}, {w.n_cols}), which does not fit the "
                    f"model's metadata; the file is inconsistent"
                )
        if c.qk_norm != "none":
            across = c.qk_norm == "all"
            sizes = (q_dim, kv_dim) if across else (c.head_dim, c.head_dim)
            for i, layer in enumerate(self.layers):
                for name, norm, size in zip(("q", "k"), (layer.q_norm, layer.k_norm), sizes):
                    if norm.shape[0] != size:
                        raise LocalLLMError(
                            f"tensor blk.{i}.attn_{name}_norm.weight has {norm.shape[0]} values, "
                            f"not the {size} that {c.arch} normalizes; the file is inconsistent"
                        )
        if self.token_embd.n_rows < c.vocab_size:
            raise LocalLLMError(f"token_embd.weight has fewer rows than the {c.vocab_size} tokens")

    # -- the forward pass -----------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    def size_pool(self, n_tokens: int, hard: bool) -> None:
        """Make the KV pool hold n_tokens positions (at least one context): `hard`, a sequence
        that needs a page past that waits for one (the server), else the pool grows."""
        page = self.pool.page_tokens
        self.pool.capacity = max(-(-n_tokens // page), -(-self.n_ctx // page))
        self.pool.hard = hard
        if hard:  # all of it now: zeros the OS backs as they are written (on a GPU, memory)
            self.pool.grow(self.pool.capacity)

    @property
    def kv_nbytes(self) -> int:
        """The bytes of the model's own KV cache (one full context)."""
        return self.cache.nbytes

    def hidden_states(self, token_ids, interrupt: Callable[[], None] | None = None) -> np.ndarray:
        """float32[n_tokens, dim]: the final normed hidden states of one input, run in a KV
        cache of its own (the embeddings of a causal model)."""
        cache = self.new_cache()
        try:
            return self.forward(token_ids, 0, cache=cache, interrupt=interrupt, hidden=True)
        finally:
            cache.clear()  # its pages back to the pool at once

    def new_cache(self, n_ctx: int | None = None) -> KVCache:
        """A KV cache for another sequence in the model's pool (by default of the same context
        size)."""
        return KVCache(self.pool, self.n_ctx if n_ctx is None else n_ctx)

    def forward(
        self,
        token_ids,
        start_pos: int,
        all_logits: bool = False,
        cache: KVCache | None = None,
        interrupt: Callable[[], None] | None = None,
        hidden: bool = False,
    ) -> np.ndarray:
        """Run tokens at positions start_pos.. through the model, filling the KV cache.

        Returns float32[vocab_size], the logits after the last token, or, with all_logits,
        float32[n_tokens, vocab_size] (used by tests; prefill skips the output head otherwise),
        or, with hidden, float32[n_tokens, dim]: the final normed hidden states (embeddings).
        `cache` defaults to the model's own; calls on one Transformer must not overlap, since
        they share its scratch buffers. `interrupt` is called before every layer of every chunk
        and may raise to stop a long prompt at once (Ctrl-C, a client gone): the cache then holds
        the chunks that were completed, and nothing of the one that was cut.
        """
        cache = self.cache if cache is None else cache
        token_ids = self._checked(token_ids, start_pos, cache)
        n_tokens = len(token_ids)
        if not (all_logits or hidden) and (batch := batching.current()) is not None:
            # on the server's engine: this sequence's tokens join one pass with the others'
            return batch.forward(self, token_ids, start_pos, cache, interrupt)
        cache.trim(start_pos)
        rows = []
        for first in range(0, n_tokens, self.n_batch):
            chunk = token_ids[first : first + self.n_batch]
            last_chunk = first + len(chunk) == n_tokens
            with self.backend.step(len(chunk)):  # the backend picks its threads per chunk
                cache.prepare(start_pos + first, len(chunk))
                segment = (cache, start_pos + first, 0, len(chunk))
                self._forward_chunk(chunk, [segment], interrupt)
                cache.extend(chunk)
                if hidden:
                    rows.append(self._hidden(0, len(chunk)))
                elif all_logits:
                    rows.append(self._logits(0, len(chunk)))
                elif last_chunk:
                    rows.append(self._logits(len(chunk) - 1, len(chunk))[0])
        return np.concatenate(rows) if all_logits or hidden else rows[0]

    def _checked(self, token_ids, start_pos: int, cache: KVCache) -> np.ndarray:
        """token_ids as int64, once they are known to fit the vocabulary and the cache at
        start_pos."""
        token_ids = np.asarray(token_ids, dtype=np.int64)
        n_tokens = len(token_ids)
        if n_tokens == 0:
            raise LocalLLMError("nothing to run: the prompt is empty")
        if start_pos + n_tokens > cache.n_ctx:
            raise LocalLLMError(
                f"{start_pos + n_tokens} tokens exceed the context size of {cache.n_ctx}; "
                "use a larger -c/--ctx-size or a shorter prompt"
            )
        if token_ids.min() < 0 or token_ids.max() >= self.config.vocab_size:
            raise LocalLLMError(
                f"token id out of range for a vocabulary of {self.config.vocab_size}"
            )
        if start_pos > cache.n_past:
            raise LocalLLMError(
                f"position {start_pos} leaves a gap after {cache.n_past} cached tokens"
            )
        return token_ids

    def forward_batch(self, parts: list[tuple[KVCache, int, np.ndarray, bool]]) -> list:
        """One pass for the tokens of several sequences: parts are (cache, start_pos,
        token_ids, wants_logits), at most n_batch tokens in all, each already checked by
        `_checked`. Every weight block is read once for all of them; attention runs per
        sequence on its own cache. Returns, per part, float32[vocab_size] (the logits after
        its last token) where it wants them, else None. A row's result does not depend on
        the rows beside it: a sequence gets the same logits batched as alone."""
        n_tokens = sum(len(ids) for _, _, ids, _ in parts)
        if not 0 < n_tokens <= self.n_batch:
            raise ValueError(f"a batch of {n_tokens} tokens (1..{self.n_batch})")
        segments, first = [], 0
        for cache, start_pos, ids, _ in parts:
            cache.trim(start_pos)
            cache.prepare(start_pos, len(ids))  # may raise PoolFull: nothing is run then
            segments.append((cache, start_pos, first, len(ids)))
            first += len(ids)
        token_ids = np.concatenate([ids for _, _, ids, _ in parts])
        with self.backend.step(n_tokens):
            self._forward_chunk(token_ids, segments)
            for cache, _, ids, _ in parts:
                cache.extend(ids)
            wanted = [i for i, part in enumerate(parts) if part[3]]
            out: list = [None] * len(parts)
            if wanted:
                last_rows = np.array([segments[i][2] + segments[i][3] - 1 for i in wanted])
                logits = self._logits_at(last_rows)
                for row, i in enumerate(wanted):
                    out[i] = logits[row]
        return out

    def _logits_at(self, rows: np.ndarray) -> np.ndarray:
        """Host float32[len(rows), vocab]: the logits of the given rows of the residual stream."""
        if len(rows) == rows[-1] - rows[0] + 1:  # contiguous (a prompt, or every row)
            return self._logits(int(rows[0]), int(rows[-1]) + 1)
        s = self.scratch
        self.backend.gather_rows(s.x, rows, s.o[: len(rows)])
        return self._logits(0, len(rows), s.o)

    def _hidden(self, first: int, end: int) -> np.ndarray:
        """Host float32[end - first, dim]: rows first..end-1 of the residual stream after the
        output norm, what the output head would read (llama.cpp's embeddings)."""
        b, c, s = self.backend, self.config, self.scratch
        h = b.rmsnorm(s.x[first:end], self.output_norm, c.rms_eps, s.h[: end - first])
        return b.to_host(h)

    def _logits(self, first: int, end: int, x=None) -> np.ndarray:
        """Host float32[end - first, vocab] for rows first..end-1 of the residual stream (or of
        x, rows gathered from it)."""
        b, c, s = self.backend, self.config, self.scratch
        n = end - first
        x = s.x if x is None else x
        h = b.rmsnorm(x[first:end], self.output_norm, c.rms_eps, s.h[:n])
        logits = b.to_host(b.linear(h, self.output, s.logits[:n]))
        if c.logit_scale != 1.0:  # as ggml_scale by 1 / logit_scale
            logits *= np.float32(1.0) / np.float32(c.logit_scale)
        if c.final_softcap:  # as ggml: scale by 1 / cap, tanh, scale by cap
            cap = np.float32(c.final_softcap)
            logits = np.tanh(logits * (np.float32(1.0) / cap)) * cap
        return logits

    def _forward_chunk(self, token_ids: np.ndarray, segments: list, interrupt=None) -> None:
        """Run token_ids (rows of the scratch) through every layer. segments: (cache,
        start_pos, first_row, n_rows) per sequence whose tokens these rows are, in row order."""
        b, c, s = self.backend, self.config, self.scratch
        n = len(token_ids)
        x = b.embed(self.token_embd, token_ids, s.x[:n])
        if c.embed_scale != 1.0:
            b.scale(x, c.embed_scale)
        positions = np.concatenate(
            [np.arange(start, start + rows, dtype=np.int64) for _, start, _, rows in segments]
        )
        kv = self._page_tables(segments)
        tables = {}
        attn_scale = c.attn_scale or 1.0 / math.sqrt(c.head_dim)
        for i, layer in enumerate(self.layers):
            if interrupt is not None:
                interrupt()
            window = c.window(i)
            key = (c.theta(i), window == 0)
            if key not in tables:  # sliding-window layers run unscaled (gemma3), or not (gpt-oss)
                scaling = c.rope_scaling
                if window and not c.scale_local_rope:
                    scaling = dataclasses.replace(scaling, freq_scale=1.0)
                tables[key] = b.rope_tables(
                    positions, c.rope_dim, c.theta(i), scaling, self.rope_freqs
                )
            cos, sin = tables[key] if c.rotates(i) else (None, None)
            self._attention_block(layer, i, x, segments, kv, cos, sin, window, attn_scale)
            self._ffn_block(layer, x)

    def _page_tables(self, segments: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tables, starts, first_rows) of the segments' sequences, as attention reads them:
        int32[n_seqs, pages] their page tables, int64[n_seqs] their first positions in this
        pass, int64[n_seqs + 1] their first rows (and the end)."""
        width = max(len(cache.pages) for cache, *_ in segments)
        tables = np.zeros((len(segments), width), np.int32)
        for row, (cache, *_) in enumerate(segments):
            if cache.pool is not self.pool:
                raise ValueError("a KV cache from another model's pool (use new_cache)")
            tables[row, : len(cache.pages)] = cache.pages
        starts = np.array([start for _, start, _, _ in segments], np.int64)
        ends = [first + rows for _, _, first, rows in segments]
        return tables, starts, np.array([segments[0][2], *ends], np.int64)

    def _attention_block(
        self, layer: Layer, i: int, x, segments, kv, cos, sin, window, attn_scale
    ) -> None:
        b, c, s = self.backend, self.config, self.scratch
        n = x.shape[0]
        h = x if layer.attn_norm is None else b.rmsnorm(x, layer.attn_norm, c.rms_eps, s.h[:n])
        q, k, v = b.linear_many(h, (layer.wq, layer.wk, layer.wv), (s.q[:n], s.k[:n], s.v[:n]))
        if layer.bq is not None:
            b.add_bias(q, layer.bq)
            b.add_bias(k, layer.bk)
            b.add_bias(v, layer.bv)
        q3 = q.reshape(n, c.n_heads, c.head_dim)
        k3 = k.reshape(n, c.n_kv_heads, c.head_dim)
        if c.qk_norm == "head":
            b.rmsnorm_heads(q3, layer.q_norm, c.rms_eps)
            b.rmsnorm_heads(k3, layer.k_norm, c.rms_eps)
        elif c.qk_norm == "all":
            b.rmsnorm(q, layer.q_norm, c.rms_eps, q)
            b.rmsnorm(k, layer.k_norm, c.rms_eps, k)
        if cos is not None:
            b.rope(q3, cos, sin, c.rope_neox)
            b.rope(k3, cos, sin, c.rope_neox)
        v3 = v.reshape(n, c.n_kv_heads, c.head_dim)
        if c.scale_q:
            b.scale(q, attn_scale)
            attn_scale = 1.0
        attn = s.attn[:n].reshape(n, c.n_heads, c.head_dim)
        k_pool, v_pool = self.pool.k[i], self.pool.v[i]
        for cache, start, r0, rows in segments:  # each sequence's rows into its own pages
            b.write_kv(k_pool, v_pool, cache.pages, start, k3[r0 : r0 + rows], v3[r0 : r0 + rows])
        b.attention_sequences(
            q3, k_pool, v_pool, *kv, window, attn_scale, c.attn_softcap, attn, layer.sinks
        )
        o = b.linear(s.attn[:n], layer.wo, s.o[:n])
        if layer.bo is not None:
            b.add_bias(o, layer.bo)
        if layer.post_attn_norm is not None:
            b.rmsnorm(o, layer.post_attn_norm, c.rms_eps, o)
        if c.residual_scale != 1.0:
            b.scale(o, c.residual_scale)
        b.add(x, o)

    def _ffn_block(self, layer: Layer, x) -> None:
        b, c, s = self.backend, self.config, self.scratch
        n = x.shape[0]
        h = x if layer.ffn_norm is None else b.rmsnorm(x, layer.ffn_norm, c.rms_eps, s.h[:n])
        o = self._dense_ffn(layer, h, s.o[:n]) if layer.moe is None else self._moe_ffn(layer, h)
        if layer.post_ffn_norm is not None:
            b.rmsnorm(o, layer.post_ffn_norm, c.rms_eps, o)
        if c.residual_scale != 1.0:
            b.scale(o, c.residual_scale)
        b.add(x, o)

    def _dense_ffn(self, layer: Layer, h, out):
        """out = down(act(gate(h)) * up(h)): the FFN, or a MoE's shared expert."""
        b, s = self.backend, self.scratch
        n = h.shape[0]
        gate, up = b.linear_many(h, (layer.w_gate, layer.w_up), (s.gate[:n], s.up[:n]))
        self._activate(gate, up)
        return b.linear(gate, layer.w_down, out)

    def _activate(self, gate, up) -> None:
        """gate = act(gate) * up, the config's gated activation, in place."""
        kind = self.config.activation
        if kind == "gelu":
            self.backend.gelu_mul(gate, up)
        elif kind == "swiglu_oai":
            self.backend.swiglu_oai_mul(gate, up)
        else:
            self.backend.silu_mul(gate, up)

    def _experts_of_one_token(self, moe: MoE, h, chosen, weights, rows) -> None:
        """_moe_ffn's experts for one token (decode): rows[r] = weights[r] * the FFN output of
        expert chosen[r]. Every expert takes the same input, so their gate and up matrices go in
        one linear_many (one kernel call for all of them, h quantized once), the activation in
        one call, and the down matrices, each on its own expert's activations, in one
        linear_each. The same products and roundings as the per-expert loop, in fewer calls."""
        b, s = self.backend, self.scratch
        k = len(chosen)
        gate, up = s.expert_gate[:k], s.expert_up[:k]  # row r: expert chosen[r]
        matrices = [w for e in chosen for w in moe.experts[e][:2]]
        outs = [buffer[r : r + 1] for r in range(k) for buffer in (gate, up)]
        b.linear_many(h, matrices, outs)
        biases = moe.expert_biases
        if biases is not None:
            b.add_bias_rows(gate, biases[0], chosen)
            b.add_bias_rows(up, biases[1], chosen)
        self._activate(gate, up)
        b.linear_each(gate, [moe.experts[e][2] for e in chosen], rows)
        if biases is not None:
            b.add_bias_rows(rows, biases[2], chosen)
        b.scatter_rows(rows, np.arange(k), weights, rows)

    def _experts_of_tokens(self, moe: MoE, h, chosen, weights, rows) -> None:
        """_moe_ffn's experts for a prompt's n tokens (or a batch's): rows[r * n + t] =
        weights[t, r] * the FFN output of expert chosen[t, r]. The n * k (token, rank) pairs go
        sorted by expert, the tokens' rows gathered in that order, so that each expert's are
        one span: every expert's gate and up in one linear_experts call, one activation for all
        the rows, the downs in another (llama.cpp's mul_mat_id), where a loop over the experts
        made, per expert, a gather, two activation quantizations, two matmul calls, an
        activation and a scatter, for a few tokens each. Each row's products and roundings are
        the same as its expert's alone (the logits are bit-identical)."""
        b, s = self.backend, self.scratch
        n, k = chosen.shape
        order = np.argsort(chosen, axis=None, kind="stable")  # (token, rank) pairs by expert
        by_expert = chosen.reshape(-1)[order]
        tokens, ranks = np.divmod(order, k)
        ids, starts = np.unique(by_expert, return_index=True)
        spans = np.append(starts, n * k).astype(np.int64)
        m = n * k
        x = b.gather_rows(h, tokens, s.expert_in[:m])
        gate, up = s.expert_gate[:m], s.expert_up[:m]
        b.linear_experts(x, moe.stacks[:2], ids, spans, (gate, up))
        biases = moe.expert_biases
        if biases is not None:  # per row, its expert's bias
            b.add_bias_rows(gate, biases[0], by_expert)
            b.add_bias_rows(up, biases[1], by_expert)
        self._activate(gate, up)
        y = s.expert_out[:m]
        b.linear_experts(gate, moe.stacks[2:], ids, spans, (y,))
        if biases is not None:
            b.add_bias_rows(y, biases[2], by_expert)
        b.scatter_rows(y, ranks * n + tokens, weights[tokens, ranks], rows)

    def _moe_ffn(self, layer: Layer, h):
        """The mixture of experts of llama.cpp's build_moe_ffn: router logits -> softmax -> the
        n_experts_used most probable experts of each token -> their SwiGLU FFNs, weighted by the
        (renormalized) probabilities, summed in rank order as ggml sums them; plus the shared
        expert's output times sigmoid(shared gate) where there is one.

        The routing runs on the host (n_experts values per token). Then each expert some token
        chose runs once, on the rows of the tokens that chose it (gathered): only the chosen
        experts' bytes are read, so decode speed follows the active parameters, and a prefill
        reads each chosen expert once per chunk (_experts_of_tokens; a token alone:
        _experts_of_one_token). Their
        weighted outputs land in rank-major rows of s.expert_rows (rank r of token t: row
        r * n + t), whose first block is the sum.
        """
        b, c, s = self.backend, self.config, self.scratch
        moe, k = layer.moe, c.n_experts_used
        n = h.shape[0]
        logits = b.linear(h, moe.router, s.router[:n])
        if moe.router_bias is not None:
            b.add_bias(logits, moe.router_bias)
        probs = b.to_host(logits)  # float32[n, n_experts]
        if c.expert_gating == "softmax":
            ops.softmax_rows(probs)
        chosen = np.argsort(-probs, axis=1, kind="stable")[:, :k]  # int64[n, k]
        weights = np.take_along_axis(probs, chosen, axis=1)  # float32[n, k]
        if c.expert_gating == "softmax_weight":  # a softmax over the chosen experts' logits
            ops.softmax_rows(weights)
        if c.expert_weights_norm:
            total = weights.sum(axis=1, dtype=np.float64, keepdims=True).astype(np.float32)
            weights = weights / total
        if c.expert_weights_scale not in (0.0, 1.0):
            weights = weights * np.float32(c.expert_weights_scale)
        rows = s.expert_rows[: k * n]
        if n == 1:
            self._experts_of_one_token(moe, h, chosen[0], weights[0], rows)
        else:
            self._experts_of_tokens(moe, h, chosen, weights, rows)
        o = rows[:n]
        for rank in range(1, k):
            b.add(o, rows[rank * n : (rank + 1) * n])
        if moe.shared_gate is not None:
            shared = self._dense_ffn(layer, h, s.shared[:n])
            g = b.to_host(b.linear(h, moe.shared_gate, s.shared_gate[:n]))[:, 0]
            # sigmoid as llama.cpp's qwen2moe graph computes it: silu(g) / g
            sigmoid = g / (np.float32(1.0) + np.exp(-g)) / g
            b.scatter_rows(shared, np.arange(n), sigmoid, shared)
            b.add(o, shared)
        return o
