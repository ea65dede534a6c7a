"""Model hyperparameters read from GGUF metadata (`{arch}.block_count`, ...)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from localllm.errors import LocalLLMError
from localllm.ops import RopeScaling

ROPE_SCALING_TYPES = ("none", "linear", "yarn")


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
    rope_scaling: RopeScaling = RopeScaling()  # linear / YaRN context extension (global layers)
    # whether sliding-window layers are scaled too (gpt-oss); gemma3's local layers run unscaled
    scale_local_rope: bool = False
    # "silu" (SwiGLU), "gelu" (GeGLU, tanh approximation) or "swiglu_oai" (gpt-oss's clamped
    # SwiGLU, ops.swiglu_oai)
    activation: str = "silu"
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(dim))
    attn_scale: float = 0.0  # 0 means 1 / sqrt(head_dim)
    # q is multiplied by the attention scale before q.k, rather than the scores after (llama.cpp
    # scales Qcur so for phi3 and gemma2; the f16 rounding of q then comes after the scale)
    scale_q: bool = False
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) before the softmax (gemma2)
    final_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) (gemma2)
    # Mixture of experts (0 experts: a dense FFN). Each token's router logits go through a
    # softmax; its n_experts_used best experts (SwiGLU FFNs of expert_ffn_dim) run, their outputs
    # weighted by those probabilities, renormalized to sum 1 where expert_weights_norm (qwen3moe)
    # and multiplied by expert_weights_scale where it is set. A shared expert (qwen2moe: its
    # width is ffn_dim) adds its output, gated by a sigmoid, when the file has one.
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    expert_weights_norm: bool = False
    expert_weights_scale: float = 0.0  # 0: not scaled
    # "softmax": the router's probabilities weight the chosen experts; "softmax_weight"
    # (gpt-oss): the experts are chosen by their logits, and a softmax over the chosen ones'
    # logits weights them (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT)
    expert_gating: str = "softmax"
    # rope.scaling.original_context_length (default: the training context): LongRoPE uses its
    # long factors when the context is larger
    n_ctx_orig: int = 0
    # RMSNorm of q and k before RoPE (attn_q_norm, attn_k_norm): "head" normalizes each head
    # (qwen3, gemma3), "all" the whole q and k of a token across its heads (olmo2)
    qk_norm: str = "none"
    pre_norm: bool = True  # attn_norm / ffn_norm before each sub-block (olmo2 has none)
    # the tensor of the norm before the FFN: gpt-oss names it post_attention_norm (llama.cpp's
    # attn_post_norm, applied to the FFN's input), where gemma's is an attention output norm
    ffn_norm_tensor: str = "ffn_norm"
    residual_scale: float = 1.0  # sub-block outputs are multiplied by it before the add (granite)
    logit_scale: float = 1.0  # logits are divided by it (granite)
    # Per layer: attention window (0 = global) and RoPE base; empty means global / rope_theta.
    layer_windows: tuple[int, ...] = field(default_factory=tuple)
    layer_rope_theta: tuple[float, ...] = field(default_factory=tuple)
    # Per layer: whether q and k are rotated (smollm3 leaves every 4th layer unrotated); empty
    # means every layer
    layer_rope: tuple[bool, ...] = field(default_factory=tuple)
    # False: an encoder (bert, nomic-bert), run by models/encoder.py: bidirectional attention
    # over the whole input, LayerNorms (with biases, epsilon norm_eps) after the residual adds,
    # and hidden states out rather than logits; an embedding model, which generates no text
    causal: bool = True
    norm_eps: float = 0.0  # the encoders' LayerNorm epsilon (attention.layer_norm_epsilon)

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def theta(self, layer: int) -> float:
        return self.layer_rope_theta[layer] if self.layer_rope_theta else self.rope_theta

    def rotates(self, layer: int) -> bool:
        return self.layer_rope[layer] if self.layer_rope else True


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
    n_ctx_train = int_meta(metadata, f"{arch}.context_length", 2048)
    values = dict(
        arch=arch,
        n_layers=int_meta(metadata, f"{arch}.block_count"),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=int_meta(metadata, f"{arch}.feed_forward_length"),
        vocab_size=vocab_size,
        n_ctx_train=n_ctx_train,
        rms_eps=float(meta(metadata, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta(metadata, f"{arch}.rope.freq_base", 10000.0)),
        rope_dim=int_meta(metadata, f"{arch}.rope.dimension_count", head_dim),
        rope_neox=False,
        rope_scaling=rope_scaling(metadata, arch, n_ctx_train),
        n_ctx_orig=int_meta(metadata, f"{arch}.rope.scaling.original_context_length", n_ctx_train),
    )
    values.update(overrides)
    return ModelConfig(**values)


def rope_scaling(metadata: Mapping[str, Any], arch: str, n_ctx_train: int) -> RopeScaling:
    """RoPE scaling as llama.cpp reads and applies it (llama_model::load_hparams, then the
    context's yarn parameters in llama_context's constructor), in float32 as it computes them.

    The type defaults to linear, so a factor without a type scales linearly; "none" never
    scales. YaRN mixes extrapolated angles back in (ext_factor 1) between the correction dims of
    beta_fast 32 and beta_slow 1 over `rope.scaling.original_context_length` (default: the
    training context). llama.cpp reads no rope.scaling.yarn_* keys for these architectures, so
    neither does this. Its magnitude factor get_mscale(factor) is cancelled against the one ggml
    applies again inside the rope (llama.cpp PR 17945), leaving `rope.scaling.attn_factor`.
    """
    f32 = np.float32
    kind = metadata.get(f"{arch}.rope.scaling.type", "linear")
    if kind not in ROPE_SCALING_TYPES:
        raise LocalLLMError(
            f"unsupported RoPE scaling type {kind!r} ({arch}.rope.scaling.type); "
            f"supported: {', '.join(ROPE_SCALING_TYPES)}"
        )
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if factor is None:
        factor = metadata.get(f"{arch}.rope.scale_linear", 0.0)  # the old key
    freq_scale = f32(1.0) if float(factor) == 0.0 else f32(f32(1.0) / f32(factor))
    if kind == "none":
        freq_scale = f32(1.0)
    attn_factor = f32(metadata.get(f"{arch}.rope.scaling.attn_factor", 1.0))
    if kind != "yarn":
        return RopeScaling(freq_scale=float(freq_scale), attn_factor=float(attn_factor))
    n_ctx_orig = int_meta(metadata, f"{arch}.rope.scaling.original_context_length", n_ctx_train)
    factor = f32(f32(1.0) / freq_scale)
    log_factor = f32(math.log(factor))
    mscale = f32(1.0) if factor <= 1.0 else f32(f32(f32(0.1) * log_factor) + f32(1.0))
    yarn_attn = f32(mscale * f32(f32(1.0) / f32(f32(1.0) + f32(f32(0.1) * log_factor))))
    return RopeScaling(
        freq_scale=float(freq_scale),
        ext_factor=1.0,
        attn_factor=float(f32(yarn_attn * attn_factor)),
        n_ctx_orig=n_ctx_orig,
    )


def moe_config(
    metadata: Mapping[str, Any], arch: str, config: ModelConfig, **fields
) -> ModelConfig:
    """The MoE fields llama.cpp reads for every MoE architecture ({arch}.expert_*)."""
    n_experts = int_meta(metadata, f"{arch}.expert_count")
    n_used = int_meta(metadata, f"{arch}.expert_used_count")
    if n_used > n_experts:
        raise LocalLLMError(f"{arch}.expert_used_count {n_used} exceeds expert_count {n_experts}")
    # llama.cpp's default expert width: feed_forward_length / expert_used_count
    default_width = max(1, config.ffn_dim // n_used)
    return dataclasses.replace(
        config,
        n_experts=n_experts,
        n_experts_used=n_used,
        expert_ffn_dim=int_meta(metadata, f"{arch}.expert_feed_forward_length", default_width),
        expert_weights_scale=float(metadata.get(f"{arch}.expert_weights_scale", 0.0)),
        **fields,
    )
