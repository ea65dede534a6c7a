"""Model hyperparameters read from GGUF metadata (`{arch}.block_count`, ...)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from localllm.errors import LocalLLMError


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model's shape."""

    arch: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    n_ctx_train: int
    rms_eps: float
    rope_theta: float
    rope_dim: int
    rope_neox: bool  # rotate (i, i + d/2) instead of adjacent pairs
    rope_freq_scale: float = 1.0
    activation: str = "silu"  # "silu" (SwiGLU) or "gelu" (GeGLU, tanh approximation)
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(dim))
    attn_scale: float = 0.0  # 0 means 1 / sqrt(head_dim)
    # Per layer: attention window (0 = global) and RoPE base; empty means global / rope_theta.
    layer_windows: tuple[int, ...] = field(default_factory=tuple)
    layer_rope_theta: tuple[float, ...] = field(default_factory=tuple)

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def theta(self, layer: int) -> float:
        return self.layer_rope_theta[layer] if self.layer_rope_theta else self.rope_theta


def meta(metadata: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value, or a clear error when a required key is missing."""
    if key in metadata:
        return metadata[key]
    if default is None:
        raise LocalLLMError(
            f"the model file lacks the metadata key {key!r}; is it a complete GGUF?"
        )
    return default


def int_meta(metadata: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = meta(metadata, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LocalLLMError(f"metadata {key} should be a positive integer, got {value!r}")
    return value


def base_config(
    metadata: Mapping[str, Any], arch: str, vocab_size: int, **overrides
) -> ModelConfig:
    """The fields every llama-like architecture stores under the same keys."""
    dim = int_meta(metadata, f"{arch}.embedding_length")
    n_heads = int_meta(metadata, f"{arch}.attention.head_count")
    head_dim = int_meta(metadata, f"{arch}.attention.key_length", dim // n_heads)
    n_kv_heads = int_meta(metadata, f"{arch}.attention.head_count_kv", n_heads)
    if n_heads % n_kv_heads:
        raise LocalLLMError(
            f"{n_heads} attention heads cannot be grouped over {n_kv_heads} KV heads"
        )
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))
    values = dict(
        arch=arch,
        n_layers=int_meta(metadata, f"{arch}.block_count"),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=int_meta(metadata, f"{arch}.feed_forward_length"),
        vocab_size=vocab_size,
        n_ctx_train=int_meta(metadata, f"{arch}.context_length", 2048),
        rms_eps=float(meta(metadata, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta(metadata, f"{arch}.rope.freq_base", 10000.0)),
        rope_dim=int_meta(metadata, f"{arch}.rope.dimension_count", head_dim),
        rope_neox=False,
        rope_freq_scale=1.0 / factor if scaling == "linear" and factor > 0 else 1.0,
    )
    values.update(overrides)
    return ModelConfig(**values)
