"""Counting the interpreter's work instead of timing it.

A speed test that bounds the Python-level calls per item (a vocabulary entry, a character)
fails when someone adds per-item work in Python, and still passes on a loaded machine, where a
wall-clock bound does not. Likewise batching is proven by the forward passes it makes
(`record_passes`), not by how long they take.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Calls:
    python: int = 0  # calls of Python functions, generator resumptions included
    builtin: int = 0  # calls of functions and methods written in C

    @property
    def total(self) -> int:
        return self.python + self.builtin


def count_calls(fn: Callable[[], Any]) -> tuple[Any, Calls]:
    """fn()'s result and the calls it made on this thread (sys.setprofile sees every one)."""
    calls = Calls()

    def profile(frame, event: str, arg) -> None:
        if event == "call":
            calls.python += 1
        elif event == "c_call":
            calls.builtin += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(previous)
    return result, calls


def record_passes(monkeypatch) -> list[list[int]]:
    """From now on (for the test), each Transformer.forward_batch call as the token counts of
    its parts: one entry per sequence sharing that pass."""
    from localllm.models.transformer import Transformer

    passes: list[list[int]] = []
    original = Transformer.forward_batch

    def recording(self, parts):
        passes.append([len(ids) for _, _, ids, _ in parts])
        return original(self, parts)

    monkeypatch.setattr(Transformer, "forward_batch", recording)
    return passes
