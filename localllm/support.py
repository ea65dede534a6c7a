"""What localllm can run: an architecture, tensor types and a tokenizer, judged from a GGUF
header alone.

A model runs when its `general.architecture` has a config builder (`models.ARCHITECTURES`),
every tensor's GGML type has kernels (`quants.QUANT_TYPES`) and its tokenizer model and BPE
pre-tokenizer are ones tokenizer.py builds. `pull` asks this of a remote file's
header (its first megabytes) before downloading gigabytes, `load_model` of a local file before
anything else, and the catalog test of every models.toml entry, so that the catalog cannot offer
a model that fails after its download.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gguf.constants import GGMLQuantizationType

from localllm.errors import LocalLLMError

# A llama.cpp file type (`general.file_type`, the quant in a file's name) -> the tensor types its
# quantizer writes into such a file (llama-quant.cpp, llama_tensor_get_type): the base type; the
# larger types it gives output.weight, attn_v, ffn_down and fused attn_qkv; the fallbacks for rows
# that are not a multiple of the block size (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0,
# i-quants -> IQ4_NL); and the F32 / F16 / BF16 tensors that are never quantized (norms, biases).
_UNQUANTIZED = ("F32", "F16", "BF16")
_K_FALLBACKS = ("Q5_0", "Q5_1", "Q8_0")
QUANT_MIXES: dict[str, frozenset[str]] = {
    name: frozenset(_UNQUANTIZED + types)
    for name, types in {
        "F32": (),
        "F16": (),
        "BF16": (),
        "Q8_0": ("Q8_0",),
        "Q4_0": ("Q4_0", "Q6_K", "Q8_0"),
        "Q4_1": ("Q4_1", "Q6_K", "Q8_0"),
        "Q5_0": ("Q5_0", "Q6_K", "Q8_0"),
        "Q5_1": ("Q5_1", "Q6_K", "Q8_0"),
        "Q2_K": ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", *_K_FALLBACKS),
        "Q3_K_S": ("Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", *_K_FALLBACKS),
        "Q3_K_M": ("Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", *_K_FALLBACKS),
        "Q3_K_L": ("Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", *_K_FALLBACKS),
        "Q4_K_S": ("Q4_K", "Q5_K", "Q6_K", *_K_FALLBACKS),
        "Q4_K_M": ("Q4_K", "Q5_K", "Q6_K", *_K_FALLBACKS),
        "Q5_K_S": ("Q5_K", "Q6_K", *_K_FALLBACKS),
        "Q5_K_M": ("Q5_K", "Q6_K", *_K_FALLBACKS),
        "Q6_K": ("Q6_K", "Q8_0"),
        "IQ4_NL": ("IQ4_NL", "Q5_K", "Q6_K", "Q8_0"),
        "IQ4_XS": ("IQ4_XS", "IQ4_NL", "Q5_K", "Q6_K", "Q8_0"),
        "MXFP4_MOE": ("MXFP4", "Q8_0"),
    }.items()
}


def supported_architectures() -> list[str]:
    from localllm.models import ARCHITECTURES

    return sorted(ARCHITECTURES)


def supported_types() -> list[str]:
    from localllm.quants import QUANT_TYPES

    return [qt.name for qt in QUANT_TYPES.values()]


def type_name(ggml_type: int) -> str:
    """ "Q4_K" for 12; the bare id for a type gguf-py does not know."""
    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return f"type id {int(ggml_type)}"


def missing_pieces(
    architecture: str | None,
    tensor_types: Iterable[str],
    metadata: Mapping[str, Any] | None = None,
) -> list[str]:
    """What localllm lacks to run such a model, in words; empty when it can run it. With the
    file's `metadata`, its tokenizer (model and pre-tokenizer) is checked too."""
    missing = []
    if architecture not in supported_architectures():
        missing.append(f"unsupported model architecture {architecture!r}")
    unsupported = sorted(set(tensor_types) - set(supported_types()))
    if unsupported:
        plural = "s" if len(unsupported) > 1 else ""
        missing.append(f"unsupported tensor type{plural} {', '.join(unsupported)}")
    if metadata is not None and "tokenizer.ggml.model" in metadata:
        from localllm.tokenizer import unsupported_tokenizer

        if problem := unsupported_tokenizer(metadata):
            missing.append(problem)
    return missing


def check_runnable(
    architecture: str | None,
    tensor_types: Iterable[str],
    what: str,
    metadata: Mapping[str, Any] | None = None,
) -> None:
    """Raise LocalLLMError naming every missing piece, unless localllm can run the model."""
    missing = missing_pieces(architecture, tensor_types, metadata)
    if not missing:
        return
    raise LocalLLMError(
        f"{what}: {' and '.join(missing)}; localllm runs the architectures "
        f"{', '.join(supported_architectures())} and the tensor types "
        f"{', '.join(supported_types())}: pick another model or quant"
    )
