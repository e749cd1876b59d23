"""attention_varlen and attention_varlen_backward: packed sequences of drawn lengths (empty ones, ones, one long
sequence, more queries than keys under causal=) with grouped-query heads, windows, mods and sinks, on every backend,
each sequence held to the float64 reference run on that sequence alone; NaN-poisoned outputs; bad offsets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
import cuflash.simt
from cuflash import BlockConfig
from reference import assert_accurate, assert_grads_accurate
from strategies import randn
from test_mods import dense_reference

SIMT = pytest.mark.skipif(not cuflash.simt.available(), reason="the SIMT emulator needs g++")
BACKENDS = ["numpy", pytest.param("simt", marks=SIMT)]
# The backward tests' instantiations (one per dtype for d, e <= 16): CUDA cores for float32 and float64 (precision
# "fma"), the tensor cores' smallest tiles for float16.
SMALL = BlockConfig(16, 16, 2)
SMALL_MMA = {"forward": BlockConfig.mma(16, 16, 1), "backward": BlockConfig.mma(16, 16, 1, stages=1)}
HEADS = ((1, 1), (2, 1), (4, 2), (3, 3))  # (H, Hk)


@st.composite
def lengths(draw, longest=40):
    """(queries, keys) per sequence, from one of the shapes packing takes."""
    kind = draw(st.sampled_from(["mixed", "empty", "ones", "one_long", "more_queries"]))
    count = draw(st.integers(1, 4))
    short = st.integers(0, 12)
    queries = draw(st.lists(short, min_size=count, max_size=count))
    keys = draw(st.lists(short, min_size=count, max_size=count))
    if kind == "empty":  # sequences without queries, or without keys
        queries[0] = 0
        keys[-1] = 0
    elif kind == "ones":  # one query per sequence (decoding)
        queries = [1] * count
    elif kind == "one_long":
        s = draw(st.integers(0, count - 1))
        queries[s], keys[s] = draw(st.integers(17, longest)), draw(st.integers(17, longest))
    elif kind == "more_queries":
        keys = [min(length, draw(st.integers(0, 5))) for length in queries]
        queries = [length + 3 for length in queries]
    return queries, keys


def offsets(lengths_):
    return np.concatenate([[0], np.cumsum(lengths_)]).astype(np.int64)


def packed(seed, queries, keys, heads, d, e, dtype):
    """(q, k, v, cu_seqlens_q, cu_seqlens_k) for these lengths, q (total_q, H, d), k and v (total_k, Hk, .)."""
    rng = np.random.default_rng(seed)
    h, hk = heads
    return (randn(rng, (sum(queries), h, d), dtype), randn(rng, (sum(keys), hk, d), dtype),
            randn(rng, (sum(keys), hk, e), dtype), offsets(queries), offsets(keys))


def sequence(x, cu, s, groups=None):
    """Sequence s of a packed array as attention's batched operand: queries (Hk, G, n, .) given groups, keys
    (Hk, 1, m, .) without."""
    rows = x[cu[s]:cu[s + 1]]
    if groups is None:
        return rows.transpose(1, 0, 2)[:, None]
    grouped = rows.reshape(rows.shape[0], rows.shape[1] // groups, groups, *rows.shape[2:])
    return grouped.transpose(1, 2, 0, *range(3, rows.ndim + 1))


def poisoned(shape, dtype):
    return np.full(shape, np.nan, dtype=dtype)


def run(backend, q, k, v, cu_q, cu_k, **options):
    out = poisoned(q.shape[:2] + v.shape[2:], q.dtype)
    result, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, out=out, return_lse=True, backend=backend, **options)
    assert result is out
    return out, lse


def block_for(backend, dtype, kind="forward"):
    if backend != "simt":
        return {}
    return {"block": SMALL_MMA[kind]} if dtype == np.float16 else {"block": SMALL, "precision": "fma"}


@given(lengths(), st.sampled_from(HEADS), st.sampled_from([np.float16, np.float32, np.float64]),
       st.sampled_from([None, (None, 0), (4, 2), (0, None)]), st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_sequence_is_attention_on_its_own(backend, shapes, heads, dtype, window, seed):
    """Every sequence's rows of out and lse are attention of its queries over its own keys (causal and windows
    aligned bottom-right within it), grouped-query heads reading their key head; every row written."""
    queries, keys = shapes
    q, k, v, cu_q, cu_k = packed(seed, queries, keys, heads, 16, 16, dtype)
    out, lse = run(backend, q, k, v, cu_q, cu_k, window=window, **block_for(backend, dtype))
    assert lse.shape == q.shape[:2] and lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    groups = heads[0] // heads[1]
    for s in range(len(queries)):
        if queries[s] == 0:
            continue
        assert_accurate(sequence(out, cu_q, s, groups), sequence(q, cu_q, s, groups), sequence(k, cu_k, s),
                        sequence(v, cu_k, s), lse=sequence(lse, cu_q, s, groups), window=window)


@given(lengths(), st.sampled_from(HEADS[1:]), st.sampled_from([np.float32, np.float64]), st.booleans(),
       st.integers(0, 2**16))
@settings(max_examples=15, deadline=None)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_are_each_sequences_own(backend, shapes, heads, dtype, causal, seed):
    """dq, dk, dv of each sequence against the float64 reference on that sequence (a key head's gradient the sum
    of its query heads'); poisoned nowhere: every gradient element is returned."""
    queries, keys = shapes
    q, k, v, cu_q, cu_k = packed(seed, queries, keys, heads, 16, 16, dtype)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
    dout = randn(seed + 1, out.shape, dtype)
    dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal,
                                                   backend=backend, **block_for(backend, dtype, "backward"))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dq.dtype == dtype
    groups = heads[0] // heads[1]
    for s in range(len(queries)):
        grads = (sequence(dq, cu_q, s, groups), sequence(dk, cu_k, s), sequence(dv, cu_k, s))
        if queries[s] == 0:
            assert not grads[1].any() and not grads[2].any()  # keys no query sees
            continue
        assert_grads_accurate(grads, sequence(dout, cu_q, s, groups), sequence(q, cu_q, s, groups),
                              sequence(k, cu_k, s), sequence(v, cu_k, s), causal=causal)


def mods_of(heads, sequences):
    """A score_mod and a mask_mod reading the sequence and the query head (their tables sized by the call), and
    the same formulas for one sequence as attention's (hk, g) batch indices see them."""
    groups = heads[0] // heads[1]
    slopes = np.linspace(0.1, 0.9, heads[0])
    bonus = np.linspace(-1.0, 1.0, sequences)

    def score_mod(score, s, h, i, j):
        return score - slopes[h] * np.abs(i - j) * 0.25 + bonus[s]

    def mask_mod(s, h, i, j):
        return ((i + j + h + s) % 4 != 1) | (j == 0)

    def of_sequence(s):
        return (lambda score, hk, g, i, j: score_mod(score, s, hk * groups + g, i, j),
                lambda hk, g, i, j: mask_mod(s, hk * groups + g, i, j))
    return score_mod, mask_mod, of_sequence


@given(lengths(longest=24), st.sampled_from(HEADS[1:]), st.booleans(), st.integers(0, 2**16))
@settings(max_examples=12, deadline=None)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mods_see_the_sequence_head_and_positions_inside_it(backend, shapes, heads, causal, seed):
    """score_mod(score, s, h, i, j) and mask_mod(s, h, i, j) with i, j inside sequence s, and sinks (H,) in every
    row's denominator: each sequence against the mods evaluated densely on it alone, in float64; the backward
    against attention_backward on that sequence alone."""
    queries, keys = shapes
    q, k, v, cu_q, cu_k = packed(seed, queries, keys, heads, 8, 8, np.float64)
    score_mod, mask_mod, of_sequence = mods_of(heads, len(queries))
    sinks = randn(seed + 2, (heads[0],), np.float64)
    options = dict(score_mod=score_mod, mask_mod=mask_mod, sinks=sinks, causal=causal)
    out, lse = run(backend, q, k, v, cu_q, cu_k, **options)
    dout = randn(seed + 1, out.shape, np.float64)
    dq, dk, dv, dsinks = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, backend=backend,
                                                           **options)
    groups = heads[0] // heads[1]
    expected_dsinks = np.zeros(heads[0])
    for s in range(len(queries)):
        q_s, k_s, v_s = sequence(q, cu_q, s, groups), sequence(k, cu_k, s), sequence(v, cu_k, s)
        score_s, mask_s = of_sequence(s)
        sinks_s = sinks.reshape(heads[1], groups)
        ref_out, ref_lse = dense_reference(q_s, k_s, v_s, score_mod=score_s, mask_mod=mask_s, sinks=sinks_s,
                                           causal=causal)
        np.testing.assert_allclose(sequence(out, cu_q, s, groups), ref_out, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(sequence(lse, cu_q, s, groups), ref_lse, rtol=1e-10, atol=1e-10)
        if queries[s] == 0:
            continue
        per_sequence = cuflash.attention_backward(
            sequence(dout, cu_q, s, groups), q_s, k_s, v_s, ref_out, ref_lse, score_mod=score_s, mask_mod=mask_s,
            sinks=sinks_s, causal=causal)
        for got, want in zip((sequence(dq, cu_q, s, groups), sequence(dk, cu_k, s), sequence(dv, cu_k, s)),
                             per_sequence):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
        expected_dsinks += per_sequence[3].reshape(-1)
    np.testing.assert_allclose(dsinks, expected_dsinks, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_sequences_on_the_planners_own_tiles(backend):
    """Sequences past the planner's tiles (128 query rows) beside short ones: its tensor-core kernels, causal."""
    queries, keys = [150, 3, 0, 131], [140, 5, 2, 200]
    q, k, v, cu_q, cu_k = packed(7, queries, keys, (4, 2), 64, 64, np.float16)
    out, lse = run(backend, q, k, v, cu_q, cu_k, causal=True)
    for s in range(len(queries)):
        if queries[s]:
            assert_accurate(sequence(out, cu_q, s, 2), sequence(q, cu_q, s, 2), sequence(k, cu_k, s),
                            sequence(v, cu_k, s), lse=sequence(lse, cu_q, s, 2), causal=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_sequences_and_no_rows(backend):
    """No sequences (cu_seqlens of one 0), and sequences that are all empty: empty results, nothing launched."""
    q, k, v = np.zeros((0, 2, 8)), np.zeros((0, 1, 8)), np.zeros((0, 1, 4))
    out, lse = cuflash.attention_varlen(q, k, v, [0], [0], return_lse=True, backend=backend)
    assert out.shape == (0, 2, 4) and lse.shape == (0, 2)
    out = cuflash.attention_varlen(q, k, v, [0, 0, 0], [0, 0, 0], backend=backend)
    assert out.shape == (0, 2, 4)
    grads = cuflash.attention_varlen_backward(out, q, k, v, out, lse, [0, 0, 0], [0, 0, 0], backend=backend)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_sinks_per_sequence_and_their_gradient_keeps_their_shape():
    queries, keys = [3, 5], [4, 6]
    q, k, v, cu_q, cu_k = packed(3, queries, keys, (2, 1), 8, 8, np.float64)
    sinks = randn(4, (2, 2), np.float64)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, sinks=sinks, return_lse=True)
    for s in range(2):
        ref_out, ref_lse = dense_reference(sequence(q, cu_q, s, 2), sequence(k, cu_k, s), sequence(v, cu_k, s),
                                           sinks=sinks[s].reshape(1, 2))
        np.testing.assert_allclose(sequence(out, cu_q, s, 2), ref_out, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(sequence(lse, cu_q, s, 2), ref_lse, rtol=1e-12, atol=1e-12)
    grads = cuflash.attention_varlen_backward(out, q, k, v, out, lse, cu_q, cu_k, sinks=sinks)
    assert grads[3].shape == sinks.shape


def test_the_max_lengths_only_size_the_launch():
    q, k, v, cu_q, cu_k = packed(5, [3, 7], [2, 9], (2, 2), 8, 8, np.float32)
    exact = cuflash.attention_varlen(q, k, v, cu_q, cu_k, backend="numpy")
    larger = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=20, max_seqlen_k=np.int64(30))
    np.testing.assert_array_equal(exact, larger)
    with pytest.raises(ValueError, match=r"max_seqlen_k=8 but a sequence has 9"):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_k=8)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int or None"):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=7.0)


def test_operands_keep_their_views_and_out_may_be_cast():
    """Strided packed arrays are read in place; out= of another float dtype gets the result cast."""
    q, k, v, cu_q, cu_k = packed(6, [4, 9], [5, 8], (4, 2), 8, 8, np.float32)
    wide = np.zeros(q.shape[:2] + (16,), np.float32)
    wide[..., ::2] = q
    expected = cuflash.attention_varlen(q, k, v, cu_q, cu_k)
    np.testing.assert_array_equal(cuflash.attention_varlen(wide[..., ::2], k, v, cu_q, cu_k), expected)
    out = np.full(expected.shape, np.nan, np.float64)
    assert cuflash.attention_varlen(q, k, v, cu_q, cu_k, out=out) is out
    np.testing.assert_array_equal(out, expected.astype(np.float64))


Q, K, V = np.zeros((9, 4, 8)), np.zeros((7, 2, 8)), np.zeros((7, 2, 8))


@pytest.mark.parametrize("cu_q, cu_k, error, text", [
    ([0, 4, 9.0], [0, 3, 7], TypeError, "cu_seqlens_q must hold integers"),
    ([0, 4, 9], np.array([0, 3, 7], bool), TypeError, "cu_seqlens_k must hold integers"),
    ([[0, 4, 9]], [0, 3, 7], ValueError, "cu_seqlens_q must be 1-D"),
    ([], [], ValueError, "must be 1-D with sequences \\+ 1 offsets"),
    ([0, 4, 9], [0, 7], ValueError, "cu_seqlens_q has 3 offsets and cu_seqlens_k 2"),
    ([1, 4, 9], [0, 3, 7], ValueError, "cu_seqlens_q must start at 0, got 1"),
    ([0, 5, 4, 9], [0, 3, 3, 7], ValueError, "cu_seqlens_q must be non-decreasing"),
    ([0, 4, 8], [0, 3, 7], ValueError, "cu_seqlens_q must end at the packed rows' count, 9 \\(q's rows\\), got 8"),
    ([0, 4, 9], [0, 3, 8], ValueError, "cu_seqlens_k must end at the packed rows' count, 7"),
])
def test_bad_offsets_are_clear_errors(cu_q, cu_k, error, text):
    with pytest.raises(error, match=text):
        cuflash.attention_varlen(Q, K, V, cu_q, cu_k)
    with pytest.raises(error, match=text):
        cuflash.attention_varlen_backward(Q, Q, K, V, Q, Q[..., 0], cu_q, cu_k)


@pytest.mark.parametrize("q, k, v, text", [
    (Q[0], K, V, r"q must be 3-D \(total_q, H, d\)"),
    (Q, K[:, :1], V, r"k \(7, 1, 8\) and v \(7, 2, 8\) must have the same keys and heads"),
    (Q[..., :4], K, V, "q's head dim 4 differs from k's 8"),
    (Q[:, :3], K, V, "q's 3 heads must be a multiple of k's and v's 2"),
])
def test_bad_shapes_are_clear_errors(q, k, v, text):
    with pytest.raises(ValueError, match=text):
        cuflash.attention_varlen(q, k, v, [0, 4, 9], [0, 3, 7])


def test_bad_sinks_out_and_saved_tensors_are_clear_errors():
    cu_q, cu_k = [0, 4, 9], [0, 3, 7]
    with pytest.raises(ValueError, match=r"sinks of shape \(3,\) does not broadcast to \(sequences, H\) = \(2, 4\)"):
        cuflash.attention_varlen(Q, K, V, cu_q, cu_k, sinks=np.zeros(3))
    with pytest.raises(ValueError, match=r"out has shape \(9, 4, 7\) but the result has shape \(9, 4, 8\)"):
        cuflash.attention_varlen(Q, K, V, cu_q, cu_k, out=np.zeros((9, 4, 7)))
    with pytest.raises(ValueError, match=r"lse has shape \(9,\) but the forward call's lse has shape \(9, 4\)"):
        cuflash.attention_varlen_backward(Q, Q, K, V, Q, Q[:, 0, 0], cu_q, cu_k)
    with pytest.raises(TypeError, match=r"score_mod must take 5 arguments \(score, s, h, i, j\)"):
        cuflash.attention_varlen(Q, K, V, cu_q, cu_k, score_mod=lambda score, b, i, j: score)
