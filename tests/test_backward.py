"""cuflash.attention_backward on the numpy backend: gradients against an independent float64 reference (itself
checked by finite differences), over the forward's input space drawn by hypothesis; broadcast axes summed;
hidden keys with exactly zero gradient; bitwise determinism, on worker threads as on one; errors in NumPy's
words."""

import os
import threading
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

import cuflash
from cuflash import api, blocked, workers
from reference import assert_grads_accurate, attention_grads_reference, attention_reference
from strategies import cases, randn

OPTIONS = ("scale", "causal", "window", "mask", "bias")


def forward_and_backward(q, k, v, dout=None, seed=0, backend="numpy", bias_grad=False, **options):
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend=backend, **options)
    if dout is None:
        dout = randn(seed, out.shape, np.float64).astype(out.dtype)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend=backend, bias_grad=bias_grad, **options)
    return dout, grads


@given(cases(lengths=(1, 5, 33, 70), head_dims=(1, 8, 33)))
@settings(max_examples=200)
def test_matches_reference(case):
    options = {key: case.options[key] for key in OPTIONS if key in case.options}
    bias_grad = options.get("bias") is not None
    dout, grads = forward_and_backward(case.q, case.k, case.v, bias_grad=bias_grad, **options)
    assert_grads_accurate(grads, dout, case.q, case.k, case.v, **options)


@given(cases(lengths=(3, 20), key_lengths=(600, 1100), head_dims=(4, 16), max_batch_dims=1))
@settings(max_examples=8)
def test_several_key_tiles(case):
    """Past the backend's 512-key tile: dQ accumulates over key tiles, dK and dV over query tiles."""
    options = {key: case.options[key] for key in OPTIONS if key in case.options}
    dout, grads = forward_and_backward(case.q, case.k, case.v, **options)
    assert_grads_accurate(grads, dout, case.q, case.k, case.v, **options)


def numeric_gradient(f, x, eps=1e-6):
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[index] += eps
        down[index] -= eps
        grad[index] = (f(up) - f(down)) / (2 * eps)
    return grad


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (2, 1)}, {"bias": "bias"},
                                     {"mask": "mask", "causal": True}])
def test_reference_agrees_with_finite_differences(options):
    """The gradient reference itself, against central differences of the float64 forward reference, with
    grouped-query broadcasting (k, v shared by two query heads) and a bias broadcast over the heads."""
    rng = np.random.default_rng(3)
    q, k, v = randn(rng, (2, 4, 3), np.float64), randn(rng, (1, 6, 3), np.float64), randn(rng, (1, 6, 2), np.float64)
    options = dict(options)
    if options.get("bias") == "bias":
        options["bias"] = randn(rng, (4, 6), np.float64)
    if options.get("mask") == "mask":
        options["mask"] = rng.random((2, 4, 6)) < 0.7
    dout = randn(rng, (2, 4, 2), np.float64)

    def loss(**changed):
        args = {"q": q, "k": k, "v": v, **changed}
        out = attention_reference(args["q"], args["k"], args["v"], **{**options, **changed.get("opts", {})})[0]
        return float((out * dout).sum())

    dq, dk, dv, dbias = attention_grads_reference(dout, q, k, v, **options)
    np.testing.assert_allclose(dq, numeric_gradient(lambda x: loss(q=x), q), atol=1e-7)
    np.testing.assert_allclose(dk, numeric_gradient(lambda x: loss(k=x), k), atol=1e-7)
    np.testing.assert_allclose(dv, numeric_gradient(lambda x: loss(v=x), v), atol=1e-7)
    if dbias is not None:
        numeric = numeric_gradient(lambda x: loss(opts={"bias": x}), options["bias"])
        np.testing.assert_allclose(dbias, numeric, atol=1e-7)


def test_broadcast_axes_are_summed_and_shapes_kept():
    """Grouped-query attention by broadcasting: dk and dv have k's and v's own (2, 1, m, d) shapes, the sums over
    each group's query heads; a bias broadcast over batch and heads gets one (n, m) gradient."""
    rng = np.random.default_rng(4)
    q = randn(rng, (2, 4, 9, 8), np.float32)
    k, v = randn(rng, (2, 1, 11, 8), np.float32), randn(rng, (2, 1, 11, 5), np.float32)
    bias = randn(rng, (9, 11), np.float32)
    dout, (dq, dk, dv, dbias) = forward_and_backward(q, k, v, bias=bias, bias_grad=True, causal=True)
    assert (dq.shape, dk.shape, dv.shape, dbias.shape) == (q.shape, k.shape, v.shape, bias.shape)
    assert {x.dtype for x in (dq, dk, dv, dbias)} == {np.dtype(np.float32)}
    assert_grads_accurate((dq, dk, dv, dbias), dout, q, k, v, bias=bias, causal=True)
    # the same as per-head copies, summed by hand
    copies = forward_and_backward(q, np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1), dout=dout, bias=bias,
                                  causal=True)[1]
    np.testing.assert_allclose(dk, copies[1].sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_hidden_keys_get_zero_gradient_and_their_nan_never_leaks():
    rng = np.random.default_rng(5)
    q, k, v = randn(rng, (6, 4)), randn(rng, (9, 4)), randn(rng, (9, 3))
    mask = np.ones((6, 9), bool)
    mask[:, 7] = False  # key 7 hidden from every row
    bias = np.zeros((6, 9), np.float32)
    bias[:, 8] = -np.inf  # key 8 hidden by the bias
    mask[2] = False  # row 2 sees nothing
    k[7], v[7], k[8], v[8] = np.nan, np.inf, np.inf, np.nan
    dout, (dq, dk, dv) = forward_and_backward(q, k, v, mask=mask, bias=bias)
    assert (dk[7:] == 0).all() and (dv[7:] == 0).all()
    assert (dq[2] == 0).all()
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert_grads_accurate((dq, dk, dv), dout, q, k, v, mask=mask, bias=bias)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_deterministic_bit_for_bit(dtype):
    rng = np.random.default_rng(6)
    q, k, v = randn(rng, (3, 2, 40, 16), dtype), randn(rng, (3, 1, 700, 16), dtype), randn(rng, (3, 1, 700, 8), dtype)
    dout, first = forward_and_backward(q, k, v, causal=True)
    _, second = forward_and_backward(q, k, v, dout=dout, causal=True)
    for a, b in zip(first, second):
        assert a.dtype == np.dtype(dtype)
        assert a.tobytes() == b.tobytes()
    assert_grads_accurate(first, dout, q, k, v, causal=True)


def on_threads(count, call):
    """call() with the backward's worker threads set to `count` (1: everything on the calling thread)."""
    with mock.patch.dict(os.environ, {workers.ENVIRONMENT: str(count)}):
        return call()


@given(cases(dtypes=(np.dtype(np.float32), np.dtype(np.float64)), lengths=(1, 7, 300), key_lengths=(5, 300, 700),
             head_dims=(3, 16), max_batch_dims=2))
@settings(max_examples=12)
def test_worker_threads_give_the_bits_of_one_thread(case):
    """Batch items on worker threads, each writing its own gradients: the same bits as one thread, whatever the
    options (causal, window, mask, bias and its gradient), tails of the 256 x 512 tiles included; and accurate."""
    options = {key: case.options[key] for key in OPTIONS if key in case.options}
    bias_grad = options.get("bias") is not None
    dout, one = on_threads(1, lambda: forward_and_backward(case.q, case.k, case.v, bias_grad=bias_grad, **options))
    for count in (2, 3):
        _, many = on_threads(count, lambda: forward_and_backward(case.q, case.k, case.v, dout=dout,
                                                                 bias_grad=bias_grad, **options))
        for a, b in zip(one, many):
            assert a.tobytes() == b.tobytes()
    assert_grads_accurate(one, dout, case.q, case.k, case.v, **options)


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_on_worker_threads_gives_the_bits_of_one_thread(causal):
    """Dropout keeps the same elements on every thread: three heads of 300 x 600 (row and key tails) with p = 0.3
    give the bits of one thread."""
    rng = np.random.default_rng(12)
    q, k, v = randn(rng, (3, 300, 8), np.float64), randn(rng, (3, 600, 8), np.float64), randn(rng, (3, 600, 5),
                                                                                              np.float64)
    options = dict(causal=causal, dropout_p=0.3, seed=5, backend="numpy")
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    dout = randn(rng, out.shape, np.float64)
    one, two = (on_threads(count, lambda: cuflash.attention_backward(dout, q, k, v, out, lse, **options))
                for count in (1, 2))
    assert any((grad != 0).any() for grad in one)
    for a, b in zip(one, two):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (300, 40)}])
def test_one_head_past_the_row_and_key_tiles(options):
    """One head of 700 queries by 1100 keys: three row tiles and three key tiles, each with a tail, and split into
    ranges of keys (a sliding window's tiles cut at their edges) that threads take apart: the bits of one thread,
    and accurate. Then row tiles of several heads where n is below a tile's rows."""
    assert 700 > 2 * blocked.BACKWARD_BR and 1100 > 2 * blocked.BACKWARD_BC
    rng = np.random.default_rng(13)
    q, k, v = randn(rng, (700, 16), np.float64), randn(rng, (1100, 16), np.float64), randn(rng, (1100, 4), np.float64)
    dout, one = on_threads(1, lambda: forward_and_backward(q, k, v, **options))
    _, two = on_threads(2, lambda: forward_and_backward(q, k, v, dout=dout, **options))
    for a, b in zip(one, two):
        assert a.tobytes() == b.tobytes()
    assert_grads_accurate(one, dout, q, k, v, **options)
    q, k, v = randn(rng, (9, 40, 16)), randn(rng, (9, 40, 16)), randn(rng, (9, 40, 4))
    dout, grads = forward_and_backward(q, k, v, **options)
    assert_grads_accurate(grads, dout, q, k, v, **options)


def test_key_ranges_only_where_pieces_are_few():
    """One head of 1100 keys: three ranges on tile boundaries; two pieces: two ranges; four or more, or keys for
    one tile, or gradients of score_mod's tables: one range."""
    q, k, v = (np.zeros(shape, np.float32) for shape in ((700, 8), (1100, 8), (1100, 8)))
    problem = api.make_problem(np, q, k, v, None, False, None, None, None)[0]
    bc = blocked.BACKWARD_BC
    assert blocked.key_ranges(problem, None, 1, {}) == [(0, bc), (bc, 2 * bc), (2 * bc, 1100)]
    assert blocked.key_ranges(problem, None, 2, {}) == [(0, 2 * bc), (2 * bc, 1100)]
    assert blocked.key_ranges(problem, None, blocked.KEY_SPLIT_PIECES, {}) == [(0, 1100)]
    assert blocked.key_ranges(problem, None, 1, {0: None}) == [(0, 1100)]
    assert blocked.key_ranges(problem, (64, 64), 1, {}) == [(0, 1100)]


def test_workers_run_pieces_side_by_side_with_blas_on_one_thread():
    """Two pieces meet at a barrier (so they ran at once), each seeing OpenBLAS held to one thread, as are two
    pieces on the calling thread; its count is restored afterwards, and a piece's exception reaches the caller."""
    blas = workers.blas()
    if blas.set is None:
        pytest.skip("OpenBLAS's thread count is not reachable here")
    before = blas.get()
    barrier, seen = threading.Barrier(2, timeout=30), []

    def piece(_):
        barrier.wait()
        seen.append(blas.get())
    workers.run_all(piece, range(2), threads=2)
    assert seen == [1, 1] and blas.get() == before
    seen.clear()  # two pieces on the calling thread: BLAS on one thread too, so the bits are the threads' bits
    workers.run_all(lambda _: seen.append(blas.get()), range(2), threads=1)
    assert seen == [1, 1] and blas.get() == before

    def failing(x):
        if x == 1:
            raise ValueError("piece 1")
    with pytest.raises(ValueError, match="piece 1"):
        workers.run_all(failing, range(3), threads=2)
    assert blas.get() == before
    assert workers.consecutive_groups([(0, 1), (0, 2), (slice(0, 2), 3), (0, 4)], key=lambda x: x[0]) == [
        [(0, 1), (0, 2)], [(slice(0, 2), 3)], [(0, 4)]]


@pytest.mark.parametrize("shapes", [((0, 4), (5, 4), (5, 3)), ((4, 4), (0, 4), (0, 3)), ((4, 0), (5, 0), (5, 3)),
                                    ((0, 3, 4), (0, 5, 4), (0, 5, 2))])
def test_empty_sizes(shapes):
    """No queries, no keys, d = 0 (every score 0: P uniform, so dv is not 0) or an empty batch."""
    rng = np.random.default_rng(7)
    q, k, v = (randn(rng, shape) for shape in shapes)
    dout, grads = forward_and_backward(q, k, v)
    assert [grad.shape for grad in grads] == [x.shape for x in (q, k, v)]
    assert_grads_accurate(grads, dout, q, k, v)
    if 0 in q.shape[:-1] + k.shape[:-1]:  # nothing attends: every gradient is exactly 0
        assert all((grad == 0).all() for grad in grads)


def test_errors_say_what_was_wrong():
    rng = np.random.default_rng(8)
    q, k, v = randn(rng, (5, 4)), randn(rng, (6, 4)), randn(rng, (6, 3))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"dout has shape \(5, 4\) but the forward call's result has shape \(5, 3\)"):
        cuflash.attention_backward(np.zeros((5, 4), np.float32), q, k, v, out, lse)
    with pytest.raises(ValueError, match=r"lse has shape \(5, 1\) but the forward call's lse has shape \(5,\)"):
        cuflash.attention_backward(out, q, k, v, out, lse[:, None])
    with pytest.raises(TypeError, match="out must be a real floating array"):
        cuflash.attention_backward(out, q, k, v, out.astype(np.int32), lse)
    with pytest.raises(ValueError, match="bias_grad=True asks for the gradient of the bias, but no bias= was given"):
        cuflash.attention_backward(out, q, k, v, out, lse, bias_grad=True)
    with pytest.raises(TypeError, match="bias_grad must be True or False"):
        cuflash.attention_backward(out, q, k, v, out, lse, bias_grad="yes")
