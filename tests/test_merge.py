"""cuflash.merge: attention over disjoint key sets, merged by the parts' logsumexps, equals attention over their
union (to the accuracy rule); associative and independent of the parts' order; parts that saw no key count
for nothing; errors say what was wrong."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from reference import assert_accurate
from strategies import cases, randn

OPTIONS = ("scale", "causal", "window", "mask", "bias")


def parts_of(case, owner, parts):
    """attention(return_lse) of the case over each part's keys: the case's mask and the part's keys, as a mask."""
    options = {key: case.options[key] for key in OPTIONS if key in case.options}
    n, m = case.q.shape[-2], case.k.shape[-2]
    base = options.pop("mask", None)
    results = []
    for part in range(parts):
        mask = np.broadcast_to(owner == part, (n, m))
        mask = mask if base is None else base & mask
        results.append(cuflash.attention(case.q, case.k, case.v, mask=mask, return_lse=True, **options))
    return results


@given(cases(lengths=(1, 7, 40), head_dims=(1, 8)), st.integers(1, 4), st.integers(0, 2**32 - 1))
@settings(max_examples=100)
def test_merged_parts_equal_attention_over_their_union(case, parts, seed):
    owner = np.random.default_rng(seed).integers(0, parts, size=case.k.shape[-2])  # each key's part
    results = parts_of(case, owner, parts)
    out, lse = cuflash.merge([o for o, _ in results], [l for _, l in results])
    options = {key: case.options[key] for key in OPTIONS if key in case.options}
    assert out.dtype == results[0][0].dtype and lse.dtype == results[0][1].dtype
    if out.dtype.itemsize > 2:
        assert_accurate(out, case.q, case.k, case.v, lse=lse, **options)
        return
    # 16-bit parts are each rounded already: merged in float32 they meet the rule; merged as they are, they
    # stay within one more rounding of that.
    exact, exact_lse = cuflash.merge([o.astype(np.float32) for o, _ in results], [l for _, l in results])
    assert_accurate(exact.astype(out.dtype), case.q, case.k, case.v, lse=exact_lse, **options)
    finite = np.isfinite(exact)
    np.testing.assert_array_equal(np.isnan(out.astype(np.float32)), np.isnan(exact))
    ulp = 2.0**-10 if out.dtype == np.float16 else 2.0**-7
    bound = 2 * ulp * max(1.0, float(np.abs(exact[finite]).max(initial=0)))
    assert np.abs(out.astype(np.float32)[finite] - exact[finite]).max(initial=0) <= bound


def test_associative_and_order_independent():
    rng = np.random.default_rng(1)
    q, k, v = randn(rng, (3, 20, 8)), randn(rng, (3, 60, 8), scale=4.0), randn(rng, (3, 60, 5))
    owner = rng.integers(0, 3, size=60)
    mask = np.stack([np.broadcast_to(owner == p, (20, 60)) for p in range(3)])
    parts = [cuflash.attention(q, k, v, mask=mask[p], return_lse=True) for p in range(3)]
    whole = cuflash.merge(*zip(*parts))
    left = cuflash.merge(*zip(cuflash.merge(*zip(*parts[:2])), parts[2]))
    right = cuflash.merge(*zip(parts[0], cuflash.merge(*zip(*parts[1:]))))
    for other in [left, right] + [cuflash.merge(*zip(*order)) for order in itertools.permutations(parts)]:
        np.testing.assert_allclose(other[0], whole[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(other[1], whole[1], rtol=1e-6, atol=1e-6)
    assert_accurate(whole[0], q, k, v, lse=whole[1])


def test_parts_that_saw_nothing_count_for_nothing():
    rng = np.random.default_rng(2)
    out_a, lse_a = randn(rng, (4, 3)), randn(rng, (4,))
    nothing = np.full((4, 3), np.nan, np.float32), np.full(4, -np.inf, np.float32)  # whatever its output holds
    out, lse = cuflash.merge([out_a, nothing[0]], [lse_a, nothing[1]])
    np.testing.assert_allclose(out, out_a, rtol=1e-6)
    np.testing.assert_allclose(lse, lse_a, rtol=1e-6)
    out, lse = cuflash.merge([nothing[0]] * 2, [nothing[1]] * 2)
    assert (out == 0).all() and np.isneginf(lse).all()
    # stacked parts, broadcast batch dims, float64 kept
    stacked = np.stack([randn(rng, (2, 1, 4, 3), np.float64)] * 2)
    out, lse = cuflash.merge(stacked, np.zeros((2, 2, 5, 4)))
    assert out.shape == (2, 5, 4, 3) and out.dtype == np.float64 and lse.dtype == np.float64
    np.testing.assert_allclose(lse, np.log(2))


def test_errors_say_what_was_wrong():
    with pytest.raises(ValueError, match="one lse per output"):
        cuflash.merge([np.zeros((2, 3))], [])
    with pytest.raises(ValueError, match="do not broadcast"):
        cuflash.merge([np.zeros((2, 3))], [np.zeros(5)])
    with pytest.raises(TypeError, match="real floating"):
        cuflash.merge([np.zeros((2, 3), np.int32)], [np.zeros(2)])
