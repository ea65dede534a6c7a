"""Tokenizers built from a GGUF vocab that give llama.cpp's token ids.

Three families, all driven by `tokenizer.ggml.*` metadata:

- ``gpt2``: byte-level BPE. The merge loop is the `tokenizers` library's `models.BPE`, built in
  memory from the GGUF tokens and merges; the pre-tokenizer is the split regex llama.cpp uses for
  the file's `tokenizer.ggml.pre` (see `_BPE_PRE_TOKENIZERS`).
- ``llama``: SentencePiece BPE (merge by piece score, byte fallback). The merge loop is the
  `sentencepiece` library, fed a ModelProto serialised by hand from the GGUF pieces (protobuf is
  not a dependency; the message is three small records).
- ``bert``: WordPiece (BERT, bge, nomic-embed), as llama.cpp's llm_tokenizer_wpm: a greedy
  longest match over the converter's "phantom space" vocabulary (word starts carry "▁",
  continuations are bare), after llama.cpp's own normalization (`_WordPiece`).

Around both, the parts llama.cpp does itself are reproduced here: special and user-defined tokens
are cut out of the raw text before the merge step (`_partition`), BOS/EOS/space-prefix handling,
the end-of-generation token set, and the per-token rendering used for decoding.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import sentencepiece
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from localllm.errors import LocalLLMError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_UNDEFINED = 0
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Token texts llama.cpp treats as end of generation whatever the metadata says
# (llama_vocab::impl::load, "maintain a list of tokens that cause end-of-generation").
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    }
)
# Control tokens llama.cpp always renders in output ("quick hack for gpt-oss"): the harmony
# format's structure, which its reply parser reads (harmony.py).
ALWAYS_RENDERED = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})
# Tokens llama.cpp finds by text when the metadata key does not name them, as
# (metadata key, candidate texts, ends generation). Found ones are typed CONTROL; FIM
# pad/repo/file-separator tokens end a generation, FIM prefix/suffix/middle do not.
_AUTO_SPECIAL_IDS = (
    ("tokenizer.ggml.eot_token_id", ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                                     "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
                                     "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"), True),
    ("tokenizer.ggml.eom_token_id", ("<|eom_id|>",), True),
    ("tokenizer.ggml.fim_pre_token_id", ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
                                         "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
                                         "<|prefix|>"), False),
    ("tokenizer.ggml.fim_suf_token_id", ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
                                         "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
                                         "<|suffix|>"), False),
    ("tokenizer.ggml.fim_mid_token_id", ("<|fim_middle|>", "<fim-middle>", "<fim_middle>",
                                         "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
                                         "<|middle|>"), False),
    ("tokenizer.ggml.fim_pad_token_id", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
                                         "[PAD]"), True),
    ("tokenizer.ggml.fim_rep_token_id", ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
                                         "<REPO>", "<reponame>"), True),
    ("tokenizer.ggml.fim_sep_token_id", ("<|file_sep|>",), True),
)  # fmt: skip

# llama.cpp's split regexes (src/llama-vocab.cpp, llm_tokenizer_bpe). Each is applied in turn,
# keeping both the matches and the text between them, before the byte-level mapping.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (GPT-4o, gpt-oss, Phi-4-mini): words with their case classes, contractions folded in
_CASED_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _CASED_CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _CASED_CONTRACTIONS
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT_REGEXES = (
    r"[\p{P}\$\+<=>\^~\|]+",
    _GPT2_REGEX,
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)


class _BpePre:
    """How llama.cpp pre-tokenizes one `tokenizer.ggml.pre` family."""

    def __init__(
        self, regexes: tuple[str, ...], ignore_merges: bool = False, add_bos: bool = False
    ) -> None:
        self.regexes = regexes
        # llama 3 style: a whole pre-token found in the vocab is used as is, merges skipped
        self.ignore_merges = ignore_merges
        self.add_bos = add_bos


_LLAMA3 = _BpePre((_LLAMA3_REGEX,), ignore_merges=True, add_bos=True)
_GPT2 = _BpePre((_GPT2_REGEX,))
_DIGITS_THEN_GPT2 = _BpePre((r"\p{N}", _GPT2_REGEX))
_QWEN2 = _BpePre((_QWEN2_REGEX,))

# tokenizer.ggml.pre -> pre-tokenizer, as llama_vocab::impl::load maps them
_BPE_PRE_TOKENIZERS: dict[str, _BpePre] = {
    "default": _BpePre(_DEFAULT_REGEXES),
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "pixtral": _LLAMA3,
    "dbrx": _BpePre((_LLAMA3_REGEX,)),
    "smaug-bpe": _BpePre((_LLAMA3_REGEX,)),
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "jais": _GPT2,
    "roberta-bpe": _GPT2,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "exaone": _DIGITS_THEN_GPT2,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "stablelm2": _QWEN2,
    "megrez": _QWEN2,
    "gpt-4o": _BpePre((_GPT4O_REGEX,)),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabs."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def unsupported_tokenizer(metadata: Mapping[str, Any]) -> str | None:
    """What localllm lacks to build this file's tokenizer, in words (None: nothing), from the
    metadata alone: read before a download (support.py) as well as at load."""
    model = metadata.get("tokenizer.ggml.model")
    if model in ("llama", "bert"):
        return None
    if model == "gpt2":
        pre_name = metadata.get("tokenizer.ggml.pre") or "default"
        if pre_name in _BPE_PRE_TOKENIZERS:
            return None
        return f"unsupported BPE pre-tokenizer {pre_name!r} (tokenizer.ggml.pre)"
    return f"unsupported tokenizer model {model!r} (tokenizer.ggml.model)"


_BYTE_LEVEL_DECODE = {ch: b for b, ch in _bytes_to_unicode().items()}


class _ByteLevelBpe:
    """gpt2-type merges: the `tokenizers` BPE model behind llama.cpp's split regexes."""

    def __init__(self, tokens: list[str], merges: list[str], pre: _BpePre) -> None:
        vocab = {text: i for i, text in enumerate(tokens)}
        pairs = []
        for merge in merges:
            # llama.cpp splits at the first space after position 0
            cut = merge.find(" ", 1)
            if cut < 0:
                continue
            left, right = merge[:cut], merge[cut + 1 :]
            # `tokenizers` rejects merges outside the vocab; llama.cpp could never emit them either
            if left in vocab and right in vocab and left + right in vocab:
                pairs.append((left, right))
        model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges)
        self._hf = HFTokenizer(model)
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        self._hf.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    @staticmethod
    def piece(text: str) -> bytes:
        # characters outside the byte table cannot come from the byte-level mapping; llama.cpp
        # prints a marker for them, UTF-8 keeps the text readable instead
        table = _BYTE_LEVEL_DECODE
        return b"".join(bytes((table[ch],)) if ch in table else ch.encode("utf-8") for ch in text)


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32 fields are written as 10-byte two's complement
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field_varint(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _field_bytes(field: int, data: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(data)) + data


# sentencepiece_model.proto: SentencePiece.Type
_SP_NORMAL, _SP_UNKNOWN, _SP_BYTE = 1, 2, 6


def _sentencepiece_model_proto(
    tokens: list[str], scores: np.ndarray, token_types: np.ndarray, unk_id: int
) -> bytes:
    """Serialise a BPE ModelProto whose piece ids are the GGUF token ids.

    llama.cpp's SPM merge accepts any vocab entry as a merge result, whatever its type, so every
    piece is NORMAL here except the byte pieces (byte fallback) and the one UNKNOWN piece
    sentencepiece insists on. Control and user-defined texts are cut out before this model runs.
    """
    types = np.where(np.asarray(token_types) == TOKEN_BYTE, _SP_BYTE, _SP_NORMAL)
    types[unk_id] = _SP_UNKNOWN
    pieces = _sentencepiece_pieces(tokens, scores, types)
    has_bytes = bool(np.any(types == _SP_BYTE))
    trainer = b"".join(
        (
            _field_varint(3, 2),  # model_type = BPE
            _field_varint(4, len(tokens)),  # vocab_size
            _field_varint(35, int(has_bytes)),  # byte_fallback
            _field_varint(40, unk_id),
            _field_varint(41, -1),  # bos/eos/pad are added by us, not by sentencepiece
            _field_varint(42, -1),
            _field_varint(43, -1),
        )
    )
    normalizer = b"".join(
        (
            _field_bytes(1, b"identity"),
            _field_varint(3, 0),  # add_dummy_prefix: llama.cpp adds the space prefix itself
            _field_varint(4, 0),  # remove_extra_whitespaces
            _field_varint(5, 1),  # escape_whitespaces: ' ' -> '▁'
        )
    )
    return pieces + _field_bytes(2, trainer) + _field_bytes(3, normalizer)


def _sentencepiece_pieces(tokens: list[str], scores: np.ndarray, types: np.ndarray) -> bytes:
    """The repeated `pieces` field (1) of a ModelProto, written with numpy.

    Each record is ``0x0A len(body) | 0x0A len(piece) piece | 0x15 score(f32) | 0x18 type``.
    A Python loop over a 262k vocabulary costs a good part of a second; this costs milliseconds.
    """
    raws = [text.encode("utf-8") for text in tokens]
    n_raw = np.fromiter(map(len, raws), np.int64, len(raws))  # [n_vocab] piece bytes
    if n_raw.max(initial=0) >= (1 << 14) - 16:
        raise LocalLLMError("a token in this GGUF vocabulary is longer than 16 KB")
    # varints below 2**14 take one byte under 128, two from there
    n_raw_len = 1 + (n_raw >= 128)
    body = 1 + n_raw_len + n_raw + 5 + 2
    body_len = 1 + (body >= 128)
    record = 1 + body_len + body
    start = np.cumsum(record) - record  # [n_vocab] offset of each record
    out = np.empty(int(record.sum()), np.uint8)

    def put_varint(at: np.ndarray, value: np.ndarray, width: np.ndarray) -> None:
        out[at] = np.where(width == 1, value, (value & 0x7F) | 0x80)
        two = width == 2
        out[at[two] + 1] = value[two] >> 7

    out[start] = 1 << 3 | 2  # field 1 (pieces), length-delimited
    put_varint(start + 1, body, body_len)
    at = start + 1 + body_len
    out[at] = 1 << 3 | 2  # SentencePiece.piece
    put_varint(at + 1, n_raw, n_raw_len)
    raw_at = at + 1 + n_raw_len
    blob = np.frombuffer(b"".join(raws), np.uint8)
    out[np.repeat(raw_at - (np.cumsum(n_raw) - n_raw), n_raw) + np.arange(blob.size)] = blob
    at = raw_at + n_raw
    out[at] = 2 << 3 | 5  # SentencePiece.score, fixed32
    score_bytes = np.frombuffer(np.asarray(scores, dtype="<f4").tobytes(), np.uint8)
    out[at[:, None] + np.arange(1, 5)] = score_bytes.reshape(-1, 4)
    out[at + 5] = 3 << 3  # SentencePiece.type, varint
    out[at + 6] = types
    return out.tobytes()


class _SentencePieceBpe:
    """llama-type (SentencePiece) merges by piece score with byte fallback."""

    def __init__(
        self, tokens: list[str], scores: np.ndarray, token_types: np.ndarray, unk_id: int
    ) -> None:
        proto = _sentencepiece_model_proto(tokens, scores, token_types, unk_id)
        self._sp = sentencepiece.SentencePieceProcessor(model_proto=proto)

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    @staticmethod
    def piece(text: str) -> bytes:
        return text.replace("\u2581", " ").encode("utf-8")


# White_Space code points, as llama.cpp's unicode tables flag them
_WHITESPACE = frozenset(
    [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029]
    + [0x202F, 0x205F, 0x3000]
)
_CJK_RANGES = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B920, 0x2CEAF),  # sic: 0x2B820 in Unicode, 0x2B920 in the HF code llama.cpp follows
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)
_SPACE, _DROP, _ALONE, _IN_WORD = range(4)


@lru_cache(maxsize=4096)
def _wpm_char(ch: str) -> tuple[int, str]:
    """(what llm_tokenizer_wpm's preprocess does with `ch`, the text it adds).

    llama.cpp's "NFD" maps each code point to the first code point of its decomposition (so
    an accented letter loses its accent), then lowercases it (the first code point of the
    lowercase); whitespace ends a word, NUL, U+FFFD and control/format characters vanish, and
    punctuation, ASCII symbols and CJK ideographs are words of their own.
    """
    cpt = ord(unicodedata.normalize("NFD", ch)[0])
    base = chr(cpt)
    if cpt in _WHITESPACE:
        return _SPACE, ""
    category = unicodedata.category(base)
    if cpt in (0, 0xFFFD) or category in ("Cc", "Cf", "Co", "Cs"):
        return _DROP, ""
    lower = base.lower()[0]
    if (
        category.startswith("P")
        or (cpt < 0x7F and category.startswith("S"))
        or any(first <= cpt <= last for first, last in _CJK_RANGES)
    ):
        return _ALONE, lower
    return _IN_WORD, lower


class _WordPiece:
    """bert-type (WordPiece) tokenization, llama.cpp's llm_tokenizer_wpm_session."""

    def __init__(self, tokens: Sequence[str], unk_id: int) -> None:
        self._ids = {text: i for i, text in enumerate(tokens)}
        self._max_len = max(map(len, tokens))
        self._unk_id = unk_id

    @staticmethod
    def words(text: str) -> list[str]:
        """The normalized words of `text` (llm_tokenizer_wpm_session::preprocess)."""
        words, word = [], []
        for ch in text:
            kind, piece = _wpm_char(ch)
            if kind == _IN_WORD:
                word.append(piece)
            elif kind in (_SPACE, _ALONE):
                if word:
                    words.append("".join(word))
                    word = []
                if kind == _ALONE:
                    words.append(piece)
        if word:
            words.append("".join(word))
        return words

    def encode(self, text: str) -> list[int]:
        """Each word, "▁" before it, as the longest vocabulary pieces from its left; a word
        that some position of which no piece starts becomes one unknown token."""
        ids = []
        for word in self.words(text):
            word = "\u2581" + word
            pieces, i = [], 0
            while i < len(word):
                for j in range(min(len(word), i + self._max_len), i, -1):
                    token_id = self._ids.get(word[i:j])
                    if token_id is not None:
                        pieces.append(token_id)
                        i = j
                        break
                else:
                    pieces = [self._unk_id]
                    break
            ids.extend(pieces)
        return ids

    @staticmethod
    def piece(text: str) -> bytes:
        return text.replace("\u2581", " ").encode("utf-8")


def _array(metadata: Mapping[str, Any], key: str, dtype: type, n: int) -> np.ndarray | None:
    value = metadata.get(key)
    if value is None:
        return None
    array = np.asarray(value, dtype=dtype)
    if array.shape != (n,):
        raise LocalLLMError(f"GGUF metadata {key} has {array.size} entries for {n} tokens")
    return array


class TokenTexts(Sequence[str]):
    """The vocabulary's texts as one UTF-8 blob and their end offsets: a str object exists only
    for a token being read. A 262k-token vocabulary takes ~4 MB here, ~20 MB as a list of str."""

    def __init__(self, texts: Iterable[str]) -> None:
        encoded = [text.encode("utf-8") for text in texts]
        self._ends = np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)))  # [n]
        self._blob = b"".join(encoded)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("token id out of range")
        start = int(self._ends[index - 1]) if index else 0
        return self._blob[start : int(self._ends[index])].decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self)))


class Tokenizer:
    """Text <-> token ids for one GGUF model, equal to llama.cpp's `llama_tokenize`."""

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: np.ndarray,  # [n_vocab] int32, llama.cpp attributes after its fix-ups
        backend: _ByteLevelBpe | _SentencePieceBpe | _WordPiece,
        *,
        bos_id: int | None,
        eos_id: int | None,
        eog_ids: frozenset[int],
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
        sep_id: int | None = None,
    ) -> None:
        self._tokens = tokens
        self._types = token_types
        self._backend = backend
        self.vocab_size = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eog_ids = eog_ids
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self.sep_id = sep_id  # WordPiece: [SEP], which ends every input with add_special
        self._pieces: list[bytes | None] = [None] * len(tokens)

        # llama.cpp's cache_special_tokens: control, user-defined and unknown tokens, longest
        # (in bytes) first; they are cut out of the raw text in that order.
        special_ids = np.nonzero(
            np.isin(token_types, (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN))
        )[0]
        ordered = sorted(
            (int(i) for i in special_ids), key=lambda i: (-len(tokens[i].encode("utf-8")), i)
        )
        # control tokens that output still shows: harmony's structure (see ALWAYS_RENDERED)
        self._rendered = frozenset(i for i in ordered if tokens[i] in ALWAYS_RENDERED)
        # first character -> [(rank, id, text, user-defined)], so a text is only checked
        # against the specials that could occur in it
        self._specials_by_char: dict[str, list[tuple[int, int, str, bool]]] = {}
        for rank, token_id in enumerate(ordered):
            text = tokens[token_id]
            user_defined = bool(token_types[token_id] == TOKEN_USER_DEFINED)
            entry = (rank, token_id, text, user_defined)
            self._specials_by_char.setdefault(text[0], []).append(entry)

    @property
    def texts(self) -> Sequence[str]:
        """The token texts by id (empty ones renamed `[EMPTY_<id>]`, as llama.cpp does)."""
        return self._tokens

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer from GGUF metadata (`localllm.gguf.read_gguf(path).metadata`)."""
        model = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if model is None or tokens is None:
            raise LocalLLMError("this GGUF file has no tokenizer (tokenizer.ggml.* metadata)")
        # llama.cpp refuses empty token texts by renaming them
        tokens = [text if text else f"[EMPTY_{i}]" for i, text in enumerate(tokens)]
        n_vocab = len(tokens)
        types = _array(metadata, "tokenizer.ggml.token_type", np.int32, n_vocab)
        types = np.full(n_vocab, TOKEN_NORMAL, np.int32) if types is None else types.copy()
        token_to_id = {text: i for i, text in enumerate(tokens)}
        if len(token_to_id) != n_vocab:
            raise LocalLLMError("the GGUF vocabulary has duplicate tokens")

        # defaults per tokenizer type, then metadata overrides (llama_vocab::impl::load)
        add_eos, sep_id = False, None
        if model == "llama":
            bos_id, eos_id, unk_id = 1, 2, 0
            add_bos, add_space_prefix = True, True
        elif model == "gpt2":
            pre_name = metadata.get("tokenizer.ggml.pre") or "default"
            pre = _BPE_PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                known = ", ".join(sorted(_BPE_PRE_TOKENIZERS))
                raise LocalLLMError(
                    f"unsupported BPE pre-tokenizer {pre_name!r} (tokenizer.ggml.pre); "
                    f"supported: {known}"
                )
            # llama.cpp's defaults for a BPE file without ids (Falcon's)
            bos_id, eos_id, unk_id = 11, 11, None
            add_bos, add_space_prefix = pre.add_bos, False
        elif model == "bert":
            # BERT's ids ([CLS] 101, [UNK] 100, [SEP] 102); the converter's bos is [CLS]
            bos_id, eos_id, unk_id, sep_id = 101, None, 100, 102
            add_bos, add_space_prefix = True, False
            bos_id = int(metadata.get("tokenizer.ggml.cls_token_id", bos_id))
        else:
            raise LocalLLMError(
                f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                "supported: gpt2 (BPE), llama (SentencePiece), bert (WordPiece)"
            )

        def special_id(key: str, default: int | None) -> int | None:
            if default is not None and default >= n_vocab:
                default = None
            value = metadata.get(key)
            if value is None or not 0 <= int(value) < n_vocab:
                return default
            return int(value)

        bos_id = special_id("tokenizer.ggml.bos_token_id", bos_id)
        eos_id = special_id("tokenizer.ggml.eos_token_id", eos_id)
        unk_id = special_id("tokenizer.ggml.unknown_token_id", unk_id)
        if model == "bert":
            # llama.cpp's WordPiece path puts [CLS] before and [SEP] after every input with
            # add_special, whatever add_bos_token / add_eos_token / add_sep_token say
            sep_id = special_id("tokenizer.ggml.seperator_token_id", sep_id)
            if bos_id is None or sep_id is None or unk_id is None:
                raise LocalLLMError(
                    "this WordPiece vocabulary lacks [CLS], [SEP] or [UNK] (tokenizer.ggml."
                    "bos_token_id, seperator_token_id, unknown_token_id)"
                )
        else:
            add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos))
            add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", add_eos))
        add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", add_space_prefix))
        if add_bos and bos_id is None:
            raise LocalLLMError("tokenizer.ggml.add_bos_token is set but the BOS id is not")
        if add_eos and eos_id is None:
            raise LocalLLMError("tokenizer.ggml.add_eos_token is set but the EOS id is not")

        eog_ids = _eog_ids(metadata, token_to_id, types, eos_id, n_vocab)
        if model == "llama":
            scores = _array(metadata, "tokenizer.ggml.scores", np.float32, n_vocab)
            if scores is None:
                scores = np.zeros(n_vocab, np.float32)
            backend = _SentencePieceBpe(tokens, scores, types, 0 if unk_id is None else unk_id)
        elif model == "bert":
            backend = _WordPiece(tokens, unk_id)
            add_space_prefix = False  # the pieces carry their "▁"
        else:
            merges = metadata.get("tokenizer.ggml.merges")
            if merges is None:
                raise LocalLLMError("this BPE GGUF file has no tokenizer.ggml.merges")
            backend = _ByteLevelBpe(tokens, list(merges), pre)
            add_space_prefix = False  # llama.cpp's BPE path ignores the flag
        return cls(
            TokenTexts(tokens),
            types,
            backend,
            bos_id=bos_id,
            eos_id=eos_id,
            eog_ids=eog_ids,
            add_bos=add_bos,
            add_eos=add_eos,
            add_space_prefix=add_space_prefix,
            sep_id=sep_id,
        )

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`, as llama.cpp's `llama_tokenize(text, add_special, parse_special)`.

        add_special adds BOS/EOS where the model's metadata asks for them; parse_special turns
        the text of control tokens (e.g. ``<|im_start|>``) into those tokens. User-defined tokens
        are always recognised, as llama.cpp does.
        """
        ids: list[int] = []
        if add_special and self.add_bos:
            ids.append(self.bos_id)
        for fragment in self._partition(text, parse_special):
            if isinstance(fragment, int):
                ids.append(fragment)
                continue
            # llama.cpp prefixes a space to text that starts the input or follows a special
            # token: every text fragment, since the partition never leaves two side by side
            if self.add_space_prefix:
                fragment = " " + fragment
            ids.extend(self._backend.encode(fragment))
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        if add_special and self.sep_id is not None:
            ids.append(self.sep_id)
        return ids

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special-token texts out of `text`: llama.cpp's tokenizer_st_partition.

        Each special token, longest first, splits every remaining text fragment at its
        non-overlapping occurrences. Without parse_special only user-defined tokens count.
        """
        if not text:
            return []
        candidates = [
            entry
            for char in set(text)
            for entry in self._specials_by_char.get(char, ())
            if (parse_special or entry[3]) and entry[2] in text
        ]
        fragments: list[str | int] = [text]
        for _, token_id, piece, _ in sorted(candidates):
            split: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or piece not in fragment:
                    split.append(fragment)
                    continue
                for k, part in enumerate(fragment.split(piece)):
                    if k:
                        split.append(token_id)
                    if part:
                        split.append(part)
            fragments = split
        return fragments

    def token_to_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` renders to, control tokens included (as llama.cpp with special).

        Byte-level BPE pieces are mapped back to bytes, SentencePiece's '▁' becomes a space,
        ``<0xNN>`` byte tokens become that byte; unused tokens render as nothing.
        """
        self._check_id(token_id)
        piece = self._pieces[token_id]
        if piece is None:
            text = self._tokens[token_id]
            kind = self._types[token_id]
            if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN):
                piece = text.encode("utf-8")
            elif kind == TOKEN_NORMAL:
                piece = self._backend.piece(text)
            elif kind == TOKEN_BYTE:
                piece = bytes((int(text[3:5], 16),))
            else:
                piece = b""
            self._pieces[token_id] = piece
        return piece

    def is_special(self, token_id: int) -> bool:
        """True for control (and unknown) tokens, which normal output does not render."""
        self._check_id(token_id)
        kind = int(self._types[token_id])
        return kind in (TOKEN_CONTROL, TOKEN_UNKNOWN) and token_id not in self._rendered

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise LocalLLMError(
                f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})"
            )

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of `ids`; with skip_special, control tokens render as nothing (llama.cpp's
        normal output). Invalid UTF-8 becomes U+FFFD."""
        data = b"".join(
            self.token_to_bytes(i) for i in ids if not (skip_special and self.is_special(i))
        )
        return data.decode("utf-8", errors="replace")


def _eog_ids(
    metadata: Mapping[str, Any],
    token_to_id: dict[str, int],
    types: np.ndarray,
    eos_id: int | None,
    n_vocab: int,
) -> frozenset[int]:
    """End-of-generation ids as llama.cpp collects them; fixes up `types` in place as it does.

    llama.cpp types a control-looking token CONTROL when the file did not, which also hides it
    from normal output and from partitioning without parse_special.
    """
    eog: set[int] = set()
    for key, texts, ends_generation in _AUTO_SPECIAL_IDS:
        value = metadata.get(key)
        if value is not None and 0 <= int(value) < n_vocab:
            token_id = int(value)
        else:
            token_id = next((token_to_id[t] for t in texts if t in token_to_id), None)
            if token_id is None:
                continue
            types[token_id] = TOKEN_CONTROL
        if ends_generation:
            eog.add(token_id)
    for text in _EOG_TEXTS:
        token_id = token_to_id.get(text)
        if token_id is not None:
            eog.add(token_id)
            types[token_id] = TOKEN_CONTROL
    if eos_id is not None:
        eog.add(eos_id)

    # llama.cpp's workarounds: harmony/solar vocabularies end turns with <|return|>/<|call|>
    # (or <|calls|>/<|flush|>), so <|end|> is an ordinary user-defined token there; and where
    # <|tool_response> exists, </s> is plain text.
    def in_eog(text: str) -> bool:
        return token_to_id.get(text) in eog

    if in_eog("<|end|>") and (
        (in_eog("<|return|>") and (in_eog("<|call|>") or in_eog("<|calls|>")))
        or ((in_eog("<|call|>") or in_eog("<|calls|>")) and in_eog("<|flush|>"))
    ):
        end_id = token_to_id["<|end|>"]
        eog.discard(end_id)
        types[end_id] = TOKEN_USER_DEFINED
    if in_eog("<|tool_response>") and in_eog("</s>"):
        s_id = token_to_id["</s>"]
        eog.discard(s_id)
        types[s_id] = TOKEN_NORMAL
    return frozenset(eog)


class StreamDecoder:
    """Turns a stream of token ids into text without ever emitting half a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._pending = b""

    def add(self, token_id: int) -> str:
        """Feed one token; return the text it completes (maybe "")."""
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        data = self._pending + self._tokenizer.token_to_bytes(token_id)
        cut = _complete_prefix_length(data)
        self._pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        """Whatever is left; bytes that never formed a character become U+FFFD."""
        data, self._pending = self._pending, b""
        return data.decode("utf-8", errors="replace")


def _complete_prefix_length(data: bytes) -> int:
    """Length of `data` without a trailing, still incomplete UTF-8 sequence."""
    n = len(data)
    # a UTF-8 character is at most 4 bytes: look for its lead byte among the last 3
    for back in range(1, min(3, n) + 1):
        byte = data[n - back]
        if byte & 0xC0 == 0x80:  # continuation byte: keep looking for the lead
            continue
        if byte >= 0xF0:
            need = 4
        elif byte >= 0xE0:
            need = 3
        elif byte >= 0xC0:
            need = 2
        else:
            need = 1
        return n - back if need > back and byte < 0xF8 else n
    return n
