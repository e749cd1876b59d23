"""The tensor-core kernel (kernels/forward_mma.cuh) for float32 and float64 on the emulator: float32 as 3xTF32
(precision "highest", the default) and in one TF32 pass ("tf32"), float64 on DMMA (mma.m8n8k4). The front door's
properties against the float64 reference with NaN-poisoned outputs: "highest" and float64 under their dtype's
accuracy rule, "tf32" under the rule with TF32 roundings (reference.assert_accurate's precision). Head-dim
buckets, split keys, block configurations, schedules, hidden NaN/inf values, the planner's choices per dtype,
precision and GPU, and a memcheck pass."""

import os
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
import cuflash.simt
from cuflash import BlockConfig, DeviceLimits, launch, tiling
from cuflash.kernels import forward_mma
from cuflash.family import Shape
from harness import check_case, problem_and_outputs, run_under_memcheck
from reference import assert_accurate, attention_reference
from strategies import cases, randn

pytestmark = pytest.mark.skipif(not cuflash.simt.available(), reason="the SIMT emulator needs g++")

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
WIDE = (F32, F64)
H100, A100, A10, L4, V100 = (DeviceLimits.known(name) for name in ("H100", "A100", "A10", "L4", "V100"))


# ----------------------------------------------------------------------------------------------------------------
# Properties


@given(cases(dtypes=WIDE, lengths=(1, 7, 33, 64, 150, 203), head_dims=(3, 32, 59, 64),
             mixed_dtypes=False, max_batch_dims=1, magnitudes=(1.0, 1.0, 12.0)),
       st.sampled_from((None, "highest", "tf32")))
@settings(max_examples=20)
def test_matches_reference(case, precision):
    check_case(case, backend="simt", block="mma", precision=precision)


@given(cases(dtypes=(F32,), lengths=(1, 33, 97), head_dims=(70, 100, 128), mixed_dtypes=False, max_batch_dims=1,
             magnitudes=(1.0, 12.0)), st.sampled_from((None, "tf32")))
@settings(max_examples=8)
def test_float32_head_dims_to_128(case, precision):
    """float32's bucket of 128, on tensor cores in both precisions (float64 keeps CUDA cores there)."""
    check_case(case, backend="simt", block="mma", precision=precision)


@given(cases(dtypes=WIDE, lengths=(17, 64), key_lengths=(1030, 2100), head_dims=(32, 59),
             mixed_dtypes=False, max_batch_dims=1, magnitudes=(12.0, 1.0)),
       st.sampled_from(("highest", "tf32")))
@settings(max_examples=6)
def test_split_keys(case, precision):
    """Split keys write partial results in the accumulator type (float, double) from the fragments."""
    check_case(case, backend="simt", block="mma", precision=precision)


@pytest.mark.parametrize("dtype, precision, d", [(F32, "highest", 32), (F32, "highest", 128), (F32, "highest", 192),
                                                 (F32, "tf32", 96), (F32, "tf32", 256), (F64, None, 32),
                                                 (F64, None, 64), (F64, None, 160)])
def test_native_head_dims(dtype, precision, d):
    """Buckets of each type, with a window straddling tiles, a key tail and rows past n in the last tile."""
    rng = np.random.default_rng(d)
    q, k, v = randn(rng, (2, 45, d), dtype), randn(rng, (1, 77, d), dtype), randn(rng, (2, 77, d), dtype)
    out, lse = cuflash.attention(q, k, v, window=(40, 3), backend="simt", block="mma", precision=precision,
                                 return_lse=True)
    assert_accurate(out, q, k, v, lse=lse, window=(40, 3), precision=precision)


BLOCKS = (BlockConfig.mma(16, 16, 1), BlockConfig.mma(32, 32, 2), BlockConfig.mma(64, 16, 4),
          BlockConfig.mma(32, 16, 2, stages=3), BlockConfig.mma(128, 16, 4), BlockConfig.mma(128, 64, 8))


@given(cases(dtypes=WIDE, lengths=(1, 5, 33, 97), head_dims=(3, 32, 59), mixed_dtypes=False, max_batch_dims=1,
             magnitudes=(1.0, 12.0)), st.sampled_from(("highest", "tf32")), st.data())
@settings(max_examples=6)
def test_block_configurations(case, precision, data):
    """Forced tiles, among those the planner accepts for the drawn dtype, precision and head dims."""
    problem = problem_and_outputs(case.q, case.k, case.v, precision=precision, **case.options)[0]
    runs = [b for b in BLOCKS if not tiling.not_supported_reasons(problem.shape, b, cuflash.backends.simt.DEVICE)]
    check_case(case, backend="simt", block=data.draw(st.sampled_from(runs)), precision=precision)


@pytest.mark.parametrize("schedule, dtype, block", [("reverse", F32, BlockConfig.mma(32, 16, 2)),
                                                     ("20261202", F64, BlockConfig.mma(32, 16, 2, stages=3))])
@given(data=st.data())
@settings(max_examples=4)
def test_emulator_schedules(schedule, dtype, block, data):
    """Other orders of the threads between barriers: a missing __syncthreads or cp.async wait would show."""
    case = data.draw(cases(dtypes=(dtype,), lengths=(7, 64, 113), head_dims=(32, 64), mixed_dtypes=False,
                           max_batch_dims=1))
    old = os.environ.get("CUFLASH_SIMT_SEED")
    os.environ["CUFLASH_SIMT_SEED"] = schedule
    try:
        check_case(case, backend="simt", block=block)
    finally:
        if old is None:
            del os.environ["CUFLASH_SIMT_SEED"]
        else:
            os.environ["CUFLASH_SIMT_SEED"] = old


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the reference's inf - inf
@pytest.mark.parametrize("dtype, precision", [(F32, "highest"), (F32, "tf32"), (F64, None)])
def test_nan_and_inf_in_hidden_keys_never_leak(dtype, precision):
    """Hidden keys holding NaN and inf go through the CUDA-core P V that skips them; a visible inf counts (the
    3xTF32 split keeps an inf whole in its high part)."""
    rng = np.random.default_rng(11)
    n, m, d = 40, 70, 32
    q, k, v = randn(rng, (n, d), dtype, 0.3), randn(rng, (m, d), dtype, 0.3), randn(rng, (m, d), dtype)
    mask = rng.random((n, m)) < 0.7
    mask[:, :3] = False
    k[:3], v[:3] = np.nan, np.inf
    v[45, 5] = np.inf  # visible to the later rows unless masked
    v[60:, 7] = np.nan
    for block in (BlockConfig.mma(16, 16, 1), BlockConfig.mma(64, 16, 4)):
        out, lse = cuflash.attention(q, k, v, mask=mask, causal=True, backend="simt", block=block,
                                     precision=precision, return_lse=True)
        assert_accurate(out, q, k, v, lse=lse, mask=mask, causal=True, precision=precision)


def test_three_tf32_passes_are_float32_exact_where_one_is_not():
    """The default really runs 3xTF32: on logits of a few units one TF32 pass misses float32's rule by far, three
    meet it (and "tf32" meets its own, looser rule)."""
    rng = np.random.default_rng(21)
    q, k, v = randn(rng, (1, 64, 64), F32, 3.0), randn(rng, (1, 96, 64), F32, 3.0), randn(rng, (1, 96, 64), F32)
    exact = cuflash.attention(q, k, v, backend="simt", block="mma")
    one = cuflash.attention(q, k, v, backend="simt", block="mma", precision="tf32")
    assert_accurate(exact, q, k, v)
    assert_accurate(one, q, k, v, precision="tf32")
    with pytest.raises(AssertionError, match="exceed the rule"):
        assert_accurate(one, q, k, v)
    ref = attention_reference(q, k, v)[0]
    assert np.abs(exact - ref).max() * 100 < np.abs(one - ref).max()


def test_grouped_query_attention_strided_views_and_bias():
    """Broadcast K/V heads, a transposed Q (element loads instead of cp.async), a bias and a strided out."""
    rng = np.random.default_rng(13)
    for dtype in WIDE:
        q = np.swapaxes(randn(rng, (2, 2, 64, 33), dtype), -1, -2)
        k, v = randn(rng, (2, 1, 47, 64), dtype), randn(rng, (2, 1, 47, 40), dtype)[..., ::-1, :]
        bias = randn(rng, (2, 1, 47), np.float32)
        out = np.full((2, 2, 33, 2 * 40), np.nan, dtype)[..., ::2]
        cuflash.attention(q, k, v, bias=bias, window=(10, 3), out=out, backend="simt", block="mma")
        assert_accurate(out, q, k, v, bias=bias, window=(10, 3))


# ----------------------------------------------------------------------------------------------------------------
# The planner: which kernel runs each dtype and precision, and why not


# The largest head dim each runs on tensor cores (forward_mma.REGISTER_BOUNDS): past it, registers would spill.
TENSOR_CORE_HEAD_DIMS = {(F32, "highest"): 192, (F32, "tf32"): 256, (F64, "highest"): 160}


@pytest.mark.parametrize("device", [H100, A100, A10, L4])
@pytest.mark.parametrize("d", [32, 64, 100, 128, 192, 224, 256])
@pytest.mark.parametrize("precision", ["highest", "tf32"])
def test_float32_runs_on_tensor_cores_up_to_its_head_dims(device, d, precision):
    shape = Shape(F32, d, d, precision=precision)
    config = tiling.choose(shape, device)
    if d > TENSOR_CORE_HEAD_DIMS[(F32, precision)]:
        assert config.variant == "fma" and forward_mma.FORWARD.first_fit(shape, device) is None
        reasons = tiling.not_supported_reasons(shape, BlockConfig.mma(16, 16, 1), device)
        assert any("accumulator registers" in r for r in reasons), reasons
        return
    assert (forward_mma.FORWARD.first_fit(shape, device) is not None) == (config.variant == "mma")
    if config.variant == "fma":  # every tensor-core block that fits leaves fewer than 4 warps on an SM
        fits = [c for c in forward_mma.CANDIDATES if forward_mma.FORWARD.runs(shape, c, device)]
        assert all(forward_mma.FORWARD.occupancy(shape, c, device) * c.warps < forward_mma.MIN_RESIDENT_WARPS
                   for c in fits)
        assert (device, precision) not in ((H100, "highest"), (A100, "highest"), (H100, "tf32")) or d > 128
        return
    assert not tiling.not_supported_reasons(shape, config, device)
    passes = forward_mma.PASSES[precision]
    assert tiling.plan(shape, device).name.endswith(f", false, {passes}>")


@pytest.mark.parametrize("d", [32, 64, 128, 160, 192, 256])
def test_float64_runs_on_dmma_only_where_it_is_fast(d):
    for device in (H100, A100):
        shape = Shape(F64, d, d)
        config = tiling.choose(shape, device)
        if d > TENSOR_CORE_HEAD_DIMS[(F64, "highest")]:  # O_i's float64 accumulators take e registers
            assert config.variant == "fma" and forward_mma.FORWARD.first_fit(shape, device) is None
            reasons = tiling.not_supported_reasons(shape, BlockConfig.mma(64, 16), device)
            assert any("accumulator registers" in r for r in reasons), reasons
            continue
        if (device, d) == (A100, 160):  # only one warp's block fits its shared memory: fewer than 4 on an SM
            assert config.variant == "fma" and forward_mma.FORWARD.first_fit(shape, device) is None
            assert not tiling.not_supported_reasons(shape, BlockConfig.mma(16, 16, 1), device)
            assert forward_mma.FORWARD.occupancy(shape, BlockConfig.mma(16, 16, 1), device) < 4
            continue
        assert config.variant == "mma"
        assert forward_mma.FORWARD.accumulator_words(shape, config) <= forward_mma.FORWARD.register_bounds(shape)[1]
    for device in (A10, L4, V100):
        assert tiling.choose(Shape(F64, d, d), device).variant == "fma"
    reasons = tiling.not_supported_reasons(Shape(F64, d, d), BlockConfig.mma(64, 16), A10)
    assert re.search(r"float64 runs on tensor cores \(DMMA\) only.*A10 has none", "; ".join(reasons)), reasons


@pytest.mark.parametrize("dtype", [np.float16, F32, F64])
def test_precision_fma_keeps_cuda_cores(dtype):
    shape = Shape(dtype, 64, 64, precision="fma")
    assert tiling.choose(shape, H100).variant == "fma"
    reasons = tiling.not_supported_reasons(shape, BlockConfig.mma(64, 32), H100)
    assert any("precision='fma' asks for CUDA cores" in r for r in reasons), reasons
    q = np.zeros((4, 32), dtype)
    with pytest.raises(ValueError, match="precision='fma' asks for CUDA cores"):
        cuflash.attention(q, q, q, backend="simt", block="mma", precision="fma")


def test_launch_names_and_shared_memory():
    rng = np.random.default_rng(14)
    for dtype, precision, head in ((F32, None, "float, "), (F32, "tf32", "float, "), (F64, None, "double, ")):
        q = randn(rng, (20, 64), dtype)
        problem, out, lse = problem_and_outputs(q, q, q, precision=precision)
        plan = tiling.plan(problem.shape, cuflash.backends.simt.DEVICE)
        (only,) = launch.launches(problem, out, lse, plan)
        assert only.name.startswith("cuflash::fwd_mma<" + head)
        assert only.shared_mem == forward_mma.FORWARD.shared_memory_bytes(problem.shape, plan.config)


# ----------------------------------------------------------------------------------------------------------------
# Memcheck


@pytest.mark.memcheck
def test_memcheck_under_address_sanitizer():
    """Out-of-bounds global, shared or cp.async accesses of the float32 and float64 tensor-core kernels abort
    under ASan."""
    result = run_under_memcheck("mma_wide")
    assert result.returncode == 0 and "memcheck ok" in result.stdout, result.stderr[-4000:]
