"""The kernels on a CUDA device (backend="cupy"): the simt properties on CuPy arrays, the backward's too, and one
problem whose operands pass 2**31 elements. Skipped only when CuPy or a CUDA device is missing."""

import numpy as np
import pytest
from hypothesis import given, settings

import cuflash
from harness import check_case
from strategies import FLOAT_DTYPES, Case, cases


def _device_count():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # CuPy missing, no driver
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_device_count() == 0, reason="no CUDA device")]


def _cupy_dtypes():
    """bfloat16 only where this CuPy computes in ml_dtypes' bfloat16 (CuPy 13 holds such arrays but cannot cast
    them): the front door's own probe, which otherwise refuses bfloat16 with a TypeError."""
    from cuflash.api import cupy_bfloat16_problem
    if cupy_bfloat16_problem():
        return tuple(t for t in FLOAT_DTYPES if t.name != "bfloat16")
    return FLOAT_DTYPES


def to_device(x):
    import cupy
    return cupy.asarray(x)


DTYPES = _cupy_dtypes() if _device_count() else FLOAT_DTYPES


@given(cases(dtypes=DTYPES, lengths=(1, 7, 31, 64, 113, 203, 300),
             head_dims=(1, 3, 17, 32, 59, 64, 111, 128, 200, 256)))
@settings(max_examples=150)
def test_matches_reference(case):
    check_case(case, backend="cupy", to_device=to_device)


@given(cases(dtypes=DTYPES, lengths=(1, 5, 33, 97), head_dims=(1, 3, 16, 59), max_batch_dims=1))
@settings(max_examples=30)
def test_block_configurations(case):
    for block in ((16, 16), cuflash.BlockConfig(8, 16, warps=4), (32, 64), cuflash.BlockConfig(16, 48, 8)):
        check_case(case, backend="cupy", to_device=to_device, block=block)


@given(cases(dtypes=DTYPES, lengths=(1, 5, 16), key_lengths=(1030, 5000), head_dims=(16, 64, 128),
             max_batch_dims=1, magnitudes=(12.0, 1.0)))
@settings(max_examples=20)
def test_split_keys(case):
    """Decoding shapes: few blocks, many keys, so the key axis is split and the partial results merged."""
    check_case(case, backend="cupy", to_device=to_device)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("d, e", [(300, 512), (1030, 600)])
def test_any_head_dim(dtype, d, e):
    """Past the largest bucket d is swept in slices and e split into column blocks."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((2, 70, d), (2, 90, d), (2, 90, e)))
    check_case(Case(q, k, v, {"causal": True}), backend="cupy", to_device=to_device)


def test_empty_sizes():
    """n, m, d or a batch dimension of 0 (no property draws them): empty results, zeros and -inf for no keys, the
    mean of the values for d = 0."""
    rng = np.random.default_rng(2)
    for q_shape, k_shape, v_shape in (((0, 8), (5, 8), (5, 3)), ((0, 2, 4, 8), (1, 6, 8), (1, 6, 3)),
                                      ((2, 4, 8), (2, 0, 8), (2, 0, 3)), ((4, 0), (6, 0), (6, 3)),
                                      ((4, 2), (6, 2), (6, 0))):
        q, k, v = (rng.standard_normal(x).astype(np.float32) for x in (q_shape, k_shape, v_shape))
        check_case(Case(q, k, v), backend="cupy", to_device=to_device)


def test_operands_past_two_to_the_31_elements():
    """k and v of 2**31 + 4096 elements each: offsets past 2**31 must not wrap. A window keeps the work to the
    last keys, which sit past the 32-bit range."""
    import cupy
    d, n = 64, 8
    m = 2**31 // d + 64
    rng = np.random.default_rng(1)
    k = cupy.zeros((1, m, d), dtype=cupy.float16)
    v = cupy.zeros((1, m, d), dtype=cupy.float16)
    tail = 300
    k_tail = rng.standard_normal((tail, d)).astype(np.float16)
    v_tail = rng.standard_normal((tail, d)).astype(np.float16)
    k[0, m - tail:] = cupy.asarray(k_tail)
    v[0, m - tail:] = cupy.asarray(v_tail)
    q = rng.standard_normal((1, n, d)).astype(np.float16)
    window = (100, 0)
    out = cuflash.attention(cupy.asarray(q), k, v, window=window).get()
    # Row i sees keys i + (m - n) - 100 ... i + (m - n): all inside the tail, at tail index i + first.
    first = tail - n
    expected = np.stack([_row(q[0, i], k_tail, v_tail, i + first - 100, i + first) for i in range(n)])
    np.testing.assert_allclose(out[0].astype(np.float64), expected, atol=2e-3, rtol=2e-2)


def _row(qi, k, v, lo, hi):
    lo = max(lo, 0)
    s = (k[lo:hi + 1].astype(np.float64) @ qi.astype(np.float64)) / np.sqrt(k.shape[1])
    w = np.exp(s - s.max())
    return (w / w.sum()) @ v[lo:hi + 1].astype(np.float64)


@given(cases(dtypes=DTYPES, lengths=(1, 7, 64, 130), head_dims=(1, 16, 64), max_batch_dims=1))
@settings(max_examples=40)
def test_backward_on_cupy_arrays(case):
    """The backward kernels on CuPy arrays (tensor cores for float16 and bfloat16, CUDA cores otherwise): the
    gradients meet the rule, and two runs give the same bits."""
    import cupy
    from reference import assert_grads_accurate
    options = {key: case.options[key] for key in ("scale", "causal", "window", "mask", "bias") if key in case.options}
    device_options = {key: cupy.asarray(x) if isinstance(x, np.ndarray) else x for key, x in options.items()}
    q, k, v = (cupy.asarray(x) for x in (case.q, case.k, case.v))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **device_options)
    dout = cupy.asarray(np.random.default_rng(0).standard_normal(out.shape).astype(out.dtype))
    first = cuflash.attention_backward(dout, q, k, v, out, lse, **device_options)
    second = cuflash.attention_backward(dout, q, k, v, out, lse, **device_options)
    assert all(a.get().tobytes() == b.get().tobytes() for a, b in zip(first, second))
    assert_grads_accurate([g.get() for g in first], dout.get(), case.q, case.k, case.v, **options)


def test_patterns_on_cupy_arrays():
    """Mods over device arrays, sinks and a block mask built on the GPU: the kernels' forward and backward against
    the numpy backend, the GPU-built block mask equal to the host-built one, and the gradients of a captured
    device table through the blocked backward."""
    import cupy
    from cuflash import mods
    rng = np.random.default_rng(41)
    q, k, v = (rng.standard_normal((2, 4, length, 64)).astype(np.float16) for length in (300, 420, 420))
    ids, slopes = np.sort(rng.integers(0, 5, 420)), rng.random(4)
    sinks = rng.standard_normal(4).astype(np.float32)
    host = cuflash.block_mask(mods.documents(ids), (2, 4), 300, 420, block=(64, 64))
    on_gpu = cuflash.block_mask(mods.documents(cupy.asarray(ids)), (2, 4), 300, 420, block=(64, 64), device=0)
    assert np.array_equal(on_gpu.kinds, host.kinds)
    from_mask = cuflash.block_mask(mask=cupy.asarray(ids[:300, None] == ids[None, :]), block=(64, 64))
    assert np.array_equal(from_mask.kinds[0], host.kinds[0, 0])
    options = dict(score_mod=mods.alibi(cupy.asarray(slopes)), block_mask=on_gpu, causal=True,
                   sinks=cupy.asarray(sinks))
    host_options = dict(options, score_mod=mods.alibi(slopes), block_mask=host, sinks=sinks)
    device = [cupy.asarray(x) for x in (q, k, v)]
    out, lse = cuflash.attention(*device, return_lse=True, **options)
    expected, expected_lse = cuflash.attention(q, k, v, return_lse=True, **host_options)
    np.testing.assert_allclose(out.get().astype(np.float64), expected.astype(np.float64), atol=2e-3)
    np.testing.assert_allclose(lse.get(), expected_lse, atol=1e-4)
    dout = rng.standard_normal(out.shape).astype(np.float16)
    grads = cuflash.attention_backward(cupy.asarray(dout), *device, out, lse, **options)
    expected_grads = cuflash.attention_backward(dout, q, k, v, expected, expected_lse, **host_options)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(got.get().astype(np.float64), want.astype(np.float64), atol=3e-2, rtol=3e-2)
    device_slopes = cupy.asarray(slopes)
    options["score_mod"] = mods.alibi(device_slopes)
    dslopes = cuflash.attention_backward(cupy.asarray(dout), *device, out, lse, score_mod_grads=(device_slopes,),
                                         **options)[-1]
    want = cuflash.attention_backward(dout, q, k, v, expected, expected_lse, score_mod_grads=(slopes,),
                                      **dict(host_options, score_mod=mods.alibi(slopes)))[-1]
    np.testing.assert_allclose(dslopes.get(), want, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dropout_on_cupy_arrays(dtype):
    """Attention dropout in the cupy backend's kernels (the planner's tiles; split keys for a decoding shape),
    forward and backward, against the numpy backend, which keeps the same elements (cuflash.dropout_mask)."""
    import cupy
    rng = np.random.default_rng(43)
    tolerance = {np.float16: 3e-2, np.float32: 1e-4, np.float64: 1e-10}[dtype]
    for shape_q, shape_k, causal in (((2, 4, 300, 64), (2, 4, 420, 64), True), ((1, 2, 2, 128), (1, 2, 5000, 128),
                                                                                  False)):
        q, k, v = rng.standard_normal(shape_q).astype(dtype), *(rng.standard_normal(shape_k).astype(dtype)
                                                                for _ in range(2))
        options = dict(causal=causal, dropout_p=0.3, seed=2**33 + 7)
        out, lse = cuflash.attention(*(cupy.asarray(x) for x in (q, k, v)), return_lse=True, **options)
        want, want_lse = cuflash.attention(q, k, v, backend="numpy", return_lse=True, **options)
        np.testing.assert_allclose(out.get().astype(np.float64), want.astype(np.float64), atol=tolerance,
                                   rtol=tolerance)
        np.testing.assert_allclose(lse.get(), want_lse, atol=tolerance, rtol=tolerance)
        dout = rng.standard_normal(want.shape).astype(dtype)
        grads = cuflash.attention_backward(*(cupy.asarray(x) for x in (dout, q, k, v, want, want_lse)), **options)
        expected = cuflash.attention_backward(dout, q, k, v, want, want_lse, backend="numpy", **options)
        for got, ref in zip(grads, expected):
            np.testing.assert_allclose(got.get().astype(np.float64), ref.astype(np.float64), atol=5 * tolerance,
                                       rtol=5 * tolerance)


def test_packed_sequences_and_paged_caches_on_cupy_arrays():
    """attention_varlen (forward and backward) and attention_paged (a prefill appended into pages, then decoding
    with the planner's key splits) on CuPy arrays, each sequence held to the float64 reference on its own rows."""
    import cupy
    from reference import assert_accurate, assert_grads_accurate
    from test_paged import gathered, grouped, keys_of, paged_case
    from test_varlen import packed, sequence
    queries, keys = [150, 3, 0, 131, 1], [140, 5, 2, 200, 900]
    q, k, v, cu_q, cu_k = packed(7, queries, keys, (4, 2), 64, 64, np.float16)
    device = [cupy.asarray(x) for x in (q, k, v)]
    out, lse = cuflash.attention_varlen(*device, cu_q, cupy.asarray(cu_k), causal=True, return_lse=True)
    dout = np.random.default_rng(3).standard_normal(out.shape).astype(np.float16)
    grads = cuflash.attention_varlen_backward(cupy.asarray(dout), *device, out, lse, cu_q, cu_k, causal=True)
    out, lse, grads = out.get(), lse.get(), [g.get() for g in grads]
    for s in range(len(queries)):
        if queries[s]:
            q_s, k_s, v_s = sequence(q, cu_q, s, 2), sequence(k, cu_k, s), sequence(v, cu_k, s)
            assert_accurate(sequence(out, cu_q, s, 2), q_s, k_s, v_s, lse=sequence(lse, cu_q, s, 2), causal=True)
            assert_grads_accurate((sequence(grads[0], cu_q, s, 2), sequence(grads[1], cu_k, s),
                                   sequence(grads[2], cu_k, s)), sequence(dout, cu_q, s, 2), q_s, k_s, v_s,
                                  causal=True)
    for size, new, queries_ in ((16, 130, 130), (16, 1, 1), (7, 1, 1)):
        q, k_cache, v_cache, table, cached, k_new, v_new = paged_case(5, size, [3000, 37, 0], new, queries_, (8, 2),
                                                                      128, 128, np.float16)
        caches = [cupy.asarray(x) for x in (k_cache, v_cache)]
        out, lse = cuflash.attention_paged(cupy.asarray(q), *caches, cupy.asarray(table), cached,
                                           k_new=cupy.asarray(k_new), v_new=cupy.asarray(v_new), causal=True,
                                           return_lse=True)
        k_cache, v_cache, out, lse = caches[0].get(), caches[1].get(), out.get(), lse.get()
        for b, c in enumerate(cached):
            m = c + new
            assert_accurate(grouped(out[b], 4), grouped(q[b], 4), keys_of(gathered(k_cache, table, b, m)),
                            keys_of(gathered(v_cache, table, b, m)), lse=grouped(lse[b][..., None], 4)[..., 0],
                            causal=True)
