"""Shared fixtures: an isolated LOCALLLM_HOME, and the real test models from ../shared/models.md."""

from __future__ import annotations

import os

# The CUDA kernels run on numba's simulator in the normal test run; this must be set before numba
# is imported. setdefault: NUMBA_ENABLE_CUDASIM=0 runs tests/test_cuda.py on a real GPU.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
REFERENCE_DIR = REPO.parent / "shared" / "reference"

# test name -> file name inside $LOCALLLM_TEST_MODELS (see scripts/fetch-test-models)
MODEL_FILES = {
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}
MODEL_NAMES = list(MODEL_FILES)


def test_models_dir() -> Path:
    default = Path.home() / ".cache" / "localllm" / "test-models"
    return Path(os.environ.get("LOCALLLM_TEST_MODELS", default))


def model_path(name: str) -> Path:
    """Path of a real test model; under CI a missing model fails the test, elsewhere it skips."""
    path = test_models_dir() / MODEL_FILES[name]
    if not path.exists():
        message = f"test model {name} not found at {path}; run scripts/fetch-test-models"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def reference(name: str) -> dict:
    path = REFERENCE_DIR / f"{name}.json"
    if not path.exists():
        message = f"llama.cpp reference {path} not found (../shared/reference)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return json.loads(path.read_text())


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Never touch the user's model store: LOCALLLM_HOME points into a temporary directory."""
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "localllm-home"))
