"""The encoder that embedding models (bert, nomic-bert: models/bert.py) run on.

It is not a hook on the decoder's Transformer because little of that one's pass applies: a
decoder runs chunks of tokens through every layer and keeps their K/V in a cache for the tokens
after them, while an encoder's attention is bidirectional, so each layer needs the whole input
at once, and there is nothing after it to cache for. Its norms are LayerNorms with biases after
the residual adds rather than RMSNorms before the sub-blocks, its input adds position and token
type embeddings and is normalized, and what comes out is hidden states, not logits. The pieces
are the backend's, the same matmuls, RoPE and attention kernel as the decoder's (attention with
causal=False over float32 K and V, as llama.cpp's cache-less graph computes it).

Weights are views into the map; the activation buffers for a whole context are allocated once,
here. One `hidden_states` call is one pass over one input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from localllm.errors import LocalLLMError
from localllm.gguf import GGUFFile
from localllm.models.config import ModelConfig


@dataclass
class EncoderLayer:
    wq: object
    wk: object
    wv: object
    wo: object
    attn_norm: tuple  # attn_output_norm (weight, bias): float32[dim] each
    w_up: object
    w_down: object
    out_norm: tuple  # layer_output_norm (weight, bias)
    w_gate: object = None  # SwiGLU MLP (nomic-bert); None: a GELU MLP (bert)
    bq: np.ndarray | None = None  # float32[dim]
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    bo: np.ndarray | None = None
    b_up: np.ndarray | None = None  # float32[ffn_dim]
    b_down: np.ndarray | None = None  # float32[dim]


class EncoderScratch:
    """Activation buffers for one input of up to n_ctx tokens (pages are touched as used)."""

    def __init__(self, config: ModelConfig, n_ctx: int, zeros):
        c = config
        self.x = zeros((n_ctx, c.dim))  # residual stream
        self.o = zeros((n_ctx, c.dim))  # sub-block output (and the position embeddings)
        self.q = zeros((n_ctx, c.n_heads * c.head_dim))
        self.k = zeros((n_ctx, c.n_kv_heads * c.head_dim))  # float32 K and V: no cache
        self.v = zeros((n_ctx, c.n_kv_heads * c.head_dim))
        self.attn = zeros((n_ctx, c.n_heads * c.head_dim))
        self.gate = zeros((n_ctx, c.ffn_dim))
        self.up = zeros((n_ctx, c.ffn_dim))


class Encoder:
    """Weights (views into the GGUF map) and scratch buffers of a bidirectional encoder."""

    kv_nbytes = 0  # no KV cache

    def __init__(self, gguf: GGUFFile, config: ModelConfig, backend, n_ctx: int):
        self.config = config
        self.backend = backend
        self._tensors = gguf.tensors
        b, c = backend, config
        self.token_embd = b.weight(self._tensor("token_embd.weight"))
        self.position_embd = None
        positions = self._tensors.get("position_embd.weight")
        if positions is not None:  # bert: one learned row per position
            self.position_embd = b.weight(positions)
            # the table ends the context: no position beyond its rows
            n_ctx = min(n_ctx, self.position_embd.n_rows)
        self.n_ctx = n_ctx
        # token type 0 ("sentence A"), as llama.cpp adds to every token: one row, made at load
        self.type_row = None
        types = self._tensors.get("token_types.weight")
        if types is not None:
            self.type_row = b.zeros((1, c.dim))
            b.embed(b.weight(types), np.zeros(1, np.int64), self.type_row)
        self.embd_norm = self._norm("token_embd_norm")
        self.layers = [self._layer(i) for i in range(c.n_layers)]
        self._check_shapes()
        self.scratch = EncoderScratch(c, n_ctx, b.zeros)

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

    def _norm(self, name: str) -> tuple:
        b = self.backend
        return b.vector(self._tensor(name + ".weight")), b.vector(self._tensor(name + ".bias"))

    def _qkv(self, p: str) -> tuple[list, list]:
        """([wq, wk, wv], [bq, bk, bv]): separate tensors (bert) or row views of a fused
        attn_qkv and slices of its bias (nomic-bert)."""
        b, c = self.backend, self.config
        if p + "attn_qkv.weight" not in self._tensors:
            weights = [b.weight(self._tensor(p + f"attn_{x}.weight")) for x in "qkv"]
            return weights, [self._optional_vector(p + f"attn_{x}.bias") for x in "qkv"]
        fused = self._tensor(p + "attn_qkv.weight")
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        sizes = (q_dim, kv_dim, kv_dim)
        if len(fused.shape) != 2 or fused.shape[0] != sum(sizes):
            raise LocalLLMError(
                f"tensor {fused.name} has shape {fused.shape}, which does not fit the model's "
                f"metadata ({' + '.join(map(str, sizes))} rows); the file is inconsistent"
            )
        starts = np.cumsum((0, *sizes))
        weights = [
            b.weight(fused.rows(int(start), int(start + size), f"{fused.name}[{part}]"))
            for start, size, part in zip(starts, sizes, "qkv", strict=False)
        ]
        bias = self._optional_vector(p + "attn_qkv.bias")
        if bias is None:
            return weights, [None, None, None]
        return weights, [bias[int(s) : int(s + n)] for s, n in zip(starts, sizes, strict=False)]

    def _layer(self, i: int) -> EncoderLayer:
        b, p = self.backend, f"blk.{i}."
        (wq, wk, wv), (bq, bk, bv) = self._qkv(p)
        gate = self._tensors.get(p + "ffn_gate.weight")
        return EncoderLayer(
            wq=wq,
            wk=wk,
            wv=wv,
            wo=b.weight(self._tensor(p + "attn_output.weight")),
            attn_norm=self._norm(p + "attn_output_norm"),
            w_up=b.weight(self._tensor(p + "ffn_up.weight")),
            w_down=b.weight(self._tensor(p + "ffn_down.weight")),
            out_norm=self._norm(p + "layer_output_norm"),
            w_gate=None if gate is None else b.weight(gate),
            bq=bq,
            bk=bk,
            bv=bv,
            bo=self._optional_vector(p + "attn_output.bias"),
            b_up=self._optional_vector(p + "ffn_up.bias"),
            b_down=self._optional_vector(p + "ffn_down.bias"),
        )

    def _check_shapes(self) -> None:
        """Fail at load, with the tensor's name, rather than inside a kernel."""
        c = self.config
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        expected = [(self.token_embd, c.dim, None)]
        if self.position_embd is not None:
            expected.append((self.position_embd, c.dim, None))
        for layer in self.layers:
            expected += [
                (layer.wq, c.dim, q_dim),
                (layer.wk, c.dim, kv_dim),
                (layer.wv, c.dim, kv_dim),
                (layer.wo, q_dim, c.dim),
                (layer.w_up, c.dim, c.ffn_dim),
                (layer.w_down, c.ffn_dim, c.dim),
            ]
            if layer.w_gate is not None:
                expected.append((layer.w_gate, c.dim, c.ffn_dim))
        for w, n_cols, n_rows in expected:
            if w.n_cols != n_cols or (n_rows is not None and w.n_rows != n_rows):
                raise LocalLLMError(
                    f"tensor {w.name} has shape ({w.n_rows}, {w.n_cols}), which does not fit the "
                    f"model's metadata; the file is inconsistent"
                )
        if self.token_embd.n_rows < c.vocab_size:
            raise LocalLLMError(f"token_embd.weight has fewer rows than the {c.vocab_size} tokens")

    # -- the pass ---------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        """Decoding: refused, an encoder predicts no next token."""
        raise LocalLLMError(
            f"this {self.config.arch} file is an embedding model: it makes embeddings "
            "(localllm serve: /v1/embeddings, /api/embed), not text"
        )

    def hidden_states(self, token_ids, interrupt: Callable[[], None] | None = None) -> np.ndarray:
        """float32[n_tokens, dim]: the last layer's state of every token of one input, each
        having seen all the others (llama.cpp's token embeddings, before pooling)."""
        c, b, s = self.config, self.backend, self.scratch
        token_ids = np.asarray(token_ids, dtype=np.int64)
        n = len(token_ids)
        if n == 0:
            raise LocalLLMError("cannot embed an empty input")
        if n > self.n_ctx:
            raise LocalLLMError(f"the input is {n} tokens, more than the context of {self.n_ctx}")
        if token_ids.min() < 0 or token_ids.max() >= c.vocab_size:
            raise LocalLLMError(f"token id out of range for a vocabulary of {c.vocab_size}")
        positions = np.arange(n, dtype=np.int64)
        with b.step(n):
            x = b.embed(self.token_embd, token_ids, s.x[:n])
            if self.type_row is not None:
                b.add_bias(x, self.type_row[0])
            if self.position_embd is not None:
                b.add(x, b.embed(self.position_embd, positions, s.o[:n]))
            b.layernorm(x, *self.embd_norm, c.norm_eps, x)
            cos = sin = None
            if c.rotates(0):
                cos, sin = b.rope_tables(positions, c.rope_dim, c.rope_theta, c.rope_scaling, None)
            for layer in self.layers:
                if interrupt is not None:
                    interrupt()
                self._attention_block(layer, x, cos, sin)
                self._ffn_block(layer, x)
            return b.to_host(x)

    def _attention_block(self, layer: EncoderLayer, x, cos, sin) -> None:
        """x = LayerNorm(x + wo(attention(x)) + bo): post-norm, every token over every token."""
        b, c, s = self.backend, self.config, self.scratch
        n = x.shape[0]
        q, k, v = b.linear_many(x, (layer.wq, layer.wk, layer.wv), (s.q[:n], s.k[:n], s.v[:n]))
        for y, bias in ((q, layer.bq), (k, layer.bk), (v, layer.bv)):
            if bias is not None:
                b.add_bias(y, bias)
        q3 = q.reshape(n, c.n_heads, c.head_dim)
        k3 = k.reshape(n, c.n_kv_heads, c.head_dim)
        v3 = v.reshape(n, c.n_kv_heads, c.head_dim)
        if cos is not None:
            b.rope(q3, cos, sin, c.rope_neox)
            b.rope(k3, cos, sin, c.rope_neox)
        attn = s.attn[:n].reshape(n, c.n_heads, c.head_dim)
        scale = c.attn_scale or 1.0 / np.sqrt(c.head_dim)
        b.attention(q3, k3, v3, 0, 0, scale, 0.0, attn, causal=False)
        o = b.linear(s.attn[:n], layer.wo, s.o[:n])
        if layer.bo is not None:
            b.add_bias(o, layer.bo)
        b.add(x, o)
        b.layernorm(x, *layer.attn_norm, c.norm_eps, x)

    def _ffn_block(self, layer: EncoderLayer, x) -> None:
        """x = LayerNorm(x + MLP(x)): GELU (bert, with biases) or SwiGLU (nomic-bert)."""
        b, c, s = self.backend, self.config, self.scratch
        n = x.shape[0]
        if layer.w_gate is None:
            h = b.linear(x, layer.w_up, s.up[:n])
            if layer.b_up is not None:
                b.add_bias(h, layer.b_up)
            b.gelu(h)
        else:
            h, up = b.linear_many(x, (layer.w_gate, layer.w_up), (s.gate[:n], s.up[:n]))
            if c.activation == "gelu":
                b.gelu_mul(h, up)
            else:
                b.silu_mul(h, up)
        o = b.linear(h, layer.w_down, s.o[:n])
        if layer.b_down is not None:
            b.add_bias(o, layer.b_down)
        b.add(x, o)
        b.layernorm(x, *layer.out_norm, c.norm_eps, x)
