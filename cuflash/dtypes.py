"""dtype rules of the front door: NumPy's promotion, with bfloat16 (ml_dtypes) treated like float16."""

from __future__ import annotations

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)

FLOATS = (float16, bfloat16, float32, float64)


def native(dtype) -> np.dtype:
    """The dtype in this machine's byte order (NumPy's functions take either; the kernels read native bytes)."""
    dtype = np.dtype(dtype)
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def is_real_float(dtype) -> bool:
    return native(dtype) in FLOATS


def describe(dtype) -> str:
    return f"dtype('{np.dtype(dtype).name}')"


def common_dtype(*dtypes, name="attention") -> np.dtype:
    """numpy.result_type of the operands; integers and bools compute in float64 as NumPy's float functions do.

    NumPy cannot promote bfloat16 with most types, so bfloat16 promotes as float16 would, and float16 with
    bfloat16 gives float32 (the smallest type holding both)."""
    natives = [native(t) for t in dtypes]
    for t in natives:
        if not (is_real_float(t) or t.kind in "biu"):
            raise TypeError(
                f"{name}: unsupported dtype {describe(t)}; q, k and v must be real: "
                f"float16, bfloat16, float32, float64 (integers and bools compute in float64)")
    has_bf16, has_f16 = bfloat16 in natives, float16 in natives
    result = np.result_type(*[float16 if t == bfloat16 else t for t in natives])
    if result.kind in "biu":
        return float64
    if result == float16 and has_bf16:
        return float32 if has_f16 else bfloat16
    return result


def acc_dtype_of(dtype) -> np.dtype:
    """Accumulation type: float32 for 16- and 32-bit inputs, float64 for float64."""
    return float64 if np.dtype(dtype) == float64 else float32


def same_kind(src, dst) -> bool:
    """NumPy's same_kind casting, with bfloat16 counted as a float like the others."""
    src, dst = np.dtype(src), np.dtype(dst)
    if is_real_float(src) and is_real_float(dst):
        return True
    return np.can_cast(src, dst, casting="same_kind")
