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

from .family import Shape

SIGNATURE = "(n,d),(m,d),(m,e)->(n,e)"


@dataclass(frozen=True)
class Window:
    """The one visibility rule on the Python side (kernels: Scores in kernels/block.cuh). Key j is visible to
    query i when i + (m - n) - left <= j <= i + (m - n) + right: the diagonal is aligned bottom-right, and a side
    of None is unbounded. causal=True is right = min(right, 0)."""

    left: Optional[int] = None
    right: Optional[int] = None

    @classmethod
    def of(cls, window=None, causal: bool = False) -> "Window":
        """From window=(left, right) (or None) and causal=, sides taken as given (the front door checks them)."""
        left, right = window if window is not None else (None, None)
        if causal:
            right = 0 if right is None else min(right, 0)
        return cls(left, right)

    @property
    def bounded(self) -> bool:
        return (self.left, self.right) != (None, None)

    def reach(self, n: int, m: int) -> Tuple[int, int]:
        """(left, right) as ints within +-(n + m + 1), so no backend's arithmetic overflows: a side of n + m or
        more (or None) reaches past every key, one of -(n + m) or less hides every key."""
        far = n + m + 1

        def clamp(side: Optional[int]) -> int:
            return far if side is None else max(-far, min(far, int(side)))
        return clamp(self.left), clamp(self.right)

    def key_range(self, i0: int, i1: int, n: int, m: int) -> Tuple[int, int]:
        """Keys [j0, j1) that any query row in [i0, i1) can see; empty when j0 >= j1."""
        left, right = self.reach(n, m)
        j0 = max(0, i0 + (m - n) - left)
        j1 = min(m, i1 - 1 + (m - n) + right + 1)
        return j0, max(j0, j1)

    def tile_fully_visible(self, i0: int, i1: int, j0: int, j1: int, n: int, m: int) -> bool:
        """True when the window hides no key of the tile rows [i0, i1) x keys [j0, j1)."""
        left, right = self.reach(n, m)
        return j0 >= (i1 - 1) + (m - n) - left and (j1 - 1) <= i0 + (m - n) + right

    def tile(self, xp, i0: int, i1: int, j0: int, j1: int, n: int, m: int):
        """Boolean (i1-i0, j1-j0) visibility of the window on one tile, in array module xp."""
        left, right = self.reach(n, m)
        i = xp.arange(i0, i1)[:, None] + (m - n)
        j = xp.arange(j0, j1)[None, :]
        return (j >= i - left) & (j <= i + right)

@dataclass(frozen=True)
class Packed:
    """Packed sequences (attention_varlen): sequence s is query rows cu_seqlens_q[s]:cu_seqlens_q[s + 1] of the
    packed operands against key rows cu_seqlens_k[s]:cu_seqlens_k[s + 1]. The Problem's batch is then
    (sequences, Hk, G), its n and m the longest sequence's, and each operand a batched view of its packed array
    (batched): stride 0 on the sequence axis, so every sequence's view starts at the packed array's first row and a
    kernel adds its sequence's first row (Params::cu_seqlens_*). total_q, total_k: the packed arrays' rows.
    cu_seqlens_*: int64 arrays of the problem's module, or None in a problem of one sequence that the blocked
    algorithm cut out (sequence), whose mods see sequence number `first`."""

    cu_seqlens_q: Any
    cu_seqlens_k: Any
    total_q: int
    total_k: int
    first: int = 0

    def offsets(self) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """The offsets on the host (a read back from a GPU)."""
        def host(x) -> Tuple[int, ...]:
            return tuple(int(v) for v in (x if isinstance(x, np.ndarray) else x.get()))
        return host(self.cu_seqlens_q), host(self.cu_seqlens_k)

    @staticmethod
    def batched(whole, sequences: int, rows: int):
        """(Hk, G, total, *cols) -> the Problem's (sequences, Hk, G, rows, *cols) view, stride 0 on the sequence
        axis (writeable: out, lse and the gradients are such views too)."""
        shape = (sequences,) + tuple(whole.shape[:2]) + (rows,) + tuple(whole.shape[3:])
        return as_strided(whole, shape, (0,) + tuple(whole.strides))

    def whole(self, x, side: str):
        """A batched view (sequences, Hk, G, rows, *cols) back to its packed array's (Hk, G, total, *cols)."""
        total = self.total_q if side == "q" else self.total_k
        return as_strided(x[0], tuple(x.shape[1:3]) + (total,) + tuple(x.shape[4:]), x.strides[1:])

    def sequence(self, x, side: str, begin: int, end: int):
        """Rows [begin, end) of a batched view, as a view of one sequence (1, Hk, G, end - begin, *cols)."""
        return None if x is None else self.whole(x, side)[None, :, :, begin:end]

    def one(self, s: int) -> "Packed":
        return Packed(None, None, 0, 0, self.first + s)


@dataclass(frozen=True)
class Paged:
    """Paged keys and values (attention_paged): key j of sequence b is row j % page_size of page
    block_table[b, j // page_size] of the caches k_cache (num_pages, page_size, Hk, d) and v_cache (..., e). The
    Problem's batch is then (B, Hk, G), n the new queries and m the longest sequence's keys (which only sizes the
    launch); its k and v are views of the caches' page 0, (B, Hk, G, page_size, cols), stride 0 on the sequence
    and group axes, from which the kernels walk the pages. block_table (B, pages) and seqlens (B,: the keys of each
    sequence) are contiguous int64 arrays of the problem's module. splits: key splits forced (num_splits), or
    None."""

    block_table: Any
    seqlens: Any
    page_size: int
    k_cache: Any
    v_cache: Any
    splits: Optional[int] = None

    def page_stride(self, name: str) -> int:
        """Elements from one page of the k ("k") or v ("v") cache to the next."""
        cache = self.k_cache if name == "k" else self.v_cache
        return cache.strides[0] // cache.dtype.itemsize

    @staticmethod
    def view(cache, batch: Tuple[int, int, int]):
        """A cache's page 0 as the Problem's (B, Hk, G, page_size, cols) operand."""
        s = cache.strides
        shape = (batch[0], batch[1], batch[2], cache.shape[1], cache.shape[3])
        return as_strided(cache, shape, (0, s[2], 0, s[1], s[3]))

    def keys(self, cache, pages, m: int, xp):
        """A sequence's first m keys (or values) gathered from its pages (its row of the table, in cache's
        module): (1, Hk, 1, m, cols)."""
        pages = pages[:-(-m // self.page_size)]
        rows = cache[pages].reshape((-1,) + tuple(cache.shape[2:]))[:m]
        return xp.moveaxis(rows, 0, 1)[None, :, None]

    def key_counts(self) -> Tuple[int, ...]:
        """Each sequence's keys on the host (a read back from a GPU)."""
        counts = self.seqlens if isinstance(self.seqlens, np.ndarray) else self.seqlens.get()
        return tuple(int(m) for m in counts)


def as_strided(x, shape, strides):
    """A view of x's memory (NumPy's or CuPy's as_strided)."""
    if isinstance(x, np.ndarray):
        return np.lib.stride_tricks.as_strided(x, shape, strides, writeable=x.flags.writeable)
    import cupy
    return cupy.lib.stride_tricks.as_strided(x, shape, strides)


@dataclass(frozen=True)
class Problem:
    """softmax(scale * q @ k.T + bias, visible) @ v for every batch index.

    q: (*batch, n, d), k: (*batch, m, d), v: (*batch, m, e), all of `dtype`.
    mask: bool (*batch, n, m) or None (True = attend). bias: (*batch, n, m) or None, in the accumulation type (the
        front door casts it once); a bias of -inf hides its key as the mask does (by selection). bias_hides: the
        bias may hold -inf, so backends must select per element on every tile it covers (False lets them keep the
        fast path).
    window: the Window (causal included).
    precision: precision= normalized for dtype (family.check_precision): "highest" (float32-exact: 3xTF32 on
        tensor cores, or CUDA cores), "tf32" (float32 only: one TF32 tensor-core pass) or "fma" (CUDA cores only).
        What the planner reads; the numpy backend computes the same either way.
    score_mod, mask_mod: the traced mods (mods.Traced) or None: score_mod maps each scaled score (after bias) to a
        new one, mask_mod is ANDed with the window and mask. sinks: (*batch,) in the accumulation type or None:
        one logit per batch item that joins every row's softmax denominator and carries no value.
    block_mask: the tiles of mask_mod's (or the mask's) pattern (blockmask.BlockMask) or None: backends visit only
        the tiles it shows and evaluate the pattern on its partial ones. mask_is_block_masks: mask is the array the
        block mask was made from (a tile it shows whole needs no look at it). score_mod_grads: the numbers of
        score_mod's float tables whose gradients the backward computes (attention_backward's score_mod_grads=).
    packed: the packed sequences (Packed) or None. paged: the paged keys and values (Paged) or None.
    dropout: attention dropout (cuflash.dropout.Dropout) or None.
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
    window: Window
    xp: Any  # numpy or cupy
    bias_hides: bool = False
    precision: str = "highest"
    score_mod: Any = None
    mask_mod: Any = None
    sinks: Any = None
    block_mask: Any = None
    mask_is_block_masks: bool = False
    score_mod_grads: Tuple[int, ...] = ()
    packed: Optional[Packed] = None
    paged: Optional[Paged] = None
    dropout: Any = None

    @property
    def batch_size(self) -> int:
        return math.prod(self.batch)

    @property
    def shape(self) -> Shape:
        """What the planner needs of this problem."""
        paged = self.paged
        return Shape(self.dtype, self.d, self.e, self.n, self.m, self.batch_size, self.precision,
                     packed=self.packed is not None and self.packed.cu_seqlens_q is not None,
                     paged=paged is not None, splits=None if paged is None else paged.splits,
                     dropout=self.dropout is not None)

    @property
    def empty(self) -> bool:
        return self.n == 0 or self.batch_size == 0

    def key_range(self, i0: int, i1: int) -> Tuple[int, int]:
        return self.window.key_range(i0, i1, self.n, self.m)

    def tile_fully_visible(self, i0: int, i1: int, j0: int, j1: int) -> bool:
        return self.window.tile_fully_visible(i0, i1, j0, j1, self.n, self.m)

    def window_tile(self, i0: int, i1: int, j0: int, j1: int):
        return self.window.tile(self.xp, i0, i1, j0, j1, self.n, self.m)

    def delta(self, dout, out):
        """D_i = rowsum(dO_i * O_i) of rows of dout and out, in the accumulation type: FlashAttention-2's
        preprocessing of the backward, for every backward path (the kernels' row terms, the blocked backward)."""
        acc = self.acc_dtype
        with np.errstate(invalid="ignore", over="ignore"):
            return (dout.astype(acc, copy=False) * out.astype(acc, copy=False)).sum(axis=-1)


def default_scale(d: int) -> float:
    # d = 0 makes every score 0 whatever the scale; 1.0 avoids 0 * inf.
    return 1.0 / math.sqrt(d) if d > 0 else 1.0
