"""Build GGUF files byte by byte for tests: valid tiny models, and hostile files.

`write_gguf(path, metadata, tensors)` writes a valid file (the layout gguf-py's GGUFWriter
writes); its keyword overrides and the `pack_*` helpers make broken ones. Nothing here checks
what the reader checks, on purpose: tests need to write exactly the bytes they mean.

Metadata values are typed from their Python type (bool -> BOOL, int -> UINT32 when it fits
else INT32/UINT64/INT64, float -> FLOAT32, str -> STRING, list -> ARRAY of the items' type,
1-D numpy array -> ARRAY of its dtype), or explicitly:

    (GGUFValueType.UINT64, 5)                          a scalar of that type
    (GGUFValueType.ARRAY, GGUFValueType.INT16, [1, 2]) an array of that item type
    (GGUFValueType.ARRAY, GGUFValueType.ARRAY, [[1], ["a", "b"]])   nested arrays

Tensors map a name to (ggml_type, shape in numpy order, data): data is raw bytes (e.g. from
`gguf.quants.quantize(...).tobytes()`) or a numpy array whose bytes are written as they are.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

T = GGUFValueType
_SCALAR_FORMATS = {
    T.UINT8: "<B",
    T.INT8: "<b",
    T.UINT16: "<H",
    T.INT16: "<h",
    T.UINT32: "<I",
    T.INT32: "<i",
    T.FLOAT32: "<f",
    T.BOOL: "<?",
    T.UINT64: "<Q",
    T.INT64: "<q",
    T.FLOAT64: "<d",
}
_DTYPE_TYPES = {
    np.dtype(np.uint8): T.UINT8,
    np.dtype(np.int8): T.INT8,
    np.dtype(np.uint16): T.UINT16,
    np.dtype(np.int16): T.INT16,
    np.dtype(np.uint32): T.UINT32,
    np.dtype(np.int32): T.INT32,
    np.dtype(np.float32): T.FLOAT32,
    np.dtype(np.bool_): T.BOOL,
    np.dtype(np.uint64): T.UINT64,
    np.dtype(np.int64): T.INT64,
    np.dtype(np.float64): T.FLOAT64,
}

TensorSpec = tuple[int, Sequence[int], "bytes | np.ndarray"]


def pack_header(n_tensors: int, n_kv: int, version: int = 3, magic: bytes = b"GGUF") -> bytes:
    """The 24-byte header: magic, u32 version, u64 tensor count, u64 metadata count."""
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv)


def pack_string(s: str | bytes) -> bytes:
    """A GGUF string: u64 byte length, then the (UTF-8) bytes."""
    raw = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def value_type(value: Any) -> GGUFValueType:
    """The GGUF type a plain Python/numpy value is written as (see the module docstring)."""
    if isinstance(value, tuple) and value and isinstance(value[0], GGUFValueType):
        return value[0]
    if isinstance(value, (bool, np.bool_)):
        return T.BOOL
    if isinstance(value, (int, np.integer)):
        if 0 <= value < 2**32:
            return T.UINT32
        if -(2**31) <= value < 0:
            return T.INT32
        return T.UINT64 if value > 0 else T.INT64
    if isinstance(value, (float, np.floating)):
        return T.FLOAT32
    if isinstance(value, str):
        return T.STRING
    if isinstance(value, (list, np.ndarray)):
        return T.ARRAY
    raise TypeError(f"no GGUF type for {type(value).__name__}; use (GGUFValueType.X, value)")


def _item_type(items: Any) -> GGUFValueType:
    if isinstance(items, np.ndarray):
        return _DTYPE_TYPES[items.dtype]
    if not items:
        raise TypeError("an empty list needs an explicit (ARRAY, item_type, []) type")
    types = {value_type(item) for item in items}
    if types <= {T.UINT32, T.INT32}:
        fits_int32 = all(-(2**31) <= item < 2**31 for item in items)
        return T.INT32 if fits_int32 else T.INT64
    if types <= {T.UINT32, T.INT32, T.UINT64, T.INT64}:
        return T.INT64
    if T.FLOAT32 in types and types <= {T.FLOAT32, T.UINT32, T.INT32}:
        return T.FLOAT32
    if len(types) == 1:
        return types.pop()
    raise TypeError(f"mixed array item types {sorted(types)}; give (ARRAY, item_type, items)")


def pack_value(value: Any) -> tuple[GGUFValueType, bytes]:
    """(type, bytes) of one metadata value; the bytes exclude the u32 type id itself."""
    vtype = value_type(value)
    if isinstance(value, tuple) and value and isinstance(value[0], GGUFValueType):
        if vtype == T.ARRAY:
            _, item_type, items = value
            return T.ARRAY, _pack_array(GGUFValueType(item_type), items)
        value = value[1]
    if vtype == T.STRING:
        return vtype, pack_string(value)
    if vtype == T.ARRAY:
        return vtype, _pack_array(_item_type(value), value)
    return vtype, struct.pack(_SCALAR_FORMATS[vtype], value)


def _pack_array(item_type: GGUFValueType, items: Any) -> bytes:
    out = [struct.pack("<IQ", item_type, len(items))]
    if item_type == T.STRING:
        out += [pack_string(item) for item in items]
    elif item_type == T.ARRAY:
        for item in items:
            inner_type, inner = pack_value(item)
            if inner_type != T.ARRAY:
                raise TypeError("items of a nested array must be arrays")
            out.append(inner)
    else:
        dtype = np.dtype(_SCALAR_FORMATS[item_type].replace("?", "u1"))
        out.append(np.asarray(items).astype(dtype).tobytes())
    return b"".join(out)


def pack_kv(key: str | bytes, value: Any) -> bytes:
    """One metadata entry: key string, u32 value type, value."""
    vtype, raw = pack_value(value)
    return pack_string(key) + struct.pack("<I", vtype) + raw


def pack_tensor_info(name: str | bytes, ggml_type: int, shape: Sequence[int], offset: int) -> bytes:
    """One tensor-table entry. `shape` is numpy order; GGUF stores it reversed, as int64."""
    dims = list(reversed(shape))
    return (
        pack_string(name)
        + struct.pack("<I", len(dims))
        + struct.pack(f"<{len(dims)}q", *dims)
        + struct.pack("<IQ", ggml_type, offset)
    )


def tensor_nbytes(ggml_type: int, shape: Sequence[int]) -> int:
    """Bytes of a tensor of this type and shape (rows must hold whole blocks)."""
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return int(np.prod(shape, dtype=np.int64)) // block_size * type_size


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def gguf_bytes(
    metadata: Mapping[str, Any],
    tensors: Mapping[str, TensorSpec] | Sequence[tuple[str, int, Sequence[int], Any]] = (),
    *,
    version: int = 3,
    alignment: int = 32,
    magic: bytes = b"GGUF",
    n_tensors: int | None = None,
    n_kv: int | None = None,
    offsets: Sequence[int] | None = None,
    check_sizes: bool = True,
) -> bytes:
    """The bytes of a GGUF file; see `write_gguf`."""
    entries = (
        [(name, *spec) for name, spec in tensors.items()]
        if isinstance(tensors, Mapping)
        else list(tensors)
    )
    metadata = dict(metadata)
    if alignment != 32:
        metadata.setdefault("general.alignment", (T.UINT32, alignment))
    blobs = []
    for name, ggml_type, shape, data in entries:
        blob = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
        if check_sizes and len(blob) != tensor_nbytes(ggml_type, shape):
            raise ValueError(
                f"tensor {name!r}: {len(blob)} data bytes, "
                f"{GGMLQuantizationType(ggml_type).name} {tuple(shape)} needs "
                f"{tensor_nbytes(ggml_type, shape)}"
            )
        blobs.append(blob)
    if offsets is None:
        offsets, position = [], 0
        for blob in blobs:
            offsets.append(position)
            position = _align(position + len(blob), alignment)
    head = [
        pack_header(
            len(entries) if n_tensors is None else n_tensors,
            len(metadata) if n_kv is None else n_kv,
            version,
            magic,
        )
    ]
    head += [pack_kv(key, value) for key, value in metadata.items()]
    head += [
        pack_tensor_info(name, ggml_type, shape, offset)
        for (name, ggml_type, shape, _), offset in zip(entries, offsets, strict=True)
    ]
    out = bytearray(b"".join(head))
    if not entries:
        return bytes(out)
    # The data is always packed in order; an `offsets` override only changes the table.
    for blob in blobs:
        out += bytes(_align(len(out), alignment) - len(out)) + blob
    out += bytes(_align(len(out), alignment) - len(out))
    return bytes(out)


def write_gguf(
    path: str | Path,
    metadata: Mapping[str, Any],
    tensors: Mapping[str, TensorSpec] | Sequence[tuple[str, int, Sequence[int], Any]] = (),
    **overrides: Any,
) -> Path:
    """Write a GGUF file and return its path.

    metadata: key -> value (typed as in the module docstring), written in order.
    tensors: name -> (ggml_type, shape_numpy_order, bytes | np.ndarray), or a list of
        (name, ggml_type, shape, data) tuples (which may repeat a name, for hostile files).
    overrides (keyword): version=3, alignment=32 (adds general.alignment when not 32),
        magic=b"GGUF", n_tensors / n_kv (header counts to write instead of the real ones),
        offsets (data offsets to write in the tensor table; the data itself is still packed
        in order), check_sizes=True (False writes data whose length does not match the
        declared type and shape).
    """
    path = Path(path)
    path.write_bytes(gguf_bytes(metadata, tensors, **overrides))
    return path
