"""OLMo 2: no norms before the sub-blocks; RMSNorm of each sub-block's output (post-attention and
post-FFN norms) before it joins the residual stream, and of the whole q and k of a token, across
its heads (attn_q_norm: float32[n_heads * head_dim]), before NeoX RoPE. An untied output head.

llama.cpp's olmo2 graph also runs OLMo 3's sliding-window layers when the file sets
`attention.sliding_window`; those are not supported here, and such a file is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from localllm.errors import LocalLLMError
from localllm.models.config import ModelConfig, base_config


def olmo2_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    if metadata.get("olmo2.attention.sliding_window", 0):
        raise LocalLLMError(
            "this olmo2 file has sliding-window layers (olmo2.attention.sliding_window, "
            "OLMo 3), which localllm does not run yet"
        )
    return base_config(metadata, "olmo2", vocab_size, rope_neox=True, qk_norm="all", pre_norm=False)
