"""Packed variable-length sequences: cuflash.attention_varlen and its backward, in FlashAttention's layout.

q (total_q, H, d), k (total_k, Hk, d), v (total_k, Hk, e); sequence s is query rows cu_seqlens_q[s]:cu_seqlens_q[s+1]
against key rows cu_seqlens_k[s]:cu_seqlens_k[s+1]. The call becomes one Problem of batch (sequences, Hk, G) with
G = H // Hk query heads per key head: every operand a view of its packed array (problem.Packed), nothing copied, and
the kernels find each sequence's rows from the offsets.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import numpy as np

from . import api, backends, dropout, mods
from .dtypes import acc_dtype_of, common_dtype, describe, is_real_float, same_kind
from .family import check_precision
from .problem import Packed, Problem

NAME = "attention_varlen"
Array = Any


@dataclasses.dataclass(frozen=True)
class Layout:
    """The packed call's sizes: sequences, heads (H query heads, Hk key heads, G = H // Hk per key head), the
    packed rows, head dims, the longest sequence's queries and keys, and the offsets (int64 arrays of the call's
    module)."""

    sequences: int
    heads: int
    kv_heads: int
    total_q: int
    total_k: int
    d: int
    e: int
    max_q: int
    max_k: int
    cu_seqlens_q: Any
    cu_seqlens_k: Any

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @property
    def batch(self) -> Tuple[int, int, int]:
        return (self.sequences, self.kv_heads, self.groups)

    def packed(self) -> Packed:
        return Packed(self.cu_seqlens_q, self.cu_seqlens_k, self.total_q, self.total_k)

    def queries(self, x):
        """(total_q, H, *cols) -> the Problem's (sequences, Hk, G, max_q, *cols) view."""
        whole = x.reshape((self.total_q, self.kv_heads, self.groups) + tuple(x.shape[2:]))
        return Packed.batched(whole.transpose((1, 2, 0) + tuple(range(3, x.ndim + 1))), self.sequences, self.max_q)

    def keys(self, x, xp):
        """(total_k, Hk, cols) -> (sequences, Hk, G, max_k, cols), shared by the G query heads (stride 0)."""
        whole = xp.broadcast_to(x.transpose(1, 0, 2)[:, None], (self.kv_heads, self.groups) + (self.total_k,) +
                                tuple(x.shape[2:]))
        return Packed.batched(whole, self.sequences, self.max_k)

    def key_grads(self, whole):
        """A key operand's gradient from its (Hk, G, total_k, cols) accumulator: summed over the group, in the
        operand's (total_k, Hk, cols) layout."""
        return whole.sum(axis=1).transpose(1, 0, 2)

    def query_rows(self, whole):
        """(Hk, G, total_q, *cols) -> (total_q, H, *cols)."""
        moved = whole.transpose((2, 0, 1) + tuple(range(3, whole.ndim)))
        return moved.reshape((self.total_q, self.heads) + tuple(whole.shape[3:]))


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, /, *, max_seqlen_q: Optional[int] = None,
                     max_seqlen_k: Optional[int] = None, scale=None, causal=False, window=None, score_mod=None,
                     mask_mod=None, sinks=None, dropout_p=0.0, seed=None, out=None, return_lse=False,
                     backend: Optional[str] = None, block=None, precision: Optional[str] = None):
    """Attention over a batch of sequences of different lengths packed along one axis (FlashAttention's varlen
    layout), each sequence attending only to its own keys.

    The work is the sum over sequences of n_s * m_s, not batch * longest^2.

    Parameters
    ----------
    q, k, v : array_like
        ``(total_q, H, d)``, ``(total_k, Hk, d)``, ``(total_k, Hk, e)``, H a multiple of Hk (grouped-query
        attention: query head h reads key head ``h // (H // Hk)``, never copied).
    cu_seqlens_q, cu_seqlens_k : array_like of int
        Sequences + 1 offsets, starting at 0, non-decreasing, ending at total_q (total_k): sequence s is query rows
        ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` against key rows ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]``; a
        sequence may be empty (its rows, if any, give 0 and lse -inf).
    max_seqlen_q, max_seqlen_k : int, optional
        The longest sequence's lengths (computed when omitted; only the launch's size; smaller than a sequence is an
        error).
    causal, window
        As `cuflash.attention`'s, aligned bottom-right within each sequence.
    score_mod, mask_mod : callable, optional
        ``score_mod(score, s, h, i, j)`` and ``mask_mod(s, h, i, j)``: as attention's, with the sequence s, the query
        head h and positions i, j inside the sequence.
    sinks : array_like, optional
        One logit per query head ``(H,)`` or per sequence and head ``(sequences, H)``.
    dropout_p, seed
        As attention's, element (s, h, i, j) counted as batch item ``s * H + h`` with i, j inside the sequence.
    out : ndarray, optional
        ``(total_q, H, e)``.
    return_lse : bool, optional
        Also return lse ``(total_q, H)``.
    scale, backend, block, precision
        As attention's.

    Returns
    -------
    out : ndarray
        ``(total_q, H, e)``.
    lse : ndarray
        ``(total_q, H)``, with ``return_lse=True``.

    Raises
    ------
    ValueError
        Offsets that are not 1-D, of different counts for q and k, not starting at 0, decreasing, or not ending at
        the total; heads that do not divide; checked before any kernel runs (on a GPU, one small reduction read back).
    TypeError
        Offsets that are not integers; as attention's otherwise.

    See Also
    --------
    attention_varlen_backward : its gradients.

    Examples
    --------
    Four sequences (one empty), 8 query heads over 2 key heads, each sequence against itself alone:

    >>> import numpy as np
    >>> import cuflash
    >>> rng = np.random.default_rng(4)
    >>> cu = np.concatenate([[0], np.cumsum([5, 0, 130, 17])])
    >>> q = rng.standard_normal((cu[-1], 8, 64), dtype=np.float32)
    >>> k, v = (rng.standard_normal((cu[-1], 2, 64), dtype=np.float32) for _ in range(2))
    >>> out, lse = cuflash.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    ((152, 8, 64), (152, 8))
    >>> s = slice(cu[2], cu[3])                             # the third sequence alone
    >>> alone = cuflash.attention(q[s].transpose(1, 0, 2), np.repeat(k[s], 4, axis=1).transpose(1, 0, 2),
    ...                           np.repeat(v[s], 4, axis=1).transpose(1, 0, 2), causal=True)
    >>> bool(np.allclose(out[s], alone.transpose(1, 0, 2), atol=1e-5))
    True
    """
    xp = api.array_module(q, k, v, None, None, out, sinks=sinks)
    with api.device_of(xp, (q, k, v, out)):
        return_lse = api.check_flag(return_lse, "return_lse")
        problem, layout = varlen_problem(xp, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         scale, causal, window, score_mod, mask_mod, sinks, precision, (out,),
                                         dropout.check(dropout_p, seed, NAME))
        runner = backends.get(backend, xp)
        result, target = api.output_for(problem, out, (q, k, v), (layout.total_q, layout.heads, layout.e), NAME)
        lse = xp.empty((layout.total_q, layout.heads), dtype=problem.acc_dtype) if return_lse else None
        if not problem.empty:
            runner.run(problem, layout.queries(result), None if lse is None else layout.queries(lse), block=block)
        if target is not None and target is not result:
            xp.copyto(target, result, casting="unsafe")  # same_kind was checked in api.output_for
            result = target
        return (result, lse) if return_lse else result


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, /, *,
                              max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, scale=None,
                              causal=False, window=None, score_mod=None, mask_mod=None, sinks=None,
                              dropout_p=0.0, seed=None, backend: Optional[str] = None, block=None,
                              precision: Optional[str] = None) -> Tuple[Array, ...]:
    """The gradients (dq, dk, dv) of `attention_varlen`'s result given dout, and dsinks with ``sinks=``.

    Each gradient has its operand's shape and the result's dtype (accumulated in float32, or float64 for float64);
    a key head's gradients are its query heads' sum. Deterministic: the same inputs give the same bits.

    Parameters
    ----------
    dout : array_like
        ``(total_q, H, e)``: the gradient of a loss with respect to out.
    q, k, v, cu_seqlens_q, cu_seqlens_k
        The forward call's.
    out, lse : array_like
        The forward call's results (``return_lse=True``).
    max_seqlen_q, max_seqlen_k, scale, causal, window, score_mod, mask_mod, sinks
        The forward call's own.
    dropout_p, seed, backend, block, precision
        The forward call's own.

    Returns
    -------
    dq, dk, dv : ndarray
        In q's, k's and v's shapes.
    dsinks : ndarray
        With ``sinks=``, in the sinks' shape.

    Raises
    ------
    ValueError, TypeError
        As attention_varlen's, and dout, out or lse of the wrong shape.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> rng = np.random.default_rng(4)
    >>> cu = np.array([0, 5, 40])
    >>> q = rng.standard_normal((40, 4, 32), dtype=np.float32)
    >>> k, v = (rng.standard_normal((40, 2, 32), dtype=np.float32) for _ in range(2))
    >>> out, lse = cuflash.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True)
    >>> dq, dk, dv = cuflash.attention_varlen_backward(np.ones_like(out), q, k, v, out, lse, cu, cu, causal=True)
    >>> dq.shape, dk.shape
    ((40, 4, 32), (40, 2, 32))
    """
    xp = api.array_module(q, k, v, None, None, out, lse, dout, sinks=sinks)
    with api.device_of(xp, (q, k, v, dout, out, lse)):
        saved = [api.as_array(x, xp, name) for x, name in ((dout, "dout"), (out, "out"), (lse, "lse"))]
        problem, layout = varlen_problem(xp, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         scale, causal, window, score_mod, mask_mod, sinks, precision, saved,
                                         dropout.check(dropout_p, seed, NAME + "_backward", backward=True))
        dout, out, lse = check_saved(layout, *saved)
        runner = backends.get(backend, xp)
        acc = problem.acc_dtype
        rows = ((layout.total_q, layout.d), (layout.total_k, layout.d), (layout.total_k, layout.e))
        wholes = [xp.zeros((layout.kv_heads, layout.groups) + shape, dtype=acc) for shape in rows]
        if not problem.empty:
            grads = [Packed.batched(x, layout.sequences, size) for x, size in
                     zip(wholes, (layout.max_q, layout.max_k, layout.max_k))]
            runner.run_backward(problem, layout.queries(dout), layout.queries(out), layout.queries(lse),
                                grads + [None], block=block)
        grads = [layout.query_rows(wholes[0]), layout.key_grads(wholes[1]), layout.key_grads(wholes[2])]
        if problem.sinks is not None:
            shape = tuple(api.as_array(sinks, xp, "sinks").shape)
            grads.append(api.sum_to(sinks_gradient(problem, layout, dout, out, lse), shape))
        return tuple(g.astype(problem.dtype, copy=False) for g in grads)


def varlen_problem(xp, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, window,
                   score_mod, mask_mod, sinks, precision, others, dropping=(0.0, None)):
    """The Problem of a packed call and its Layout, every argument checked before any kernel runs."""
    q, k, v = (api.as_array(x, xp, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    check_operands(q, k, v)
    dtype = common_dtype(q.dtype, k.dtype, v.dtype, name=NAME)
    api.check_bfloat16_support(xp, [dtype, q.dtype, k.dtype, v.dtype] +
                               [x.dtype for x in others if isinstance(x, xp.ndarray)])
    layout = make_layout(xp, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    traced = grouped_mods(score_mod, mask_mod, layout.groups)
    problem = Problem(
        q=layout.queries(q.astype(dtype, copy=False)), k=layout.keys(k.astype(dtype, copy=False), xp),
        v=layout.keys(v.astype(dtype, copy=False), xp), mask=None, bias=None,
        batch=layout.batch, n=layout.max_q, m=layout.max_k, d=layout.d, e=layout.e,
        dtype=dtype, acc_dtype=acc_dtype_of(dtype), scale=api.check_scale(scale, layout.d),
        window=api.visibility_window(window, causal), xp=xp, precision=check_precision(precision, dtype, NAME),
        score_mod=traced["score_mod"], mask_mod=traced["mask_mod"],
        sinks=None if sinks is None else head_sinks(xp, sinks, layout.batch, dtype, NAME), packed=layout.packed(),
        dropout=dropout.Dropout(*dropping, dropout.row_major(layout.batch)) if dropping[0] > 0 else None)
    return problem, layout


def check_operands(q, k, v) -> None:
    for x, name, layout in ((q, "q", "(total_q, H, d)"), (k, "k", "(total_k, Hk, d)"), (v, "v", "(total_k, Hk, e)")):
        if x.ndim != 3:
            raise ValueError(f"{NAME}: {name} must be 3-D {layout}, got shape {tuple(x.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"{NAME}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same keys and heads "
                         f"(total_k, Hk)")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{NAME}: q's head dim {q.shape[2]} differs from k's {k.shape[2]}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{NAME}: q's {heads} heads must be a multiple of k's and v's {kv_heads} (grouped-query "
                         f"attention: each key head serves H // Hk query heads)")


def make_layout(xp, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Layout:
    """The Layout, the offsets checked (on the arrays' device: one small reduction read back) and the max
    lengths computed or checked."""
    total_q, total_k = q.shape[0], k.shape[0]
    cu_q, cu_k = (offsets_array(xp, x, name) for x, name in ((cu_seqlens_q, "cu_seqlens_q"),
                                                             (cu_seqlens_k, "cu_seqlens_k")))
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"{NAME}: cu_seqlens_q has {cu_q.shape[0]} offsets and cu_seqlens_k {cu_k.shape[0]}; both "
                         f"hold sequences + 1 offsets, one batch of sequences")
    facts = offset_facts(xp, (cu_q, cu_k))
    lengths = []
    for (first, descents, last, longest), name, total, given in zip(
            facts, ("cu_seqlens_q", "cu_seqlens_k"), (total_q, total_k), (max_seqlen_q, max_seqlen_k)):
        if first != 0:
            raise ValueError(f"{NAME}: {name} must start at 0, got {first}")
        if descents:
            raise ValueError(f"{NAME}: {name} must be non-decreasing (offsets of consecutive sequences), but it "
                             f"decreases {descents} time(s)")
        if last != total:
            rows = "q's" if name.endswith("q") else "k's and v's"
            raise ValueError(f"{NAME}: {name} must end at the packed rows' count, {total} ({rows} rows), got {last}")
        lengths.append(max_length(given, longest, name.replace("cu_seqlens", "max_seqlen")))
    return Layout(cu_q.shape[0] - 1, q.shape[1], k.shape[1], total_q, total_k, q.shape[2], v.shape[2],
                  lengths[0], lengths[1], cu_q, cu_k)


def offsets_array(xp, x, name):
    """Offsets as a 1-D int64 array of xp with at least one entry (host offsets are copied to a GPU's)."""
    if api.module_name(x) == "cupy" and xp is np:
        raise TypeError(f"{NAME}: {name} is a CuPy array but q, k and v are NumPy arrays; pass it with "
                        f"cupy.asnumpy, or the operands with cupy.asarray")
    if not hasattr(x, "dtype"):
        x = np.asarray(x)
        x = x.astype(np.int64) if x.size == 0 else x  # [] is no float
    if x.dtype.kind not in "iu":
        raise TypeError(f"{NAME}: {name} must hold integers (sequence offsets), got {describe(x.dtype)}")
    if x.ndim != 1 or x.shape[0] == 0:
        raise ValueError(f"{NAME}: {name} must be 1-D with sequences + 1 offsets, got shape {tuple(x.shape)}")
    if x.dtype.kind == "u" and x.dtype.itemsize == 8 and xp is np and x.size and int(x.max()) >= 2**63:
        raise ValueError(f"{NAME}: {name} holds an offset past int64")
    return xp.asarray(x, dtype=np.int64)


def offset_facts(xp, arrays):
    """For each offsets array: (first, number of descents, last, longest sequence), all read back at once."""
    rows = []
    for x in arrays:
        steps = x[1:] - x[:-1]
        rows += [x[0], (steps < 0).sum(), x[-1], steps.max() if steps.size else xp.zeros((), np.int64)]
    facts = xp.stack([xp.asarray(r, dtype=np.int64) for r in rows])
    facts = [int(f) for f in (facts if xp is np else facts.get())]
    return [facts[i:i + 4] for i in range(0, len(facts), 4)]


def max_length(given, longest: int, name: str) -> int:
    if given is None:
        return max(0, longest)
    if isinstance(given, (bool, np.bool_)) or not isinstance(given, (int, np.integer)):
        raise TypeError(f"{NAME}: {name} must be an int or None, got {given!r}")
    if given < longest:
        raise ValueError(f"{NAME}: {name}={given} but a sequence has {longest}; give the longest length or None")
    return int(given)


def grouped_mods(score_mod, mask_mod, groups: int) -> dict:
    """score_mod and mask_mod traced for a batch of (sequence, Hk, G), seen as (s, h, i, j) with the query head
    h = hk * G + g (packed sequences and paged caches alike)."""
    return {name: None if fn is None else mods.trace(fn, name.split("_")[0], 3, name, groups=groups)
            for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod))}


def head_sinks(xp, sinks, batch: Tuple[int, ...], dtype, name: str):
    """sinks= as the Problem's batch (sequences, Hk, G) in the accumulation type, from one logit per query head,
    (H,) or (sequences, H)."""
    sinks = api.as_array(sinks, xp, "sinks")
    if not (is_real_float(sinks.dtype) or sinks.dtype.kind in "iu"):
        raise TypeError(f"{name}: sinks must be a real array (one logit per query head), got {describe(sinks.dtype)}")
    wanted = (batch[0], batch[1] * batch[2])
    try:
        shape = np.broadcast_shapes(tuple(sinks.shape), wanted)
    except ValueError:
        shape = None
    if shape != wanted:
        raise ValueError(f"{name}: sinks of shape {tuple(sinks.shape)} does not broadcast to (sequences, H) = "
                         f"{wanted}; give one logit per query head, (H,) or (sequences, H)")
    full = xp.broadcast_to(sinks.astype(acc_dtype_of(dtype), copy=False), wanted)
    return full.reshape(batch)


def check_saved(layout: Layout, dout, out, lse):
    rows = (layout.total_q, layout.heads)
    for x, name, shape in ((dout, "dout", rows + (layout.e,)), (out, "out", rows + (layout.e,)), (lse, "lse", rows)):
        if tuple(x.shape) != shape:
            raise ValueError(f"{NAME}_backward: {name} has shape {tuple(x.shape)} but the forward call's "
                             f"{'lse' if name == 'lse' else 'result'} has shape {shape}")
        if not is_real_float(x.dtype):
            raise TypeError(f"{NAME}_backward: {name} must be a real floating array, got {describe(x.dtype)}")
    return dout, out, lse


def sinks_gradient(problem, layout: Layout, dout, out, lse):
    """dL/dsink per (sequence, query head): -sum over the sequence's rows i of exp(sink - lse_i) D_i (as
    api.sinks_gradient), summed per sequence from a float64 running sum over the packed rows (deterministic)."""
    xp = problem.xp
    cu = layout.cu_seqlens_q
    sequence = xp.searchsorted(cu, xp.arange(layout.total_q), side="right") - 1  # each row's sequence
    sinks = problem.sinks.reshape(layout.sequences, layout.heads)
    lse = lse.astype(np.float64, copy=False)
    with np.errstate(invalid="ignore", over="ignore"):
        share = xp.where(lse == -np.inf, 0, xp.exp(sinks[xp.minimum(sequence, layout.sequences - 1)] - lse))
        terms = share * problem.delta(dout, out).astype(np.float64)
    running = xp.concatenate([xp.zeros((1, layout.heads)), xp.cumsum(terms, axis=0)])
    return -(running[cu[1:]] - running[cu[:-1]])
