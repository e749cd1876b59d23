"""The truth: naive, materialized attention in float64, written apart from every backend (the tests hold every
backend to it; python -m cuflash checks its sample of rows against it).

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


def attention_reference(q, k, v, *, scale=None, causal=False, window=None, mask=None, bias=None, rows=None):
    """(out, lse) in float64 for any broadcastable operands. rows: only these query rows (indices into q's rows),
    each still seeing its keys as row i of the whole problem does."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    n, d = q.shape[-2:]
    m, e = v.shape[-2:]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    vis = visible_pairs(n, m, causal, window, mask, bias)
    if bias is not None:
        bias = np.asarray(bias).astype(np.float64)
    if rows is not None:
        rows = np.asarray(rows)
        q, vis = q[..., rows, :], np.broadcast_to(vis, vis.shape[:-2] + (n, m))[..., rows, :]
        if bias is not None:
            bias = np.broadcast_to(bias, bias.shape[:-2] + (n, m))[..., rows, :]
        n = rows.size
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if bias is not None:
        scores = scores + bias
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
