"""cuflash.torch: cuflash.attention on torch tensors, differentiable, and opaque to torch.compile.

    from cuflash.torch import attention
    out = attention(q, k, v, causal=True)        # q, k, v: torch tensors; out.backward(...) gives q.grad, ...

CPU tensors run on the numpy backend and CUDA tensors on the cupy backend (on torch's current stream), both
without copies: CPU tensors are viewed as NumPy arrays, CUDA tensors exchanged by DLPack. The forward and the
backward are torch.library custom operators (cuflash::attention_forward, cuflash::attention_backward) with fake
tensor rules, so torch.compile traces them as single opaque nodes. Only the front door is called: this module
translates tensors and nothing else.

scaled_dot_product_attention is a drop-in for torch.nn.functional.scaled_dot_product_attention (its arguments,
top-left causal alignment, masks, enable_gqa and errors) on the same operators; attention(..., enable_gqa=True)
pairs query heads with fewer key and value heads by views, never copies.

The backward is cuflash.attention_backward: the numpy backend's blocked algorithm for CPU tensors, the CUDA
backward kernels (the blocked algorithm on CuPy's arrays past their head dims) for CUDA tensors. lse, when
returned, is not differentiable.
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from . import api, dropout, mods, varlen
from .blockmask import BlockMask
from .dtypes import bfloat16, common_dtype

__all__ = ["attention", "attention_varlen", "register_with_transformers", "scaled_dot_product_attention",
           "transformers_attention"]

NAME = "cuflash.torch.attention"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
              causal: bool = False, window: Optional[Tuple[Optional[int], Optional[int]]] = None,
              mask: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
              score_mod: Optional[Callable] = None, mask_mod: Optional[Callable] = None,
              block_mask: Optional[BlockMask] = None, sinks: Optional[torch.Tensor] = None,
              dropout_p: float = 0.0, seed: Optional[int] = None, return_lse: bool = False,
              precision: Optional[str] = None, enable_gqa: bool = False):
    """`cuflash.attention` with the same keywords, on torch tensors (all on one device); differentiable.

    Differentiable in q, k, v, bias and sinks (the backward runs with the same precision), and in the floating
    tensors score_mod closes over that require grad (learnable ALiBi slopes, a relative-position table:
    attention_backward's score_mod_grads). CPU tensors run on the numpy backend as NumPy views of the tensors' memory
    (bfloat16 included), CUDA tensors on the cupy backend by DLPack on torch's current stream; results and gradients
    are tensors on the inputs' device, each gradient in its input's dtype. The forward and the backward are
    ``torch.library`` custom operators (``cuflash::attention_forward``, ``cuflash::attention_backward``) with
    fake-tensor rules, so ``torch.compile`` traces them as opaque nodes. score_mod and mask_mod may be written with
    torch's operations over the tensors they close over (a mod written for flex_attention works unchanged); such
    calls run as an autograd function rather than the custom operators (a function is no operator argument).

    Parameters
    ----------
    q, k, v : torch.Tensor
        As `cuflash.attention`'s operands.
    scale, causal, window, mask, bias, score_mod, mask_mod, block_mask, sinks, precision
        As `cuflash.attention`'s (mask, bias and sinks as tensors).
    dropout_p, seed
        Attention dropout as cuflash.attention's; ``seed=None`` draws the seed from torch's default generator
        (``torch.manual_seed`` makes a step reproducible), and the backward regenerates the same keep mask.
    return_lse : bool, optional
        Also return lse (not differentiable).
    enable_gqa : bool, optional
        Grouped-query attention as SDPA's enable_gqa: q ``(..., H, n, d)`` against k ``(..., Hk, m, d)`` and v
        ``(..., Hv, m, e)``, Hk and Hv dividing H, query head h reading key head ``h // (H // Hk)`` and value head
        ``h // (H // Hv)``. Done by views (q split to ``(..., Hk, H // Hk, n, d)``, k and v given a size-1 group
        axis), so k and v are never repeated and their gradients are the sums over their groups. mask, bias and sinks
        are broadcastable to the ``(..., H, n, m)`` and ``(..., H)`` of the query heads, and mods see
        ``(..., h, i, j)`` as without it; block_mask is refused (make one for the grouped shapes and reshape
        yourself).

    Returns
    -------
    out : torch.Tensor
        ``(..., n, e)``.
    lse : torch.Tensor
        With ``return_lse=True``.

    Raises
    ------
    ValueError
        As `cuflash.attention`'s; without enable_gqa, k and v must have H heads or one head: ``(..., 4, n, d)``
        against ``(..., 2, m, d)`` is a ValueError that says both ways to ask.
    TypeError
        As `cuflash.attention`'s.

    Examples
    --------
    >>> import torch
    >>> from cuflash.torch import attention
    >>> q, k, v = (torch.randn(2, 4, 64, 32, requires_grad=True) for _ in range(3))
    >>> out = attention(q, k, v, causal=True)
    >>> out.square().mean().backward()                      # q.grad, k.grad, v.grad
    >>> q.grad.shape
    torch.Size([2, 4, 64, 32])
    """
    groups = Groups.of(q, k, v) if enable_gqa else None
    if groups is None:
        check_heads(q, k, v)
    else:
        if block_mask is not None:
            raise ValueError(f"{NAME}: enable_gqa=True does not take block_mask= (one is made for one batch shape); "
                             f"reshape q to (..., {groups.text(groups.levels)}, n, d), k to (..., "
                             f"{groups.text(groups.key_levels)}, m, d) and v to (..., "
                             f"{groups.text(groups.value_levels)}, m, e), make the block mask for that batch shape "
                             f"and call without enable_gqa")
        q, k, v = groups.query(q), groups.operand(k, groups.key_levels), groups.operand(v, groups.value_levels)
        mask, bias = groups.scores(mask, "mask"), groups.scores(bias, "bias")
        sinks = groups.per_head(sinks)
        nbatch = max([x.dim() for x in (q, k, v)] + [max(x.dim(), 2) for x in (mask, bias) if x is not None]) - 2
        score_mod, mask_mod = groups.mod(score_mod, "score", nbatch), groups.mod(mask_mod, "mask", nbatch)
    dropping = torch_dropout(dropout_p, seed)
    out, lse = grouped_attention(q, k, v, scale, causal, window, mask, bias, score_mod, mask_mod, block_mask, sinks,
                                 precision, dropping)
    if groups is not None:
        out, lse = groups.ungroup(out, 2), groups.ungroup(lse, 1)
    return (out, lse) if return_lse else out


def grouped_attention(q, k, v, scale, causal, window, mask, bias, score_mod, mask_mod, block_mask, sinks, precision,
                      dropping=(0.0, None)):
    """attention's (out, lse) for operands whose batch axes broadcast (the query heads grouped, if asked): the
    custom operators, or the autograd function for patterns."""
    left, right = (None, None) if window is None else window
    scale = None if scale is None else float(scale)
    precision = api.check_precision(precision, None, NAME)  # refused here, traced or not; the dtype's rule in the op
    if score_mod is not None or mask_mod is not None or block_mask is not None or sinks is not None:
        patterns = (score_mod, mask_mod, block_mask)
        out, lse = PatternAttention.apply(q, k, v, mask, bias, sinks, None, patterns,
                                          (scale, bool(causal), left, right, precision) + dropping,
                                          *learnable(score_mod))
    else:
        out, lse = torch.ops.cuflash.attention_forward(q, k, v, mask, bias, scale, bool(causal), left, right,
                                                       precision, *dropping)
    return out, lse


def learnable(score_mod) -> Tuple[torch.Tensor, ...]:
    """The floating tensors score_mod closes over that require grad, each once (the autograd function's extra
    inputs; a mask_mod's tensors take no gradient: the mask is piecewise constant)."""
    found: dict = {}
    for _, value in mods.captured(score_mod) if score_mod is not None else ():
        if isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point():
            found.setdefault(id(value), value)
    return tuple(found.values())


class PatternAttention(torch.autograd.Function):
    """attention with mods, sinks or a block mask, or attention_varlen with mods or sinks (packed: its offsets'
    tensors and max lengths): the front door's forward and backward, by tensors' arrays."""

    @staticmethod
    def forward(ctx, q, k, v, mask, bias, sinks, packed, patterns, params, *tables):
        keywords = dict(options(mask, bias, *params), score_mod=patterns[0],
                        mask_mod=patterns[1], block_mask=patterns[2], sinks=to_array(sinks))
        with on_stream(q.device):
            arrays = (to_array(q), to_array(k), to_array(v))
            if packed is None:
                out, lse = api.attention(*arrays, return_lse=True, **keywords)
            else:
                out, lse = varlen.attention_varlen(*arrays, *packed_arguments(packed), return_lse=True,
                                                   **packed_keywords(keywords))
        out, lse = to_tensor(out, q.device), to_tensor(lse, q.device)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, mask, bias, sinks, out, lse)
        ctx.keywords, ctx.tables, ctx.packed = keywords, tables, packed
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, mask, bias, sinks, out, lse = ctx.saved_tensors
        bias_grad = bias is not None and ctx.needs_input_grad[4]
        keywords = dict(ctx.keywords, mask=to_array(mask), bias=to_array(bias), sinks=to_array(sinks))
        with on_stream(q.device):
            arrays = (to_array(dout.contiguous()), to_array(q), to_array(k), to_array(v), to_array(out),
                      to_array(lse))
            if ctx.packed is None:
                grads = api.attention_backward(*arrays, bias_grad=bias_grad, score_mod_grads=ctx.tables, **keywords)
            else:
                grads = varlen.attention_varlen_backward(*arrays, *packed_arguments(ctx.packed),
                                                         **packed_keywords(keywords))
        grads = [to_tensor(g, q.device) for g in grads]
        dq, dk, dv = (g.to(x.dtype) for g, x in zip(grads, (q, k, v)))
        dbias = grads[3].to(bias.dtype) if bias_grad else None
        tables = ctx.tables
        dtables = tuple(g.to(t.dtype) for g, t in zip(grads[len(grads) - len(tables):], tables))
        dsinks = grads[len(grads) - len(tables) - 1].to(sinks.dtype).reshape(sinks.shape) if sinks is not None \
            else None
        return (dq, dk, dv, None, dbias, dsinks, None, None, None) + dtables


def packed_arguments(packed) -> tuple:
    """attention_varlen's offsets (arrays of its tensors) from (cu_seqlens_q, cu_seqlens_k, max_q, max_k)."""
    return to_array(packed[0]), to_array(packed[1])


def packed_keywords(keywords: dict) -> dict:
    """attention's keywords as attention_varlen takes them (it has no mask, bias or block mask)."""
    return {name: value for name, value in keywords.items() if name not in ("mask", "bias", "block_mask")}


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q, cu_seqlens_k, *,
                     max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                     scale: Optional[float] = None, causal: bool = False,
                     window: Optional[Tuple[Optional[int], Optional[int]]] = None,
                     score_mod: Optional[Callable] = None, mask_mod: Optional[Callable] = None,
                     sinks: Optional[torch.Tensor] = None, dropout_p: float = 0.0, seed: Optional[int] = None,
                     return_lse: bool = False, precision: Optional[str] = None):
    """`cuflash.attention_varlen` on torch tensors (FlashAttention's flash_attn_varlen_func layout); differentiable.

    Differentiable in q, k, v and sinks through ``torch.library`` custom operators
    (``cuflash::attention_varlen_forward``, ``cuflash::attention_varlen_backward``) that ``torch.compile`` traces
    (the backward is attention_varlen_backward, with the same precision); with mods or sinks, an autograd
    function. lse is not differentiable.

    Parameters
    ----------
    q, k, v : torch.Tensor
        ``(total_q, H, d)``, ``(total_k, Hk, d)``, ``(total_k, Hk, e)``.
    cu_seqlens_q, cu_seqlens_k : torch.Tensor or sequence of int
        Sequences + 1 offsets (int32 or int64 tensors, or lists).
    max_seqlen_q, max_seqlen_k, scale, causal, window, precision
        As `cuflash.attention_varlen`'s.
    score_mod, mask_mod : callable, optional
        See ``(s, h, i, j)`` and may be written with torch's operations; a tensor a score_mod closes over gets no
        gradient here (refused if it requires one; `cuflash.torch.attention` gives those).
    sinks : torch.Tensor, optional
        ``(H,)`` or ``(sequences, H)``.
    dropout_p, seed
        As `attention`'s (a seed drawn from torch's generator when None).
    return_lse : bool, optional
        Also return lse ``(total_q, H)``.

    Returns
    -------
    out : torch.Tensor
        ``(total_q, H, e)``.
    lse : torch.Tensor
        ``(total_q, H)``, with ``return_lse=True``.

    Raises
    ------
    ValueError, TypeError
        As `cuflash.attention_varlen`'s.

    Examples
    --------
    A packed training step of four documents:

    >>> import torch
    >>> import cuflash.torch
    >>> cu = torch.tensor([0, 7, 19, 20, 29], dtype=torch.int32)
    >>> q = torch.randn(29, 8, 64, requires_grad=True)             # (total, heads, d)
    >>> k, v = (torch.randn(29, 2, 64, requires_grad=True) for _ in range(2))   # 2 key/value heads
    >>> out = cuflash.torch.attention_varlen(q, k, v, cu, cu, causal=True)
    >>> out.square().mean().backward()
    >>> k.grad.shape
    torch.Size([29, 2, 64])
    """
    left, right = (None, None) if window is None else window
    scale = None if scale is None else float(scale)
    precision = api.check_precision(precision, None, NAME)
    cu_q, cu_k = (offsets_tensor(x, q.device, name) for x, name in ((cu_seqlens_q, "cu_seqlens_q"),
                                                                      (cu_seqlens_k, "cu_seqlens_k")))
    dropping = torch_dropout(dropout_p, seed)
    if score_mod is not None or mask_mod is not None or sinks is not None:
        if learnable(score_mod):
            raise ValueError(f"{NAME}_varlen: score_mod closes over tensors that require grad; their gradients are "
                             f"attention's only (cuflash.torch.attention): detach them here")
        packed = (cu_q, cu_k, max_seqlen_q, max_seqlen_k)
        params = (scale, bool(causal), left, right, precision) + dropping
        out, lse = PatternAttention.apply(q, k, v, None, None, sinks, packed, (score_mod, mask_mod, None), params)
    else:
        out, lse = torch.ops.cuflash.attention_varlen_forward(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, scale,
                                                              bool(causal), left, right, precision, *dropping)
    return (out, lse) if return_lse else out


def offsets_tensor(x, device: torch.device, name: str) -> torch.Tensor:
    """Offsets as a tensor (a Python sequence or a NumPy array made one, on the operands' device); the front door
    checks its values."""
    if isinstance(x, torch.Tensor):
        return x
    array = np.asarray(x)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{NAME}_varlen: {name} must hold integers (sequence offsets), got {array.dtype}")
    return torch.as_tensor(array.astype(np.int64), device=device)


# ----------------------------------------------------------------------------------------------------------------
# Grouped-query heads, and PyTorch's scaled_dot_product_attention


class Groups:
    """How enable_gqa groups H query heads over Hk key heads and Hv value heads with views: q's head axis split into
    levels, (Hk, H // Hk) when Hk == Hv, else (a, b // a, H // b) for a and b the fewer and the more of Hk and Hv
    (one must divide the other: no view says anything else); k's and v's head axes split into the levels they span,
    with size 1 for the rest, so that broadcasting pairs query head h with key head h // (H // Hk) and value head
    h // (H // Hv)."""

    def __init__(self, heads: int, levels: Tuple[int, ...], key_levels: Tuple[int, ...],
                 value_levels: Tuple[int, ...]):
        self.heads, self.levels, self.key_levels, self.value_levels = heads, levels, key_levels, value_levels

    @staticmethod
    def of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> "Groups":
        if min(x.dim() for x in (q, k, v)) < 3:
            raise ValueError(f"{NAME}: enable_gqa=True takes q, k and v with a head axis, (..., heads, n, d); they "
                             f"have {q.dim()}, {k.dim()} and {v.dim()} dimensions")
        heads, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
        if hk == 0 or hv == 0 or heads % hk or heads % hv:
            raise ValueError(f"{NAME}: enable_gqa=True needs key heads ({hk}) and value heads ({hv}) that divide "
                             f"the query heads ({heads}) (dim -3)")
        if hk == hv:
            return Groups(heads, (hk, heads // hk), (hk, 1), (hk, 1))
        few, many = sorted((hk, hv))
        if many % few:
            raise ValueError(f"{NAME}: enable_gqa=True with {hk} key heads and {hv} value heads: grouped without "
                             f"copies only when one of them divides the other")
        levels = (few, many // few, heads // many)
        spans = {many: (few, many // few, 1), few: (few, 1, 1)}
        return Groups(heads, levels, spans[hk], spans[hv])

    @staticmethod
    def text(levels: Tuple[int, ...]) -> str:
        return ", ".join(map(str, levels))

    def query(self, q: torch.Tensor) -> torch.Tensor:
        return self.operand(q, self.levels)

    @staticmethod
    def operand(x: torch.Tensor, levels: Tuple[int, ...]) -> torch.Tensor:
        """x's head axis (dim -3) split into levels: a view."""
        return x.reshape(tuple(x.shape[:-3]) + levels + tuple(x.shape[-2:]))

    def split(self, x: Optional[torch.Tensor], axis: int, name: str, what: str) -> Optional[torch.Tensor]:
        """x's query-head axis (axis from the end: H or 1, or absent) split into the levels (or size-1 axes)."""
        if x is None or x.dim() < axis:
            return x
        size = x.shape[-axis]
        if size not in (1, self.heads):
            raise ValueError(f"{NAME}: {name} of shape {tuple(x.shape)} does not broadcast to {what} with the "
                             f"{self.heads} query heads: its dim {-axis} must be 1 or {self.heads}")
        levels = self.levels if size == self.heads else (1,) * len(self.levels)
        return x.reshape(tuple(x.shape[:-axis]) + levels + tuple(x.shape[x.dim() - axis + 1:]))

    def scores(self, x: Optional[torch.Tensor], name: str) -> Optional[torch.Tensor]:
        """A mask or bias broadcastable to (..., H, n, m), grouped."""
        return self.split(x, 3, name, "(..., heads, n, m)")

    def per_head(self, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Sinks broadcastable to (..., H), grouped."""
        return self.split(x, 1, "sinks", "(..., heads)")

    def ungroup(self, x: torch.Tensor, core: int) -> torch.Tensor:
        """A result (..., *levels, *core dims) as (..., H, *core dims): a view."""
        shape = tuple(x.shape)
        return x.reshape(shape[:len(shape) - core - len(self.levels)] + (self.heads,) + shape[len(shape) - core:])

    def mod(self, fn: Optional[Callable], kind: str, nbatch: int) -> Optional[Callable]:
        """The user's mod of (..., h, i, j) as a mod of the grouped call's (..., *levels, i, j): h from the levels'
        indices (the tracer sees through it, and finds what fn closes over)."""
        if fn is None:
            return None
        seen = nbatch - len(self.levels) + 1
        mods.check_arity(fn, seen + 2 + (kind == "score"), seen, kind, f"{kind}_mod")
        count, sizes = len(self.levels), self.levels[1:]

        def head_of(indices):
            head = indices[0]
            for index, size in zip(indices[1:], sizes):
                if size != 1:
                    head = head * size + index
            return head

        def grouped_score_mod(score, *idx):
            return fn(score, *idx[:-count - 2], head_of(idx[-count - 2:-2]), idx[-2], idx[-1])

        def grouped_mask_mod(*idx):
            return fn(*idx[:-count - 2], head_of(idx[-count - 2:-2]), idx[-2], idx[-1])
        return grouped_score_mod if kind == "score" else grouped_mask_mod


def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Without enable_gqa, k or v with fewer heads than q, dividing them (grouped-query attention asked the wrong
    way), is refused with the ways to ask for it (the front door would only say that the batches do not
    broadcast)."""
    if min(x.dim() for x in (q, k, v)) < 3:
        return
    heads = q.shape[-3]
    for x in (k, v):
        kv = x.shape[-3]
        if kv not in (0, 1, heads) and heads % kv == 0:
            raise ValueError(
                f"{NAME}: q has {heads} heads and k, v have {k.shape[-3]} and {v.shape[-3]} (dim -3), which do not "
                f"broadcast; for grouped-query attention pass enable_gqa=True (query head h reads key head "
                f"h // {heads // kv}, nothing is copied), or reshape q to (..., {kv}, {heads // kv}, n, d) and k, v "
                f"to (..., {kv}, 1, m, d)")


SDPA = "cuflash.torch.scaled_dot_product_attention"


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, *, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``, computed by cuflash (never holding the L x S scores).

    The same arguments, results, gradients and errors, so that replacing one with the other changes only speed and
    memory. A row that sees no key (a boolean mask hiding all of it, or a float mask of -inf) gives 0 and zero
    gradients, as SDPA's does. It differs only where SDPA's behaviour is an accident: a 0-d or 1-d attn_mask
    broadcasts here (SDPA raises IndexError), as does a mask broadcast over value's leading dims (SDPA's adds the mask
    to query's and key's broadcast only); a non-finite scale is a ValueError, and so is enable_gqa with key and value
    heads of which neither divides the other (no view pairs them with the query heads).

    Parameters
    ----------
    query, key, value : torch.Tensor
        ``(..., L, E)``, ``(..., S, E)``, ``(..., S, Ev)``, their leading dims broadcast.
    attn_mask : torch.Tensor, optional
        Boolean (True = attend) or floating (float32 or the query's dtype: added to the scaled scores,
        differentiable), broadcastable to the attention weights ``(..., L, S)`` without enlarging them.
    dropout_p : float, optional
        Drops attention weights as SDPA's does (whenever it is above 0, kept weights scaled by ``1 / (1 - p)``), by
        cuflash's counter-based rule (`cuflash.dropout_mask`), its seed drawn from torch's generator: the kept
        elements differ from SDPA's own generator's, their law does not.
    is_causal : bool, optional
        Query i sees keys ``j <= i``, top-left aligned as SDPA's even when L != S (cuflash's
        ``window=(None, L - S)``).
    scale : float, optional
        Default ``1/sqrt(E)``.
    enable_gqa : bool, optional
        Query ``(..., Hq, L, E)`` against key and value heads dividing Hq, query head h reading key head
        ``h // (Hq // Hk)``, by views (k and v are never repeated).

    Returns
    -------
    torch.Tensor
        ``(..., L, Ev)`` in the query's dtype.

    Raises
    ------
    RuntimeError
        SDPA's: dtypes that differ, a mask of another dtype, shapes that do not broadcast, heads that do not divide;
        is_causal with attn_mask, as SDPA documents and its math backend raises (its fused CPU kernel applies both
        instead).
    ValueError
        A non-finite scale; enable_gqa with key and value heads of which neither divides the other.

    Examples
    --------
    >>> import torch
    >>> import torch.nn.functional as F
    >>> import cuflash.torch
    >>> q = torch.randn(2, 8, 50, 32, requires_grad=True)             # 8 query heads, 50 queries
    >>> k, v = (torch.randn(2, 2, 120, 32, requires_grad=True) for _ in range(2))   # 2 key/value heads
    >>> keep = torch.rand(2, 1, 50, 120) < 0.9                         # True = attend
    >>> out = cuflash.torch.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    >>> torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True),
    ...                            rtol=1e-4, atol=1e-5)
    >>> out.square().mean().backward()                                 # q.grad, k.grad (2 heads), v.grad

    A model's attention runs through it where the model's call is patched, here with ``unittest.mock``:

    >>> from unittest import mock
    >>> layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True).eval()
    >>> with mock.patch.object(F, "scaled_dot_product_attention", cuflash.torch.scaled_dot_product_attention):
    ...     y = layer(torch.randn(2, 10, 32))
    """
    check_sdpa(query, key, value, attn_mask, is_causal, enable_gqa)
    floating = attn_mask is not None and attn_mask.dtype != torch.bool
    window = (None, query.shape[-2] - key.shape[-2]) if is_causal else None  # top-left: j <= i
    return attention(query, key, value, scale=scale, window=window, mask=None if floating else attn_mask,
                     bias=attn_mask if floating else None, enable_gqa=enable_gqa, dropout_p=dropout_p)


def check_sdpa(query, key, value, attn_mask, is_causal, enable_gqa) -> None:
    """SDPA's checks, as RuntimeErrors (TypeErrors for arguments that are no tensors or flags), before any call."""
    for x, name in ((query, "query"), (key, "key"), (value, "value"), (attn_mask, "attn_mask")):
        if not isinstance(x, torch.Tensor) and (x is not None or name != "attn_mask"):
            raise TypeError(f"{SDPA}: {name} must be a Tensor, not {type(x).__name__}")
    for flag, name in ((is_causal, "is_causal"), (enable_gqa, "enable_gqa")):
        if not isinstance(flag, bool):
            raise TypeError(f"{SDPA}: {name} must be bool, not {type(flag).__name__}")
    if min(x.dim() for x in (query, key, value)) < 2:
        raise RuntimeError(f"{SDPA}: expected query, key and value to be at least 2-dimensional, got "
                           f"{query.dim()}, {key.dim()} and {value.dim()}")
    if not query.dtype == key.dtype == value.dtype:
        raise RuntimeError(f"{SDPA}: expected query, key and value to have the same dtype, got {query.dtype}, "
                           f"{key.dtype} and {value.dtype}")
    if key.shape[-1] != query.shape[-1] or value.shape[-2] != key.shape[-2]:
        raise RuntimeError(f"{SDPA}: query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                           f"{tuple(value.shape)} must be (..., L, E), (..., S, E) and (..., S, Ev)")
    batch = sdpa_batch(query, key, value, enable_gqa)
    if attn_mask is None:
        return
    if is_causal:
        raise RuntimeError(f"{SDPA}: an explicit attn_mask should not be set when is_causal=True (AND the causal "
                           f"mask into attn_mask instead)")
    if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise RuntimeError(f"{SDPA}: expected attn_mask dtype to be bool or float or to match query dtype, got "
                           f"{attn_mask.dtype} for a query of {query.dtype}")
    weights = batch + (query.shape[-2], key.shape[-2])
    try:
        fits = tuple(torch.broadcast_shapes(tuple(attn_mask.shape), weights)) == weights
    except RuntimeError:
        fits = False
    if not fits:
        raise RuntimeError(f"{SDPA}: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the "
                           f"attention weights' shape {weights}")


def sdpa_batch(query, key, value, enable_gqa) -> Tuple[int, ...]:
    """The result's leading dims (SDPA's broadcasting of query, key and value), or SDPA's RuntimeError."""
    if enable_gqa:
        if min(x.dim() for x in (query, key, value)) < 3:
            raise RuntimeError(f"{SDPA}: enable_gqa=True takes query, key and value with a head axis (dim -3)")
        heads, kv = query.shape[-3], (key.shape[-3], value.shape[-3])
        if 0 in kv or heads % kv[0] or heads % kv[1]:
            raise RuntimeError(f"{SDPA}: number of heads in key ({kv[0]}) and value ({kv[1]}) must divide the "
                               f"number of heads in query ({heads})")
        shapes = [tuple(x.shape[:-3]) for x in (query, key, value)]
    else:
        shapes = [tuple(x.shape[:-2]) for x in (query, key, value)]
    try:
        batch = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        hint = ""
        if min(x.dim() for x in (query, key, value)) >= 3 and key.shape[-3] and query.shape[-3] % key.shape[-3] == 0:
            hint = "; for grouped-query attention pass enable_gqa=True"
        raise RuntimeError(f"{SDPA}: the leading dims of query {tuple(query.shape)}, key {tuple(key.shape)} and "
                           f"value {tuple(value.shape)} do not broadcast{hint}") from None
    return batch + ((query.shape[-3],) if enable_gqa else ())


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face transformers


def register_with_transformers(name: str = "cuattention") -> str:
    """Make cuflash an attention implementation of Hugging Face transformers under `name`.

    Then ``AutoModel.from_pretrained(..., attn_implementation=name)`` runs its attention through cuflash. Its mask
    interface builds no mask: it hands transformers' own mask function (padding, causal, sliding windows, packed
    sequences, ...) to the attention as a mask_mod, or None where causal alone says it. (transformers takes any name
    containing "flash" for a FlashAttention kernel of its hub, hence not "cuflash".)

    Parameters
    ----------
    name : str, optional
        Default "cuattention".

    Returns
    -------
    str
        The name.

    Raises
    ------
    ValueError
        A name containing "flash".

    Examples
    --------
    A tiny random Llama (``from_pretrained(path, attn_implementation=name)`` does the same for a real one):

    >>> import torch
    >>> import cuflash.torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> name = cuflash.torch.register_with_transformers()
    >>> name
    'cuattention'
    >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                      num_attention_heads=4, num_key_value_heads=2)
    >>> config._attn_implementation = name
    >>> model = LlamaForCausalLM(config).eval()
    >>> model(torch.randint(0, 64, (2, 10))).logits.shape
    torch.Size([2, 10, 64])
    """
    if "flash" in name:
        raise ValueError(f"{NAME}: transformers takes an attention implementation named {name!r} for a "
                         f"FlashAttention kernel of its hub; choose a name without 'flash'")
    from transformers import AttentionInterface, AttentionMaskInterface
    AttentionInterface.register(name, transformers_attention)
    AttentionMaskInterface.register(name, transformers_mask)
    return name


class ModMask:
    """What transformers_mask hands the attention instead of a (batch, 1, n, m) mask: transformers' mask function
    of (batch, head, query position, key position) and the positions of the call's first query and key, as an
    int64 tensor on the call's device (offsets)."""

    def __init__(self, mask_function, q_offset: int, kv_offset: int, shape, device=None):
        self.mask_function, self.q_offset, self.kv_offset, self.shape = mask_function, q_offset, kv_offset, shape
        # A tensor the mod reads, not numbers in it: a new offset per generated token keeps the expression, so no
        # kernel is compiled again; made once per model call, every layer reads it where it is.
        self.offsets = torch.tensor([q_offset, kv_offset], dtype=torch.int64, device=device)
        self.dtype = torch.bool
        self.device = torch.device("cpu")
        self.packed = packed_sequence_ids(mask_function)

    def mask_mod(self, device=None):
        """The mask_mod of the attention's (batch, kv head, group, i, j) indices (transformers' masks have one
        head: index 0; their positions start at the offsets), its offsets on `device` (the query's)."""
        if device is not None and self.offsets.device != device:
            self.offsets = self.offsets.to(device)  # once (a mask interface told no device): layers share it
        fn, offsets = self.mask_function, self.offsets

        def transformers_mask_mod(b, kv_head, group, i, j):
            return fn(b, 0, i + offsets[0], j + offsets[1])
        return transformers_mask_mod

    def packed_mask_mod(self, row: torch.Tensor, start: torch.Tensor):
        """The mask_mod of attention_varlen's (sequence, head, i, j) for a batch whose rows hold packed sequences:
        sequence s is row row[s] from position start[s] on (packing comes without a cache: no offsets)."""
        fn = self.mask_function

        def transformers_packed_mask_mod(s, h, i, j):
            return fn(row[s], 0, start[s] + i, start[s] + j)
        return transformers_packed_mask_mod


def packed_sequence_ids(mask_function) -> Optional[torch.Tensor]:
    """transformers' packed-sequence ids ((batch, n): one id per token, its sequence's) where its mask function
    ANDs its packed-sequence mask in at the top, so that whatever else it says, tokens of different sequences never
    see each other; else None."""
    members = closure_value(mask_function, "mask_functions") or ()
    for member in (mask_function,) + tuple(members):
        ids = closure_value(member, "packed_sequence_mask")
        if isinstance(ids, torch.Tensor):
            return ids
    return None


def closure_value(fn, name: str):
    """The value a function closes over under `name`, or None."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or cells is None or name not in code.co_freevars:
        return None
    return cells[code.co_freevars.index(name)].cell_contents


def transformers_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                      mask_function: Optional[Callable] = None, attention_mask: Optional[torch.Tensor] = None,
                      local_size: Optional[int] = None, allow_is_causal_skip: bool = True,
                      allow_is_bidirectional_skip: bool = False, **kwargs):
    """transformers' mask interface ("sdpa"'s signature): None where causal alone (or nothing) says it, as sdpa's
    mask does; else a ModMask of the mask function with the padding ANDed in, never an (n, m) array."""
    from transformers import masking_utils as mu
    padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if allow_is_causal_skip and mu._ignore_causal_mask_sdpa(padding, q_length, kv_length, q_offset, kv_offset,
                                                            local_size):
        return None
    if allow_is_bidirectional_skip and mu._ignore_bidirectional_mask_sdpa(padding, kv_length, local_size):
        return None
    function = mask_function or mu.causal_mask_function
    if padding is not None:
        function = mu.and_masks(function, mu.padding_mask_function(padding.bool()))
    return ModMask(function, q_offset, kv_offset, (batch_size, 1, q_length, kv_length), kwargs.get("device"))


def transformers_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                           position_bias: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
                           s_aux: Optional[torch.Tensor] = None, sliding_window: Optional[int] = None, **kwargs):
    """The attention function transformers calls (its "sdpa" contract), registered by `register_with_transformers`.

    Parameters
    ----------
    module : torch.nn.Module
        The attention module (its ``is_causal``).
    query : torch.Tensor
        ``(batch, heads, n, d)``.
    key, value : torch.Tensor
        ``(batch, kv_heads, m, d)`` with heads a multiple of kv_heads (grouped-query attention by broadcasting, never
        repeated).
    attention_mask : torch.Tensor or None
        transformers_mask's (the mask function as a mask_mod), boolean (True = attend) or additive, or None with
        causal from is_causal or the module (and sliding_window as ``window=``).
    dropout : float, optional
        The module's attention dropout in training, as dropout_p, its seed from torch's generator.
    scaling : float, optional
        The scale.
    is_causal : bool, optional
        Overrides the module's.
    position_bias : torch.Tensor, optional
        Added to the scores.
    softcap : float, optional
        As score_mod (``cap * tanh(s / cap)``, before any mask).
    s_aux : torch.Tensor, optional
        One sink per head.
    sliding_window : int, optional
        Keys ``i - j < sliding_window`` under causal.
    **kwargs
        transformers' others; packed sequences' ``cu_seq_lens_q``/``cu_seq_lens_k`` and ``max_length_q``/
        ``max_length_k`` run through `attention_varlen`.

    Returns
    -------
    out : torch.Tensor
        ``(batch, n, heads, e)``.
    weights : None
        No weights.

    Examples
    --------
    >>> import types
    >>> import torch
    >>> import cuflash.torch
    >>> query = torch.randn(2, 4, 10, 16)
    >>> key, value = (torch.randn(2, 2, 10, 16) for _ in range(2))
    >>> out, weights = cuflash.torch.transformers_attention(types.SimpleNamespace(is_causal=True), query, key, value,
    ...                                                     None)
    >>> out.shape, weights
    (torch.Size([2, 10, 4, 16]), None)
    """
    dropout_p = float(dropout or 0.0)  # transformers passes its module's rate in training, 0 in eval
    n, heads, kv_heads = query.shape[2], query.shape[1], key.shape[1]
    packing = packed_rows(query, key, attention_mask, position_bias, kwargs)
    if packing is not None:
        return packed_attention(module, query, key, value, attention_mask, packing, scaling, is_causal, softcap,
                                s_aux, sliding_window, dropout_p), None
    modded = isinstance(attention_mask, ModMask)
    tensor_mask = None if modded else attention_mask
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(n > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > n:  # as sdpa: a prefill into an empty static cache aligns top-left
        key, value = key[:, :, :n], value[:, :, :n]
        position_bias = None if position_bias is None else position_bias[..., :n]
    mask = tensor_mask if tensor_mask is not None and tensor_mask.dtype == torch.bool else None
    bias = tensor_mask if tensor_mask is not None and mask is None else None
    if softcap is not None and (bias is not None or position_bias is not None):
        raise ValueError(f"{NAME}: softcap with an additive attention mask or position bias: transformers caps the "
                         f"scores before adding them, cuflash after; pass a boolean mask")
    if position_bias is not None:
        bias = position_bias if bias is None else position_bias + bias
    groups = heads // kv_heads
    grouped = query.reshape(query.shape[0], kv_heads, groups, n, query.shape[-1])

    def per_group(x):  # (batch, 1 or heads, n, m) masks and biases, by kv head and group
        if x is None or x.dim() < 4 or x.shape[1] == 1:
            return None if x is None else (x.unsqueeze(1) if x.dim() == 4 else x)
        return x.reshape(x.shape[0], kv_heads, groups, *x.shape[2:])

    window = (sliding_window - 1, 0) if sliding_window is not None and causal else None  # i - j < sliding_window
    sinks = None if s_aux is None else s_aux.reshape(kv_heads, groups)
    out = attention(grouped, key.unsqueeze(2), value.unsqueeze(2), scale=scaling, causal=causal, window=window,
                    mask=per_group(mask), bias=per_group(bias),
                    mask_mod=attention_mask.mask_mod(query.device) if modded else None,
                    score_mod=None if softcap is None else mods.softcap(float(softcap)), sinks=sinks,
                    dropout_p=dropout_p)
    return out.reshape(out.shape[0], heads, n, out.shape[-1]).transpose(1, 2).contiguous(), None


def packed_rows(query, key, attention_mask, position_bias, kwargs):
    """Where transformers hands over a packed batch (several sequences in each row of (batch, n) tokens), its
    sequences as attention_varlen takes them: (cu_seqlens, longest, row, start), sequence s being tokens
    start[s]... of row row[s] and rows cu_seqlens[s]:cu_seqlens[s + 1] of the flattened batch; else None. Told
    by FlashAttention's keywords (cu_seq_lens_q/k, max_length_q/k), or by the packed-sequence ids transformers'
    own mask function holds (position ids restarting within a row, with no cache and no padding mask)."""
    batch, n, m = query.shape[0], query.shape[2], key.shape[2]
    if position_bias is not None or not (attention_mask is None or isinstance(attention_mask, ModMask)) or n != m:
        return None
    given = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if given[0] is not None and given[1] is not None:
        cu_q, cu_k = (x.to(torch.int64).reshape(-1) for x in given)
        if not torch.equal(cu_q, cu_k) or int(cu_q[-1]) != batch * n:
            raise ValueError(f"{NAME}: cu_seq_lens_q and cu_seq_lens_k must be the same offsets of the batch's "
                             f"{batch} x {n} tokens (packed sequences attend within themselves)")
        cu = cu_q.to(query.device)
    elif isinstance(attention_mask, ModMask) and attention_mask.packed is not None:
        ids = attention_mask.packed.expand(batch, n).to(query.device)
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        cu = torch.cat([starts.reshape(-1).nonzero().reshape(-1), torch.tensor([batch * n], device=ids.device)])
    else:
        return None
    row = torch.div(cu[:-1], n, rounding_mode="floor")
    return cu, int(torch.diff(cu).max()) if cu.numel() > 1 else 0, row, cu[:-1] - row * n


def packed_attention(module, query, key, value, attention_mask, packing, scaling, is_causal, softcap, s_aux,
                     sliding_window, dropout_p=0.0):
    """transformers_attention on a packed batch: attention_varlen over the flattened tokens, each sequence within
    itself; transformers' mask function (a ModMask), if any, as the mask_mod of (sequence, head, i, j) with the
    sequence's row and start, else causal (and a sliding window) from the module. Returns (batch, n, heads, e)."""
    cu, longest, row, start = packing
    batch, heads, n = query.shape[:3]

    def flat(x):  # (batch, heads, n, d) -> (batch * n, heads, d)
        return x.transpose(1, 2).reshape(batch * x.shape[2], x.shape[1], x.shape[3])

    modded = isinstance(attention_mask, ModMask)
    causal = not modded and bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = (sliding_window - 1, 0) if sliding_window is not None and causal else None
    out = attention_varlen(flat(query), flat(key), flat(value), cu, cu, max_seqlen_q=longest,
                           max_seqlen_k=longest, scale=scaling, causal=causal, window=window,
                           mask_mod=attention_mask.packed_mask_mod(row, start) if modded else None,
                           score_mod=None if softcap is None else mods.softcap(float(softcap)), sinks=s_aux,
                           dropout_p=dropout_p)
    return out.reshape(batch, n, heads, out.shape[-1])


# ----------------------------------------------------------------------------------------------------------------
# Tensors <-> arrays, without copies


def to_array(t: Optional[torch.Tensor]):
    """A NumPy view of a CPU tensor (bfloat16 as ml_dtypes.bfloat16), or a CuPy array sharing a CUDA tensor's
    memory (DLPack); None stays None."""
    if t is None:
        return None
    t = t.detach()
    if t.device.type == "cuda":
        import cupy
        return cupy.from_dlpack(t)
    if t.device.type != "cpu":
        raise TypeError(f"{NAME}: tensors on {t.device.type} are not supported: use CPU or CUDA tensors")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16)
    return t.numpy()


def to_tensor(x, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.from_dlpack(x)
    if x.dtype == bfloat16:
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def on_stream(device: torch.device):
    """The CuPy stream of torch's current stream on a CUDA device (nothing to do on the CPU)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    import cupy
    return cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, device.index)


# Torch's dtypes and NumPy's (ml_dtypes' bfloat16), as a table: the fake rules run where no tensor has data.
DTYPES = {torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(bfloat16), torch.float32: np.dtype(np.float32),
          torch.float64: np.dtype(np.float64), torch.bool: np.dtype(np.bool_), torch.int8: np.dtype(np.int8),
          torch.uint8: np.dtype(np.uint8), torch.int16: np.dtype(np.int16), torch.int32: np.dtype(np.int32),
          torch.int64: np.dtype(np.int64)}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype not in DTYPES:
        raise TypeError(f"{NAME}: tensors of {dtype} are not supported: use a float dtype")
    return DTYPES[dtype]


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return next(t for t, n in DTYPES.items() if n == dtype)


def options(mask, bias, scale, causal, left, right, precision, dropout_p=0.0, seed=None) -> dict:
    window = None if left is None and right is None else (left, right)
    return {"mask": to_array(mask), "bias": to_array(bias), "scale": scale, "causal": causal, "window": window,
            "precision": precision, "dropout_p": dropout_p, "seed": seed}


def torch_dropout(dropout_p, seed) -> Tuple[float, Optional[int]]:
    """(dropout_p, seed) checked as cuflash.attention checks them, the seed drawn from torch's default generator
    where none is given (torch.manual_seed makes a training step reproducible); the backward gets the same."""
    p, _ = dropout.check(dropout_p, 0 if seed is None else seed, NAME)
    if p == 0.0 or seed is not None:
        return p, seed
    return p, int(torch.randint(0, 2**62, (), dtype=torch.int64))


# ----------------------------------------------------------------------------------------------------------------
# The operators


@torch.library.custom_op("cuflash::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                      bias: Optional[torch.Tensor], scale: Optional[float], causal: bool, left: Optional[int],
                      right: Optional[int], precision: Optional[str] = None, dropout_p: float = 0.0,
                      seed: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    with on_stream(q.device):
        out, lse = api.attention(to_array(q), to_array(k), to_array(v), return_lse=True,
                                 **options(mask, bias, scale, causal, left, right, precision, dropout_p, seed))
    return to_tensor(out, q.device), to_tensor(lse, q.device)


@attention_forward.register_fake
def _(q, k, v, mask, bias, scale, causal, left, right, precision=None, dropout_p=0.0, seed=None):
    dtype = common_dtype(*(numpy_dtype(x.dtype) for x in (q, k, v)), name=NAME)
    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]] + [pair_batch(x) for x in (mask, bias) if x is not None]
    batch = tuple(torch.broadcast_shapes(*shapes))
    lse_dtype = torch.float64 if dtype == np.float64 else torch.float32
    return (q.new_empty(batch + (q.shape[-2], v.shape[-1]), dtype=torch_dtype(dtype)),
            q.new_empty(batch + (q.shape[-2],), dtype=lse_dtype))


def pair_batch(x: torch.Tensor) -> Tuple[int, ...]:
    """The batch part of a mask or bias of shape (*batch, n, m), left-padded to two dims as NumPy would."""
    return tuple(x.shape)[:-2] if x.dim() >= 2 else ()


@torch.library.custom_op("cuflash::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, mask: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                       scale: Optional[float], causal: bool, left: Optional[int], right: Optional[int],
                       bias_grad: bool, precision: Optional[str] = None, dropout_p: float = 0.0,
                       seed: Optional[int] = None) -> List[torch.Tensor]:
    with on_stream(q.device):
        grads = api.attention_backward(to_array(dout), to_array(q), to_array(k), to_array(v), to_array(out),
                                       to_array(lse), bias_grad=bias_grad,
                                       **options(mask, bias, scale, causal, left, right, precision, dropout_p, seed))
    return [to_tensor(g, q.device) for g in grads]


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, mask, bias, scale, causal, left, right, bias_grad, precision=None, dropout_p=0.0,
      seed=None):
    dtype = torch_dtype(common_dtype(*(numpy_dtype(x.dtype) for x in (q, k, v)), name=NAME))
    operands = (q, k, v) + ((bias,) if bias_grad else ())
    return [x.new_empty(x.shape, dtype=dtype) for x in operands]


@torch.library.custom_op("cuflash::attention_varlen_forward", mutates_args=())
def attention_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
                             scale: Optional[float], causal: bool, left: Optional[int], right: Optional[int],
                             precision: Optional[str] = None, dropout_p: float = 0.0,
                             seed: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    with on_stream(q.device):
        out, lse = varlen.attention_varlen(to_array(q), to_array(k), to_array(v), to_array(cu_seqlens_q),
                                           to_array(cu_seqlens_k), max_seqlen_q=max_seqlen_q,
                                           max_seqlen_k=max_seqlen_k, return_lse=True,
                                           **packed_keywords(options(None, None, scale, causal, left, right,
                                                                     precision, dropout_p, seed)))
    return to_tensor(out, q.device), to_tensor(lse, q.device)


@attention_varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, left, right, precision=None,
      dropout_p=0.0, seed=None):
    dtype = common_dtype(*(numpy_dtype(x.dtype) for x in (q, k, v)), name=NAME)
    lse_dtype = torch.float64 if dtype == np.float64 else torch.float32
    return (q.new_empty(tuple(q.shape[:2]) + (v.shape[-1],), dtype=torch_dtype(dtype)),
            q.new_empty(tuple(q.shape[:2]), dtype=lse_dtype))


@torch.library.custom_op("cuflash::attention_varlen_backward", mutates_args=())
def attention_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              cu_seqlens_k: torch.Tensor, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
                              scale: Optional[float], causal: bool, left: Optional[int], right: Optional[int],
                              precision: Optional[str] = None, dropout_p: float = 0.0,
                              seed: Optional[int] = None) -> List[torch.Tensor]:
    with on_stream(q.device):
        grads = varlen.attention_varlen_backward(
            to_array(dout), to_array(q), to_array(k), to_array(v), to_array(out), to_array(lse),
            to_array(cu_seqlens_q), to_array(cu_seqlens_k), max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            **packed_keywords(options(None, None, scale, causal, left, right, precision, dropout_p, seed)))
    return [to_tensor(g, q.device) for g in grads]


@attention_varlen_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, left, right,
      precision=None, dropout_p=0.0, seed=None):
    dtype = torch_dtype(common_dtype(*(numpy_dtype(x.dtype) for x in (q, k, v)), name=NAME))
    return [x.new_empty(x.shape, dtype=dtype) for x in (q, k, v)]


def setup_varlen_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *params = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(q, k, v, cu_q, cu_k, *output)
    ctx.params = params


def varlen_backward(ctx, dout, _dlse):
    q, k, v, cu_q, cu_k, out, lse = ctx.saved_tensors
    grads = torch.ops.cuflash.attention_varlen_backward(dout.contiguous(), q, k, v, out, lse, cu_q, cu_k,
                                                        *ctx.params)
    dq, dk, dv = (g.to(x.dtype) for g, x in zip(grads, (q, k, v)))
    return (dq, dk, dv) + (None,) * (2 + len(ctx.params))


attention_varlen_forward.register_autograd(varlen_backward, setup_context=setup_varlen_context)


def setup_context(ctx, inputs, output):
    q, k, v, mask, bias, scale, causal, left, right, *rest = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, mask, bias, out, lse)
    ctx.params = (scale, causal, left, right)
    ctx.rest = tuple(rest)  # precision, dropout_p and seed, as the forward had them


def backward(ctx, dout, _dlse):
    q, k, v, mask, bias, out, lse = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[4]
    grads = torch.ops.cuflash.attention_backward(dout, q, k, v, out, lse, mask, bias, *ctx.params, bias_grad,
                                                 *ctx.rest)
    # Autograd wants each gradient in its input's dtype; cuflash gives the forward's result dtype.
    dq, dk, dv = (g.to(x.dtype) for g, x in zip(grads, (q, k, v)))
    dbias = grads[3].to(bias.dtype) if bias_grad else None
    return (dq, dk, dv, None, dbias) + (None,) * (4 + len(ctx.rest))


attention_forward.register_autograd(backward, setup_context=setup_context)
