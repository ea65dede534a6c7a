"""The GGUF reader: real models against gguf-py's reader, valid tiny files, hostile files."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from call_counter import count_calls
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf_writer import (
    gguf_bytes,
    pack_header,
    pack_kv,
    pack_string,
    pack_tensor_info,
    tensor_nbytes,
    write_gguf,
)
from real_models import model_path

from localllm.errors import LocalLLMError
from localllm.gguf import GGUFFile, TensorInfo, read_gguf, read_header_bytes

T = GGUFValueType
Q = GGMLQuantizationType

# name -> (architecture, tensors, vocabulary size, blocks, embedding width, GGML types used)
REAL_MODELS = {
    "smollm2-135m": ("llama", 272, 49152, 30, 576, {Q.F32, Q.Q4_1, Q.Q8_0}),
    "gemma3-270m": ("gemma3", 236, 262144, 18, 640, {Q.F32, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K}),
    "qwen2.5-coder-0.5b": ("qwen2", 291, 151936, 24, 896, {Q.F32, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K}),
}


def expect_error(path, *fragments: str) -> str:
    """read_gguf(path) raises LocalLLMError whose message contains every fragment."""
    with pytest.raises(LocalLLMError) as info:
        read_gguf(path)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def tiny_tensors() -> dict:
    """Three small tensors whose sizes are multiples of 32, so the file ends with the data."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((2, 64)).astype(np.float32)
    return {
        "norm.weight": (Q.F32, (8,), np.arange(8, dtype=np.float32)),
        "blk.0.w": (Q.Q8_0, (2, 64), gguf.quants.quantize(weight, Q.Q8_0)),  # 136 bytes
        "blk.0.b": (Q.F32, (2, 3, 16), np.ones((2, 3, 16), np.float32)),
    }


ALL_VALUE_TYPES = {
    "general.architecture": "llama",
    "u8": (T.UINT8, 255),
    "i8": (T.INT8, -128),
    "u16": (T.UINT16, 65535),
    "i16": (T.INT16, -32768),
    "u32": (T.UINT32, 2**32 - 1),
    "i32": (T.INT32, -(2**31)),
    "u64": (T.UINT64, 2**64 - 1),
    "i64": (T.INT64, -(2**63)),
    "f32": (T.FLOAT32, 0.1),
    "f64": (T.FLOAT64, 0.1),
    "yes": True,
    "no": False,
    "text": "héllo ▁wörld \U0001f600",
    "empty": "",
    "strings": ["a", "", "<0x80>", "日本"],
    "no_strings": (T.ARRAY, T.STRING, []),
    "a_u8": np.array([0, 255], np.uint8),
    "a_i8": np.array([-128, 127], np.int8),
    "a_u16": np.array([1, 65535], np.uint16),
    "a_i16": np.array([-5, 5], np.int16),
    "a_u32": np.array([7, 2**32 - 1], np.uint32),
    "a_i32": np.array([-1, 2**31 - 1], np.int32),
    "a_u64": np.array([2**64 - 1], np.uint64),
    "a_i64": np.array([-(2**63), 3], np.int64),
    "a_f32": np.array([0.5, -0.25, 1e-6], np.float32),
    "a_f64": np.array([0.1, 1e300], np.float64),
    "a_bool": np.array([True, False, True]),
    "a_empty": np.array([], np.int32),
    "nested": (T.ARRAY, T.ARRAY, [np.array([1, 2], np.uint16), ["x", "y"], (T.ARRAY, T.ARRAY, [])]),
}


# ---------------------------------------------------------------- real models


@pytest.mark.parametrize("name", REAL_MODELS)
def test_real_model_metadata_and_tensors(name):
    arch, n_tensors, n_vocab, n_blocks, dim, types = REAL_MODELS[name]
    path = model_path(name)
    with read_gguf(path) as gf:
        assert gf.version == 3 and gf.alignment == 32
        assert gf.file_size == path.stat().st_size
        assert gf.architecture == arch
        assert gf.metadata[f"{arch}.block_count"] == n_blocks
        assert gf.metadata[f"{arch}.embedding_length"] == dim
        tokens = gf.metadata["tokenizer.ggml.tokens"]
        assert isinstance(tokens, list) and len(tokens) == n_vocab
        assert all(isinstance(token, str) for token in tokens[:100])
        token_type = gf.metadata["tokenizer.ggml.token_type"]
        assert token_type.dtype == np.int32 and token_type.shape == (n_vocab,)
        assert isinstance(gf.metadata[f"{arch}.attention.layer_norm_rms_epsilon"], float)
        assert len(gf.tensors) == n_tensors
        assert {tensor.ggml_type for tensor in gf.tensors.values()} == types
        embedding = gf.tensors["token_embd.weight"]
        assert embedding.shape == (n_vocab, dim)
        block_size, type_size = GGML_QUANT_SIZES[Q(embedding.ggml_type)]
        assert embedding.data.shape == (n_vocab, dim // block_size * type_size)

        base = gf._buffer
        base_address = base.__array_interface__["data"][0]
        previous_end = 0
        for tensor in gf.tensors.values():
            # a zero-copy, read-only view at exactly the tensor's offset in the one map
            assert tensor.data.__array_interface__["data"][0] == base_address + tensor.offset
            assert np.shares_memory(tensor.data, base)
            assert not tensor.data.flags.writeable and not tensor.data.flags.owndata
            assert tensor.data.nbytes == tensor.n_bytes
            assert tensor.offset >= previous_end and tensor.offset % gf.alignment == 0
            previous_end = tensor.offset + tensor.n_bytes
        assert previous_end == gf.file_size


def compare_with_gguf_reader(gf: GGUFFile, reader: gguf.GGUFReader) -> None:
    fields = {key: field for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert list(gf.metadata) == list(fields)
    for key, field in fields.items():
        ours, theirs = gf.metadata[key], field.contents()
        if field.types[0] == T.ARRAY and field.types[-1] != T.STRING:
            assert isinstance(ours, np.ndarray), key
            assert ours.dtype == reader.gguf_scalar_to_np[field.types[-1]], key
            np.testing.assert_array_equal(ours, np.asarray(theirs), err_msg=key)
        else:
            assert ours == theirs, key
            assert type(ours) is type(theirs), key
    assert list(gf.tensors) == [tensor.name for tensor in reader.tensors]
    for theirs in reader.tensors:
        ours = gf.tensors[theirs.name]
        assert ours.ggml_type == int(theirs.tensor_type)
        assert ours.shape == tuple(int(n) for n in reversed(theirs.shape))
        assert ours.offset == theirs.data_offset and ours.n_bytes == theirs.n_bytes
    for theirs in (reader.tensors[0], reader.tensors[1], reader.tensors[-1]):
        ours = gf.tensors[theirs.name].data
        assert ours.tobytes() == theirs.data.tobytes()


@pytest.mark.parametrize(
    "name",
    [
        "smollm2-135m",
        # gguf-py needs ~10 s to parse each of these vocabularies (ours: ~0.1 s)
        pytest.param("gemma3-270m", marks=pytest.mark.slow),
        pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow),
    ],
)
def test_real_model_matches_gguf_reader(name):
    path = model_path(name)
    with read_gguf(path) as gf:
        compare_with_gguf_reader(gf, gguf.GGUFReader(path))


def test_large_vocabulary_loads_fast():
    """gemma3's 262,144 strings are read in one tight loop: no Python function call per string
    and three builtin ones (gguf-py's reader makes ~40 Python calls per string: ~10 s).
    Counted, not timed (measured: 0.02 Python calls and 3.0 calls in all per string)."""
    path = model_path("gemma3-270m")
    gf, calls = count_calls(lambda: read_gguf(path))
    with gf:
        n_strings = len(gf.metadata["tokenizer.ggml.tokens"])
        assert n_strings == 262144
        assert gf.metadata["tokenizer.ggml.scores"].dtype == np.float32
    assert calls.python < n_strings / 10, calls
    assert calls.total < 6 * n_strings, calls


def test_tensor_views_do_not_copy_the_weights():
    psutil = pytest.importorskip("psutil")
    path = model_path("qwen2.5-coder-0.5b")
    process = psutil.Process()
    before = process.memory_info().rss
    gf = read_gguf(path)
    views = [tensor.data for tensor in gf.tensors.values()]
    grown = process.memory_info().rss - before
    assert sum(view.nbytes for view in views) > 450 * 2**20
    # metadata (151,936 tokens and merges as Python strings) costs some tens of MiB;
    # a copy of even one large weight (output.weight alone is 138 MiB) would not fit
    assert grown < 100 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"
    gf.close()


def test_close_releases_the_map_but_held_views_stay_valid(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama"}, tiny_tensors())
    with read_gguf(path) as gf:
        held = gf.tensors["norm.weight"].data
    assert gf.tensors == {}
    np.testing.assert_array_equal(held.view(np.float32), np.arange(8, dtype=np.float32))

    gf = read_gguf(path)
    gf.close()
    with pytest.raises(ValueError):
        gf._mmap[0]  # nothing held a view, so the map really was unmapped


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage"), reason="no transparent huge pages"
)
def test_the_map_asks_for_huge_pages(tmp_path):
    """The weights' map carries MADV_HUGEPAGE (VmFlags "hg" in /proc/self/smaps): what the
    kernel reads of the file for it is cached in 2 MiB folios, one TLB entry each."""
    path = write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama"}, tiny_tensors())
    with read_gguf(path):
        entries = Path("/proc/self/smaps").read_text().split("\n")
        at = next(i for i, line in enumerate(entries) if line.endswith(str(path)))
        flags = next(line for line in entries[at:] if line.startswith("VmFlags:"))
    assert "hg" in flags.split(), flags


@pytest.mark.parametrize(
    ("cut", "fragment"),
    [
        (10, "only 10 bytes, too short for a GGUF header"),
        (23, "only 23 bytes, too short for a GGUF header"),
        (24, "the header claims 33 metadata entries"),
        (1000, "the header claims 272 tensors, more than the 1000-byte file"),
        (300_000, "'tokenizer.ggml.tokens' claims 49152 strings"),
        (1_500_000, "'tokenizer.ggml.merges' is cut off at string #33014"),
        (("data_start", -1), "the data offset of tensor 'output_norm.weight'"),  # the last info
        (("data_start", 1000), "tensor 'token_embd.weight' (Q8_0, shape (49152, 576)"),
        (("file_size", -1), "runs past the end of the file"),
    ],
)
def test_truncated_real_model(tmp_path, cut, fragment):
    source = model_path("smollm2-135m")
    with read_gguf(source) as gf:
        data_start = next(iter(gf.tensors.values())).offset
        file_size = gf.file_size
    if isinstance(cut, tuple):
        anchor, delta = cut
        n_bytes = {"data_start": data_start, "file_size": file_size}[anchor] + delta
    else:
        n_bytes = cut
    path = tmp_path / "truncated.gguf"
    if n_bytes > 10**6:
        shutil.copyfile(source, path)
        os.truncate(path, n_bytes)
    else:
        with open(source, "rb") as f:
            path.write_bytes(f.read(n_bytes))
    expect_error(path, str(path), fragment, "download")


# ---------------------------------------------------------------- valid tiny files


def test_writer_matches_gguf_writer(tmp_path):
    metadata = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "f": 1.5,
        "flag": True,
        "tokens": ["a", "bc", ""],
        "token_type": [1, 2, 3],
        "scores": np.array([0.5, 1.0], np.float32),
    }
    tensors = tiny_tensors()
    writer = gguf.GGUFWriter(tmp_path / "ref.gguf", "llama")
    writer.add_block_count(2)
    writer.add_float32("f", 1.5)
    writer.add_bool("flag", True)
    writer.add_array("tokens", ["a", "bc", ""])
    writer.add_array("token_type", [1, 2, 3])
    writer.add_array("scores", [0.5, 1.0])
    for name, (ggml_type, _, data) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_bytes(metadata, tensors) == (tmp_path / "ref.gguf").read_bytes()


@pytest.mark.parametrize("version", [2, 3])
def test_every_metadata_value_type_round_trips(tmp_path, version):
    path = write_gguf(tmp_path / "m.gguf", ALL_VALUE_TYPES, tiny_tensors(), version=version)
    with read_gguf(path) as gf:
        assert gf.version == version
        meta = gf.metadata
        assert list(meta) == list(ALL_VALUE_TYPES)
        for key in ("u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64"):
            assert type(meta[key]) is int and meta[key] == ALL_VALUE_TYPES[key][1]
        assert meta["f32"] == float(np.float32(0.1)) and type(meta["f32"]) is float
        assert meta["f64"] == 0.1 and type(meta["f64"]) is float
        assert meta["yes"] is True and meta["no"] is False
        assert meta["text"] == ALL_VALUE_TYPES["text"] and meta["empty"] == ""
        assert meta["strings"] == ["a", "", "<0x80>", "日本"] and meta["no_strings"] == []
        for key, expected in ALL_VALUE_TYPES.items():
            if key.startswith("a_"):
                assert meta[key].dtype == expected.dtype, key
                assert meta[key].flags.writeable and meta[key].flags.owndata, key
                np.testing.assert_array_equal(meta[key], expected, err_msg=key)
        first, second, third = meta["nested"]
        assert first.dtype == np.uint16 and first.tolist() == [1, 2]
        assert second == ["x", "y"] and third == []
    if version == 3:  # gguf-py reads everything but arrays of arrays the same way
        reader = gguf.GGUFReader(path)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "nested":
                continue
            theirs = field.contents()
            ours = meta[key]
            if isinstance(ours, np.ndarray):
                np.testing.assert_array_equal(ours, np.asarray(theirs, dtype=ours.dtype))
            else:
                assert ours == theirs, key


def test_tensor_views_hold_the_written_bytes(tmp_path):
    tensors = tiny_tensors()
    path = write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama"}, tensors)
    with read_gguf(path) as gf:
        assert list(gf.tensors) == list(tensors)
        norm, weight, bias = gf.tensors.values()
        assert isinstance(norm, TensorInfo)
        assert norm.shape == (8,) and norm.data.shape == (32,)
        np.testing.assert_array_equal(norm.data.view(np.float32), np.arange(8))
        assert weight.shape == (2, 64) and weight.data.shape == (2, 68)
        assert weight.type_name == "Q8_0"
        np.testing.assert_array_equal(weight.data, tensors["blk.0.w"][2])
        assert bias.shape == (2, 3, 16) and bias.data.shape == (2, 3, 64)
        assert weight.offset % 32 == 0 and weight.offset == norm.offset + 32
        assert gf.file_size == bias.offset + bias.n_bytes


def test_every_known_ggml_type_is_accepted(tmp_path):
    tensors = {}
    for ggml_type, (block_size, type_size) in GGML_QUANT_SIZES.items():
        tensors[f"t.{ggml_type.name}"] = (ggml_type, (3, 2 * block_size), bytes(6 * type_size))
    path = write_gguf(tmp_path / "m.gguf", {"general.architecture": "x"}, tensors)
    with read_gguf(path) as gf:
        for ggml_type, (_, type_size) in GGML_QUANT_SIZES.items():
            tensor = gf.tensors[f"t.{ggml_type.name}"]
            assert tensor.ggml_type == ggml_type
            assert tensor.data.shape == (3, 2 * type_size)
            assert tensor.n_bytes == tensor_nbytes(ggml_type, tensor.shape)


def test_custom_alignment_and_no_tensors(tmp_path):
    path = write_gguf(
        tmp_path / "a.gguf", {"general.architecture": "x"}, tiny_tensors(), alignment=64
    )
    with read_gguf(path) as gf:
        assert gf.alignment == 64
        assert all(tensor.offset % 64 == 0 for tensor in gf.tensors.values())
    # a vocabulary-only file: no tensors, and no data section or padding after the metadata
    path = write_gguf(tmp_path / "v.gguf", {"tokenizer.ggml.tokens": ["a", "b"]})
    with read_gguf(path) as gf:
        assert gf.tensors == {} and gf.metadata["tokenizer.ggml.tokens"] == ["a", "b"]
        with pytest.raises(LocalLLMError, match="general.architecture"):
            _ = gf.architecture


# ---------------------------------------------------------------- hostile files


def header_then(tmp_path, *parts: bytes, n_tensors=0, n_kv=1, version=3) -> os.PathLike:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(pack_header(n_tensors, n_kv, version) + b"".join(parts))
    return path


def tensor_file(tmp_path, tensors, **overrides) -> os.PathLike:
    return write_gguf(
        tmp_path / "hostile.gguf",
        {"general.architecture": "llama"},
        tensors,
        check_sizes=False,
        **overrides,
    )


def test_missing_and_empty_files(tmp_path):
    expect_error(tmp_path / "nope.gguf", "cannot read model file", "nope.gguf")
    expect_error(tmp_path, "cannot read model file")  # a directory
    (tmp_path / "empty.gguf").write_bytes(b"")
    expect_error(tmp_path / "empty.gguf", "empty", "download")
    (tmp_path / "short.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    expect_error(tmp_path / "short.gguf", "only 8 bytes", "too short")


@pytest.mark.parametrize(
    ("start", "hint"),
    [
        (b"GGML", "not a GGUF model"),
        (b"<!DOCTYPE html>", "HTML"),
        (b"version https://git-lfs.github.com/spec/v1", "Git LFS pointer"),
        (b"PK\x03\x04", "zip archive"),
    ],
)
def test_bad_magic(tmp_path, start, hint):
    path = tmp_path / "bad.gguf"
    path.write_bytes(start + bytes(64))
    expect_error(path, "not a GGUF file", hint)


@pytest.mark.parametrize(
    ("version", "fragments"),
    [
        (1, ("version 1", "too old")),
        (0, ("version 0", "too old")),
        (4, ("version 4", "newer")),
        (2**31, ("version 2147483648", "newer")),
        (3 << 16, ("big-endian",)),
    ],
)
def test_unsupported_versions(tmp_path, version, fragments):
    expect_error(header_then(tmp_path, bytes(64), version=version), *fragments)


def test_huge_counts_in_the_header(tmp_path):
    path = header_then(tmp_path, bytes(100), n_tensors=2**63, n_kv=0)
    expect_error(path, "claims 9223372036854775808 tensors")
    path = header_then(tmp_path, bytes(100), n_kv=2**63)
    expect_error(path, "claims 9223372036854775808 metadata entries")
    path = header_then(tmp_path, bytes(100), n_kv=2**64 - 1)
    expect_error(path, "metadata entries")
    # counts that pass the cheap bound but are not backed by entries
    path = header_then(tmp_path, pack_kv("a", 1), b"\xff" * 40, n_kv=3)
    expect_error(path, "metadata key #1", "file ends")
    path = header_then(tmp_path, pack_kv("a", 1), b"\xff" * 40, n_tensors=1)
    expect_error(path, "the name of tensor #0")


def test_string_lengths_past_the_end(tmp_path):
    value = struct.pack("<IQ", T.STRING, 10**6) + b"only a few bytes"
    path = header_then(tmp_path, pack_string("general.name"), value)
    expect_error(path, "'general.name'", "1000000 bytes", "truncated or corrupt")
    path = header_then(tmp_path, struct.pack("<Q", 2**64 - 1), b"key" * 10)
    expect_error(path, "metadata key #0", "18446744073709551615 bytes")
    tokens = struct.pack("<IQ", T.STRING, 2) + pack_string("ok") + struct.pack("<Q", 2**40) + b"x"
    path = header_then(
        tmp_path, pack_string("tokenizer.ggml.tokens"), struct.pack("<I", T.ARRAY), tokens
    )
    expect_error(path, "string #1 of metadata key 'tokenizer.ggml.tokens'", "past the end")
    cut = struct.pack("<IQ", T.STRING, 3) + pack_string("abcdefgh") * 2 + b"\x01\x00"
    path = header_then(
        tmp_path, pack_string("tokenizer.ggml.tokens"), struct.pack("<I", T.ARRAY), cut
    )
    expect_error(path, "cut off at string #2")


@pytest.mark.parametrize(
    ("item_type", "fragment"),
    [
        (T.INT32, "an array of 4611686018427387904 int32"),
        (T.UINT8, "an array of 4611686018427387904 uint8"),
        (T.STRING, "claims 4611686018427387904 strings"),
        (T.ARRAY, "claims 4611686018427387904 nested arrays"),
    ],
)
def test_huge_array_counts(tmp_path, item_type, fragment):
    array = struct.pack("<IIQ", T.ARRAY, item_type, 2**62) + bytes(64)
    path = header_then(tmp_path, pack_string("tokenizer.ggml.scores"), array)
    expect_error(path, "'tokenizer.ggml.scores'", fragment)


def test_bad_metadata_entries(tmp_path):
    path = header_then(tmp_path, pack_string("k"), struct.pack("<I", 13), bytes(8))
    expect_error(path, "'k' has unknown value type 13")
    path = header_then(tmp_path, pack_string("k"), struct.pack("<IIQ", T.ARRAY, 99, 1), bytes(8))
    expect_error(path, "'k' is an array of unknown value type 99")
    path = header_then(tmp_path, pack_kv("k", 1), pack_kv("k", 2), n_kv=2)
    expect_error(path, "metadata key 'k' appears twice")
    path = header_then(tmp_path, pack_string("k"), struct.pack("<I", T.UINT64), b"\x01\x02")
    expect_error(path, "the uint64 value of metadata key 'k'")
    path = header_then(tmp_path, pack_string(b"bad\xff"), struct.pack("<I", T.UINT8), b"\x01")
    expect_error(path, "metadata key #0 is not valid UTF-8")
    path = header_then(
        tmp_path, pack_string("k"), struct.pack("<I", T.STRING), pack_string(b"\xc3")
    )
    expect_error(path, "metadata key 'k' is not valid UTF-8")
    tokens = struct.pack("<IQ", T.STRING, 2) + pack_string("ok") + pack_string(b"\xe2\x96")
    path = header_then(tmp_path, pack_string("tokens"), struct.pack("<I", T.ARRAY), tokens)
    expect_error(path, "string #1 of metadata key 'tokens' is not valid UTF-8")


def test_deeply_nested_arrays(tmp_path):
    depth = 1000  # deeper than Python's recursion limit would allow without the nesting bound
    nested = struct.pack("<IQ", T.ARRAY, 1) * depth + struct.pack("<IQ", T.UINT8, 0)
    path = header_then(tmp_path, pack_string("k"), struct.pack("<I", T.ARRAY), nested)
    expect_error(path, "nests arrays more than 8 deep")


@pytest.mark.parametrize("alignment", [0, 13, 48, 2**32 - 1])
def test_bad_alignment(tmp_path, alignment):
    metadata = {"general.architecture": "llama", "general.alignment": (T.UINT32, alignment)}
    path = write_gguf(tmp_path / "a.gguf", metadata, tiny_tensors())
    expect_error(path, f"general.alignment is {alignment}", "power of two")


def test_alignment_of_the_wrong_type(tmp_path):
    metadata = {"general.architecture": "llama", "general.alignment": "32"}
    path = write_gguf(tmp_path / "a.gguf", metadata, tiny_tensors())
    expect_error(path, "general.alignment is '32'")


def f32(shape) -> tuple:
    return (Q.F32, shape, bytes(4 * int(np.prod(shape))))


def test_duplicate_tensor_names(tmp_path):
    path = tensor_file(tmp_path, [("w", *f32((8,))), ("w", *f32((8,)))])
    expect_error(path, "tensor name 'w' appears twice")


@pytest.mark.parametrize(
    ("shape", "fragment"),
    [
        ((1, 1, 1, 1, 8), "tensor 'w' has 5 dimensions"),
        ((), "tensor 'w' has 0 dimensions"),
        ((0, 8), "tensor 'w' has a zero size (0) in dimension 1"),
        ((8, -1), "tensor 'w' has a negative size (-1) in dimension 0"),
        ((-(2**63), 8), "negative size (-9223372036854775808)"),
        ((2**32, 2**32), "element count overflows int64"),
    ],
)
def test_bad_dimensions(tmp_path, shape, fragment):
    path = tensor_file(tmp_path, {"w": (Q.F32, shape, bytes(64))})
    expect_error(path, fragment)


def test_rows_must_hold_whole_blocks(tmp_path):
    path = tensor_file(tmp_path, {"w": (Q.Q4_0, (2, 33), bytes(64))})
    expect_error(path, "tensor 'w' has rows of 33 elements", "Q4_0 block size 32")


def test_a_3d_tensors_matrices_are_views_of_its_bytes(tmp_path):
    """A MoE's experts: matrix e of a 3-D tensor is bytes e * matrix_bytes onward, named w[e]; a
    tensor of other rank has no matrices."""
    values = np.arange(3 * 2 * 32, dtype=np.float32)
    tensors = {"w": (Q.F32, (3, 2, 32), values.tobytes()), "v": f32((2, 32))}
    with read_gguf(tensor_file(tmp_path, tensors)) as gf:
        matrices = gf.tensors["w"].matrices()
        assert [m.name for m in matrices] == ["w[0]", "w[1]", "w[2]"]
        for e, m in enumerate(matrices):
            assert m.shape == (2, 32)
            np.testing.assert_array_equal(
                m.data.view(np.float32), values[e * 64 :].reshape(-1, 2, 32)[0]
            )
        with pytest.raises(LocalLLMError, match=r"tensor v should be 3-D, has shape \(2, 32\)"):
            gf.tensors["v"].matrices()


@pytest.mark.parametrize("ggml_type", [4, 5, 31, 99, 2**32 - 1])
def test_unknown_ggml_type(tmp_path, ggml_type):
    path = tensor_file(tmp_path, {"blk.0.attn_q.weight": (ggml_type, (4, 32), bytes(64))})
    expect_error(path, "tensor 'blk.0.attn_q.weight'", f"GGML type id {ggml_type}")


def test_tensor_data_past_the_end(tmp_path):
    path = tensor_file(tmp_path, {"norm": f32((8,)), "w": (Q.F32, (1000,), bytes(16))})
    expect_error(path, "tensor 'w' (F32, shape (1000,), 4000 bytes", "runs past the end")
    tensors = {"norm": f32((8,)), "w": f32((8,))}
    path = tensor_file(tmp_path, tensors, offsets=[0, 2**63])
    expect_error(path, "tensor 'w'", "runs past the end")
    path = tensor_file(tmp_path, tensors, offsets=[0, 2**64 - 32])
    expect_error(path, "tensor 'w'", "runs past the end")


def test_misaligned_tensor_offset(tmp_path):
    path = tensor_file(tmp_path, {"norm": f32((8,)), "w": f32((8,))}, offsets=[0, 40])
    expect_error(path, "tensor 'w' starts at data offset 40", "alignment 32")


def test_cut_inside_the_tensor_table(tmp_path):
    data = gguf_bytes({"general.architecture": "llama"}, {"w": f32((8,))})
    info = pack_tensor_info("w", Q.F32, (8,), 0)
    table_end = data.index(info) + len(info)
    for cut, fragment in [(2, "tensor #0"), (12, "tensor 'w'"), (len(info) - 1, "offset of")]:
        (tmp_path / "cut.gguf").write_bytes(data[: table_end - len(info) + cut])
        expect_error(tmp_path / "cut.gguf", fragment)


def test_every_truncation_of_a_small_file_is_refused(tmp_path):
    data = gguf_bytes(ALL_VALUE_TYPES, tiny_tensors())
    path = tmp_path / "cut.gguf"
    for n_bytes in range(len(data)):
        path.write_bytes(data[:n_bytes])
        with pytest.raises(LocalLLMError):
            read_gguf(path)
    path.write_bytes(data)
    read_gguf(path).close()


def test_random_corruption_gives_only_clear_errors(tmp_path):
    data = gguf_bytes(ALL_VALUE_TYPES, tiny_tensors())
    rng = np.random.default_rng(1234)
    path = tmp_path / "fuzz.gguf"
    outcomes = {"read": 0, "refused": 0}
    for _ in range(400):
        mutant = bytearray(data)
        for position in rng.integers(0, len(data), size=rng.integers(1, 4)):
            mutant[position] = rng.choice([0x00, 0xFF, 0x80, int(rng.integers(0, 256))])
        path.write_bytes(bytes(mutant))
        try:
            read_gguf(path).close()
            outcomes["read"] += 1
        except LocalLLMError:
            outcomes["refused"] += 1
    assert outcomes["read"] > 0 and outcomes["refused"] > 0, outcomes


# ---------------------------------------------------------------- header only


def test_read_metadata_reads_the_header_alone(tmp_path):
    from localllm.gguf import read_metadata

    source = model_path("smollm2-135m")
    with read_gguf(source) as gf:
        expected, data_start = gf.metadata, next(iter(gf.tensors.values())).offset
    metadata = read_metadata(source)
    assert metadata.keys() == expected.keys()
    assert metadata["general.file_type"] == expected["general.file_type"] == 3
    assert metadata["tokenizer.ggml.tokens"] == expected["tokenizer.ggml.tokens"]
    # Cut in the tensor data: the header still reads, the whole file does not.
    path = tmp_path / "cut.gguf"
    with open(source, "rb") as f:
        path.write_bytes(f.read(data_start + 1000))
    assert read_metadata(path)["general.architecture"] == "llama"
    expect_error(path, "runs past the end of the file")
    # Cut in the metadata: both fail, with the same checks.
    os.truncate(path, 300_000)
    with pytest.raises(LocalLLMError, match="'tokenizer.ggml.tokens' claims 49152 strings"):
        read_metadata(path)


def test_a_short_file_that_is_not_gguf_says_so(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_bytes(b"hello world")
    expect_error(path, "not a GGUF file", "b'hell'")


def test_a_header_is_read_from_the_first_bytes_of_a_file():
    data = gguf_bytes(
        {"general.architecture": "llama", "general.description": "d" * 5000},
        {"output.weight": (1, (2, 32), np.zeros((2, 32), np.float16))},
    )
    header = read_header_bytes(data[:5200], len(data), "remote.gguf")
    assert header.architecture == "llama" and header.tensor_types == {"output.weight": 1}
    # Too short a prefix asks for more; a whole file that is bad is an error.
    assert read_header_bytes(data[:4000], len(data), "remote.gguf") is None
    with pytest.raises(LocalLLMError, match="remote.gguf: corrupt GGUF"):
        read_header_bytes(data[:4000], 4000, "remote.gguf")
