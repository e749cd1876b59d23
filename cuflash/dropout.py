"""Attention dropout: which probabilities a call keeps, as a pure function of (seed, batch index, i, j).

Each element's keep bit comes from Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC 2011; the generator cuRAND and PyTorch use), keyed by the 64-bit seed: the counter (j >> 2, i, b mod 2^32,
b >> 32) gives four 32-bit words, and word j & 3 is element (b, i, j)'s. The element is dropped when that word is
below threshold = floor(p 2^32), kept otherwise (probability 1 - threshold / 2^32, which is 1 - p to within
2^-32), and a kept probability is scaled by 1 / (1 - p) after the softmax (lse is the softmax's, unchanged). b is
the element's batch index: its place in the call's broadcast batch shape, row-major (for (B, H, n, d) operands b =
batch * H + head; for packed sequences s * H + h). So every backend, tile size and split of the keys keeps the
same elements, bit for bit, and the backward regenerates them instead of storing them.

The kernels compute the same function (kernels/tile.cuh: philox, dropout_keeps); this module is its NumPy (and
CuPy) twin, and dropout_mask gives the dense mask for tests and debugging.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Optional, Tuple

import numpy as np

NAME = "attention"
M0, M1 = 0xD2511F53, 0xCD9E8D57  # Philox-4x32's multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # its Weyl key increments
ROUNDS = 10
_LOW = 0xFFFFFFFF


def philox(counter: Tuple[Any, Any, Any, Any], key: Tuple[Any, Any], xp=np):
    """Philox-4x32-10 of a counter (four uint32 arrays, or ints) under a key (two uint32 arrays or ints): four
    uint32 arrays, element-wise (arrays broadcast). Wider words are taken mod 2^32, as the kernels' 32-bit words
    are (a key's group (j + key0) >> 2 past 2^32)."""
    low = np.uint64(_LOW)
    c = [xp.asarray(x, dtype=np.uint64) & low for x in counter]
    k0, k1 = (xp.asarray(x, dtype=np.uint64) & low for x in key)
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + np.uint64(W0)) & low, (k1 + np.uint64(W1)) & low
        p0, p1 = np.uint64(M0) * c[0], np.uint64(M1) * c[2]  # 32 x 32 -> 64 bits: no overflow in uint64
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & low, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & low]
    return tuple(x.astype(np.uint32) for x in c)


@dataclasses.dataclass(frozen=True)
class Dropout:
    """A call's dropout (the Problem's): p, the seed, and where its elements sit in the call that counts them: the
    batch index of batch item (x_0, ..., x_k) of the problem is base + sum x_a strides[a] (row-major over the
    call's batch shape; a Dask task's chunk adds its offsets), query i is row0 + i, key j is key0 + j."""

    p: float
    seed: int
    strides: Tuple[int, ...]
    base: int = 0
    row0: int = 0
    key0: int = 0

    @property
    def threshold(self) -> int:
        """Words below this are dropped."""
        return min(_LOW, int(math.floor(self.p * 2.0**32)))

    @property
    def scale(self) -> float:
        return 1.0 / (1.0 - self.p)

    def keeps(self, batch, i, j, xp=np):
        """Whether elements are kept: batch (the batch index b, as computed here from the problem's batch
        multi-index by the caller), i and j (query rows and keys of the problem) as int64 arrays that broadcast."""
        b = xp.asarray(batch, dtype=np.int64).astype(np.uint64)
        i = xp.asarray(i, dtype=np.int64) + self.row0
        j = xp.asarray(j, dtype=np.int64) + self.key0
        jj = j.astype(np.uint64)
        words = philox((jj >> np.uint64(2), i.astype(np.uint64) & np.uint64(_LOW), b & np.uint64(_LOW),
                        b >> np.uint64(32)), (self.seed & _LOW, self.seed >> 32), xp)
        lane = (jj & np.uint64(3)).astype(np.int64)
        word = xp.where(lane == 0, words[0], xp.where(lane == 1, words[1], xp.where(lane == 2, words[2], words[3])))
        return word >= np.uint32(self.threshold)

    def tile_keeps(self, batch, i0: int, i1: int, j0: int, j1: int, xp=np):
        """keeps() over a tile, rows [i0, i1) x keys [j0, j1) of the batch index `batch` (an int64 array, or one
        that broadcasts as the batch axes of the tile's scores: (..., 1, 1)): four keys per Philox call, as the
        kernels take them."""
        g0, g1 = (j0 + self.key0) >> 2, ((j1 - 1 + self.key0) >> 2) + 1
        b = xp.asarray(batch, dtype=np.int64).astype(np.uint64)
        i = (xp.arange(i0, i1, dtype=np.int64) + self.row0).astype(np.uint64)[:, None]
        groups = xp.arange(g0, g1, dtype=np.int64).astype(np.uint64)[None, :]
        words = philox((groups, i & np.uint64(_LOW), b & np.uint64(_LOW), b >> np.uint64(32)),
                       (self.seed & _LOW, self.seed >> 32), xp)
        kept = xp.stack([w >= np.uint32(self.threshold) for w in words], axis=-1)  # (..., rows, groups, 4)
        kept = kept.reshape(tuple(kept.shape[:-2]) + (-1,))
        first = j0 + self.key0 - 4 * g0
        return kept[..., first:first + (j1 - j0)]

    def batch_index(self, grids, xp=np):
        """b from the batch axes' index grids (blocked.index_grids' first ones)."""
        total = xp.asarray(self.base, dtype=np.int64)
        for grid, stride in zip(grids, self.strides):
            total = total + grid * stride
        return total


def row_major(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The strides of a row-major walk over shape (in items)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


_drawn = threading.local()


def check(dropout_p, seed, name: str = NAME, backward: bool = False) -> Tuple[float, Optional[int]]:
    """(p, seed) checked: 0 <= p < 1 (a float); seed an int in [0, 2^64) or None. With p > 0 and seed None the
    forward draws a seed from NumPy's global generator (np.random.seed makes it reproducible) and records it
    (last_seed); the backward refuses it, as a fresh seed would drop other elements than the forward did."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: dropout_p must be a number in [0, 1), got {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name}: dropout_p must be in [0, 1), got {dropout_p!r} (1 would drop everything)")
    if seed is not None:
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
            raise ValueError(f"{name}: seed must be an int in [0, 2^64) or None, got {seed!r}")
        seed = int(seed)
    if p == 0.0:
        return p, seed
    if seed is None:
        if backward:
            raise ValueError(f"{name}: dropout_p > 0 needs the forward's seed: pass seed= to both calls, or "
                             f"cuflash.last_seed() right after a forward that drew one")
        seed = int(np.random.randint(0, 2**63, dtype=np.int64))
        _drawn.seed = seed
    return p, seed


def last_seed() -> Optional[int]:
    """The seed the last attention call with ``dropout_p > 0`` and ``seed=None`` drew in this thread.

    Give it to `cuflash.attention_backward` (``seed=``) so that it drops the elements the forward dropped.

    Returns
    -------
    int or None
        None before any such call.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> q = k = v = np.ones((1, 8, 4))
    >>> np.random.seed(0)                                   # makes the drawn seed reproducible
    >>> out, lse = cuflash.attention(q, k, v, dropout_p=0.5, return_lse=True)
    >>> seed = cuflash.last_seed()
    >>> grads = cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, dropout_p=0.5, seed=seed)
    """
    return getattr(_drawn, "seed", None)


def dropout_mask(batch_shape, n: int, m: int, *, p: float, seed: int) -> np.ndarray:
    """The keep mask (True: kept) of attention with ``dropout_p=p`` and this seed: the elements every backend keeps.

    Whether element (b, i, j) is kept is a pure function of the seed, its batch index b (its place in the broadcast
    batch shape, row-major), its query i and its key j: word ``j & 3`` of Philox-4x32-10 of the counter
    ``(j >> 2, i, b mod 2^32, b >> 32)`` under the 64-bit seed, dropped when below ``floor(p * 2^32)``. For tests and
    debugging (it is n x m); attention never makes it.

    Parameters
    ----------
    batch_shape : tuple of int
        The broadcast batch shape of the call.
    n, m : int
        Queries and keys.
    p : float
        The call's dropout_p, ``0 <= p < 1``.
    seed : int
        The call's seed, in ``[0, 2^64)``.

    Returns
    -------
    ndarray of bool
        ``(*batch_shape, n, m)``.

    Raises
    ------
    ValueError
        p or seed out of range, negative sizes.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> rng = np.random.default_rng(6)
    >>> q, k, v = (rng.standard_normal((2, 4, 64, 32)) for _ in range(3))
    >>> out = cuflash.attention(q, k, v, dropout_p=0.1, seed=1234)
    >>> keep = cuflash.dropout_mask((2, 4), 64, 64, p=0.1, seed=1234)     # the elements the call kept
    >>> s = q @ k.swapaxes(-1, -2) / np.sqrt(32)
    >>> weights = np.exp(s - s.max(-1, keepdims=True))
    >>> weights /= weights.sum(-1, keepdims=True)
    >>> bool(np.allclose(out, (weights * keep / 0.9) @ v))
    True
    """
    p, checked = check(p, seed, "dropout_mask", backward=True)
    batch_shape = tuple(int(x) for x in batch_shape)
    dropout = Dropout(p, checked if checked is not None else 0, row_major(batch_shape))
    grids = np.indices(batch_shape, sparse=True) if batch_shape else ()
    b = dropout.batch_index([g[..., None, None] for g in grids])
    if n == 0 or m == 0:
        return np.ones(batch_shape + (n, m), bool)
    return np.broadcast_to(dropout.tile_keeps(b, 0, n, 0, m), batch_shape + (n, m)).copy()
