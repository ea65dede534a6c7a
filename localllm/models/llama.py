"""Llama-family architectures: llama (Llama 2/3, Mistral, TinyLlama, SmolLM2) and qwen2.

They share one block: pre-RMSNorm, GQA attention with RoPE, SwiGLU MLP. Qwen2 adds Q/K/V
biases, which the transformer picks up from the tensors present, and uses NeoX-style RoPE.
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
