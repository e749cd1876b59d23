"""Problem: the one frozen description of an attention call that flows from the front door to a backend.

The front door (api.py) builds it from NumPy semantics; a backend runs it and knows nothing of argument parsing.
Operands are views already broadcast to the batch shape (stride 0 where broadcast): nothing is copied here except
a dtype cast of an operand whose dtype differs from the common one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

SIGNATURE = "(n,d),(m,d),(m,e)->(n,e)"


@dataclass(frozen=True)
class Problem:
    """softmax(scale * q @ k.T + bias, visible) @ v for every batch index.

    q: (*batch, n, d), k: (*batch, m, d), v: (*batch, m, e), all of `dtype`.
    mask: bool (*batch, n, m) or None (True = attend). bias: (*batch, n, m) or None, any real dtype; a bias of
        -inf hides its key as the mask does (by selection). bias_hides: the bias may hold -inf, so backends must
        select per element on every tile it covers (False lets them keep the fast path).
    window: (left, right), None meaning unbounded: key j is visible to query i when
        i + (m - n) - left <= j <= i + (m - n) + right.
    """

    q: Any
    k: Any
    v: Any
    mask: Any
    bias: Any
    batch: Tuple[int, ...]
    n: int
    m: int
    d: int
    e: int
    dtype: np.dtype  # element type of q, k, v and of the result
    acc_dtype: np.dtype  # float32 for 16- and 32-bit inputs, float64 for float64
    scale: float
    window: Tuple[Optional[int], Optional[int]]
    xp: Any  # numpy or cupy
    bias_hides: bool = False

    @property
    def offset(self) -> int:
        """Diagonal offset m - n: bottom-right alignment of causal and window."""
        return self.m - self.n

    @property
    def batch_size(self) -> int:
        return math.prod(self.batch)

    @property
    def empty(self) -> bool:
        return self.n == 0 or self.batch_size == 0

    @property
    def windowed(self) -> bool:
        return self.window != (None, None)

    def key_range(self, i0: int, i1: int) -> Tuple[int, int]:
        """Keys [j0, j1) that any query row in [i0, i1) can see; empty when j0 >= j1."""
        left, right = self.window
        j0 = 0 if left is None else max(0, i0 + self.offset - left)
        j1 = self.m if right is None else min(self.m, i1 - 1 + self.offset + right + 1)
        return j0, max(j0, j1)

    def tile_fully_visible(self, i0: int, i1: int, j0: int, j1: int) -> bool:
        """True when the window hides no key of the tile rows [i0, i1) x keys [j0, j1)."""
        left, right = self.window
        ok_left = left is None or j0 >= (i1 - 1) + self.offset - left
        ok_right = right is None or (j1 - 1) <= i0 + self.offset + right
        return ok_left and ok_right

    def window_tile(self, i0: int, i1: int, j0: int, j1: int):
        """Boolean (i1-i0, j1-j0) visibility of the window on one tile, in the problem's array module."""
        xp = self.xp
        i = xp.arange(i0, i1)[:, None] + self.offset
        j = xp.arange(j0, j1)[None, :]
        left, right = self.window
        vis = xp.ones((i1 - i0, j1 - j0), dtype=bool)
        if left is not None:
            vis &= j >= i - left
        if right is not None:
            vis &= j <= i + right
        return vis


def default_scale(d: int) -> float:
    # d = 0 makes every score 0 whatever the scale; 1.0 avoids 0 * inf.
    return 1.0 / math.sqrt(d) if d > 0 else 1.0
