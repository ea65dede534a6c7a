"""Llama-family architectures: llama (Llama 2/3, Mistral, TinyLlama, SmolLM2), qwen2, qwen3,
granite, smollm3, and the Qwen mixtures of experts qwen3moe and qwen2moe.

They share one block: pre-RMSNorm, GQA attention with RoPE, SwiGLU MLP. Qwen2 adds Q/K/V
biases, which the transformer picks up from the tensors present, and uses NeoX-style RoPE.
Qwen3 drops the biases and normalizes each head of q and k (RMSNorm over head_dim) before RoPE.
Llama 3.1+ files carry rope_freqs.weight (the transformer applies it when present); linear and
YaRN scaling come from the rope.scaling.* metadata (config.rope_scaling).

Granite (IBM Granite 3.x) scales four things, as llama.cpp's granite graph does: embeddings by
`embedding_scale`, the attention scores by `attention.scale` (instead of 1 / sqrt(head_dim)),
each sub-block's output by `residual_scale` before it joins the residual stream, and the logits
by 1 / `logit_scale`; `rope.scaling.finetuned` false turns RoPE off. SmolLM3 leaves q and k
unrotated in every 4th layer (layers 3, 7, ...): llama.cpp's n_no_rope_layer_step, a constant
(no metadata key holds it).

qwen3moe (Qwen3-30B-A3B) is qwen3 with a MoE FFN whose chosen experts' weights are renormalized
to sum 1; qwen2moe (Qwen1.5/2-MoE) is qwen2 with a MoE FFN (weights not renormalized) plus a
shared expert of `expert_shared_feed_forward_length`, gated by a sigmoid: as llama.cpp's graphs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from localllm.models.config import ModelConfig, base_config, int_meta, meta, moe_config

SMOLLM3_NO_ROPE_LAYER_STEP = 4


def llama_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    return base_config(metadata, "llama", vocab_size, rope_neox=False)


def mistral_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    return base_config(metadata, "mistral", vocab_size, rope_neox=False)


def qwen2_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    return base_config(metadata, "qwen2", vocab_size, rope_neox=True)


def qwen3_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    return base_config(metadata, "qwen3", vocab_size, rope_neox=True, qk_norm="head")


def granite_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    config = base_config(metadata, "granite", vocab_size, rope_neox=False)

    def scale(key: str) -> float:  # 0 or absent: llama.cpp leaves that scaling out
        return float(metadata.get(f"granite.{key}", 0.0)) or 1.0

    rope = bool(metadata.get("granite.rope.scaling.finetuned", True))
    return dataclasses.replace(
        config,
        embed_scale=scale("embedding_scale"),
        attn_scale=float(metadata.get("granite.attention.scale", 0.0)),
        residual_scale=scale("residual_scale"),
        logit_scale=float(meta(metadata, "granite.logit_scale")) or 1.0,
        layer_rope=() if rope else (False,) * config.n_layers,
    )


def smollm3_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    config = base_config(metadata, "smollm3", vocab_size, rope_neox=False)
    step = SMOLLM3_NO_ROPE_LAYER_STEP
    return dataclasses.replace(
        config, layer_rope=tuple((i + 1) % step != 0 for i in range(config.n_layers))
    )


def qwen3moe_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    config = base_config(metadata, "qwen3moe", vocab_size, rope_neox=True, qk_norm="head")
    return moe_config(metadata, "qwen3moe", config, expert_weights_norm=True)


def qwen2moe_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    config = base_config(metadata, "qwen2moe", vocab_size, rope_neox=True)
    shared = int_meta(metadata, "qwen2moe.expert_shared_feed_forward_length", config.ffn_dim)
    return moe_config(metadata, "qwen2moe", config, ffn_dim=shared)
