"""Named cases of the front door's semantics, each pinned on the NumPy backend (and reused by kernel backends
through the `backend` fixture where the file that imports them says so)."""

import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import cuflash
from harness import check_case
from reference import assert_accurate, attention_reference
from strategies import Case, randn

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(params=["numpy", "simt"])
def backend(request):
    return request.param


def test_result_is_exact_softmax_attention(backend):
    q, k, v = randn(0, (5, 4)), randn(1, (7, 4)), randn(2, (7, 3))
    s = q.astype(np.float64) @ k.T.astype(np.float64) / 2.0
    p = np.exp(s - s.max(axis=1, keepdims=True))
    expected = (p / p.sum(axis=1, keepdims=True)) @ v
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend=backend)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(axis=1)), rtol=1e-5)


@pytest.mark.parametrize("dtypes, expected", [
    ((np.float16,) * 3, np.float16), ((BF16,) * 3, BF16), ((np.float32,) * 3, np.float32),
    ((np.float64,) * 3, np.float64), ((np.float16, np.float32, np.float16), np.float32),
    ((np.float16, BF16, BF16), np.float32), ((BF16, np.float64, BF16), np.float64),
    ((np.int32,) * 3, np.float64), ((np.bool_, np.int8, np.int8), np.float64),
    ((np.float16, np.int8, np.float16), np.float16),
])
def test_dtype_promotion(backend, dtypes, expected):
    q, k, v = (randn(i, (3, 2)).astype(t) if t != np.bool_ else randn(0, (3, 2)) > 0 for i, t in enumerate(dtypes))
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend=backend)
    assert out.dtype == np.dtype(expected)
    assert lse.dtype == (np.float64 if np.dtype(expected) == np.float64 else np.float32)
    check_case(Case(q, k, v), backend=backend)


def test_empty_sizes(backend):
    q, k, v = randn(0, (0, 4)), randn(0, (6, 4)), randn(0, (6, 3))
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend=backend)
    assert out.shape == (0, 3) and lse.shape == (0,)
    out = cuflash.attention(randn(0, (0, 2, 5, 4)), randn(0, (1, 6, 4)), randn(0, (1, 6, 3)), backend=backend)
    assert out.shape == (0, 2, 5, 3)


def test_no_keys_gives_zeros_and_minus_inf(backend):
    out, lse = cuflash.attention(randn(0, (2, 5, 4)), randn(0, (2, 0, 4)), randn(0, (2, 0, 3)), return_lse=True,
                                 backend=backend)
    assert out.shape == (2, 5, 3)
    assert (out == 0).all() and np.isneginf(lse).all()


def test_zero_head_dim(backend):
    """d = 0: every score is 0, so each row is the mean of the visible values."""
    v = randn(0, (6, 3))
    out = cuflash.attention(np.zeros((4, 0), np.float32), np.zeros((6, 0), np.float32), v, backend=backend)
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=0), (4, 3)), rtol=1e-6)
    out = cuflash.attention(randn(0, (4, 2)), randn(0, (6, 2)), np.zeros((6, 0), np.float32), backend=backend)
    assert out.shape == (4, 0)


def test_fully_masked_rows_give_zero_and_minus_inf(backend):
    q, k, v = randn(0, (4, 8)), randn(0, (5, 8)), randn(0, (5, 2))
    mask = np.ones((4, 5), bool)
    mask[1] = False
    bias = np.zeros((4, 5), np.float32)
    bias[2] = -np.inf  # an additive -inf mask hides the row as well
    out, lse = cuflash.attention(q, k, v, mask=mask, bias=bias, return_lse=True, backend=backend)
    assert (out[1:3] == 0).all() and np.isneginf(lse[1:3]).all()
    assert_accurate(out, q, k, v, lse=lse, mask=mask, bias=bias)


def test_nan_in_hidden_keys_and_values_never_leaks(backend):
    """Future keys of a causal problem hold NaN and inf (an unfilled KV cache): no row may see them."""
    n, m = 6, 10
    q, k, v = randn(0, (n, 4)), randn(0, (m, 4)), randn(0, (m, 3))
    k[m - 2] = np.nan
    v[m - 2] = np.inf
    v[m - 1, 1] = np.nan
    mask = np.ones((n, m), bool)
    mask[:, 3] = False
    v[3] = np.nan
    out, lse = cuflash.attention(q, k, v, causal=True, mask=mask, return_lse=True, backend=backend)
    ref, ref_lse = attention_reference(q, k, v, causal=True, mask=mask)
    assert np.isnan(out).sum() == np.isnan(ref).sum() > 0  # the last rows see the NaN keys: those propagate
    assert np.isfinite(out[: n - 2]).all() and np.isfinite(lse[: n - 2]).all()
    check_case(Case(q, k, v, dict(causal=True, mask=mask)), backend=backend)


def test_nan_in_visible_input_propagates(backend):
    q, k, v = randn(0, (3, 4)), randn(0, (5, 4)), randn(0, (5, 2))
    q[1, 0] = np.nan
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend=backend)
    assert np.isnan(out[1]).all() and np.isnan(lse[1])
    assert_accurate(out, q, k, v, lse=lse)


@pytest.mark.parametrize("n, m", [(3, 8), (8, 3), (5, 5)])
def test_causal_is_bottom_right_aligned(backend, n, m):
    """Held to the reference given the visibility as an explicit mask, so the rule is stated here once more,
    apart from both the backends and the reference's own window code."""
    q, k, v = randn(0, (n, 4)), randn(0, (m, 4)), randn(0, (m, 2))
    i, j = np.arange(n)[:, None], np.arange(m)[None, :]
    out, lse = cuflash.attention(q, k, v, causal=True, backend=backend, return_lse=True)
    assert_accurate(out, q, k, v, lse=lse, mask=j <= i + (m - n))
    out, lse = cuflash.attention(q, k, v, window=(None, n - m), backend=backend, return_lse=True)
    assert_accurate(out, q, k, v, lse=lse, mask=j <= i)  # the top-left variant


def test_window_and_causal_intersect(backend):
    q, k, v = randn(0, (9, 4)), randn(0, (9, 4)), randn(0, (9, 2))
    i, j = np.arange(9)[:, None], np.arange(9)[None, :]
    out, lse = cuflash.attention(q, k, v, causal=True, window=(2, 5), backend=backend, return_lse=True)
    assert_accurate(out, q, k, v, lse=lse, mask=(j <= i) & (j >= i - 2))
    out, lse = cuflash.attention(q, k, v, causal=True, window=(4, -2), backend=backend, return_lse=True)
    assert_accurate(out, q, k, v, lse=lse, mask=(j <= i - 2) & (j >= i - 4))  # the window's right side is tighter


def test_grouped_query_attention_by_broadcasting(backend):
    """8 query heads share 2 key/value heads: k and v carry a size-1 axis and are never copied."""
    q = randn(0, (3, 2, 4, 7, 16))  # batch, kv groups, heads per group, n, d
    k, v = randn(1, (3, 2, 1, 11, 16)), randn(2, (3, 2, 1, 11, 8))
    out = cuflash.attention(q, k, v, backend=backend)
    assert out.shape == (3, 2, 4, 7, 8)
    k_heads = np.broadcast_to(k, q.shape[:3] + k.shape[-2:]).copy()  # each query head its own copy
    v_heads = np.broadcast_to(v, q.shape[:3] + v.shape[-2:]).copy()
    assert_accurate(out, q, k_heads, v_heads)


def test_key_padding_mask(backend):
    """A mask of shape (batch, 1, m) hides padded keys of each sequence."""
    q, k, v = randn(0, (2, 5, 4)), randn(0, (2, 6, 4)), randn(0, (2, 6, 3))
    lengths = np.array([6, 3])
    mask = (np.arange(6)[None, :] < lengths[:, None])[:, None, :]
    out = cuflash.attention(q, k, v, mask=mask, backend=backend)
    assert_accurate(out[1], q[1], k[1, :3], v[1, :3])  # the padded keys are as if absent
    assert_accurate(out, q, k, v, mask=mask)


def test_out_strided_and_cast(backend):
    q, k, v = randn(0, (2, 5, 4)), randn(0, (2, 6, 4)), randn(0, (2, 6, 3))
    big = np.full((2, 10, 6), np.nan, np.float64)
    out = big[:, ::2, ::2]
    result = cuflash.attention(q, k, v, out=out, backend=backend)
    assert result is out
    assert_accurate(out.astype(np.float32), q, k, v)  # computed in float32, then cast
    np.testing.assert_array_equal(out, out.astype(np.float32))
    assert np.isnan(big[:, 1::2]).all() and np.isnan(big[:, :, 1::2]).all()  # nothing written outside the view


def test_out_overlapping_an_input(backend):
    q, k, v = randn(0, (6, 3)), randn(1, (6, 3)), randn(2, (6, 3))
    q_before = q.copy()
    expected = cuflash.attention(q, k, v, backend=backend)
    result = cuflash.attention(q, k, v, out=q, backend=backend)
    assert result is q
    np.testing.assert_array_equal(q, expected)  # as if it did not overlap
    assert_accurate(q, q_before, k, v)


def test_lists_are_accepted_like_numpy(backend):
    out = cuflash.attention([[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [[1.0], [2.0]], backend=backend)
    assert out.dtype == np.float64 and out.shape == (1, 1)
    p = 1 / (1 + np.exp(-1 / np.sqrt(2)))  # softmax of the scores (1/sqrt(2), 0)
    np.testing.assert_allclose(out, [[p * 1.0 + (1 - p) * 2.0]], rtol=1e-14)


@pytest.mark.parametrize("working_set", [None, 8 * 2**20])
def test_working_set_is_bounded_far_below_the_score_matrix(monkeypatch, working_set):
    """n = m = 8192: the scores would take 256 MiB in float32; the NumPy backend's peak follows its working-set
    bound (64 MiB by default), not n * m."""
    from cuflash import blocked

    if working_set is not None:
        monkeypatch.setattr(blocked, "WORKING_SET_BYTES", working_set)
    bound = blocked.WORKING_SET_BYTES
    n, d = 8192, 16
    q, k, v = randn(0, (n, d)), randn(1, (n, d)), randn(2, (n, d))
    tracemalloc.start()
    out = cuflash.attention(q, k, v, causal=True, backend="numpy")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert out.shape == (n, d)
    assert peak < 1.5 * bound < n * n * 4 / 2, f"peak {peak / 2**20:.1f} MiB for a bound of {bound / 2**20:.0f} MiB"
    rows = np.r_[0:3, 1000:1003, 4095:4099, 8190:8192, np.random.default_rng(3).integers(0, n, 20)]
    causal = np.arange(n)[None, :] <= rows[:, None]  # these rows of the causal problem, as a mask
    assert_accurate(out[rows], q[rows], k, v, mask=causal)


def test_broadcast_operands_stay_views():
    """The Problem holds stride-0 views of broadcast operands, never copies."""
    from cuflash.api import broadcast_pair

    mask = np.ones((1, 7), bool)
    view = broadcast_pair(mask, (4, 3), 5, 7, np)
    assert view.shape == (4, 3, 5, 7) and view.strides[:3] == (0, 0, 0) and np.shares_memory(view, mask)


def test_numpy_backend_takes_a_block_config():
    q, k, v = randn(0, (9, 4)), randn(1, (13, 4)), randn(2, (13, 2))
    out = cuflash.attention(q, k, v, backend="numpy", block=cuflash.BlockConfig(4, 8), causal=True)
    assert_accurate(out, q, k, v, causal=True)
