"""Gemma 2 and Gemma 3: the llama block plus post-attention and post-MLP norms, GeGLU,
embeddings scaled by sqrt(dim), and interleaved sliding-window (local) and global layers.
RMSNorm weights in the GGUF already include Gemma's +1.

Gemma 2 (llama.cpp's gemma2 graph): local and global layers alternate (layer i is local when
i % `attention.sliding_window_pattern` < pattern - 1, pattern 2 by default: the even layers),
window `attention.sliding_window` (4096 by default), one RoPE base for both. Attention scores are
softcapped (`attn_logit_softcapping`, 50 by default) and so are the final logits
(`final_logit_softcapping`, 30). q is scaled before q.k by 1 / sqrt(head_dim), or for the 27B
(46 layers) by 1 / sqrt(dim / n_heads): llama.cpp's reading of query_pre_attn_scalar, which the
converter does not store.

Gemma 3: QK-norm, no softcapping; five local layers with RoPE base 10,000 (and no RoPE scaling)
and a window of `sliding_window` tokens alternate with one global layer using `rope.freq_base`
(and the linear RoPE scaling, when the file gives one).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from localllm.models.config import ModelConfig, base_config, int_meta

GEMMA3_SWA_PATTERN = 6  # layer i is global when (i + 1) % 6 == 0
GEMMA3_ROPE_THETA_LOCAL = 10000.0
GEMMA2_SWA_PATTERN = 2
GEMMA2_27B_LAYERS = 46


def gemma2_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    config = base_config(metadata, "gemma2", vocab_size, rope_neox=True, activation="gelu")
    pattern = int_meta(metadata, "gemma2.attention.sliding_window_pattern", GEMMA2_SWA_PATTERN)
    window = int_meta(metadata, "gemma2.attention.sliding_window", 4096)
    theta_local = float(metadata.get("gemma2.rope.freq_base_swa", config.rope_theta))
    is_local = [i % pattern < pattern - 1 for i in range(config.n_layers)]
    if config.n_layers == GEMMA2_27B_LAYERS:
        attn_scale = 1.0 / math.sqrt(config.dim // config.n_heads)
    else:
        attn_scale = 1.0 / math.sqrt(config.head_dim)
    return dataclasses.replace(
        config,
        embed_scale=math.sqrt(config.dim),
        attn_scale=attn_scale,
        scale_q=True,
        attn_softcap=float(metadata.get("gemma2.attn_logit_softcapping", 50.0)),
        final_softcap=float(metadata.get("gemma2.final_logit_softcapping", 30.0)),
        layer_windows=tuple(window if local else 0 for local in is_local),
        layer_rope_theta=tuple(theta_local if local else config.rope_theta for local in is_local),
    )


def gemma3_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    config = base_config(
        metadata, "gemma3", vocab_size, rope_neox=True, activation="gelu", qk_norm="head"
    )
    window = int_meta(metadata, "gemma3.attention.sliding_window", 4096)
    theta_local = float(metadata.get("gemma3.rope.freq_base_swa", GEMMA3_ROPE_THETA_LOCAL))
    is_local = [(i + 1) % GEMMA3_SWA_PATTERN != 0 for i in range(config.n_layers)]
    return dataclasses.replace(
        config,
        embed_scale=math.sqrt(config.dim),
        layer_windows=tuple(window if local else 0 for local in is_local),
        layer_rope_theta=tuple(theta_local if local else config.rope_theta for local in is_local),
    )
