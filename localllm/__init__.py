"""localllm: a local LLM runner for GGUF models, written in Python."""

__version__ = "0.1.0"

from localllm.threads import configure_environment as _configure_environment

_configure_environment()  # before Numba or numpy start their thread pools
