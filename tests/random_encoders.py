"""Small random-weight embedding models (encoders), as llama.cpp's converter writes them.

The sibling of random_models.py for the architectures that make embeddings rather than text:
`bert` (BERT, bge, all-MiniLM, mxbai-embed: absolute position embeddings, GELU MLP, biases
everywhere) and `nomic-bert` (nomic-embed-text: RoPE, fused attn_qkv, SwiGLU MLP, no biases on
the matrices). `write_case(case, path)` writes a case's GGUF file with gguf-py's GGUFWriter,
deterministically from its seed; scripts/make-arch-references --embeddings records llama.cpp's
embeddings and token ids for `TEXTS` beside it; tests/test_embedding_architectures.py compares.

Tensor names, metadata keys and the vocabulary follow convert_hf_to_gguf.py's BertModel and
NomicBertModel: the WordPiece vocabulary is stored with its word-start pieces prefixed by "▁" and
its "##" continuation pieces bare (the converter's "phantom space" vocabulary), [PAD] [UNK]
[CLS] [SEP] [MASK] are control tokens, [CLS] and [SEP] double as BOS and EOS and are added
around every input (add_bos_token, add_eos_token: the converter's reading of BERT's
TemplateProcessing), and `tokenizer.ggml.token_type_count` sizes the token type embeddings.
The special tokens sit at ids 0-4, not at BERT's 100-103 (llama.cpp's defaults), so that a
tokenizer that ignored the metadata ids would be caught.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(5)

_WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "from", "at", "which", "but", "have", "an", "they",
    "model", "token", "layer", "position", "embed", "text", "search", "query", "document",
    "sentence", "cafe", "naive", "un", "re",
)  # fmt: skip
_SUFFIXES = ("ed", "ing", "er", "ly", "tion", "ment", "ding", "dings", "ness", "able")
_PUNCTUATION = tuple(".,;:!?'\"()-[]/$+<=>")

# Texts whose tokenization exercises WordPiece as llama.cpp does it: case folding, punctuation
# and ASCII symbols split off, NFD (an accent becomes its own combining mark, kept), CJK
# characters as words, words that no pieces spell (one [UNK]), runs of whitespace.
TEXTS = (
    "search_query: What is the position of a token?",
    "The Model embeds sentences, and the layers are not causal!",
    "re-embedding documents: querying (naively) at $5 + 3 = <8>...",
    "Café naïve   text\twith\nwhitespace, 東京 and 🙂 unknowns; xyzzy",
    "it",
)
# More tokenization only (their embeddings would say nothing more): special-token texts, read
# as text and (parse_special) as the tokens, full-width and compatibility characters, NBSP and
# ideographic spaces, NUL, BEL and a BOM (dropped), Greek with a iota subscript.
TOKENIZE_TEXTS = (
    "[CLS] the [SEP] model [MASK]",
    "x[UNK]y",
    "ＡＢＣ ｔｈｅ",
    "the\u00a0model\u3000text",
    'TOKEN\'s "layer" — ok',
    "\x00a\x07b\ufeffc",
    "ῼ Ǆ ǅ Ⅻ ① ²",
)


@dataclass(frozen=True)
class Case:
    """One random encoder: its shape and how it pools."""

    name: str
    arch: str  # general.architecture: "bert" or "nomic-bert"
    description: str
    seed: int
    n_layers: int = 2
    dim: int = 64
    n_heads: int = 4
    ffn_dim: int = 128
    context_length: int = 512
    pooling: int = 1  # {arch}.pooling_type: 1 mean, 2 cls
    rope_theta: float = 1000.0  # nomic-bert only
    norm_eps: float = 1e-12
    n_token_types: int = 2
    matrix_type: str = "F16"  # the 2-D weights' GGML type (norms, biases, token types: F32)


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case(
            "bert",
            "bert",
            "bge / all-MiniLM style BERT: absolute position and token type embeddings, "
            "LayerNorm after the embeddings and after each residual, separate q/k/v with biases, "
            "GELU MLP with biases, bidirectional attention, mean pooling",
            seed=101,
        ),
        Case(
            "bert-cls",
            "bert",
            "bge-base style BERT pooled at [CLS] (pooling_type 2), 6 heads of 16 on a 96 "
            "embedding, Q8_0 matrices (embeddings included), as the common Q8_0 files have them",
            seed=102,
            dim=96,
            n_heads=6,
            ffn_dim=192,
            pooling=2,
            matrix_type="Q8_0",
        ),
        Case(
            "nomic-bert",
            "nomic-bert",
            "nomic-embed-text style: fused attn_qkv without bias, NeoX RoPE (theta 1000) instead "
            "of position embeddings, SwiGLU MLP without biases, post-LayerNorms with biases, "
            "mean pooling, a 2048 context",
            seed=103,
            context_length=2048,
            norm_eps=1e-12,
        ),
    )
}


# ---- vocabulary ----


def vocabulary() -> list[str]:
    """The GGUF token list: specials, then word-start pieces ("▁x") and continuations ("x")."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789")
    tokens = list(SPECIALS)
    tokens += ["▁" + ch for ch in letters + list(_PUNCTUATION) + ["東", "京"]]
    tokens += letters + ["\u0301", "\u0308"]  # continuations, the combining acute and diaeresis
    tokens += ["▁" + word for word in _WORDS]
    tokens += list(_SUFFIXES) + ["ve", "iv", "ai"]
    return tokens


def token_types(tokens: list[str]) -> list[int]:
    return [int(gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL) for t in tokens]


# ---- weights ----


def _weights(case: Case, rng: np.random.Generator) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (GGML type name, float32 array in numpy order (n_out, n_in))."""
    c = case
    n_vocab = len(vocabulary())

    def matrix(n_out, n_in, gain=1.0):
        return (rng.standard_normal((n_out, n_in)) * (gain / math.sqrt(n_in))).astype(np.float32)

    def vector(n, spread=0.1, center=0.0):
        return (center + rng.standard_normal(n) * spread).astype(np.float32)

    kind = c.matrix_type
    tensors = {
        "token_embd.weight": (kind, rng.standard_normal((n_vocab, c.dim)).astype(np.float32)),
        "token_types.weight": ("F32", vector(c.n_token_types * c.dim, 0.5).reshape(-1, c.dim)),
    }
    if c.arch == "bert":
        positions = rng.standard_normal((c.context_length, c.dim)) * 0.5
        tensors["position_embd.weight"] = (kind, positions.astype(np.float32))
    tensors["token_embd_norm.weight"] = ("F32", vector(c.dim, 0.1, 1.0))
    tensors["token_embd_norm.bias"] = ("F32", vector(c.dim))
    biases = c.arch == "bert"
    for i in range(c.n_layers):
        p = f"blk.{i}."
        q, k, v = matrix(c.dim, c.dim, 2.0), matrix(c.dim, c.dim, 2.0), matrix(c.dim, c.dim)
        if c.arch == "bert":
            for name, w in (("q", q), ("k", k), ("v", v)):
                tensors[p + f"attn_{name}.weight"] = (kind, w)
                tensors[p + f"attn_{name}.bias"] = ("F32", vector(c.dim, 0.2))
        else:
            tensors[p + "attn_qkv.weight"] = (kind, np.concatenate([q, k, v]))
        tensors[p + "attn_output.weight"] = (kind, matrix(c.dim, c.dim))
        if biases:
            tensors[p + "attn_output.bias"] = ("F32", vector(c.dim))
        tensors[p + "attn_output_norm.weight"] = ("F32", vector(c.dim, 0.1, 1.0))
        tensors[p + "attn_output_norm.bias"] = ("F32", vector(c.dim))
        tensors[p + "ffn_up.weight"] = (kind, matrix(c.ffn_dim, c.dim, 2.0))
        if biases:
            tensors[p + "ffn_up.bias"] = ("F32", vector(c.ffn_dim, 0.3))
        else:
            tensors[p + "ffn_gate.weight"] = (kind, matrix(c.ffn_dim, c.dim, 2.0))
        tensors[p + "ffn_down.weight"] = (kind, matrix(c.dim, c.ffn_dim))
        if biases:
            tensors[p + "ffn_down.bias"] = ("F32", vector(c.dim))
        tensors[p + "layer_output_norm.weight"] = ("F32", vector(c.dim, 0.1, 1.0))
        tensors[p + "layer_output_norm.bias"] = ("F32", vector(c.dim))
    return tensors


# ---- the file ----


def write_case(case: Case, path: str | Path, drop: tuple[str, ...] = ()) -> None:
    """Write the case's GGUF file (tensors named in `drop` left out, for error tests)."""
    c = case
    rng = np.random.default_rng(c.seed)
    tokens = vocabulary()
    tensors = _weights(c, rng)
    writer = gguf.GGUFWriter(str(path), c.arch)
    writer.add_name(c.name)
    # TextModel.set_gguf_parameters, then BertModel's (and NomicBertModel's rope base)
    writer.add_block_count(c.n_layers)
    writer.add_context_length(c.context_length)
    writer.add_embedding_length(c.dim)
    writer.add_feed_forward_length(c.ffn_dim)
    writer.add_head_count(c.n_heads)
    writer.add_layer_norm_eps(c.norm_eps)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{c.matrix_type}"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(c.pooling))
    if c.arch == "nomic-bert":
        writer.add_rope_freq_base(c.rope_theta)
    # BertModel.set_vocab: token type count, the phantom-space vocabulary, SpecialVocab
    writer.add_token_type_count(c.n_token_types)
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types(tokens))
    writer.add_bos_token_id(CLS_ID)
    writer.add_eos_token_id(SEP_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_sep_token_id(SEP_ID)
    writer.add_pad_token_id(PAD_ID)
    writer.add_mask_token_id(MASK_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, (type_name, array) in tensors.items():
        if name in drop:
            continue
        if type_name == "F32":
            writer.add_tensor(name, array)
        elif type_name == "F16":
            writer.add_tensor(name, array.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[type_name]
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def metadata_summary(case: Case) -> dict[str, Any]:
    """What the reference file records about the case (for a reader, not for the test)."""
    return {
        "arch": case.arch,
        "description": case.description,
        "shape": {
            "n_layers": case.n_layers,
            "dim": case.dim,
            "n_heads": case.n_heads,
            "ffn_dim": case.ffn_dim,
            "n_vocab": len(vocabulary()),
            "context_length": case.context_length,
        },
        "pooling_type": case.pooling,
        "matrix_type": case.matrix_type,
    }
