"""Sampling and length options: the `run` flags, changed in a chat with `/set NAME VALUE`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from localllm.errors import LocalLLMError
from localllm.sampling import DEFAULTS, LogitsProcessor, Sampler
from localllm.sampling import make_logits_processors as _make_logits_processors
from localllm.sampling import make_sampler as _make_sampler


@dataclass
class Options:
    """Sampling and length settings: the `run` flags, changed in a chat with `/set NAME VALUE`."""

    temperature: float = DEFAULTS["temperature"]
    top_k: int = DEFAULTS["top_k"]
    top_p: float = DEFAULTS["top_p"]
    min_p: float = DEFAULTS["min_p"]
    repeat_penalty: float = DEFAULTS["repeat_penalty"]
    seed: int | None = None
    num_predict: int = -1  # tokens per reply at most; -1: until end of text or a full context

    def sampler(self) -> Sampler:
        """A fresh sampler (with a seed, each reply restarts the same random sequence)."""
        return _make_sampler(self.temperature, self.top_k, self.top_p, self.min_p, self.seed)

    def logits_processors(self) -> list[LogitsProcessor]:
        return _make_logits_processors(self.repeat_penalty)

    def max_tokens(self, n_ctx: int) -> int:
        """num_predict as stream_generate takes it: the context bounds an unlimited reply."""
        return n_ctx if self.num_predict < 0 else self.num_predict

    def set(self, name: str, value: str) -> None:
        """Set one option from text, validated; raises LocalLLMError for a bad name or value."""
        types = {f.name: f.type for f in fields(self)}
        if name not in types:
            raise LocalLLMError(f"unknown parameter {name!r}; one of: {', '.join(types)}")
        try:
            if name == "seed" and value.lower() in ("none", "random", "-1"):
                parsed: Any = None
            elif "int" in str(types[name]):
                parsed = int(value)
            else:
                parsed = float(value)
                if not math.isfinite(parsed):
                    raise ValueError(value)
        except ValueError:
            raise LocalLLMError(f"{name} needs a number, got {value!r}") from None
        if name == "num_predict" and parsed < -1:
            raise LocalLLMError("num_predict must be -1 (no limit) or more")
        candidate = Options(**{**asdict(self), name: parsed})
        candidate.sampler()  # the sampler's own checks say what is out of range
        candidate.logits_processors()
        setattr(self, name, parsed)
