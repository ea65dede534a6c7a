"""The integer kernels (quants/intdot.py) against a float64 reference and the float kernels, for
each instruction set they are compiled for: this CPU's, and older x86 targets through Numba's
NUMBA_CPU_NAME / NUMBA_CPU_FEATURES (code for them runs on this CPU too)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from random_blocks import ggml_id, random_weights, read_only

from localllm.quants import QUANT_TYPES, dequantize, gemm, get_quant_type, intdot
from localllm.quants.activations import Q8_BLOCK_SIZE, round_activations

pytestmark = pytest.mark.skipif(not intdot.AVAILABLE, reason="no integer kernels for this CPU")

TYPES = {qt.name: t for t, qt in QUANT_TYPES.items() if qt.int_matvec is not None}
ASYMMETRIC_LEGACY = {"Q4_1", "Q5_1"}  # w = d * q + m, with m an f16 at byte 2 of each block


def quantized(x: np.ndarray, ggml_type: int) -> tuple:
    xq = intdot.activation_buffers(*x.shape)
    intdot.quantize_q8(x, Q8_BLOCK_SIZE[get_quant_type(ggml_type).vec_dot_type], *xq)
    return xq


def reference(raw: np.ndarray, ggml_type: int, x: np.ndarray, xq: tuple) -> np.ndarray:
    """ggml's dot products in float64: dequantized weights times the quantized activations. For
    Q4_1/Q5_1, ggml takes sum(x) from the f16-rounded block sum xs (as quantize_q8 stores it)."""
    w = dequantize(raw, ggml_type).astype(np.float64)  # bit-exact, tested in test_quants
    q, d, s = (a.astype(np.float64) for a in xq[:3])
    xr = q * np.repeat(d, 32, axis=1)
    out = xr @ w.T
    qt = get_quant_type(ggml_type)
    if qt.name in ASYMMETRIC_LEGACY:
        blocks = raw.reshape(raw.shape[0], -1, qt.type_size)
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        exact_sums = xr.reshape(x.shape[0], -1, 32).sum(axis=2)
        out += (s - exact_sums) @ m.T
    return out


def test_quantize_q8_equals_round_activations():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 512)).astype(np.float32) * np.float32(3.0)
    x[1, :256] = 0.0  # an all-zero super-block
    x[2, 7] = -40.0  # the largest magnitude negative (Q8_K scales by it)
    for ggml_type, kind in ((8, "q8_0"), (3, "q8_1"), (12, "q8_K")):
        xq, xd, xs, xl, xb = quantized(x, ggml_type)
        rounded = round_activations(x, kind, np.empty_like(x))
        np.testing.assert_array_equal(xq * np.repeat(xd, 32, axis=1), rounded)
        q = xq.astype(np.int64)
        np.testing.assert_array_equal(xl, q.reshape(3, -1, 4).sum(axis=2))
        np.testing.assert_array_equal(xb, q.reshape(3, -1, 16).sum(axis=2))
        sums = q.reshape(3, -1, 32).sum(axis=2) * xd.astype(np.float64)
        if kind != "q8_K":  # stored as f16 (Q8_1 in ggml), from the unrounded scale
            np.testing.assert_allclose(xs, sums, rtol=2e-3, atol=1e-6)
        else:
            np.testing.assert_allclose(xs, sums, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("n_rows", [1, 3, 4, 37])
def test_matvec_matches_reference(name, n_rows):
    ggml_type = TYPES[name]
    rng = np.random.default_rng(n_rows * 100 + ggml_type)
    # 32-weight blocks: 15 = a group of 8 (intdot.GROUP), then 4, 2 and 1
    n_cols = 512 if get_quant_type(ggml_type).block_size == 256 else 480
    raw = read_only(random_weights(name, n_rows, n_cols, rng))
    x = rng.standard_normal((1, n_cols)).astype(np.float32)
    xq = quantized(x, ggml_type)
    expected = reference(raw, ggml_type, x, xq)
    out = np.full((1, n_rows), np.nan, np.float32)
    get_quant_type(ggml_type).int_matvec((raw,), *xq, (out,))
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-6 * np.abs(expected).max())


@pytest.mark.parametrize("name", sorted(TYPES))
def test_activations_at_full_scale_with_the_weights_signs(name):
    """The largest sums a lane can hold: every activation quant at 127 with its weight's sign.
    The narrow types (Layout.narrow) multiply each lane's sum of 4 products by its scale in
    int16 pairs (vpmaddwd): a type whose levels left +-64 would overflow there and fail."""
    ggml_type = TYPES[name]
    rng = np.random.default_rng(ggml_id(name) + 5)
    n_cols = 1024 if get_quant_type(ggml_type).block_size == 256 else 480
    raw = read_only(random_weights(name, 12, n_cols, rng))
    w = dequantize(raw, ggml_type)
    for r in range(raw.shape[0]):
        x = np.where(w[r] < 0, -1.0, 1.0).astype(np.float32)[None]
        xq = quantized(x, ggml_type)
        assert np.abs(xq[0]).min() == 127
        expected = reference(raw[r : r + 1], ggml_type, x, xq)
        out = np.full((1, 1), np.nan, np.float32)
        get_quant_type(ggml_type).int_matvec((raw[r : r + 1],), *xq, (out,))
        np.testing.assert_allclose(out, expected, rtol=0, atol=2e-6 * np.abs(expected).max())


@pytest.mark.parametrize("name", sorted(TYPES))
def test_integer_and_float_kernels_agree(name):
    """The two paths a CPU may take: the integer one here, the float one on rounded activations
    (what a CPU without VNNI runs)."""
    ggml_type = TYPES[name]
    rng = np.random.default_rng(ggml_id(name))
    qt = get_quant_type(ggml_type)
    raw = read_only(random_weights(name, 64, 4 * 256, rng))
    x = rng.standard_normal((1, 4 * 256)).astype(np.float32)
    xq = quantized(x, ggml_type)
    ours = np.empty(64, np.float32)
    qt.int_matvec((raw,), *xq, (ours[None],))
    theirs = np.empty(64, np.float32)
    qt.matvec(
        raw,
        round_activations(x, get_quant_type(ggml_type).vec_dot_type, np.empty_like(x))[0],
        theirs,
    )
    # equal up to float summation order, and the f16 block sums of Q8_1
    tol = 2e-3 if name in ASYMMETRIC_LEGACY else 2e-5
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=tol * np.abs(theirs).max())


@pytest.mark.parametrize("name", ["Q4_K", "Q5_0"])
def test_matvec_of_several_weights(name):
    """Q/K/V or gate/up in one call: each output equals its own single-weight call."""
    ggml_type = TYPES[name]
    rng = np.random.default_rng(7)
    n_cols = 512
    raws = tuple(read_only(random_weights(name, n, n_cols, rng)) for n in (5, 37, 4))
    xq = quantized(rng.standard_normal((1, n_cols)).astype(np.float32), ggml_type)
    together = tuple(np.full((1, raw.shape[0]), np.nan, np.float32) for raw in raws)
    get_quant_type(ggml_type).int_matvec(raws, *xq, together)
    for raw, out in zip(raws, together):
        alone = np.full((1, raw.shape[0]), np.nan, np.float32)
        get_quant_type(ggml_type).int_matvec((raw,), *xq, (alone,))
        np.testing.assert_array_equal(out, alone)


@pytest.mark.parametrize("name", ["Q4_K", "Q4_0"])
def test_each_token_through_its_own_weight(name):
    """each=True (a token's MoE experts): row i of the output is token i's product with the i-th
    weight, bit for bit what a call for that token and weight alone gives. Q4_K goes a row at
    a time, Q4_0 four."""
    ggml_type = TYPES[name]
    rng = np.random.default_rng(11)
    n_rows, n_cols, n_tokens = 37, 512, 5
    raws = tuple(read_only(random_weights(name, n_rows, n_cols, rng)) for _ in range(n_tokens))
    x = rng.standard_normal((n_tokens, n_cols)).astype(np.float32)
    xq = quantized(x, ggml_type)
    out = np.full((n_tokens, n_rows), np.nan, np.float32)
    get_quant_type(ggml_type).int_matvec(raws, *xq, (out,) * n_tokens, True)
    for i, raw in enumerate(raws):
        alone = np.full((1, n_rows), np.nan, np.float32)
        get_quant_type(ggml_type).int_matvec((raw,), *quantized(x[i : i + 1], ggml_type), (alone,))
        np.testing.assert_array_equal(out[i], alone[0])


@pytest.mark.parametrize("name", ["Q4_K", "Q4_0", "MXFP4"])
def test_experts_each_on_their_own_rows(name):
    """experts_kernel (a prompt's MoE experts): each span of rows, sorted by expert, through its
    expert's matrix of the 3-D stack, bit for bit what a call for that expert's rows alone gives
    (spans of 1 to 11 tokens: every tile width; an expert chosen by no token is skipped)."""
    ggml_type = TYPES[name]
    qt = get_quant_type(ggml_type)
    rng = np.random.default_rng(12)
    n_experts, n_rows, n_cols = 6, 37, 512
    stack = read_only(
        np.stack([random_weights(name, n_rows, n_cols, rng) for _ in range(n_experts)])
    )
    ids = np.array([0, 2, 3, 5], np.int64)
    spans = np.array([0, 1, 8, 19, 21], np.int64)
    x = rng.standard_normal((spans[-1], n_cols)).astype(np.float32)
    out = np.full((spans[-1], n_rows), np.nan, np.float32)
    bounds = np.stack([spans[:-1], spans[1:]], axis=1)
    qt.int_experts(stack, ids, bounds, *quantized(x, ggml_type), out)
    for i, e in enumerate(ids):
        rows = slice(spans[i], spans[i + 1])
        alone = np.full((spans[i + 1] - spans[i], n_rows), np.nan, np.float32)
        qt.int_matvec((stack[e],), *quantized(x[rows], ggml_type), (alone,))
        np.testing.assert_array_equal(out[rows], alone)


HASWELL = (
    "+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fsgsbase,+lzcnt,+mmx,+movbe,+pclmul,"
    "+popcnt,+rdrnd,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave,+xsaveopt"
)
AVX512_VNNI = HASWELL + ",+avx512f,+avx512bw,+avx512vl,+avx512dq,+avx512cd,+avx512vnni"
AVX512_GRID = AVX512_VNNI + ",+avx512vbmi,+avx512vbmi2,+avx512bitalg,+avx512vpopcntdq,+gfni"
TARGETS = {  # instruction set: (NUMBA_CPU_NAME, NUMBA_CPU_FEATURES)
    "avx2": ("haswell", HASWELL),
    "vnni": ("alderlake", HASWELL + ",+avxvnni"),  # AVX-VNNI (VEX), no AVX-512
    # AVX-512 VNNI without GFNI and BITALG: 512-bit kernels, the grid types' signs without
    # vpshufbitqmb (blocks._ksigns_wide's other path)
    "avx512": ("cascadelake", AVX512_VNNI),
    # AVX-512 with VBMI, GFNI and BITALG, the two ways of the grid types' lookups (cpu.SLOW_GATHERS,
    # by the CPU name): Zen 4's register permutes, Ice Lake's and later Intel's gathers. Whichever
    # this CPU is, the other way is tested here too.
    "zen4": ("znver4", AVX512_GRID),
    "icelake": ("icelake-server", AVX512_GRID),
    # AVX2 on AMD Zen 2/3: the grid entries by scalar loads (blocks.SCALAR_LOOKUPS)
    "zen3": ("znver3", HASWELL),
    None: (
        "nehalem",
        "+64bit,+cmov,+cx16,+mmx,+popcnt,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3",
    ),
}


def skip_unless_host_runs(instruction_set) -> None:
    """Code compiled for a target this CPU lacks a feature of dies with SIGILL: skip instead."""
    missing = {f[1:] for f in TARGETS[instruction_set][1].split(",")} - intdot.host_features()
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(sorted(missing))}, which the target needs")


def run_for_target(instruction_set, tmp_path: Path, *args: str) -> str:
    skip_unless_host_runs(instruction_set)
    cpu_name, features = TARGETS[instruction_set]
    env = dict(
        os.environ,
        NUMBA_CPU_NAME=cpu_name,
        NUMBA_CPU_FEATURES=features,
        NUMBA_CACHE_DIR=str(tmp_path / "numba"),
    )
    result = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


# The tests above run again in a subprocess compiled for another target: `-k KERNEL_SELECT`.
KERNEL_TESTS = ("-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k")
KERNEL_SELECT = "matches_reference and 37 or agree or tiles_equal"


@pytest.mark.slow  # two subprocesses that compile every kernel afresh
@pytest.mark.parametrize("instruction_set", ["avx2", "vnni", "avx512"])
def test_other_instruction_sets(instruction_set, tmp_path):
    """The AVX2 (vpmaddubsw), AVX-VNNI (VEX vpdpbusd) and AVX-512 VNNI without GFNI/BITALG
    (Cascade Lake) variants pass the tests above."""
    code = "from localllm.quants import intdot; print(intdot.INSTRUCTION_SET)"
    expected = "vnni" if instruction_set == "avx512" else instruction_set
    assert run_for_target(instruction_set, tmp_path, "-c", code).strip() == expected
    run_for_target(instruction_set, tmp_path, *KERNEL_TESTS, KERNEL_SELECT)


@pytest.mark.slow  # two subprocesses that compile the grid types' kernels afresh
@pytest.mark.parametrize(
    "target, ways",
    [("zen4", "True True False"), ("icelake", "False True False"), ("zen3", "False False True")],
)
def test_grid_lookups_either_way(target, ways, tmp_path):
    """The grid types' kernels with their entries from register permutes (where gathers are
    slow: AMD Zen 4), from gathers (Intel) and from scalar loads (AVX2 on Zen 2/3) pass the
    tests above, whichever way this CPU takes (the AVX2 gathers: test_other_instruction_sets)."""
    code = (
        "from localllm.quants import blocks; "
        "print(blocks.PERMUTED_GRIDS, blocks.BLOCK_SIGNS, blocks.SCALAR_LOOKUPS)"
    )
    assert run_for_target(target, tmp_path, "-c", code).strip() == ways
    grid_types = f"({KERNEL_SELECT}) and IQ and not IQ4"
    out = run_for_target(target, tmp_path, *KERNEL_TESTS, grid_types)
    assert "21 passed" in out, out[-2000:]


def test_no_simd_falls_back_to_float_kernels(tmp_path):
    code = (
        "from localllm.backend import CPUBackend; from localllm.quants import intdot; "
        "print(intdot.INSTRUCTION_SET, CPUBackend(1).integer_kernels)"
    )
    assert run_for_target(None, tmp_path, "-c", code).split() == ["None", "False"]


@pytest.mark.slow  # compiles every kernel a model needs afresh
def test_no_simd_runs_the_models_as_llama_cpp(tmp_path):
    """The portable path (what an ARM laptop or a CPU without AVX runs: the float kernels, the
    attention's LLVM IR on generic vectors, halves converted in integers without F16C) compiled
    for a target without AVX or F16C: the three real models' teacher-forced logits and top-1
    against llama.cpp, as test_model checks them natively."""
    tests = str(Path(__file__).parent / "test_model.py")
    select = "teacher_forced"
    out = run_for_target(None, tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", tests,
                         "-k", select)  # fmt: skip
    assert "3 passed" in out and "skipped" not in out, out[-2000:]


ZEN4 = {"avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni"}  # no AVX-VNNI


@pytest.mark.parametrize(
    "features, expected",
    [
        (ZEN4, "vnni"),  # EVEX vpdpbusd on 256-bit vectors
        (ZEN4 - {"avx512vl"}, "avx2"),  # no 256-bit EVEX form without VL
        ({"avx2", "f16c", "avxvnni"}, "vnni"),  # Alder Lake: VEX vpdpbusd
        ({"avx2", "f16c"}, "avx2"),
        ({"avx2"}, None),  # the kernels convert halves with F16C
        ({"sse4.2", "avxvnni"}, "vnni"),
        (set(), None),
    ],
)
def test_instruction_set_from_exact_flags(features, expected):
    assert intdot.choose_instruction_set(features, features) == expected


def test_instruction_set_never_beyond_this_cpu():
    """A target that claims what the CPU lacks (AVX-VNNI on a Zen 4) gets only what both have."""
    assert intdot.choose_instruction_set(ZEN4 | {"avxvnni"}, ZEN4 - {"avx512vl"}) == "avx2"
    assert intdot.choose_instruction_set({"avx2", "f16c", "avxvnni"}, {"sse2"}) is None
    host = intdot.host_features()
    assert intdot.choose_instruction_set(host, host) == intdot.INSTRUCTION_SET or (
        os.environ.get("NUMBA_CPU_FEATURES") is not None
    )


def test_targets_this_cpu_cannot_run_are_skipped(monkeypatch, tmp_path):
    """On a Zen 4 (AVX-512 VNNI, no AVX-VNNI) the alderlake target must skip, not SIGILL."""
    zen4 = {f[1:] for f in HASWELL.split(",")} | ZEN4
    monkeypatch.setattr(intdot, "host_features", lambda: zen4)
    with pytest.raises(pytest.skip.Exception, match="avxvnni"):
        run_for_target("vnni", tmp_path, "-c", "raise SystemExit(1)")
    skip_unless_host_runs("avx2")  # haswell's features are all there: no skip


@pytest.mark.parametrize("name", sorted(TYPES))
def test_a_tile_of_tokens_gives_each_token_its_own_result(name):
    """A prefill's tiles (TILE_TOKENS tokens share each unpacked block, tokens in blocks) give
    every token exactly the result it gets alone."""
    ggml_type = TYPES[name]
    n_rows, n_cols, n_tokens = 9, 512, 2 * intdot.TILE_TOKENS + 1
    rng = np.random.default_rng(ggml_type)
    raw = read_only(random_weights(name, n_rows, n_cols, rng))
    x = rng.standard_normal((n_tokens, n_cols)).astype(np.float32)
    xq = intdot.activation_buffers(n_tokens, n_cols)
    intdot.quantize_q8_tokens(x, Q8_BLOCK_SIZE[get_quant_type(ggml_type).vec_dot_type], *xq)
    batch = np.zeros((n_tokens, n_rows), np.float32)
    get_quant_type(ggml_type).int_matvec((raw,), *xq, (batch,))
    for t in range(n_tokens):
        alone = np.zeros((1, n_rows), np.float32)
        get_quant_type(ggml_type).int_matvec((raw,), *(a[t : t + 1] for a in xq), (alone,))
        np.testing.assert_array_equal(batch[t], alone[0])


needs_tiles = pytest.mark.skipif(not gemm.AVAILABLE, reason="no vpdpbusd: no prefill tiles")


@needs_tiles
@pytest.mark.parametrize("name", sorted(TYPES))
def test_prefill_tiles_equal_the_matvec_bit_for_bit(name):
    """gemm.py's tiles (tokens in the lanes) give every token exactly the matvec's result:
    rows not a multiple of ROWS, tokens not a multiple of the lanes (a pair of tile vectors and
    a single one), two weights in one call; and batches of a few sequences' decode rows (tiles
    of one zmm, and of one ymm: gemm.TILE_SHAPES)."""
    ggml_type = TYPES[name]
    qt = get_quant_type(ggml_type)
    rng = np.random.default_rng(ggml_type + 1000)
    n_cols = 512 if qt.block_size == 256 else 480
    raws = tuple(read_only(random_weights(name, n, n_cols, rng)) for n in (9, 4))
    for n_tokens in (2 * gemm.LANES + 5, gemm.LANES - 3, gemm.NARROW_LANES - 3):
        x = rng.standard_normal((n_tokens, n_cols)).astype(np.float32)
        x[3] *= 50.0  # tokens of very different scales side by side
        xq = intdot.activation_buffers(n_tokens, n_cols)
        intdot.quantize_q8_tokens(x, Q8_BLOCK_SIZE[qt.vec_dot_type], *xq)
        tiled = tuple(np.full((n_tokens, raw.shape[0]), np.nan, np.float32) for raw in raws)
        qt.int_matmul(raws, *xq, tiled)
        for raw, out in zip(raws, tiled):
            alone = np.full((n_tokens, raw.shape[0]), np.nan, np.float32)
            qt.int_matvec((raw,), *xq, (alone,))
            np.testing.assert_array_equal(out, alone)


@needs_tiles
@pytest.mark.slow
def test_prefill_tiles_over_several_blocks_of_tokens():
    """More tiles than one block of packed activations holds (gemm.TILE_BLOCK_BYTES)."""
    ggml_type = TYPES["Q4_K"]
    qt = get_quant_type(ggml_type)
    rng = np.random.default_rng(5)
    n_cols = 4096
    per_block = max(gemm.MIN_TILES, gemm.TILE_BLOCK_BYTES // gemm.tile_bytes(n_cols, gemm.LANES))
    n_tokens = (2 * per_block + 1) * gemm.LANES + 3
    raw = read_only(random_weights("Q4_K", 6, n_cols, rng))
    x = rng.standard_normal((n_tokens, n_cols)).astype(np.float32)
    xq = intdot.activation_buffers(n_tokens, n_cols)
    intdot.quantize_q8_tokens(x, Q8_BLOCK_SIZE[qt.vec_dot_type], *xq)
    tiled = np.full((n_tokens, 6), np.nan, np.float32)
    alone = np.full((n_tokens, 6), np.nan, np.float32)
    qt.int_matmul((raw,), *xq, (tiled,))
    qt.int_matvec((raw,), *xq, (alone,))
    np.testing.assert_array_equal(tiled, alone)
