"""The truth: naive, materialized attention in float64, written apart from every backend.

It follows the documented semantics directly: scores for every (query, key) pair, visibility as a boolean
matrix (the window, the mask, and a -inf bias, which hides its key as the mask does), softmax over the visible
keys of each row, and the weighted sum over those keys only (selection, so a NaN in a hidden key or value never
counts).
"""

from __future__ import annotations

import math

import numpy as np


def visibility(n, m, causal=False, window=None):
    """Boolean (n, m): key j visible to query i when i + (m - n) - left <= j <= i + (m - n) + right.
    Compared in Python's integers, so a side of any size (past int64 too) means what it says."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    vis = np.ones((n, m), dtype=bool)
    for i in range(n):
        row = i + (m - n)
        lo = 0 if left is None else min(max(row - left, 0), m)
        hi = m - 1 if right is None else min(max(row + right, -1), m - 1)
        vis[i, :lo] = False
        vis[i, hi + 1:] = False
    return vis


def visible_pairs(n, m, causal=False, window=None, mask=None, bias=None):
    """(*batch, n, m) booleans: the window, the mask, and a bias of -inf, which hides its key like the mask."""
    vis = visibility(n, m, causal, window)
    if mask is not None:
        vis = vis & np.asarray(mask, dtype=bool)
    if bias is not None:
        vis = vis & (np.asarray(bias).astype(np.float64) != -np.inf)
    return vis


def attention_reference(q, k, v, *, scale=None, causal=False, window=None, mask=None, bias=None):
    """(out, lse) in float64 for any broadcastable operands."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    n, d = q.shape[-2:]
    m, e = v.shape[-2:]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    vis = visible_pairs(n, m, causal, window, mask, bias)
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if bias is not None:
        scores = scores + np.asarray(bias).astype(np.float64)
    batch = np.broadcast_shapes(scores.shape[:-2], vis.shape[:-2], v.shape[:-2])
    scores = np.broadcast_to(scores, batch + (n, m))
    vis = np.broadcast_to(vis, batch + (n, m))
    v = np.broadcast_to(v, batch + (m, e))
    out = np.zeros(batch + (n, e))
    lse = np.full(batch + (n,), -np.inf)
    for b in np.ndindex(*batch):
        for i in range(n):
            keys = vis[b][i]
            s = scores[b][i][keys]
            if s.size == 0:
                continue
            top = s.max()
            if np.isnan(top) or np.isnan(s).any():
                out[b][i] = np.nan
                lse[b][i] = np.nan
                continue
            with np.errstate(invalid="ignore"):
                w = np.exp(s - top)
                out[b][i] = (w / w.sum()) @ v[b][keys]
                lse[b][i] = top + np.log(w.sum())
    return out, lse


def round_to(x, dtype):
    return np.asarray(x).astype(dtype).astype(np.float64 if dtype == np.float64 else np.float32)


def naive_in_dtype(q, k, v, *, scale=None, causal=False, window=None, mask=None, bias=None):
    """Naive materialized attention with every intermediate (S, P, O) rounded to the input dtype, matmuls
    accumulating in float32 (float64 for float64): the error budget a backend is measured against. Returns
    (out, lse), lse = max + log(sum of exp) of the rounded scores in the accumulation type."""
    dtype = np.dtype(result_dtype_name(q, k, v))
    acc = np.float64 if dtype == np.float64 else np.float32
    q, k, v = (np.asarray(x).astype(dtype).astype(acc) for x in (q, k, v))
    n, d = q.shape[-2:]
    m = k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    s = round_to(np.matmul(q, np.swapaxes(k, -1, -2)), dtype) * acc(scale)
    if bias is not None:
        s = s + np.asarray(bias).astype(acc)
    s = round_to(s, dtype)
    vis = visible_pairs(n, m, causal, window, mask, bias)
    s = np.where(vis, s, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        top = s.max(axis=-1, keepdims=True, initial=-np.inf)
        w = np.exp(s - np.where(top == -np.inf, 0, top))
        total = w.sum(axis=-1, keepdims=True)
        p = round_to(w / total, dtype)
        p = np.where(vis, p, 0)
        v_clean = np.where(np.isfinite(v), v, 0)
        out = round_to(np.matmul(np.nan_to_num(p), v_clean), dtype)
        lse = (top + np.log(total))[..., 0]
    return out, lse


def score_condition(q, k, *, scale=None, causal=False, window=None, mask=None, bias=None):
    """Per query row, the largest |scale| * sum_x |q_ix k_jx| + |bias_ij| over its visible keys: what one
    rounding of a score in the accumulation type is relative to (0 for a row that sees nothing)."""
    q, k = (np.abs(np.nan_to_num(np.asarray(x).astype(np.float64), posinf=0, neginf=0)) for x in (q, k))
    n, d = q.shape[-2:]
    m = k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    cond = np.matmul(q, np.swapaxes(k, -1, -2)) * abs(scale)
    if bias is not None:
        cond = cond + np.abs(np.nan_to_num(np.asarray(bias).astype(np.float64), posinf=0, neginf=0))
    vis = visible_pairs(n, m, causal, window, mask, bias)
    return np.where(vis, cond, 0).max(axis=-1, initial=0)


ABS_TOL = {"float64": 1e-12, "float32": 2e-6, "float16": 2e-4, "bfloat16": 2e-3}
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24}  # of the accumulation type


def assert_accurate(result, q, k, v, *, lse=None, **options):
    """The accuracy rule, row by row: for each output row, |result - reference| <= 2 * (the largest error of naive
    attention in the input dtype on that row) + a small absolute term, with NaN exactly where the reference has
    NaN. Per row, so one ill-conditioned row never loosens the bound of another.

    The absolute term is ABS_TOL of the row's largest output, plus two roundings of the row's largest score in
    the accumulation type (score_condition, times the largest |v|): with logits in the hundreds, one rounding of
    a score moves P by more than naive's own error happens to reach on some rows, and no exact algorithm in that
    type avoids it. lse is held to the same rule: 2 * naive's lse error on the row + the same two roundings +
    1e-5 of |lse| (1e-12 in float64)."""
    ref_out, ref_lse = attention_reference(q, k, v, **options)
    result = np.asarray(result).astype(np.float64)
    assert result.shape == ref_out.shape, (result.shape, ref_out.shape)
    nan_ref = np.isnan(ref_out)
    np.testing.assert_array_equal(np.isnan(result), nan_ref, err_msg="NaN where the reference has none, or not where it has")
    infinite = np.isinf(ref_out)
    np.testing.assert_array_equal(result[infinite], ref_out[infinite], err_msg="infinities differ from the reference")
    finite = ~nan_ref & ~infinite
    dtype = np.dtype(result_dtype_name(q, k, v))
    acc_name = "float64" if dtype == np.float64 else "float32"
    naive, naive_lse = naive_in_dtype(q, k, v, **options)
    naive = naive.astype(np.float64)
    naive_err = np.where(finite & np.isfinite(naive), np.abs(naive - ref_out), 0).max(axis=-1, initial=0)
    rounding = 2 * UNIT_ROUNDOFF[acc_name] * np.broadcast_to(score_condition(q, k, **options), ref_lse.shape)
    v_abs = np.abs(np.asarray(v).astype(np.float64))
    v_max = float(v_abs[np.isfinite(v_abs)].max(initial=0))
    row_scale = np.maximum(1.0, np.where(finite, np.abs(ref_out), 0).max(axis=-1, initial=0))
    atol = ABS_TOL[dtype.name] * row_scale + rounding * v_max
    bound = 2 * naive_err + atol  # one per row
    err = np.where(finite, np.abs(result - ref_out), 0).max(axis=-1, initial=0)
    bad = err > bound
    if bad.any():
        row = tuple(int(i) for i in np.argwhere(bad)[np.argmax((err - bound)[bad])])
        raise AssertionError(
            f"{int(bad.sum())} of {bad.size} rows exceed the rule's bound; worst row {row}: max error {err[row]:.3g} > "
            f"bound {bound[row]:.3g} (2 x naive {naive_err[row]:.3g} + atol {atol[row]:.3g})")
    if lse is not None:
        lse = np.asarray(lse).astype(np.float64)
        np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse), err_msg="lse -inf rows differ")
        ok = np.isfinite(ref_lse)
        naive_lse = np.broadcast_to(naive_lse, ref_lse.shape)
        with np.errstate(invalid="ignore"):  # -inf - -inf on rows that see nothing: not compared
            naive_lse_err = np.where(ok & np.isfinite(naive_lse), np.abs(naive_lse - ref_lse), 0)[ok]
        rel = 1e-12 if dtype == np.float64 else 1e-5
        lse_tol = 2 * naive_lse_err + rounding[ok] + rel * np.maximum(1.0, np.abs(ref_lse[ok]))
        err = np.abs(lse[ok] - ref_lse[ok])
        assert (err <= lse_tol).all(), f"lse error {err.max():.3g} exceeds its bound on {(err > lse_tol).sum()} rows"


def result_dtype_name(q, k, v):
    """The front door's promotion rule, stated here on its own: NumPy's, bfloat16 promoting like float16,
    float16 with bfloat16 giving float32, integers and bools computing in float64."""
    names = {np.dtype(x.dtype).name for x in (q, k, v)}
    if {"float16", "bfloat16"} <= names:
        return np.result_type(np.float32, *[x.dtype for x in (q, k, v) if x.dtype.name not in ("float16", "bfloat16")]).name
    as_numpy = [np.float16 if x.dtype.name == "bfloat16" else x.dtype for x in (q, k, v)]
    result = np.result_type(*as_numpy)
    if result.kind in "biu":
        return "float64"
    if result == np.float16 and "bfloat16" in names:
        return "bfloat16"
    return result.name
