"""localllm: a local LLM runner for GGUF models, written in Python."""

__version__ = "0.1.0"
