"""The accuracy check: float64 attention on a few sampled rows of the first input set, and the same rows of any
backend's output brought to the host as float64."""

from __future__ import annotations

import math

import numpy as np

from .failures import Skip
from .inputs import InputSets, float_dtype
from .points import Point


ROWS_CHECKED = 16  # query rows per sampled batch item compared with float64 attention


def to_host(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        return x.detach().double().cpu().numpy()
    if type(x).__module__.startswith("cupy"):
        x = x.get()
    return np.asarray(x).astype(np.float64)


def sample(x, rows):
    """The first and last batch items' given rows of a (batch, heads, rows, cols) array, as float64 on the host."""
    flat = x.reshape(-1, x.shape[-2], x.shape[-1])
    rows = rows.tolist() if isinstance(rows, np.ndarray) else rows
    return np.stack([to_host(flat[i][rows]) for i in (0, flat.shape[0] - 1)])


def reference(sets: InputSets, point: Point):
    """float64 attention of the sampled rows of the first input set: (rows, output sample)."""
    rows = np.unique(np.linspace(0, point.n - 1, min(point.n, ROWS_CHECKED)).astype(np.int64))
    qs, ks, vs = (sample(x, r) for x, r in zip(sets.arrays[0], (rows, slice(None), slice(None))))
    if not sets.native:  # float32 here, rounded to the dtype on PyTorch's side
        qs, ks, vs = (rounded(x, point.dtype) for x in (qs, ks, vs))
    s = qs @ np.swapaxes(ks, -1, -2) / math.sqrt(point.d)
    if point.causal:
        s = np.where(np.arange(point.m)[None, :] <= rows[:, None] + (point.m - point.n), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return rows, (p / p.sum(axis=-1, keepdims=True)) @ vs


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    try:
        return x.astype(float_dtype(dtype)).astype(np.float64)
    except Skip:
        return x
