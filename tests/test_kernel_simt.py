"""The CUDA-core forward kernel on the emulator (backend="simt", precision="fma": never the tensor cores, whose
kernel has its own test files): the front door's properties against the float64 reference, with NaN-poisoned
outputs, over dtypes, head dims, odd lengths, windows, masks, biases, broadcast and strided views, block
configurations and emulator schedules. Problems stay small: the emulator runs on the CPU."""

import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

import cuflash
import cuflash.simt
from cuflash import BlockConfig, launch, tiling
from cuflash.backends import simt
from harness import check_case, problem_and_outputs, run_under_memcheck
from reference import assert_accurate
from strategies import Case, cases, randn

pytestmark = pytest.mark.skipif(not cuflash.simt.available(), reason="the SIMT emulator needs g++")

LENGTHS = (1, 7, 31, 64, 113, 150, 203, 300)  # past one query tile (64) and one key tile (32 to 64) often
HEAD_DIMS = (1, 3, 17, 32, 59, 64, 111, 128, 200)  # every bucket up to 256 (512: test_any_head_dim)
F32, F64 = np.dtype(np.float32), np.dtype(np.float64)


def plan_for(problem, block):
    """The emulated device's plan for problem with `block` forced."""
    return tiling.plan(problem.shape, simt.DEVICE, block)


@given(cases(lengths=LENGTHS, head_dims=HEAD_DIMS))
@settings(max_examples=50)
def test_matches_reference(case):
    check_case(case, backend="simt", precision="fma")


@given(cases(lengths=(1, 33, 70), head_dims=(256,), max_batch_dims=1))
@settings(max_examples=6)
def test_head_dim_256(case):
    check_case(case, backend="simt", precision="fma")


@given(cases(lengths=(5, 40), head_dims=(300, 512, 1030), max_batch_dims=0, masks=False))
@settings(max_examples=6)
def test_any_head_dim(case):
    """Past the largest bucket (256 for 16-bit types, 512 otherwise) d is swept in slices and e split into
    column blocks; 1030 leaves a 6-wide last slice."""
    check_case(case, backend="simt", precision="fma")


@given(cases(lengths=(5, 40), head_dims=(16, 70, 150), max_batch_dims=1))
@settings(max_examples=8)
def test_narrow_head_tiles(case):
    """A head tile of 32, as a small GPU's plan may take: d in slices and e in column blocks with tails."""
    check_case(case, backend="simt", precision="fma", block=BlockConfig(8, 16, 4, head_tile=32))


@given(cases(lengths=(1, 5, 16), key_lengths=(1030, 2100), head_dims=(1, 16, 64), max_batch_dims=1,
             magnitudes=(12.0, 1.0)))
@settings(max_examples=12)
def test_split_keys(case):
    """Few queries over many keys, too few blocks to fill the GPU: the key axis is split (flash-decoding) and
    the partial results merged; masks, windows and empty splits cross the split boundaries."""
    check_case(case, backend="simt", precision="fma")


def test_split_keys_launch_and_hidden_values():
    rng = np.random.default_rng(9)
    q, k, v = randn(rng, (2, 1, 3, 64), np.float16), randn(rng, (2, 1, 2000, 64), np.float16), \
        randn(rng, (2, 1, 2000, 64), np.float16)
    mask = rng.random((3, 2000)) < 0.5
    mask[:, 600:1400] = False  # whole splits see nothing
    mask[1] = False  # a row no split sees
    k[..., 700:800, :], v[..., 900:1000, :] = np.nan, np.inf  # hidden non-finite values never leak
    problem, out, lse = problem_and_outputs(q, k, v, mask=mask)
    plan = tiling.plan(problem.shape, simt.DEVICE)
    config = plan.config
    splits = tiling.key_splits(problem.shape, config, simt.DEVICE)
    assert (config.Br, config.variant, splits) == (8, "fma", 3)  # 2 blocks; 2000 // 512 splits at most
    keys, count = tiling.split_keys(2000, splits, config.Bc)
    assert (keys, count) == (672, 3) == (plan.split_keys, plan.splits)
    out, lse = cuflash.attention(q, k, v, mask=mask, backend="simt", precision="fma", return_lse=True)
    assert (out[:, :, 1] == 0).all() and np.isneginf(lse[:, :, 1]).all()
    assert np.isfinite(out.astype(np.float64)).all()
    assert_accurate(out, q, k, v, lse=lse, mask=mask)


def test_split_keys_with_slices_and_column_blocks():
    """Decoding with head dims past the largest tile: d in slices, e in column blocks, keys in splits at once."""
    rng = np.random.default_rng(10)
    q, k, v = randn(rng, (2, 3, 600)), randn(rng, (2, 1100, 600)), randn(rng, (2, 1100, 700))
    problem, out, lse = problem_and_outputs(q, k, v, causal=True)
    plan = tiling.plan(problem.shape, simt.DEVICE)
    assert tiling.key_splits(problem.shape, plan.config, simt.DEVICE) == plan.splits == 2
    assert plan.name == "cuflash::fwd<float, 8, 32, 512, 512, 4, true, true>"
    assert plan.column_blocks == ((0, 512), (512, 700))
    check_case(Case(q, k, v, {"causal": True}, out_kind="strided"), backend="simt", precision="fma")


def test_wide_e_is_split_into_column_blocks():
    rng = np.random.default_rng(8)
    q, k = randn(rng, (2, 9, 70), np.float64), randn(rng, (2, 33, 70), np.float64)
    v = randn(rng, (2, 33, 2 * 1100), np.float64)[..., ::2]
    problem, out, lse = problem_and_outputs(q, k, v)
    blocks = launch.launches(problem, out, lse, plan_for(problem, BlockConfig(4, 16, warps=2)))
    assert [x.name for x in blocks] == ["cuflash::fwd<double, 4, 16, 128, 512, 2>"] * 3
    assert [x.params["flags"] & launch.WANT_LSE for x in blocks] == [launch.WANT_LSE, 0, 0]  # lse written once
    assert [int(x.params["e"]) for x in blocks] == [512, 512, 76]  # e of each column block
    check_case(Case(q, k, v, {"causal": True}, out_kind="strided"), backend="simt", precision="fma")


BLOCKS = ((16, 16), BlockConfig(8, 16, warps=4), BlockConfig(4, 32, warps=2), (32, 64), BlockConfig(16, 48, 8))


@given(cases(lengths=(1, 5, 33, 97), head_dims=(1, 3, 16), max_batch_dims=1, magnitudes=(1.0, 12.0)))
@settings(max_examples=10)
def test_block_configurations(case):
    """Small tiles sweep many key tiles: rescaling, straddling windows, tails in both directions."""
    for block in BLOCKS:
        check_case(case, backend="simt", precision="fma", block=block)


@pytest.mark.parametrize("schedule", ["reverse", "20261129"])
@given(cases(lengths=(7, 64, 113), head_dims=(3, 16), max_batch_dims=1))
@settings(max_examples=6)
def test_emulator_schedules(schedule, case):
    """Other orders of the threads between barriers: a missing __syncthreads would show here."""
    old = os.environ.get("CUFLASH_SIMT_SEED")
    os.environ["CUFLASH_SIMT_SEED"] = schedule
    try:
        check_case(case, backend="simt", precision="fma", block=(16, 32))
    finally:
        if old is None:
            del os.environ["CUFLASH_SIMT_SEED"]
        else:
            os.environ["CUFLASH_SIMT_SEED"] = old


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_nan_and_inf_in_hidden_keys_never_leak(dtype):
    rng = np.random.default_rng(1)
    n, m, d = 40, 50, 16
    q, k, v = randn(rng, (n, d), dtype), randn(rng, (m, d), dtype), randn(rng, (m, d), dtype)
    mask = rng.random((n, m)) < 0.7
    hidden = ~mask.any(axis=0)
    mask[:, :3] = False  # keys 0..2 hidden from every row by the mask
    k[:3], v[:3] = np.nan, np.inf
    v[m - 5:] = np.nan  # the last keys are hidden by causal=True for the first rows only? no: n < m, offset 10
    causal_q = np.arange(n)[:, None] + (m - n) >= np.arange(m)[None, :]
    mask &= causal_q
    mask[:, m - 5:] = False
    del hidden
    out, lse = cuflash.attention(q, k, v, mask=mask, causal=True, backend="simt", precision="fma", block=(16, 16),
                                 return_lse=True)
    assert np.isfinite(out.astype(np.float64)).all()
    assert_accurate(out, q, k, v, lse=lse, mask=mask, causal=True)


def test_fully_masked_rows_and_no_keys():
    rng = np.random.default_rng(2)
    q, k, v = randn(rng, (2, 9, 8)), randn(rng, (2, 20, 8)), randn(rng, (2, 20, 5))
    mask = np.ones((9, 20), bool)
    mask[3] = False
    out, lse = cuflash.attention(q, k, v, mask=mask, backend="simt", precision="fma", return_lse=True)
    assert (out[:, 3] == 0).all() and np.isneginf(lse[:, 3]).all()
    assert_accurate(out, q, k, v, lse=lse, mask=mask)
    out, lse = cuflash.attention(q, k[:, :0], v[:, :0], backend="simt", precision="fma", return_lse=True)
    assert (out == 0).all() and np.isneginf(lse).all()


def test_grouped_query_attention_by_broadcasting():
    rng = np.random.default_rng(3)
    q = randn(rng, (2, 4, 33, 16), np.float16)
    k, v = randn(rng, (2, 1, 47, 16), np.float16), randn(rng, (2, 1, 47, 24), np.float16)
    bias = randn(rng, (4, 1, 47))  # per head, broadcast over rows
    out = cuflash.attention(q, k, v, bias=bias, window=(10, 3), backend="simt", precision="fma")
    assert_accurate(out, q, k, v, bias=bias, window=(10, 3))


def test_batch_with_more_dims_than_the_kernel_takes():
    """Seven batch dims that no two operands walk alike cannot be coalesced: one launch per leading index."""
    rng = np.random.default_rng(4)
    batch = (2,) * 7
    q = randn(rng, batch + (5, 4))
    k = randn(rng, (2, 1) * 3 + (2, 6, 4))
    v = randn(rng, (1, 2) * 3 + (2, 6, 3))
    problem, out, lse = problem_and_outputs(q, k, v)
    problem_launches = launch.launches(problem, out, lse, plan_for(problem, BlockConfig(16, 16)))
    assert len(problem_launches) == 2
    out = cuflash.attention(q, k, v, backend="simt", precision="fma")
    assert_accurate(out, q, k, v)


@pytest.mark.parametrize("offset", [0, 1])
def test_vector_loads_only_when_aligned(offset):
    rng = np.random.default_rng(5)
    base = randn(rng, (3, 40, 64 + 8), np.float16)
    q = base[:, :, offset:offset + 64]  # offset 1: every row starts 2 bytes past a 16-byte boundary
    k, v = base[:, :37, 8 - offset:72 - offset], base[:, 3:, :64]
    problem, out, lse = problem_and_outputs(q, k, v)
    flags = launch.launches(problem, out, lse, plan_for(problem, BlockConfig(64, 64)))[0].params["flags"]
    vector_q = bool(flags & launch.VECTOR_Q)
    assert vector_q == (offset == 0 and q.ctypes.data % 16 == 0)
    result = cuflash.attention(q, k, v, backend="simt", precision="fma")
    assert_accurate(result, q, k, v)


def test_launch_uses_the_shared_memory_model():
    rng = np.random.default_rng(6)
    q, k, v = randn(rng, (20, 59)), randn(rng, (30, 59)), randn(rng, (30, 111))
    problem, out, lse = problem_and_outputs(q, k, v)
    config = BlockConfig(32, 64)
    (only,) = launch.launches(problem, out, lse, plan_for(problem, config))
    assert only.shared_mem == tiling.shared_memory_bytes(problem.shape, config)
    assert only.name == "cuflash::fwd<float, 32, 64, 64, 128, 4>"
    assert only.block == (128, 1, 1) and only.grid == (1, 1, 1)


def test_invalid_blocks_raise_with_reasons():
    q = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="Bc=5 is not supported"):
        cuflash.attention(q, q, q, backend="simt", precision="fma", block=(7, 5))
    with pytest.raises(ValueError, match="warps=3"):
        cuflash.attention(q, q, q, backend="simt", precision="fma", block=BlockConfig(64, 64, warps=3))
    too_large = r"needs 328 KiB of shared memory; H100 allows 227 KiB per block; .* \(64, 64, stages=2\) fits"
    with pytest.raises(ValueError, match=too_large):
        cuflash.attention(q, q, q, backend="simt", precision="fma", block=BlockConfig(256, 256, warps=8))


@pytest.mark.memcheck
def test_memcheck_under_address_sanitizer():
    """A representative subset in the emulator's memcheck mode: out-of-bounds global or shared accesses abort."""
    result = run_under_memcheck("fma")
    assert "probe ok" in result.stdout, "memcheck fails on a trivial kernel: " + result.stderr[-4000:]
    assert result.returncode == 0 and "memcheck ok" in result.stdout, result.stderr[-4000:]
