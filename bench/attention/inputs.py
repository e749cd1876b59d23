"""A point's inputs: several (q, k, v) sets in its dtype, rotated so that no call finds its operands in the
cache, shared with PyTorch through DLPack."""

from __future__ import annotations

import math

import numpy as np

from .failures import Skip, one_line
from .points import Point


def float_dtype(name):
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise Skip("bfloat16 needs ml_dtypes, which is not installed") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class InputSets:
    """count sets of (q, k, v) in the point's dtype, shape (batch, heads, rows, d), as the device's arrays.

    When the array module cannot hold the dtype (bfloat16 on an old CuPy), the sets stay float32 and only
    PyTorch gets them, cast on its side; `native` says which.
    """

    def __init__(self, dev, point: Point, count: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        shapes = [(point.batch, point.heads, rows, point.d) for rows in (point.n, point.m, point.m)]
        self.dtype, self.native, self.reason = point.dtype, True, None
        self.arrays = [self._cast(tuple(dev.normal(s, rng) for s in shapes), dev) for _ in range(count)]

    def _cast(self, x32, dev):
        if self.native:
            try:
                return tuple(x.astype(float_dtype(self.dtype)) for x in x32)
            except Exception as exc:  # noqa: BLE001 - any failure means "this module cannot"
                self.native = False
                self.reason = f"{dev.array_module} cannot make {self.dtype} arrays: {one_line(exc)}"
        return x32

    def native_arrays(self):
        if not self.native:
            raise Skip(self.reason)
        return self.arrays

    def torch_tensors(self, torch):
        dtype = getattr(torch, self.dtype)
        if not self.native:
            return [tuple(torch.from_dlpack(x).to(dtype) for x in s) for s in self.arrays]
        return [tuple(to_torch(torch, x, dtype) for x in s) for s in self.arrays]


def to_torch(torch, x, dtype):
    """Share x with PyTorch through DLPack; bfloat16 crosses as its uint16 bits where DLPack refuses it."""
    try:
        return torch.from_dlpack(x)
    except Exception:  # noqa: BLE001
        return torch.from_dlpack(x.view(np.uint16)).view(dtype)


def set_count(dev, point: Point) -> int:
    """Enough input sets to exceed twice the cache, between 2 and 8, within a quarter of free memory."""
    itemsize = 4 if point.dtype == "float32" else 8 if point.dtype == "float64" else 2
    one = point.batch * point.heads * (point.n + 2 * point.m) * point.d * itemsize
    want = min(8, max(2, math.ceil(2 * dev.cache_bytes() / max(one, 1))))
    return max(1, min(want, dev.free_bytes() // 4 // max(one, 1)))
