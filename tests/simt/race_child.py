"""Run kernels in race mode (ThreadSanitizer) in this process, which must have TSan preloaded. Used by
test_simt_race.py as a child process: a race report ends it with exit status 66 and the report on stderr.
Usage: python race_child.py CASE  (CASE: a name in CASES; the clean ones print "CLEAN <case>")."""

import os
import sys

import numpy as np
import simt_util

from cuflash import simt

# Markers name the lines the parent expects in a report.
RACY = r'''
extern "C" __global__ void missing_barrier(const float* x, float* out) {
  __shared__ float s[64];
  int t = threadIdx.x;
  s[t] = x[blockIdx.x * 64 + t];                       // RACE_WRITE
  // a __syncthreads() belongs here
  out[blockIdx.x * 64 + t] = s[(t + 63) % 64];         // RACE_READ
}

extern "C" __global__ void write_after_read(const float* x, float* out) {
  __shared__ float s[64];
  int t = threadIdx.x;
  s[t] = x[blockIdx.x * 64 + t];
  __syncthreads();
  float v = s[(t + 1) % 64];                           // WAR_READ
  // a __syncthreads() belongs here: others may still read s[t]
  s[t] = 2 * v;                                        // WAR_WRITE
  __syncthreads();
  out[blockIdx.x * 64 + t] = s[t];
}

extern "C" __global__ void atomics_only(int* counter) {
  atomicAdd(counter, 1);
  __shared__ int hits;
  if (threadIdx.x == 0) hits = 0;
  __syncthreads();
  atomicAdd(&hits, 1);
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(counter + 1, hits);
}
'''


def racy():
    return simt.RawModule(code=RACY, filename="racy.cu", mode="race")


def case_missing_barrier():
    x = np.arange(128, dtype=np.float32)
    racy().get_function("missing_barrier")((2,), (64,), (x, np.zeros(128, np.float32)))


def case_write_after_read():
    x = np.arange(128, dtype=np.float32)
    racy().get_function("write_after_read")((2,), (64,), (x, np.zeros(128, np.float32)))


def case_clean_reductions():
    for schedule in ("forward", "reverse", 5):
        simt_util.check_reductions("race", schedule)
        z = np.random.default_rng(3).standard_normal(4 * 128).astype(np.float32)
        o = np.zeros(4, np.float32)
        simt_util.module("basics.cu", ("reduce_shared<128>",), mode="race").get_function("reduce10")(
            (4,), (128,), (z, o), seed=schedule)
        np.testing.assert_allclose(o, z.reshape(4, 128).sum(1), rtol=1e-4, atol=1e-4)
    counter = np.zeros(2, np.int32)
    racy().get_function("atomics_only")((3,), (64,), (counter,))
    assert counter.tolist() == [192, 192], counter


def blocks():
    return simt_util.module("blocks.cu", with_ptx=True, mode="race")


def case_blocks_same_output():
    x = np.arange(128, dtype=np.float32)
    blocks().get_function("blocks_same_output")((2,), (64,), (x, np.zeros(64, np.float32)))


def case_blocks_read_other_after_copy():
    x = np.arange(256, dtype=np.float32)
    blocks().get_function("blocks_read_other_after_copy")((2,), (64,), (x, x, np.zeros(128, np.float32),
                                                                    np.zeros(128, np.float32)))


def case_blocks_read_other():
    x = np.arange(128, dtype=np.float32)
    blocks().get_function("blocks_read_other")((2,), (64,), (x, np.zeros(128, np.float32), np.zeros(128, np.float32)))


def case_clean_blocks():
    """The fixed twins, in every schedule and twice in a row (each launch ordered after the last)."""
    x = np.random.default_rng(4).standard_normal(4 * 64).astype(np.float32)
    for schedule in ("forward", "reverse", 9, 9):
        out, prev = np.zeros(256, np.float32), np.zeros(256, np.float32)
        blocks().get_function("blocks_disjoint")((4,), (64,), (x, out, prev), seed=schedule)
        np.testing.assert_array_equal(out, 2 * x)
        want = np.roll(np.concatenate([np.zeros(64, np.float32), 2 * x[:192]]).reshape(4, 64), -1, axis=1)
        np.testing.assert_array_equal(prev, want.ravel())
        total, count = np.zeros(1, np.float32), np.zeros(1, np.int32)
        blocks().get_function("blocks_atomic_sum")((4,), (64,), (x, total, count), shared_mem=64 * 4, seed=schedule)
        np.testing.assert_allclose(total[0], x.sum(), rtol=1e-5, atol=1e-4)
        assert count[0] == 256, count


def case_clean_ptx():
    simt_util.check_ptx_kernels("race")


def case_clean_attention():
    """The project's forward kernels (the FMA kernel: float32 with precision "fma"; the tensor-core one: float16,
    float32 as 3xTF32 and in one TF32 pass, float64) on small problems with ragged tiles, every block running
    under TSan."""
    import cuflash
    from reference import assert_accurate  # tests/ is on the path
    rng = np.random.default_rng(0)
    for dtype, precision in ((np.float32, "fma"), (np.float16, None), (np.float32, None), (np.float32, "tf32"),
                             (np.float64, None)):
        q, k, v = (rng.standard_normal((1, 2, n, 64)).astype(dtype) for n in (40, 72, 72))
        for causal in (False, True):
            o, lse = cuflash.attention(q, k, v, causal=causal, backend="simt", precision=precision,
                                       return_lse=True)
            assert_accurate(o, q, k, v, lse=lse, causal=causal, precision=precision)
    # The tensor-core forward's other tiles in two parts (two m16 tiles, 64 keys, e = 128), with a mask.
    q, k, v = (rng.standard_normal(shape).astype(np.float16) for shape in ((40, 64), (150, 64), (150, 128)))
    mask = rng.random((40, 150)) < 0.8
    o = cuflash.attention(q, k, v, mask=mask, backend="simt", block=cuflash.BlockConfig.mma(32, 64, 1))
    assert_accurate(o, q, k, v, mask=mask)


def case_clean_backward():
    """The backward kernels, CUDA-core and tensor-core (each block the only writer of its gradients, across
    blocks too), on a ragged causal problem with a bias and its gradient, in two schedules; each with one stage
    and with two (the next swept tile's copies and row terms in flight)."""
    import cuflash
    from cuflash import BlockConfig
    from reference import assert_grads_accurate
    rng = np.random.default_rng(1)
    for dtype, block in ((np.float32, BlockConfig(16, 16, 2)), (np.float32, BlockConfig(16, 16, 2, stages=2)),
                         (np.float16, BlockConfig.mma(32, 32, 2, stages=1)), (np.float16, (32, 32))):
        q, k, v = (rng.standard_normal((2, n, 24)).astype(dtype) for n in (37, 50, 50))
        bias = rng.standard_normal((37, 50)).astype(np.float32)
        out, lse = cuflash.attention(q, k, v, bias=bias, causal=True, return_lse=True)
        dout = rng.standard_normal(out.shape).astype(dtype)
        for seed in ("forward", "reverse"):
            os.environ["CUFLASH_SIMT_SEED"] = seed
            grads = cuflash.attention_backward(dout, q, k, v, out, lse, bias=bias, causal=True, bias_grad=True,
                                               backend="simt", block=block)
            assert_grads_accurate(grads, dout, q, k, v, bias=bias, causal=True)


def case_clean_patterns():
    """The kernels with mods compiled in (score_mod and mask_mod over captured arrays, sinks) and with a block
    mask's visits, forward and backward, CUDA cores and tensor cores; and a mod whose reads past its array many
    threads flag at once."""
    import cuflash
    from cuflash import BlockConfig, mods
    from reference import assert_accurate
    rng = np.random.default_rng(2)
    ids = np.sort(rng.integers(0, 3, 50))
    pattern = mods.documents(ids)
    made = cuflash.block_mask(pattern, (2,), 37, 50, block=(16, 16))
    for dtype, block in ((np.float32, BlockConfig(16, 16, 2, stages=2)), (np.float16, BlockConfig.mma(16, 16, 1))):
        q, k, v = (rng.standard_normal((2, n, 24)).astype(dtype) for n in (37, 50, 50))
        for options in (dict(score_mod=mods.softcap(2.0), mask_mod=pattern, sinks=np.zeros(2, np.float32)),
                        dict(block_mask=made)):
            out, lse = cuflash.attention(q, k, v, causal=True, backend="simt", block=block, return_lse=True,
                                         **options)
            if "block_mask" in options:
                assert_accurate(out, q, k, v, lse=lse, causal=True, mask=ids[:37, None] == ids[None, :])
            dout = rng.standard_normal(out.shape).astype(dtype)
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, backend="simt", block=block, **options)
    try:  # a score_mod's read: the kernels flag it (a mask_mod's would be found building its block mask)
        cuflash.attention(q, k, v, score_mod=lambda s, b, i, j: s + ids[i + j], backend="simt", block=block)
    except IndexError:
        pass
    else:
        raise AssertionError("reads past a captured array were not flagged")


def case_clean_sequences():
    """Packed sequences (forward and backward) and paged caches (short last pages, an empty cache, split keys),
    CUDA cores and tensor cores."""
    import cuflash
    from cuflash import BlockConfig
    from test_paged import paged_case
    from test_varlen import packed
    for dtype, block in ((np.float32, BlockConfig(16, 16, 2, stages=2)), (np.float16, BlockConfig.mma(16, 16, 1))):
        q, k, v, cu_q, cu_k = packed(3, [5, 0, 21, 3], [7, 4, 19, 0], (4, 2), 24, 24, dtype)
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, backend="simt", block=block,
                                            return_lse=True)
        dout = np.ones(out.shape, dtype)
        cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True, backend="simt",
                                          block=block)
        q, k_cache, v_cache, table, cached, k_new, v_new = paged_case(5, 3, [20, 0, 37], 2, 2, (4, 2), 24, 24,
                                                                      dtype, spare=0)
        cuflash.attention_paged(q, k_cache, v_cache, table, cached, k_new=k_new, v_new=v_new, causal=True,
                                backend="simt", block=block, num_splits=2)
        cuflash.attention_paged(q, k_cache, v_cache, table, cached + 2, backend="simt", block=block)


def case_clean_dropout():
    """Attention dropout's kernels forward and backward (the keep tiles each block makes and its warps read: one
    buffer on CUDA cores, two on tensor cores), CUDA cores and tensor cores, with tails and a window whose key tiles
    start off a Philox group, in two schedules."""
    import cuflash
    from cuflash import BlockConfig
    from test_dropout import kernels_only
    with kernels_only():
        clean_dropout_runs(cuflash, BlockConfig)


def clean_dropout_runs(cuflash, BlockConfig):
    rng = np.random.default_rng(3)
    for dtype, forward_block, backward_block, precision in (
            (np.float32, BlockConfig(16, 16, 2), BlockConfig(16, 16, 2, stages=2), "fma"),
            (np.float16, BlockConfig.mma(32, 32, 2), BlockConfig.mma(16, 16, 1, stages=1), None),
            (np.float16, BlockConfig.mma(16, 16, 1), BlockConfig.mma(32, 32, 2, stages=2), None)):
        q, k, v = (rng.standard_normal((2, n, 24)).astype(dtype) for n in (37, 50, 50))
        options = dict(window=(20, 3), dropout_p=0.4, seed=8)
        want, lse = cuflash.attention(q, k, v, return_lse=True, precision=precision, **options)
        dout = rng.standard_normal(want.shape).astype(dtype)
        expected = cuflash.attention_backward(dout, q, k, v, want, lse, precision=precision, **options)
        for seed in ("forward", "reverse"):
            os.environ["CUFLASH_SIMT_SEED"] = seed
            out = cuflash.attention(q, k, v, backend="simt", block=forward_block, precision=precision, **options)
            np.testing.assert_allclose(out.astype(np.float64), want.astype(np.float64), rtol=1e-2, atol=2e-2)
            grads = cuflash.attention_backward(dout, q, k, v, want, lse, backend="simt", block=backward_block,
                                               precision=precision, **options)
            for got, ref in zip(grads, expected):
                np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64), rtol=5e-2, atol=5e-2)


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    which = sys.argv[1]
    CASES[which]()
    print("CLEAN", which)
