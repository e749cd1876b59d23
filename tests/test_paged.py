"""attention_paged: a paged KV cache of drawn page sizes (1 and up), permuted page tables with unused entries past
each sequence's keys, empty caches, in-place appends of new keys, grouped-query heads, windows, mods and sinks,
forced key splits, on every backend; each sequence held to the float64 reference run on its keys gathered by hand;
NaN-poisoned outputs; bad tables, lengths, caches and new rows as clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
import cuflash.simt
from cuflash import BlockConfig
from harness import run_under_memcheck
from reference import assert_accurate
from strategies import randn
from test_mods import dense_reference

SIMT = pytest.mark.skipif(not cuflash.simt.available(), reason="the SIMT emulator needs g++")
BACKENDS = ["numpy", pytest.param("simt", marks=SIMT)]
HEADS = ((1, 1), (2, 1), (4, 2), (3, 3))  # (H, Hk)
UNUSED = -7  # table entries past a sequence's keys: never read, so never checked


@st.composite
def caches(draw):
    """(page size, keys cached per sequence, new rows, queries): the shapes serving takes."""
    kind = draw(st.sampled_from(["mixed", "empty", "decode", "one_long", "appending"]))
    size = draw(st.sampled_from([1, 2, 3, 5, 8, 16]))
    count = draw(st.integers(1, 3))
    cached = draw(st.lists(st.integers(0, 20), min_size=count, max_size=count))
    new = draw(st.integers(0, 3))
    queries = draw(st.integers(1, 4))
    if kind == "empty":
        cached[0] = 0
    elif kind == "decode":
        queries, new = 1, draw(st.integers(0, 1))
    elif kind == "one_long":
        cached[draw(st.integers(0, count - 1))] = draw(st.integers(40, 70))
    elif kind == "appending":
        queries = new = draw(st.integers(1, 5))
    return size, cached, new, queries


def paged_case(seed, size, cached, new, queries, heads, d, e, dtype, spare=2):
    """(q, k_cache, v_cache, block_table, cache_seqlens, k_new, v_new): each sequence's pages drawn at random
    from a shared pool (in any order), `spare` unused table entries past its keys."""
    rng = np.random.default_rng(seed)
    h, hk = heads
    needed = [-(-(c + new) // size) for c in cached]
    width = max(needed) + spare
    pool = rng.permutation(sum(needed) + 3)  # more pages than the sequences use
    table = np.full((len(cached), width), UNUSED, np.int64)
    start = 0
    for b, count in enumerate(needed):
        table[b, :count] = pool[start:start + count]
        start += count
    pages = len(pool)
    k_cache, v_cache = randn(rng, (pages, size, hk, d), dtype), randn(rng, (pages, size, hk, e), dtype)
    q = randn(rng, (len(cached), queries, h, d), dtype)
    k_new, v_new = (randn(rng, (len(cached), new, hk, x), dtype) for x in (d, e))
    return q, k_cache, v_cache, table, np.array(cached), k_new, v_new


def gathered(cache, table, b, m):
    """Sequence b's first m rows of a cache, by hand: (m, Hk, cols)."""
    size = cache.shape[1]
    j = np.arange(m)
    return cache[table[b, j // size], j % size]


def grouped(q_b, groups):
    """A sequence's queries (n, H, d) as attention's (Hk, G, n, d)."""
    n, h = q_b.shape[:2]
    return q_b.reshape(n, h // groups, groups, -1).transpose(1, 2, 0, 3)


def keys_of(rows):
    """(m, Hk, cols) as attention's (Hk, 1, m, cols), shared by the group."""
    return rows.transpose(1, 0, 2)[:, None]


def run(backend, q, k_cache, v_cache, table, cached, k_new=None, v_new=None, **options):
    out = np.full(q.shape[:3] + v_cache.shape[3:], np.nan, q.dtype)
    result, lse = cuflash.attention_paged(q, k_cache, v_cache, table, cached, k_new=k_new, v_new=v_new, out=out,
                                          return_lse=True, backend=backend, **options)
    assert result is out
    return out, lse


def block_for(backend, dtype):
    if backend != "simt":
        return {}
    return {"block": BlockConfig.mma(16, 16, 1)} if dtype == np.float16 else \
        {"block": BlockConfig(16, 16, 2), "precision": "fma"}


@given(caches(), st.sampled_from(HEADS), st.sampled_from([np.float16, np.float32, np.float64]),
       st.sampled_from([None, (None, 0), (4, 1), (0, None)]), st.booleans(), st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_sequence_attends_to_its_pages(backend, shape, heads, dtype, window, append, seed):
    """Every sequence's queries see its cached keys and the new ones (written into their pages first, in place,
    and nothing else touched), causal and windows aligned bottom-right with its keys; against the float64
    reference on the keys gathered by hand; every row written."""
    size, cached, new, queries = shape
    q, k_cache, v_cache, table, lengths, k_new, v_new = paged_case(seed, size, cached, new, queries, heads, 16, 8,
                                                                   dtype)
    before = k_cache.copy(), v_cache.copy()
    if not append:
        k_new = v_new = None
        new = 0
    out, lse = run(backend, q, k_cache, v_cache, table, lengths, k_new, v_new, window=window,
                   **block_for(backend, dtype))
    assert lse.shape == q.shape[:3] and lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    groups = heads[0] // heads[1]
    written = np.zeros(k_cache.shape[:2], bool)
    for b, c in enumerate(cached):
        if new:
            np.testing.assert_array_equal(gathered(k_cache, table, b, c + new)[c:], k_new[b])
            np.testing.assert_array_equal(gathered(v_cache, table, b, c + new)[c:], v_new[b])
            j = np.arange(c, c + new)
            written[table[b, j // size], j % size] = True
        m = c + new
        assert_accurate(grouped(out[b], groups), grouped(q[b], groups), keys_of(gathered(k_cache, table, b, m)),
                        keys_of(gathered(v_cache, table, b, m)), lse=grouped(lse[b][..., None], groups)[..., 0],
                        window=window)
    np.testing.assert_array_equal(k_cache[~written], before[0][~written])  # only the new rows' slots changed
    np.testing.assert_array_equal(v_cache[~written], before[1][~written])


def paged_mods(heads, sequences):
    """A score_mod and a mask_mod reading the sequence, the query head and the positions, and the same
    formulas as attention's (hk, g) batch indices see them for sequence b alone."""
    groups = heads[0] // heads[1]
    slopes = np.linspace(0.1, 0.9, heads[0])
    bonus = np.linspace(-1.0, 1.0, sequences)

    def score_mod(score, b, h, i, j):
        return score - slopes[h] * np.abs(i - j) * 0.25 + bonus[b]

    def mask_mod(b, h, i, j):
        return ((i + j + h + b) % 4 != 1) | (j == 0)

    def of_sequence(b):
        return (lambda score, hk, g, i, j: score_mod(score, b, hk * groups + g, i, j),
                lambda hk, g, i, j: mask_mod(b, hk * groups + g, i, j))
    return score_mod, mask_mod, of_sequence


@given(caches(), st.sampled_from(HEADS[1:]), st.booleans(), st.integers(0, 2**16))
@settings(max_examples=12, deadline=None)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mods_and_sinks_see_the_sequence_and_positions(backend, shape, heads, causal, seed):
    """score_mod(score, b, h, i, j) and mask_mod(b, h, i, j) (i the new query, j the key's position in its
    sequence) and sinks (H,) in every row's denominator: each sequence against the mods evaluated densely on its
    gathered keys, in float64."""
    size, cached, new, queries = shape
    q, k_cache, v_cache, table, lengths, k_new, v_new = paged_case(seed, size, cached, new, queries, heads, 8, 8,
                                                                   np.float64)
    score_mod, mask_mod, of_sequence = paged_mods(heads, len(cached))
    sinks = randn(seed + 2, (heads[0],), np.float64)
    out, lse = run(backend, q, k_cache, v_cache, table, lengths, k_new, v_new, score_mod=score_mod,
                   mask_mod=mask_mod, sinks=sinks, causal=causal)
    groups = heads[0] // heads[1]
    for b, c in enumerate(cached):
        m = c + new
        score_b, mask_b = of_sequence(b)
        ref_out, ref_lse = dense_reference(grouped(q[b], groups), keys_of(gathered(k_cache, table, b, m)),
                                           keys_of(gathered(v_cache, table, b, m)), score_mod=score_b,
                                           mask_mod=mask_b, sinks=sinks.reshape(heads[1], groups), causal=causal)
        np.testing.assert_allclose(grouped(out[b], groups), ref_out, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(grouped(lse[b][..., None], groups)[..., 0], ref_lse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoding_splits_the_keys_and_merges_them(backend):
    """One new query over long caches (the decoding shape): the planner's own kernel and key splits (and forced
    ones, num_splits), each sequence's keys split across blocks and merged by their lse, sequences of different
    lengths (a split past a short sequence's keys sees nothing), pages of 16 rows in any order."""
    rng = np.random.default_rng(3)
    q, k_cache, v_cache, table, lengths, k_new, v_new = paged_case(11, 16, [1100, 37, 0], 1, 1, (4, 2), 64, 64,
                                                                   np.float16, spare=0)
    reference = None
    for splits in (None, 1, 3):
        out, lse = run(backend, q, k_cache, v_cache, table, lengths + (splits is not None), num_splits=splits,
                       k_new=k_new if splits is None else None, v_new=v_new if splits is None else None)
        for b, c in enumerate(lengths):
            m = c + 1
            assert_accurate(grouped(out[b], 2), grouped(q[b], 2), keys_of(gathered(k_cache, table, b, m)),
                            keys_of(gathered(v_cache, table, b, m)), lse=grouped(lse[b][..., None], 2)[..., 0])
        reference = out if reference is None else reference
        np.testing.assert_allclose(out, reference, atol=2e-3)
    del rng


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_into_pages_on_the_planners_tiles(backend):
    """Many new queries appended to caches (a prefill): the planner's tensor-core kernel walks pages of 8 rows
    (smaller than its key tiles) and of 64, causal; and without a mask over longer caches, whose full tiles run in
    its steady loop: through the general copy, row by row, for pages of 8, through the chunk loaders, a tile from
    its page at a time, for pages of 128 (whole tiles)."""
    for size, cached, causal in ((8, [30, 0], True), (64, [30, 0], True), (8, [300, 5], False),
                                 (128, [300, 5], False)):
        q, k_cache, v_cache, table, lengths, k_new, v_new = paged_case(5, size, cached, 130, 130, (4, 2), 64, 64,
                                                                       np.float16)
        out, lse = run(backend, q, k_cache, v_cache, table, lengths, k_new, v_new, causal=causal)
        for b, c in enumerate(lengths):
            m = c + 130
            assert_accurate(grouped(out[b], 2), grouped(q[b], 2), keys_of(gathered(k_cache, table, b, m)),
                            keys_of(gathered(v_cache, table, b, m)), lse=grouped(lse[b][..., None], 2)[..., 0],
                            causal=causal)


def test_a_decoding_loop_matches_attention_over_the_whole_history():
    """Token by token: each step appends one key and value to its pages and attends; the outputs equal
    attention over the contiguous history, and the lse merges with another key set's by cuflash.merge."""
    rng = np.random.default_rng(9)
    steps, size, heads, d = 6, 4, (2, 1), 8
    k_cache, v_cache = np.zeros((5, size, 1, d)), np.zeros((5, size, 1, d))
    table = np.array([[4, 0, 3, 1, 2]])
    keys, values = randn(rng, (1, steps, 1, d), np.float64), randn(rng, (1, steps, 1, d), np.float64)
    for t in range(steps):
        q = randn(rng, (1, 1, 2, d), np.float64)
        out, lse = cuflash.attention_paged(q, k_cache, v_cache, table, [t], k_new=keys[:, t:t + 1],
                                           v_new=values[:, t:t + 1], return_lse=True)
        expected = cuflash.attention(q[0].transpose(1, 0, 2), keys[0, :t + 1].transpose(1, 0, 2),
                                     values[0, :t + 1].transpose(1, 0, 2))
        np.testing.assert_allclose(out[0].transpose(1, 0, 2), expected, rtol=1e-12, atol=1e-12)
    other_k, other_v = randn(rng, (2, 3, d), np.float64), randn(rng, (2, 3, d), np.float64)
    other, other_lse = cuflash.attention(q[0].transpose(1, 0, 2), other_k, other_v, return_lse=True)
    merged, _ = cuflash.merge([out[0].transpose(1, 0, 2), other], [lse[0].T, other_lse])
    whole = cuflash.attention(q[0].transpose(1, 0, 2), np.concatenate([np.repeat(keys[0].transpose(1, 0, 2), 2, 0),
                                                                       other_k], axis=1),
                              np.concatenate([np.repeat(values[0].transpose(1, 0, 2), 2, 0), other_v], axis=1))
    np.testing.assert_allclose(merged, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_keys_anywhere_and_no_queries(backend):
    """Every cache empty: rows see nothing (0, lse -inf; with a sink, lse is the sink). No queries, or no
    sequences: empty results."""
    q, k_cache, v_cache = np.ones((2, 3, 2, 8)), np.ones((4, 2, 1, 8)), np.ones((4, 2, 1, 4))
    table = np.zeros((2, 1), np.int64)
    out, lse = cuflash.attention_paged(q, k_cache, v_cache, table, [0, 0], return_lse=True, backend=backend)
    assert not out.any() and (lse == -np.inf).all()
    out, lse = cuflash.attention_paged(q, k_cache, v_cache, table, [0, 0], sinks=np.array([0.5, -1.0]),
                                       return_lse=True, backend=backend)
    assert not out.any() and (lse == np.array([0.5, -1.0])).all()
    out = cuflash.attention_paged(q[:, :0], k_cache, v_cache, table, [1, 2], backend=backend)
    assert out.shape == (2, 0, 2, 4)
    out = cuflash.attention_paged(q[:0], k_cache, v_cache, table[:0], [], backend=backend)
    assert out.shape == (0, 3, 2, 4)


def test_strided_caches_and_out_cast():
    """Caches that are views (every other head of a wider cache) are read and written in place; out= of another
    float dtype gets the result cast."""
    q, k_cache, v_cache, table, lengths, k_new, v_new = paged_case(4, 4, [5, 9], 2, 2, (2, 1), 8, 8, np.float32)
    wide_k = np.zeros(k_cache.shape[:2] + (2, 8), np.float32)
    wide_k[:, :, ::2] = k_cache
    expected = cuflash.attention_paged(q, k_cache.copy(), v_cache.copy(), table, lengths, k_new=k_new, v_new=v_new)
    out = np.full(expected.shape, np.nan, np.float64)
    result = cuflash.attention_paged(q, wide_k[:, :, ::2], v_cache, table, lengths, k_new=k_new, v_new=v_new,
                                     out=out)
    assert result is out
    np.testing.assert_array_equal(out, expected.astype(np.float64))
    np.testing.assert_array_equal(gathered(wide_k[:, :, ::2], table, 1, 11)[9:], k_new[1])


@pytest.mark.memcheck
@SIMT
def test_packed_and_paged_kernels_under_address_sanitizer():
    """Packed sequences (forward and backward) and paged caches (short last pages, an empty cache, split keys) in
    the emulator's memcheck mode (memcheck_cases.py case_sequences): no read or write outside an array, a page's
    rows included."""
    result = run_under_memcheck("sequences")
    assert result.returncode == 0 and "memcheck ok" in result.stdout, result.stderr[-4000:]


Q, KC, VC = np.zeros((2, 1, 4, 8)), np.zeros((6, 4, 2, 8)), np.zeros((6, 4, 2, 4))
TABLE = np.array([[0, 1, -1], [5, 2, 3]])


@pytest.mark.parametrize("arguments, error, text", [
    (dict(block_table=[[0, 1, 6], [5, 2, 3]], cache_seqlens=[9, 3]), ValueError,
     r"block_table\[0, 2\] = 6 is not a page of the caches \(0 to 5\)"),
    (dict(block_table=[[0, -1, 1], [5, 2, 3]], cache_seqlens=[5, 3]), ValueError, r"block_table\[0, 1\] = -1"),
    (dict(cache_seqlens=[13, 3]), ValueError, r"needs 13 keys .* block_table's 3 pages of 4 rows hold 12"),
    (dict(cache_seqlens=[-1, 3]), ValueError, "cache_seqlens must be 0 or more, got -1"),
    (dict(cache_seqlens=[1, 2, 3]), ValueError, r"cache_seqlens must be one int or 1-D \(B,\)"),
    (dict(cache_seqlens=[1.0, 2.0]), TypeError, "cache_seqlens must hold integers"),
    (dict(block_table=TABLE[:1]), ValueError, r"block_table must be 2-D \(B, max_pages\) with q's B = 2 rows"),
    (dict(block_table=TABLE.astype(float)), TypeError, "block_table must hold integers"),
    (dict(q=Q.astype(np.float32)), TypeError, "must share one dtype"),
    (dict(v_cache=VC[:, :3]), ValueError, "must have the same pages, page size and heads"),
    (dict(q=Q[..., :4]), ValueError, "q's head dim 4 differs from k_cache's 8"),
    (dict(q=Q[:, :, :3]), ValueError, "q's 3 heads must be a multiple of the caches' 2"),
    (dict(k_cache=KC[0]), ValueError, r"k_cache must be 4-D \(num_pages, page_size, Hk, d\)"),
    (dict(k_cache=KC.tolist()), TypeError, "k_cache must be a numpy.ndarray"),
    (dict(k_new=np.zeros((2, 1, 2, 8))), ValueError, "give both k_new and v_new, or neither"),
    (dict(k_new=np.zeros((2, 1, 2, 8)), v_new=np.zeros((2, 1, 2, 8))), ValueError,
     r"v_new must be \(B, n_new, Hk, e\)"),
    (dict(k_new=np.zeros((2, 1, 2, 8), np.complex128), v_new=np.zeros((2, 1, 2, 4))), TypeError,
     r"cannot write k_new of dtype\('complex128'\) into a cache"),
    (dict(num_splits=0), ValueError, "num_splits must be a positive int or None"),
    (dict(sinks=np.zeros(3)), ValueError, r"sinks of shape \(3,\) does not broadcast to \(sequences, H\)"),
])
def test_bad_arguments_are_clear_errors(arguments, error, text):
    given_ = dict(q=Q, k_cache=KC, v_cache=VC, block_table=TABLE, cache_seqlens=[3, 9])
    given_.update(arguments)
    positional = [given_.pop(name) for name in ("q", "k_cache", "v_cache", "block_table", "cache_seqlens")]
    with pytest.raises(error, match=text):
        cuflash.attention_paged(*positional, **given_)


def test_new_rows_are_written_only_into_writable_caches_and_never_before_the_checks():
    k_cache, v_cache = KC.copy(), VC.copy()
    k_new, v_new = np.ones((2, 1, 2, 8)), np.ones((2, 1, 2, 4))
    with pytest.raises(ValueError, match="block_table"):
        cuflash.attention_paged(Q, k_cache, v_cache, [[0, 1, 9], [5, 2, 3]], [8, 3], k_new=k_new, v_new=v_new)
    assert not k_cache.any() and not v_cache.any()  # a refused call writes nothing
    k_cache.flags.writeable = False
    with pytest.raises(ValueError, match="the caches are read-only"):
        cuflash.attention_paged(Q, k_cache, v_cache, TABLE, [3, 9], k_new=k_new, v_new=v_new)
