"""Block masks: which (query tile, key tile) pairs a pattern hides entirely, shows entirely, or partly.

cuflash.block_mask(mask_mod, batch_shape, n, m) evaluates the mod tile by tile (one row of tiles at a time, never an
(n, m) array) and keeps, per row tile of every batch entry, the key tiles it shows partly and those it shows
whole, as FlexAttention's kv_num_blocks / kv_indices / full_kv_num_blocks / full_kv_indices, plus the transposed
lists (per key tile, its query tiles) that a key-tile sweep (the backward's dK/dV) walks. Batch axes the pattern
does not read have size 1 and are shared. Every backend visits only the tiles it shows and evaluates the mod only
on the partial ones; causal= and window= keep their own skipping.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Any, Iterator, Optional, Tuple

import numpy as np

from . import mods

DEFAULT_BLOCK = (128, 128)
HIDDEN, PARTIAL, FULL = 0, 1, 2
EVALUATED_ELEMENTS = 2**22  # mask elements evaluated at once while building: a row of tiles, in key chunks


class BlockMask:
    """The tiles of a pattern: which (query tile, key tile) pairs it hides, shows whole, or shows in part.

    Made by `cuflash.block_mask`; passed as ``block_mask=``, it is reused across calls and layers: only the tiles it
    shows are computed, and the pattern is evaluated only on the partial ones. It describes its arrays' contents when
    it was made: make a new one when they change. Its ``repr`` draws the tiles.

    Attributes
    ----------
    shape : tuple of int
        ``(*batch, n, m)``, batch axes of size 1 shared by every batch item.
    block : tuple of (int, int)
        ``(Br, Bc)``.
    kinds : ndarray of int8
        ``(*batch, row tiles, key tiles)`` of HIDDEN (0), PARTIAL (1) or FULL (2).
    kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices : ndarray
        FlexAttention's per-row-tile lists of the partial and of the full key tiles; ``q_*`` their transposes, per
        key tile, for a key-tile sweep.
    mask_mod, mask
        The traced mod, or a boolean array broadcastable to ``(*batch, n, m)``: what decides the elements of a
        partial tile.

    Examples
    --------
    >>> import cuflash
    >>> from cuflash import mods
    >>> pattern = cuflash.block_mask(mods.causal, (), 256, 256, block=(64, 64))
    >>> pattern.to_dense().astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [1, 1, 1, 0],
           [1, 1, 1, 1]])
    >>> pattern.covering(128, 128).density
    0.75
    """

    def __init__(self, kinds, shape, block, mask_mod=None, mask=None, function=None):
        self.kinds, self.shape, self.block = kinds, tuple(shape), tuple(block)
        self.mask_mod, self.mask, self.function = mask_mod, mask, function
        self._visits: dict = {}  # visits() by (br, bc, keys_own, device)
        partial, full = kinds == PARTIAL, kinds == FULL
        self.kv_num_blocks, self.kv_indices = _lists(partial)
        self.full_kv_num_blocks, self.full_kv_indices = _lists(full)
        self.q_num_blocks, self.q_indices = _lists(np.swapaxes(partial, -1, -2))
        self.full_q_num_blocks, self.full_q_indices = _lists(np.swapaxes(full, -1, -2))

    @property
    def batch(self) -> Tuple[int, ...]:
        return self.shape[:-2]

    @property
    def density(self) -> float:
        """The share of tiles shown (partly or whole), over every batch entry."""
        return float((self.kinds != HIDDEN).mean()) if self.kinds.size else 0.0

    def to_dense(self):
        """``(*batch, row tiles, key tiles)`` booleans: whether each tile is shown (partly or whole)."""
        return self.kinds != HIDDEN

    def key_tiles(self, entry, row_tile: int) -> Iterator[Tuple[int, bool]]:
        """(key tile, whole) for the tiles row tile `row_tile` of batch entry `entry` shows, in key order."""
        kinds = self.kinds[entry][row_tile]
        for t in np.flatnonzero(kinds):
            yield int(t), bool(kinds[t] == FULL)

    def __repr__(self) -> str:
        br, bc = self.block
        counts = ", ".join(f"{name} {int((self.kinds == kind).sum())}"
                           for name, kind in (("full", FULL), ("partial", PARTIAL), ("hidden", HIDDEN)))
        text = [f"BlockMask(shape={self.shape}, block=({br}, {bc}), density={100 * self.density:.1f}%: tiles {counts})"]
        if self.kinds.size and self.kinds.shape[-2] <= 32 and self.kinds.shape[-1] <= 64:
            first = self.kinds[(0,) * len(self.batch)]
            text += ["".join(" ░█"[k] for k in row) for row in first]  # hidden, partial, full
        return "\n".join(text)

    def check_for(self, batch, n, m, name="attention"):
        """The mask must describe this problem: its (n, m), and batch axes of its size or 1 that broadcast."""
        if self.shape[-2:] != (n, m):
            raise ValueError(f"{name}: the block mask was made for n = {self.shape[-2]}, m = {self.shape[-1]}, not "
                             f"n = {n}, m = {m}; make one for this call's lengths")
        try:
            fits = np.broadcast_shapes(self.batch, batch) == tuple(batch)
        except ValueError:
            fits = False
        if not fits or len(self.batch) > len(batch):
            raise ValueError(f"{name}: the block mask's batch shape {self.batch} does not broadcast to the call's "
                             f"{tuple(batch)}")

    def retile(self, br: int, bc: int) -> "BlockMask":
        """The same pattern on tiles of (br, bc), exactly as fine as it was: sizes must divide one another on each
        axis (a caller's ``block=`` for the blocked algorithm). `covering` does the work.
        """
        for old, new in zip(self.block, (br, bc)):
            if old % new and new % old:
                raise ValueError(f"the block mask's tiles {self.block} cannot be re-tiled to ({br}, {bc}): each "
                                 f"size must divide the other; make it with block=({br}, {bc})")
        return self.covering(br, bc)

    def covering(self, br: int, bc: int) -> "BlockMask":
        """The pattern on tiles of (br, bc), any sizes: a tile is hidden (or full) where every tile of this mask it
        overlaps is, and partial otherwise. Exact where the sizes divide one another (finer tiles inside a coarse
        one take its kind; a coarse tile made of fine ones is hidden or full only if all of them are); where they
        do not, a tile shows at least what the pattern shows, so nothing hidden is ever visited wrongly."""
        if (br, bc) == self.block:
            return self
        low = high = self.kinds  # the least and the greatest kind a tile overlaps (HIDDEN < PARTIAL < FULL)
        for axis, (old, new, length) in enumerate(((self.block[0], br, self.shape[-2]),
                                                    (self.block[1], bc, self.shape[-1]))):
            axis = self.kinds.ndim - 2 + axis
            low, high = _over_tiles(low, np.minimum, axis, old, new, length), \
                _over_tiles(high, np.maximum, axis, old, new, length)
        kinds = np.where(high == HIDDEN, HIDDEN, np.where(low == FULL, FULL, PARTIAL)).astype(np.int8)
        return BlockMask(kinds, self.shape, (br, bc), self.mask_mod, self.mask, self.function)

    def visits(self, br: int, bc: int, keys_own: bool, xp=np):
        """What a kernel on tiles of (br, bc) visits (mods.cuh's Visits): (count, entries, owned), count and
        entries int32 arrays of xp of shape (batch entries * owned,) and (batch entries * owned, width): for each
        of the `owned` row tiles (key tiles, keys_own) of each batch entry, its shown tiles of the other axis
        ascending as 2 * tile + whole, the rest 0; width at least 1. Made once per (br, bc, keys_own) and device."""
        device = None if xp is np else xp.cuda.Device().id
        key = (br, bc, keys_own, device)
        if key not in self._visits:
            kinds = self.covering(br, bc).kinds
            if keys_own:
                kinds = np.swapaxes(kinds, -1, -2)
            shown = kinds != HIDDEN
            count = shown.sum(axis=-1, dtype=np.int32)
            order = np.argsort(~shown, axis=-1, kind="stable")
            entries = 2 * order + (np.take_along_axis(kinds, order, axis=-1) == FULL)
            width = max(1, kinds.shape[-1])
            lists = np.zeros(kinds.shape[:-1] + (width,), np.int32)
            columns = np.arange(kinds.shape[-1])
            lists[..., :kinds.shape[-1]] = np.where(columns < count[..., None], entries, 0)
            self._visits[key] = (xp.asarray(count.reshape(-1)), xp.asarray(lists.reshape(-1, width)),
                                 kinds.shape[-2])
        return self._visits[key]

    def entry_strides(self, nbatch: int) -> Tuple[int, ...]:
        """For each of a call's nbatch batch axes, the batch entries one step along it moves (0 where this mask's
        batch has size 1 or no such axis: its batch aligns with the call's trailing axes)."""
        strides, step = [], 1
        for size in reversed(self.batch):
            strides.append(step if size != 1 else 0)
            step *= size
        return (0,) * (nbatch - len(self.batch)) + tuple(reversed(strides))


def _over_tiles(kinds, reduce, axis: int, old: int, new: int, length: int):
    """kinds on tiles of `old` along `axis` reduced (np.minimum or np.maximum) over those each tile of `new` (of
    a `length` long axis) overlaps."""
    if old == new:
        return kinds
    tiles = -(-length // new)
    parts = []
    for t in range(tiles):
        lo, hi = t * new // old, (min((t + 1) * new, length) - 1) // old
        parts.append(reduce.reduce(np.take(kinds, range(lo, hi + 1), axis=axis), axis=axis, keepdims=True))
    if not parts:
        return np.take(kinds, [], axis=axis)
    return np.concatenate(parts, axis=axis)


def _lists(chosen):
    """(counts, indices) of the True entries along the last axis: counts (..., rows) int32, indices (..., rows,
    cols) int32, each row's tiles first in ascending order, the rest of the row 0 (FlexAttention's layout)."""
    counts = chosen.sum(axis=-1).astype(np.int32)
    order = np.argsort(~chosen, axis=-1, kind="stable").astype(np.int32)
    columns = np.arange(chosen.shape[-1])
    return counts, np.where(columns < counts[..., None], order, 0).astype(np.int32)


# ----------------------------------------------------------------------------------------------------------------
# Building one


def block_mask(mask_mod=None, batch_shape=(), n: Optional[int] = None, m: Optional[int] = None, *, mask=None,
               block: Optional[Tuple[int, int]] = None, device: Any = None) -> BlockMask:
    """The BlockMask of ``mask_mod(*idx, i, j)`` over ``(*batch_shape, n, m)``, or of a dense boolean ``mask=``.

    Evaluated a row of tiles at a time, never an (n, m) array; the tile kinds and lists are kept on the host (the
    kernels' copies go to each device once). Batch axes the pattern does not read are kept as size 1.

    Parameters
    ----------
    mask_mod : callable, optional
        ``mask_mod(*idx, i, j) -> bool``, as `cuflash.attention` takes it.
    batch_shape : tuple of int
        The batch axes of the calls it serves.
    n, m : int
        Queries and keys.
    mask : array_like of bool, optional
        Instead of mask_mod: a dense mask broadcastable to ``(*batch, n, m)``; its own shape gives the batch, n and m
        when they are not given.
    block : tuple of (int, int), optional
        ``(Br, Bc)`` tile sizes, default (128, 128).
    device : int or cupy.cuda.Device, optional
        Where mask_mod is evaluated: None on the CPU with NumPy, or a CUDA device (its number or a
        ``cupy.cuda.Device``) with CuPy, the arrays it closes over read there (a CuPy ``mask=`` is read on its own
        device).

    Returns
    -------
    BlockMask
        For every (query tile, key tile) of every batch entry, whether the pattern hides it, shows it whole or in part.

    Raises
    ------
    ValueError
        Neither or both of mask_mod and mask, sizes or tiles that cannot be.
    TypeError
        A mask_mod that cannot be traced, a mask that is not boolean.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> ids = np.repeat(np.arange(4), 128)[None]            # (B, n): 4 packed documents
    >>> def same_document(b, h, i, j):
    ...     return ids[b, i] == ids[b, j]
    >>> pattern = cuflash.block_mask(same_document, (1, 4), 512, 512)
    >>> pattern.shape, pattern.block, pattern.density       # the pattern reads no head: that axis is shared
    ((1, 1, 512, 512), (128, 128), 0.25)
    """
    br, bc = _check_block(block)
    if (mask_mod is None) == (mask is None):
        raise ValueError("block_mask: give a mask_mod or mask=, not both and not neither")
    if mask is not None:
        return _from_mask(mask if _module_of(mask) is not np else np.asarray(mask), batch_shape, n, m, br, bc)
    if n is None or m is None:
        raise TypeError("block_mask: give n and m (the query and key lengths) with a mask_mod")
    batch = _check_batch(batch_shape)
    n, m = _check_length(n, "n"), _check_length(m, "m")
    traced = mods.trace(mask_mod, "mask", len(batch))
    if device is None:
        return _from_mod(traced, batch, n, m, br, bc, mask_mod)
    import cupy
    with cupy.cuda.Device(device):
        return _from_mod(traced, batch, n, m, br, bc, mask_mod, cupy)


def _check_block(block):
    if block is None:
        return DEFAULT_BLOCK
    if not (isinstance(block, (tuple, list)) and len(block) == 2 and
            all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 1 for x in block)):
        raise ValueError(f"block_mask: block must be a pair (Br, Bc) of positive ints, got {block!r}")
    return int(block[0]), int(block[1])


def _check_batch(batch_shape):
    try:
        batch = tuple(int(s) for s in batch_shape)
    except TypeError:
        raise TypeError(f"block_mask: batch_shape must be a tuple of ints, got {batch_shape!r}") from None
    if any(s < 0 for s in batch):
        raise ValueError(f"block_mask: batch_shape {batch} has a negative size")
    return batch


def _check_length(x, name):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0:
        raise ValueError(f"block_mask: {name} must be a non-negative int, got {x!r}")
    return int(x)


def _from_mod(traced, batch, n, m, br, bc, function, xp=np):
    """The tile kinds of a traced mask_mod, evaluated with xp (NumPy, or CuPy on the current device)."""
    own = tuple(size if axis in traced.batch_axes else 1 for axis, size in enumerate(batch))
    tables = mods.prepared_tables(traced, xp, np.dtype(np.float64))
    rows, cols = -(-n // br), -(-m // bc)
    kinds = xp.zeros(own + (rows, cols), dtype=np.int8)
    chunk = max(bc, EVALUATED_ELEMENTS // max(1, br) // bc * bc)
    for entry in np.ndindex(*own):
        batch_index = [xp.asarray(x, dtype=np.int64) for x in entry]
        for t in range(rows):
            i0, i1 = t * br, min(n, (t + 1) * br)
            i = xp.arange(i0, i1, dtype=np.int64)[:, None]
            for j0 in range(0, m, chunk):
                j1 = min(m, j0 + chunk)
                j = xp.arange(j0, j1, dtype=np.int64)[None, :]
                shown = xp.broadcast_to(mods.evaluate(traced.expr, batch_index + [i, j], tables, np.float64, xp=xp,
                                                      what="mask_mod"), (i1 - i0, j1 - j0))
                kinds[entry + (t, slice(j0 // bc, -(-j1 // bc)))] = _kinds_of(shown, bc, xp)
    return BlockMask(_on_host(kinds, xp), own + (n, m), (br, bc), mask_mod=traced, function=function)


def _module_of(array):
    """CuPy for a CuPy array, NumPy for anything else."""
    if type(array).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def _on_host(kinds, xp):
    return kinds if xp is np else xp.asnumpy(kinds)


def _kinds_of(shown, bc, xp=np):
    """The kind of each tile of Bc columns of one row of tiles (the last may be narrower)."""
    rows, width = shown.shape
    pad = (-width) % bc
    any_ = xp.pad(shown, ((0, 0), (0, pad)), constant_values=False).reshape(rows, -1, bc).any(axis=(0, 2))
    all_ = xp.pad(shown, ((0, 0), (0, pad)), constant_values=True).reshape(rows, -1, bc).all(axis=(0, 2))
    return xp.where(all_, FULL, xp.where(any_, PARTIAL, HIDDEN)).astype(np.int8)


def _from_mask(mask, batch_shape, n, m, br, bc):
    if mask.dtype != np.bool_:
        raise TypeError(f"block_mask: mask must be a boolean array (True = attend), got {mask.dtype}")
    shape = (1,) * max(0, 2 - mask.ndim) + tuple(mask.shape)
    mask = mask.reshape(shape)
    n = shape[-2] if n is None else _check_length(n, "n")
    m = shape[-1] if m is None else _check_length(m, "m")
    if shape[-2] not in (1, n) or shape[-1] not in (1, m):
        raise ValueError(f"block_mask: mask of shape {tuple(mask.shape)} does not broadcast to (n, m) = ({n}, {m})")
    own = shape[:-2]
    if batch_shape:
        batch = _check_batch(batch_shape)
        try:
            np.broadcast_shapes(own, batch)
        except ValueError:
            raise ValueError(f"block_mask: mask of shape {tuple(mask.shape)} does not broadcast to the batch shape "
                             f"{batch}") from None
    xp = _module_of(mask)
    rows, cols = -(-n // br), -(-m // bc)
    kinds = xp.zeros(own + (rows, cols), dtype=np.int8)
    full = xp.broadcast_to(mask, own + (n, m))
    for entry in np.ndindex(*own):
        for t in range(rows):
            kinds[entry + (t,)] = _kinds_of(full[entry][t * br:(t + 1) * br], bc, xp)
    return BlockMask(_on_host(kinds, xp), own + (n, m), (br, bc), mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# The block mask of a call's mask_mod, made once and kept


_cache: "collections.OrderedDict[Any, BlockMask]" = collections.OrderedDict()
CACHE_SIZE = 16


def for_mod(traced, batch, n, m, block=DEFAULT_BLOCK, xp=np) -> BlockMask:
    """The block mask of a traced mask_mod for a call, kept by its expression, the call's sizes, the bytes of the
    arrays it reads (new contents make a new one) and, with CuPy (xp), the current device, where it is made."""
    digest = hashlib.blake2b(digest_size=16)
    for a in traced.arrays:
        a = _host_copy(a)
        digest.update(f"{a.dtype}{a.shape}".encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    device = None if xp is np else xp.cuda.Device().id
    key = (traced.key, tuple(batch), n, m, tuple(block), digest.hexdigest(), device)
    found = _cache.get(key)
    if found is not None:
        _cache.move_to_end(key)
        return found
    own = tuple(size if axis in traced.batch_axes else 1 for axis, size in enumerate(batch))
    made = _from_mod(traced, own, n, m, block[0], block[1], None, xp)
    _cache[key] = made
    if len(_cache) > CACHE_SIZE:
        _cache.popitem(last=False)
    return made


def _host_copy(array):
    """A captured array's contents on the host (a CuPy array's read back from its device)."""
    if _module_of(array) is not np:
        return _module_of(array).asnumpy(array)
    return mods.as_module_array(array, np)


def entries(mask: BlockMask, batch) -> Iterator[Tuple[Tuple[int, ...], Tuple[Any, ...]]]:
    """(entry of the block mask, the call's batch index it covers): an int where the mask has the axis, a slice
    of every item where it shares it (size 1 against more)."""
    lead = len(batch) - len(mask.batch)
    own = (1,) * lead + mask.batch
    for entry in np.ndindex(*own):
        index = tuple(slice(None) if size == 1 and full != 1 else e for e, size, full in zip(entry, own, batch))
        yield entry[lead:], index
