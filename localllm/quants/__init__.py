"""GGML weight types: one registry keyed by GGML type id, with Numba kernels per type.

Every kernel takes the raw weight as it sits in the memory-mapped GGUF: uint8 rows of
`n_cols // block_size * type_size` bytes (F32/F16/BF16 included, with block_size 1).

    qt = get_quant_type(tensor.ggml_type, tensor.name)
    qt.matvec(w, x, out)   # w: uint8[n_rows, row_bytes], x: float32[n_cols], out: float32[n_rows]
    qt.matmul(w, x, out)   # x: float32[n_tokens, n_cols], out: float32[n_tokens, n_rows]
    qt.dequantize(w)       # -> float32[n_rows, n_cols], bit-exact with gguf.quants.dequantize

The kernels are compiled lazily, per argument types, and cached on disk. Pass C-contiguous
arrays: read-only uint8 weights (what a read-only memmap gives), float32 activations and outputs;
other layouts work but cost another compilation. The module-level `dequantize`, `matvec` and
`matmul` wrappers check shapes, convert arguments to that form and allocate `out` if needed.

Numba's on-disk cache of the factory-made kernels is keyed on the whole package's source
(kernels.SOURCE_KEY), so an edit anywhere here recompiles them. The hand-written matvec kernels
are cached per file as Numba does it: after editing float.py (whose helpers are inlined
everywhere), delete this package's __pycache__.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from gguf.constants import GGMLQuantizationType

from ..errors import LocalLLMError
from . import blocks, gemm, intdot, iquants, kquants, legacy, mxfp4, ternary
from . import float as fp
from .activations import BF16, F16, NONE, Q8_0, Q8_1, Q8_K
from .kernels import dequantize_kernel, matmul_kernel


@dataclass(frozen=True)
class QuantType:
    """One GGML weight type: its block layout and kernels (all Numba, taking raw uint8 rows).

    A record names what is written per type (the row dequantizer, the float matvec, the
    integer dot's block reader); the factories in kernels.py, intdot.py and gemm.py make the
    rest."""

    ggml_type: int  # GGML type id
    name: str  # "Q4_K"
    block_size: int  # weights per block
    type_size: int  # bytes per block
    vec_dot_type: str  # the activation type ggml's CPU dot product uses (activations.py)
    dequantize_row: Callable  # (row: uint8[row_bytes], out: float32[n_cols]), Numba-only
    matvec: Callable  # (w: uint8[n_rows, row_bytes], x: float32[n_cols], out: float32[n_rows])
    dot_unpacker: Callable | None = None  # its block reader (blocks.py), None: float kernels only
    cuda: bool = False  # cuda/kernels.dequantize_chunk has this type
    one_row: bool = False  # a token alone reads the rows one at a time (intdot.matvec_kernel)
    # made from the fields above by the factories:
    dequantize: Callable = field(init=False)  # (raw: uint8[n_rows, row_bytes]) -> float32[..]
    matmul: Callable = field(init=False)  # (w, x: float32[n_tokens, n_cols], out: float32[..])
    # the integer kernels, or None: (ws, xq, xd, xs, xl, xb, outs), see intdot.quantize_q8;
    # int_matvec with the weights in the SIMD lanes (a token or a few), int_matmul with the
    # tokens in them (gemm.py: prompts and batches; None on CPUs without AVX2)
    int_matvec: Callable | None = field(init=False)
    int_matmul: Callable | None = field(init=False)
    # a MoE's experts, each on its own rows of x (intdot.experts_kernel), or None
    int_experts: Callable | None = field(init=False)

    def __post_init__(self):
        set_field = object.__setattr__.__get__(self)  # frozen: the factories' results, once
        set_field("dequantize", dequantize_kernel(self))
        set_field("matmul", matmul_kernel(self))
        int_matvec = int_matmul = int_experts = None
        if self.dot_unpacker is not None:
            int_matvec = intdot.matvec_kernel(self.ggml_type, self.name.lower(), self.one_row)
            int_experts = intdot.experts_kernel(self.ggml_type, self.name.lower(), self.one_row)
            if gemm.AVAILABLE:
                int_matmul = gemm.gemm_kernel(self.ggml_type, self.name.lower())
        set_field("int_matvec", int_matvec)
        set_field("int_matmul", int_matmul)
        set_field("int_experts", int_experts)


def _record(ggml_type, name, block_size, type_size, vec_dot_type, module, unpacker=None,
            cuda=True, one_row=False):  # fmt: skip
    suffix = name.lower()
    return QuantType(
        ggml_type, name, block_size, type_size, vec_dot_type,
        getattr(module, f"dequantize_row_{suffix}"), getattr(module, f"matvec_{suffix}"),
        unpacker, cuda, one_row,
    )  # fmt: skip


# Adding a type: its row dequantizer and matvec (and intdot unpacker), and one line here.
QUANT_TYPES: dict[int, QuantType] = {
    qt.ggml_type: qt
    for qt in (
        _record(0, "F32", 1, 4, NONE, fp),
        _record(1, "F16", 1, 2, F16, fp),
        _record(30, "BF16", 1, 2, BF16, fp),
        _record(2, "Q4_0", 32, 18, Q8_0, legacy, blocks.q4_0),
        _record(3, "Q4_1", 32, 20, Q8_1, legacy, blocks.q4_1),
        _record(6, "Q5_0", 32, 22, Q8_0, legacy, blocks.q5_0, one_row=True),
        _record(7, "Q5_1", 32, 24, Q8_1, legacy, blocks.q5_1),
        _record(8, "Q8_0", 32, 34, Q8_0, legacy, blocks.q8_0, one_row=True),
        _record(10, "Q2_K", 256, 84, Q8_K, kquants, blocks.q2_k),
        _record(11, "Q3_K", 256, 110, Q8_K, kquants, blocks.q3_k),
        _record(12, "Q4_K", 256, 144, Q8_K, kquants, blocks.q4_k, one_row=True),
        _record(13, "Q5_K", 256, 176, Q8_K, kquants, blocks.q5_k, one_row=True),
        _record(14, "Q6_K", 256, 210, Q8_K, kquants, blocks.q6_k, one_row=True),
        _record(20, "IQ4_NL", 32, 18, Q8_0, iquants, blocks.iq4_nl),
        _record(16, "IQ2_XXS", 256, 66, Q8_K, iquants, blocks.iq2_xxs),
        _record(17, "IQ2_XS", 256, 74, Q8_K, iquants, blocks.iq2_xs),
        _record(18, "IQ3_XXS", 256, 98, Q8_K, iquants, blocks.iq3_xxs),
        _record(19, "IQ1_S", 256, 50, Q8_K, iquants, blocks.iq1_s),
        _record(21, "IQ3_S", 256, 110, Q8_K, iquants, blocks.iq3_s),
        _record(22, "IQ2_S", 256, 82, Q8_K, iquants, blocks.iq2_s),
        _record(23, "IQ4_XS", 256, 136, Q8_K, iquants, blocks.iq4_xs, one_row=True),
        _record(29, "IQ1_M", 256, 56, Q8_K, iquants, blocks.iq1_m),
        _record(34, "TQ1_0", 256, 54, Q8_K, ternary, blocks.tq1_0),
        _record(35, "TQ2_0", 256, 66, Q8_K, ternary, blocks.tq2_0),
        _record(39, "MXFP4", 32, 17, Q8_0, mxfp4, blocks.mxfp4),
    )
}


def get_quant_type(ggml_type: int, tensor_name: str = "") -> QuantType:
    """The registry entry for a GGML type id.

    Raises LocalLLMError naming the type and the tensor (if given) when the type is unsupported.
    """
    qt = QUANT_TYPES.get(int(ggml_type))
    if qt is not None:
        return qt
    try:
        type_name = f"{GGMLQuantizationType(int(ggml_type)).name} (type id {int(ggml_type)})"
    except ValueError:
        type_name = f"unknown type id {int(ggml_type)}"
    where = f"tensor '{tensor_name}'" if tensor_name else "a tensor"
    supported = ", ".join(qt.name for qt in QUANT_TYPES.values())
    raise LocalLLMError(
        f"{where} uses GGML type {type_name}, which localllm cannot run. "
        f"Supported types: {supported}. Use a GGUF quantized to one of these (e.g. Q4_K_M or Q8_0)."
    )


def _weight_rows(raw: np.ndarray, qt: QuantType) -> np.ndarray:
    """raw as C-contiguous read-only uint8 with whole blocks in the last dimension."""
    raw = np.ascontiguousarray(raw)
    if raw.dtype != np.uint8:  # e.g. an F32 or F16 tensor handed over in its own dtype
        raw = raw.view(np.uint8)
    if raw.ndim == 0 or raw.shape[-1] % qt.type_size:
        raise ValueError(
            f"{qt.name} rows must be whole {qt.type_size}-byte blocks, got shape {raw.shape}"
        )
    if raw.flags.writeable:
        # one compiled signature for weights: the read-only one a read-only memmap gives
        raw = raw.view()
        raw.flags.writeable = False
    return raw


def _n_cols(w: np.ndarray, qt: QuantType) -> int:
    return w.shape[-1] // qt.type_size * qt.block_size


def dequantize(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """raw: uint8[..., row_bytes] of any leading shape -> float32[..., n_cols], a new array."""
    qt = get_quant_type(ggml_type)
    raw = _weight_rows(raw, qt)
    rows = raw.reshape(-1, raw.shape[-1])  # uint8[n_rows, row_bytes]
    return qt.dequantize(rows).reshape(*raw.shape[:-1], _n_cols(raw, qt))


def _activations(x: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape != shape:
        raise ValueError(f"{what} must have shape {shape}, got {x.shape}")
    return x


def _output(out: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    if out is None:
        return np.empty(shape, np.float32)
    if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 of shape {shape}")
    return out


def matvec(
    w: np.ndarray, ggml_type: int, x: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """out[n_rows] = w[n_rows, n_cols] @ x[n_cols], dequantizing w block by block on the fly."""
    qt = get_quant_type(ggml_type)
    w = _weight_rows(w, qt)
    if w.ndim != 2:
        raise ValueError(f"w must be uint8[n_rows, row_bytes], got shape {w.shape}")
    x = _activations(x, (_n_cols(w, qt),), "x")
    out = _output(out, (w.shape[0],))
    qt.matvec(w, x, out)
    return out


def matmul(
    w: np.ndarray, ggml_type: int, x: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """out[n_tokens, n_rows] = x[n_tokens, n_cols] @ w[n_rows, n_cols].T, w dequantized per tile."""
    qt = get_quant_type(ggml_type)
    w = _weight_rows(w, qt)
    if w.ndim != 2 or np.ndim(x) != 2:
        raise ValueError(
            f"need w: uint8[n_rows, row_bytes] and x: [n_tokens, n_cols], got {w.shape}"
        )
    x = _activations(x, (np.shape(x)[0], _n_cols(w, qt)), "x")
    out = _output(out, (x.shape[0], w.shape[0]))
    if x.shape[0] == 1:  # one token: the matvec kernel streams the weights without a row tile
        qt.matvec(w, x[0], out[0])
    else:
        qt.matmul(w, x, out)
    return out
