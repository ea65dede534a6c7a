"""The backend Protocol: CPUBackend and CUDABackend both provide it, and the model needs no more.

The CUDA module imports on numba's simulator (conftest sets NUMBA_ENABLE_CUDASIM=1), so this
runs without a GPU.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
from real_models import model_path

from localllm.backend import Backend, CPUBackend
from localllm.models import load_model

PROTOCOL_METHODS = sorted(
    name for name, member in vars(Backend).items() if callable(member) and not name.startswith("_")
)


def parameters(function) -> list[tuple]:
    """(name, kind, has a default) of each parameter: the shape of a call, not its annotations."""
    return [
        (p.name, p.kind, p.default is not inspect.Parameter.empty)
        for p in inspect.signature(function).parameters.values()
    ]


def backend_classes() -> list[type]:
    pytest.importorskip("numba_cuda")
    from localllm.cuda.backend import CUDABackend

    return [CPUBackend, CUDABackend]


def test_the_protocol_lists_what_the_model_calls():
    assert "linear" in PROTOCOL_METHODS and "attention" in PROTOCOL_METHODS
    assert len(PROTOCOL_METHODS) == 32


@pytest.mark.parametrize("method", PROTOCOL_METHODS)
def test_both_backends_have_each_method_with_its_signature(method):
    expected = parameters(getattr(Backend, method))
    for cls in backend_classes():
        implementation = getattr(cls, method, None)
        assert callable(implementation), f"{cls.__name__} lacks {method}"
        assert parameters(implementation) == expected, f"{cls.__name__}.{method}"


def test_both_backends_are_backends():
    for cls in backend_classes():
        assert isinstance(cls.name, str) and cls.name
    assert isinstance(CPUBackend(n_threads=1), Backend)


@pytest.mark.parametrize("integer", [True, False])
def test_linear_experts_is_each_expert_on_its_rows(integer):
    """CPUBackend.linear_experts (a prompt's MoE experts, rows sorted by expert) gives each span
    of rows exactly what `linear` gives for those rows and that expert alone, with the integer
    kernels (one call for all the experts) and without them (one linear per expert)."""
    from random_blocks import random_weights

    from localllm.gguf import TensorInfo

    rng = np.random.default_rng(5)
    n_experts, n_rows, n_cols = 5, 24, 512
    stacks = []
    for kind in ("gate", "up"):
        data = np.stack([random_weights("Q4_K", n_rows, n_cols, rng) for _ in range(n_experts)])
        shape = (n_experts, n_rows, n_cols)
        stacks.append(TensorInfo(f"ffn_{kind}_exps", 12, shape, 0, data.nbytes, data))
    backend = CPUBackend(n_threads=2)
    backend.integer_kernels = backend.integer_kernels and integer
    stacks = [backend.weight_stack(t) for t in stacks]
    ids = np.array([1, 2, 4], np.int64)
    spans = np.array([0, 3, 4, 13], np.int64)
    x = rng.standard_normal((13, n_cols)).astype(np.float32)
    outs = [np.full((13, n_rows), np.nan, np.float32) for _ in stacks]
    backend.linear_experts(x, stacks, ids, spans, outs)
    for stack, out in zip(stacks, outs, strict=True):
        for i, e in enumerate(ids):
            rows = slice(spans[i], spans[i + 1])
            alone = np.empty((spans[i + 1] - spans[i], n_rows), np.float32)
            backend.linear(x[rows], stack.experts[e], alone)
            np.testing.assert_array_equal(out[rows], alone)


def test_add_bias_rows_adds_each_rows_own_bias():
    """gpt-oss's expert biases: row r gets row ids[r] of the table (ids repeat and skip)."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 40)).astype(np.float32)
    table = rng.standard_normal((4, 40)).astype(np.float32)
    ids = np.array([3, 0, 3, 3, 1])
    out = x.copy()
    CPUBackend(n_threads=2).add_bias_rows(out, table, ids)
    np.testing.assert_array_equal(out, x + table[ids])


class OnlyTheProtocol:
    """A CPUBackend that refuses every attribute the Protocol does not list."""

    def __init__(self) -> None:
        self._inner = CPUBackend()
        self.calls: set[str] = set()

    def __getattr__(self, name: str):
        if name not in PROTOCOL_METHODS and name != "name":
            raise AssertionError(f"the model used backend.{name}, which the Protocol lacks")
        self.calls.add(name)
        return getattr(self._inner, name)


def test_the_model_calls_only_protocol_methods():
    backend = OnlyTheProtocol()
    model = load_model(model_path("smollm2-135m"), n_ctx=64, backend=backend)
    try:
        ids = model.tokenizer.encode("Hello there", add_special=True)
        logits = model.transformer.forward(ids, 0)  # prefill
        logits = model.transformer.forward([int(np.argmax(logits))], len(ids))  # one decode step
        assert np.isfinite(logits).all()
    finally:
        model.close()
    assert {"weight", "vector", "zeros", "linear_many", "attention_sequences"} <= backend.calls


def test_a_mixture_of_experts_calls_only_protocol_methods():
    """qwen2moe's MoE FFN and shared expert (a random model of tests/fixtures/architectures)."""
    backend = OnlyTheProtocol()
    path = Path(__file__).resolve().parent / "fixtures" / "architectures" / "qwen2moe.gguf"
    model = load_model(path, n_ctx=16, backend=backend)
    try:
        logits = model.transformer.forward([5, 17, 63, 8], 0)  # prefill
        logits = model.transformer.forward([int(np.argmax(logits))], 4)  # one decode step
        assert np.isfinite(logits).all()
    finally:
        model.close()
    assert {"gather_rows", "scatter_rows", "to_host"} <= backend.calls


def test_kv_pool_arrays_are_writable_zeros_that_grow():
    """CPUBackend.kv_zeros (huge_zeros: a private anonymous map asked for huge pages) gives
    writable zeros of the shape and element type asked, and a KVPool grown on them keeps what
    its pages held."""
    from localllm.kv_cache import KVPool

    for rounding, dtype in ((True, np.uint16), (False, np.float32)):
        backend = CPUBackend(1, llama_cpp_rounding=rounding)
        zeros = backend.kv_zeros((3, 2, 5, 4))
        assert zeros.shape == (3, 2, 5, 4) and zeros.dtype == dtype and zeros.flags.writeable
        assert zeros.flags.c_contiguous and not zeros.any()
    pool = KVPool(2, 2, 8, 4, capacity=64, zeros=CPUBackend(1).kv_zeros)
    page = pool.allocate()
    pool.k[1, page, 1, 2, 3] = 7
    pool.grow(40)
    assert pool.n_pages == 40 and pool.k[1, page, 1, 2, 3] == 7 and pool.k.sum() == 7
