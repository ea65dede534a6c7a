"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): the llama block with fused projections and LongRoPE.

- attn_qkv holds Q, K and V as one matrix and ffn_up the gate and up halves of the MLP (no
  ffn_gate): the transformer splits them into row views of the mapped tensors.
- LongRoPE: rope_factors_long / rope_factors_short divide the angles of each pair; the
  transformer picks one by the context size, as llama.cpp does, and cos/sin are multiplied by
  `rope.scaling.attn_factor` (the converter's sqrt(1 + ln(scale) / ln(original context))).
- NeoX RoPE; q is scaled by 1 / sqrt(head_dim) before q.k, as llama.cpp's phi3 graph does.
- `attention.sliding_window` is read by llama.cpp but not applied ("Phi SWA is currently
  disabled", llama.cpp PR 13676): every layer attends globally, so that outputs match it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from localllm.models.config import ModelConfig, base_config


def phi3_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    return base_config(metadata, "phi3", vocab_size, rope_neox=True, scale_q=True)
