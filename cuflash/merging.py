"""Merging attention over disjoint key sets: the outputs and logsumexps of the same queries, each over its own
keys, give the output and logsumexp over their union (FlashAttention's split of the key axis). The kernels' split
keys use combine(); cuflash.merge is the same rule at the front door, for users who shard attention their own way
(ring attention, pipelines, several devices).
"""

from __future__ import annotations

from typing import Any, Sequence, Tuple

import numpy as np

from .dtypes import acc_dtype_of, common_dtype, is_real_float

NAME = "merge"


def combine(parts_out, parts_lse, out, lse, xp) -> None:
    """Merge parts stacked on axis 0 (each normalized by its own sum, with its own lse) into out and lse (lse
    may be None): weights exp(lse_s - lse), lse = log sum exp(lse_s). A part with lse -inf saw no key and
    contributes nothing, whatever its output holds (by selection); a row no part saw gives 0 and -inf; NaN
    propagates."""
    top = parts_lse.max(axis=0)
    shift = xp.where(top == -xp.inf, 0, top)
    weights = xp.exp(parts_lse - shift)
    total = weights.sum(axis=0)
    with np.errstate(invalid="ignore"):  # 0 * inf of a part that saw nothing: selected away
        weighted = xp.where((parts_lse == -xp.inf)[..., None], 0, weights[..., None] * parts_out)
    out[...] = weighted.sum(axis=0) / xp.where(total == 0, 1, total)[..., None]
    if lse is not None:
        with np.errstate(divide="ignore"):  # log(0) = -inf: nothing visible
            lse[...] = xp.log(total) + shift


def merge(outputs: Sequence[Any], lses: Sequence[Any]) -> Tuple[Any, Any]:
    """(out, lse) of the same queries over the union of disjoint key sets, from each set's (out_s, lse_s).

    Each part weighs exp(lse_s - lse): exact up to rounding, associative and independent of the parts' order. A
    part with lse -inf (no visible key) counts for nothing, and a row no part saw gives 0 and -inf, as attention
    does. The kernels' split keys merge with the same code.

    Parameters
    ----------
    outputs : sequence of arrays, or array
        Each part's out, ``(*batch, n, e)``, as ``cuflash.attention(..., return_lse=True)`` gives them, or the parts
        stacked on a leading axis. Batch dimensions broadcast.
    lses : sequence of arrays, or array
        Each part's lse, ``(*batch, n)``, likewise.

    Returns
    -------
    out : ndarray
        In the outputs' result dtype. 16-bit parts were each rounded to their dtype already: cast them to float32
        before merging to keep the merged result within attention's own accuracy.
    lse : ndarray
        In the accumulation type (float32, float64 for float64 outputs).

    Raises
    ------
    ValueError
        No parts, counts that differ, or shapes that do not broadcast.

    Examples
    --------
    Attention over 256 keys from its two halves:

    >>> import numpy as np
    >>> import cuflash
    >>> rng = np.random.default_rng(2)
    >>> q, k, v = (rng.standard_normal((4, 256, 64), dtype=np.float32) for _ in range(3))
    >>> halves = [cuflash.attention(q, k[:, s], v[:, s], return_lse=True) for s in (slice(0, 128), slice(128, 256))]
    >>> out, lse = cuflash.merge([o for o, _ in halves], [l for _, l in halves])
    >>> bool(np.allclose(out, cuflash.attention(q, k, v), atol=1e-5))
    True
    """
    xp = array_module(outputs, lses)
    outputs = [xp.asarray(x) for x in outputs]  # a list of parts, or one array with the parts on axis 0
    lses = [xp.asarray(x) for x in lses]
    if not outputs or len(outputs) != len(lses):
        raise ValueError(f"{NAME}: give one lse per output and at least one of each; got {len(outputs)} outputs "
                         f"and {len(lses)} lses")
    for x, name in [(x, "outputs") for x in outputs] + [(x, "lses") for x in lses]:
        if not is_real_float(x.dtype):
            raise TypeError(f"{NAME}: {name} must be real floating arrays, got {x.dtype}")
    if any(x.ndim < 2 for x in outputs):
        raise ValueError(f"{NAME}: each output must be (*batch, n, e); got shapes {[tuple(x.shape) for x in outputs]}")
    dtype = common_dtype(*[x.dtype for x in outputs], name=NAME)
    acc = acc_dtype_of(dtype)
    try:
        shape = np.broadcast_shapes(*[tuple(x.shape) for x in outputs], *[tuple(x.shape) + (1,) for x in lses])
    except ValueError:
        raise ValueError(f"{NAME}: outputs {[tuple(x.shape) for x in outputs]} and lses "
                         f"{[tuple(x.shape) for x in lses]} do not broadcast to one (*batch, n, e)") from None
    parts_out = xp.stack([xp.broadcast_to(x.astype(acc), shape) for x in outputs])
    parts_lse = xp.stack([xp.broadcast_to(x.astype(acc), shape[:-1]) for x in lses])
    out = xp.empty(shape, dtype=acc)
    lse = xp.empty(shape[:-1], dtype=acc)
    combine(parts_out, parts_lse, out, lse, xp)
    return out.astype(dtype, copy=False), lse


def array_module(*groups):
    """numpy, or cupy when any part is a CuPy array."""
    for group in groups:
        for x in group:
            if type(x).__module__.split(".")[0] == "cupy":
                import cupy
                return cupy
    return np
