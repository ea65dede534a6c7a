"""Validated, memory-mapped GGUF reader: a metadata dict and zero-copy tensor views.

The whole file is mapped once, read-only. Every count, length, dimension and offset read from
the file is checked against the file size before it is used, so a truncated or hostile file
gives a `LocalLLMError` that says what is wrong and where, never a crash, a hang or a huge
allocation. Only the little-endian layout of GGUF versions 2 and 3 is read (they are identical;
version 1 used 32-bit counts). Layout, from the GGUF spec:

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key | u32 value_type | value)
    n_tensors x (string name | u32 n_dims | n_dims x i64 ne | u32 ggml_type | u64 offset)
    padding to `general.alignment` (default 32) | tensor data (offsets relative to here)

Strings are a u64 byte length followed by UTF-8 bytes. All strings (keys, tensor names, values,
token strings) are decoded strictly as UTF-8: a file with invalid UTF-8 is rejected with the key
or tensor named. llama.cpp's converters only write valid UTF-8 (byte tokens are spelled
`<0x80>`), so strictness costs nothing on real models and keeps later code free of surrogates.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from localllm.errors import LocalLLMError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS in ggml.h
MAX_ARRAY_NESTING = 8  # arrays of arrays: real files use none; a bound keeps recursion finite
_INT64_MAX = 2**63 - 1
_HEADER_SIZE = 24  # magic + version + n_tensors + n_kv

# GGML type id -> (block_size in elements, type_size in bytes per block)
BLOCK_SIZES: dict[int, tuple[int, int]] = {int(t): sizes for t, sizes in GGML_QUANT_SIZES.items()}

V = GGUFValueType
# scalar metadata value type -> little-endian numpy dtype (BOOL is one byte, 0 or 1)
_NUMERIC_DTYPES: dict[int, np.dtype] = {
    V.UINT8: np.dtype("<u1"),
    V.INT8: np.dtype("<i1"),
    V.UINT16: np.dtype("<u2"),
    V.INT16: np.dtype("<i2"),
    V.UINT32: np.dtype("<u4"),
    V.INT32: np.dtype("<i4"),
    V.FLOAT32: np.dtype("<f4"),
    V.BOOL: np.dtype("<u1"),
    V.UINT64: np.dtype("<u8"),
    V.INT64: np.dtype("<i8"),
    V.FLOAT64: np.dtype("<f8"),
}
_SCALAR_STRUCTS = {
    t: struct.Struct("<" + fmt)
    for t, fmt in zip(_NUMERIC_DTYPES, "BbHhIifBQqd", strict=True)  # standard sizes, unlike .char
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
# fewest bytes a string, a nested array, a key/value pair and a tensor info can occupy
_MIN_STRING = 8
_MIN_ARRAY = 12
_MIN_KV = 8 + 4 + 1
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8

_REDOWNLOAD = "the file is truncated or corrupt; delete it and download the model again"


@dataclass(frozen=True, eq=False)
class TensorInfo:
    """One tensor of a GGUF file: its type, numpy-order shape and a read-only view of its bytes."""

    name: str
    ggml_type: int  # GGML type id, a key of gguf.constants.GGML_QUANT_SIZES
    shape: tuple[int, ...]  # numpy order: GGUF's ne reversed, (n_rows, n_cols) for a 2-D weight
    offset: int  # absolute byte offset of the tensor data in the file
    n_bytes: int
    # uint8 view into the file's memory map, shape shape[:-1] + (row_bytes,) with
    # row_bytes = shape[-1] // block_size * type_size; never a copy
    data: np.ndarray = field(repr=False)

    @property
    def type_name(self) -> str:
        """The GGML type's name, e.g. "Q4_K"."""
        return GGMLQuantizationType(self.ggml_type).name

    def matrix(self, index: int, name: str) -> TensorInfo:
        """Matrix `index` of a 3-D tensor, as a 2-D tensor named `name`: one expert of a MoE's
        ffn_{gate,up,down}_exps (float32[n_experts, n_rows, n_cols] in numpy order). A view of
        its bytes in the map, no copy."""
        if len(self.shape) != 3 or not 0 <= index < self.shape[0]:
            raise LocalLLMError(
                f"tensor {self.name} of shape {self.shape} has no matrix {index}; "
                "the file is inconsistent"
            )
        matrix_bytes = self.n_bytes // self.shape[0]
        return replace(
            self,
            name=name,
            shape=self.shape[1:],
            offset=self.offset + index * matrix_bytes,
            n_bytes=matrix_bytes,
            data=self.data[index],
        )

    def matrices(self) -> list[TensorInfo]:
        """Every matrix of a 3-D tensor (a MoE's experts), `matrix(e, "name[e]")` each."""
        if len(self.shape) != 3:
            raise LocalLLMError(f"tensor {self.name} should be 3-D, has shape {self.shape}")
        return [self.matrix(e, f"{self.name}[{e}]") for e in range(self.shape[0])]

    def rows(self, start: int, stop: int, name: str) -> TensorInfo:
        """Rows start..stop-1 of a 2-D tensor as a tensor of its own, named `name`: a part of a
        fused matrix (Phi-3's attn_qkv, its gate+up ffn_up). A view of the same bytes, no copy."""
        if len(self.shape) != 2 or not 0 <= start < stop <= self.shape[0]:
            raise LocalLLMError(
                f"tensor {self.name} of shape {self.shape} has no rows {start}..{stop - 1}; "
                "the file is inconsistent"
            )
        row_bytes = self.data.shape[-1]
        return replace(
            self,
            name=name,
            shape=(stop - start, self.shape[1]),
            offset=self.offset + start * row_bytes,
            n_bytes=(stop - start) * row_bytes,
            data=self.data[start:stop],
        )


class GGUFFile:
    """An open GGUF file: `metadata`, `tensors` (views into one read-only memory map).

    Metadata values are plain Python values or copied numpy arrays, so they stay valid after
    `close()`. Tensor views keep the mapping alive for as long as any of them is referenced.
    """

    def __init__(
        self,
        path: Path,
        version: int,
        alignment: int,
        file_size: int,
        metadata: dict[str, Any],
        tensors: dict[str, TensorInfo],
        mapping: mmap.mmap,
        buffer: np.ndarray,
    ) -> None:
        self.path = path
        self.version = version
        self.alignment = alignment
        self.file_size = file_size
        self.metadata = metadata
        self.tensors = tensors
        self._mmap = mapping
        self._buffer = buffer  # (file_size,) uint8 over the whole map; every tensor view's base

    @property
    def architecture(self) -> str:
        """`general.architecture`, e.g. "llama", "qwen2", "gemma3"."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise LocalLLMError(
                f"{self.path}: GGUF metadata has no general.architecture; "
                "this is not a model file llama.cpp could load either"
            )
        return arch

    def close(self) -> None:
        """Drop this object's tensor views and unmap the file if no view is referenced elsewhere.

        Views that callers still hold stay valid: the mapping is released when the last of them
        is garbage-collected.
        """
        self.tensors = {}
        self._buffer = None
        # BufferError: a caller still holds a tensor view, which keeps the mapping alive safely.
        with contextlib.suppress(BufferError):
            self._mmap.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFFile({str(self.path)!r}, version={self.version}, "
            f"{len(self.metadata)} keys, {len(self.tensors)} tensors)"
        )


def read_gguf(path: str | Path) -> GGUFFile:
    """Map a GGUF file and validate its header, metadata and tensor table.

    Raises LocalLLMError for a missing, unreadable, truncated, corrupt or unsupported file.
    """
    path = Path(path)
    mapping, file_size = _map(path)
    try:
        return _Parser(path, mapping, file_size).parse()
    except BaseException:
        # Nothing views the map yet (metadata is copied, views come last), so this unmaps it.
        with contextlib.suppress(BufferError):
            mapping.close()
        raise


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Only the header and metadata of a GGUF file, validated as `read_gguf` validates them.

    The tensor table and data are not looked at, so this reads just the first pages of a
    multi-GB file (the metadata, vocabulary included); use `read_gguf` to check the whole file.
    """
    path = Path(path)
    mapping, file_size = _map(path)
    try:
        parser = _Parser(path, mapping, file_size)
        _version, _n_tensors, n_kv = parser.read_header()
        return parser.read_metadata(n_kv)
    finally:
        with contextlib.suppress(BufferError):  # a traceback may still hold a view
            mapping.close()  # every metadata value is a copy


@dataclass(frozen=True)
class GGUFHeader:
    """What the first bytes of a GGUF file say: its metadata and its tensor table."""

    metadata: dict[str, Any]
    tensor_types: dict[str, int]  # tensor name -> GGML type id

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None


def read_header_bytes(head: bytes, file_size: int, name: str) -> GGUFHeader | None:
    """Parse the header, metadata and tensor table from the first bytes of a GGUF file.

    `head` is a prefix of a `file_size`-byte file (a Range request's answer, the start of a
    wheel member). Returns None when the prefix is too short to hold the tensor table (ask for
    more bytes); raises LocalLLMError when the whole file is there and its header is bad.
    """
    try:
        parser = _Parser(Path(name), head, len(head))
        _version, n_tensors, n_kv = parser.read_header()
        metadata = parser.read_metadata(n_kv)
        infos = parser.read_tensor_infos(n_tensors)
    except LocalLLMError:
        # Within a prefix a cut-off string or array reads as corruption; only the whole file
        # can be judged corrupt.
        if len(head) < file_size:
            return None
        raise
    return GGUFHeader(metadata, {name: ggml_type for name, ggml_type, _shape, _off in infos})


def ask_for_huge_pages(mapping: mmap.mmap) -> None:
    """madvise(MADV_HUGEPAGE) on a map (Linux; elsewhere, or refused, nothing): a model file's,
    or the KV cache's anonymous one (backend.huge_zeros). What the kernel reads of a file for its
    map it then holds in 2 MiB folios, mapped with one TLB entry each by this process and every
    later one (the next run, llama.cpp): a plain read of a model's weights 27-29 -> 35 GB/s on
    this project's VMs (ext4, Linux 6.18), near an anonymous buffer's 36-37. Pages already
    cached in 4 KiB folios stay so (MADV_COLLAPSE is refused there)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages
            mapping.madvise(advice)


def _map(path: Path) -> tuple[mmap.mmap, int]:
    """(read-only map of the whole file, file size), for a file big enough for a header."""
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            if file_size == 0:
                raise LocalLLMError(f"{path}: the file is empty; download the model again")
            if file_size < _HEADER_SIZE:
                head = f.read(4)
                if not GGUF_MAGIC.startswith(head):  # a short file of something else
                    raise LocalLLMError(_bad_magic_message(path, head))
                raise LocalLLMError(
                    f"{path}: only {file_size} bytes, too short for a GGUF header; {_REDOWNLOAD}"
                )
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            ask_for_huge_pages(mapping)
            return mapping, file_size
    except OSError as e:
        raise LocalLLMError(f"cannot read model file {path}: {e.strerror or e}") from e


class _Parser:
    """A cursor over the mapped bytes; every read is bounds-checked against the file size."""

    def __init__(self, path: Path, mapping: mmap.mmap, file_size: int) -> None:
        self.path = path
        self.mm = mapping
        self.file_size = file_size
        self.pos = 0

    def corrupt(self, problem: str) -> LocalLLMError:
        return LocalLLMError(f"{self.path}: corrupt GGUF file: {problem}; {_REDOWNLOAD}")

    def need(self, n_bytes: int, what: str) -> None:
        """Fail unless `n_bytes` more bytes exist at the cursor."""
        remaining = self.file_size - self.pos
        if n_bytes > remaining:
            raise self.corrupt(
                f"{what} needs {n_bytes} bytes at offset {self.pos} "
                f"but the file ends {remaining} bytes later (file size {self.file_size})"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (value,) = _U32.unpack_from(self.mm, self.pos)
        self.pos += 4
        return value

    def u64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _U64.unpack_from(self.mm, self.pos)
        self.pos += 8
        return value

    def i64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _I64.unpack_from(self.mm, self.pos)
        self.pos += 8
        return value

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        self.need(n, f"{what} (a string of {n} bytes)")
        raw = self.mm[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.corrupt(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from e

    def read_header(self) -> tuple[int, int, int]:
        """(version, n_tensors, n_kv) from the fixed header, with the counts bounded."""
        magic = self.mm[:4]
        if magic != GGUF_MAGIC:
            raise LocalLLMError(_bad_magic_message(self.path, magic))
        self.pos = 4
        version = self.u32("the version")
        if version not in SUPPORTED_VERSIONS:
            raise LocalLLMError(_bad_version_message(self.path, version))
        n_tensors = self.u64("the tensor count")
        n_kv = self.u64("the metadata count")
        # Cheap upper bounds first, so a hostile count fails here instead of looping or allocating.
        available = self.file_size - self.pos
        if n_kv > available // _MIN_KV:
            raise self.corrupt(
                f"the header claims {n_kv} metadata entries, but {available} bytes "
                f"hold at most {available // _MIN_KV}"
            )
        if n_tensors > (available - n_kv * _MIN_KV) // _MIN_TENSOR_INFO:
            raise self.corrupt(
                f"the header claims {n_tensors} tensors, more than the "
                f"{self.file_size}-byte file can describe"
            )
        return version, n_tensors, n_kv

    def parse(self) -> GGUFFile:
        version, n_tensors, n_kv = self.read_header()
        metadata = self.read_metadata(n_kv)
        alignment = self.check_alignment(metadata)
        infos = self.read_tensor_infos(n_tensors)
        data_start = -(-self.pos // alignment) * alignment
        # Validate every tensor before the first view exists: on an error the map must still
        # be closable, and views held by a traceback would pin it.
        layouts = [self.tensor_layout(*info, data_start, alignment) for info in infos]
        buffer = np.frombuffer(self.mm, dtype=np.uint8)  # (file_size,) read-only
        tensors = {}
        for name, ggml_type, shape, offset, n_bytes, row_bytes in layouts:
            data = buffer[offset : offset + n_bytes].reshape(shape[:-1] + (row_bytes,))
            tensors[name] = TensorInfo(name, ggml_type, shape, offset, n_bytes, data)
        return GGUFFile(
            self.path, version, alignment, self.file_size, metadata, tensors, self.mm, buffer
        )

    def read_metadata(self, n_kv: int) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = self.string(f"metadata key #{i}")
            if key in metadata:
                raise self.corrupt(f"metadata key {key!r} appears twice")
            value_type = self.u32(f"the value type of metadata key {key!r}")
            metadata[key] = self.value(value_type, f"metadata key {key!r}", depth=0)
        return metadata

    def value(self, value_type: int, what: str, depth: int) -> Any:
        if value_type == V.STRING:
            return self.string(f"the value of {what}")
        if value_type == V.ARRAY:
            return self.array(what, depth)
        if value_type not in _SCALAR_STRUCTS:
            raise self.corrupt(f"{what} has unknown value type {value_type}")
        unpacker = _SCALAR_STRUCTS[value_type]
        self.need(unpacker.size, f"the {V(value_type).name.lower()} value of {what}")
        (value,) = unpacker.unpack_from(self.mm, self.pos)
        self.pos += unpacker.size
        if value_type == V.BOOL:
            return value != 0
        return float(value) if value_type in (V.FLOAT32, V.FLOAT64) else int(value)

    def array(self, what: str, depth: int) -> Any:
        if depth >= MAX_ARRAY_NESTING:
            raise self.corrupt(f"{what} nests arrays more than {MAX_ARRAY_NESTING} deep")
        item_type = self.u32(f"the array item type of {what}")
        count = self.u64(f"the array length of {what}")
        if item_type in _NUMERIC_DTYPES:
            dtype = _NUMERIC_DTYPES[item_type]
            self.need(count * dtype.itemsize, f"{what} (an array of {count} {dtype.name})")
            items = np.frombuffer(self.mm, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            if item_type == V.BOOL:
                return items != 0
            return items.astype(dtype.newbyteorder("="))  # a copy: metadata outlives the map
        if item_type == V.STRING:
            return self.string_array(count, what)
        if item_type == V.ARRAY:
            if count > (self.file_size - self.pos) // _MIN_ARRAY:
                raise self.corrupt(
                    f"{what} claims {count} nested arrays, more than the rest of the file holds"
                )
            return [self.array(f"{what}[{i}]", depth + 1) for i in range(count)]
        raise self.corrupt(f"{what} is an array of unknown value type {item_type}")

    def string_array(self, count: int, what: str) -> list[str]:
        end = self.file_size
        pos = self.pos
        if count > (end - pos) // _MIN_STRING:
            raise self.corrupt(
                f"{what} claims {count} strings, but the {end - pos} bytes left "
                f"hold at most {(end - pos) // _MIN_STRING}"
            )
        # The vocabulary has up to ~260k strings: one tight loop, bounds checked per item.
        mm = self.mm
        unpack = _U64.unpack_from
        items: list[str] = []
        append = items.append
        i = 0
        try:
            for i in range(count):
                (n,) = unpack(mm, pos)
                pos += 8
                if n > end - pos:
                    raise self.corrupt(
                        f"string #{i} of {what} is {n} bytes long, past the end of the file "
                        f"(offset {pos}, file size {end})"
                    )
                append(mm[pos : pos + n].decode("utf-8"))
                pos += n
        except struct.error as e:
            raise self.corrupt(f"{what} is cut off at string #{i} (offset {pos})") from e
        except UnicodeDecodeError as e:
            raise self.corrupt(f"string #{i} of {what} is not valid UTF-8 ({e.reason})") from e
        self.pos = pos
        return items

    def check_alignment(self, metadata: dict[str, Any]) -> int:
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (
            not isinstance(alignment, int)
            or isinstance(alignment, bool)
            or alignment <= 0
            or alignment & (alignment - 1)
        ):
            raise self.corrupt(
                f"general.alignment is {alignment!r}; it must be a positive power of two"
            )
        return alignment

    def read_tensor_infos(self, n_tensors: int) -> list[tuple[str, int, tuple[int, ...], int]]:
        infos = []
        seen: set[str] = set()
        for i in range(n_tensors):
            name = self.string(f"the name of tensor #{i}")
            if name in seen:
                raise self.corrupt(f"tensor name {name!r} appears twice")
            seen.add(name)
            what = f"tensor {name!r}"
            n_dims = self.u32(f"the dimension count of {what}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self.corrupt(f"{what} has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}")
            ne = [self.i64(f"dimension {d} of {what}") for d in range(n_dims)]
            ggml_type = self.u32(f"the type of {what}")
            rel_offset = self.u64(f"the data offset of {what}")
            for d, n in enumerate(ne):
                if n < 1:
                    kind = "zero" if n == 0 else "negative"
                    raise self.corrupt(f"{what} has a {kind} size ({n}) in dimension {d}")
            infos.append((name, ggml_type, tuple(reversed(ne)), rel_offset))
        return infos

    def tensor_layout(
        self,
        name: str,
        ggml_type: int,
        shape: tuple[int, ...],
        rel_offset: int,
        data_start: int,
        alignment: int,
    ) -> tuple[str, int, tuple[int, ...], int, int, int]:
        """(name, ggml_type, shape, absolute offset, n_bytes, row_bytes) of a checked tensor."""
        what = f"tensor {name!r}"
        if ggml_type not in BLOCK_SIZES:
            raise LocalLLMError(
                f"{self.path}: {what} has GGML type id {ggml_type}, which localllm does not "
                "know (it may be a newer or removed quantization); use a model quantized to a "
                "common type such as Q4_K_M or Q8_0"
            )
        block_size, type_size = BLOCK_SIZES[ggml_type]
        n_elements = 1
        for n in shape:
            n_elements *= n
        if n_elements > _INT64_MAX:
            raise self.corrupt(f"{what} has shape {shape}: its element count overflows int64")
        type_name = GGMLQuantizationType(ggml_type).name
        if shape[-1] % block_size:
            raise self.corrupt(
                f"{what} has rows of {shape[-1]} elements, not a multiple of the "
                f"{type_name} block size {block_size}"
            )
        row_bytes = shape[-1] // block_size * type_size
        n_bytes = n_elements // block_size * type_size
        if rel_offset % alignment:
            raise self.corrupt(
                f"{what} starts at data offset {rel_offset}, not a multiple of the "
                f"alignment {alignment}"
            )
        offset = data_start + rel_offset
        if offset + n_bytes > self.file_size:
            raise self.corrupt(
                f"{what} ({type_name}, shape {shape}, {n_bytes} bytes at offset {offset}) "
                f"runs past the end of the file (file size {self.file_size})"
            )
        return name, ggml_type, shape, offset, n_bytes, row_bytes


def _bad_magic_message(path: Path, magic: bytes) -> str:
    hint = "it is not a GGUF model"
    if magic[:1] == b"<":
        hint = "it looks like an HTML or XML page, so the download probably failed"
    elif magic == b"vers":
        hint = "it looks like a Git LFS pointer, not the model itself"
    elif magic in (b"lmgg", b"fmgg", b"tjgg"):
        hint = "it is an old GGML/GGJT model; convert it to GGUF with llama.cpp"
    elif magic[:2] == b"PK":
        hint = "it is a zip archive (a PyTorch checkpoint?); convert it to GGUF with llama.cpp"
    return f"{path}: not a GGUF file (starts with {magic!r} instead of b'GGUF'): {hint}"


def _bad_version_message(path: Path, version: int) -> str:
    if version & 0xFFFF == 0 and version >> 16 in SUPPORTED_VERSIONS:
        return f"{path}: a big-endian GGUF file; localllm reads only little-endian GGUF files"
    if version < SUPPORTED_VERSIONS[0]:
        return (
            f"{path}: GGUF version {version} is too old (localllm reads versions 2 and 3); "
            "download a model converted with a current llama.cpp"
        )
    return (
        f"{path}: GGUF version {version} is newer than localllm supports (versions 2 and 3); "
        "update localllm or use a model converted for version 3"
    )
