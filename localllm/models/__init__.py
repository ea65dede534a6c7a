"""Architectures, chosen by `general.architecture`, and `load_model`."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm import support
from localllm.errors import LocalLLMError
from localllm.gguf import GGUFFile, read_gguf
from localllm.models.bert import bert_config, nomic_bert_config
from localllm.models.config import ModelConfig
from localllm.models.encoder import Encoder
from localllm.models.gemma import gemma2_config, gemma3_config
from localllm.models.gpt_oss import gpt_oss_config
from localllm.models.llama import (
    granite_config,
    llama_config,
    mistral_config,
    qwen2_config,
    qwen2moe_config,
    qwen3_config,
    qwen3moe_config,
    smollm3_config,
)
from localllm.models.olmo2 import olmo2_config
from localllm.models.phi3 import phi3_config
from localllm.models.transformer import Transformer
from localllm.tokenizer import Tokenizer

# general.architecture -> config builder; all of them run on the one Transformer, but for the
# embedding encoders (config.causal False: bert, nomic-bert), which run on the Encoder.
ARCHITECTURES: dict[str, Callable[[Mapping[str, Any], int], ModelConfig]] = {
    "llama": llama_config,
    "mistral": mistral_config,
    "qwen2": qwen2_config,
    "qwen3": qwen3_config,
    "qwen3moe": qwen3moe_config,
    "qwen2moe": qwen2moe_config,
    "gemma2": gemma2_config,
    "gemma3": gemma3_config,
    "phi3": phi3_config,
    "granite": granite_config,
    "olmo2": olmo2_config,
    "smollm3": smollm3_config,
    "gpt-oss": gpt_oss_config,
    "bert": bert_config,
    "nomic-bert": nomic_bert_config,
}

# the encoders among them: embedding models, which generate no text
EMBEDDING_ARCHITECTURES = frozenset({"bert", "nomic-bert"})

DEFAULT_CTX = 4096


@dataclass
class Model:
    """A loaded model: the file, its tokenizer, its config and the transformer with its KV cache
    (or, for an embedding model, the encoder)."""

    path: Path
    gguf: GGUFFile
    config: ModelConfig
    tokenizer: Tokenizer
    transformer: Transformer | Encoder
    load_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def metadata(self) -> dict[str, Any]:
        return self.gguf.metadata

    @property
    def n_ctx(self) -> int:
        return self.transformer.n_ctx

    @property
    def embedding_only(self) -> bool:
        """An encoder (bert, nomic-bert): it makes embeddings, never text."""
        return not self.config.causal

    def check_generates(self) -> None:
        """Raise a LocalLLMError that says so, for an embedding model asked to generate."""
        if self.embedding_only:
            raise LocalLLMError(
                f"{self.path.name} is an embedding model ({self.config.arch}): it makes "
                "embeddings (localllm serve: /v1/embeddings, /api/embed), not text"
            )

    def close(self) -> None:
        self.gguf.close()


def model_config(metadata: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    arch = metadata.get("general.architecture")
    builder = ARCHITECTURES.get(arch)
    if builder is None:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise LocalLLMError(f"unsupported model architecture {arch!r}; supported: {supported}")
    return builder(metadata, vocab_size)


def load_model(
    path: str | Path,
    n_ctx: int | None = None,
    n_threads: int | None = None,
    device: str = "auto",
    backend=None,
) -> Model:
    """Open a GGUF file and make it ready to run. n_ctx defaults to min(training context, 4096);
    device is "auto", "cpu" or "cuda" (see backend.make_backend); `backend` overrides it."""
    from localllm.backend import make_backend

    start = time.perf_counter()
    gguf = read_gguf(path)
    try:
        types = {support.type_name(t.ggml_type) for t in gguf.tensors.values()}
        support.check_runnable(gguf.architecture, types, str(path))
        tokenizer = Tokenizer.from_metadata(gguf.metadata)
        # The vocabulary once: the tokenizer's compact texts stand in for the parsed list of str
        # (~20 MB for a 262k vocabulary) wherever the metadata is read later (chat templates).
        gguf.metadata["tokenizer.ggml.tokens"] = tokenizer.texts
        config = model_config(gguf.metadata, tokenizer.vocab_size)
        if n_ctx is None:
            n_ctx = min(config.n_ctx_train, DEFAULT_CTX)
        if n_ctx < 1:
            raise LocalLLMError(f"the context size must be at least 1, got {n_ctx}")
        backend = backend or make_backend(device, n_threads)
        runner = Transformer if config.causal else Encoder
        transformer = runner(gguf, config, backend, n_ctx)
    except BaseException:
        gguf.close()
        raise
    return Model(Path(path), gguf, config, tokenizer, transformer, time.perf_counter() - start)
