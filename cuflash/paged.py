"""A paged KV cache: cuflash.attention_paged, in FlashAttention's kvcache layout.

q (B, n, H, d); k_cache (num_pages, page_size, Hk, d), v_cache (num_pages, page_size, Hk, e); block_table
(B, max_pages) page ids and cache_seqlens (B,) keys already cached. Key j of sequence b is row j % page_size of page
block_table[b, j // page_size]. New keys and values (k_new, v_new) are written into their pages first, in place.
The call becomes one Problem of batch (B, Hk, G), G = H // Hk query heads per key head, whose k and v are views of
the caches (problem.Paged): the kernels walk each sequence's pages, the numpy backend gathers one sequence at a time.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import api, backends
from .dtypes import acc_dtype_of, describe, is_real_float, same_kind
from .family import check_precision
from .problem import Paged, Problem
from .varlen import grouped_mods, head_sinks

NAME = "attention_paged"
Array = Any


def attention_paged(q, k_cache, v_cache, block_table, cache_seqlens, /, *, k_new=None, v_new=None, scale=None,
                    causal=False, window=None, score_mod=None, mask_mod=None, sinks=None, out=None,
                    return_lse=False, backend: Optional[str] = None, num_splits: Optional[int] = None, block=None,
                    precision: Optional[str] = None):
    """Attention of new queries over keys and values kept in pages (a paged KV cache, as in serving).

    A generation server keeps keys and values in fixed-size pages shared by every sequence, not in one contiguous
    array each (FlashAttention's ``flash_attn_with_kvcache``, vLLM). Forward only: it serves, it does not train.

    Parameters
    ----------
    q : array_like
        ``(B, n, H, d)``.
    k_cache, v_cache : ndarray
        ``(num_pages, page_size, Hk, d)`` and ``(num_pages, page_size, Hk, e)``, of q's dtype (a cache is never cast,
        which would copy it), H a multiple of Hk (query head h reads key head ``h // (H // Hk)``); any page size of 1
        or more.
    block_table : array_like of int
        ``(B, max_pages)`` page ids: sequence b's key j is row ``j % page_size`` of page
        ``block_table[b, j // page_size]`` (pages in any order, shared pools; entries past a sequence's keys are
        never read, so vLLM's -1 padding is fine).
    cache_seqlens : int or array_like of int
        ``(B,)`` (or one int): the keys already cached.
    k_new, v_new : array_like, optional
        ``(B, n_new, Hk, d)`` and ``(B, n_new, Hk, e)``: written into the caches in place at positions
        ``cache_seqlens[b]`` on, before attending; sequence b's queries then see ``cache_seqlens[b] + n_new`` keys.
        cache_seqlens is not changed: add n_new to it for the next call.
    causal, window
        As `cuflash.attention`'s, aligned bottom-right with each sequence's keys (the new queries are its last
        positions).
    score_mod, mask_mod : callable, optional
        ``score_mod(score, b, h, i, j)``, ``mask_mod(b, h, i, j)``: as attention's, i the new query's index and j the
        key's position in its sequence.
    sinks : array_like, optional
        One logit per query head, ``(H,)`` or ``(B, H)``.
    num_splits : int, optional
        Split each sequence's keys into this many parts on the GPU backends (None: the planner's choice from the
        GPU's SM count; the numpy backend ignores it).
    out : ndarray, optional
        ``(B, n, H, e)``, as attention's ``out=``.
    return_lse : bool, optional
        Also return lse.
    scale, backend, block, precision
        As attention's.

    Returns
    -------
    out : ndarray
        ``(B, n, H, e)``.
    lse : ndarray
        ``(B, n, H)`` in the accumulation type, with ``return_lse=True`` (what `cuflash.merge` takes, to join another
        key set's).

    Raises
    ------
    ValueError
        A page id the sequence's keys (cached or new) use that is not a page of the caches, ``cache_seqlens + n_new``
        past the table's pages, a negative length, caches of another shape, new rows of the wrong shape, a read-only
        cache to append to; checked before anything is written (on a GPU one small reduction read back), so a page id
        never reads or writes outside the cache.
    TypeError
        Caches of another dtype than q's, a table that is not integers.

    Examples
    --------
    A decoding loop, one token per step (the cache holds 40 pages of 16 rows, shared by the batch):

    >>> import numpy as np
    >>> import cuflash
    >>> rng = np.random.default_rng(5)
    >>> batch, heads, kv_heads, d, page = 2, 8, 2, 64, 16
    >>> k_cache = np.zeros((40, page, kv_heads, d), np.float32)
    >>> v_cache = np.zeros((40, page, kv_heads, d), np.float32)
    >>> block_table = rng.permutation(40).reshape(batch, 20)    # each sequence's pages, in any order
    >>> lengths = np.array([0, 0])
    >>> for step in range(3):
    ...     q = rng.standard_normal((batch, 1, heads, d), dtype=np.float32)
    ...     k_new, v_new = (rng.standard_normal((batch, 1, kv_heads, d), dtype=np.float32) for _ in range(2))
    ...     out = cuflash.attention_paged(q, k_cache, v_cache, block_table, lengths, k_new=k_new, v_new=v_new)
    ...     lengths += 1                                         # the new rows are in the cache now
    >>> out.shape
    (2, 1, 8, 64)
    """
    xp = api.array_module(q, k_cache, v_cache, None, None, None, sinks=sinks)
    with api.device_of(xp, (q, k_cache, v_cache)):
        return_lse = api.check_flag(return_lse, "return_lse")
        q, k_cache, v_cache = operands(xp, q, k_cache, v_cache)
        pages = page_arguments(xp, q, k_cache, block_table, cache_seqlens)
        new = new_rows(xp, q, k_cache, v_cache, k_new, v_new)
        seqlens, longest = checked_key_counts(xp, k_cache, pages, new)
        if new is not None:
            append(xp, k_cache, v_cache, pages, new)
        problem = paged_problem(xp, q, k_cache, v_cache, pages[0], seqlens, longest, scale, causal, window,
                                score_mod, mask_mod, sinks, precision, splits(num_splits))
        runner = backends.get(backend, xp)
        rows = q.shape[:3]
        result, target = api.output_for(problem, out, (q, k_cache, v_cache), rows + (v_cache.shape[3],), NAME)
        lse = xp.empty(rows, dtype=problem.acc_dtype) if return_lse else None
        if not problem.empty:
            runner.run(problem, queries(result, problem.batch),
                       None if lse is None else queries(lse, problem.batch), block=block)
        if target is not None and target is not result:
            xp.copyto(target, result, casting="unsafe")  # same_kind was checked in api.output_for
            result = target
        return (result, lse) if return_lse else result


def queries(x, batch: Tuple[int, ...]):
    """(B, n, H, *cols) -> the Problem's (B, Hk, G, n, *cols) view."""
    whole = x.reshape(tuple(x.shape[:2]) + batch[1:] + tuple(x.shape[3:]))
    return whole.transpose((0, 2, 3, 1) + tuple(range(4, whole.ndim)))


def operands(xp, q, k_cache, v_cache):
    """q and the caches checked: 4-D, one real floating dtype, shapes that agree. The caches stay the caller's
    arrays (new keys are written into them), never copies."""
    q = api.as_array(q, xp, "q")
    for x, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        api.refuse_masked_array(x, name)
        if not isinstance(x, xp.ndarray):
            raise TypeError(f"{NAME}: {name} must be a {xp.__name__}.ndarray like q (the cache attention reads and "
                            f"appends to), got {type(x).__name__}")
        if not x.dtype.isnative:
            raise TypeError(f"{NAME}: {name} holds non-native byte order ({x.dtype.str}); keep caches in native "
                            f"order (x.astype(x.dtype.newbyteorder('=')))")
    layouts = ((q, "q", "(B, n, H, d)"), (k_cache, "k_cache", "(num_pages, page_size, Hk, d)"),
               (v_cache, "v_cache", "(num_pages, page_size, Hk, e)"))
    for x, name, layout in layouts:
        if x.ndim != 4:
            raise ValueError(f"{NAME}: {name} must be 4-D {layout}, got shape {tuple(x.shape)}")
        if not is_real_float(x.dtype):
            raise TypeError(f"{NAME}: {name} must be a real floating array, got {describe(x.dtype)}")
    if k_cache.dtype != v_cache.dtype or q.dtype != k_cache.dtype:
        raise TypeError(f"{NAME}: q ({describe(q.dtype)}), k_cache ({describe(k_cache.dtype)}) and v_cache "
                        f"({describe(v_cache.dtype)}) must share one dtype (a cache is never cast: that would copy "
                        f"it); cast q with q.astype(k_cache.dtype)")
    api.check_bfloat16_support(xp, [q.dtype])
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"{NAME}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the "
                         f"same pages, page size and heads (num_pages, page_size, Hk)")
    if q.shape[3] != k_cache.shape[3]:
        raise ValueError(f"{NAME}: q's head dim {q.shape[3]} differs from k_cache's {k_cache.shape[3]}")
    heads, kv_heads = q.shape[2], k_cache.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{NAME}: q's {heads} heads must be a multiple of the caches' {kv_heads} (grouped-query "
                         f"attention: each key head serves H // Hk query heads)")
    if k_cache.shape[1] == 0:
        raise ValueError(f"{NAME}: the caches' pages hold no rows (page_size 0); a page holds 1 row or more")
    for x, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if any(s % x.dtype.itemsize for s in x.strides):
            raise ValueError(f"{NAME}: {name}'s strides {x.strides} are not whole elements; pass a cache whose "
                             f"strides are")
    return q, k_cache, v_cache


def page_arguments(xp, q, k_cache, block_table, cache_seqlens):
    """(block_table, cache_seqlens) as contiguous int64 arrays of xp, (B, max_pages) and (B,)."""
    batch = q.shape[0]
    table = integers(xp, block_table, "block_table")
    if table.ndim != 2 or table.shape[0] != batch:
        raise ValueError(f"{NAME}: block_table must be 2-D (B, max_pages) with q's B = {batch} rows, got shape "
                         f"{tuple(table.shape)}")
    counts = integers(xp, cache_seqlens, "cache_seqlens")
    if counts.ndim == 0:
        counts = xp.full((batch,), counts, dtype=np.int64)
    if counts.shape != (batch,):
        raise ValueError(f"{NAME}: cache_seqlens must be one int or 1-D (B,) with q's B = {batch}, got shape "
                         f"{tuple(counts.shape)}")
    return xp.ascontiguousarray(table), xp.ascontiguousarray(counts)


def integers(xp, x, name):
    """x as an int64 array of xp (host arrays are copied to a GPU's); a CuPy array beside NumPy operands, or
    anything not integer, is an error."""
    if api.module_name(x) == "cupy" and xp is np:
        raise TypeError(f"{NAME}: {name} is a CuPy array but q and the caches are NumPy arrays; pass it with "
                        f"cupy.asnumpy, or the others with cupy.asarray")
    if not hasattr(x, "dtype"):
        x = np.asarray(x)
        x = x.astype(np.int64) if x.size == 0 else x
    if x.dtype.kind not in "iu":
        raise TypeError(f"{NAME}: {name} must hold integers, got {describe(x.dtype)}")
    return xp.asarray(x, dtype=np.int64)


def new_rows(xp, q, k_cache, v_cache, k_new, v_new):
    """(k_new, v_new) checked against the caches, or None."""
    if (k_new is None) != (v_new is None):
        raise ValueError(f"{NAME}: give both k_new and v_new, or neither")
    if k_new is None:
        return None
    k_new, v_new = api.as_array(k_new, xp, "k_new"), api.as_array(v_new, xp, "v_new")
    batch, kv_heads = q.shape[0], k_cache.shape[2]
    for x, name, cache in ((k_new, "k_new", k_cache), (v_new, "v_new", v_cache)):
        wanted = (batch, x.shape[1] if x.ndim == 4 else None, kv_heads, cache.shape[3])
        if x.ndim != 4 or tuple(x.shape) != wanted:
            cols = "d" if name == "k_new" else "e"
            raise ValueError(f"{NAME}: {name} must be (B, n_new, Hk, {cols}) = ({batch}, n_new, {kv_heads}, "
                             f"{cache.shape[3]}), got shape {tuple(x.shape)}")
        if not same_kind(x.dtype, cache.dtype):
            raise TypeError(f"{NAME}: cannot write {name} of {describe(x.dtype)} into a cache of "
                            f"{describe(cache.dtype)} with casting rule 'same_kind'")
    if k_new.shape[1] != v_new.shape[1]:
        raise ValueError(f"{NAME}: k_new has {k_new.shape[1]} new rows and v_new {v_new.shape[1]}; they must agree")
    if xp is np and not (k_cache.flags.writeable and v_cache.flags.writeable):
        raise ValueError(f"{NAME}: the caches are read-only, so k_new and v_new cannot be written into them")
    return k_new, v_new


def checked_key_counts(xp, k_cache, pages, new):
    """(each sequence's keys: cache_seqlens + n_new, int64 of xp; the most), once the page table is checked for
    them: no negative count, no key past the table's pages, every page id those keys use within the caches (one
    reduction, read back once from a GPU)."""
    table, cached = pages
    num_pages, size = k_cache.shape[:2]
    seqlens = cached + (0 if new is None else new[0].shape[1])
    used = xp.arange(table.shape[1])[None, :] < (-(-seqlens // size))[:, None]
    bad = used & ((table < 0) | (table >= num_pages))
    zero = xp.zeros((), np.int64)
    facts = xp.stack([cached.min() if cached.size else zero, seqlens.max() if seqlens.size else zero,
                      bad.sum(), xp.argmax(bad) if bad.size else zero])
    least, longest, wrong, first = (int(f) for f in (facts if xp is np else facts.get()))
    capacity = table.shape[1] * size
    if capacity >= 2**31:
        raise ValueError(f"{NAME}: block_table's {table.shape[1]} pages of {size} rows would give a sequence 2^31 "
                         f"keys or more; give it fewer pages per row")
    if least < 0:
        raise ValueError(f"{NAME}: cache_seqlens must be 0 or more, got {least}")
    if longest > capacity:
        raise ValueError(f"{NAME}: a sequence needs {longest} keys (cache_seqlens + n_new) but block_table's "
                         f"{table.shape[1]} pages of {size} rows hold {capacity}; give more pages per row")
    if wrong:
        b, slot = divmod(first, table.shape[1])
        page = int(table[b, slot])
        raise ValueError(f"{NAME}: block_table[{b}, {slot}] = {page} is not a page of the caches (0 to "
                         f"{num_pages - 1}), and sequence {b}'s keys use it ({wrong} such entries in all)")
    return seqlens, longest


def append(xp, k_cache, v_cache, pages, new) -> None:
    """k_new and v_new into their pages, in place: row t of sequence b at position cache_seqlens[b] + t."""
    table, cached = pages
    k_new, v_new = new
    size = k_cache.shape[1]
    position = cached[:, None] + xp.arange(k_new.shape[1])[None, :]
    page = xp.take_along_axis(table, position // size, axis=1)
    k_cache[page, position % size] = k_new
    v_cache[page, position % size] = v_new


def splits(num_splits) -> Optional[int]:
    if num_splits is None:
        return None
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (int, np.integer)) or num_splits < 1:
        raise ValueError(f"{NAME}: num_splits must be a positive int or None, got {num_splits!r}")
    return int(num_splits)


def paged_problem(xp, q, k_cache, v_cache, table, seqlens, longest, scale, causal, window, score_mod, mask_mod,
                  sinks, precision, num_splits) -> Problem:
    batch = (q.shape[0], k_cache.shape[2], q.shape[2] // k_cache.shape[2])
    dtype = q.dtype
    traced = grouped_mods(score_mod, mask_mod, batch[2])
    paged = Paged(table, seqlens, k_cache.shape[1], k_cache, v_cache, num_splits)
    return Problem(
        q=queries(q, batch), k=Paged.view(k_cache, batch), v=Paged.view(v_cache, batch), mask=None, bias=None,
        batch=batch, n=q.shape[1], m=longest, d=q.shape[3], e=v_cache.shape[3], dtype=dtype,
        acc_dtype=acc_dtype_of(dtype), scale=api.check_scale(scale, q.shape[3]),
        window=api.visibility_window(window, causal), xp=xp, precision=check_precision(precision, dtype, NAME),
        score_mod=traced["score_mod"], mask_mod=traced["mask_mod"],
        sinks=None if sinks is None else head_sinks(xp, sinks, batch, dtype, NAME), paged=paged)
