"""The forward kernels' memcheck cases: representative problems run in the emulator's memcheck mode, in a child
Python with AddressSanitizer preloaded (harness.run_under_memcheck), where the first out-of-bounds global, shared
or cp.async access aborts with ASan's report. Usage: python memcheck_cases.py CASE (a name in CASES); a clean
case prints "memcheck ok"."""

import sys

import ml_dtypes
import numpy as np

import cuflash
import cuflash.simt
from cuflash import BlockConfig
from reference import assert_accurate, assert_grads_accurate
from strategies import randn


def case_probe():
    """The emulator's own memcheck mode on a trivial kernel, so its failures are told apart from a kernel's."""
    probe = cuflash.simt.RawModule(code='extern "C" __global__ void probe(float* x) { float y[64]; '
                                   'for (int i = 0; i < 64; ++i) y[i] = i * x[i]; x[threadIdx.x] = y[threadIdx.x]; }')
    buf = np.zeros(64, np.float32)
    for _ in range(2):  # fiber stacks reused across blocks and launches
        probe.get_function("probe")((4,), (32,), (buf,))
    print("probe ok", flush=True)


def case_fma():
    """The CUDA-core kernel: tails in every direction, strided and offset views, mask, bias, window, lse; head
    dims past the largest bucket (three slices of d, the last 6 wide, and two column blocks of e)."""
    case_probe()
    rng = np.random.default_rng(7)
    q = randn(rng, (2, 37, 2 * 19), np.float32)[..., ::2]
    k, v = randn(rng, (1, 45, 19), np.float32), randn(rng, (2, 45, 23), np.float32)[:, ::-1]
    mask = rng.random((37, 45)) < 0.8
    bias = randn(rng, (2, 1, 45), np.float16)
    for block in [(16, 16), (32, 64)]:
        out, lse = cuflash.attention(q, k, v, mask=mask, bias=bias, window=(9, 4), backend="simt", block=block,
                                     precision="fma", return_lse=True)
        assert_accurate(out, q, k, v, lse=lse, mask=mask, bias=bias, window=(9, 4))
    q, k, v = (randn(rng, (9, 2 * 1030), np.float32)[:, ::2], randn(rng, (20, 1030), np.float32),
               randn(rng, (20, 600), np.float32))
    out, lse = cuflash.attention(q, k, v, causal=True, backend="simt", precision="fma", return_lse=True)
    assert_accurate(out, q, k, v, lse=lse, causal=True)
    q, k, v = (randn(rng, shape, np.float16) for shape in ((3, 29, 64), (3, 70, 64), (3, 70, 64)))
    out = cuflash.attention(q, k, v, causal=True, backend="simt", precision="fma")
    assert_accurate(out, q, k, v, causal=True)


def case_mma():
    """The tensor-core kernel: tails in every direction, cp.async and element loads, mask, bias, window, lse, the
    hidden-NaN path; bfloat16; split keys (float partial results written from the fragments, a ragged last split,
    a strided value dim)."""
    rng = np.random.default_rng(15)
    q = randn(rng, (2, 37, 2 * 40), np.float16)[..., ::2]
    k, v = randn(rng, (1, 45, 40), np.float16), randn(rng, (2, 45, 23), np.float16)[:, ::-1]
    mask = rng.random((37, 45)) < 0.8
    v[0, 3, 1] = np.nan
    bias = randn(rng, (2, 1, 45), np.float32)
    out, lse = cuflash.attention(q, k, v, mask=mask, bias=bias, window=(9, 4), backend="simt",
                                 block=BlockConfig.mma(32, 16, 1), return_lse=True)
    assert_accurate(out, q, k, v, lse=lse, mask=mask, bias=bias, window=(9, 4))
    q, k, v = (randn(rng, shape, ml_dtypes.bfloat16) for shape in ((3, 29, 64), (3, 70, 64), (3, 70, 64)))
    out = cuflash.attention(q, k, v, causal=True, backend="simt", block=BlockConfig.mma(64, 32, 2))
    assert_accurate(out, q, k, v, causal=True)
    q, k = randn(rng, (1, 20, 32), np.float16), randn(rng, (1, 1100, 32), np.float16)
    v = randn(rng, (1, 1100, 2 * 19), np.float16)[..., ::2]
    out, lse = cuflash.attention(q, k, v, backend="simt", block="mma", return_lse=True)
    assert_accurate(out, q, k, v, lse=lse)
    # Contiguous K and V (the steady loop's chunk loaders) and a short last tile, which they must never copy.
    k, v = randn(rng, (1, 1100, 32), np.float16), randn(rng, (1, 1100, 32), np.float16)
    out = cuflash.attention(q, k, v, backend="simt", block="mma")
    assert_accurate(out, q, k, v)
    # The other tiles in two parts (two m16 tiles, 64 keys, e = 128), a short second part and hidden NaNs.
    q, k, v = randn(rng, (40, 64), np.float16), randn(rng, (178, 64), np.float16), randn(rng, (178, 128), np.float16)
    mask = rng.random((40, 178)) < 0.8
    mask[:, 5] = False
    v[5] = np.nan
    out = cuflash.attention(q, k, v, mask=mask, backend="simt", block=BlockConfig.mma(32, 64, 1))
    assert_accurate(out, q, k, v, mask=mask)


def case_mma_wide():
    """The tensor-core kernel for float32 (3xTF32, one TF32 pass) and float64 (DMMA): tails in every direction,
    cp.async and element loads, mask, bias, window, lse, the hidden-NaN path, split keys."""
    rng = np.random.default_rng(16)
    for dtype, precision in ((np.float32, "highest"), (np.float32, "tf32"), (np.float64, None)):
        q = randn(rng, (2, 37, 2 * 40), dtype)[..., ::2]
        k, v = randn(rng, (1, 45, 40), dtype), randn(rng, (2, 45, 23), dtype)[:, ::-1]
        mask = rng.random((37, 45)) < 0.8
        v[0, 3, 1] = np.nan
        bias = randn(rng, (2, 1, 45), np.float32)
        out, lse = cuflash.attention(q, k, v, mask=mask, bias=bias, window=(9, 4), backend="simt",
                                     block=BlockConfig.mma(32, 16, 2), precision=precision, return_lse=True)
        assert_accurate(out, q, k, v, lse=lse, mask=mask, bias=bias, window=(9, 4), precision=precision)
        if precision == "tf32":  # the same code as 3xTF32 but for its low parts: one problem is enough
            continue
        q, k, v = (randn(rng, shape, dtype) for shape in ((3, 29, 64), (3, 70, 64), (3, 70, 64)))
        out = cuflash.attention(q, k, v, causal=True, backend="simt", block="mma", precision=precision)
        assert_accurate(out, q, k, v, causal=True, precision=precision)
        q, k = randn(rng, (1, 20, 32), dtype), randn(rng, (1, 1100, 32), dtype)
        v = randn(rng, (1, 1100, 2 * 19), dtype)[..., ::2]
        out, lse = cuflash.attention(q, k, v, backend="simt", block="mma", precision=precision, return_lse=True)
        assert_accurate(out, q, k, v, lse=lse, precision=precision)


def case_backward():
    """The backward kernels (CUDA cores, then tensor cores): tails of both tiles, strided and reversed views,
    mask, bias with its gradient, window, grouped-query broadcasting; the planner's tiles and small ones (the
    tensor cores' smallest are proven in the emulator's other modes)."""
    rng = np.random.default_rng(8)
    q = randn(rng, (2, 37, 2 * 19), np.float32)[..., ::2]
    k, v = randn(rng, (1, 45, 19), np.float32), randn(rng, (2, 45, 23), np.float32)[:, ::-1]
    mask = rng.random((37, 45)) < 0.8
    bias = randn(rng, (2, 1, 45), np.float32)
    options = dict(mask=mask, bias=bias, window=(9, 4))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    dout = randn(rng, out.shape, np.float32)
    for block in [BlockConfig(16, 16, 2), None]:
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="simt", block=block, bias_grad=True,
                                           precision="fma", **options)
        assert_grads_accurate(grads, dout, q, k, v, **options)
    # The tensor-core kernels: cp.async and element loads, the careful path (a hidden key holding inf)
    q, k, v = (x.astype(np.float16) for x in (q, k, v))
    k[0, 3, 0] = np.inf
    mask[:, 3] = False
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    dout = dout.astype(np.float16)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="simt", bias_grad=True, **options)
    assert_grads_accurate(grads, dout, q, k, v, **options)
    # Their steady loops (whole tiles through the chunk loaders), each followed by short last tiles, and the tiles
    # before a window's first plain one; one stage and two, the planner's tiles and the smallest.
    q, k, v = (randn(rng, (2, length, 32), np.float16) for length in (70, 83, 83))
    for options in ({}, {"causal": True}, {"window": (20, 7)}):
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
        dout = randn(rng, out.shape, np.float16)
        for block in [(16, 16), BlockConfig.mma(16, 16, 1, stages=1), None]:
            grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="simt", block=block, **options)
            assert_grads_accurate(grads, dout, q, k, v, **options)


def case_backward_wide(cases=((np.float32, None), (np.float32, "tf32"), (np.float64, None))):
    """The float32 (3xTF32 and one TF32 pass) and float64 (DMMA) tensor-core backward: tails of both tiles, strided
    and reversed views, mask, bias with its gradient, window, the careful path (a hidden key holding inf), two warps
    splitting each swept tile to TF32 with the next one's copies in flight."""
    rng = np.random.default_rng(9)
    for dtype, precision in cases:
        q = randn(rng, (2, 37, 2 * 19), dtype)[..., ::2]
        k, v = randn(rng, (1, 45, 19), dtype), randn(rng, (2, 45, 23), dtype)[:, ::-1]
        k[0, 3, 0] = np.inf
        mask = rng.random((37, 45)) < 0.8
        mask[:, 3] = False
        bias = randn(rng, (2, 1, 45), dtype)
        options = dict(mask=mask, bias=bias, window=(9, 4))
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
        dout = randn(rng, out.shape, dtype)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="simt", block=BlockConfig.mma(32, 32, 2, 2),
                                           bias_grad=True, precision=precision, **options)
        assert_grads_accurate(grads, dout, q, k, v, precision=precision, **options)


def case_backward_race():
    """case_backward_wide's 3xTF32 part, for race mode: the warps' split of each swept tile between barriers."""
    case_backward_wide(((np.float32, None),))


def case_patterns():
    """The kernels with mods compiled in (a score_mod and mask_mod reading captured arrays, sinks) and a block
    mask's visits over hidden, partial and whole tiles (a whole one inside the causal band and one across it),
    forward and backward, CUDA cores and tensor cores, with tails in both tiles; and a score_mod that indexes
    past its array, which the kernels flag without reading there (a mask_mod's is found building its block mask,
    before any kernel)."""
    from cuflash import blockmask, mods
    rng = np.random.default_rng(9)
    ids = np.repeat([0, 1, 2], [32, 6, 7])  # 3 documents over 45 keys: 16 x 16 tiles of every kind
    pattern = mods.and_masks(mods.documents(ids), lambda b, h, i, j: (i + j) % 5 != 0)  # every shown tile partial
    score_mod = mods.alibi(rng.random(2))
    made = cuflash.block_mask(mods.documents(ids), (1, 2), 37, 45, block=(16, 16))
    assert [int((made.kinds == kind).sum()) for kind in (blockmask.FULL, blockmask.PARTIAL, blockmask.HIDDEN)] == \
        [4, 1, 4], made
    for dtype, block in [(np.float32, BlockConfig(16, 16, 2)), (np.float16, BlockConfig.mma(16, 16, 1, stages=2))]:
        q, k, v = (randn(rng, (1, 2, length, 24), dtype) for length in (37, 45, 45))
        sinks = randn(rng, (2,), np.float32)
        for options in (dict(score_mod=score_mod, mask_mod=pattern, sinks=sinks), dict(block_mask=made)):
            out, lse = cuflash.attention(q, k, v, causal=True, backend="simt", block=block, return_lse=True,
                                         **options)
            dout = randn(rng, out.shape, dtype)
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, backend="simt", block=block, **options)
    try:
        cuflash.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + ids[i + 10], backend="simt", block=block)
    except IndexError:
        pass
    else:
        raise AssertionError("an index past a captured array was not flagged")
    print("memcheck ok", flush=True)


def case_sequences():
    """Packed sequences (forward and backward, the kernels' own offsets: empty sequences, one longer than a tile)
    and paged caches (pages of 3 rows and of 16, short last pages, an empty cache, forced key splits), CUDA cores
    and tensor cores, with the tiles the patterns case compiles."""
    from test_paged import paged_case
    from test_varlen import packed
    for dtype, block in [(np.float32, BlockConfig(16, 16, 2)), (np.float16, BlockConfig.mma(16, 16, 1, stages=2))]:
        q, k, v, cu_q, cu_k = packed(3, [5, 0, 21, 3], [7, 4, 19, 0], (4, 2), 24, 24, dtype)
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=True, backend="simt", block=block,
                                            return_lse=True)
        dout = randn(4, out.shape, dtype)
        cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True, backend="simt",
                                          block=block)
        for size, splits in [(3, None), (16, 2)]:
            q, k_cache, v_cache, table, cached, k_new, v_new = paged_case(5, size, [20, 0, 37], 2, 2, (4, 2), 24,
                                                                          24, dtype, spare=0)
            cuflash.attention_paged(q, k_cache, v_cache, table, cached, k_new=k_new, v_new=v_new, causal=True,
                                    backend="simt", block=block, num_splits=splits)
            # without a mask: full tiles in the steady loop, their rows found through the pages
            cuflash.attention_paged(q, k_cache, v_cache, table, cached + 2, backend="simt", block=block)
    print("memcheck ok", flush=True)


def dropout_runs(rng, options, dtype, forward_block, backward_block, precision, shapes):
    """Attention dropout forward and backward on the emulated kernels (these blocks), held to the numpy backend."""
    q, k, v = (randn(rng, shape, dtype) for shape in shapes)
    options = dict(options, dropout_p=0.3, seed=2**40 + 9)
    out, lse = cuflash.attention(q, k, v, backend="simt", block=forward_block, precision=precision,
                                 return_lse=True, **options)
    want, want_lse = cuflash.attention(q, k, v, backend="numpy", precision=precision, return_lse=True, **options)
    np.testing.assert_allclose(out.astype(np.float64), want.astype(np.float64), rtol=1e-2, atol=2e-2)
    dout = randn(rng, out.shape, dtype)
    grads = cuflash.attention_backward(dout, q, k, v, want, want_lse, backend="simt", block=backward_block,
                                       precision=precision, **options)
    expected = cuflash.attention_backward(dout, q, k, v, want, want_lse, backend="numpy", precision=precision,
                                          **options)
    for got, ref in zip(grads, expected):
        np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64), rtol=5e-2, atol=5e-2)


def case_dropout():
    """Attention dropout's kernels, forward and backward: CUDA cores (one stage and two), tensor cores (the smallest
    tiles and two warps'), tails of both tiles, a window whose key tiles start off a Philox group, split keys
    (decoding shapes) and the planner's tiles (the forward's steady loop). The blocked fallback is refused."""
    from test_dropout import kernels_only
    with kernels_only():
        dropout_cases()
    print("memcheck ok", flush=True)


def dropout_cases():
    rng = np.random.default_rng(21)
    shapes = ((2, 37, 24), (2, 45, 24), (2, 45, 20))
    for dtype, forward_block, backward_block, precision in [
            (np.float32, BlockConfig(16, 16, 2), BlockConfig(16, 16, 2), "fma"),
            (np.float64, BlockConfig(16, 32, 2, stages=2), BlockConfig(16, 16, 2, stages=2), "fma"),
            (np.float16, BlockConfig.mma(16, 16, 1), BlockConfig.mma(16, 16, 1, stages=1), None),
            (np.float16, BlockConfig.mma(32, 32, 2), BlockConfig.mma(32, 32, 2, stages=2), None)]:
        for options in ({"causal": True}, {"window": (9, 4)}):
            dropout_runs(rng, options, dtype, forward_block, backward_block, precision, shapes)
    dropout_runs(rng, {}, np.float16, None, None, None, ((2, 3, 32), (2, 1100, 32), (2, 1100, 32)))
    dropout_runs(rng, {}, np.float32, None, None, "fma", ((2, 3, 32), (2, 1100, 32), (2, 1100, 32)))
    dropout_runs(rng, {"causal": True}, np.float16, None, None, None, ((1, 150, 64), (1, 200, 64), (1, 200, 64)))


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    CASES[sys.argv[1]]()
    print("memcheck ok")
