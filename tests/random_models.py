"""Small random-weight GGUF models of each architecture, as llama.cpp's converter writes them.

`CASES` names one model per architecture feature worth checking against llama.cpp (RoPE
scaling, head sizes, QK-norm, ...); `write_case(case, path)` writes its GGUF file with gguf-py's
GGUFWriter, deterministically from the case's seed, and `prompts(case)` gives its fixed prompts
(token ids). scripts/make-arch-references writes each file and llama.cpp's output on it into
tests/fixtures/architectures/; tests/test_architectures.py compares localllm with that.

Tensor names and metadata keys are those of convert_hf_to_gguf.py for the architecture (the
llama3 `rope_freqs.weight` is computed as its LlamaModel.generate_extra_tensors computes it).
The vocabulary is tiny: a gpt2-style byte-level BPE (the 256 byte tokens, merges that spell a few
dozen English words) or a SentencePiece one (byte-fallback tokens <0x00>..<0xFF>, the pieces of
the same words with scores), then the architecture's special tokens.

The weights are scaled so that the models have something to say: every matrix has gain `gain`
over 1 / sqrt(n_in), q and k enough to make attention depend on position (scores of a few
units), and the output head gives logits spread by a few units, so that top-2 gaps are mostly
above 0.5 and greedy continuations do not repeat one token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType

# Words the merges spell out (with and without a leading space): enough for a few hundred tokens.
_WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "they", "you", "were", "her", "she", "there", "one", "all", "we", "model", "token", "layer",
    "position", "rotate",
)  # fmt: skip

TOKENIZERS = {
    # name: (tokenizer.ggml.pre, special tokens: bos, eos, others), as the real families have;
    # pre None: a SentencePiece vocabulary (tokenizer.ggml.model "llama"), whose third special
    # token is <unk>
    "llama3": ("llama-bpe", ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")),
    "qwen": ("qwen2", ("<|endoftext|>", "<|im_start|>", "<|im_end|>")),
    # (llama.cpp sets attributes of <|endoftext|> by name for a model named phi3: it must exist)
    "phi3": (None, ("<s>", "</s>", "<unk>", "<|endoftext|>", "<|end|>", "<|assistant|>")),
    "gemma": (None, ("<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>")),
    "granite": ("refact", ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>")),
    "olmo": ("dbrx", ("<|endoftext|>", "<|pad|>")),
    # o200k_harmony's specials (bos <|startoftext|>, eos <|return|> as the converter sets them)
    "harmony": (
        "gpt-4o",
        (
            "<|startoftext|>",
            "<|return|>",
            "<|endoftext|>",
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|channel|>",
            "<|constrain|>",
            "<|call|>",
        ),
    ),  # fmt: skip
}
ADDS_BOS = {"llama3", "gemma"}  # tokenizers whose prompts start with BOS


@dataclass(frozen=True)
class Case:
    """One random model: its shape, weight types, RoPE and prompts."""

    name: str
    arch: str  # general.architecture
    description: str
    seed: int
    n_layers: int = 2
    dim: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    ffn_dim: int = 160
    context_length: int = 2048
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tokenizer: str = "llama3"
    tied_embeddings: bool = True
    write_head_dim: bool = False  # key_length/value_length, as the converter writes for head_dim
    # GGML type per weight kind: embd, output, attn (q/k/v/o), ffn (gate/up/down). F16 keeps the
    # comparison tight: llama.cpp then rounds activations to half, where 8-bit quantized weights
    # take activations rounded to 8 bits, whose rounding flips these sharp models amplify.
    types: Mapping[str, str] = field(
        default_factory=lambda: {"embd": "F16", "output": "F16", "attn": "F16", "ffn": "F16"}
    )
    # converter's llama3 rope scaling: (factor, low_freq_factor, high_freq_factor, original ctx)
    llama3_rope: tuple[float, float, float, int] | None = None
    # rope.scaling.* metadata: ("linear" | "yarn", factor, original context length (yarn only))
    rope_scaling: tuple[str, float, int] | None = None
    # Phi-3 LongRoPE: the original context length; rope_factors_long/short and the attn factor
    # are made as the converter makes them from a long_factor / short_factor config
    longrope_original_ctx: int = 0
    sliding_window: int | None = None  # attention.sliding_window metadata, where the case has it
    softcaps: tuple[float, float] | None = None  # gemma2: attention and final logit softcapping
    # post-attention and post-FFN norm weights (gemma2): the post-norm makes an attention output
    # that averages many positions as large as any other, a small weight keeps it from drowning
    # the token's own signal (greedy would then repeat one token)
    post_norm_gains: tuple[float, float] = (1.0, 1.0)
    # granite's multipliers: embedding, attention, residual, logits (the converter's
    # embedding_multiplier, attention_multiplier, residual_multiplier, logits_scaling)
    multipliers: tuple[float, float, float, float] | None = None
    # MoE (qwen3moe, qwen2moe): experts, experts used per token, expert FFN width, shared
    # expert width (0: none); the router's logits have a spread of about router_gain
    moe: tuple[int, int, int, int] | None = None
    router_gain: float = 2.0
    prompt_lengths: tuple[int, ...] = (24, 90)
    tokenize_text: str = ""  # the sentence llama.cpp tokenizes (default: the script's)
    chat_template: str = ""  # tokenizer.chat_template, where the case has one
    qk_gain: float = 1.5  # q and k projections: output rms / input rms
    qk_norm_gain: float = 1.6  # qwen3: the per-head norm weights (score scale after QK-norm)
    # Small token embeddings (a residual stream that is mostly the last token's own embedding
    # makes a tied head predict that token again and again) and a large output norm: logits
    # spread by ~ output_norm_gain * embd_std * sqrt(dim), about 9.
    embd_std: float = 0.1
    output_norm_gain: float = 8.0


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case(
            "llama3-rope-freqs",
            "llama",
            "Llama 3.2 style: rope_freqs.weight from llama3 scaling (factor 32, low 1, high 4, "
            "original context 8192), theta 500000, head_dim 64, tied embeddings; prompts of "
            "700-1000 tokens, where the factors turn the low-frequency pairs by tenths of a radian",
            seed=1,
            n_heads=2,
            n_kv_heads=1,
            head_dim=64,
            context_length=131072,
            rope_theta=500000.0,
            llama3_rope=(32.0, 1.0, 4.0, 8192),
            prompt_lengths=(700, 1000),
        ),
        Case(
            "llama-linear",
            "llama",
            "linear RoPE scaling (rope.scaling.type linear, factor 4): positions divided by 4; "
            "prompts of 70-120 tokens",
            seed=2,
            rope_scaling=("linear", 4.0, 0),
            prompt_lengths=(70, 120),
        ),
        Case(
            "llama-yarn",
            "llama",
            "YaRN, factor 4 over an original context of 64 (ramp between pairs 0 and 5 of 16), "
            "the magnitude correction on cos/sin; prompts of 70-120 tokens",
            seed=3,
            context_length=256,
            rope_scaling=("yarn", 4.0, 64),
            prompt_lengths=(70, 120),
        ),
        Case(
            "mistral-nemo-style",
            "llama",
            "Mistral Nemo / Small style llama file: head_dim (key_length) 32 with 6 heads on a 128 "
            "embedding (q is 192 wide, not dim), theta 1e6, an untied output head",
            seed=4,
            n_heads=6,
            n_kv_heads=2,
            head_dim=32,
            rope_theta=1000000.0,
            tied_embeddings=False,
            write_head_dim=True,
            embd_std=0.8,  # an untied head needs no small embeddings
            output_norm_gain=1.0,
            ffn_dim=256,
            types={"embd": "Q8_0", "output": "Q4_0", "attn": "Q8_0", "ffn": "Q5_0"},
            prompt_lengths=(30, 100),
        ),
        Case(
            "qwen3",
            "qwen3",
            "Qwen3 style: per-head q_norm/k_norm before NeoX RoPE, no q/k/v biases, head_dim 48 "
            "with 4 heads (q is 192 wide) over 1 KV head on a 128 embedding, theta 1e6, tied "
            "embeddings",
            seed=5,
            n_heads=4,
            n_kv_heads=1,
            head_dim=48,
            context_length=40960,
            rope_theta=1000000.0,
            rms_eps=1e-6,
            tokenizer="qwen",
            write_head_dim=True,
            prompt_lengths=(30, 100),
        ),
        Case(
            "phi3",
            "phi3",
            "Phi-3.5 style: fused attn_qkv and gate+up ffn_up, LongRoPE factors with an original "
            "context of 160 (llama.cpp's context, 132 rounded up to 256, is larger: the long "
            "factors; the attn factor of a 4096 context), NeoX RoPE, tied embeddings (as "
            "Phi-4-mini), a SentencePiece vocabulary; sliding_window 16, which llama.cpp does "
            "not apply",
            seed=6,
            context_length=4096,
            longrope_original_ctx=160,
            sliding_window=16,
            tokenizer="phi3",
            prompt_lengths=(30, 100),
        ),
        Case(
            "gemma2",
            "gemma2",
            "Gemma 2 style: a sliding-window layer (window 24) then a global one, post-attention "
            "and post-FFN norms, GeGLU, embeddings scaled by sqrt(dim), q scaled by "
            "1/sqrt(head_dim) before q.k, an attention softcap of 5 (the real 50 would barely "
            "touch these scores) and the real final logit softcap of 30 on logits of ~20, tied "
            "embeddings, a SentencePiece vocabulary without a space prefix",
            seed=7,
            n_heads=4,
            n_kv_heads=2,
            head_dim=48,
            context_length=8192,
            rms_eps=1e-6,
            write_head_dim=True,
            sliding_window=24,
            softcaps=(5.0, 30.0),
            post_norm_gains=(0.3, 2.0),
            # embeddings scaled by sqrt(dim) stay small beside the sub-blocks' outputs (else the
            # tied head predicts the last token again); the output norm spreads logits to ~20
            embd_std=0.03,
            output_norm_gain=30.0,
            tokenizer="gemma",
            prompt_lengths=(30, 100),
        ),
        Case(
            "granite",
            "granite",
            "Granite 3 style: embeddings times 12, attention scores times 1/head_dim (1/32) "
            "instead of 1/sqrt(head_dim), sub-block outputs times 0.22 before the residual add, "
            "logits divided by 8; llama (adjacent-pair) RoPE, an untied head",
            seed=8,
            tied_embeddings=False,
            multipliers=(12.0, 0.03125, 0.22, 8.0),
            qk_gain=3.0,  # scores of a few units under the small attention multiplier
            tokenizer="granite",
            embd_std=0.3,
            output_norm_gain=30.0,  # logits of ~35 after the division by 8
            prompt_lengths=(30, 100),
        ),
        Case(
            "olmo2",
            "olmo2",
            "OLMo 2 style: no pre-norms, post-attention and post-FFN norms, q and k RMS-normed "
            "across all heads (norm weights of 128 and 64) before NeoX RoPE, 4 heads over 2 KV "
            "heads, an untied head",
            seed=9,
            tied_embeddings=False,
            rms_eps=1e-6,
            rope_theta=500000.0,
            tokenizer="olmo",
            embd_std=0.8,
            output_norm_gain=1.0,
            prompt_lengths=(30, 100),
        ),
        Case(
            "smollm3",
            "smollm3",
            "SmolLM3 style: 4 layers, the 4th without RoPE (llama.cpp's n_no_rope_layer_step), "
            "llama RoPE elsewhere, 4 heads of 16 over 2 KV heads on a 64 embedding, tied "
            "embeddings",
            seed=10,
            n_layers=4,
            dim=64,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            ffn_dim=96,
            context_length=65536,
            rope_theta=5000000.0,
            rms_eps=1e-6,
            prompt_lengths=(30, 100),
        ),
        Case(
            "qwen3moe",
            "qwen3moe",
            "Qwen3-30B-A3B style: 8 experts of width 64, 2 used per token with their weights "
            "renormalized, stored as 3-D Q8_0 tensors; per-head q/k norm, head_dim 32 with 4 "
            "heads (q is 128 wide) on a 64 embedding, tied embeddings",
            seed=11,
            dim=64,
            n_heads=4,
            n_kv_heads=2,
            head_dim=32,
            ffn_dim=192,
            context_length=40960,
            rope_theta=1000000.0,
            rms_eps=1e-6,
            tokenizer="qwen",
            write_head_dim=True,
            moe=(8, 2, 64, 0),
            types={"embd": "F16", "output": "F16", "attn": "F16", "ffn": "F16", "experts": "Q8_0"},
            prompt_lengths=(30, 100),
        ),
        Case(
            "qwen2moe",
            "qwen2moe",
            "Qwen2-MoE style: 8 experts of width 64, 2 used per token (weights not renormalized), "
            "a shared expert of width 128 gated by a sigmoid, q/k/v biases, 4 heads of 16 on a 64 "
            "embedding, an untied head",
            seed=12,
            dim=64,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            ffn_dim=256,
            rope_theta=1000000.0,
            rms_eps=1e-6,
            tokenizer="qwen",
            tied_embeddings=False,
            embd_std=0.8,
            output_norm_gain=1.0,
            moe=(8, 2, 64, 128),
            prompt_lengths=(30, 100),
        ),
        Case(
            "gpt-oss",
            "gpt-oss",
            "gpt-oss style: a sliding-window layer (window 16) then a global one, a sink logit "
            "per head in each softmax, q/k/v/output biases, YaRN (factor 32 over an original "
            "context of 64), NeoX RoPE; 8 experts of width 64 with biases, 2 chosen by the "
            "biased router's logits and weighted by a softmax over those two, the clamped "
            "SwiGLU; the FFN norm named post_attention_norm; 4 heads of 16 over 2 KV heads on "
            "a 64 embedding, an untied head; MXFP4 experts, as OpenAI's files have them; the o200k "
            "(gpt-4o) pre-tokenizer",
            seed=13,
            dim=64,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            ffn_dim=64,
            context_length=4096,
            rope_theta=150000.0,
            tokenizer="harmony",
            tied_embeddings=False,
            write_head_dim=True,
            rope_scaling=("yarn", 32.0, 64),
            sliding_window=16,
            embd_std=0.8,
            output_norm_gain=1.0,
            moe=(8, 2, 64, 0),
            router_gain=3.0,
            types={"embd": "F16", "output": "F16", "attn": "F16", "ffn": "F16", "experts": "MXFP4"},
            prompt_lengths=(30, 100),
            tokenize_text="The Model's layer WAS rotated 12345 times!\n\nIt's the position/token.",
            chat_template="HARMONY",
        ),
    )
}


# The F16 model scripts/make-quant-references hands to llama.cpp's quantizer, one file per
# llama.cpp file type (tests/fixtures/quants/, compared in tests/test_quant_references.py): a
# realistic width, every row a whole number of 256-weight super-blocks (else llama.cpp falls
# back to other types), one layer to keep the files small. Not in CASES: llama.cpp, not
# gguf-py, writes its quantized files.
QUANT_BASE = Case(
    "quant-base",
    "llama",
    "Llama style, dim 512, 8 heads of 64 over 2 KV heads, FFN 512, tied embeddings: the F16 "
    "model that llama.cpp quantizes",
    seed=23,
    n_layers=1,
    dim=512,
    n_heads=8,
    n_kv_heads=2,
    head_dim=64,
    ffn_dim=512,
    rope_theta=500000.0,
    # with one layer, qk_gain 2.0 left some file's 24-step greedy continuation on 1-6 distinct
    # tokens for each of six seeds tried; 4.0 with this seed keeps 11-24 in every file, as the
    # two-layer base had
    qk_gain=4.0,
    # logits of 10-25 at the top: the differences 8-bit activations make (a value near a rounding
    # boundary flips a level) stay a few tenths
    output_norm_gain=2.0,
    prompt_lengths=(30, 100),
)


# ---- vocabulary ----


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character map (bytes_to_unicode), in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    types: list[int]
    scores: list[float] | None  # SentencePiece only
    merges: list[str] | None  # BPE only
    bos_id: int
    eos_id: int
    first_special: int  # ids below are ordinary tokens

    @property
    def spm(self) -> bool:
        return self.merges is None


def _word_prefixes(space: str) -> list[str]:
    """Every prefix (of two characters or more) of every word, with and without `space` before
    it, in order of first appearance: each one joins two tokens of the vocabulary."""
    pieces, known = [], set()
    for word in _WORDS:
        for spelled in (word, space + word):
            for end in range(2, len(spelled) + 1):
                if spelled[:end] not in known:
                    pieces.append(spelled[:end])
                    known.add(spelled[:end])
    return pieces


def vocabulary(tokenizer: str) -> Vocabulary:
    """The tokenizer's vocabulary: base tokens, one merge (BPE) or piece (SentencePiece) per
    word prefix, then the special tokens."""
    pre, specials = TOKENIZERS[tokenizer]
    if pre is None:  # SentencePiece: byte fallback, single characters, word pieces
        tokens = [f"<0x{b:02X}>" for b in range(256)]
        types = [gguf.TokenType.BYTE] * 256
        chars = sorted({ch for word in _WORDS for ch in word} | {"▁"})
        pieces = chars + _word_prefixes("▁")
        tokens += pieces
        types += [gguf.TokenType.NORMAL] * len(pieces)
        # longer pieces score higher, so that words merge whole
        scores = [0.0] * 256 + [-10.0 + 0.5 * len(p) - 1e-3 * i for i, p in enumerate(pieces)]
        merges = None
    else:
        byte_chars = _byte_chars()
        tokens, merges = list(byte_chars), []
        for piece in _word_prefixes(byte_chars[ord(" ")]):
            merges.append(f"{piece[:-1]} {piece[-1]}")
            tokens.append(piece)
        types = [gguf.TokenType.NORMAL] * len(tokens)
        scores = None
    first_special = len(tokens)
    tokens += list(specials)
    types += [gguf.TokenType.CONTROL] * len(specials)
    if pre is None:
        types[first_special + 2] = gguf.TokenType.UNKNOWN
        scores += [0.0] * len(specials)
    return Vocabulary(
        tokens,
        [int(t) for t in types],
        scores,
        merges,
        first_special,
        first_special + 1,
        first_special,
    )


def n_normal_tokens(case: Case) -> int:
    """Ids below this are ordinary tokens (prompts are drawn from them)."""
    return vocabulary(case.tokenizer).first_special


# ---- weights ----


def llama3_rope_freqs(
    head_dim: int, theta: float, factor: float, low: float, high: float, old_ctx: int
) -> np.ndarray:
    """float32[head_dim // 2] as convert_hf_to_gguf.py's LlamaModel computes rope_freqs for
    rope_type llama3 (in float32, as its torch code does)."""
    f32 = np.float32
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / f32(head_dim)
    freqs = (f32(1.0) / (f32(theta) ** exponents)).astype(np.float32)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    factors = []
    for freq in freqs:
        wavelen = f32(2 * math.pi) / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (f32(old_ctx) / wavelen - f32(low)) / f32(high - low)
            factors.append(f32(1.0) / ((f32(1.0) - smooth) / f32(factor) + smooth))
    return np.array(factors, dtype=np.float32)


def _weights(case: Case, rng: np.random.Generator) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (GGML type name, float32 array in numpy order (n_out, n_in))."""
    c = case
    n_vocab = len(vocabulary(c.tokenizer).tokens)
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim

    def matrix(n_out, n_in, gain):
        return (rng.standard_normal((n_out, n_in)) * (gain / math.sqrt(n_in))).astype(np.float32)

    def norm(n, spread=0.1, center=1.0):
        return (center + rng.standard_normal(n) * spread).astype(np.float32)

    embd = (rng.standard_normal((n_vocab, c.dim)) * c.embd_std).astype(np.float32)
    tensors = {"token_embd.weight": (c.types["embd"], embd)}
    tensors["output_norm.weight"] = (
        "F32",
        norm(c.dim, 0.1 * c.output_norm_gain, c.output_norm_gain),
    )
    if not c.tied_embeddings:
        out = matrix(n_vocab, c.dim, c.embd_std * math.sqrt(c.dim))
        tensors["output.weight"] = (c.types.get("output", "F16"), out)
    if c.llama3_rope is not None:
        tensors["rope_freqs.weight"] = (
            "F32",
            llama3_rope_freqs(c.head_dim, c.rope_theta, *c.llama3_rope),
        )
    if c.longrope_original_ctx:
        long, short = longrope_factors(c.head_dim // 2, rng)
        tensors["rope_factors_long.weight"] = ("F32", long)
        tensors["rope_factors_short.weight"] = ("F32", short)
    attn, ffn = c.types["attn"], c.types.get("ffn", c.types["attn"])
    fused = c.arch == "phi3"  # Phi3MiniModel keeps qkv_proj and gate_up_proj whole
    post_norms = c.arch in ("gemma2", "olmo2")
    pre_norms = c.arch != "olmo2"
    oss = c.arch == "gpt-oss"
    for i in range(c.n_layers):
        p = f"blk.{i}."
        if pre_norms:
            tensors[p + "attn_norm.weight"] = ("F32", norm(c.dim))
        q = matrix(q_dim, c.dim, c.qk_gain)
        k = matrix(kv_dim, c.dim, c.qk_gain)
        v = matrix(kv_dim, c.dim, 1.0)
        if fused:
            tensors[p + "attn_qkv.weight"] = (attn, np.concatenate([q, k, v]))
        else:
            tensors[p + "attn_q.weight"] = (attn, q)
            tensors[p + "attn_k.weight"] = (attn, k)
            tensors[p + "attn_v.weight"] = (attn, v)
        if c.arch in ("qwen2moe", "gpt-oss"):  # q/k/v biases
            for name, n in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                bias = (rng.standard_normal(n) * 0.2).astype(np.float32)
                tensors[p + f"attn_{name}.bias"] = ("F32", bias)
        tensors[p + "attn_output.weight"] = (attn, matrix(c.dim, q_dim, 1.0))
        if oss:  # the output bias, and a sink logit per head of about the scores' size
            tensors[p + "attn_output.bias"] = ("F32", norm(c.dim, 0.2, 0.0))
            tensors[p + "attn_sinks.weight"] = ("F32", norm(c.n_heads, 1.0, 1.0))
        if c.arch == "olmo2":  # q and k normalized across heads
            tensors[p + "attn_q_norm.weight"] = ("F32", norm(q_dim, 0.2, c.qk_norm_gain))
            tensors[p + "attn_k_norm.weight"] = ("F32", norm(kv_dim, 0.2, c.qk_norm_gain))
        if post_norms:
            gain = c.post_norm_gains[0]
            tensors[p + "post_attention_norm.weight"] = ("F32", norm(c.dim, 0.1 * gain, gain))
        if c.arch in ("qwen3", "qwen3moe"):
            tensors[p + "attn_q_norm.weight"] = ("F32", norm(c.head_dim, 0.2, c.qk_norm_gain))
            tensors[p + "attn_k_norm.weight"] = ("F32", norm(c.head_dim, 0.2, c.qk_norm_gain))
        if pre_norms:  # gpt-oss's FFN norm is post_attention_norm (llama.cpp's attn_post_norm)
            tensors[p + ("post_attention_norm" if oss else "ffn_norm") + ".weight"] = (
                "F32",
                norm(c.dim),
            )
        if c.moe is not None:
            tensors.update(_moe_weights(c, p, matrix))
            continue
        gate = matrix(c.ffn_dim, c.dim, 1.0)
        up = matrix(c.ffn_dim, c.dim, 1.0)
        if fused:  # gate rows first, as HF's gate_up_proj.chunk(2) and ggml_swiglu split it
            tensors[p + "ffn_up.weight"] = (ffn, np.concatenate([gate, up]))
        else:
            tensors[p + "ffn_gate.weight"] = (ffn, gate)
            tensors[p + "ffn_up.weight"] = (ffn, up)
        tensors[p + "ffn_down.weight"] = (ffn, matrix(c.dim, c.ffn_dim, 1.0))
        if post_norms:
            gain = c.post_norm_gains[1]
            tensors[p + "post_ffw_norm.weight"] = ("F32", norm(c.dim, 0.1 * gain, gain))
    return tensors


def _moe_weights(c: Case, p: str, matrix) -> dict[str, tuple[str, np.ndarray]]:
    """One layer's router (F32, as the converter keeps ffn_gate_inp), experts stacked into 3-D
    tensors [n_experts, n_out, n_in] as Qwen2MoeModel stacks them, and the shared expert."""
    n_experts, _, n_ff, n_shared = c.moe
    kind = c.types.get("experts", c.types["ffn"])
    tensors = {p + "ffn_gate_inp.weight": ("F32", matrix(n_experts, c.dim, c.router_gain))}
    biased = c.arch == "gpt-oss"  # GptOssModel: biases on the router and every expert matrix
    if biased:
        router_bias = matrix(1, n_experts, c.router_gain * 0.5)[0]
        tensors[p + "ffn_gate_inp.bias"] = ("F32", router_bias)
    for name, (n_out, n_in) in (
        ("gate", (n_ff, c.dim)),
        ("up", (n_ff, c.dim)),
        ("down", (c.dim, n_ff)),
    ):
        # gpt-oss's gate runs up to its clamp (7): gates of a few units
        gain = 3.0 if biased and name == "gate" else 1.0
        stacked = np.stack([matrix(n_out, n_in, gain) for _ in range(n_experts)])
        tensors[p + f"ffn_{name}_exps.weight"] = (kind, stacked)
        if biased:
            bias = (matrix(n_experts, n_out, 1.0) * 0.3 * math.sqrt(n_out)).astype(np.float32)
            tensors[p + f"ffn_{name}_exps.bias"] = ("F32", bias)
    if n_shared:
        tensors[p + "ffn_gate_inp_shexp.weight"] = ("F32", matrix(1, c.dim, 1.0))
        ffn = c.types["ffn"]
        tensors[p + "ffn_gate_shexp.weight"] = (ffn, matrix(n_shared, c.dim, 1.0))
        tensors[p + "ffn_up_shexp.weight"] = (ffn, matrix(n_shared, c.dim, 1.0))
        tensors[p + "ffn_down_shexp.weight"] = (ffn, matrix(c.dim, n_shared, 1.0))
    return tensors


def longrope_factors(n_pairs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(long, short) float32[n_pairs]: LongRoPE's per-pair divisors of the angles, rising with
    the pair's wavelength as Phi-3's do (long up to ~30, short up to ~2), with some noise."""
    ramp = np.linspace(0.0, 1.0, n_pairs)
    long = np.exp(ramp**2 * math.log(30.0)) * (1.0 + 0.05 * rng.standard_normal(n_pairs))
    short = 1.0 + ramp**3 * (1.0 + 0.1 * rng.standard_normal(n_pairs))
    return np.maximum(long, 1.0).astype(np.float32), np.maximum(short, 1.0).astype(np.float32)


def longrope_attn_factor(context_length: int, original_ctx: int) -> float:
    """The converter's Phi3MiniModel attn_factor for rope type longrope."""
    scale = context_length / original_ctx
    return math.sqrt(1 + math.log(scale) / math.log(original_ctx)) if scale > 1.0 else 1.0


# ---- the file ----


def case_weights(case: Case) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (GGML type name, float32 array in numpy order (n_out, n_in)): what write_case
    writes for the case, before its types are applied."""
    return _weights(case, np.random.default_rng(case.seed))


def write_case(
    case: Case,
    path: str | Path,
    drop: tuple[str, ...] = (),
    quantized: Mapping[str, tuple[str, np.ndarray]] | None = None,
    file_type: int = gguf.LlamaFileType.MOSTLY_F16,
) -> None:
    """Write the case's GGUF file (tensors named in `drop` left out, for error tests; those in
    `quantized`, name -> (GGML type name, raw uint8 rows), written as given, with `file_type`:
    scripts/make-quant-references quantizes with llama.cpp's quantizer itself)."""
    c = case
    vocab = vocabulary(c.tokenizer)
    tensors = case_weights(c)
    writer = gguf.GGUFWriter(str(path), c.arch)
    writer.add_name(c.name)
    writer.add_context_length(c.context_length)
    writer.add_embedding_length(c.dim)
    writer.add_feed_forward_length(c.ffn_dim)
    writer.add_block_count(c.n_layers)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.n_kv_heads)
    if c.arch != "gemma2":  # Gemma2Model writes no rope_theta (llama.cpp's default, 10000)
        writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_eps)
    if c.write_head_dim:
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    if c.rope_scaling is not None:
        kind, factor, original_ctx = c.rope_scaling
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(factor)
        if kind == "yarn":
            writer.add_rope_scaling_orig_ctx_len(original_ctx)
    if c.arch in ("llama", "granite", "smollm3"):  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(len(vocab.tokens))
        writer.add_rope_dimension_count(c.head_dim)
    if c.moe is not None:  # TextModel and Qwen2MoeModel.set_gguf_parameters
        n_experts, n_used, n_ff, n_shared = c.moe
        writer.add_expert_count(n_experts)
        writer.add_expert_used_count(n_used)
        writer.add_expert_feed_forward_length(n_ff)
        if n_shared:
            writer.add_expert_shared_feed_forward_length(n_shared)
    if c.multipliers is not None:  # GraniteModel.set_gguf_parameters
        embedding, attention, residual, logits = c.multipliers
        writer.add_attention_scale(attention)
        writer.add_embedding_scale(embedding)
        writer.add_residual_scale(residual)
        writer.add_logit_scale(logits)
    if c.arch == "phi3":  # Phi3MiniModel.set_gguf_parameters
        writer.add_rope_scaling_orig_ctx_len(c.longrope_original_ctx or c.context_length)
        writer.add_rope_dimension_count(c.head_dim)
        if c.longrope_original_ctx:  # generate_extra_tensors, for a long_factor config
            attn_factor = longrope_attn_factor(c.context_length, c.longrope_original_ctx)
            writer.add_rope_scaling_attn_factors(attn_factor)
    writer.add_file_type(file_type)
    if c.softcaps is not None:  # Gemma2Model.set_gguf_parameters
        writer.add_attn_logit_softcapping(c.softcaps[0])
        writer.add_final_logit_softcapping(c.softcaps[1])
    if c.sliding_window is not None:
        writer.add_sliding_window(c.sliding_window)
    _write_vocabulary(writer, c.tokenizer, vocab)
    if c.chat_template:
        harmony = c.chat_template == "HARMONY"
        writer.add_chat_template(HARMONY_TEMPLATE if harmony else c.chat_template)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, (type_name, array) in tensors.items():
        if name in drop:
            continue
        if quantized is not None and name in quantized:
            type_name, raw = quantized[name]
            writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[type_name])
            continue
        qtype = GGMLQuantizationType[type_name]
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            raw = gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# A harmony chat template of this project's own, in the shape of gpt-oss's (system and developer
# messages, tools as a TypeScript-like namespace, assistant messages on the final channel, calls
# on commentary to=functions.NAME, tool results from functions.NAME), ending an assistant turn
# with <|start|>assistant as the real one does.
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>You are a helpful assistant.\nReasoning: "
    "{{ reasoning_effort | default('medium') }}\n\n# Valid channels: analysis, commentary, "
    "final. Channel must be included for every message.<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\n"
    "namespace functions {\n"
    "{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "\n// {{ f.description | default('') }}\ntype {{ f.name }} = (_: "
    "{{ f.parameters | tojson }}) => any;\n{% endfor %}\n} // namespace functions<|end|>"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'system' or m.role == 'developer' %}"
    "<|start|>developer<|message|># Instructions\n\n{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' and m.tool_calls %}"
    "{%- for call in m.tool_calls %}{%- set f = call.function if call.function is defined "
    "else call %}<|start|>assistant to=functions.{{ f.name }}<|channel|>commentary json"
    "<|message|>{{ f.arguments | tojson }}<|call|>{%- endfor %}"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name | default('tool') }} "
    "to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)


def _write_vocabulary(writer: gguf.GGUFWriter, tokenizer: str, vocab: Vocabulary) -> None:
    """tokenizer.ggml.* as the converter's _set_vocab_gpt2 / _set_vocab_sentencepiece write it."""
    pre, _ = TOKENIZERS[tokenizer]
    writer.add_tokenizer_model("llama" if vocab.spm else "gpt2")
    writer.add_tokenizer_pre(pre or "default")
    writer.add_token_list(vocab.tokens)
    if vocab.spm:
        writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    if not vocab.spm:
        writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    if vocab.spm:
        writer.add_unk_token_id(vocab.first_special + 2)
    writer.add_add_bos_token(tokenizer in ADDS_BOS)
    if tokenizer == "gemma":  # GemmaModel / Gemma2Model.set_vocab
        writer.add_add_space_prefix(False)


def prompts(case: Case) -> list[list[int]]:
    """The case's fixed prompts: random ordinary tokens (after BOS where the family adds one)."""
    rng = np.random.default_rng(1000 + case.seed)
    bos_id = vocabulary(case.tokenizer).bos_id
    out = []
    for n in case.prompt_lengths:
        ids = rng.integers(0, n_normal_tokens(case), n).tolist()
        out.append([bos_id, *ids[1:]] if case.tokenizer in ADDS_BOS else ids)
    return out


def metadata_summary(case: Case) -> dict[str, Any]:
    """What the reference file records about the case (for a reader, not for the test)."""
    summary = {
        "arch": case.arch,
        "description": case.description,
        "shape": {
            "n_layers": case.n_layers,
            "dim": case.dim,
            "n_heads": case.n_heads,
            "n_kv_heads": case.n_kv_heads,
            "head_dim": case.head_dim,
            "ffn_dim": case.ffn_dim,
            "n_vocab": len(vocabulary(case.tokenizer).tokens),
        },
        "types": dict(case.types),
        "rope_theta": case.rope_theta,
        "llama3_rope": case.llama3_rope,
        "rope_scaling": case.rope_scaling,
    }
    # features only some cases have, recorded where set (the older references lack the keys)
    extra = {
        "longrope_original_ctx": case.longrope_original_ctx,
        "sliding_window": case.sliding_window,
        "softcaps": case.softcaps,
        "multipliers": case.multipliers,
        "moe": case.moe,
        "tokenize_text": case.tokenize_text,
    }
    summary.update({k: v for k, v in extra.items() if v})
    return summary
