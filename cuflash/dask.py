"""cuflash.dask: attention over Dask arrays, on Dask's own schedulers (threads, processes, dask.distributed).

The graph is FlashAttention's split of the key axis, one level up: each (query chunk, key chunk) pair that the
visibility leaves anything to see is one task calling cuflash.attention on its chunks, giving a partial output and
logsumexp; the parts of a query chunk merge by their logsumexps (cuflash.merge) in a tree of split_every parts
per task. Batch chunks are independent; a chunk broadcast along a batch axis (a size-1 head axis of k and v) is
the same input of every task that uses it, never copied. Each task holds its chunks and one (query chunk, e)
output at most: the n x m scores never exist, not even per chunk pair.
"""

from __future__ import annotations

import dataclasses

import functools
import itertools
import operator
from typing import Any, Dict, List, Optional, Tuple

import dask
import dask.array as da
import numpy as np
from dask.array.core import common_blockdim
from dask.array.utils import meta_from_array
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from . import api, dropout, blockmask, mods
from .blockmask import BlockMask
from .dtypes import acc_dtype_of
from .merging import array_module, merge
from .problem import Window

__all__ = ["attention"]

NAME = "cuflash.dask.attention"


def attention(q, k, v, /, *, scale=None, causal=False, window=None, mask=None, bias=None, score_mod=None,
              mask_mod=None, block_mask=None, sinks=None, dropout_p=0.0, seed=None, return_lse=False, backend=None,
              block=None, precision: Optional[str] = None, split_every: Optional[int] = None):
    """`cuflash.attention` on Dask arrays (any operand may also be a NumPy or CuPy array): lazy.

    Each (query chunk, key chunk) pair is one task calling `cuflash.attention` on its chunks; a query chunk's parts
    merge with `cuflash.merge` in a tree of split_every parts per task, so no n x m block exists anywhere. Key chunks
    that the window or ``causal=`` hide from a whole query chunk make no task. The head dims d and e are rechunked to
    one chunk each, the key axis of v, mask and bias to k's chunks, and the query axis of mask and bias to q's. Each
    task runs the backend its chunks' type picks (NumPy chunks: numpy, CuPy chunks: cupy) unless ``backend=`` forces
    one. There is no backward on Dask arrays; `cuflash.torch` is the way to train.

    Parameters
    ----------
    q, k, v : dask.array.Array or array_like
        As `cuflash.attention`'s operands; chunk sizes must be known.
    scale, causal, window, mask, bias, sinks, return_lse, backend, block, precision
        `cuflash.attention`'s keywords (no ``out=``: a Dask array is never written in place), with the same meaning.
    score_mod, mask_mod : callable, optional
        As attention's; they see global indices (each task's chunk offsets added).
    block_mask : BlockMask, optional
        Made from a mask_mod: a chunk pair whose tiles it hides makes no task (``mask_mod=`` alone prunes nothing).
    dropout_p, seed
        Dropout keeps the elements cuflash.attention keeps on the whole arrays (each task's chunk placed in them; a
        seed drawn for ``seed=None`` is drawn once, for the graph).
    split_every : int, optional
        How many partial results of a query chunk one merge task takes (default Dask's config "split_every", else 4).

    Returns
    -------
    out : dask.array.Array
        Chunked as q along the query axis, and along each batch axis as the common refinement of the operands'
        chunks there.
    lse : dask.array.Array
        With ``return_lse=True``; the sinks join each query chunk's merged result once.

    Raises
    ------
    ValueError
        As `cuflash.attention`'s, chunks of unknown size, ``out=``.
    TypeError
        As `cuflash.attention`'s.

    Examples
    --------
    >>> import dask.array as da
    >>> import numpy as np
    >>> import cuflash
    >>> import cuflash.dask
    >>> rng = np.random.default_rng(3)
    >>> q, k, v = (da.from_array(rng.standard_normal((2, 1024, 32), dtype=np.float32), chunks=(1, 256, 32))
    ...            for _ in range(3))
    >>> out = cuflash.dask.attention(q, k, v, causal=True)    # lazy: 10 chunk-pair tasks per batch chunk, not 16
    >>> result = out.compute()                               # Dask's scheduler, or a dask.distributed Client's
    >>> bool(np.allclose(result, cuflash.attention(q.compute(), k.compute(), v.compute(), causal=True), atol=1e-5))
    True
    """
    return_lse = api.check_flag(return_lse, "return_lse")
    operands = [as_dask(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v"), (mask, "mask"), (bias, "bias"))]
    batch, n, m, d, e, dtype = api.core_sizes(*operands)
    xp = api.array_module(*(None if x is None else x._meta for x in operands))  # NumPy and CuPy chunks never mix
    api.check_bfloat16_support(xp, [x.dtype for x in operands if x is not None])
    settings = dict(scale=api.check_scale(scale, d), backend=backend, block=block,
                    precision=api.check_precision(precision, dtype, NAME))
    chunked = Chunked.of(operands, batch)
    patterns = Patterns.of(score_mod, mask_mod, block_mask, sinks, batch, n, m, dtype, xp,
                           dropout.check(dropout_p, seed, NAME))
    graph = Graph(chunked, n, m, api.visibility_window(window, causal), settings, merge_fan_in(split_every),
                  patterns)
    out, lse = graph.arrays(dtype)
    return (out, lse) if return_lse else out


def as_dask(x, name):
    """x as a Dask array with known chunk sizes (None stays None)."""
    if x is None:
        return None
    api.refuse_masked_array(x, name)
    if not isinstance(x, da.Array):
        x = da.asarray(x)
    if any(np.isnan(size) for size in x.shape):
        raise ValueError(f"{NAME}: {name} has unknown chunk sizes (shape {x.shape}); call "
                         f"{name}.compute_chunk_sizes() first, or give it known chunks")
    return x


def merge_fan_in(split_every):
    fan_in = dask.config.get("split_every", 4) if split_every is None else split_every
    if isinstance(fan_in, (bool, np.bool_)) or not isinstance(fan_in, (int, np.integer)) or fan_in < 2:
        raise ValueError(f"{NAME}: split_every must be an int of at least 2 (partial results per merge task), "
                         f"got {fan_in!r}")
    return int(fan_in)


# ----------------------------------------------------------------------------------------------------------------
# Patterns: mods with global indices, the sinks, the block mask's pruning


class Patterns:
    """score_mod and mask_mod (traced once here, so a mod that cannot be traced fails at once), the sinks
    broadcast to the batch (in the accumulation type) and the block mask, as the graph uses them."""

    def __init__(self, score_mod, mask_mod, block_mask, sinks, dropping=None):
        self.score_mod, self.mask_mod, self.block_mask, self.sinks = score_mod, mask_mod, block_mask, sinks
        self.dropping = dropping  # the whole call's dropout (cuflash.dropout.Dropout), or None

    @classmethod
    def of(cls, score_mod, mask_mod, block_mask, sinks, batch, n, m, dtype, xp, dropping=(0.0, None)):
        for fn, kind in ((score_mod, "score"), (mask_mod, "mask")):
            if fn is not None:
                mods.trace(fn, kind, len(batch))
        if block_mask is not None:
            if not isinstance(block_mask, BlockMask):
                raise TypeError(f"{NAME}: block_mask must be a cuflash.BlockMask, got {type(block_mask).__name__}")
            block_mask.check_for(batch, n, m, NAME)
            if block_mask.function is None:
                raise TypeError(f"{NAME}: a block mask made from mask= cannot be split into chunks; pass the "
                                f"mask as mask= (a Dask array), or make the block mask from a mask_mod")
            if mask_mod is not None and mask_mod is not block_mask.function:
                raise ValueError(f"{NAME}: block_mask= was made from another mask_mod than mask_mod=")
            mask_mod = block_mask.function
        if sinks is not None:
            sinks = api.pattern_fields(api.Patterns(sinks=sinks), batch, n, m, dtype, xp)["sinks"]
        p, seed = dropping
        return cls(score_mod, mask_mod, block_mask, sinks,
                   dropout.Dropout(p, seed, dropout.row_major(batch)) if p > 0 else None)

    def shown(self, block_starts, block_shape, rows, cols) -> bool:
        """Whether the block mask shows any tile of the batch block's items x rows x cols (True without one)."""
        if self.block_mask is None:
            return True
        bm = self.block_mask
        lead = len(block_starts) - len(bm.batch)
        index = tuple(slice(0, 1) if size == 1 else slice(start, start + count)
                      for start, count, size in zip(block_starts[lead:], block_shape[lead:], bm.batch))
        br, bc = bm.block
        tiles = bm.kinds[index][..., rows[0] // br:-(-rows[1] // br), cols[0] // bc:-(-cols[1] // bc)]
        return bool((tiles != blockmask.HIDDEN).any())

    def for_pair(self, block_starts, i0, j0):
        """The mods and the dropout of one chunk pair's task: the indices it sees shifted to the global ones."""
        placed = None
        if self.dropping is not None:
            base = sum(start * stride for start, stride in zip(block_starts, self.dropping.strides))
            placed = dataclasses.replace(self.dropping, base=base, row0=i0, key0=j0)
        return {"score_mod": shifted(self.score_mod, True, block_starts, i0, j0),
                "mask_mod": shifted(self.mask_mod, False, block_starts, i0, j0), "dropout": placed}

    def sinks_of(self, block_starts, block_shape):
        if self.sinks is None:
            return None
        return self.sinks[tuple(slice(s, s + c) for s, c in zip(block_starts, block_shape))]


def shifted(fn, takes_score, block_starts, i0, j0):
    """fn of a chunk pair's local indices, calling it with the global ones. The offsets are an array the mod
    reads, not numbers in it: every chunk pair traces one expression, so the kernels compile once per graph's
    mod, not once per chunk pair."""
    if fn is None:
        return None
    starts = np.array(tuple(block_starts) + (i0, j0), dtype=np.int64)

    def move(idx):
        return tuple(x + starts[axis] for axis, x in enumerate(idx))
    if takes_score:
        return lambda score, *idx: fn(score, *move(idx))
    return lambda *idx: fn(*move(idx))


# ----------------------------------------------------------------------------------------------------------------
# Operands chunked to match


class Chunked:
    """q, k, v, mask, bias with the batch rank padded by size-1 axes and chunks that line up: batch axes as one
    common chunking (an operand of size 1 on an axis keeps its one chunk and is broadcast), the query axis as q's,
    the key axis as k's, d and e whole."""

    def __init__(self, operands, batch, batch_chunks):
        self.q, self.k, self.v, self.mask, self.bias = operands
        self.batch = batch
        self.batch_chunks = batch_chunks

    @classmethod
    def of(cls, operands, batch):
        operands = [None if x is None else pad_batch(x, len(batch)) for x in operands]
        present = [x for x in operands if x is not None]
        batch_chunks = tuple(common_blockdim([x.chunks[a] for x in present if x.shape[a] == size]) if size != 1
                             else (1,) for a, size in enumerate(batch))
        q, k, v, mask, bias = operands
        rows, cols = q.chunks[-2], k.chunks[-2]
        aligned = [rechunk(q, batch_chunks, rows, (q.shape[-1],)), rechunk(k, batch_chunks, cols, (k.shape[-1],)),
                   rechunk(v, batch_chunks, cols, (v.shape[-1],))]
        aligned += [None if x is None else rechunk(x, batch_chunks, rows, cols) for x in (mask, bias)]
        return cls(aligned, batch, batch_chunks)

    @property
    def present(self) -> List[Any]:
        return [x for x in (self.q, self.k, self.v, self.mask, self.bias) if x is not None]

    def block_indices(self):
        return itertools.product(*(range(len(chunks)) for chunks in self.batch_chunks))

    def key(self, x, batch_index, row, col):
        """x's chunk for a batch block, query chunk `row` and key chunk `col` (q: col is its d chunk 0; k, v:
        row is theirs): index 0 along each axis x broadcasts."""
        if x is None:
            return None
        index = tuple(i if x.shape[a] != 1 else 0 for a, i in enumerate(batch_index))
        last = [row if len(x.chunks[-2]) > 1 else 0, col if len(x.chunks[-1]) > 1 else 0]
        return (x.name,) + index + tuple(last)

    def block_batch_shape(self, batch_index):
        return tuple(chunks[i] for chunks, i in zip(self.batch_chunks, batch_index))

    def block_starts(self, batch_index):
        """The global index of the batch block's first item along each batch axis."""
        return tuple(sum(chunks[:i]) for chunks, i in zip(self.batch_chunks, batch_index))


def pad_batch(x, rank):
    """x with leading size-1 axes up to `rank` batch axes (a mask or bias of fewer than 2 dims padded to 2)."""
    core = max(2, x.ndim) - x.ndim
    missing = rank + 2 - (x.ndim + core)
    return x[(None,) * (missing + core)] if missing + core else x


def rechunk(x, batch_chunks, rows, cols):
    """x rechunked to the batch chunks on its non-broadcast axes, `rows` (if it has that many rows) and `cols`."""
    target = [chunks if x.shape[a] != 1 else (1,) for a, chunks in enumerate(batch_chunks)]
    target += [rows if x.shape[-2] == sum(rows) else x.chunks[-2], cols if x.shape[-1] == sum(cols) else x.chunks[-1]]
    return x.rechunk(tuple(target))


# ----------------------------------------------------------------------------------------------------------------
# The graph


class Graph:
    """Tasks per batch block and query chunk: one per visible key chunk, a tree of merges, and the result."""

    def __init__(self, chunked: Chunked, n: int, m: int, window: Window, settings: Dict[str, Any], fan_in: int,
                 patterns: Patterns):
        self.c, self.n, self.m, self.window, self.settings, self.fan_in = chunked, n, m, window, settings, fan_in
        self.patterns = patterns
        token = tokenize(*chunked.present, n, m, window, settings, fan_in, patterns.score_mod, patterns.mask_mod,
                         patterns.sinks)
        self.parts_name = f"cuflash-attention-parts-{token}"
        self.out_name = f"cuflash-attention-{token}"
        self.lse_name = f"cuflash-attention-lse-{token}"
        self.parts: Dict[Any, Any] = {}

    def arrays(self, dtype):
        """The out and lse Dask arrays of this graph."""
        outs, lses = {}, {}
        rows = self.c.q.chunks[-2]
        for b in self.c.block_indices():
            for i, (start, size) in enumerate(zip(offsets(rows), rows)):
                result = self.result_of(b, i, start, size, dtype)
                outs[(self.out_name,) + b + (i, 0)] = (operator.getitem, result, 0)
                lses[(self.lse_name,) + b + (i,)] = (operator.getitem, result, 1)
        graph = self.high_level_graph(outs, lses)
        e = self.c.v.shape[-1]
        acc = acc_dtype_of(dtype)
        meta = self.c.q._meta
        out = da.Array(graph, self.out_name, self.c.batch_chunks + (rows, (e,)),
                       meta=meta_from_array(meta, len(self.c.batch) + 2, dtype=dtype))
        lse = da.Array(graph, self.lse_name, self.c.batch_chunks + (rows,),
                       meta=meta_from_array(meta, len(self.c.batch) + 1, dtype=acc))
        return out, lse

    def result_of(self, b, i, start, size, dtype):
        """The key of (out, lse) for batch block b and query chunk i: its parts merged, cast to dtype."""
        parts = self.visible_parts(b, i, start, size)
        sinks = self.patterns.sinks_of(self.c.block_starts(b), self.c.block_batch_shape(b))
        if not parts:
            shape = self.c.block_batch_shape(b) + (size,)
            key = (self.parts_name, "hidden") + b + (i,)
            task = functools.partial(hidden_rows, shape=shape, e=self.c.v.shape[-1], dtype=dtype, sinks=sinks)
            self.parts[key] = (task, self.c.key(self.c.q, b, i, 0))
            return key
        level = 0
        while len(parts) > 1:
            groups = [parts[g:g + self.fan_in] for g in range(0, len(parts), self.fan_in)]
            parts = []
            for g, group in enumerate(groups):
                if len(group) == 1:  # carried up a level as it is
                    parts.append(group[0])
                    continue
                key = (self.parts_name, f"merge-{level}") + b + (i, g)
                self.parts[key] = (merge_parts, group)
                parts.append(key)
            level += 1
        key = (self.parts_name, "result") + b + (i,)
        self.parts[key] = (functools.partial(finish, dtype=dtype, sinks=sinks), parts[0])
        return key

    def visible_parts(self, b, i, start, size):
        """One task per key chunk that some query of rows [start, start + size) sees."""
        first, last = self.window.key_range(start, start + size, self.n, self.m)
        keys = []
        cols = self.c.k.chunks[-2]
        starts, shape = self.c.block_starts(b), self.c.block_batch_shape(b)
        for j, (col, width) in enumerate(zip(offsets(cols), cols)):
            if size == 0 or width == 0 or col + width <= first or col >= last:
                continue
            if not self.patterns.shown(starts, shape, (start, start + size), (col, col + width)):
                continue
            key = (self.parts_name, "pair") + b + (i, j)
            sides = self.local_window(start, size, col, width)
            c = self.c
            # constants go in a partial: a tuple among a task's arguments could read as a key or a task
            task = functools.partial(attend_pair, window=sides, settings=self.settings,
                                     patterns=self.patterns.for_pair(starts, start, col))
            self.parts[key] = (task, c.key(c.q, b, i, 0), c.key(c.k, b, j, 0), c.key(c.v, b, j, 0),
                               c.key(c.mask, b, i, j), c.key(c.bias, b, i, j))
            keys.append(key)
        return keys

    def local_window(self, start, size, col, width) -> Optional[Tuple[Optional[int], Optional[int]]]:
        """The window of the global one seen from a chunk pair (rows from `start`, keys from `col`), or None
        when it hides nothing there: key j' is visible to query i' when j - i = (col + j') - (start + i') lies in
        the global band [m - n - left, m - n + right]."""
        if self.window.tile_fully_visible(start, start + size, col, col + width, self.n, self.m):
            return None
        shift = (self.m - self.n) - (width - size) + start - col
        left, right = self.window.left, self.window.right
        return (None if left is None else left - shift, None if right is None else right + shift)

    def high_level_graph(self, outs, lses):
        inputs = self.c.present
        graph = HighLevelGraph.merge(*[x.__dask_graph__() for x in inputs])
        layers = dict(graph.layers)
        dependencies = dict(graph.dependencies)
        layers[self.parts_name] = self.parts
        dependencies[self.parts_name] = {x.name for x in inputs}
        for name, layer in ((self.out_name, outs), (self.lse_name, lses)):
            layers[name] = layer
            dependencies[name] = {self.parts_name}
        return HighLevelGraph(layers, dependencies)


def offsets(chunks):
    return itertools.accumulate((0,) + tuple(chunks[:-1]))


# ----------------------------------------------------------------------------------------------------------------
# Tasks


def attend_pair(q, k, v, mask, bias, window, settings, patterns):
    """(out, lse) of a query chunk over one key chunk, out in the accumulation type for the merges (the front
    door's own steps, its dropout placed in the whole call)."""
    placed = patterns["dropout"]
    xp = api.array_module(q, k, v, mask, bias, None)
    with api.device_of(xp, (q, k, v, mask, bias)):
        chosen = api.Patterns(patterns["score_mod"], patterns["mask_mod"],
                              dropout=(0.0, None) if placed is None else placed)
        out, lse = api._attention(xp, q, k, v, settings["scale"], False, window, mask, bias, chosen, None, True,
                                  settings["backend"], settings["block"], settings["precision"])
    return out.astype(lse.dtype, copy=False), lse


def merge_parts(parts):
    return merge([out for out, _ in parts], [lse for _, lse in parts])


def finish(part, dtype, sinks=None):
    """The merged (out, lse) of a query chunk in dtype; with sinks, the sink joins it once: lse' = log(exp(lse) +
    exp(sink)), and out, which the sink adds no value to, is weighted by exp(lse - lse')."""
    out, lse = part
    if sinks is not None:
        xp = array_module([out])
        total = xp.logaddexp(lse, sinks[..., None].astype(lse.dtype))
        with np.errstate(invalid="ignore"):
            weight = xp.where(total == -np.inf, 0, xp.exp(lse - total))
        out, lse = out * weight[..., None], total
    return out.astype(dtype, copy=False), lse


def hidden_rows(q, shape, e, dtype, sinks=None):
    """A query chunk that sees no key: output 0 and lse -inf (the sink's logit with sinks), as attention gives,
    in q's array module."""
    xp = array_module([q])
    lse = xp.full(shape, -np.inf, dtype=acc_dtype_of(dtype))
    if sinks is not None:
        lse = xp.broadcast_to(sinks[..., None], shape).astype(lse.dtype)
    return xp.zeros(shape + (e,), dtype=dtype), lse
