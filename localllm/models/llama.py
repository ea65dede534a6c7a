"""Llama-family architectures: llama (Llama 2/3, Mistral, TinyLlama, SmolLM2), qwen2, qwen3.

They share one block: pre-RMSNorm, GQA attention with RoPE, SwiGLU MLP. Qwen2 adds Q/K/V
biases, which the transformer picks up from the tensors present, and uses NeoX-style RoPE.
Qwen3 drops the biases and normalizes each head of q and k (RMSNorm over head_dim) before RoPE.
Llama 3.1+ files carry rope_freqs.weight (the transformer applies it when present); linear and
YaRN scaling come from the rope.scaling.* metadata (config.rope_scaling).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from localllm.models.config import ModelConfig, base_config


def llama_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    return base_config(metadata, "llama", vocab_size, rope_neox=False)


def mistral_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    return base_config(metadata, "mistral", vocab_size, rope_neox=False)


def qwen2_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    return base_config(metadata, "qwen2", vocab_size, rope_neox=True)


def qwen3_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    return base_config(metadata, "qwen3", vocab_size, rope_neox=True, qk_norm=True)
