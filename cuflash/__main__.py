"""python -m cuflash: a short demonstration on whatever this machine has.

It runs one attention problem on the best backend available (CuPy on a CUDA device, else NumPy), times it,
checks a sample of rows against naive materialized attention in float64 (cuflash.reference), and says how much
memory the naive path's score matrix would have needed.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from . import attention, backends, cost
from .dtypes import FLOATS
from .reference import attention_reference


def cuda_device_name():
    """Name of CUDA device 0, or None when CuPy or a device is missing."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        props = cupy.cuda.runtime.getDeviceProperties(0)
        return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    except Exception:
        return None


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit status 2, without the usage block
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def size(text):
    """A size: an int of 0 or more (every legal size runs, 0 included)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; sizes are 0 or more")
    return value


def parse_args(argv):
    gpu = cuda_device_name()
    p = Parser(prog="python -m cuflash", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("numpy", "cupy", "simt"), default="cupy" if gpu else "numpy")
    p.add_argument("--batch", type=size, default=1)
    p.add_argument("--heads", type=size, default=16 if gpu else 4)
    p.add_argument("--n", type=size, default=4096 if gpu else 2048, help="query length")
    p.add_argument("--m", type=size, default=None, help="key length (default: n)")
    p.add_argument("--d", type=size, default=64, help="head dimension")
    p.add_argument("--dtype", choices=[t.name for t in FLOATS], default="float16" if gpu else "float32")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--check-rows", type=size, default=64, help="rows checked against naive attention")
    args = p.parse_args(argv)
    args.m = args.n if args.m is None else args.m
    args.gpu = gpu
    return args


def make_inputs(args, xp):
    rng = np.random.default_rng(0)
    shape = (args.batch, args.heads)
    dtype = next(t for t in FLOATS if t.name == args.dtype)
    q = rng.standard_normal(shape + (args.n, args.d), dtype=np.float32).astype(dtype)
    k = rng.standard_normal(shape + (args.m, args.d), dtype=np.float32).astype(dtype)
    v = rng.standard_normal(shape + (args.m, args.d), dtype=np.float32).astype(dtype)
    return q, k, v, [xp.asarray(x) for x in (q, k, v)]


def timed(fn, xp, repeats=3):
    """Median seconds of fn() after one warm-up call (device events on the GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if xp is np:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        else:
            # Recorded on the stream the kernels run on (CuPy's current one), whatever it is.
            stream = xp.cuda.get_current_stream()
            start, stop = xp.cuda.Event(), xp.cuda.Event()
            start.record(stream)
            fn()
            stop.record(stream)
            stop.synchronize()
            times.append(xp.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def main(argv=None):
    args = parse_args(argv)
    xp = np
    reason = backends.unavailable(args.backend)  # the backend's own sentence: no CuPy, no device, no compiler
    if reason:
        print(f"python -m cuflash: {reason}", file=sys.stderr)
        return 2
    if args.backend == "cupy":
        import cupy as xp
    q, k, v, (dq, dk, dv) = make_inputs(args, xp)
    where = args.gpu if args.backend == "cupy" else "the CPU" + (" (SIMT emulator)" if args.backend == "simt" else "")
    print(f"cuflash attention: batch {args.batch}, heads {args.heads}, n {args.n}, m {args.m}, d {args.d}, "
          f"{args.dtype}{', causal' if args.causal else ''}")
    print(f"backend: {args.backend} on {where}")

    out = attention(dq, dk, dv, causal=args.causal, backend=args.backend)
    seconds = timed(lambda: attention(dq, dk, dv, causal=args.causal, backend=args.backend), xp)
    flops = cost.flops(args.batch * args.heads, args.n, args.m, args.d, causal=args.causal)
    rate = f", {flops / seconds / 1e9:.1f} GFLOP/s" if seconds > 0 and flops > 0 else ""
    print(f"time: {seconds * 1e3:.2f} ms (median of 3){rate}")

    out = out if xp is np else xp.asnumpy(out)
    rows = np.unique(np.linspace(0, args.n - 1, min(args.n, args.check_rows)).astype(int))
    expected, _ = attention_reference(q, k, v, causal=args.causal, rows=rows)
    err = float(np.abs(out[..., rows, :].astype(np.float64) - expected).max(initial=0.0))
    print(f"check: {rows.size} rows per head against naive float64 attention, max abs error {err:.2e}")

    itemsize = np.dtype(args.dtype).itemsize
    scores = args.batch * args.heads * args.n * args.m * itemsize
    operands = sum(x.nbytes for x in (q, k, v)) + out.nbytes
    print(f"memory: naive attention's {args.n}x{args.m} score matrices alone need {scores / 2**20:,.1f} MiB "
          f"in {args.dtype}; cuflash holds none of them (inputs and output: {operands / 2**20:,.1f} MiB)")
    tolerance = {"float64": 1e-10, "float32": 1e-4}.get(args.dtype, 5e-2)
    if not err <= tolerance:
        print(f"error {err:.2e} is above the expected {tolerance:.0e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
