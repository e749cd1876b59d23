"""Run one attention case through a backend with a NaN-poisoned out= and hold it to the accuracy rule."""

from __future__ import annotations

import importlib

import os
import subprocess
import sys

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


def on_device(x, to_device):
    """x moved by to_device with its layout kept (strides, stride-0 axes, offset, reversed axes): the bytes it spans
    travel and the same view is taken there. to_device alone (cupy.asarray) hands over a compact copy, so device
    runs would never see a strided out= or a strided input."""
    if not isinstance(x, np.ndarray) or x.size == 0 or x.flags.c_contiguous or any(s % x.itemsize for s in x.strides):
        return to_device(x)
    item = x.itemsize
    lo = sum((size - 1) * s for size, s in zip(x.shape, x.strides) if s < 0)
    hi = sum((size - 1) * s for size, s in zip(x.shape, x.strides) if s > 0) + item
    lowest = x[tuple(size - 1 if s < 0 else 0 for size, s in zip(x.shape, x.strides)) + (...,)]  # a 0-d view
    span = to_device(np.lib.stride_tricks.as_strided(lowest, shape=((hi - lo) // item,), strides=(item,)).copy())
    xp = importlib.import_module(type(span).__module__.split(".")[0])
    return xp.lib.stride_tricks.as_strided(span[-lo // item:], shape=x.shape, strides=x.strides)


def record_events(case, backend, block=None, precision=None):
    """Tell hypothesis's statistics what this example reaches (`--hypothesis-show-statistics`): dtype, causal,
    window, mask, bias, large logits, poisoned hidden keys, and for the kernels the kernel, its head-dim bucket,
    several key tiles, more rows than one query tile and split keys. Outside a property it does nothing."""
    from hypothesis import event
    from hypothesis.control import currently_in_test_context

    if not currently_in_test_context():
        return
    o = case.options
    event(f"dtype {result_dtype_name(case.q, case.k, case.v)}")
    for name, reached in (("causal", o.get("causal")), ("window", o.get("window") is not None),
                          ("mask", o.get("mask") is not None), ("bias", o.get("bias") is not None),
                          ("bias hides keys", o.get("bias") is not None and
                           np.isneginf(o["bias"].astype(np.float64)).any()),
                          ("large logits", case.q.size and np.abs(case.q.astype(np.float64)).max() > 8),
                          ("non-finite input", not all(np.isfinite(x.astype(np.float64)).all()
                                                       for x in (case.k, case.v)))):
        if reached:
            event(name)
    n, m = case.q.shape[-2], case.k.shape[-2]
    if n == 0 or m == 0 or 0 in result_shape(case)[:-2]:
        event("empty")  # the front door answers without a backend
        return
    if backend == "numpy":
        from cuflash import blocked
        bc = block[1] if isinstance(block, tuple) else blocked.DEFAULT_BC
        event(f"key tiles {'> 1' if m > bc else '1'}")
        return
    if backend == "simt":
        from cuflash import tiling
        from cuflash.backends import simt
        problem = problem_and_outputs(case.q, case.k, case.v, precision=precision, **o)[0]
        plan = tiling.plan(problem.shape, simt.DEVICE, block)
        config = plan.config
        D = plan.family.buckets(problem.shape, config)[0]
        event(f"kernel {config.variant} d bucket {D if problem.d <= D else 'sliced'}")
        event(f"key tiles {'> 1' if m > config.Bc else '1'}")
        event(f"n {'>' if n > config.Br else '<='} Br")
        if plan.splits > 1:
            event("split keys")


def check_case(case, backend=None, to_device=None, **extra):
    """to_device: optional function moving NumPy arrays to the backend's array type (and back with .get());
    operands and out= keep their layout there (on_device)."""
    record_events(case, backend, extra.get("block"), extra.get("precision"))
    dtype = np.dtype(result_dtype_name(case.q, case.k, case.v))
    move = (lambda x: on_device(x, to_device)) if to_device else (lambda x: x)
    out = move(poisoned_out(result_shape(case), dtype, case.out_kind))
    options = {key: (move(val) if isinstance(val, np.ndarray) else val) for key, val in case.options.items()}
    result, lse = cuflash.attention(move(case.q), move(case.k), move(case.v), out=out, return_lse=True,
                                    backend=backend, **options, **extra)
    assert result is out
    get = (lambda x: x.get()) if to_device else (lambda x: x)
    assert_accurate(get(result), case.q, case.k, case.v, lse=get(lse), precision=extra.get("precision"),
                    **case.options)


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


def run_under_race(case):
    """Run memcheck_cases.py's CASE in a child with ThreadSanitizer preloaded and the emulator in race mode (a race
    between a block's threads, or between blocks, ends it with exit status 66); returns the CompletedProcess."""
    import cuflash.simt

    here = os.path.dirname(os.path.abspath(__file__))
    env = cuflash.simt.sanitizer_env("race")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), here])
    return subprocess.run([sys.executable, os.path.join(here, "memcheck_cases.py"), case], env=env,
                          capture_output=True, text=True, timeout=900)


def run_under_memcheck(case):
    """Run memcheck_cases.py's CASE in a child with AddressSanitizer preloaded and the emulator in memcheck mode
    (ASan stops the process at its first report); returns the CompletedProcess."""
    import cuflash.simt

    here = os.path.dirname(os.path.abspath(__file__))
    env = cuflash.simt.memcheck_env()
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), here])
    return subprocess.run([sys.executable, os.path.join(here, "memcheck_cases.py"), case], env=env,
                          capture_output=True, text=True, timeout=900)
