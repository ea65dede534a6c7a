"""Test session set-up: the CUDA simulator and an isolated LOCALLLM_HOME.

Tests import what they share from helper modules beside this file (real_models.py,
gguf_writer.py), never from conftest.
"""

from __future__ import annotations

import os

# The CUDA kernels run on numba's simulator in the normal test run; this must be set before numba
# is imported. setdefault: NUMBA_ENABLE_CUDASIM=0 runs tests/test_cuda.py on a real GPU.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Never touch the user's model store: LOCALLLM_HOME points into a temporary directory."""
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "localllm-home"))
