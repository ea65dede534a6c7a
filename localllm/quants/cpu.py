"""Which SIMD instructions the integer kernels may use: the CPU features Numba compiles for that
this CPU also has (cpuid), never more.

    INSTRUCTION_SET   "vnni" | "avx2" | None   (intdot.py's dot products; None: float kernels)
    TILE_LANES        16 | 8 | 0              (gemm.py's token lanes: zmm, ymm, or no tiles)
    HARDWARE_HALF     bool                    (float <-> IEEE half in one instruction)
    SLOW_GATHERS      bool                    (grid lookups by permutes: AMD Zen)
"""

from __future__ import annotations

import platform

import llvmlite.binding as llvm
from numba.core import config as numba_config


def host_features() -> set[str]:
    """The features this CPU has, as LLVM reads them from cpuid (e.g. "avx512vnni", "avxvnni")."""
    return {name for name, present in llvm.get_host_cpu_features().items() if present}


def _target_features() -> set[str]:
    """The CPU features Numba compiles for: $NUMBA_CPU_FEATURES if set, else the host's."""
    if numba_config.CPU_FEATURES is not None:
        return {f[1:] for f in numba_config.CPU_FEATURES.split(",") if f.startswith("+")}
    return host_features()


def _instruction_set(features: set[str]) -> str | None:
    """ "vnni": vpdpbusd (AVX-512 VNNI with VL, or the VEX-coded AVX-VNNI); "avx2": vpmaddubsw +
    vpmaddwd, ggml's AVX2 way; None: neither, the float kernels run instead.

    Exact cpuid flags, never a CPU family: Zen 4 has AVX-512 VNNI but not AVX-VNNI, Alder Lake
    the reverse, and the 256-bit vpdpbusd exists in either encoding only with its own flag."""
    if {"avx512vnni", "avx512vl"} <= features or "avxvnni" in features:
        return "vnni"
    if {"avx2", "f16c"} <= features:
        return "avx2"
    return None


def choose_instruction_set(target: set[str], host: set[str]) -> str | None:
    """The instruction set for code compiled for `target` that runs on `host`: only what both
    have, so that a target that claims more than this CPU has ($NUMBA_CPU_FEATURES) never makes
    the kernels execute an instruction the CPU lacks (SIGILL)."""
    return _instruction_set(target & host)


def tile_lanes(features: set[str]) -> int:
    """Tokens per vector of the prefill tiles (gemm.py): 16 with AVX-512 VNNI (zmm), 8 with the
    256-bit vpdpbusd alone (AVX-VNNI, or AVX-512 VNNI without 512-bit registers in use) and with
    AVX2 (vpmaddubsw, ggml's sign trick), 0 without either (the float kernels)."""
    instruction_set = _instruction_set(features)
    if instruction_set is None:
        return 0
    if instruction_set == "vnni" and {"avx512vnni", "avx512f", "avx512bw"} <= features:
        return 16
    return 8


_USABLE = _target_features() & host_features()
INSTRUCTION_SET = _instruction_set(_USABLE)
TILE_LANES = tile_lanes(_USABLE)

# AVX-512 VNNI with VL: vpdpbusd / vpdpwssd EVEX-coded (any of 32 registers; else AVX-VNNI's VEX)
EVEX_VNNI = {"avx512vnni", "avx512vl"} <= _USABLE

# AVX-512BW/VL: <n x i1> vectors live in mask registers (elsewhere blocks.BlockReader.sign_bits
# builds byte masks instead)
MASK_REGISTERS = {"avx512bw", "avx512vl"} <= _USABLE

# GFNI and AVX-512 BITALG (Ice Lake, Zen 4 and later): the grid types' sign bits in a few
# instructions (blocks._ksigns)
BIT_SHUFFLES = {"gfni", "avx512bitalg", "avx512bw", "avx512vl"} <= _USABLE

# AVX-512 VBMI (Ice Lake, Zen 4 and later): vpermb, a byte table lookup that ignores the index
# bits above the table (blocks._iq4_levels: no mask of the nibbles first)
BYTE_PERMUTES = {"avx512vbmi", "avx512vl"} <= _USABLE

# Whether the grid types should look their entries up by register permutes (blocks.grid_codes:
# vpermi2w, vpermw) rather than by gathers: a speed choice, not a correctness one, by the CPU
# Numba compiles for. AMD's Zen 4 runs a zmm vpermi2w as one uop and gathers about an element a
# cycle, so the permutes won there (IQ3_XXS/IQ3_S 1.7x in cache); Intel's Sapphire Rapids the
# reverse (vpermi2w three uops on one port, fast gathers): the permutes lost there
# (scripts/bench-quant-types, 2 threads, alternating, GB/s with gathers / permutes: IQ3_S 12.0-12.1
# / 8.8, IQ2_XS 9.7-10.0 / 6.8-7.0, IQ2_XXS 11.0 / 9.5, IQ3_XXS 11.9-12.2 / 11.2-11.6).
SLOW_GATHERS = (numba_config.CPU_NAME or llvm.get_host_cpu_name()).startswith("znver")

# Half <-> float in one instruction where the CPU has one (x86 F16C: every AVX2 CPU; ARMv8);
# elsewhere LLVM would call a runtime helper Numba cannot link, so bit-exact integer code.
HARDWARE_HALF = "f16c" in _USABLE or platform.machine().lower() in ("aarch64", "arm64")
