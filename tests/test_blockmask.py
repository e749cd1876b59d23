"""Block masks: the tile lists against the dense pattern, re-tiling, reuse across calls, and attention through them
on every backend (forward and backward) against the same pattern as a dense mask."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import blocked, blockmask, mods

from harness import run_under_memcheck
from reference import assert_accurate, assert_grads_accurate

BACKENDS = ["numpy", "simt"]


def dense_kinds(dense, br, bc):
    """The tile kinds of a dense (*batch, n, m) pattern, written out tile by tile."""
    n, m = dense.shape[-2:]
    rows, cols = -(-n // br), -(-m // bc)
    kinds = np.zeros(dense.shape[:-2] + (rows, cols), dtype=np.int8)
    for entry in np.ndindex(*dense.shape[:-2]):
        for t in range(rows):
            for c in range(cols):
                tile = dense[entry][t * br:(t + 1) * br, c * bc:(c + 1) * bc]
                kinds[entry + (t, c)] = 2 if tile.all() else 1 if tile.any() else 0
    return kinds


def documents_case(seed, batch=2, n=70, m=70):
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.integers(0, 4, (batch, max(n, m))), axis=1)
    dense = ids[:, :n, None] == ids[:, None, :m]
    return ids, dense


@settings(max_examples=30)
@given(st.integers(0, 2**16), st.integers(1, 80), st.integers(1, 80), st.sampled_from([(8, 8), (16, 32), (7, 5)]))
def test_tile_lists_match_the_dense_pattern(seed, n, m, block):
    ids, dense = documents_case(seed, n=n, m=m)
    made = cuflash.block_mask(mods.documents(ids[:, :n], ids[:, :m]), (2, 3), n, m, block=block)
    assert made.shape == (2, 1, n, m)  # the head axis is not read: shared
    kinds = dense_kinds(dense[:, None], *block)
    np.testing.assert_array_equal(made.kinds, kinds)
    np.testing.assert_array_equal(cuflash.block_mask(mask=dense[:, None], block=block).kinds, kinds)
    for entry in np.ndindex(2, 1):
        for t in range(kinds.shape[-2]):
            partial = np.flatnonzero(kinds[entry][t] == 1)
            full = np.flatnonzero(kinds[entry][t] == 2)
            assert made.kv_num_blocks[entry][t] == len(partial)
            assert made.full_kv_num_blocks[entry][t] == len(full)
            np.testing.assert_array_equal(made.kv_indices[entry][t][:len(partial)], partial)
            np.testing.assert_array_equal(made.full_kv_indices[entry][t][:len(full)], full)
        for c in range(kinds.shape[-1]):  # the transposed lists: each key tile's query tiles
            np.testing.assert_array_equal(made.q_indices[entry][c][:made.q_num_blocks[entry][c]],
                                          np.flatnonzero(kinds[entry][:, c] == 1))
            np.testing.assert_array_equal(made.full_q_indices[entry][c][:made.full_q_num_blocks[entry][c]],
                                          np.flatnonzero(kinds[entry][:, c] == 2))
    assert made.density == pytest.approx((kinds != 0).mean())
    np.testing.assert_array_equal(made.to_dense(), kinds != 0)


@pytest.mark.parametrize("new", [(4, 8), (16, 16), (32, 8), (8, 32), (16, 32)])
def test_retiling_never_misreads_a_tile(new):
    """Coarser tiles (each made of whole old ones) come out exactly as a mask made for them; finer tiles take
    their old tile's kind, so one called hidden or full is hidden or full, and a partial one is evaluated."""
    _, dense = documents_case(3, n=61, m=75)
    made = cuflash.block_mask(mask=dense, block=(8, 16))
    retiled, exact = made.retile(*new), dense_kinds(dense, *new)
    assert retiled.block == new and retiled.kinds.shape == exact.shape
    decided = retiled.kinds != blockmask.PARTIAL
    np.testing.assert_array_equal(retiled.kinds[decided], exact[decided])
    if new[0] % 8 == 0 and new[1] % 16 == 0:
        np.testing.assert_array_equal(retiled.kinds, exact)


@settings(max_examples=30)
@given(st.integers(0, 2**16), st.integers(1, 70), st.integers(1, 70), st.integers(1, 24), st.integers(1, 24),
       st.integers(1, 40), st.integers(1, 40))
def test_covering_any_tiles_never_hides_or_fills_wrongly(seed, n, m, br, bc, new_br, new_bc):
    """Tiles of any size over a block mask's: one called hidden (full) is hidden (full) in the dense pattern, and
    the kernels' visit lists (both directions) hold exactly the tiles not hidden, ascending, each with its kind."""
    _, dense = documents_case(seed, n=n, m=m)
    covered = cuflash.block_mask(mask=dense, block=(br, bc)).covering(new_br, new_bc)
    exact = dense_kinds(dense, new_br, new_bc)
    assert covered.kinds.shape == exact.shape
    decided = covered.kinds != blockmask.PARTIAL
    np.testing.assert_array_equal(covered.kinds[decided], exact[decided])
    for keys_own in (False, True):
        count, entries, owned = covered.visits(new_br, new_bc, keys_own)
        kinds = np.swapaxes(covered.kinds, -1, -2) if keys_own else covered.kinds
        assert owned == kinds.shape[-2]
        for row, tile_kinds in enumerate(kinds.reshape(-1, kinds.shape[-1])):
            shown = np.flatnonzero(tile_kinds)
            assert count[row] == len(shown)
            np.testing.assert_array_equal(entries[row, :len(shown)], 2 * shown + (tile_kinds[shown] == 2))


def test_a_mask_that_cannot_be_retiled_is_refused():
    made = cuflash.block_mask(mods.causal, (), 64, 64, block=(16, 16))
    with pytest.raises(ValueError, match=r"cannot be re-tiled to \(24, 16\)"):
        made.retile(24, 16)


def test_repr_draws_the_first_entry():
    made = cuflash.block_mask(mods.causal, (), 32, 32, block=(8, 8))
    text = repr(made)
    assert text.splitlines()[0] == ("BlockMask(shape=(32, 32), block=(8, 8), density=62.5%: tiles full 6, "
                                    "partial 4, hidden 6)")
    assert text.splitlines()[1:] == ["░   ", "█░  ", "██░ ", "███░"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["block_mask", "block_mask_of_mask", "mask_mod", "retiled"])
def test_attention_through_a_block_mask_matches_the_dense_mask(backend, how):
    ids, dense = documents_case(5, n=70, m=70)
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 3, 70, 8)) for _ in range(3))
    pattern = mods.documents(ids)
    options = {
        "block_mask": dict(block_mask=cuflash.block_mask(pattern, (2, 3), 70, 70, block=(16, 16))),
        "block_mask_of_mask": dict(block_mask=cuflash.block_mask(mask=dense[:, None], block=(16, 32))),
        "mask_mod": dict(mask_mod=pattern),
        "retiled": dict(block_mask=cuflash.block_mask(pattern, (2, 3), 70, 70, block=(16, 16)), block=(32, 8)),
    }[how]
    if backend != "numpy":
        options.pop("block", None)
    out = np.full((2, 3, 70, 8), np.nan)
    got, lse = cuflash.attention(q, k, v, causal=True, out=out, return_lse=True, backend=backend, **options)
    expected, expected_lse = cuflash.attention(q, k, v, causal=True, mask=dense[:, None], return_lse=True)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-12, atol=1e-12)
    dout = rng.standard_normal(got.shape)
    grads = cuflash.attention_backward(dout, q, k, v, got, lse, causal=True, backend=backend, **options)
    expected_grads = cuflash.attention_backward(dout, q, k, v, expected, expected_lse, causal=True,
                                                mask=dense[:, None])
    for g, e in zip(grads, expected_grads):
        np.testing.assert_allclose(g, e, rtol=1e-11, atol=1e-11)


def test_hidden_tiles_are_never_computed(monkeypatch):
    """A key tile the block mask hides is never reached: NaN keys there leave the result as the dense mask's,
    and the scores are computed for the shown tiles' keys only."""
    ids, dense = documents_case(6, n=64, m=64)
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((2, 64, 8)) for _ in range(3))
    made = cuflash.block_mask(mods.documents(ids), (2,), 64, 64, block=(16, 16))
    seen = []
    real = blocked.tile_scores

    def counting(problem, patterns, index, q_i, i0, i1, j0, j1, *args, **kwargs):
        seen.append((index, i0, i1, j0, j1))
        return real(problem, patterns, index, q_i, i0, i1, j0, j1, *args, **kwargs)
    monkeypatch.setattr(blocked, "tile_scores", counting)
    cuflash.attention(q, k, v, block_mask=made)
    keys = sum((i1 - i0) * (j1 - j0) for _, i0, i1, j0, j1 in seen)
    assert keys == 16 * 16 * int(made.to_dense().sum())


KERNEL_BLOCKS = {  # the simt kernels a block mask's visits run through, on tiles of 32 x 32
    "float16": cuflash.BlockConfig(32, 32, 2, 2, "mma"),  # fwd_mma, bwd_mma_dq, bwd_mma_dkdv
    "float32": cuflash.BlockConfig(32, 32, 4),  # fwd, bwd_dq, bwd_dkdv
}


@pytest.mark.parametrize("dtype", sorted(KERNEL_BLOCKS))
def test_the_kernels_visit_only_the_tiles_a_block_mask_shows(dtype):
    """A block mask that hides more tiles than its mask_mod does and calls a partial tile whole (lies the kernels
    cannot see through): the kernels' forward and backward equal attention with those tiles hidden, so they never
    computed them, and with the whole tile's pairs all shown, so they never evaluated mask_mod there; a tile's
    visits start where causal= starts its sweep."""
    ids, dense = documents_case(8, n=100, m=100)
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 2, 100, 16)).astype(dtype) for _ in range(3))
    pattern = mods.documents(ids)
    honest = cuflash.block_mask(pattern, (2, 2), 100, 100, block=(32, 32))
    kinds = honest.kinds.copy()
    for entry in np.ndindex(*kinds.shape[:-2]):
        shown, partial = np.argwhere(kinds[entry] != blockmask.HIDDEN), np.argwhere(kinds[entry] == blockmask.PARTIAL)
        kinds[entry][tuple(partial[-1])] = blockmask.FULL
        kinds[entry][tuple(shown[rng.integers(len(shown))])] = blockmask.HIDDEN
    lying = blockmask.BlockMask(kinds, honest.shape, honest.block, honest.mask_mod, function=honest.function)

    def elements(kind):
        return np.repeat(np.repeat(kind, 32, axis=-2), 32, axis=-1)[..., :100, :100]
    mask = (dense[:, None] | elements(kinds == blockmask.FULL)) & elements(kinds != blockmask.HIDDEN)
    options = dict(causal=True, backend="simt", block=KERNEL_BLOCKS[dtype])
    out = np.full(q.shape, np.nan, dtype)
    got, lse = cuflash.attention(q, k, v, block_mask=lying, out=out, return_lse=True, **options)
    assert_accurate(got, q, k, v, lse=lse, causal=True, mask=mask)
    dout = rng.standard_normal(q.shape).astype(dtype)
    grads = cuflash.attention_backward(dout, q, k, v, got, lse, block_mask=lying, **options)
    assert_grads_accurate(grads, dout, q, k, v, causal=True, mask=mask)


def test_a_mask_mod_alone_gets_one_block_mask_per_pattern_and_contents():
    blockmask._cache.clear()
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 40, 4)) for _ in range(3))
    ids = np.zeros(40, np.int64)
    pattern = mods.documents(ids)
    cuflash.attention(q, k, v, mask_mod=pattern)
    cuflash.attention(q, k, v, mask_mod=pattern)
    assert len(blockmask._cache) == 1
    ids[20:] = 1  # new contents: a new block mask, and the right result
    out = cuflash.attention(q, k, v, mask_mod=pattern)
    assert len(blockmask._cache) == 2
    np.testing.assert_allclose(out, cuflash.attention(q, k, v, mask=ids[:, None] == ids[None, :]), atol=1e-12)


def test_a_block_mask_for_another_call_is_a_clear_error():
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 3, 16, 4)) for _ in range(3))
    made = cuflash.block_mask(mods.causal, (2, 3), 16, 16)
    with pytest.raises(ValueError, match="made for n = 16, m = 16, not n = 8, m = 16"):
        cuflash.attention(q[..., :8, :], k, v, block_mask=made)
    with pytest.raises(ValueError, match=r"batch shape \(2, 1\) does not broadcast to the call's \(3, 3\)"):
        other = cuflash.block_mask(lambda b, h, i, j: b >= 0, (2, 3), 16, 16)
        cuflash.attention(np.concatenate([q, q[:1]]), np.concatenate([k, k[:1]]), np.concatenate([v, v[:1]]),
                          block_mask=other)
    with pytest.raises(ValueError, match="made from another mask_mod"):
        cuflash.attention(q, k, v, block_mask=made, mask_mod=lambda b, h, i, j: j <= i)
    with pytest.raises(ValueError, match="made from another mask than mask="):
        cuflash.attention(q, k, v, block_mask=cuflash.block_mask(mask=np.tri(16, dtype=bool)),
                          mask=np.tri(16, dtype=bool))
    with pytest.raises(TypeError, match="block_mask must be a cuflash.BlockMask"):
        cuflash.attention(q, k, v, block_mask=np.ones((16, 16), bool))
    with pytest.raises(ValueError, match="give a mask_mod or mask="):
        cuflash.block_mask()
    with pytest.raises(ValueError, match=r"block must be a pair \(Br, Bc\) of positive ints"):
        cuflash.block_mask(mods.causal, (), 8, 8, block=(0, 8))


@pytest.mark.memcheck
def test_patterns_in_the_kernels_under_address_sanitizer():
    """The kernels with mods, sinks and a block mask's visits in the emulator's memcheck mode (memcheck_cases.py
    case_patterns): any out-of-bounds global or shared access aborts, a mod's read past its array included."""
    result = run_under_memcheck("patterns")
    assert result.returncode == 0 and "memcheck ok" in result.stdout, result.stderr[-4000:]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_split_keys_visit_their_share_of_a_block_masks_tiles(dtype):
    """Decoding (few queries, many keys): the key splits each walk the shown tiles of their share, and the sinks
    join once (split 0), against the numpy backend's result through the same block mask."""
    rng = np.random.default_rng(14)
    q = rng.standard_normal((2, 3, 4, 32)).astype(dtype)
    k, v = (rng.standard_normal((2, 1, 1500, 32)).astype(dtype) for _ in range(2))
    ids = np.sort(rng.integers(0, 6, 1500))
    made = cuflash.block_mask(lambda b, h, i, j: (ids[j] % 2 == 0) | (j > 1400), (1, 1), 4, 1500, block=(16, 64))
    sinks = rng.standard_normal(3).astype(np.float32)
    options = dict(block_mask=made, sinks=sinks, causal=True, return_lse=True)
    out, lse = cuflash.attention(q, k, v, backend="simt", **options)
    expected, expected_lse = cuflash.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                               **options)
    tolerance = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(out, expected, atol=tolerance)
    np.testing.assert_allclose(lse, expected_lse, atol=1e-5)
