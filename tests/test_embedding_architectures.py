"""The embedding architectures (bert, nomic-bert) against llama.cpp, on small random models.

Each case of tests/random_encoders.py is a GGUF file in tests/fixtures/architectures/ with
llama.cpp's token ids and pooled embeddings (raw and L2-normalized) for a few texts beside it
(scripts/make-arch-references made them). The embeddings go through localllm's own path, the
one /v1/embeddings and /api/embed take (embeddings.embed_texts). Variants of each model with
one of its particulars dropped land far from llama.cpp's vectors, so that matching them is the
particulars' doing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import random_encoders
from typer.testing import CliRunner

from localllm import support
from localllm.backend import CPUBackend
from localllm.cli import app
from localllm.embeddings import embed_ids, embed_texts, pooling
from localllm.errors import LocalLLMError
from localllm.generate import stream_generate
from localllm.models import load_model
from localllm.models.encoder import Encoder
from localllm.prompt import chat_prompt_ids

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "architectures"
CASE_NAMES = sorted(random_encoders.CASES)

# Measured against llama.cpp (F16 weights with activations rounded to half, Q8_0 weights with
# activations quantized to Q8_0, as ggml does both; integer and float kernels alike): cosine at
# least 0.99999995, raw vectors (norms of 2-10) within 3e-4, the normalized ones within 1e-4.
# The bounds leave room for rounding flips, not for a missing piece (see
# test_particulars_are_what_matches: those miss by 0.03 of cosine or more).
MIN_COSINE = 0.99999
RAW_TOL = 1e-2
NORMALIZED_TOL = 2e-3


def reference(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=CASE_NAMES)
def case(request):
    name = request.param
    model = load_model(FIXTURES / f"{name}.gguf", device="cpu")
    yield reference(name), model
    model.close()


def test_cases_are_all_there():
    """Every case of the builder has its fixture pair, and every fixture pair a builder."""
    import random_models

    stems = sorted(path.stem for path in FIXTURES.glob("*.json"))
    assert stems == sorted([*random_models.CASES, *random_encoders.CASES])


@pytest.mark.parametrize("name", CASE_NAMES)
def test_fixture_is_the_file_llama_cpp_ran(name):
    ref = reference(name)
    data = (FIXTURES / f"{name}.gguf").read_bytes()
    assert hashlib.sha256(data).hexdigest() == ref["gguf_sha256"]
    assert len(data) < 700_000  # small fixtures
    summary = json.loads(json.dumps(random_encoders.metadata_summary(random_encoders.CASES[name])))
    assert {key: ref[key] for key in summary} == summary
    assert [t["text"] for t in ref["texts"]] == list(random_encoders.TEXTS)


def test_loads_as_an_encoder(case):
    ref, model = case
    assert isinstance(model.transformer, Encoder)
    assert model.embedding_only and not model.config.causal
    assert pooling(model) == {1: "mean", 2: "cls"}[ref["pooling_type"]]
    if ref["arch"] == "bert":  # the context is the position table's
        assert model.n_ctx == ref["shape"]["context_length"]


def test_token_ids_match_llama_cpp(case):
    """WordPiece as llama.cpp's: [CLS] ... [SEP] with the special tokens, the pieces without."""
    ref, model = case
    for expected in ref["texts"]:
        text = expected["text"]
        assert model.tokenizer.encode(text, add_special=True) == expected["ids"], text
        assert model.tokenizer.encode(text, add_special=False) == expected["ids_no_special"], text


def test_tokenizer_edge_cases_match_llama_cpp(case):
    """Special-token texts (as text, and parsed), full-width, compatibility and invisible
    characters, unusual spaces: llama.cpp's ids."""
    ref, model = case
    assert [t["text"] for t in ref["tokenize"]] == list(random_encoders.TOKENIZE_TEXTS)
    tokenizer = model.tokenizer
    for expected in ref["tokenize"]:
        text = expected["text"]
        assert tokenizer.encode(text) == expected["ids"], text
        assert tokenizer.encode(text, add_special=False) == expected["ids_no_special"], text
        assert tokenizer.encode(text, parse_special=True) == expected["ids_parse_special"], text


def test_embeddings_match_llama_cpp(case):
    """The raw pooled vectors of llama.cpp's embed(normalize=False), from llama.cpp's ids."""
    ref, model = case
    for expected in ref["texts"]:
        ours = embed_ids(model, expected["ids"], normalize=False)
        theirs = np.array(expected["embedding"], np.float32)
        assert ours.shape == theirs.shape == (ref["shape"]["dim"],)
        assert cosine(ours, theirs) > MIN_COSINE, expected["text"]
        assert np.abs(ours - theirs).max() < RAW_TOL, expected["text"]


def test_embeddings_path_matches_llama_cpp_normalized(case):
    """What /v1/embeddings and /api/embed return (embed_texts: tokenize, embed, normalize),
    against llama.cpp's embed(normalize=True), and the tokens they count."""
    ref, model = case
    texts = [t["text"] for t in ref["texts"]]
    vectors, n_tokens = embed_texts(model, texts)
    assert n_tokens == sum(len(t["ids"]) for t in ref["texts"])
    for ours, expected in zip(vectors, ref["texts"], strict=True):
        theirs = np.array(expected["normalized"], np.float32)
        assert abs(np.linalg.norm(ours) - 1.0) < 1e-5
        assert cosine(ours, theirs) > MIN_COSINE, expected["text"]
        assert np.abs(ours - theirs).max() < NORMALIZED_TOL, expected["text"]


class CausalCPU(CPUBackend):
    """The CPU backend with attention made causal: an encoder run as a decoder would run it."""

    def attention(self, q, k, v, start_pos, window, scale, softcap, out, sinks=None, causal=True):
        return super().attention(q, k, v, start_pos, window, scale, softcap, out, sinks, True)


def without_position_embeddings(encoder: Encoder) -> None:
    encoder.position_embd = None


def without_token_type(encoder: Encoder) -> None:
    encoder.type_row = None


def adjacent_pair_rope(config):
    return dataclasses.replace(config, rope_neox=False)


def no_rope(config):
    return dataclasses.replace(config, layer_rope=(False,) * config.n_layers)


def other_pooling(model, ids):
    """The other pooling (cls for a mean-pooled model, mean for a cls-pooled one)."""
    states = model.transformer.hidden_states(ids)
    return states[0] if pooling(model) == "mean" else states.mean(axis=0)


# case -> variant -> (config change, encoder change, backend class)
VARIANTS = {
    "bert": {
        "causal attention": (None, None, CausalCPU),
        "no position embeddings": (None, without_position_embeddings, CPUBackend),
        "no token type embedding": (None, without_token_type, CPUBackend),
    },
    "nomic-bert": {
        "causal attention": (None, None, CausalCPU),
        "adjacent-pair RoPE": (adjacent_pair_rope, None, CPUBackend),
        "no RoPE": (no_rope, None, CPUBackend),
    },
}


@pytest.mark.parametrize(
    ("name", "variant"),
    [(name, variant) for name, variants in VARIANTS.items() for variant in variants],
)
def test_particulars_are_what_matches(name, variant):
    """Each particular dropped: the vectors of llama.cpp are then far off (measured cosines of
    0.53-0.97 on the longest text), so the tests above would catch an encoder that lacked it."""
    change_config, change_encoder, backend_class = VARIANTS[name][variant]
    ref = reference(name)
    expected = max(ref["texts"], key=lambda t: len(t["ids"]))
    model = load_model(FIXTURES / f"{name}.gguf", device="cpu")
    try:
        config = model.config if change_config is None else change_config(model.config)
        model.transformer = Encoder(model.gguf, config, backend_class(), model.n_ctx)
        if change_encoder is not None:
            change_encoder(model.transformer)
        ours = embed_ids(model, expected["ids"], normalize=False)
        assert cosine(ours, expected["embedding"]) < 0.99
    finally:
        model.close()


@pytest.mark.parametrize("name", CASE_NAMES)
def test_pooling_is_what_matches(name):
    ref = reference(name)
    expected = max(ref["texts"], key=lambda t: len(t["ids"]))
    model = load_model(FIXTURES / f"{name}.gguf", device="cpu")
    try:
        assert cosine(other_pooling(model, expected["ids"]), expected["embedding"]) < 0.99
    finally:
        model.close()


def test_the_context_bounds_an_input():
    model = load_model(FIXTURES / "bert.gguf", n_ctx=8, device="cpu")
    try:
        assert model.n_ctx == 8
        with pytest.raises(LocalLLMError, match="more than the context of 8"):
            embed_ids(model, list(range(5, 14)))
        vectors, n_tokens = embed_texts(model, ["the model " * 10])  # cut to 8 (truncate)
        assert n_tokens == 8 and len(vectors) == 1
    finally:
        model.close()
    model = load_model(FIXTURES / "bert.gguf", n_ctx=100_000, device="cpu")
    try:  # never beyond the position table
        assert model.n_ctx == 512
    finally:
        model.close()


def test_missing_tensor_is_one_error_line(tmp_path):
    path = tmp_path / "broken.gguf"
    random_encoders.write_case(random_encoders.CASES["bert"], path, drop=("blk.1.ffn_up.bias",))
    model = load_model(path, device="cpu")  # biases are optional: a GELU MLP without one
    model.close()
    random_encoders.write_case(
        random_encoders.CASES["nomic-bert"], path, drop=("blk.0.layer_output_norm.bias",)
    )
    with pytest.raises(LocalLLMError, match="lacks the tensor 'blk.0.layer_output_norm.bias'"):
        load_model(path, device="cpu")


# -- an embedding model is not a text generator -------------------------------------------


def test_generation_is_a_clear_error():
    model = load_model(FIXTURES / "bert.gguf", device="cpu")
    try:
        with pytest.raises(LocalLLMError, match=r"bert\.gguf is an embedding model \(bert\)"):
            next(stream_generate(model, "the model"))
        with pytest.raises(LocalLLMError, match="is an embedding model"):
            chat_prompt_ids(model, [{"role": "user", "content": "hi"}])
        with pytest.raises(LocalLLMError, match="is an embedding model"):
            model.transformer.forward([5, 6], 0)
    finally:
        model.close()


def test_bench_says_it_is_an_embedding_model():
    from localllm.bench import bench

    with pytest.raises(LocalLLMError, match="is an embedding model"):
        bench(FIXTURES / "bert.gguf", "bert", n_prompt=4, n_gen=2, repetitions=1, device="cpu")


def test_run_says_it_is_an_embedding_model():
    result = CliRunner().invoke(app, ["run", str(FIXTURES / "nomic-bert.gguf"), "hello"])
    assert result.exit_code != 0
    assert "is an embedding model (nomic-bert)" in result.output
    assert "/v1/embeddings" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("name", ["bert", "nomic-bert"])
def test_support_accepts_the_embedding_architectures(name):
    from localllm.gguf import read_gguf

    assert name in support.supported_architectures()
    gguf = read_gguf(FIXTURES / f"{name}.gguf")
    try:
        types = {support.type_name(t.ggml_type) for t in gguf.tensors.values()}
        support.check_runnable(gguf.architecture, types, name, gguf.metadata)  # no error
        assert support.missing_pieces(gguf.architecture, types, gguf.metadata) == []
    finally:
        gguf.close()


# -- the server: the embeddings routes on an embedding model ------------------------------


@pytest.fixture(scope="module")
def server():
    from live_server import running_server

    models = [str(FIXTURES / "bert.gguf"), str(FIXTURES / "nomic-bert.gguf")]
    with running_server(models=models, n_ctx=None) as (url, _):
        yield url


@pytest.mark.parametrize("name", ["bert", "nomic-bert"])
def test_server_embeddings_are_llama_cpp_s(server, name):
    """/v1/embeddings (the openai client) and /api/embed give llama.cpp's normalized vectors."""
    import httpx
    import openai

    ref = reference(name)
    texts = [t["text"] for t in ref["texts"]]
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    answer = client.embeddings.create(model=name, input=texts)
    assert answer.usage.prompt_tokens == sum(len(t["ids"]) for t in ref["texts"])
    ollama_answer = httpx.post(server + "/api/embed", json={"model": name, "input": texts})
    assert ollama_answer.status_code == 200
    for item, ollama_vector, expected in zip(
        answer.data, ollama_answer.json()["embeddings"], ref["texts"], strict=True
    ):
        theirs = np.array(expected["normalized"])
        for ours in (np.array(item.embedding), np.array(ollama_vector)):
            assert cosine(ours, theirs) > MIN_COSINE
            assert np.abs(ours - theirs).max() < NORMALIZED_TOL


def test_server_refuses_to_generate_with_an_embedding_model(server):
    import httpx

    chat = {"model": "bert", "messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(server + "/v1/chat/completions", json=chat)
    assert answer.status_code == 400
    assert "is an embedding model" in answer.json()["error"]["message"]
    answer = httpx.post(server + "/v1/completions", json={"model": "bert", "prompt": [5, 6]})
    assert answer.status_code == 400 and "embedding model" in answer.json()["error"]["message"]
    answer = httpx.post(server + "/api/chat", json={**chat, "stream": False})
    assert answer.status_code == 400 and "embedding model" in answer.json()["error"]
    shown = httpx.post(server + "/api/show", json={"model": "nomic-bert"}).json()
    assert shown["capabilities"] == ["embedding"]
