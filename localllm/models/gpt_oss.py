"""gpt-oss (gpt-oss-20b, gpt-oss-120b): llama.cpp's openai-moe graph on the one Transformer.

Pre-RMSNorm GQA attention with q/k/v/output biases and a learned sink logit per head
(`attn_sinks`: one more term in each softmax, weighting no value), NeoX RoPE with YaRN
(rope.scaling.*, on every layer), and sliding-window layers (`attention.sliding_window`, 128)
alternating with global ones: the even layers are local, as llama.cpp's set_swa_pattern(2).
The FFN is a mixture of experts whose norm is the file's `post_attention_norm`: a router with
a bias picks `expert_used_count` experts by their logits and weights them by a softmax over
those logits only; each expert (with biases on all three matrices) runs the clamped SwiGLU of
ops.swiglu_oai. The experts are MXFP4 in the files OpenAI and the converter publish.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from localllm.models.config import ModelConfig, base_config, int_meta, moe_config

ARCH = "gpt-oss"
SWA_PATTERN = 2  # layer i is local when i % 2 < 1


def gpt_oss_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    config = base_config(metadata, ARCH, vocab_size, rope_neox=True)
    window = int_meta(metadata, f"{ARCH}.attention.sliding_window", 128)
    local = [i % SWA_PATTERN < SWA_PATTERN - 1 for i in range(config.n_layers)]
    config = dataclasses.replace(
        config,
        activation="swiglu_oai",
        ffn_norm_tensor="post_attention_norm",
        scale_local_rope=True,
        layer_windows=tuple(window if is_local else 0 for is_local in local),
    )
    return moe_config(metadata, ARCH, config, expert_gating="softmax_weight")
