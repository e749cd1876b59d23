"""The PTX wrappers of cuflash/kernels/ptx.cuh and the tests' own (tests/simt_kernels/ptx_extra.cuh) in the
emulator: per-lane fragment layouts of mma and ldmatrix against the PTX ISA's tables, the float64 mma and the
tf32 rounding bit for bit against exact references, a whole mma fed from shared memory by cp.async and ldmatrix
against NumPy matmul, cp.async landing only at its wait, misuse reported, and the same source compiling under
NVRTC."""

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import simt_util
from hypothesis import given, settings, strategies as st
from ptx_cases import (ALL_NAMES, CVT_NAME, F64_NAME, LDM_NAMES, MMA_NAMES, cvt_case, cvt_rna_tf32, f64_matrices,
                       fma_chain, ldmatrix_case, mma_case, mma_f64_case, tile_case)

from cuflash import simt

pytestmark = pytest.mark.skipif(not simt.available(), reason=str(simt.unavailable_reason()))


@pytest.fixture(scope="module")
def mod():
    return simt_util.module("ptx_tests.cu", ALL_NAMES, with_ptx=True)


def run_mma(mod, kind, inputs):
    a_regs, b_regs, c = inputs
    d = np.full((32, 4), np.nan, np.float32)
    mod.get_function(MMA_NAMES[kind])((1,), (32,), (a_regs, b_regs, c, d))
    return d


@pytest.mark.parametrize("kind", [0, 1, 2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_mma_fragment_layouts_exact(mod, kind, seed):
    inputs, want = mma_case(kind, np.random.default_rng(seed))
    np.testing.assert_array_equal(run_mma(mod, kind, inputs), want)


@pytest.mark.parametrize("kind", [0, 1, 2, 3])
def test_mma_random_values(mod, kind):
    inputs, want = mma_case(kind, np.random.default_rng(10 + kind), integers=False)
    np.testing.assert_allclose(run_mma(mod, kind, inputs), want, rtol=1e-5, atol=1e-5)


def test_mma_tf32_ignores_low_mantissa_bits(mod):
    inputs, want = mma_case(3, np.random.default_rng(5))
    a_regs, b_regs, c = inputs
    noisy = (a_regs | 0x1FFF * (a_regs != 0)).astype(np.uint32), (b_regs | 0x0FFF * (b_regs != 0)).astype(np.uint32)
    np.testing.assert_array_equal(run_mma(mod, 3, (noisy[0], noisy[1], c)), want)


def run_mma_f64(mod, inputs, in_place):
    a, b, c = inputs
    d = np.full((32, 2), np.nan)
    mod.get_function(F64_NAME)((1,), (32,), (a, b, c, d, np.int32(in_place)))
    return d


def assert_same_bits(got, want):
    """Bit for bit (so -0 is not 0 and the last place counts), naming the first differing lanes."""
    dtype = np.uint64 if got.dtype == np.float64 else np.uint32
    g, w = got.view(dtype), want.view(dtype)
    bad = np.argwhere(g != w)
    assert bad.size == 0, [(i.tolist(), hex(g[tuple(i)]), hex(w[tuple(i)])) for i in bad[:8]]


@pytest.mark.parametrize("in_place", [0, 1])
@pytest.mark.parametrize("seed", range(3))
def test_mma_f64_fragment_layout_exact(mod, seed, in_place):
    inputs, want = mma_f64_case(np.random.default_rng(seed))  # integers: every step exact
    assert_same_bits(run_mma_f64(mod, inputs, in_place), want)


@pytest.mark.parametrize("in_place", [0, 1])
@pytest.mark.parametrize("scale", [0, -520])  # -520: products and C among float64's subnormals
def test_mma_f64_random_values_bit_for_bit(mod, in_place, scale):
    inputs, want = mma_f64_case(np.random.default_rng(30 - scale), integers=False, scale=scale)
    assert_same_bits(run_mma_f64(mod, inputs, in_place), want)
    if scale:  # among subnormals each fma rounds its product alone to a multiple of 2^-1074: any order agrees
        return
    # The case tells the fma chain in k order from the same chain reversed and from one rounding of the exact sum.
    A, B, C = f64_matrices(*inputs)
    assert (fma_chain(A, B, C, order=(3, 2, 1, 0)) != fma_chain(A, B, C)).any()
    once = np.array([[float(Fraction(C[r, j]) + sum(Fraction(A[r, k]) * Fraction(B[k, j]) for k in range(4)))
                      for j in range(8)] for r in range(8)])
    assert (once != fma_chain(A, B, C)).any()


def run_cvt(mod, bits):
    out = np.full(bits.size, 0xDEADBEEF, np.uint32)
    mod.get_function(CVT_NAME)((2,), (128,), (bits, out, np.int32(bits.size)))
    return out


# cvt.rna.tf32.f32 by hand, from the ISA: (input bits, result bits).
CVT_BY_HAND = [
    (0x3F801000, 0x3F802000), (0xBF801000, 0xBF802000),  # 1 + 2^-11, a tie at an even tf32: away from zero
    (0x3F803000, 0x3F804000), (0x3F800FFF, 0x3F800000),  # a tie at an odd one; just below a tie
    (0x3F801001, 0x3F802000), (0x3FFFF000, 0x40000000),  # just above; a carry into the exponent: 2
    (0x7F7FEFFF, 0x7F7FE000), (0x7F7FF000, 0x7F800000),  # the largest tf32; past it, inf
    (0xFF7FF000, 0xFF800000), (0x00001000, 0x00002000),  # -inf; a subnormal tie
    (0x00000FFF, 0x00000000), (0x80000FFF, 0x80000000),  # subnormals to zero, keeping the sign
    (0x007FF000, 0x00800000), (0x00000000, 0x00000000),  # the largest subnormals round up to 2^-126
    (0x7F800000, 0x7F800000), (0xFF800000, 0xFF800000),  # infs stay
    (0x7F800001, 0x7FFFFFFF), (0xFFC00000, 0x7FFFFFFF),  # NaNs: the canonical NaN
    (0x7FBFF000, 0x7FFFFFFF), (0x7F801000, 0x7FFFFFFF),  # a signalling NaN; one rounding would turn into inf
]


def test_cvt_rna_tf32_by_hand(mod):
    bits, want = (np.array(column, np.uint32) for column in zip(*CVT_BY_HAND))
    assert_same_bits(cvt_rna_tf32(bits), want)  # the NumPy reference the random cases use
    assert_same_bits(run_cvt(mod, bits), want)


@pytest.mark.parametrize("seed", range(3))
def test_cvt_rna_tf32_bit_for_bit(mod, seed):
    bits, want = cvt_case(np.random.default_rng(seed))
    assert_same_bits(run_cvt(mod, bits), want)


@pytest.mark.parametrize("name", LDM_NAMES)
@pytest.mark.parametrize("seed", range(3))
def test_ldmatrix_layouts(mod, name, seed):
    n, trans = int(name.split("<")[1][0]), "true" in name
    (tile, perm), want = ldmatrix_case(n, trans, np.random.default_rng(seed))
    regs = np.zeros((32, n), np.uint32)
    mod.get_function(name)((1,), (32,), (tile, perm, regs))
    np.testing.assert_array_equal(regs, want)


@settings(max_examples=12)
@given(seed=st.integers(0, 2**32 - 1), bf16=st.booleans(), trans_b=st.booleans(),
       schedule=st.sampled_from(["forward", "reverse", 1, 2]))
def test_mma_from_shared_memory_matches_numpy(mod, seed, bf16, trans_b, schedule):
    dtype = ml_dtypes.bfloat16 if bf16 else np.float16
    (a, b, c), want = tile_case(dtype, trans_b, np.random.default_rng(seed))
    d = np.full((16, 8), np.nan, np.float32)
    name = f"mma_tile<{'__nv_bfloat16' if bf16 else '__half'}, {'true' if trans_b else 'false'}>"
    mod.get_function(name)((1,), (32,), (a, b, c, d), seed=schedule)
    np.testing.assert_allclose(d, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("src_bytes", [16, 12, 4, 0])
def test_cp_async_lands_at_the_wait_only(mod, src_bytes):
    rng = np.random.default_rng(src_bytes)
    src, src2 = rng.standard_normal((64, 4)).astype(np.float32), rng.standard_normal((64, 4)).astype(np.float32)
    before, mid, after = (np.zeros((n, 4), np.float32) for n in (64, 128, 64))
    mod.get_function("cp_async_order")((1,), (64,), (src, src2, before, mid, after, np.int32(src_bytes)))
    assert (before == -1).all()                      # issued, not waited: the old contents
    assert (mid[:64] == -2).all()                    # wait_group 1 leaves the newest group in flight
    np.testing.assert_array_equal(mid[64:], src2)    # wait_all lands it
    want = src.copy()
    want[:, src_bytes // 4:] = 0                     # zero-fill past src-size
    np.testing.assert_array_equal(after, want)


@pytest.mark.parametrize("which,block,words", [
    (0, 32, "not in this block's shared memory"), (1, 32, "not 16-byte aligned"),
    (2, 32, "aligned to the copy size"), (3, 32, "not 16 bytes of this block's shared memory"),
    (4, 32, "ldmatrix.x2"), (5, 16, "do not exist"),
])
def test_ptx_misuse_is_reported_with_its_file_and_line(which, block, words):
    mod = simt_util.module("ptx_misuse.cu", (), with_ptx=True)
    g, out = np.zeros(512, np.uint16), np.zeros(32, np.float32)
    with pytest.raises(simt.LaunchError, match=words) as e:
        mod.get_function("ptx_misuse")((1,), (block,), (g, out, np.int32(which)))
    assert simt_util.site("ptx_misuse.cu", f"MISUSE_{which}", with_ptx=True).search(str(e.value)), str(e.value)


def _nvrtc_include():
    import os
    for d in [os.path.join(os.environ.get("CUDA_PATH", "/usr/local/cuda"), "include")]:
        if os.path.exists(os.path.join(d, "cuda_fp16.h")):
            return d
    try:
        import nvidia.cuda_runtime
        d = os.path.join(list(nvidia.cuda_runtime.__path__)[0], "include")
        return d if os.path.exists(os.path.join(d, "cuda_fp16.h")) else None
    except ImportError:
        return None


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_same_source_compiles_under_nvrtc(arch):
    try:
        from cupy.cuda import nvrtc
    except ImportError:
        pytest.skip("CuPy is not installed")
    inc = _nvrtc_include()
    if inc is None:
        pytest.skip("no cuda_fp16.h for NVRTC (install nvidia-cuda-runtime-cu12)")
    try:
        prog = nvrtc.createProgram(simt_util.source("ptx_tests.cu", with_ptx=True), "ptx_tests.cu", [], [])
    except Exception as e:  # NVRTC's library missing
        pytest.skip(f"NVRTC unavailable: {e}")
    for name in ALL_NAMES:
        nvrtc.addNameExpression(prog, name)
    try:
        nvrtc.compileProgram(prog, [f"-arch={arch}", "--std=c++17", f"-I{inc}"])
    except Exception:
        pytest.fail(nvrtc.getProgramLog(prog))
    assert len(nvrtc.getCUBIN(prog)) > 0
