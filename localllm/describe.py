"""Describing a model and a generation, shared by `localllm show`, the chat's `/show` and
`--verbose`: what a GGUF is (from its own metadata and tensors), counts, and timing stats."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from localllm.store import detect_quant, format_bytes

if TYPE_CHECKING:  # `show` needs neither the generator nor numpy's GGUF reader to be imported here
    from localllm.generate import GenerationResponse
    from localllm.gguf import GGUFFile


# {arch}.pooling_type values (llama.cpp's enum)
POOLING_NAMES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def describe_model(gguf: GGUFFile) -> dict[str, Any]:
    """What `show` prints: architecture, parameter count (from tensor shapes), context length,
    quantization, tensor types (how many tensors of each, and their bytes), chat template and
    license, all from the GGUF itself."""
    metadata = gguf.metadata
    quant = detect_quant(gguf.path, metadata=metadata)
    arch = str(metadata.get("general.architecture", ""))
    tensor_types: dict[str, int] = {}
    tensor_bytes: dict[str, int] = {}
    n_params = 0
    for tensor in gguf.tensors.values():
        n_params += math.prod(tensor.shape)
        try:
            type_name = tensor.type_name
        except ValueError:
            type_name = f"type {tensor.ggml_type}"
        tensor_types[type_name] = tensor_types.get(type_name, 0) + 1
        tensor_bytes[type_name] = tensor_bytes.get(type_name, 0) + tensor.n_bytes
    # the types that hold the most bytes first: what the file's size is made of
    by_bytes = sorted(tensor_types, key=lambda name: (-tensor_bytes[name], name))
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, bytes):
        template = template.decode("utf-8", errors="replace")
    if template:
        source = "file"
    elif metadata.get(f"{arch}.attention.causal") is False:  # an encoder: nothing to chat with
        source, template = "none: an embedding model", ""
    else:
        from localllm.chat_template import builtin_template

        tokens = metadata.get("tokenizer.ggml.tokens") or []
        template_name, template = builtin_template(arch, tokens)
        source = f"built-in {template_name}"
    return {
        "name": metadata.get("general.name"),
        "architecture": arch or None,
        "parameters": n_params,
        "context_length": metadata.get(f"{arch}.context_length"),
        "embedding_length": metadata.get(f"{arch}.embedding_length"),
        "layers": metadata.get(f"{arch}.block_count"),
        "quantization": quant,
        "tensor_types": {name: tensor_types[name] for name in by_bytes},
        "tensor_bytes": {name: tensor_bytes[name] for name in by_bytes},
        "chat_template": template,
        "chat_template_source": source,
        "license": metadata.get("general.license"),
        "particulars": particulars(metadata, arch, set(gguf.tensors)),
        "file": str(gguf.path),
        "file_size": gguf.file_size,
    }


def particulars(metadata: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """The architecture's particulars that its metadata (or tensors) set, as `show` lists them:
    attention heads, experts, sliding window, softcaps, RoPE scaling, Granite's multipliers."""

    def get(key: str) -> Any:
        return metadata.get(f"{arch}.{key}")

    found: dict[str, Any] = {}
    heads, kv_heads = get("attention.head_count"), get("attention.head_count_kv")
    if heads:
        found["attention heads"] = f"{heads} ({kv_heads or heads} K/V)"
    if get("expert_count"):
        found["experts"] = f"{get('expert_count')}, {get('expert_used_count')} used per token"
        if get("expert_shared_count"):
            found["experts"] += f", {get('expert_shared_count')} shared"
    if get("pooling_type") in POOLING_NAMES:  # an embedding model's
        found["pooling"] = POOLING_NAMES[get("pooling_type")]
    if get("attention.sliding_window"):
        found["sliding window"] = get("attention.sliding_window")
    for key, label in (
        ("attn_logit_softcapping", "attention softcap"),
        ("final_logit_softcapping", "final softcap"),
        ("embedding_scale", "embedding multiplier"),
        ("residual_scale", "residual multiplier"),
        ("attention.scale", "attention multiplier"),
        ("logit_scale", "logit divisor"),
    ):
        if get(key):
            found[label] = get(key)
    kind = get("rope.scaling.type")
    if kind and kind != "none":
        factor, original = get("rope.scaling.factor"), get("rope.scaling.original_context_length")
        found["rope scaling"] = f"{kind} x{factor:g}" + (f" of {original}" if original else "")
    elif "rope_freqs.weight" in tensor_names:
        found["rope scaling"] = "llama3 (rope_freqs.weight)"
    elif "rope_factors_long.weight" in tensor_names:
        found["rope scaling"] = "longrope (rope_factors_long / _short)"
    return found


def info_rows(info: dict[str, Any]) -> list[tuple[str, Any]]:
    """The rows `show` prints of a describe_model() dict, as (label, value or None)."""
    total = sum(info["tensor_bytes"].values())
    types = ", ".join(
        f"{name} {byte_share(info['tensor_bytes'][name], total)} (x{n})"
        for name, n in info["tensor_types"].items()
    )
    return [
        ("name", info["name"]),
        ("architecture", info["architecture"]),
        ("parameters", format_count(info["parameters"])),
        ("context length", info["context_length"]),
        ("embedding length", info["embedding_length"]),
        ("layers", info["layers"]),
        ("quantization", info["quantization"]),
        ("tensor types", types),
        *info.get("particulars", {}).items(),
        ("file", f"{info['file']} ({format_bytes(info['file_size'])})"),
    ]


def byte_share(n_bytes: int, total: int) -> str:
    """A type's share of the tensor bytes, as `show` lists it: '81.5%', '<0.1%' (a few norms)."""
    share = 100 * n_bytes / total if total else 0.0
    return "<0.1%" if 0 < share < 0.05 else f"{share:.1f}%"


def printable(value: Any) -> str:
    """Text from a model file with control characters escaped, never sent raw to a terminal."""
    text = str(value)
    return "".join(c if c.isprintable() or c == "\t" else repr(c)[1:-1] for c in text)


def format_count(n: int) -> str:
    """134515008 -> '134.52M' (parameter counts, as Ollama shows them)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def format_stats(
    response: GenerationResponse, load_seconds: float | None, total_seconds: float
) -> str:
    """Ollama's --verbose block: durations, token counts and rates of one generation."""
    n_prefilled = response.prompt_tokens - response.cached_tokens
    prompt_s = n_prefilled / response.prompt_tps if response.prompt_tps > 0 else 0.0
    n_timed = response.generation_tokens - 1  # the first token's time counts as prompt eval
    eval_s = n_timed / response.generation_tps if response.generation_tps > 0 else 0.0
    cached = f" ({response.cached_tokens} cached)" if response.cached_tokens else ""
    rows = [("total duration", _seconds(total_seconds))]
    if load_seconds is not None:
        rows.append(("load duration", _seconds(load_seconds)))
    rows += [
        ("prompt eval count", f"{response.prompt_tokens} token(s){cached}"),
        ("prompt eval duration", _seconds(prompt_s)),
        ("prompt eval rate", f"{response.prompt_tps:.2f} tokens/s"),
        ("eval count", f"{response.generation_tokens} token(s)"),
        ("eval duration", _seconds(eval_s)),
        ("eval rate", f"{response.generation_tps:.2f} tokens/s"),
    ]
    return "\n".join(f"{name + ':':<22}{value}" for name, value in rows)


def _seconds(s: float) -> str:
    return f"{s * 1000:.2f}ms" if s < 1 else f"{s:.3f}s"
