"""Random valid raw blocks of every quant type, for the kernel tests (test_quants, test_intdot,
test_cuda)."""

from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType

from localllm.quants import get_quant_type

# byte offsets of the f16 scale fields inside one block
F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "IQ3_S": (0,),
    "IQ3_XXS": (0,),
    "IQ2_XXS": (0,),
    "IQ2_XS": (0,),
    "IQ2_S": (0,),
    "IQ1_S": (0,),
    "TQ1_0": (52,),
    "TQ2_0": (64,),
}


# byte offsets of four uint16 whose top 4 bits hold one f16 scale, lowest nibble first (IQ1_M's
# d beside its 3-bit scales)
NIBBLE_F16_FIELDS = {"IQ1_M": (48,)}

# byte offsets of E8M0 exponent fields (a scale of 2^(e - 128)), kept to scales near 1/64
E8M0_FIELDS = {"MXFP4": (0,)}


def ggml_id(name: str) -> int:
    return int(GGMLQuantizationType[name])


def read_only(a: np.ndarray) -> np.ndarray:
    """Like a read-only memmap view: the one weight signature the kernels get compiled for."""
    a = np.ascontiguousarray(a)
    a.flags.writeable = False
    return a


def random_f16_scales(n_rows: int, n_blocks: int, rng, scale_range) -> np.ndarray:
    """float16[n_rows, n_blocks] of finite scales, some zero and some subnormal."""
    scales = rng.uniform(*scale_range, size=(n_rows, n_blocks)).astype(np.float16)
    scales.flat[::17] = 0.0
    scales.flat[5::23] = np.float16(3e-6)  # subnormal in f16
    return scales


def random_weights(name: str, n_rows: int, n_cols: int, rng, scale_range=(-0.05, 0.05)):
    """Random valid raw rows: random quant bytes, finite f16 scales (some zero or subnormal)."""
    if name == "F32":
        return rng.standard_normal((n_rows, n_cols)).astype(np.float32).view(np.uint8)
    if name == "F16":
        return rng.standard_normal((n_rows, n_cols)).astype(np.float16).view(np.uint8)
    if name == "BF16":
        bits = rng.standard_normal((n_rows, n_cols)).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    qt = get_quant_type(ggml_id(name))
    n_blocks = n_cols // qt.block_size
    raw = rng.integers(0, 256, size=(n_rows, n_blocks, qt.type_size), dtype=np.uint8)
    for offset in E8M0_FIELDS.get(name, ()):
        raw[:, :, offset] = rng.integers(118, 126, size=(n_rows, n_blocks), dtype=np.uint8)
    for offset in F16_FIELDS.get(name, ()):
        scales = random_f16_scales(n_rows, n_blocks, rng, scale_range)
        raw[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(n_rows, n_blocks, 2)
    for offset in NIBBLE_F16_FIELDS.get(name, ()):
        bits = random_f16_scales(n_rows, n_blocks, rng, scale_range).view(np.uint16)
        for i in range(4):  # the high nibble of each uint16's high byte
            high = raw[:, :, offset + 2 * i + 1]
            raw[:, :, offset + 2 * i + 1] = (high & 0x0F) | (((bits >> (4 * i)) & 0xF) << 4)
    return raw.reshape(n_rows, n_blocks * qt.type_size)
