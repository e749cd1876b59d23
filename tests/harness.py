"""Run one attention case through a backend with a NaN-poisoned out= and hold it to the accuracy rule."""

from __future__ import annotations

import numpy as np

import cuflash
from reference import assert_accurate, result_dtype_name


def result_shape(case):
    o = case.options
    shapes = [case.q.shape[:-2], case.k.shape[:-2], case.v.shape[:-2]]
    for key in ("mask", "bias"):
        if o.get(key) is not None:
            x = o[key]
            shapes.append(((1,) * max(0, 2 - x.ndim) + x.shape)[:-2])
    return tuple(np.broadcast_shapes(*shapes)) + (case.q.shape[-2], case.v.shape[-1])


def poisoned_out(shape, dtype, kind="contiguous"):
    """A NaN-filled array of `shape` held as the requested kind of view, so an unwritten element fails."""
    if kind == "strided" and shape:
        return np.full(shape[:-1] + (2 * shape[-1],), np.nan, dtype=dtype)[..., ::2]
    if kind == "reversed" and len(shape) >= 2:
        return np.full(shape, np.nan, dtype=dtype)[..., ::-1, :]
    return np.full(shape, np.nan, dtype=dtype)


def check_case(case, backend=None, to_device=None, **extra):
    """to_device: optional function moving NumPy arrays to the backend's array type (and back with .get())."""
    dtype = np.dtype(result_dtype_name(case.q, case.k, case.v))
    move = to_device or (lambda x: x)
    out = move(poisoned_out(result_shape(case), dtype, case.out_kind))
    options = {key: (move(val) if isinstance(val, np.ndarray) else val) for key, val in case.options.items()}
    result, lse = cuflash.attention(move(case.q), move(case.k), move(case.v), out=out, return_lse=True,
                                    backend=backend, **options, **extra)
    assert result is out
    get = (lambda x: x.get()) if to_device else (lambda x: x)
    assert_accurate(get(result), case.q, case.k, case.v, lse=get(lse), **case.options)


def problem_and_outputs(q, k, v, **options):
    """(Problem, out, lse) exactly as the front door hands them to a backend, caught by a stand-in backend."""
    import cuflash.backends as registry

    captured = {}

    class Spy:
        ARRAYS = "numpy"

        @staticmethod
        def run(problem, out, lse, block=None):
            captured.update(problem=problem, out=out, lse=lse)

    original = registry.get
    registry.get = lambda name, xp: Spy
    try:
        cuflash.attention(q, k, v, return_lse=True, **options)
    finally:
        registry.get = original
    return captured["problem"], captured["out"], captured["lse"]
