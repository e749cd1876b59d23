"""The backends timed side by side: cuflash (the planner's tiling, and forced ones), naive attention with the
scores materialized, and PyTorch's SDPA forced to each of its kernels. A Runner's prepare(dev, point, sets)
returns call(i), which runs on input set i (mod the count)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import numpy as np

from cuflash import cost

from .failures import Skip, one_line
from .inputs import float_dtype
from .points import Point


@dataclass
class Runner:
    name: str
    backend: str
    variant: str
    prepare: Callable
    allocator: str = "device"  # whose counter sees its allocations: "device" (CuPy / tracemalloc) or "torch"


def cuflash_runner(block, precision=None) -> Runner:
    """cuflash with the planner's tiles (block None) or forced ones; precision (float32 and float64 points only:
    "tf32", or "fma" for the CUDA-core kernel) beside the default."""
    def prepare(dev, point, sets):
        if precision is not None and point.dtype not in ("float32", "float64"):
            raise Skip(f"precision={precision!r} is timed on float32 and float64 points")
        if precision == "tf32" and point.dtype != "float32":
            raise Skip("precision='tf32' is float32's")
        cuflash = import_cuflash()
        arrays = sets.native_arrays()
        options = dict(causal=point.causal, backend=dev.array_module, block=block, precision=precision)

        def call(i):
            return cuflash.attention(*arrays[i % len(arrays)], **options)

        call.block, call.splits = heuristic_plan(point, precision) if block is None and dev.gpu else (block, None)
        return call

    name = "cuflash" if block is None else f"cuflash[{block[0]}x{block[1]}]"
    variant = "heuristic" if block is None else f"block={block[0]}x{block[1]}"
    if precision is not None:
        name, variant = f"cuflash[{precision}]", f"precision={precision}"
    return Runner(name, "cuflash", variant, prepare)


def heuristic_plan(point: Point, precision=None) -> Tuple[Optional[Tuple[int, int]], Optional[int]]:
    """((Br, Bc), key splits) that cuflash's planner picks for this point on the current GPU; (None, None) without
    one. The point's n, m and batch count matter: decoding shapes take other tiles and split keys."""
    from cuflash import BackendUnavailableError, tiling
    from cuflash.family import Shape

    shape = Shape(float_dtype(point.dtype), point.d, point.d, point.n, point.m, point.batch * point.heads,
                  precision or "highest")
    try:
        plan = tiling.plan(shape, tiling.DeviceLimits.of())
    except (BackendUnavailableError, ValueError):  # no GPU here, or nothing fits it: the record says none
        return None, None
    return (plan.config.Br, plan.config.Bc), plan.splits


def import_cuflash():
    try:
        import cuflash
    except Exception as exc:  # noqa: BLE001 - e.g. ml_dtypes missing on a borrowed machine
        raise Skip(f"cannot import cuflash: {one_line(exc)}") from None
    return cuflash


def naive_attention(xp, q, k, v, causal_bias, scale):
    """Softmax attention with the scores materialized: matmul in the input dtype, softmax in float32 (float64
    for float64 inputs), the probabilities cast back for the second matmul. Rows that see no key give NaN."""
    acc = np.float64 if q.dtype == np.float64 else np.float32
    s = xp.matmul(q, xp.swapaxes(k, -1, -2)).astype(acc)
    s *= scale
    if causal_bias is not None:
        s += causal_bias
    s -= s.max(axis=-1, keepdims=True)
    xp.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return xp.matmul(s.astype(q.dtype), v)


def naive_bytes_per_pair(itemsize: int, acc: int = 4) -> int:
    """DRAM bytes per (query, key) pair that naive_attention moves without causal, when no pass hits the cache:
    S written (itemsize); cast read + write (itemsize + acc); scale, subtract, exp, divide read + write (2 acc
    each); max and sum read (acc each); cast back read + write (acc + itemsize); P read by the second matmul."""
    return 4 * itemsize + 12 * acc


def causal_bias(xp, point: Point, dtype):
    """(n, m) additive mask: -inf where key j is after query i + (m - n) (bottom-right, like cuflash)."""
    i = xp.arange(point.n)[:, None]
    j = xp.arange(point.m)[None, :]
    return xp.where(j <= i + (point.m - point.n), 0.0, -np.inf).astype(dtype)


def naive_runner(module: str) -> Runner:
    def prepare(dev, point, sets):
        arrays = sets.native_arrays()
        acc = 8 if point.dtype == "float64" else 4
        check_memory(dev, point, point.pairs * (float_dtype(point.dtype).itemsize + acc), "the scores")
        bias = causal_bias(dev.xp, point, np.float64 if acc == 8 else np.float32) if point.causal else None
        scale = 1.0 / math.sqrt(point.d)
        return lambda i: naive_attention(dev.xp, *arrays[i % len(arrays)], bias, scale)

    return Runner(f"naive-{module}", "naive", module, prepare)


def check_memory(dev, point, need, what):
    free = dev.free_bytes()
    if need * 1.25 > free:
        raise Skip(f"{what} need {need / cost.GiB:.1f} GiB and {free / cost.GiB:.1f} GiB are free")


TORCH_SDPA = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
              "math": "MATH"}


def torch_runner(kind: str) -> Runner:
    def prepare(dev, point, sets):
        torch = import_torch(dev)
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except ImportError as exc:
            raise Skip(f"this PyTorch has no torch.nn.attention.sdpa_kernel: {one_line(exc)}") from None
        backend = getattr(SDPBackend, TORCH_SDPA[kind], None)
        if backend is None:
            raise Skip(f"this PyTorch has no SDPBackend.{TORCH_SDPA[kind]}")
        if kind == "math":
            check_memory(dev, point, point.pairs * 12, "the math backend's scores")
        options = torch_causal(point)
        tensors = sets.torch_tensors(torch)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def call(i):
            with sdpa_kernel(backend):
                return sdpa(*tensors[i % len(tensors)], **options)

        return call

    return Runner(f"torch-{kind}", "torch-sdpa", kind, prepare, allocator="torch")


def import_torch(dev):
    try:
        import torch
    except ImportError:
        raise Skip("PyTorch is not installed") from None
    if dev.gpu and not torch.cuda.is_available():
        raise Skip(f"PyTorch {torch.__version__} sees no CUDA device")
    return torch


def torch_causal(point: Point) -> dict:
    """SDPA's is_causal is top-left aligned; cuflash's causal is bottom-right, which SDPA spells as a bias."""
    if not point.causal:
        return {}
    if point.n == point.m:
        return {"is_causal": True}
    try:
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:
        raise Skip("bottom-right causal with n != m needs torch.nn.attention.bias.causal_lower_right") from None
    return {"attn_mask": causal_lower_right(point.n, point.m)}


def runners_for(dev, blocks, wanted) -> List[Runner]:
    """The heuristic's cuflash, each forced tiling, naive attention, then PyTorch's SDPA backends (on a GPU)."""
    every = [cuflash_runner(None)] + [cuflash_runner(b) for b in blocks]
    every += [cuflash_runner(None, p) for p in ("tf32", "fma")] if dev.gpu else []
    every += [naive_runner(dev.array_module)]
    every += [torch_runner(kind) for kind in TORCH_SDPA]
    default = ("cuflash", "naive", "torch") if dev.gpu else ("cuflash", "naive")
    wanted = wanted or default
    return [r for r in every if any(r.name.startswith(w) for w in wanted)]


def peer_name(dev) -> str:
    return "torch-flash" if dev.gpu else "naive-numpy"
