"""Each architecture against llama.cpp, on small random models (tests/fixtures/architectures/).

Every case is a GGUF file that tests/random_models.py writes as llama.cpp's converter would, with
llama.cpp's greedy continuation, top-5 logits per step and last logits on fixed prompts beside it
(scripts/make-arch-references made them; this test needs neither llama.cpp nor the builder to
run). RoPE scaling cases put their prompts where the scaling changes the angles a lot: dropping
the scaling moves logits by several units (`test_rope_scaling_is_what_matches`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import random_models
from llama_cpp_compare import (
    LOGIT_TOL,
    LOGIT_TOL_QUANTIZED,
    N_STEPS,
    check_greedy,
    check_teacher_forced,
    teacher_forced_logits,
)
from typer.testing import CliRunner

from localllm.backend import CPUBackend
from localllm.cli import app
from localllm.errors import LocalLLMError
from localllm.models import load_model
from localllm.models.config import rope_scaling
from localllm.models.transformer import Transformer
from localllm.ops import RopeScaling
from localllm.quants import intdot
from localllm.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "architectures"
# the decoders' fixtures (the encoders' beside them: tests/test_embedding_architectures.py)
CASE_NAMES = sorted(random_models.CASES)


def reference(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def tolerance(ref: dict) -> float:
    quantized = any(t not in ("F32", "F16") for t in ref["types"].values())
    return LOGIT_TOL_QUANTIZED if quantized else LOGIT_TOL


@pytest.fixture(scope="module", params=CASE_NAMES)
def case(request):
    name = request.param
    ref = reference(name)
    n_ctx = max(len(c["prompt_ids"]) for c in ref["greedy"]) + N_STEPS
    model = load_model(FIXTURES / f"{name}.gguf", n_ctx=n_ctx, device="cpu")
    yield ref, model
    model.close()


def test_cases_are_all_there():
    """Every case of the builder has its fixture pair (scripts/make-arch-references writes them)."""
    assert all((FIXTURES / f"{name}.json").is_file() for name in CASE_NAMES)
    assert all((FIXTURES / f"{name}.gguf").is_file() for name in CASE_NAMES)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_fixture_is_the_file_llama_cpp_ran(name):
    ref = reference(name)
    data = (FIXTURES / f"{name}.gguf").read_bytes()
    assert hashlib.sha256(data).hexdigest() == ref["gguf_sha256"]
    assert len(data) < 700_000  # small fixtures
    # and the builder's case is still the one the file was written from
    summary = json.loads(json.dumps(random_models.metadata_summary(random_models.CASES[name])))
    assert {key: ref[key] for key in summary} == summary


@pytest.mark.parametrize("integer_kernels", [True, False], ids=["integer", "float"])
def test_greedy_continuation_matches_llama_cpp(case, integer_kernels):
    """24 greedy steps: the same tokens as llama.cpp's unless after one of its near-ties, the
    top-5 logits of every step and the whole last logits within tolerance. Both decode kernels:
    integer dot products (x86 SIMD, for the quantized weights) and float ones (any CPU)."""
    ref, model = case
    backend = model.transformer.backend
    if integer_kernels and not intdot.AVAILABLE:
        pytest.skip("no integer kernels for this CPU")
    default, backend.integer_kernels = backend.integer_kernels, integer_kernels
    try:
        check_greedy(model, ref, tolerance(ref))
    finally:
        backend.integer_kernels = default


def test_teacher_forced_logits_match_llama_cpp(case):
    ref, model = case
    check_teacher_forced(model, ref, tolerance(ref))


def test_tokenizer_matches_llama_cpp(case):
    ref, model = case
    tokenizer = Tokenizer.from_metadata(model.metadata)
    expected = ref["tokenize"]
    assert tokenizer.encode(expected["text"], add_special=False) == expected["ids"]


# How each scaling case would come out with its scaling dropped or half-done: llama.cpp's logits
# are then far away, so matching them is the scaling's doing.
WITHOUT_SCALING = {
    "llama3-rope-freqs": {"no rope_freqs": (None, False)},
    "llama-linear": {"no linear scaling": (RopeScaling(), True)},
    "llama-yarn": {
        "no scaling": (RopeScaling(), True),
        "as linear": (RopeScaling(freq_scale=0.25), True),
        "YaRN angles, no magnitude factor": (
            # cancels the 1 + 0.1 ln(4) that ggml multiplies cos and sin by
            RopeScaling(
                0.25, ext_factor=1.0, attn_factor=1 / (1 + 0.1 * math.log(4)), n_ctx_orig=64
            ),
            True,
        ),
    },
}


@pytest.mark.parametrize(
    ("name", "variant"),
    [(name, variant) for name, variants in WITHOUT_SCALING.items() for variant in variants],
)
def test_rope_scaling_is_what_matches(name, variant):
    """Scaling replaced (None: kept) and rope_freqs kept or not: logits at least 10 tolerances
    from llama.cpp's, so the tests above would catch a loader that ignores the scaling."""
    scaling, keep_rope_freqs = WITHOUT_SCALING[name][variant]
    ref = reference(name)
    expected = ref["greedy"][-1]
    model = load_model(FIXTURES / f"{name}.gguf", n_ctx=8, device="cpu")
    try:
        config = model.config
        if scaling is not None:
            config = dataclasses.replace(config, rope_scaling=scaling)
        n_ctx = len(expected["prompt_ids"]) + N_STEPS
        transformer = Transformer(model.gguf, config, CPUBackend(), n_ctx)
        if not keep_rope_freqs:
            assert transformer.rope_freqs is not None
            transformer.rope_freqs = None
        logits = teacher_forced_logits(transformer, expected)
        worst = max(
            np.abs(logits[step][top["top5_ids"]] - np.array(top["top5_logits"])).max()
            for step, top in enumerate(expected["teacher_forced"])
        )
        assert worst > 10 * tolerance(ref), (name, variant, worst)
    finally:
        model.close()


# ---- RoPE scaling metadata, as llama.cpp reads it ----


def scaling_of(n_ctx_train: int = 2048, **keys) -> RopeScaling:
    return rope_scaling({f"llama.{k}": v for k, v in keys.items()}, "llama", n_ctx_train)


def test_rope_scaling_metadata_defaults_and_linear():
    assert scaling_of() == RopeScaling()
    # llama.cpp's default type is linear: a factor alone scales; the old key too; "none" never
    assert scaling_of(**{"rope.scaling.factor": 4.0}) == RopeScaling(freq_scale=0.25)
    assert scaling_of(**{"rope.scale_linear": 2.0}) == RopeScaling(freq_scale=0.5)
    assert scaling_of(**{"rope.scaling.type": "none", "rope.scaling.factor": 4.0}) == RopeScaling()
    both = {
        "rope.scaling.type": "linear",
        "rope.scaling.factor": 8.0,
        "rope.scaling.attn_factor": 2.0,
    }
    assert scaling_of(**both) == RopeScaling(freq_scale=0.125, attn_factor=2.0)


def test_rope_scaling_metadata_yarn():
    keys = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}
    yarn = scaling_of(**keys, **{"rope.scaling.original_context_length": 64})
    assert (yarn.freq_scale, yarn.ext_factor, yarn.n_ctx_orig) == (0.25, 1.0, 64)
    assert (yarn.beta_fast, yarn.beta_slow) == (32.0, 1.0)
    # get_mscale(4) = 1 + 0.1 ln 4, cancelled against the factor ggml applies itself
    assert yarn.attn_factor == pytest.approx(1.0, abs=1e-6)
    assert scaling_of(4096, **keys).n_ctx_orig == 4096  # default: the training context


def test_rope_scaling_metadata_unsupported_type():
    with pytest.raises(LocalLLMError, match="unsupported RoPE scaling type 'longrope'"):
        scaling_of(**{"rope.scaling.type": "longrope"})


# ---- what a file localllm cannot run says ----


def one_error_line(tmp_path, case: random_models.Case, drop: tuple[str, ...] = ()) -> str:
    path = tmp_path / f"{case.name}.gguf"
    random_models.write_case(case, path, drop=drop)
    result = CliRunner().invoke(app, ["run", str(path), "hi", "-n", "1", "--device", "cpu"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_unsupported_architecture_is_one_error_line(tmp_path):
    case = dataclasses.replace(random_models.CASES["qwen3"], arch="mamba")
    error = one_error_line(tmp_path, case)
    assert "unsupported model architecture 'mamba'" in error and "qwen3" in error


def test_missing_tensor_is_one_error_line(tmp_path):
    error = one_error_line(
        tmp_path, random_models.CASES["qwen3"], drop=("blk.1.attn_k_norm.weight",)
    )
    assert "lacks the tensor 'blk.1.attn_k_norm.weight' that qwen3 needs" in error


def test_unsupported_rope_scaling_is_one_error_line(tmp_path):
    case = dataclasses.replace(random_models.CASES["llama-yarn"], rope_scaling=("longrope", 4, 64))
    error = one_error_line(tmp_path, case)
    assert "unsupported RoPE scaling type 'longrope' (llama.rope.scaling.type)" in error


# ---- the particulars of each family ----


def worst_teacher_forced_diff(transformer, expected) -> float:
    logits = teacher_forced_logits(transformer, expected)
    return max(
        np.abs(logits[step][top["top5_ids"]] - np.array(top["top5_logits"])).max()
        for step, top in enumerate(expected["teacher_forced"])
    )


def factors(model, name: str) -> np.ndarray:
    return model.gguf.tensors[name].data.view(np.float32).reshape(-1)


def replaced(**fields):
    """A variant that changes config fields."""
    return lambda config: (dataclasses.replace(config, **fields), None)


def short_factors(config):
    def use_short(transformer, model):
        transformer.rope_freqs = np.ascontiguousarray(factors(model, "rope_factors_short.weight"))

    return config, use_short


def without_post_attention_norms(config):
    def drop(transformer, model):
        for layer in transformer.layers:
            layer.post_attn_norm = None

    return config, drop


def without(attribute: str, on: str = "layer"):
    """A variant that drops a per-layer (or per-MoE) tensor the file has."""

    def variant(config):
        def drop(transformer, model):
            for layer in transformer.layers:
                setattr(layer if on == "layer" else layer.moe, attribute, None)

        return config, drop

    return variant


def without_shared_experts(config):
    def drop(transformer, model):
        for layer in transformer.layers:
            layer.moe.shared_gate = None

    return config, drop


# case -> variant -> config -> (config, None or a change to the transformer(transformer, model)):
# each of a family's particulars undone, or done where llama.cpp does not
FEATURE_VARIANTS = {
    "phi3": {
        "short factors": short_factors,
        "no attn factor": replaced(rope_scaling=RopeScaling()),
        "sliding window applied": replaced(layer_windows=(16, 16)),
    },
    "gemma2": {
        "no attention softcap": replaced(attn_softcap=0.0),
        "no final softcap": replaced(final_softcap=0.0),
        "no sliding window": replaced(layer_windows=(0, 0)),
        "window on the other layer": replaced(layer_windows=(0, 24)),
    },
    "granite": {
        "no embedding scale": replaced(embed_scale=1.0),
        "attention scale 1/sqrt(head_dim)": replaced(attn_scale=0.0),
        "no residual scale": replaced(residual_scale=1.0),
        "no logit scale": replaced(logit_scale=1.0),
    },
    "olmo2": {
        "no q/k norm": replaced(qk_norm="none"),
        "no post-attention norms": without_post_attention_norms,
    },
    "smollm3": {
        "RoPE on every layer": replaced(layer_rope=()),
    },
    "qwen3moe": {
        "weights not renormalized": replaced(expert_weights_norm=False),
        "one expert per token": replaced(n_experts_used=1),
    },
    "qwen2moe": {
        "weights renormalized": replaced(expert_weights_norm=True),
        "no shared expert": without_shared_experts,
    },
    "gpt-oss": {
        "no attention sinks": without("sinks"),
        "no output bias": without("bo"),
        "no router bias": without("router_bias", on="moe"),
        "no expert biases": without("expert_biases", on="moe"),
        "softmax before the choice": replaced(expert_gating="softmax"),
        "plain SwiGLU": replaced(activation="silu"),
        "no sliding window": replaced(layer_windows=(0, 0)),
        "window on the other layer": replaced(layer_windows=(0, 16)),
        "local layers unscaled": replaced(scale_local_rope=False),
    },
}


@pytest.mark.parametrize(
    ("name", "variant"),
    [(name, variant) for name, variants in FEATURE_VARIANTS.items() for variant in variants],
)
def test_family_particulars_are_what_matches(name, variant):
    """Each particular of a family undone (or, for phi3's window, done): the logits land at least
    10 tolerances from llama.cpp's, so the tests above would catch a loader that missed it."""
    ref = reference(name)
    expected = ref["greedy"][-1]
    model = load_model(FIXTURES / f"{name}.gguf", n_ctx=8, device="cpu")
    try:
        config, change = FEATURE_VARIANTS[name][variant](model.config)
        n_ctx = len(expected["prompt_ids"]) + N_STEPS
        transformer = Transformer(model.gguf, config, CPUBackend(), n_ctx)
        if change is not None:
            change(transformer, model)
        worst = worst_teacher_forced_diff(transformer, expected)
        assert worst > 10 * tolerance(ref), (name, variant, worst)
    finally:
        model.close()


def test_phi3_factors_are_chosen_by_the_context_as_llama_cpp_does():
    """rope_factors_long above the original context, short at or below it, the context rounded
    up to a multiple of 256 first (llama.cpp's n_ctx_seq)."""
    model = load_model(FIXTURES / "phi3.gguf", n_ctx=8, device="cpu")
    try:
        long = factors(model, "rope_factors_long.weight")
        short = factors(model, "rope_factors_short.weight")
        assert model.config.n_ctx_orig == 160
        np.testing.assert_array_equal(model.transformer.rope_freqs, long)  # 8 -> 256 > 160
        config = dataclasses.replace(model.config, n_ctx_orig=256)
        for n_ctx, expected in ((200, short), (256, short), (257, long)):
            transformer = Transformer(model.gguf, config, CPUBackend(), n_ctx)
            np.testing.assert_array_equal(transformer.rope_freqs, expected)
    finally:
        model.close()


def test_phi3_fused_matrices_are_views_of_the_map():
    """Q/K/V and gate/up are row slices of attn_qkv and ffn_up, sharing their mapped bytes."""
    model = load_model(FIXTURES / "phi3.gguf", n_ctx=8, device="cpu")
    try:
        c, tensors = model.config, model.gguf.tensors
        layer = model.transformer.layers[1]
        qkv, up = tensors["blk.1.attn_qkv.weight"].data, tensors["blk.1.ffn_up.weight"].data
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        for w, rows, source in (
            (layer.wq, slice(0, q_dim), qkv),
            (layer.wk, slice(q_dim, q_dim + kv_dim), qkv),
            (layer.wv, slice(q_dim + kv_dim, q_dim + 2 * kv_dim), qkv),
            (layer.w_gate, slice(0, c.ffn_dim), up),
            (layer.w_up, slice(c.ffn_dim, 2 * c.ffn_dim), up),
        ):
            assert np.shares_memory(w.raw, source) and not w.raw.flags.owndata
            np.testing.assert_array_equal(w.raw, source[rows])
    finally:
        model.close()


def test_phi3_fused_matrix_that_does_not_fit_is_a_clear_error():
    """A fused attn_qkv whose rows do not add up to the heads the metadata gives."""
    model = load_model(FIXTURES / "phi3.gguf", n_ctx=8, device="cpu")
    try:
        config = dataclasses.replace(model.config, n_kv_heads=1)
        with pytest.raises(
            LocalLLMError, match=r"blk\.0\.attn_qkv\.weight has shape .* does not fit"
        ):
            Transformer(model.gguf, config, CPUBackend(), 8)
    finally:
        model.close()


def test_olmo3_sliding_window_is_one_error_line(tmp_path):
    """An olmo2 file with sliding-window layers (OLMo 3) is refused, not run wrong."""
    case = dataclasses.replace(random_models.CASES["olmo2"], sliding_window=4096)
    error = one_error_line(tmp_path, case)
    assert "sliding-window layers (olmo2.attention.sliding_window" in error


def test_granite_without_logit_scale_is_one_error_line(tmp_path):
    """llama.cpp requires granite.logit_scale; so does localllm, naming the key."""
    case = dataclasses.replace(random_models.CASES["granite"], multipliers=None)
    error = one_error_line(tmp_path, case)
    assert "lacks the metadata key 'granite.logit_scale'" in error


# ---- mixtures of experts ----


@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe"])
def test_experts_are_views_of_the_3d_tensors(name):
    """Each expert's matrices are the bytes of its slice of ffn_{gate,up,down}_exps in the map."""
    model = load_model(FIXTURES / f"{name}.gguf", n_ctx=8, device="cpu")
    try:
        tensors = model.gguf.tensors
        for i, layer in enumerate(model.transformer.layers):
            assert len(layer.moe.experts) == model.config.n_experts
            for e, weights in enumerate(layer.moe.experts):
                for w, kind in zip(weights, ("gate", "up", "down"), strict=True):
                    stacked = tensors[f"blk.{i}.ffn_{kind}_exps.weight"].data
                    assert np.shares_memory(w.raw, stacked) and not w.raw.flags.owndata
                    np.testing.assert_array_equal(w.raw, stacked[e])
    finally:
        model.close()


def test_only_the_chosen_experts_run():
    """A decode step multiplies by n_experts_used experts per layer, the router's best ones,
    and by no other expert matrix: a token reads the active parameters only."""
    model = load_model(FIXTURES / "qwen3moe.gguf", n_ctx=40, device="cpu")
    try:
        transformer, backend = model.transformer, model.transformer.backend
        prompt = reference("qwen3moe")["greedy"][0]["prompt_ids"]
        transformer.forward(prompt, 0)
        used, inside = [], []

        def recording(original):
            def method(x, weights, outs):
                if not inside:  # linear_each may go through linear_many
                    used.extend(w.name for w in weights if "_exps" in w.name)
                inside.append(True)
                try:
                    return original(x, weights, outs)
                finally:
                    inside.pop()

            return method

        # gate and up in one linear_many, the downs in one linear_each
        backend.linear_many = recording(backend.linear_many)
        backend.linear_each = recording(backend.linear_each)
        try:
            transformer.forward([prompt[-1]], len(prompt))
        finally:
            del backend.linear_many, backend.linear_each
        c = model.config
        # gate, up and down of each chosen expert, in each layer, once
        assert len(used) == len(set(used)) == 3 * c.n_experts_used * c.n_layers
        for i in range(c.n_layers):
            experts = {name.split("[")[1] for name in used if name.startswith(f"blk.{i}.")}
            assert len(experts) == c.n_experts_used
    finally:
        model.close()


def test_a_prompts_experts_run_in_two_calls_a_layer():
    """A prefill runs each layer's chosen experts in two linear_experts calls (gate and up, then
    down) on the experts some token chose, each once, and no expert matrix through any other
    call."""
    model = load_model(FIXTURES / "qwen3moe.gguf", n_ctx=40, device="cpu")
    try:
        transformer, backend = model.transformer, model.transformer.backend
        prompt = reference("qwen3moe")["greedy"][0]["prompt_ids"]
        calls, others = [], []
        original_experts, original_many = backend.linear_experts, backend.linear_many

        def experts(x, stacks, ids, spans, outs):
            calls.append(([s.name for s in stacks], ids.tolist(), spans.tolist(), len(x)))
            return original_experts(x, stacks, ids, spans, outs)

        def many(x, weights, outs):
            others.extend(w.name for w in weights if "_exps" in w.name)
            return original_many(x, weights, outs)

        backend.linear_experts, backend.linear_many = experts, many
        try:
            transformer.forward(prompt, 0)
        finally:
            del backend.linear_experts, backend.linear_many
        c = model.config
        assert not others and len(calls) == 2 * c.n_layers
        for names, ids, spans, n_rows in calls:
            kinds = [name.split(".")[-2] for name in names]
            assert kinds in (["ffn_gate_exps", "ffn_up_exps"], ["ffn_down_exps"])
            assert n_rows == len(prompt) * c.n_experts_used == spans[-1]
            assert ids == sorted(set(ids)) and len(spans) == len(ids) + 1
            assert all(a < b for a, b in zip(spans, spans[1:], strict=False))
    finally:
        model.close()


def test_moe_metadata_that_does_not_fit_is_one_error_line(tmp_path):
    """More experts used than there are: one Error: line naming the keys."""
    case = dataclasses.replace(random_models.CASES["qwen3moe"], moe=(8, 9, 64, 0))
    error = one_error_line(tmp_path, case)
    assert "qwen3moe.expert_used_count 9 exceeds expert_count 8" in error
