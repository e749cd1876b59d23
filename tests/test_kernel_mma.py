"""The tensor-core kernel (kernels/forward_mma.cuh) on the emulator: the front door's properties against the float64
reference with NaN-poisoned outputs (head dims 32..256 and odd ones, odd lengths, causal with n < m and n > m,
masks, biases, broadcasting, strided views), several block configurations and schedules, hidden NaN/inf values,
the dispatcher's choice and its reasons, and a memcheck pass. Problems stay small: every mma and ldmatrix is a
warp rendezvous on the CPU."""

import os
import re

import ml_dtypes
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
from reference import assert_accurate
from strategies import cases, randn

pytestmark = pytest.mark.skipif(not cuflash.simt.available(), reason="the SIMT emulator needs g++")

F16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
HALVES = (F16, BF16)
H100, A100, A10, V100 = (DeviceLimits.known(name) for name in ("H100", "A100", "A10", "V100"))


# ----------------------------------------------------------------------------------------------------------------
# Properties


@given(cases(dtypes=HALVES, lengths=(1, 7, 33, 64, 150, 203, 300), head_dims=(32, 59, 64, 100, 128, 200, 256),
             mixed_dtypes=False, max_batch_dims=1, magnitudes=(1.0, 1.0, 12.0)))
@settings(max_examples=25)
def test_matches_reference(case):
    check_case(case, backend="simt", block="mma")


@given(cases(dtypes=HALVES, lengths=(17, 64, 150), key_lengths=(1030, 2100), head_dims=(32, 59, 64),
             mixed_dtypes=False, max_batch_dims=1, magnitudes=(12.0, 1.0)))
@settings(max_examples=10)
def test_split_keys(case):
    """Too few query tiles to fill the GPU: the tensor-core kernel splits the key axis as well, writes float
    partial results from its fragments, and they are merged; masks, windows and empty splits included."""
    check_case(case, backend="simt", block="mma")


def test_split_keys_launch():
    rng = np.random.default_rng(11)
    q, k, v = randn(rng, (1, 100, 64), F16), randn(rng, (1, 2000, 64), F16), randn(rng, (1, 2000, 40), F16)
    problem, out, lse = problem_and_outputs(q, k, v, causal=True)
    plan = tiling.plan(problem.shape, H100, "mma")
    assert tiling.key_splits(problem.shape, plan.config, H100) == 3  # one query tile; 2000 // 512 splits at most
    count = plan.splits
    parts_out, parts_lse = np.empty((count, 1, 100, 40), np.float32), np.empty((count, 1, 100), np.float32)
    (only,) = launch.launches(problem, parts_out[0], parts_lse[0], plan, (parts_out[0].size, parts_lse[0].size))
    assert only.name.endswith(", 2, true>") and only.grid[0] == 3
    out, lse = cuflash.attention(q, k, v, causal=True, backend="simt", block="mma", return_lse=True)
    assert_accurate(out, q, k, v, lse=lse, causal=True)


@pytest.mark.parametrize("dtype", HALVES)
def test_tiles_before_a_windows_first_plain_one_are_swept_last(dtype):
    """The steady tiles run first: a window's left edge leaves tiles before the first plain one (block rows
    [256, 320) see keys from 106 on: tile [106, 170) is partial, [170, 234) plain), and those come after the
    others, each exactly once."""
    rng = np.random.default_rng(320)
    q, k, v = (randn(rng, (1, 320, 32), dtype) for _ in range(3))
    block = BlockConfig.mma(128, 64, 4)
    out, lse = cuflash.attention(q, k, v, window=(150, None), backend="simt", block=block, return_lse=True)
    assert_accurate(out, q, k, v, lse=lse, window=(150, None))


@pytest.mark.parametrize("dtype", [F16, np.dtype(np.float32), np.dtype(np.float64)])
def test_steady_loop_with_three_stages(dtype):
    """Enough full tiles for the steady loop with three stages (it prefetches two tiles on): 100 keys make six
    full 16-key tiles, four of them steady, then the partial ones; with and without a causal mask."""
    rng = np.random.default_rng(3)
    q, k, v = randn(rng, (1, 70, 32), dtype), randn(rng, (1, 100, 32), dtype), randn(rng, (1, 100, 32), dtype)
    for causal in (False, True):
        out, lse = cuflash.attention(q, k, v, causal=causal, backend="simt", block=BlockConfig.mma(64, 16, 4, 3),
                                     return_lse=True)
        assert_accurate(out, q, k, v, lse=lse, causal=causal)


@pytest.mark.parametrize("dtype", [F16, np.dtype(np.float32)])
def test_hot_loop_leaves_to_rescale_when_a_later_tile_holds_the_max(dtype):
    """The steady tiles' hot loop rescales O_i and l_i only when a row's max grows: scores that grow with every
    key tile (every tile moves the max), and small scores with one large one in the eighth tile of twelve."""
    rng = np.random.default_rng(21)
    q = np.abs(randn(rng, (1, 16, 32), dtype))
    growing = (np.linspace(0.0, 1.0, 200)[:, None] * np.abs(randn(rng, (200, 32), np.float64))).astype(dtype)
    spike = randn(rng, (200, 32), dtype, 0.1)
    spike[120] = 1
    v = randn(rng, (1, 200, 32), dtype)
    for k in (growing[None], spike[None]):
        out, lse = cuflash.attention(q, k, v, backend="simt", block=BlockConfig.mma(16, 16, 1), return_lse=True)
        assert_accurate(out, q, k, v, lse=lse)


@pytest.mark.parametrize("d", [32, 64, 96, 128, 160, 192, 224, 256])
def test_native_head_dims(d):
    """Each bucket once, with a window straddling tiles, a key tail and rows past n in the last tile."""
    rng = np.random.default_rng(d)
    dtype = HALVES[d // 32 % 2]
    q, k, v = randn(rng, (2, 45, d), dtype), randn(rng, (1, 77, d), dtype), randn(rng, (2, 77, d), dtype)
    out, lse = cuflash.attention(q, k, v, window=(40, 3), backend="simt", block="mma", return_lse=True)
    assert_accurate(out, q, k, v, lse=lse, window=(40, 3))


BLOCKS = (BlockConfig.mma(16, 16, 1), BlockConfig.mma(32, 32, 2), BlockConfig.mma(64, 32, 2),
          BlockConfig.mma(64, 64, 4, stages=3), BlockConfig.mma(128, 64, 4))


@given(cases(dtypes=HALVES, lengths=(1, 5, 33, 97), head_dims=(3, 32, 59), mixed_dtypes=False, max_batch_dims=1,
             magnitudes=(1.0, 12.0)))
@settings(max_examples=8)
def test_block_configurations(case):
    """One or two m16 tiles per warp, 1 to 4 warps, 2 and 3 stages: many key tiles, tails both ways."""
    for block in BLOCKS:
        check_case(case, backend="simt", block=block)


@pytest.mark.parametrize("n, m", [(37, 100), (100, 37), (64, 64), (1, 150), (150, 1)])
@pytest.mark.parametrize("dtype", HALVES)
def test_causal_both_ways(n, m, dtype):
    """Bottom-right causal: n < m skips no tile at the start, n > m leaves the first rows with nothing (0, -inf)."""
    rng = np.random.default_rng(n * 1000 + m)
    q, k, v = randn(rng, (n, 64), dtype), randn(rng, (m, 64), dtype), randn(rng, (m, 40), dtype)
    out, lse = cuflash.attention(q, k, v, causal=True, backend="simt", block=BlockConfig.mma(32, 32, 2),
                                 return_lse=True)
    assert_accurate(out, q, k, v, lse=lse, causal=True)


@pytest.mark.parametrize("schedule, dtype, block", [("reverse", F16, BlockConfig.mma(32, 16, 1)),
                                                     ("20261130", BF16, BlockConfig.mma(64, 32, 2, stages=3))])
@given(data=st.data())
@settings(max_examples=8)
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
@pytest.mark.parametrize("dtype", HALVES)
def test_nan_and_inf_in_hidden_keys_never_leak(dtype):
    """Hidden from every row (masked, past the causal diagonal) and hidden from some rows only: the tile's
    vote sends P V through the CUDA-core path that skips hidden (row, key) pairs; a visible inf still counts."""
    rng = np.random.default_rng(11)
    n, m, d = 40, 70, 32
    q, k, v = randn(rng, (n, d), dtype, 0.3), randn(rng, (m, d), dtype, 0.3), randn(rng, (m, d), dtype)
    mask = rng.random((n, m)) < 0.7
    mask[:, :3] = False
    k[:3], v[:3] = np.nan, np.inf  # hidden from all rows by the mask
    v[45, 5] = np.inf  # hidden from the first rows by causal, visible to the later ones unless masked
    v[60:, 7] = np.nan  # past the diagonal of most rows
    for block in (BlockConfig.mma(16, 32, 1), BlockConfig.mma(64, 64, 4)):
        out, lse = cuflash.attention(q, k, v, mask=mask, causal=True, backend="simt", block=block, return_lse=True)
        assert_accurate(out, q, k, v, lse=lse, mask=mask, causal=True)
        out = cuflash.attention(q, k, v, causal=True, window=(20, None), backend="simt", block=block)
        assert_accurate(out, q, k, v, causal=True, window=(20, None))
    # Q_i read from shared memory each tile (MT * D > 128): P's scratch rows have their own space.
    q2, k2 = randn(rng, (n, 160), dtype, 0.2), randn(rng, (m, 160), dtype, 0.2)
    block = BlockConfig.mma(32, 32, 1)
    assert not forward_mma.q_in_registers(Shape(dtype, 160, d), block)
    out = cuflash.attention(q2, k2, v, mask=mask, causal=True, backend="simt", block=block)
    assert_accurate(out, q2, k2, v, mask=mask, causal=True)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the reference's inf - inf
@pytest.mark.parametrize("dtype", HALVES)
def test_other_tiles_in_two_parts(dtype):
    """Two m16 tiles per warp, 64 keys and e = 128 hold 160 accumulators or more: the tiles other than the steady
    ones take their keys in two parts of 32. Masks, biases, windows, hidden NaN/inf values and last tiles of 20
    keys (the second part empty) and of 50 (the second part short)."""
    block = BlockConfig.mma(32, 64, 1)
    assert forward_mma.key_parts(Shape(dtype, 64, 128), block) == 2
    assert forward_mma.key_parts(Shape(dtype, 64, 64), block) == 1
    rng = np.random.default_rng(14)
    for m in (148, 178):
        q, k, v = randn(rng, (40, 64), dtype, 0.3), randn(rng, (m, 64), dtype, 0.3), randn(rng, (m, 128), dtype)
        mask = rng.random((40, m)) < 0.8
        bias = randn(rng, (40, m), np.float32)
        k[70] = np.nan  # hidden by the mask from every row
        mask[:, 70] = False
        v[140, 9] = np.inf  # past the causal diagonal for the first rows
        for kwargs in ({"mask": mask, "bias": bias}, {"causal": True}, {"window": (30, 5), "bias": bias}, {}):
            out, lse = cuflash.attention(q, k, v, backend="simt", block=block, return_lse=True, **kwargs)
            assert_accurate(out, q, k, v, lse=lse, **kwargs)


def test_fully_masked_rows_and_bias_minus_inf():
    rng = np.random.default_rng(12)
    q, k, v = randn(rng, (2, 33, 64), F16), randn(rng, (2, 50, 64), F16), randn(rng, (2, 50, 64), F16)
    mask = np.ones((33, 50), bool)
    mask[3] = False
    bias = np.zeros((33, 50), np.float32)
    bias[7] = -np.inf  # every visible score -inf: nothing to attend
    out, lse = cuflash.attention(q, k, v, mask=mask, bias=bias, backend="simt", block="mma", return_lse=True)
    assert (out[:, 3] == 0).all() and np.isneginf(lse[:, 3]).all()
    assert (out[:, 7] == 0).all() and np.isneginf(lse[:, 7]).all()
    assert_accurate(out, q, k, v, lse=lse, mask=mask, bias=bias)


def test_grouped_query_attention_and_strided_views():
    """Broadcast K/V heads, a transposed Q (element loads instead of cp.async) and a strided out."""
    rng = np.random.default_rng(13)
    q = np.swapaxes(randn(rng, (2, 4, 64, 33), BF16), -1, -2)
    k, v = randn(rng, (2, 1, 47, 64), BF16), randn(rng, (2, 1, 47, 96), BF16)[..., ::-1, :]
    bias = randn(rng, (4, 1, 47), np.float32)
    out = np.full((2, 4, 33, 2 * 96), np.nan, BF16)[..., ::2]
    cuflash.attention(q, k, v, bias=bias, window=(10, 3), out=out, backend="simt", block="mma")
    assert_accurate(out, q, k, v, bias=bias, window=(10, 3))


# ----------------------------------------------------------------------------------------------------------------
# The dispatcher and its reasons


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("device", [H100, A100, A10])
@pytest.mark.parametrize("d", [32, 59, 64, 96, 128, 160, 192, 224, 256])
def test_dispatcher_prefers_tensor_cores(dtype, device, d):
    config = tiling.choose(Shape(dtype, d, d), device)
    assert config.variant == "mma" and config.stages == 2
    assert not tiling.not_supported_reasons(Shape(dtype, d, d), config, device)
    assert forward_mma.FORWARD.accumulator_words(Shape(dtype, d, d), config) <= forward_mma.REGISTER_TARGET


@pytest.mark.parametrize("workload, device", [(Shape(np.float32, 64, 64, precision="fma"), H100),
                                              (Shape(np.float64, 64, 64), A10),
                                              (Shape(F16, 64, 64), V100),
                                              (Shape(BF16, 128, 128), DeviceLimits.known("T4"))])
def test_dispatcher_falls_back_to_cuda_cores(workload, device):
    assert tiling.choose(workload, device).variant == "fma"


def test_simt_backend_picks_tensor_cores_for_halves():
    rng = np.random.default_rng(14)
    q = randn(rng, (20, 64), F16)
    problem, out, lse = problem_and_outputs(q, q, q)
    plan = tiling.plan(problem.shape, cuflash.backends.simt.DEVICE)
    (only,) = launch.launches(problem, out, lse, plan)
    assert only.name.startswith("cuflash::fwd_mma<__half, ")
    assert only.shared_mem == forward_mma.FORWARD.shared_memory_bytes(problem.shape, plan.config)
    assert tiling.resolve((64, 64), problem.shape, H100) == BlockConfig.mma(64, 64, 4)
    assert tiling.resolve((8, 16), problem.shape, H100).variant == "fma"  # not a tensor-core shape
    assert tiling.resolve("fma", problem.shape, H100).variant == "fma"


@pytest.mark.parametrize("workload, device, config, pattern", [
    (Shape(np.float32, 64, 64, precision="fma"), H100, BlockConfig.mma(64, 64), r"precision='fma' asks for CUDA"),
    (Shape(np.float64, 64, 64), A10, BlockConfig.mma(64, 64), r"float64 runs on tensor cores \(DMMA\) only"),
    (Shape(np.int8, 64, 64), H100, BlockConfig.mma(64, 64), r"runs float16, bfloat16, float32 and float64, not int8"),
    (Shape(F16, 64, 64), V100, BlockConfig.mma(64, 64), r"compute capability 8\.0 or newer.* has 7\.0"),
    (Shape(F16, 320, 64), H100, BlockConfig.mma(64, 64), r"d=320 is above 256"),
    (Shape(F16, 256, 256), A100, BlockConfig.mma(128, 128, 8),
     r"needs [\d.]+ KiB of shared memory; A100 allows 163 KiB per block.*\(.*mma\) fits"),
    (Shape(F16, 64, 64), H100, BlockConfig.mma(48, 64), r"Br=48 is not supported.*64 or 128"),
    (Shape(F16, 64, 64), H100, BlockConfig.mma(64, 40), r"Bc=40 is not supported"),
    (Shape(F16, 64, 64), H100, BlockConfig(64, 64, 4, 1, "mma"), r"stages=1 is not supported"),
    (Shape(F16, 256, 256), H100, BlockConfig.mma(128, 128, 4), r"accumulator registers per thread"),
])
def test_forced_tensor_core_choice_gives_reasons(workload, device, config, pattern):
    reasons = tiling.not_supported_reasons(workload, config, device)
    assert reasons and re.search(pattern, "; ".join(reasons)), reasons


def test_forced_choice_raises_through_the_front_door():
    q = np.zeros((4, 32), np.float16)
    with pytest.raises(ValueError, match="precision='fma' asks for CUDA cores"):
        cuflash.attention(q, q, q, backend="simt", block="mma", precision="fma")
    with pytest.raises(ValueError, match="precision='fma' asks for CUDA cores"):
        cuflash.attention(q, q, q, backend="simt", block=BlockConfig.mma(64, 64), precision="fma")


# ----------------------------------------------------------------------------------------------------------------
# Memcheck


@pytest.mark.memcheck
def test_memcheck_under_address_sanitizer():
    """Out-of-bounds global, shared or cp.async accesses of the tensor-core kernel abort under ASan."""
    result = run_under_memcheck("mma")
    assert result.returncode == 0 and "memcheck ok" in result.stdout, result.stderr[-4000:]
