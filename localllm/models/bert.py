"""The embedding encoders: BERT (bge, all-MiniLM, mxbai-embed) and nomic-bert (nomic-embed-text),
as llama.cpp's bert graph runs them (models/encoder.py runs these configs).

Both: token embeddings plus the first token type's ("sentence A"), a LayerNorm of the sum
(token_embd_norm), then per layer bidirectional attention and an MLP, each added to its input
and LayerNorm-ed after the add (attn_output_norm, layer_output_norm), every norm with a bias and
`attention.layer_norm_epsilon`. No final norm, no output head: the last layer's states are the
token embeddings, pooled as `pooling_type` says (embeddings.py).

- bert: learned absolute position embeddings (position_embd, one row per position up to the
  training context) and no RoPE; separate q/k/v with biases, an attention output bias; a GELU
  MLP (ffn_up, ffn_down, with biases).
- nomic-bert: no position embeddings but NeoX RoPE of base `rope.freq_base` on q and k; one
  fused attn_qkv; a SwiGLU MLP (ffn_gate, ffn_up, ffn_down); no biases on the matrices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from localllm.models.config import ModelConfig, base_config, meta


def _encoder_config(metadata: Mapping[str, Any], arch: str, vocab_size: int, **fields):
    config = base_config(metadata, arch, vocab_size, rope_neox=True, causal=False, **fields)
    eps = float(meta(metadata, f"{arch}.attention.layer_norm_epsilon", 1e-12))
    return dataclasses.replace(config, norm_eps=eps)


def bert_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    config = _encoder_config(metadata, "bert", vocab_size, activation="gelu")
    return dataclasses.replace(config, layer_rope=(False,) * config.n_layers)


def nomic_bert_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    return _encoder_config(metadata, "nomic-bert", vocab_size, activation="silu")
