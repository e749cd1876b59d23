"""The front door: cuflash.attention with NumPy's semantics (shapes, broadcasting, dtypes, out=, errors).

It knows NumPy and nothing of kernels: it turns the arguments into one Problem and hands it to a backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers

from typing import Any, Callable, Literal, Optional, Sequence, Tuple, Union, overload

import numpy as np
from numpy.typing import ArrayLike

from . import backends, blockmask, dropout, mods
from .blockmask import BlockMask
from .dtypes import acc_dtype_of, bfloat16, common_dtype, describe, is_real_float, native, same_kind
from .family import BlockConfig, check_precision
from .problem import SIGNATURE, Problem, Window, default_scale

NAME = "attention"


Array = Any  # a numpy.ndarray, or a cupy.ndarray on a GPU (CuPy is optional, so no stricter type here)
WindowSides = Tuple[Optional[int], Optional[int]]
Scalar = Union[float, np.number, np.ndarray]  # a Python or NumPy real number, or a 0-d array
Flag = Union[bool, np.bool_]
Block = Union[Tuple[int, int], str, "BlockConfig", None]
ScoreMod = Callable[..., Any]  # score_mod(score, *batch_indices, i, j) -> score
MaskMod = Callable[..., Any]  # mask_mod(*batch_indices, i, j) -> bool


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, /, *, scale: Optional[Scalar] = None, causal: Flag = False,
              window: Optional[WindowSides] = None, mask: Optional[ArrayLike] = None, bias: Optional[ArrayLike] = None,
              score_mod: Optional[ScoreMod] = None, mask_mod: Optional[MaskMod] = None,
              block_mask: Optional[BlockMask] = None, sinks: Optional[ArrayLike] = None,
              dropout_p: float = 0.0, seed: Optional[int] = None, out: Optional[Array] = None,
              return_lse: Literal[False] = False, backend: Optional[str] = None, block: Block = None,
              precision: Optional[str] = None) -> Array: ...


@overload
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, /, *, scale: Optional[Scalar] = None, causal: Flag = False,
              window: Optional[WindowSides] = None, mask: Optional[ArrayLike] = None, bias: Optional[ArrayLike] = None,
              score_mod: Optional[ScoreMod] = None, mask_mod: Optional[MaskMod] = None,
              block_mask: Optional[BlockMask] = None, sinks: Optional[ArrayLike] = None,
              dropout_p: float = 0.0, seed: Optional[int] = None, out: Optional[Array] = None,
              return_lse: Union[Literal[True], np.bool_], backend: Optional[str] = None, block: Block = None,
              precision: Optional[str] = None) -> Tuple[Array, Array]: ...


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, /, *, scale: Optional[Scalar] = None, causal: Flag = False,
              window: Optional[WindowSides] = None, mask: Optional[ArrayLike] = None, bias: Optional[ArrayLike] = None,
              score_mod: Optional[ScoreMod] = None, mask_mod: Optional[MaskMod] = None,
              block_mask: Optional[BlockMask] = None, sinks: Optional[ArrayLike] = None,
              dropout_p: float = 0.0, seed: Optional[int] = None, out: Optional[Array] = None,
              return_lse: Flag = False, backend: Optional[str] = None, block: Block = None,
              precision: Optional[str] = None) -> Union[Array, Tuple[Array, Array]]:
    """Exact softmax(scale * q @ k.T + bias, masked) @ v, tile by tile, never holding the n x m scores.

    A generalized ufunc with signature ``(n,d),(m,d),(m,e)->(n,e)``: leading dimensions of q, k, v, mask and bias
    broadcast by NumPy's rules (k, v with a size-1 head axis express grouped-query attention without copies).

    Parameters
    ----------
    q, k, v : array_like
        ``(*batch, n, d)``, ``(*batch, m, d)``, ``(*batch, m, e)``: NumPy or CuPy arrays (not mixed) of float16,
        bfloat16, float32 or float64 (integers and bools compute in float64).
    scale : float, optional
        Multiplies ``q @ k.T``; default ``1/sqrt(d)``.
    causal : bool, optional
        Key j visible to query i only when ``j <= i + (m - n)`` (bottom-right aligned; for n == m the lower
        triangle). The top-left variant is ``window=(None, n - m)``.
    window : tuple of (int or None, int or None), optional
        ``(left, right)``, None meaning unbounded: key j is visible to query i when
        ``i + (m - n) - left <= j <= i + (m - n) + right``. With ``causal=True``, right is ``min(right, 0)``.
    mask : array_like of bool, optional
        Broadcastable to ``(*batch, n, m)``; True means attend.
    bias : array_like, optional
        Real, broadcastable to ``(*batch, n, m)``, added to the scaled scores.
    score_mod : callable, optional
        ``score_mod(score, *idx, i, j) -> score`` of the scaled score (after bias, in the accumulation type), one
        integer index per batch axis, the query row i and the key j (for ``(B, H, n, d)`` inputs
        ``score_mod(score, b, h, i, j)``); it may use Python's operators and numbers, NumPy ufuncs, ``np.where``,
        ``np.clip``, ``.astype``, and index arrays it closes over (`cuflash.mods` has ALiBi, soft-capping and more).
    mask_mod : callable, optional
        ``mask_mod(*idx, i, j) -> bool``, ANDed with ``mask=``, ``causal=`` and ``window=``: key j is seen by query
        i only where it is True. Both are traced once per call into an expression (`cuflash.mods`).
    block_mask : BlockMask, optional
        A `cuflash.BlockMask` (`cuflash.block_mask`) of the call's mask_mod or mask: only the tiles it shows are
        computed, and the pattern is evaluated only on the tiles it shows in part. Without one, a mask_mod gets one
        made and kept (by its expression, the sizes and the contents of its arrays; for CuPy arrays made on their
        device).
    sinks : array_like, optional
        Real, broadcastable to ``(*batch,)``: one logit per batch item that joins every row's softmax denominator
        and carries no value (attention sinks); lse includes it.
    dropout_p : float, optional
        Attention dropout, ``0 <= p < 1``: each probability is dropped with probability p, the kept ones scaled by
        ``1 / (1 - p)`` after the softmax (lse is the softmax's). Which elements are kept is a pure function of
        (seed, batch index, i, j) (`cuflash.dropout_mask`), the same on every backend and tile size.
    seed : int, optional
        An int in ``[0, 2^64)`` for dropout; None with ``dropout_p > 0`` draws one from NumPy's global generator
        (``np.random.seed`` makes it reproducible) and records it: `cuflash.last_seed` gives it, for the backward.
    out : ndarray, optional
        Array of exactly the result's shape; the result is cast to its dtype with same-kind casting. It may be
        strided or overlap an input.
    return_lse : bool, optional
        Also return lse ``(*batch, n)``, the natural log of the sum of exp of each row's final scores (float32, or
        float64 when computing in float64); -inf for a row with no visible key.
    backend : {None, "numpy", "cupy", "simt"}, optional
        None picks from the arrays' module ("numpy" for NumPy arrays, "cupy" for CuPy arrays); "numpy", "cupy" or
        "simt" forces one.
    block : tuple of (int, int), str or BlockConfig, optional
        ``(Br, Bc)`` query and key tile sizes for the backend, ``"mma"`` / ``"fma"`` (one kernel, its heuristic's
        tiles) or a `cuflash.BlockConfig` (see the guide's page on the kernels and the planner).
    precision : {None, "highest", "tf32", "fma"}, optional
        How the GPU kernels compute float32: None or "highest" (float32-exact: on tensor cores only as 3xTF32, else
        on CUDA cores), "tf32" (one TF32 tensor-core pass: faster, less exact) or "fma" (CUDA cores, never tensor
        cores). float64 and the 16-bit types ignore it except "fma". The numpy backend computes the same whatever
        it is.

    Returns
    -------
    out : ndarray
        ``(*batch, n, e)`` in NumPy's result type of q, k and v (bfloat16 promoting like float16), or ``out=``.
    lse : ndarray
        ``(*batch, n)``, only with ``return_lse=True``.

    Raises
    ------
    ValueError
        Shapes that do not match or broadcast (in NumPy's words), a window, scale or block that cannot be, a
        forced kernel configuration that cannot run (with every reason).
    TypeError
        Dtypes that cannot be (complex, object), mixed NumPy and CuPy operands, masked arrays, flags that are not
        bools, a mod that cannot be traced.
    IndexError
        A mod reading outside an array it closes over.
    BackendUnavailableError
        A forced backend that cannot run here.

    See Also
    --------
    attention_backward : the gradients.
    merge : join attention over disjoint key sets by their lse.
    attention_varlen, attention_paged : packed sequences and a paged KV cache.

    Examples
    --------
    Grouped-query attention by broadcasting: 8 query heads as (2 groups, 4 heads) over 2 key/value heads, which
    are never copied.

    >>> import numpy as np
    >>> import cuflash
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 2, 4, 64, 32), dtype=np.float32)
    >>> k, v = (rng.standard_normal((2, 2, 1, 256, 32), dtype=np.float32) for _ in range(2))
    >>> cuflash.attention(q, k, v).shape
    (2, 2, 4, 64, 32)

    Causal attention with its logsumexp, against the naive formula:

    >>> out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    >>> lse.shape, lse.dtype
    ((2, 2, 4, 64), dtype('float32'))
    >>> s = q @ k.swapaxes(-1, -2) / np.sqrt(32)
    >>> s = np.where(np.arange(256) <= np.arange(64)[:, None] + 192, s, -np.inf)
    >>> p = np.exp(s - lse[..., None])
    >>> bool(np.allclose(out, p @ v, atol=1e-5))
    True
    """
    xp = array_module(q, k, v, mask, bias, out, sinks=sinks)
    # CuPy allocates and launches on the current device: make it the operands' one for casts, out and lse.
    with device_of(xp, (q, k, v, mask, bias, out)):
        patterns = Patterns(score_mod, mask_mod, sinks, block_mask, dropout.check(dropout_p, seed))
        return _attention(xp, q, k, v, scale, causal, window, mask, bias, patterns, out, return_lse, backend, block,
                          precision)


def _attention(xp, q, k, v, scale, causal, window, mask, bias, patterns, out, return_lse, backend, block,
               precision):
    return_lse = check_flag(return_lse, "return_lse")
    problem, (q, k, v, mask, bias) = make_problem(xp, q, k, v, scale, causal, window, mask, bias, (out,), precision,
                                                  patterns)
    batch, n = problem.batch, problem.n
    runner = backends.get(backend, xp)
    result, target = output_for(problem, out, (q, k, v, mask, bias))
    lse = xp.empty(batch + (n,), dtype=problem.acc_dtype) if return_lse else None
    if not problem.empty:
        runner.run(problem, result, lse, block=block)
    if target is not None and target is not result:
        xp.copyto(target, result, casting="unsafe")  # same_kind was checked in output_for
        result = target
    return (result, lse) if return_lse else result


def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, out: ArrayLike, lse: ArrayLike, /,
                       *, scale: Optional[Scalar] = None, causal: Flag = False, window: Optional[WindowSides] = None,
                       mask: Optional[ArrayLike] = None, bias: Optional[ArrayLike] = None,
                       score_mod: Optional[ScoreMod] = None, mask_mod: Optional[MaskMod] = None,
                       block_mask: Optional[BlockMask] = None, sinks: Optional[ArrayLike] = None,
                       dropout_p: float = 0.0, seed: Optional[int] = None,
                       bias_grad: Flag = False, score_mod_grads: Sequence[Any] = (),
                       backend: Optional[str] = None, block: Block = None,
                       precision: Optional[str] = None) -> Tuple[Array, ...]:
    """The gradients (dq, dk, dv), and dbias with bias_grad=True, of attention's result given dout, the gradient
    of a loss with respect to it.

    q, k, v and the keywords are those of the forward call that returned (out, lse) (``return_lse=True``), with the
    same meaning. Each gradient has its operand's own shape: axes the forward broadcast are summed, so k and v
    shared by a group of query heads get the group's sum, and a bias broadcast over the batch its sum over the
    batch. Gradients have the forward's result dtype; 16- and 32-bit inputs accumulate in float32, float64 in
    float64. Hidden keys (causal, window, mask, -inf bias) get exactly zero gradient, and a NaN or inf in a
    hidden key or value never reaches a gradient. Deterministic: the same inputs give the same bits. score_mod's
    derivative with respect to the score is traced from the same function.

    Parameters
    ----------
    dout : array_like
        ``(*batch, n, e)``: the gradient of a loss with respect to out.
    q, k, v : array_like
        The forward's operands.
    out, lse : array_like
        The forward's results (``return_lse=True``).
    scale, causal, window, mask, bias, score_mod, mask_mod, block_mask, sinks, backend, block, precision
        As `attention`'s, for the forward call that gave out and lse (precision: for the backward's kernels).
    dropout_p, seed : float, int
        The forward's: the backward regenerates the elements it kept (a seed is required with ``dropout_p > 0``:
        the forward's own, or `cuflash.last_seed` after a forward that drew one).
    bias_grad : bool, optional
        Also return dbias, in the bias's own shape, fourth.
    score_mod_grads : sequence of arrays, optional
        Floating arrays score_mod closes over (the very objects: learnable ALiBi slopes, a relative-position
        table) whose gradients follow, in that order, each of its array's shape and dtype: every read of the array
        adds ``dS * d score_mod / d (the value read)`` to the element it read (summed in a fixed order:
        deterministic). These calls run the blocked algorithm on every backend.

    Returns
    -------
    dq, dk, dv : ndarray
        In q's, k's and v's shapes.
    dbias : ndarray
        With ``bias_grad=True``.
    dsinks : ndarray
        With ``sinks=``, in the sinks' own shape, after the other gradients.
    *grads : ndarray
        With ``score_mod_grads=``, one per array, last.

    Raises
    ------
    ValueError
        As `attention`, and dout, out or lse of the wrong shape, ``bias_grad=True`` without a bias, ``seed=None``
        with ``dropout_p > 0``.
    TypeError
        As `attention`.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> rng = np.random.default_rng(1)
    >>> q = rng.standard_normal((2, 8, 64, 32), dtype=np.float32)
    >>> k, v = (rng.standard_normal((2, 1, 256, 32), dtype=np.float32) for _ in range(2))  # one key/value head
    >>> out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    >>> dout = rng.standard_normal(out.shape, dtype=np.float32)
    >>> dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    >>> dq.shape, dk.shape                  # dk: the sum over the 8 query heads that share k
    ((2, 8, 64, 32), (2, 1, 256, 32))
    """
    xp = array_module(q, k, v, mask, bias, out, lse, dout, sinks=sinks)
    with device_of(xp, (q, k, v, mask, bias, dout, out, lse)):
        return _attention_backward(xp, dout, q, k, v, out, lse, scale, causal, window, mask, bias,
                                   Patterns(score_mod, mask_mod, sinks, block_mask,
                                            dropout.check(dropout_p, seed, NAME + "_backward", backward=True)),
                                   bias_grad, score_mod_grads,
                                   backend, block, precision)


def _attention_backward(xp, dout, q, k, v, out, lse, scale, causal, window, mask, bias, patterns, bias_grad,
                        score_mod_grads, backend, block, precision):
    bias_grad = check_flag(bias_grad, "bias_grad")
    saved = [as_array(x, xp, name) for x, name in ((dout, "dout"), (out, "out"), (lse, "lse"))]
    problem, operands = make_problem(xp, q, k, v, scale, causal, window, mask, bias, saved, precision, patterns)
    problem = dataclasses.replace(problem, score_mod_grads=score_mod_tables(problem, score_mod_grads))
    if bias_grad and problem.bias is None:
        raise ValueError(f"{NAME}_backward: bias_grad=True asks for the gradient of the bias, but no bias= was "
                         f"given; pass the forward call's bias")
    dout, out, lse = check_saved(problem, *saved)
    runner = backends.get(backend, xp)
    batch, n, m = problem.batch, problem.n, problem.m
    shapes = ((n, problem.d), (m, problem.d), (m, problem.e)) + (((n, m),) if bias_grad else ())
    grads = [xp.zeros(batch + shape, dtype=problem.acc_dtype) for shape in shapes]
    tables = [problem.score_mod.arrays[t] for t in problem.score_mod_grads]
    dtables = [xp.zeros(tuple(a.shape), dtype=problem.acc_dtype) for a in tables]
    if not problem.empty:
        runner.run_backward(problem, dout, out, lse, grads + [None] * (4 - len(grads)) + dtables, block=block)
    q, k, v, _, bias = operands
    result = tuple(sum_to(g, x.shape).astype(problem.dtype, copy=False) for g, x in zip(grads, (q, k, v, bias)))
    if problem.sinks is not None:
        dsinks = sum_to(sinks_gradient(problem, dout, out, lse), patterns.sinks.shape)
        result += (dsinks.astype(problem.dtype, copy=False),)
    return result + tuple(g.astype(table_dtype(a, problem.acc_dtype), copy=False) for g, a in zip(dtables, tables))


def table_dtype(array, acc) -> np.dtype:
    """A table gradient's dtype: its array's (a torch tensor's: the accumulation type, cuflash.torch casts it)."""
    try:
        return np.dtype(array.dtype)
    except TypeError:
        return acc


def score_mod_tables(problem, wanted) -> Tuple[int, ...]:
    """The numbers of score_mod's tables that score_mod_grads= names (by identity), each a real floating one."""
    if isinstance(wanted, (tuple, list)) and not wanted:
        return ()
    if not isinstance(wanted, (tuple, list)):
        raise TypeError(f"{NAME}_backward: score_mod_grads must be a tuple of arrays score_mod closes over, got "
                        f"{type(wanted).__name__}")
    if problem.score_mod is None:
        raise ValueError(f"{NAME}_backward: score_mod_grads= asks for gradients of arrays score_mod closes over, "
                         f"but no score_mod= was given")
    arrays = problem.score_mod.arrays
    numbers = []
    for x in wanted:
        number = next((t for t, a in enumerate(arrays) if a is x), None)
        if number is None:
            reads = ", ".join(f"{tuple(a.shape)} {a.dtype}" for a in arrays) or "none"
            shape = tuple(getattr(x, "shape", ()))
            raise ValueError(f"{NAME}_backward: score_mod_grads holds an array of shape {shape} that score_mod does "
                             f"not close over (pass the very arrays it reads; it reads: {reads})")
        if mods.kind_of_dtype(x.dtype) != "float":
            raise TypeError(f"{NAME}_backward: score_mod_grads holds an array of dtype {x.dtype}, which has no "
                            f"gradient; only real floating arrays do")
        numbers.append(number)
    return tuple(numbers)


def sinks_gradient(problem, dout, out, lse):
    """dL/dsink of each batch item: the sink takes exp(sink - lse_i) of row i's probability and gives no value, so
    dL/dsink = -sum_i exp(sink - lse_i) D_i with D_i = rowsum(dO_i * O_i). In the accumulation type, (*batch,)."""
    xp, acc = problem.xp, problem.acc_dtype
    delta = problem.delta(dout, out)
    lse = lse.astype(acc, copy=False)
    with np.errstate(invalid="ignore", over="ignore"):
        share = xp.where(lse == -np.inf, 0, xp.exp(problem.sinks[..., None] - lse))
        return -(share * delta).sum(axis=-1)


def check_saved(problem, dout, out, lse):
    """dout and out as the forward's result, lse as its row log-sum-exp: shapes exact, real floating dtypes."""
    batch = problem.batch
    for x, name, shape in ((dout, "dout", batch + (problem.n, problem.e)), (out, "out", batch + (problem.n, problem.e)),
                           (lse, "lse", batch + (problem.n,))):
        if tuple(x.shape) != shape:
            raise ValueError(f"{NAME}_backward: {name} has shape {tuple(x.shape)} but the forward call's "
                             f"{'lse' if name == 'lse' else 'result'} has shape {shape}")
        if not is_real_float(x.dtype):
            raise TypeError(f"{NAME}_backward: {name} must be a real floating array, got {describe(x.dtype)}")
    return dout, out, lse


def sum_to(x, shape):
    """x summed over the axes NumPy broadcast an array of `shape` along to reach x.shape, in a fixed order
    (leading axes first, then the size-1 ones): the same inputs give the same bits."""
    lead = x.ndim - len(shape)
    if lead:
        x = x.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, (size, full) in enumerate(zip(shape, x.shape)) if size == 1 and full != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


@dataclasses.dataclass
class Patterns:
    """score_mod=, mask_mod=, sinks= and block_mask= as the caller gave them (checked by make_problem)."""

    score_mod: Any = None
    mask_mod: Any = None
    sinks: Any = None
    block_mask: Any = None
    dropout: Any = (0.0, None)  # (dropout_p, seed) checked (dropout.check), or a placed dropout.Dropout


def make_problem(xp, q, k, v, scale, causal, window, mask, bias, others=(), precision=None, patterns=None):
    """The Problem of a call's arguments, checked by NumPy's rules, and the operands as arrays (their own shapes:
    the backward sums each gradient back to them). others: further arrays whose dtypes take part in the
    bfloat16 check (out=, the backward's saved tensors). patterns: score_mod=, mask_mod= and sinks= (traced here,
    sinks made an array of xp in place)."""
    q, k, v = (as_array(x, xp, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    mask, mask_is_block_masks = block_masks_mask(patterns, mask)
    mask = None if mask is None else as_array(mask, xp, "mask")
    bias = None if bias is None else as_array(bias, xp, "bias")
    batch, n, m, d, e, dtype = core_sizes(q, k, v, mask, bias)
    check_bfloat16_support(xp, [dtype, q.dtype, k.dtype, v.dtype] + [x.dtype for x in (bias,) + tuple(others)
                                                                  if isinstance(x, xp.ndarray)])
    problem = Problem(
        q=xp.broadcast_to(q.astype(dtype, copy=False), batch + (n, d)),
        k=xp.broadcast_to(k.astype(dtype, copy=False), batch + (m, d)),
        v=xp.broadcast_to(v.astype(dtype, copy=False), batch + (m, e)),
        mask=None if mask is None else broadcast_pair(mask, batch, n, m, xp),
        bias=None if bias is None else broadcast_pair(bias_operand(bias, dtype), batch, n, m, xp),
        batch=batch, n=n, m=m, d=d, e=e,
        dtype=dtype, acc_dtype=acc_dtype_of(dtype),
        scale=check_scale(scale, d),
        window=visibility_window(window, causal),
        xp=xp,
        bias_hides=bias_may_hide(bias, xp),
        precision=check_precision(precision, dtype, NAME),
        **pattern_fields(patterns, batch, n, m, dtype, xp),
        mask_is_block_masks=mask_is_block_masks,
    )
    return problem, (q, k, v, mask, bias)


def call_block_mask(patterns, fields, batch, n, m, xp):
    """The call's BlockMask: block_mask= checked against the call (its mask_mod taken when mask_mod= is not
    given), or one made and kept for mask_mod= (with CuPy arrays made on their device), or None."""
    given = patterns.block_mask
    if given is None:
        if fields["mask_mod"] is None:
            return None
        return blockmask.for_mod(fields["mask_mod"], batch, n, m, xp=xp)
    if not isinstance(given, BlockMask):
        raise TypeError(f"{NAME}: block_mask must be a cuflash.BlockMask (made by cuflash.block_mask), got "
                        f"{type(given).__name__}")
    given.check_for(batch, n, m, NAME)
    if given.function is not None:
        if patterns.mask_mod is None:
            fields["mask_mod"] = mods.trace(given.function, "mask", len(batch))
        elif patterns.mask_mod is not given.function:
            raise ValueError(f"{NAME}: block_mask= was made from another mask_mod than mask_mod=; pass the same "
                             f"function, or block_mask= alone (it brings its mask_mod)")
    elif given.mask is None and fields["mask_mod"] is None:
        fields["mask_mod"] = given.mask_mod
    return given


def block_masks_mask(patterns, mask):
    """(mask, whether it is the block mask's): a block mask made from mask= brings it when mask= is not given."""
    made_from = None if patterns is None or patterns.block_mask is None else \
        getattr(patterns.block_mask, "mask", None)
    if made_from is None:
        return mask, False
    if mask is not None and mask is not made_from:
        raise ValueError(f"{NAME}: block_mask= was made from another mask than mask=; pass the same array, or "
                         f"block_mask= alone (it brings its mask)")
    return made_from, True


def pattern_fields(patterns, batch, n, m, dtype, xp):
    """The Problem's score_mod, mask_mod (traced for the batch's axes), sinks (broadcast to the batch, in the
    accumulation type) and block mask (checked against the call, or made for a mask_mod)."""
    if patterns is None:
        return {}
    fields = {name: None if fn is None else mods.trace(fn, name.split("_")[0], len(batch))
              for name, fn in (("score_mod", patterns.score_mod), ("mask_mod", patterns.mask_mod))}
    fields["block_mask"] = call_block_mask(patterns, fields, batch, n, m, xp)
    if patterns.sinks is not None:
        sinks = as_array(patterns.sinks, xp, "sinks")
        patterns.sinks = sinks
        if not (is_real_float(sinks.dtype) or sinks.dtype.kind in "iu"):
            raise TypeError(f"{NAME}: sinks must be a real array (one logit per batch item), got "
                            f"{describe(sinks.dtype)}")
        try:
            shape = np.broadcast_shapes(tuple(sinks.shape), batch)
        except ValueError:
            shape = None
        if shape != batch:
            raise ValueError(f"{NAME}: sinks of shape {tuple(sinks.shape)} does not broadcast to the batch shape "
                             f"{batch}; give one logit per batch item (for (B, H, n, d) inputs: shape (H,) or "
                             f"(B, H))")
        fields["sinks"] = xp.broadcast_to(sinks.astype(acc_dtype_of(dtype), copy=False), batch)
    if isinstance(patterns.dropout, dropout.Dropout):  # placed in a larger call (a Dask task's chunks)
        fields["dropout"] = patterns.dropout
    elif patterns.dropout[0] > 0:
        fields["dropout"] = dropout.Dropout(*patterns.dropout, dropout.row_major(batch))
    return fields


def core_sizes(q, k, v, mask, bias):
    """(batch, n, m, d, e, dtype) of the operands, checked by NumPy's rules: core dimensions, dtypes and the
    broadcast batch shape. Reads only shapes and dtypes, so Dask arrays are checked by the same rules."""
    check_core_dims(q, k, v)
    dtype = common_dtype(q.dtype, k.dtype, v.dtype, name=NAME)
    check_mask_bias_dtypes(mask, bias)
    n, d = q.shape[-2:]
    m, e = v.shape[-2:]
    return broadcast_batch(q, k, v, mask, bias, n, m), n, m, d, e, dtype


# ----------------------------------------------------------------------------------------------------------------
# Array module and operands


def array_module(*operands, sinks=None):
    """numpy or cupy, from the operands that are arrays; mixing the two is a TypeError."""
    modules = {}
    named = tuple(zip(("q", "k", "v", "mask", "bias", "out", "lse", "dout"), operands)) + (("sinks", sinks),)
    for name, x in named:
        if x is None:
            continue
        modules.setdefault(module_name(x), []).append(name)
    if "cupy" in modules and "numpy" in modules:
        raise TypeError(
            f"{NAME}: operands mix NumPy and CuPy arrays ({', '.join(modules['numpy'])} NumPy; "
            f"{', '.join(modules['cupy'])} CuPy); move them to one side with cupy.asarray or cupy.asnumpy")
    if "cupy" in modules:
        import cupy
        return cupy
    return np


def device_of(xp, operands):
    """The device of the first CuPy array among operands, as a context manager (nothing for NumPy)."""
    if xp is not np:
        for x in operands:
            if isinstance(x, xp.ndarray):
                return x.device
    return contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def cupy_bfloat16_problem():
    """None when CuPy computes in ml_dtypes.bfloat16 (CuPy 14 with NumPy 2.1.2+), else what went wrong: CuPy 13
    holds such arrays but its kernels (a cast, a copy) fail deep inside."""
    import cupy
    try:
        cupy.zeros(2, dtype=np.float32).astype(bfloat16).astype(np.float32)
    except Exception as exc:  # CuPy's TypeError, or a compile error of its cast kernel
        return f"{type(exc).__name__}: {exc}"
    return None


def check_bfloat16_support(xp, dtypes):
    if xp is np or bfloat16 not in dtypes:
        return
    problem = cupy_bfloat16_problem()
    if problem:
        import cupy
        raise TypeError(
            f"{NAME}: this CuPy cannot compute in bfloat16 (CuPy {cupy.__version__}: {problem}); bfloat16 needs "
            f"CuPy 14 or later with NumPy 2.1.2 or later; or pass float16 or float32 arrays")


def module_name(x) -> str:
    top = type(x).__module__.split(".")[0]
    return "cupy" if top == "cupy" else "numpy"


def as_array(x, xp, name):
    """x as an array of xp in native byte order (big-endian data, as FITS files hold, is copied once, like a
    cast). A numpy.ma masked array is refused: its mask would be silently dropped."""
    refuse_masked_array(x, name)
    if not isinstance(x, xp.ndarray):
        try:
            x = xp.asarray(x)
        except Exception as exc:  # object sequences, ragged lists ...
            raise TypeError(f"{NAME}: cannot make an array of {type(x).__name__}: {exc}") from exc
    return x if x.dtype.isnative else x.astype(native(x.dtype))


def refuse_masked_array(x, name):
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"{NAME}: {name} is a numpy.ma masked array, whose mask attention would not see; pass its data "
            f"(numpy.ma.getdata({name})) and say which keys to hide with mask= (True = attend)")


def check_core_dims(q, k, v):
    for index, x in enumerate((q, k, v)):
        if x.ndim < 2:
            raise ValueError(
                f"{NAME}: Input operand {index} does not have enough dimensions (has {x.ndim}, "
                f"gufunc core with signature {SIGNATURE} requires 2)")
    d, m = q.shape[-1], k.shape[-2]
    mismatches = ((1, 1, k.shape[-1], d), (2, 0, v.shape[-2], m))
    for operand, core_dim, size, expected in mismatches:
        if size != expected:
            raise ValueError(
                f"{NAME}: Input operand {operand} has a mismatch in its core dimension {core_dim}, "
                f"with gufunc signature {SIGNATURE} (size {size} is different from {expected})")


def check_mask_bias_dtypes(mask, bias):
    if mask is not None and mask.dtype != np.bool_:
        raise TypeError(
            f"{NAME}: mask must be a boolean array (True = attend), got {describe(mask.dtype)}; "
            f"use mask.astype(bool), or pass additive scores as bias=")
    if bias is not None and not (is_real_float(bias.dtype) or bias.dtype.kind in "biu"):
        raise TypeError(f"{NAME}: bias must be a real array, got {describe(bias.dtype)}")


def bias_operand(bias, dtype):
    """The bias in the accumulation type, as every backend adds it: its un-broadcast original (every stride-0 axis
    cut to length 1, a view) cast once; broadcast_pair broadcasts it again."""
    acc = acc_dtype_of(dtype)
    if bias.dtype == acc:
        return bias
    return bias[tuple(slice(0, 1) if s == 0 and size > 1 else slice(None)
                      for s, size in zip(bias.strides, bias.shape))].astype(acc)


def pair_shape(x):
    """(batch, (rows, cols)) of a mask or bias, as NumPy broadcasting sees it (left-padded to 2 dims)."""
    shape = (1,) * max(0, 2 - x.ndim) + tuple(x.shape)
    return shape[:-2], shape[-2:]


def broadcast_batch(q, k, v, mask, bias, n, m):
    shapes = {"q": q.shape[:-2], "k": k.shape[:-2], "v": v.shape[:-2]}
    for name, x in (("mask", mask), ("bias", bias)):
        if x is None:
            continue
        batch, (rows, cols) = pair_shape(x)
        if rows not in (1, n) or cols not in (1, m):
            raise ValueError(
                f"{NAME}: {name} of shape {tuple(x.shape)} does not broadcast to (*batch, n, m) with n={n}, m={m}; "
                f"its last two dimensions must be 1 or ({n}, {m})")
        shapes[name] = batch
    try:
        return tuple(np.broadcast_shapes(*shapes.values()))
    except ValueError:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"{NAME}: batch dimensions could not be broadcast together: {listed}") from None


def bias_may_hide(bias, xp):
    """Whether the bias may hold -inf (which hides its key). Read on NumPy; a CuPy bias is assumed to, since
    reading it back would synchronize the stream (and break graph capture)."""
    if bias is None:
        return False
    if xp is not np:
        return True
    return bias.dtype.kind not in "biu" and bool((bias == -np.inf).any())


def broadcast_pair(x, batch, n, m, xp):
    if x.ndim < 2:
        x = x.reshape((1,) * (2 - x.ndim) + tuple(x.shape))
    return xp.broadcast_to(x, batch + (n, m))


def check_scale(scale, d):
    """A real scalar as NumPy takes one: a Python or NumPy number or a 0-d array of a real dtype; finite."""
    if scale is None:
        return default_scale(d)
    if hasattr(scale, "ndim") and hasattr(scale, "dtype") and scale.ndim == 0 and \
            scale.dtype.kind in "iuf" and not isinstance(scale, np.ma.MaskedArray):
        scale = scale.item()  # a 0-d NumPy or CuPy array, or a NumPy scalar
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{NAME}: scale must be a real number, got {type(scale).__name__}")
    try:
        value = float(scale)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        shown = scale if len(str(scale)) < 40 else f"a number of {len(str(scale))} digits"
        raise ValueError(f"{NAME}: scale must be a finite real number, got {shown}")
    return value


def check_flag(value, name):
    """True or False (NumPy's bools too), as every flag of the front door takes them."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{NAME}: {name} must be True or False, got {value!r}")
    return bool(value)


def visibility_window(window, causal):
    """The Window of window= and causal=, checked (sides are ints of any size: Window.reach holds them within
    +-(n + m + 1), where they mean the same)."""
    causal = check_flag(causal, "causal")
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(f"{NAME}: window must be a pair (left, right) of ints or None, got {window!r}")
        window = tuple(check_window_side(side, name) for side, name in zip(window, ("left", "right")))
    return Window.of(window, causal)


def check_window_side(side, name):
    if side is None:
        return None
    if isinstance(side, (bool, np.bool_)) or not isinstance(side, (numbers.Integral, np.integer)):
        raise ValueError(f"{NAME}: window {name} must be an int or None, got {side!r}")
    return int(side)


# ----------------------------------------------------------------------------------------------------------------
# Output


def output_for(problem, out, inputs, shape=None, name: str = NAME):
    """(array the backend writes, user's out or None). A scratch array stands in when out overlaps an input
    or has another dtype, so the result is right either way. shape: the result's (default the batch's (n, e);
    the packed and paged calls' own layouts); name: the caller, as its errors begin."""
    xp = problem.xp
    shape = problem.batch + (problem.n, problem.e) if shape is None else tuple(shape)
    if out is None:
        return xp.empty(shape, dtype=problem.dtype), None
    refuse_masked_array(out, "out")
    if not isinstance(out, xp.ndarray):
        raise TypeError(f"{name}: out must be a {xp.__name__}.ndarray like the inputs, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise ValueError(f"{name}: out has shape {tuple(out.shape)} but the result has shape {shape}")
    if not same_kind(problem.dtype, out.dtype):
        raise TypeError(
            f"Cannot cast ufunc '{name}' output from {describe(problem.dtype)} to {describe(out.dtype)} "
            f"with casting rule 'same_kind'")
    if xp is np and not out.flags.writeable:
        raise ValueError(f"{name}: out is read-only")
    overlaps = any(x is not None and xp.may_share_memory(out, x) for x in inputs)
    if overlaps or out.dtype != problem.dtype:
        return xp.empty(shape, dtype=problem.dtype), out
    return out, out
