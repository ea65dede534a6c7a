"""Gemma 3: the llama block plus QK-norm, post-attention and post-MLP norms, GeGLU, embeddings
scaled by sqrt(dim), and interleaved sliding-window (local) and global layers.

Five local layers with RoPE base 10,000 and a window of `sliding_window` tokens alternate with one
global layer using `rope.freq_base` (and the linear RoPE scaling, when the file gives one), as in
llama.cpp's gemma3 graph. RMSNorm weights in the GGUF already include Gemma's +1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from localllm.models.config import ModelConfig, base_config, int_meta

SWA_PATTERN = 6  # layer i is global when (i + 1) % 6 == 0
ROPE_THETA_LOCAL = 10000.0


def gemma3_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    config = base_config(
        metadata, "gemma3", vocab_size, rope_neox=True, activation="gelu", qk_norm=True
    )
    window = int_meta(metadata, "gemma3.attention.sliding_window", 4096)
    theta_local = float(metadata.get("gemma3.rope.freq_base_swa", ROPE_THETA_LOCAL))
    is_local = [(i + 1) % SWA_PATTERN != 0 for i in range(config.n_layers)]
    return ModelConfig(
        **{
            **config.__dict__,
            "embed_scale": math.sqrt(config.dim),
            "layer_windows": tuple(window if local else 0 for local in is_local),
            "layer_rope_theta": tuple(
                theta_local if local else config.rope_theta for local in is_local
            ),
        }
    )
