"""cuflash.torch: cuflash.attention on torch tensors, differentiable, and opaque to torch.compile.

    from cuflash.torch import attention
    out = attention(q, k, v, causal=True)        # q, k, v: torch tensors; out.backward(...) gives q.grad, ...

CPU tensors run on the numpy backend and CUDA tensors on the cupy backend (on torch's current stream), both
without copies: CPU tensors are viewed as NumPy arrays, CUDA tensors exchanged by DLPack. The forward and the
backward are torch.library custom operators (cuflash::attention_forward, cuflash::attention_backward) with fake
tensor rules, so torch.compile traces them as single opaque nodes. Only the front door is called: this module
translates tensors and nothing else.

The backward is cuflash.attention_backward: the numpy backend's blocked algorithm for CPU tensors, the CUDA
backward kernels (the blocked algorithm on CuPy's arrays past their head dims) for CUDA tensors. lse, when
returned, is not differentiable.
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from . import api, mods
from .blockmask import BlockMask
from .dtypes import bfloat16, common_dtype

__all__ = ["attention", "register_with_transformers", "transformers_attention"]

NAME = "cuflash.torch.attention"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
              causal: bool = False, window: Optional[Tuple[Optional[int], Optional[int]]] = None,
              mask: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
              score_mod: Optional[Callable] = None, mask_mod: Optional[Callable] = None,
              block_mask: Optional[BlockMask] = None, sinks: Optional[torch.Tensor] = None,
              return_lse: bool = False, precision: Optional[str] = None):
    """cuflash.attention with the same keywords, on torch tensors (all on one device); differentiable in q, k,
    v, bias and sinks (the backward runs with the same precision), and in the floating tensors score_mod closes
    over that require grad (learnable ALiBi slopes, a relative-position table: attention_backward's
    score_mod_grads). score_mod and mask_mod may be written with torch's operations over the tensors they close
    over (a mod written for flex_attention works unchanged); such calls run as an autograd function rather than
    the custom operators (a function is no operator argument). Returns out, or (out, lse) with return_lse=True."""
    left, right = (None, None) if window is None else window
    scale = None if scale is None else float(scale)
    precision = api.check_precision(precision, None, NAME)  # refused here, traced or not; the dtype's rule in the op
    if score_mod is not None or mask_mod is not None or block_mask is not None or sinks is not None:
        patterns = (score_mod, mask_mod, block_mask)
        out, lse = PatternAttention.apply(q, k, v, mask, bias, sinks, patterns,
                                          (scale, bool(causal), left, right, precision), *learnable(score_mod))
    else:
        out, lse = torch.ops.cuflash.attention_forward(q, k, v, mask, bias, scale, bool(causal), left, right,
                                                       precision)
    return (out, lse) if return_lse else out


def learnable(score_mod) -> Tuple[torch.Tensor, ...]:
    """The floating tensors score_mod closes over that require grad, each once (the autograd function's extra
    inputs; a mask_mod's tensors take no gradient: the mask is piecewise constant)."""
    found: dict = {}
    for _, value in mods.captured(score_mod) if score_mod is not None else ():
        if isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point():
            found.setdefault(id(value), value)
    return tuple(found.values())


class PatternAttention(torch.autograd.Function):
    """attention with mods, sinks or a block mask: the front door forward and backward, by tensors' arrays."""

    @staticmethod
    def forward(ctx, q, k, v, mask, bias, sinks, patterns, params, *tables):
        scale, causal, left, right, precision = params
        keywords = dict(options(mask, bias, scale, causal, left, right, precision), score_mod=patterns[0],
                        mask_mod=patterns[1], block_mask=patterns[2], sinks=to_array(sinks))
        with on_stream(q.device):
            out, lse = api.attention(to_array(q), to_array(k), to_array(v), return_lse=True, **keywords)
        out, lse = to_tensor(out, q.device), to_tensor(lse, q.device)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, mask, bias, sinks, out, lse)
        ctx.keywords, ctx.tables = keywords, tables
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, mask, bias, sinks, out, lse = ctx.saved_tensors
        bias_grad = bias is not None and ctx.needs_input_grad[4]
        keywords = dict(ctx.keywords, mask=to_array(mask), bias=to_array(bias), sinks=to_array(sinks))
        with on_stream(q.device):
            grads = api.attention_backward(to_array(dout.contiguous()), to_array(q), to_array(k), to_array(v),
                                           to_array(out), to_array(lse), bias_grad=bias_grad,
                                           score_mod_grads=ctx.tables, **keywords)
        grads = [to_tensor(g, q.device) for g in grads]
        dq, dk, dv = (g.to(x.dtype) for g, x in zip(grads, (q, k, v)))
        dbias = grads[3].to(bias.dtype) if bias_grad else None
        tables = ctx.tables
        dtables = tuple(g.to(t.dtype) for g, t in zip(grads[len(grads) - len(tables):], tables))
        dsinks = grads[len(grads) - len(tables) - 1].to(sinks.dtype).reshape(sinks.shape) if sinks is not None \
            else None
        return (dq, dk, dv, None, dbias, dsinks, None, None) + dtables


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face transformers


def register_with_transformers(name: str = "cuattention") -> str:
    """Make cuflash an attention implementation of Hugging Face transformers under `name`: then
    AutoModel.from_pretrained(..., attn_implementation=name) runs its attention through cuflash. Its mask
    interface builds no mask: it hands transformers' own mask function (padding, causal, sliding windows, packed
    sequences, ...) to the attention as a mask_mod (ModMask), or None where causal alone says it. (transformers
    takes any name containing "flash" for a FlashAttention kernel of its hub, hence not "cuflash".)"""
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

    def mask_mod(self, device=None):
        """The mask_mod of the attention's (batch, kv head, group, i, j) indices (transformers' masks have one
        head: index 0; their positions start at the offsets), its offsets on `device` (the query's)."""
        if device is not None and self.offsets.device != device:
            self.offsets = self.offsets.to(device)  # once (a mask interface told no device): layers share it
        fn, offsets = self.mask_function, self.offsets

        def transformers_mask_mod(b, kv_head, group, i, j):
            return fn(b, 0, i + offsets[0], j + offsets[1])
        return transformers_mask_mod


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
    """The attention function transformers calls (its "sdpa" contract): query (batch, heads, n, d), key and value
    (batch, kv_heads, m, d) with heads a multiple of kv_heads (grouped-query attention by broadcasting, never
    repeated); attention_mask a ModMask (transformers_mask's: the mask function as a mask_mod), boolean (True =
    attend) or additive, or None with causal from is_causal or the module (and sliding_window as window=);
    position_bias added to the scores; softcap as score_mod (cap tanh(s / cap), before any mask); s_aux one sink
    per head. Returns (batch, n, heads, e) and no weights."""
    if dropout and module.training:
        raise ValueError(f"{NAME}: attention dropout ({dropout}) is not supported; set the model's attention "
                         f"dropout to 0 or call model.eval()")
    n, heads, kv_heads = query.shape[2], query.shape[1], key.shape[1]
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
                    score_mod=None if softcap is None else mods.softcap(float(softcap)), sinks=sinks)
    return out.reshape(out.shape[0], heads, n, out.shape[-1]).transpose(1, 2).contiguous(), None


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


def options(mask, bias, scale, causal, left, right, precision) -> dict:
    window = None if left is None and right is None else (left, right)
    return {"mask": to_array(mask), "bias": to_array(bias), "scale": scale, "causal": causal, "window": window,
            "precision": precision}


# ----------------------------------------------------------------------------------------------------------------
# The operators


@torch.library.custom_op("cuflash::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                      bias: Optional[torch.Tensor], scale: Optional[float], causal: bool, left: Optional[int],
                      right: Optional[int], precision: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    with on_stream(q.device):
        out, lse = api.attention(to_array(q), to_array(k), to_array(v), return_lse=True,
                                 **options(mask, bias, scale, causal, left, right, precision))
    return to_tensor(out, q.device), to_tensor(lse, q.device)


@attention_forward.register_fake
def _(q, k, v, mask, bias, scale, causal, left, right, precision=None):
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
                       bias_grad: bool, precision: Optional[str] = None) -> List[torch.Tensor]:
    with on_stream(q.device):
        grads = api.attention_backward(to_array(dout), to_array(q), to_array(k), to_array(v), to_array(out),
                                       to_array(lse), bias_grad=bias_grad,
                                       **options(mask, bias, scale, causal, left, right, precision))
    return [to_tensor(g, q.device) for g in grads]


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, mask, bias, scale, causal, left, right, bias_grad, precision=None):
    dtype = torch_dtype(common_dtype(*(numpy_dtype(x.dtype) for x in (q, k, v)), name=NAME))
    operands = (q, k, v) + ((bias,) if bias_grad else ())
    return [x.new_empty(x.shape, dtype=dtype) for x in operands]


def setup_context(ctx, inputs, output):
    q, k, v, mask, bias, scale, causal, left, right, precision = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, mask, bias, out, lse)
    ctx.params = (scale, causal, left, right)
    ctx.precision = precision


def backward(ctx, dout, _dlse):
    q, k, v, mask, bias, out, lse = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[4]
    grads = torch.ops.cuflash.attention_backward(dout, q, k, v, out, lse, mask, bias, *ctx.params, bias_grad,
                                                 ctx.precision)
    # Autograd wants each gradient in its input's dtype; cuflash gives the forward's result dtype.
    dq, dk, dv = (g.to(x.dtype) for g, x in zip(grads, (q, k, v)))
    dbias = grads[3].to(bias.dtype) if bias_grad else None
    return dq, dk, dv, None, dbias, None, None, None, None, None


attention_forward.register_autograd(backward, setup_context=setup_context)
