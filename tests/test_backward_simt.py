"""The backward kernels (kernels/backward.cuh) on the emulator (backend="simt"): gradients against the float64
reference over the forward's input space drawn by hypothesis; every gradient element written (NaN-poisoned
gradient arrays); the same bits under other emulator schedules; the planner's own configurations; the blocked
path past the kernels' head dims; errors for a block that cannot run. Problems stay small: the emulator runs on
the CPU, and a few instantiations serve most tests (each costs a compile)."""

import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
import cuflash.simt
from cuflash import BlockConfig, launch, tiling
from cuflash.backends import numpy as numpy_backend
from cuflash.backends import simt
from cuflash.family import Shape
from harness import problem_and_outputs, run_under_memcheck, run_under_race
from reference import assert_grads_accurate
from strategies import cases, randn

pytestmark = pytest.mark.skipif(not cuflash.simt.available(), reason="the SIMT emulator needs g++")

OPTIONS = ("scale", "causal", "window", "mask", "bias")
SMALL = BlockConfig(16, 16, 2)  # many tiles on small problems; one instantiation per dtype for d, e <= 16
SMALL_MMA = BlockConfig.mma(16, 16, 1, stages=1)  # the tensor-core kernels' smallest tiles (every dtype)
TWO_WARPS = BlockConfig.mma(32, 32, 2, stages=2)  # two warps sharing each swept tile (float32: its TF32 split)


def options_of(case):
    return {key: case.options[key] for key in OPTIONS if key in case.options}


def backward(q, k, v, dout=None, seed=0, block=None, bias_grad=False, precision=None, **options):
    """(dout, gradients of the simt backward); the forward that makes out and lse is the numpy backend's."""
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend="numpy", **options)
    if dout is None:
        dout = randn(seed, out.shape, np.float64).astype(out.dtype)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="simt", block=block, bias_grad=bias_grad,
                                       precision=precision, **options)
    return dout, grads


@given(cases(lengths=(1, 5, 33, 70), head_dims=(1, 8, 13), max_batch_dims=1),
       st.sampled_from([SMALL, BlockConfig(16, 16, 2, stages=2)]))
@settings(max_examples=40)
def test_matches_reference(case, block):
    """Tails of both tiles, windows, masks, biases (with -inf), broadcast and strided views, hidden NaN and inf;
    the swept tiles in one stage and in two (the next one's copies in flight)."""
    options = options_of(case)
    dout, grads = backward(case.q, case.k, case.v, block=block, bias_grad=options.get("bias") is not None,
                           **options)
    assert_grads_accurate(grads, dout, case.q, case.k, case.v, **options)


@given(cases(dtypes=(np.float16, ml_dtypes.bfloat16), mixed_dtypes=False, lengths=(1, 5, 33, 70),
             head_dims=(1, 8, 13, 32), max_batch_dims=1), st.sampled_from([(16, 16), SMALL_MMA]))
@settings(max_examples=30)
def test_tensor_core_kernels_match_reference(case, block):
    """The same properties on the tensor-core backward (one warp, 16 x 16 tiles: many tiles each way); (16, 16)
    as a pair takes both kernels with two stages (the next swept tile's copies in flight), SMALL_MMA one."""
    options = options_of(case)
    dout, grads = backward(case.q, case.k, case.v, block=block, bias_grad=options.get("bias") is not None,
                           **options)
    assert_grads_accurate(grads, dout, case.q, case.k, case.v, **options)


@given(cases(dtypes=(np.float16, ml_dtypes.bfloat16), mixed_dtypes=False, lengths=(16, 33, 70), head_dims=(8, 16, 32),
             masks=False, biases=False, views=("contiguous", "stride0"), max_batch_dims=1),
       st.sampled_from([(16, 16), SMALL_MMA]))
@settings(max_examples=20)
def test_tensor_core_steady_loops_match_reference(case, block):
    """The tensor-core kernels' steady loops: whole tiles of 16-byte rows without mask or bias, the plain ones
    swept first (windows and causal masks leave others before and after them), short last tiles after them."""
    options = options_of(case)
    dout, grads = backward(case.q, case.k, case.v, block=block, **options)
    assert_grads_accurate(grads, dout, case.q, case.k, case.v, **options)


@given(cases(dtypes=(np.float32, np.float64), mixed_dtypes=False, lengths=(1, 5, 33, 70), head_dims=(1, 8, 13, 32),
             max_batch_dims=1), st.sampled_from([(16, 16), SMALL_MMA]), st.sampled_from([None, "tf32"]))
@settings(max_examples=30)
def test_float32_and_float64_tensor_core_kernels_match_reference(case, block, precision):
    """The same properties on the float32 (3xTF32, and one TF32 pass under the rule with TF32 roundings) and
    float64 (DMMA) tensor-core backward: one warp, 16 x 16 tiles, one stage and two."""
    options = options_of(case)
    dout, grads = backward(case.q, case.k, case.v, block=block, bias_grad=options.get("bias") is not None,
                           precision=precision, **options)
    assert_grads_accurate(grads, dout, case.q, case.k, case.v, precision=precision, **options)


@given(cases(dtypes=(np.float32, np.float64), mixed_dtypes=False, lengths=(33, 70), head_dims=(16, 32), masks=False,
             biases=False, views=("contiguous", "stride0"), max_batch_dims=1), st.sampled_from([None, "tf32"]))
@settings(max_examples=12)
def test_float32_and_float64_steady_loops_match_reference(case, precision):
    """Their steady loops (whole tiles of 16-byte rows through the chunk loaders, each split to TF32 once for
    both warps of a block), the plain tiles first, short last ones after them."""
    options = options_of(case)
    dout, grads = backward(case.q, case.k, case.v, block=TWO_WARPS, precision=precision, **options)
    assert_grads_accurate(grads, dout, case.q, case.k, case.v, precision=precision, **options)


@pytest.mark.parametrize("window", [(40, 17), (17, 40), (None, -8), (9, None)])
def test_tensor_core_plain_tiles_inside_a_window(window):
    """Windows wide enough for whole plain tiles between their edges, on both axes: dQ's plain key tiles and dK
    dV's plain query tiles (the window transposed) after the edge tiles before them, and the edges after."""
    rng = np.random.default_rng(9)
    q, k, v = (randn(rng, (2, length, 32), np.float16) for length in (70, 83, 83))
    dout, grads = backward(q, k, v, block=(16, 16), window=window)
    assert_grads_accurate(grads, dout, q, k, v, window=window)


def test_row_terms_shift_a_row_that_saw_nothing_by_zero():
    """The backward's row terms: lse log2 e and D_i = rowsum(dO * O) per row, and a shift of 0 for a row whose lse
    is -inf (it saw no key), so that its P = exp2(s - shift) is never exp2(-inf + inf)."""
    q = np.zeros((3, 4), np.float32)
    problem, out, _ = problem_and_outputs(q, q, q)
    lse = np.array([0.5, -np.inf, 2.0], np.float32)
    dout = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = np.ones((3, 4), np.float32)
    terms = launch.row_terms(problem, dout, out, lse)
    assert terms.shape == (3, 2) and terms.dtype == np.float32
    np.testing.assert_array_equal(terms[:, 0], [np.float32(0.5) * np.float32(np.log2(np.e)), 0.0,
                                                np.float32(2.0) * np.float32(np.log2(np.e))])
    np.testing.assert_array_equal(terms[:, 1], dout.sum(axis=1))


@pytest.mark.parametrize("dtype, d, e, options, block, variant", [
    (np.float32, 64, 64, {"causal": True}, BlockConfig(64, 64, 8, stages=2), "fma"),
    (np.float64, 64, 64, {"causal": True}, None, "mma"),
    (np.float64, 128, 128, {"window": (40, 7)}, None, "mma"),  # dK dV: a pair of warps per 16 keys, half the columns
    (np.float16, 128, 40, {"window": (50, 3)}, None, "mma"),
    (ml_dtypes.bfloat16, 32, 24, {"causal": True}, BlockConfig.mma(32, 32, 1, stages=1), "mma"),
])
def test_the_planners_configurations(dtype, d, e, options, block, variant):
    """The heuristic's tiles (CUDA cores: 8 warps; tensor cores: 4 warps of one m16 tile; float64 on DMMA, at
    d = e = 128 its dK and dV split between pairs of warps) and two m16 tiles per warp: several tiles each way, a
    ragged last one."""
    rng = np.random.default_rng(1)
    q, k, v = randn(rng, (2, 97, d), dtype), randn(rng, (2, 150, d), dtype), randn(rng, (2, 150, e), dtype)
    problem = problem_and_outputs(q, k, v, **options)[0]
    plans = tiling.backward_plans(problem.shape, simt.DEVICE, block)
    assert [p.family.kind for p in plans] == ["dkdv", "dq"] and {p.config.variant for p in plans} == {variant}
    dout, grads = backward(q, k, v, block=block, **options)
    assert_grads_accurate(grads, dout, q, k, v, **options)


def test_every_gradient_element_is_written():
    """The backend fills dq, dk and dv whole (NaN-poisoned here): rows no key sees, keys no query sees, and the
    ragged last tiles; each equals the blocked backward's to rounding."""
    rng = np.random.default_rng(2)
    q, k, v = randn(rng, (2, 37, 13)), randn(rng, (1, 50, 13)), randn(rng, (2, 50, 7))
    mask = rng.random((37, 50)) < 0.6
    mask[4] = False  # a row that sees nothing
    options = dict(mask=mask, window=(20, 5))  # keys 0..(m - n - 21) are seen by no query
    problem = problem_and_outputs(q, k, v, **options)[0]
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend="numpy", **options)
    dout = randn(rng, out.shape)
    shapes = [(2, 37, 13), (2, 50, 13), (2, 50, 7)]
    poisoned = [np.full(s, np.nan, np.float32) for s in shapes] + [None]
    zeroed = [np.zeros(s, np.float32) for s in shapes] + [None]
    simt.run_backward(problem, dout, out, lse, poisoned, block=SMALL)
    numpy_backend.run_backward(problem, dout, out, lse, zeroed)
    for got, want in zip(poisoned[:3], zeroed[:3]):
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert (poisoned[0][:, 4] == 0).all()


@pytest.mark.parametrize("schedule, block", [("reverse", SMALL), ("20261201", SMALL), ("reverse", TWO_WARPS)])
def test_the_same_bits_in_every_schedule(schedule, block):
    """Each gradient element has one writer and a fixed order of sums: other orders of the threads between
    barriers give the same bits (a missing barrier would not); on tensor cores too (float32: the swept tiles
    split to TF32 by both warps, between two barriers)."""
    rng = np.random.default_rng(3)
    q, k, v = randn(rng, (2, 40, 16)), randn(rng, (2, 45, 16)), randn(rng, (2, 45, 9))
    bias = randn(rng, (40, 45))
    dout, first = backward(q, k, v, block=block, bias=bias, bias_grad=True, causal=True)
    old = os.environ.get("CUFLASH_SIMT_SEED")
    os.environ["CUFLASH_SIMT_SEED"] = schedule
    try:
        second = backward(q, k, v, dout=dout, block=block, bias=bias, bias_grad=True, causal=True)[1]
    finally:
        if old is None:
            del os.environ["CUFLASH_SIMT_SEED"]
        else:
            os.environ["CUFLASH_SIMT_SEED"] = old
    for a, b in zip(first, second):
        assert a.tobytes() == b.tobytes()
    assert_grads_accurate(first, dout, q, k, v, bias=bias, causal=True)


@pytest.mark.parametrize("dtype, block", [(np.float32, SMALL), (np.float16, SMALL_MMA), (np.float32, SMALL_MMA),
                                          (np.float64, SMALL_MMA)])
def test_hidden_non_finite_keys_never_leak(dtype, block):
    """Hidden keys and values holding inf and NaN, and a query row that sees nothing holding inf: on tensor
    cores such tiles take the products on CUDA cores with hidden pairs skipped (float32: each value its high and
    low TF32 parts added back)."""
    rng = np.random.default_rng(5)
    q, k, v = randn(rng, (20, 8), dtype), randn(rng, (30, 8), dtype), randn(rng, (30, 5), dtype)
    mask = np.ones((20, 30), bool)
    mask[:, 7] = False
    bias = np.zeros((20, 30), np.float32)
    bias[:, 21] = -np.inf
    mask[2] = False
    k[7], v[7], k[21], v[21] = np.nan, np.inf, np.inf, np.nan
    q[2] = np.inf  # a query row that sees nothing: its inf reaches no dk
    dout, (dq, dk, dv) = backward(q, k, v, block=block, mask=mask, bias=bias)
    assert (dk[[7, 21]] == 0).all() and (dv[[7, 21]] == 0).all() and (dq[2] == 0).all()
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert_grads_accurate((dq, dk, dv), dout, q, k, v, mask=mask, bias=bias)


def test_grouped_query_heads_and_a_shared_bias_are_summed():
    rng = np.random.default_rng(4)
    q = randn(rng, (2, 4, 9, 8), np.float64)
    k, v = randn(rng, (2, 1, 11, 8), np.float64), randn(rng, (2, 1, 11, 5), np.float64)
    bias = randn(rng, (9, 11), np.float64)
    dout, grads = backward(q, k, v, block=SMALL, bias=bias, bias_grad=True, causal=True)
    assert [g.shape for g in grads] == [x.shape for x in (q, k, v, bias)]
    assert_grads_accurate(grads, dout, q, k, v, bias=bias, causal=True)


def test_launches_cover_both_kernels_once_each():
    rng = np.random.default_rng(6)
    q, k, v = randn(rng, (3, 33, 8)), randn(rng, (3, 50, 8)), randn(rng, (3, 50, 4))
    problem, out, lse = problem_and_outputs(q, k, v)
    dkdv, dq = tiling.backward_plans(problem.shape, simt.DEVICE, SMALL)
    grads = [np.zeros((3, 33, 8), np.float32), np.zeros((3, 50, 8), np.float32), np.zeros((3, 50, 4), np.float32),
             None]
    operands = launch.backward_operands(problem, out, launch.row_terms(problem, out, out, lse), grads)
    (a,) = launch.backward_launches(problem, dkdv, operands)
    (b,) = launch.backward_launches(problem, dq, operands)
    assert (a.name, a.grid) == ("cuflash::bwd_dkdv<float, 16, 16, 16, 16, 2>", (4, 3, 1))  # 50 keys / 16
    assert (b.name, b.grid) == ("cuflash::bwd_dq<float, 16, 16, 16, 16, 2>", (3, 3, 1))  # 33 queries / 16
    assert a.shared_mem == dkdv.family.shared_memory_bytes(problem.shape, SMALL)
    assert not a.params["flags"] & launch.WANT_DBIAS


def test_past_the_kernels_head_dims_the_blocked_path_serves():
    assert tiling.backward_plans(Shape(np.float32, 300, 16, 10, 10), simt.DEVICE) is None
    rng = np.random.default_rng(7)
    q, k, v = randn(rng, (9, 300)), randn(rng, (12, 300)), randn(rng, (12, 3))
    dout, grads = backward(q, k, v, causal=True)
    assert_grads_accurate(grads, dout, q, k, v, causal=True)
    with pytest.raises(ValueError, match="the backward kernels hold a block's gradients whole and take d, e <= 256"):
        backward(q, k, v, block=SMALL)


def test_a_block_that_cannot_run_is_refused_with_reasons():
    q = np.zeros((4, 8), np.float32)
    out, lse = cuflash.attention(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match="Br=8 is not supported by the backward's dkdv kernel"):
        cuflash.attention_backward(out, q, q, q, out, lse, backend="simt", block=BlockConfig(8, 16, 2))
    with pytest.raises(ValueError, match="head_tile=32 is not supported by the backward kernels"):
        cuflash.attention_backward(out, q, q, q, out, lse, backend="simt", block=BlockConfig(16, 16, 2, head_tile=32))
    with pytest.raises(ValueError, match="precision='fma' asks for CUDA cores: the tensor-core backward .variant "
                                         "'mma'. does not run"):
        cuflash.attention_backward(out, q, q, q, out, lse, backend="simt", block=SMALL_MMA, precision="fma")
    with pytest.raises(ValueError, match="the tensor-core backward .variant 'mma'. runs float16, bfloat16, float32 "
                                         "and float64, not int8"):
        tiling.backward_plans(Shape(np.int8, 8, 8), simt.DEVICE, SMALL_MMA)


@pytest.mark.memcheck
def test_backward_under_address_sanitizer():
    """Both backward kernels in the emulator's memcheck mode: any out-of-bounds global or shared access aborts."""
    result = run_under_memcheck("backward")
    assert result.returncode == 0 and "memcheck ok" in result.stdout, result.stderr[-4000:]


@pytest.mark.memcheck
def test_float32_and_float64_tensor_core_backward_under_address_sanitizer():
    result = run_under_memcheck("backward_wide")
    assert result.returncode == 0 and "memcheck ok" in result.stdout, result.stderr[-4000:]


@pytest.mark.memcheck
@pytest.mark.skipif(cuflash.simt.libtsan_path() is None, reason="the C++ compiler has no ThreadSanitizer runtime")
def test_float32_and_float64_tensor_core_backward_in_race_mode():
    """3xTF32's part of it under ThreadSanitizer: no race between the warps splitting a swept tile to TF32, the
    copies of the next one and the products reading it."""
    result = run_under_race("backward_race")
    assert result.returncode == 0 and "memcheck ok" in result.stdout, result.stderr[-4000:]
