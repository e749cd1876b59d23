"""The truth: naive, materialized attention in float64, written apart from every backend.

It follows the documented semantics directly: scores for every (query, key) pair, visibility as a boolean
matrix, softmax over the visible keys of each row, and the weighted sum over those keys only (selection, so a
NaN in a hidden value never counts).
"""

from __future__ import annotations

import math

import numpy as np


def visibility(n, m, causal=False, window=None):
    """Boolean (n, m): key j visible to query i when i + (m - n) - left <= j <= i + (m - n) + right."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    i = np.arange(n)[:, None] + (m - n)
    j = np.arange(m)[None, :]
    vis = np.ones((n, m), dtype=bool)
    if left is not None:
        vis &= j >= i - left
    if right is not None:
        vis &= j <= i + right
    return vis


def attention_reference(q, k, v, *, scale=None, causal=False, window=None, mask=None, bias=None):
    """(out, lse) in float64 for any broadcastable operands."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    n, d = q.shape[-2:]
    m, e = v.shape[-2:]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    vis = visibility(n, m, causal, window)
    if mask is not None:
        vis = vis & np.asarray(mask, dtype=bool)
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
            if top == -np.inf:  # every visible score is -inf (a bias mask): nothing to attend
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
    accumulating in float32 (float64 for float64): the error budget a backend is measured against."""
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
    vis = visibility(n, m, causal, window)
    if mask is not None:
        vis = vis & np.asarray(mask, dtype=bool)
    s = np.where(vis, s, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        top = s.max(axis=-1, keepdims=True, initial=-np.inf)
        w = np.exp(s - np.where(top == -np.inf, 0, top))
        p = round_to(w / w.sum(axis=-1, keepdims=True), dtype)
        p = np.where(vis, p, 0)
        v_clean = np.where(np.isfinite(v), v, 0)
        return round_to(np.matmul(np.nan_to_num(p), v_clean), dtype)


ABS_TOL = {"float64": 1e-12, "float32": 2e-6, "float16": 2e-4, "bfloat16": 2e-3}


def assert_accurate(result, q, k, v, *, lse=None, **options):
    """The accuracy rule: |result - reference| <= 2 * |naive in dtype - reference| + a small absolute term,
    with NaN exactly where the reference has NaN."""
    ref_out, ref_lse = attention_reference(q, k, v, **options)
    result = np.asarray(result).astype(np.float64)
    assert result.shape == ref_out.shape, (result.shape, ref_out.shape)
    nan_ref = np.isnan(ref_out)
    np.testing.assert_array_equal(np.isnan(result), nan_ref, err_msg="NaN where the reference has none, or not where it has")
    infinite = np.isinf(ref_out)
    np.testing.assert_array_equal(result[infinite], ref_out[infinite], err_msg="infinities differ from the reference")
    finite = ~nan_ref & ~infinite
    dtype = np.dtype(result_dtype_name(q, k, v))
    naive = naive_in_dtype(q, k, v, **options).astype(np.float64)
    naive_err = np.abs(naive - ref_out)[finite & np.isfinite(naive)]
    scale = max(1.0, float(np.nanmax(np.abs(ref_out), initial=0)))
    atol = ABS_TOL[dtype.name] * scale
    bound = 2 * (naive_err.max() if naive_err.size else 0.0) + atol
    err = np.abs(result - ref_out)[finite]
    worst = err.max() if err.size else 0.0
    assert worst <= bound, f"max error {worst:.3g} exceeds the rule's bound {bound:.3g} (naive {bound - atol:.3g}/2, atol {atol:.3g})"
    if lse is not None:
        lse = np.asarray(lse).astype(np.float64)
        np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse), err_msg="lse -inf rows differ")
        ok = np.isfinite(ref_lse)
        lse_scale = max(1.0, float(np.abs(ref_lse[ok]).max(initial=0)))
        lse_tol = (1e-12 if dtype == np.float64 else 1e-5) * lse_scale
        np.testing.assert_allclose(lse[ok], ref_lse[ok], rtol=0, atol=lse_tol)


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
