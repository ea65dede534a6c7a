"""Files quantized by llama.cpp's own quantizer against llama.cpp's output on them
(tests/fixtures/quants/).

scripts/make-quant-references quantized random_models.QUANT_BASE (F16, dim 512) to each llama.cpp
file type with `llama_model_quantize` (or, for types that need an importance matrix, tensor by
tensor with ggml's `ggml_quantize_chunk`) and recorded llama.cpp's greedy continuation, top-5 logits
and last logits; the comparison is test_architectures' (llama_cpp_compare.py; this test needs
neither llama.cpp nor the builder to run). Every matrix is of the file's type but the tied
embeddings (Q6_K) and, in the IQ files, attn_v (llama.cpp's mix makes it Q5_K or Q4_K).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import random_models
from gguf.constants import GGMLQuantizationType
from llama_cpp_compare import LOGIT_TOL_QUANTIZED, N_STEPS, check_greedy, check_teacher_forced

from localllm.models import load_model
from localllm.quants import QUANT_TYPES, intdot

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "quants"
FILE_TYPES = sorted(path.stem for path in FIXTURES.glob("*.json"))
# Logit tolerance: test_architectures' for quantized weights. Measured at most 0.12 (IQ4), 0.17
# (IQ3), 0.15 (IQ2), 0.18 (IQ1) and 0.11 (TQ) over both kernels and the teacher-forced pass, on
# top logits of 10-25: the activations localllm and llama.cpp compute differ in the last float
# bits (norms, SiLU, softmax), and where such a value sits on a rounding boundary of its 8-bit
# activation block it flips a level, which this sharp model amplifies. Greedy tokens part only
# after near-ties (one, of gap 0.04).
LOGIT_TOL = LOGIT_TOL_QUANTIZED


def reference(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.fixture(scope="module", params=FILE_TYPES)
def case(request):
    name = request.param
    ref = reference(name)
    n_ctx = max(len(c["prompt_ids"]) for c in ref["greedy"]) + N_STEPS
    model = load_model(FIXTURES / f"{name}.gguf", n_ctx=n_ctx, device="cpu")
    yield ref, model
    model.close()


def test_every_newer_type_has_a_file():
    """Each i-quant and ternary type of the registry is checked on a file llama.cpp wrote."""
    newer = {qt.name for qt in QUANT_TYPES.values() if qt.name.startswith(("IQ", "TQ"))}
    assert newer == {reference(name)["ggml_type"] for name in FILE_TYPES}


@pytest.mark.parametrize("name", FILE_TYPES)
def test_fixture_is_the_file_llama_cpp_quantized(name):
    ref = reference(name)
    data = (FIXTURES / f"{name}.gguf").read_bytes()
    assert hashlib.sha256(data).hexdigest() == ref["gguf_sha256"]
    assert len(data) < 1_100_000  # small fixtures
    summary = json.loads(json.dumps(random_models.metadata_summary(random_models.QUANT_BASE)))
    assert ref["base"] == summary
    # every matrix of each layer but attn_v, which llama.cpp's IQ4 / IQ3_S mixes make Q5_K / Q4_K
    assert ref["tensor_types"][ref["ggml_type"]] >= 6 * random_models.QUANT_BASE.n_layers


def test_file_holds_the_type(case):
    ref, model = case
    types = {GGMLQuantizationType(t.ggml_type).name for t in model.gguf.tensors.values()}
    assert ref["ggml_type"] in types
    assert types == set(ref["tensor_types"])


@pytest.mark.parametrize("integer_kernels", [True, False], ids=["integer", "float"])
def test_greedy_continuation_matches_llama_cpp(case, integer_kernels):
    """24 greedy steps: the same tokens as llama.cpp's unless after one of its near-ties, the
    top-5 logits of every step and the whole last logits within tolerance, with either decode
    kernel."""
    ref, model = case
    backend = model.transformer.backend
    if integer_kernels and not intdot.AVAILABLE:
        pytest.skip("no integer kernels for this CPU")
    default, backend.integer_kernels = backend.integer_kernels, integer_kernels
    try:
        check_greedy(model, ref, LOGIT_TOL)
    finally:
        backend.integer_kernels = default


def test_teacher_forced_logits_match_llama_cpp(case):
    ref, model = case
    check_teacher_forced(model, ref, LOGIT_TOL)
