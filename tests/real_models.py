"""The three real test models, and llama.cpp's output for them (tests/reference/)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
REFERENCE_DIR = Path(__file__).resolve().parent / "reference"

# test name -> file name inside $LOCALLLM_TEST_MODELS (see scripts/fetch-test-models)
MODEL_FILES = {
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}
MODEL_NAMES = list(MODEL_FILES)


def models_dir() -> Path:
    default = Path.home() / ".cache" / "localllm" / "test-models"
    return Path(os.environ.get("LOCALLLM_TEST_MODELS", default))


def model_path(name: str) -> Path:
    """Path of a real test model; under CI a missing model fails the test, elsewhere it skips."""
    path = models_dir() / MODEL_FILES[name]
    if not path.exists():
        message = f"test model {name} not found at {path}; run scripts/fetch-test-models"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def reference(name: str) -> dict:
    """llama.cpp's tokenizations and greedy continuations for a real test model."""
    return json.loads((REFERENCE_DIR / f"{name}.json").read_text(encoding="utf-8"))
