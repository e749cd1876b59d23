"""Time cuflash.attention beside naive attention and PyTorch's SDPA, side by side in one run.

    python bench/attention.py --tiny --out DIR      # CI: seconds on any machine, NumPy backend vs naive NumPy
    python bench/attention.py --out DIR             # the default sweep on a CUDA GPU (the cpu preset without one)
    python bench/attention.py --preset fa2          # the tensor-core targets: 16k tokens per batch, hidden 2048
    python bench/attention.py --preset short        # the few points the device check runs
    python bench/attention.py --ncu --out DIR       # DRAM bytes measured by ncu beside the traffic model

Every backend of a point runs on the same inputs. A time is the median of per-call timings (CUDA events on a
GPU, perf_counter on the CPU) after warm-up, the calls cycling through enough input sets that the L2 cache
cannot serve a repeat. FLOPs are cost.flops (4*B*H*n*m*d, causal pairs counted exactly); each rate is also
given as a fraction of a large matmul timed in the same run, and as a speed ratio to the peer (PyTorch's flash
SDPA on a GPU, naive NumPy on the CPU). A point a backend cannot run is recorded with the reason, never fatal.
Output: results.json, results.md and PNG plots (with matplotlib) in --out, rewritten after every point.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import io
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import tracemalloc
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cuflash import cost  # noqa: E402  (cost needs numpy only, so it imports where cuflash's backends cannot)

SCHEMA = "cuflash-bench-attention/1"
ROWS_CHECKED = 16  # query rows per sampled batch item compared with float64 attention


# ---------------------------------------------------------------------------------------------------------
# Points and presets
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One attention problem: (batch, heads, n, d) queries against (batch, heads, m, d) keys and values."""

    dtype: str
    batch: int
    heads: int
    n: int
    m: int
    d: int
    causal: bool

    @property
    def label(self) -> str:
        return (f"{self.dtype} {self.batch}x{self.heads} n={self.n} m={self.m} d={self.d}"
                + (" causal" if self.causal else ""))

    @property
    def pairs(self) -> int:
        return self.batch * self.heads * self.n * self.m

    def flops(self) -> int:
        return cost.flops(self.batch * self.heads, self.n, self.m, self.d, causal=self.causal)


def grid(dtypes, ds, ns, causals=(False, True), m_per_n=1.0, tokens=16384, hidden=2048) -> List[Point]:
    """Points with tokens = batch * n and hidden = heads * d held fixed, as FlashAttention-2's benchmark does."""
    return [Point(t, max(1, tokens // n), max(1, hidden // d), n, max(1, int(n * m_per_n)), d, c)
            for t in dtypes for d in ds for n in ns for c in causals]


@dataclass(frozen=True)
class Preset:
    points: Tuple[Point, ...]
    blocks: Tuple[Tuple[int, int], ...]  # forced cuflash tilings timed beside the heuristic's choice
    gpu: bool  # needs a CUDA device
    warmup: int
    repeats: int
    matmul: int  # side of the square matmul timed as the peak
    budget_s: float = 2.0  # timing stops after this many seconds per backend (at least 3 calls)


def decode(dtype, d, ms, batch=1, heads=16) -> List[Point]:
    """Decoding points: one query per head over an m-key cache, too few blocks to fill a GPU unless keys split."""
    return [Point(dtype, batch, heads, 1, m, d, False) for m in ms]


HALF = ("float16", "bfloat16")
FA2_POINTS = grid(HALF, (64, 128), (1024, 2048, 4096, 8192, 16384))
PRESETS = {
    # The tensor-core issue's targets: forward, n = m from 1k to 16k, B*n = 16384, heads = 2048 / d.
    "fa2": Preset(tuple(FA2_POINTS), ((128, 64), (128, 128), (64, 64)), True, 3, 20, 8192),
    # Everything: the fa2 points, other head dims, float32, and n != m both ways.
    "sweep": Preset(tuple(FA2_POINTS
                          + grid(HALF, (32, 256), (1024, 4096, 16384))
                          + grid(("float32",), (64, 128), (1024, 4096))
                          + grid(("float16",), (64, 128), (1024, 4096), m_per_n=4)
                          + grid(("float16",), (128,), (4096,), causals=(False,), m_per_n=0.25)
                          + decode("float16", 128, (4096, 16384, 65536))),
                    ((128, 64), (64, 64)), True, 3, 10, 8192),
    # The device check's: a couple of minutes with kernel compilation included.
    "short": Preset(tuple(grid(HALF, (128,), (2048, 8192), causals=(False,))
                          + grid(("float16",), (128,), (8192,), causals=(True,))
                          + grid(("float16",), (64,), (4096,), causals=(False,))
                          + grid(("float16",), (128,), (1024,), m_per_n=4)
                          + decode("float16", 128, (32768,))),
                    ((128, 64),), True, 2, 10, 8192, budget_s=1.0),
    # A CPU without a GPU: the NumPy backend against naive NumPy.
    "cpu": Preset(tuple(grid(("float32",), (64,), (256, 512, 1024), tokens=1024, hidden=256)
                        + grid(("float64",), (64,), (1024,), causals=(False,), tokens=1024, hidden=256)
                        + grid(("float32",), (64,), (256,), m_per_n=4, tokens=1024, hidden=256)),
                  ((128, 256),), False, 1, 5, 1024, budget_s=1.0),
    # CI: a few seconds.
    "tiny": Preset(tuple(grid(("float32",), (16,), (64, 256), tokens=512, hidden=32)
                         + grid(("float32",), (16,), (64,), m_per_n=2, tokens=512, hidden=32)),
                   ((32, 32),), False, 1, 3, 256, budget_s=0.5),
}


# ---------------------------------------------------------------------------------------------------------
# Devices: how to time a call, measure its peak memory, and make arrays
# ---------------------------------------------------------------------------------------------------------


class Skip(Exception):
    """A backend cannot run a point; the message says why."""


def float_dtype(name):
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise Skip("bfloat16 needs ml_dtypes, which is not installed") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class Cpu:
    gpu = False
    xp = np
    array_module = "numpy"
    timing = "time.perf_counter around each call"
    min_sample_s = 0.0
    memory = {"device": "tracemalloc: peak traced bytes during one call, output included (NumPy reports its "
                        "allocations to tracemalloc)",
              "torch": "not measured on the CPU"}

    def sync(self):
        pass

    def time_call(self, call) -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    def peak_bytes(self, call, allocator) -> Optional[int]:
        if allocator != "device":
            call()
            return None
        tracemalloc.start()
        try:
            out = call()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        del out
        return peak

    def free_bytes(self) -> int:
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return 8 * cost.GiB

    def cache_bytes(self) -> int:
        return 32 * cost.MiB  # a large last-level cache; the CPU does not say portably

    def normal(self, shape, rng) -> Any:
        return rng.standard_normal(shape, dtype=np.float32)

    def release(self):
        gc.collect()

    def env(self) -> dict:
        return {"cpu": cpu_model(), "cpu_count": os.cpu_count()}


class Gpu:
    gpu = True
    array_module = "cupy"
    timing = ("cupy.cuda.Event pair on the null stream around each call, or around a group of back-to-back calls "
              "(calls_per_sample) when one call is shorter than 1 ms, so that host launch overhead hides")
    min_sample_s = 1e-3
    memory = {"device": "growth of CuPy's default memory pool (total_bytes) during one call after free_all_blocks: "
                        "the call's peak, output included, rounded to the pool's block sizes",
              "torch": "torch.cuda.max_memory_allocated during one call after reset_peak_memory_stats, minus the "
                       "bytes allocated before it"}

    def __init__(self):
        import cupy

        self.cp = self.xp = cupy
        self.pool = cupy.get_default_memory_pool()
        self.props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)

    def sync(self):
        self.cp.cuda.Device().synchronize()

    def time_call(self, call) -> float:
        start, stop = self.cp.cuda.Event(), self.cp.cuda.Event()
        start.record()
        call()
        stop.record()
        stop.synchronize()
        return self.cp.cuda.get_elapsed_time(start, stop) / 1e3

    def peak_bytes(self, call, allocator) -> int:
        self.release()
        if allocator == "torch":
            torch = sys.modules["torch"]
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = call()
            self.sync()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            base = self.pool.total_bytes()
            out = call()
            self.sync()
            peak = self.pool.total_bytes() - base
        del out
        return int(peak)

    def free_bytes(self) -> int:
        return int(self.cp.cuda.runtime.memGetInfo()[0] + self.pool.free_bytes())

    def cache_bytes(self) -> int:
        return int(self.props.get("l2CacheSize", 50 * cost.MiB))

    def normal(self, shape, rng) -> Any:
        return self.cp.random.RandomState(int(rng.integers(2**31))).standard_normal(shape, dtype=np.float32)

    def release(self):
        gc.collect()
        self.sync()
        self.pool.free_all_blocks()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def env(self) -> dict:
        rt, p = self.cp.cuda.runtime, self.props
        name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
        return {"gpu": name, "compute_capability": f"{p['major']}.{p['minor']}",
                "sm_count": p.get("multiProcessorCount"), "l2_bytes": p.get("l2CacheSize"),
                "memory_bytes": p.get("totalGlobalMem"),
                "driver": nvidia_smi_driver(), "cuda_driver_api": cuda_version(rt.driverGetVersion()),
                "cuda_runtime": cuda_version(rt.runtimeGetVersion())}


def cuda_device_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def nvidia_smi_driver() -> Optional[str]:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------------------------------------------------
# Inputs, rotated so that no call finds its operands in the cache
# ---------------------------------------------------------------------------------------------------------


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


def to_host(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        return x.detach().double().cpu().numpy()
    if type(x).__module__.startswith("cupy"):
        x = x.get()
    return np.asarray(x).astype(np.float64)


def sample(x, rows):
    """The first and last batch items' given rows of a (batch, heads, rows, cols) array, as float64 on the host."""
    flat = x.reshape(-1, x.shape[-2], x.shape[-1])
    rows = rows.tolist() if isinstance(rows, np.ndarray) else rows
    return np.stack([to_host(flat[i][rows]) for i in (0, flat.shape[0] - 1)])


def reference(sets: InputSets, point: Point):
    """float64 attention of the sampled rows of the first input set: (rows, output sample)."""
    rows = np.unique(np.linspace(0, point.n - 1, min(point.n, ROWS_CHECKED)).astype(np.int64))
    qs, ks, vs = (sample(x, r) for x, r in zip(sets.arrays[0], (rows, slice(None), slice(None))))
    if not sets.native:  # float32 here, rounded to the dtype on PyTorch's side
        qs, ks, vs = (rounded(x, point.dtype) for x in (qs, ks, vs))
    s = qs @ np.swapaxes(ks, -1, -2) / math.sqrt(point.d)
    if point.causal:
        s = np.where(np.arange(point.m)[None, :] <= rows[:, None] + (point.m - point.n), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return rows, (p / p.sum(axis=-1, keepdims=True)) @ vs


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    try:
        return x.astype(float_dtype(dtype)).astype(np.float64)
    except Skip:
        return x


# ---------------------------------------------------------------------------------------------------------
# Backends: prepare(dev, point, sets) returns call(i), which runs on input set i (mod the count)
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Runner:
    name: str
    backend: str
    variant: str
    prepare: Callable
    allocator: str = "device"  # whose counter sees its allocations: "device" (CuPy / tracemalloc) or "torch"


def cuflash_runner(block) -> Runner:
    def prepare(dev, point, sets):
        cuflash = import_cuflash()
        arrays = sets.native_arrays()
        options = dict(causal=point.causal, backend=dev.array_module, block=block)

        def call(i):
            return cuflash.attention(*arrays[i % len(arrays)], **options)

        call.block, call.splits = heuristic_plan(point) if block is None and dev.gpu else (block, None)
        return call

    name = "cuflash" if block is None else f"cuflash[{block[0]}x{block[1]}]"
    return Runner(name, "cuflash", "heuristic" if block is None else f"block={block[0]}x{block[1]}", prepare)


def heuristic_plan(point: Point) -> Tuple[Optional[Tuple[int, int]], Optional[int]]:
    """((Br, Bc), key splits) that cuflash's planner picks for this point on the current GPU; (None, None) if
    unknown. The point's n, m and batch count: decoding shapes take other tiles and split keys."""
    try:
        from cuflash import tiling

        shape = SimpleNamespace(dtype=float_dtype(point.dtype), d=point.d, e=point.d, n=point.n, m=point.m,
                                batch_size=point.batch * point.heads)
        device = tiling.DeviceLimits.of()
        config = tiling.choose(shape, device)
        return (config.Br, config.Bc), tiling.key_splits(shape, config, device)
    except Exception:  # noqa: BLE001 - the planner's API may change; the plan is only informative
        return None, None


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
    every = [cuflash_runner(None)] + [cuflash_runner(b) for b in blocks] + [naive_runner(dev.array_module)]
    every += [torch_runner(kind) for kind in TORCH_SDPA]
    default = ("cuflash", "naive", "torch") if dev.gpu else ("cuflash", "naive")
    wanted = wanted or default
    return [r for r in every if any(r.name.startswith(w) for w in wanted)]


def peer_name(dev) -> str:
    return "torch-flash" if dev.gpu else "naive-numpy"


# ---------------------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------------------


def one_line(exc, limit=400) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split()) if not isinstance(exc, Skip) else str(exc)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_cannot_run(exc) -> bool:
    """Errors that say "this backend cannot run this point" rather than "something broke"."""
    name = type(exc).__name__
    text = str(exc)
    return (isinstance(exc, Skip) or name in ("BackendUnavailableError", "OutOfMemoryError", "NotImplementedError")
            or "No available kernel" in text or "No viable backend" in text or "out of memory" in text.lower())


def time_calls(dev, call, warmup: int, repeats: int, budget_s: float) -> Tuple[List[float], int]:
    """Seconds per call after warm-up, one sample per group of back-to-back calls; stops early once budget_s is
    spent (keeping at least 3 samples). A group is one call unless a call is shorter than dev.min_sample_s: then
    enough calls are queued between the two events that the host's launch overhead hides behind the GPU's work."""
    for i in range(warmup):
        call(i)  # compiles kernels, fills plan caches
    dev.sync()
    group = 1
    if dev.min_sample_s:
        one = dev.time_call(lambda: call(warmup))
        group = max(1, min(100, math.ceil(dev.min_sample_s / max(one, 1e-9))))
    times: List[float] = []
    begin, start = time.perf_counter(), warmup + 1
    while len(times) < repeats:
        times.append(dev.time_call(lambda: run_group(call, start, group)) / group)
        start += group
        if len(times) >= 3 and time.perf_counter() - begin > budget_s:
            break
    return times, group


def run_group(call, start: int, count: int):
    for i in range(start, start + count):
        call(i)


def measure(dev, runner: Runner, point: Point, sets: InputSets, preset: Preset, ref) -> dict:
    """One backend on one point: the times, the error on sampled rows, the peak memory, or why it did not run."""
    rec = {"name": runner.name, "backend": runner.backend, "variant": runner.variant, "status": "ok", "reason": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call = runner.prepare(dev, point, sets)
            rec["block"] = getattr(call, "block", None)
            rec["splits"] = getattr(call, "splits", None)
            times, rec["calls_per_sample"] = time_calls(dev, call, preset.warmup, preset.repeats, preset.budget_s)
            rows, expected = ref
            rec["max_abs_err"] = float(np.max(np.abs(sample(call(0), rows) - expected)))
            rec["peak_bytes"] = dev.peak_bytes(lambda: call(0), runner.allocator)
            rec["peak_bytes_method"] = dev.memory[runner.allocator]
            rec.update(rates(point, times))
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run a point must not end the sweep
            rec["status"] = "skipped" if is_cannot_run(exc) else "error"
            said = [one_line(w.message, 300) for w in caught if "kernel not used" in str(w.message)
                    or "Memory efficient" in str(w.message) or "cuDNN" in str(w.message)]
            rec["reason"] = "; ".join([one_line(exc)] + sorted(set(said))[:4])
            dev.release()
    return rec


def rates(point: Point, times: List[float]) -> dict:
    median = float(np.median(times))
    return {"time_ms": median * 1e3, "times_ms": [t * 1e3 for t in times],
            "tflops": point.flops() / median / 1e12 if median > 0 else None}


def relate(records: List[dict], peer: str, peak: Optional[float]):
    """Fill in each record's fraction of the matmul peak and its speed relative to the peer."""
    peer_ms = next((r["time_ms"] for r in records if r["name"] == peer and r["status"] == "ok"), None)
    for r in records:
        if r["status"] != "ok":
            continue
        r["matmul_fraction"] = r["tflops"] / peak if peak and r["tflops"] else None
        r["vs_peer"] = peer_ms / r["time_ms"] if peer_ms and r["time_ms"] else None


# ---------------------------------------------------------------------------------------------------------
# The matmul peak, measured in the same run
# ---------------------------------------------------------------------------------------------------------


def matmul_peak(dev, dtype: str, size: int, preset: Preset) -> dict:
    """The faster of the array module's matmul and (on a GPU) PyTorch's for size^3, with both recorded."""
    tries = {dev.array_module: lambda: module_matmul(dev, dtype, size)}
    if dev.gpu:
        tries["torch"] = lambda: torch_matmul(dev, dtype, size)
    found = {"dtype": dtype, "shape": [size, size, size], "via": None, "tflops": None, "tries": {}}
    for via, make in tries.items():
        try:
            call = make()
            median = float(np.median(time_calls(dev, call, preset.warmup, preset.repeats, preset.budget_s)[0]))
            tflops = 2 * size**3 / median / 1e12
            found["tries"][via] = {"time_ms": median * 1e3, "tflops": tflops}
            if found["tflops"] is None or tflops > found["tflops"]:
                found.update(via=via, tflops=tflops, time_ms=median * 1e3)
        except Exception as exc:  # noqa: BLE001
            found["tries"][via] = {"error": one_line(exc)}
        dev.release()
    return found


def module_matmul(dev, dtype, size):
    rng = np.random.default_rng(1)
    pairs = [tuple(dev.normal((size, size), rng).astype(float_dtype(dtype)) for _ in "ab") for _ in "xy"]
    return lambda i: dev.xp.matmul(*pairs[i % 2])


def torch_matmul(dev, dtype, size):
    torch = import_torch(dev)
    pairs = [tuple(torch.randn(size, size, device="cuda", dtype=getattr(torch, dtype)) for _ in "ab")
             for _ in "xy"]
    return lambda i: torch.matmul(*pairs[i % 2])


# ---------------------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------------------


def environment(dev) -> dict:
    env = {"python": platform.python_version(), "platform": platform.platform(), "numpy": np.__version__}
    if dev.gpu:
        try:
            import torch  # noqa: F401 - its CUDA and cuDNN versions belong in the record
        except ImportError:
            pass
    for module in ("cupy", "torch", "ml_dtypes", "cuflash"):
        env[module] = module_version(module)
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch_cuda"] = getattr(torch.version, "cuda", None)
        try:
            env["cudnn"] = torch.backends.cudnn.version()
        except Exception:  # noqa: BLE001
            env["cudnn"] = None
    env["git_commit"] = git_commit()
    env.update(dev.env())
    return env


DISTRIBUTIONS = {"cupy": ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy")}


def module_version(name) -> Optional[str]:
    """The version of a module, without importing a heavy one that this run does not use."""
    from importlib import metadata

    if name in sys.modules:
        return getattr(sys.modules[name], "__version__", "unknown")
    for dist in DISTRIBUTIONS.get(name, (name,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def git_commit() -> Optional[str]:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def command_line(argv) -> str:
    """The command as run, with paths inside the repository written relative to it."""
    def rel(arg):
        path = Path(arg)
        if path.is_absolute():
            try:
                return str(path.resolve().relative_to(ROOT))
            except ValueError:
                pass
        return arg

    script = rel(str(Path(__file__).resolve()))
    return " ".join(["python", shlex.quote(script)] + [shlex.quote(rel(a)) for a in argv])


def run_sweep(dev, preset: Preset, points, runners, out: Path, meta: dict, time_limit: Optional[float]) -> dict:
    peer = peer_name(dev)
    results = dict(meta, peer=peer, matmul_peak={}, points=[], complete=False)
    for dtype in sorted({p.dtype for p in points}):
        results["matmul_peak"][dtype] = peak = matmul_peak(dev, dtype, preset.matmul, preset)
        unit, factor = rate_unit(results["mode"])
        progress(f"matmul peak {dtype} {preset.matmul}^3: " + (f"{peak['tflops'] * factor:.4g} {unit} via {peak['via']}"
                                                              if peak["tflops"] else f"failed {peak['tries']}"))
    begin = time.perf_counter()
    for index, point in enumerate(points, 1):
        late = time_limit is not None and index > 1 and time.perf_counter() - begin > time_limit
        entry = dict(asdict(point), flops=point.flops(), input_sets=0, input_note=None)
        entry["results"] = run_point(dev, preset, point, runners, entry, late)
        relate(entry["results"], peer, results["matmul_peak"].get(point.dtype, {}).get("tflops"))
        results["points"].append(entry)
        for r in entry["results"]:
            progress(f"[{index}/{len(points)}] {point.label} | {describe(r, results['mode'])}")
        write_reports(results, out, plots=False)
    results["complete"] = True
    return results


def run_point(dev, preset, point, runners, entry, late) -> List[dict]:
    if late:
        return [dict(name=r.name, backend=r.backend, variant=r.variant, status="skipped",
                     reason="the sweep's --time-limit was reached") for r in runners]
    try:
        sets = InputSets(dev, point, set_count(dev, point))
        ref = reference(sets, point)
    except Exception as exc:  # noqa: BLE001 - no inputs: every backend is skipped with the reason
        dev.release()
        return [dict(name=r.name, backend=r.backend, variant=r.variant, status="skipped",
                     reason=f"could not make the inputs: {one_line(exc)}") for r in runners]
    entry["input_sets"], entry["input_note"] = len(sets.arrays), sets.reason
    records = [measure(dev, r, point, sets, preset, ref) for r in runners]
    del sets
    dev.release()
    return records


def rate_unit(mode: str):
    """TFLOP/s on a GPU, GFLOP/s on a CPU: (label, factor applied to tflops)."""
    return ("TFLOP/s", 1.0) if mode == "gpu" else ("GFLOP/s", 1e3)


def describe(r: dict, mode: str) -> str:
    if r["status"] != "ok":
        return f"{r['name']:<16} {r['status']}: {r['reason'][:150]}"
    unit, factor = rate_unit(mode)
    parts = [f"{r['name']:<16} {r['time_ms']:9.3f} ms", f"{fmt(scaled(r['tflops'], factor), '8.4g')} {unit}"]
    if r.get("matmul_fraction") is not None:
        parts.append(f"{r['matmul_fraction']:.2f} of matmul")
    if r.get("vs_peer") is not None:
        parts.append(f"{r['vs_peer']:.2f}x peer")
    parts.append(f"err {r['max_abs_err']:.1e}")
    return "  ".join(parts)


def progress(line: str):
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------
# Reports: JSON, Markdown, plots
# ---------------------------------------------------------------------------------------------------------


def write_reports(results: dict, out: Path, plots: bool) -> List[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results))
    return draw_plots(results, out) if plots else []


def fmt(x, spec) -> str:
    return "" if x is None else format(x, spec)


def scaled(x, factor):
    return None if x is None else x * factor


def markdown(results: dict) -> str:
    env = results["env"]
    where = env.get("gpu") or env.get("cpu")
    unit, factor = rate_unit(results["mode"])
    lines = [f"# cuflash attention benchmark: {results['preset']} on {where}", "",
             f"- date: {results['started']}", f"- command: `{results['command']}`",
             "- versions: " + ", ".join(f"{k} {env.get(k)}" for k in
                                        ("python", "numpy", "cupy", "torch", "cuflash", "driver", "cuda_runtime")
                                        if env.get(k) is not None),
             f"- time: {results['method']['timing']}; the median of up to {results['method']['repeats']} calls "
             f"after {results['method']['warmup']} warm-up calls",
             f"- peer: {results['peer']} (\"vs peer\" > 1 means faster than it)", ""]
    lines += [f"| matmul | via | {unit} |", "|---|---|---|"]
    for dtype, peak in results["matmul_peak"].items():
        shape = "x".join(map(str, peak["shape"]))
        lines.append(f"| {dtype} {shape} | {peak['via']} | {fmt(scaled(peak['tflops'], factor), '.4g')} |")
    lines += targets_table(results["points"]) if results["mode"] == "gpu" else []
    lines += ["", f"| dtype | B×H | n | m | d | causal | backend | ms | {unit} | of matmul | vs peer | peak MiB "
              "| max err | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in results["points"]:
        lines += [markdown_row(p, r, factor) for r in p["results"]]
    return "\n".join(lines) + "\n"


def target_tflops(p: dict) -> Optional[float]:
    """The tensor-core issue's forward targets on the H200 (n = m, float16/bfloat16), None where it sets none."""
    if p["n"] != p["m"] or p["dtype"] not in HALF:
        return None
    if p["causal"]:
        return 300.0 if p["d"] == 128 and p["n"] >= 8192 else None
    return {128: 370.0, 64: 320.0}.get(p["d"])


def targets_table(points: List[dict]) -> List[str]:
    """Per point with a target: cuflash's fastest variant against the target and against torch-flash."""
    lines = ["", "| target | point | cuflash (fastest variant) TFLOP/s | torch-flash TFLOP/s | met |",
             "|---|---|---|---|---|"]
    for p in points:
        target = target_tflops(p)
        if target is None:
            continue
        ok = [r for r in p["results"] if r["status"] == "ok"]
        best = max((r for r in ok if r["backend"] == "cuflash"), key=lambda r: r["tflops"] or 0, default=None)
        peer = next((r for r in ok if r["name"] == "torch-flash"), None)
        fast = best is not None and (best["tflops"] or 0) >= target
        met = fast and (peer is None or best["time_ms"] <= peer["time_ms"])
        label = f"{p['dtype']} {p['batch']}×{p['heads']} n={p['n']} d={p['d']}{' causal' if p['causal'] else ''}"
        mine = f"{fmt(best['tflops'], '.1f')} ({best['name']})" if best else ""
        lines.append(f"| {target:.0f} | {label} | {mine} | {fmt(peer and peer['tflops'], '.1f')} "
                     f"| {'yes' if met else 'no'} |")
    return lines if len(lines) > 3 else []


def plan_note(r: dict) -> str:
    """cuflash's tiling and key splits where the run recorded them: "128x64", "8x32, 8 splits"."""
    block, splits = r.get("block"), r.get("splits")
    if not block:
        return ""
    return f"{block[0]}x{block[1]}" + (f", {splits} splits" if splits and splits > 1 else "")


def markdown_row(p: dict, r: dict, factor: float) -> str:
    peak = r.get("peak_bytes")
    note = plan_note(r) if r["status"] == "ok" else f"{r['status']}: {r['reason'][:120]}".replace("|", "/")
    cells = [p["dtype"], f"{p['batch']}×{p['heads']}", p["n"], p["m"], p["d"], "yes" if p["causal"] else "",
             r["name"], fmt(r.get("time_ms"), ".3f"), fmt(scaled(r.get("tflops"), factor), ".4g"),
             fmt(r.get("matmul_fraction"), ".2f"), fmt(r.get("vs_peer"), ".2f"),
             fmt(None if peak is None else peak / cost.MiB, ".1f"), fmt(r.get("max_abs_err"), ".1e"), note]
    return "| " + " | ".join(map(str, cells)) + " |"


def draw_plots(results: dict, out: Path) -> List[Path]:
    """Rate (GPU: TFLOP/s; CPU: ms) and peak memory against n, one panel per dtype, d and causal (n == m only)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        results.setdefault("notes", []).append("plots skipped: matplotlib is not installed")
        return []
    gpu = results["mode"] == "gpu"
    panels = {}
    for p in results["points"]:
        if p["n"] == p["m"]:
            panels.setdefault((p["dtype"], p["d"], p["causal"]), []).append(p)
    metrics = [("tflops" if gpu else "time_ms", "TFLOP/s" if gpu else "ms", "rate.png"),
               ("peak_bytes", "peak memory (MiB)", "memory.png")]
    paths = []
    for key, label, name in metrics:
        if not panels:
            break
        fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
        for ax, ((dtype, d, causal), points) in zip(axes[0], sorted(panels.items())):
            plot_panel(ax, points, key)
            ax.set_title(f"{dtype} d={d}{' causal' if causal else ''}", fontsize=9)
            ax.set_xlabel("n = m")
            ax.set_ylabel(label)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=60 if results["preset"] == "tiny" else 110)
        plt.close(fig)
        paths.append(out / name)
    return paths


def plot_panel(ax, points, key):
    names = [r["name"] for r in points[0]["results"]]
    for name in names:
        xs, ys = [], []
        for p in sorted(points, key=lambda p: p["n"]):
            r = next((r for r in p["results"] if r["name"] == name and r["status"] == "ok"), None)
            if r is not None and r.get(key) is not None:
                xs.append(p["n"])
                ys.append(r[key] / cost.MiB if key == "peak_bytes" else r[key])
        if xs:
            ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)


# ---------------------------------------------------------------------------------------------------------
# ncu: DRAM bytes of one naive and one cuflash problem beside the model
# ---------------------------------------------------------------------------------------------------------

NCU_POINT = Point("float16", 1, 16, 4096, 4096, 128, False)
ASSUMED_BLOCK = (128, 64)  # the model's tiles when the planner cannot be asked
NCU_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
         "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def ncu_problem(which: str) -> int:
    """The process ncu profiles: warm up, then run one problem between cudaProfilerStart and cudaProfilerStop."""
    import cupy

    dev = Gpu()
    sets = InputSets(dev, NCU_POINT, 1)
    q, k, v = sets.native_arrays()[0]
    if which == "naive":
        def call():
            return naive_attention(cupy, q, k, v, None, 1.0 / math.sqrt(NCU_POINT.d))
    else:
        import cuflash

        def call():
            return cuflash.attention(q, k, v, backend="cupy")
    for _ in range(2):
        call()
    dev.sync()
    cupy.cuda.profiler.start()
    call()
    dev.sync()
    cupy.cuda.profiler.stop()
    return 0


def parse_ncu_csv(text: str) -> dict:
    """Sum each metric over the kernels of ncu's CSV (--csv --print-units base); the header starts with "ID"."""
    start = next((i for i, line in enumerate(text.splitlines()) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no CSV table in ncu's output")
    totals = {m: 0.0 for m in NCU_METRICS}
    kernels = set()
    for row in csv.DictReader(io.StringIO("\n".join(text.splitlines()[start:]))):
        name = row.get("Metric Name")
        if name in totals:
            value = float(row["Metric Value"].replace(",", ""))
            totals[name] += value * UNITS.get(row.get("Metric Unit", "byte"), 1)
            kernels.add(row.get("ID"))
    return {"kernels": len(kernels), **totals, "total": sum(totals.values())}


def ncu_models(point: Point, block: Tuple[int, int]) -> dict:
    """Predicted DRAM bytes: cuflash's tile walk (and its compulsory lower bound), naive attention as written."""
    bh, itemsize = point.batch * point.heads, 2
    walk = dict(itemsize=itemsize, Br=block[0], Bc=block[1], causal=point.causal, lse=False)
    operands = bh * (point.n + 2 * point.m) * point.d * itemsize + bh * point.n * point.d * itemsize
    return {
        "cuflash": {"model": cost.kernel_traffic(bh, point.n, point.m, point.d, **walk).total,
                    "lower_bound": cost.compulsory_traffic(bh, point.n, point.m, point.d, **walk).total},
        "naive": {"model": point.pairs * naive_bytes_per_pair(itemsize) + operands,
                  "seed_model": point.batch * cost.standard_traffic_bytes(point.n, point.heads, point.d)},
    }


def ncu_measure(out: Path, timeout: float) -> int:
    """Run ncu on both problems, write ncu.json and ncu.md into out, print the table. 0 when both measured."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    chosen = heuristic_plan(NCU_POINT)[0] if cuda_device_count() else None
    block = chosen or ASSUMED_BLOCK
    models = ncu_models(NCU_POINT, block)
    report = {"point": asdict(NCU_POINT), "block": list(block), "block_from": "planner" if chosen else "assumed",
              "metrics": list(NCU_METRICS),
              "command": command_line(sys.argv[1:]), "problems": {}}
    ncu = shutil.which("ncu")
    for which in ("naive", "cuflash"):
        entry = dict(models[which])
        if ncu is None:
            entry["error"] = "ncu is not on PATH"
        else:
            entry.update(ncu_run(ncu, which, out, timeout))
        report["problems"][which] = entry
    (out / "ncu.json").write_text(json.dumps(report, indent=1) + "\n")
    text = ncu_markdown(report)
    (out / "ncu.md").write_text(text)
    print(text)
    return 0 if all("total" in e for e in report["problems"].values()) else 1


def ncu_run(ncu: str, which: str, out: Path, timeout: float) -> dict:
    cmd = [ncu, "--profile-from-start", "off", "--metrics", ",".join(NCU_METRICS), "--csv", "--print-units", "base",
           sys.executable, str(Path(__file__).resolve()), "--ncu-problem", which]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"ncu took more than {timeout:.0f} s"}
    (out / f"ncu_{which}.csv").write_text(done.stdout)
    (out / f"ncu_{which}.log").write_text(done.stderr)
    try:
        found = parse_ncu_csv(done.stdout)
    except ValueError as exc:
        tail = " ".join((done.stdout + done.stderr).split()[-60:])
        return {"error": f"{exc} (exit {done.returncode}): {tail}"}
    if done.returncode != 0 or not found["kernels"]:
        found["error"] = f"exit {done.returncode}, {found['kernels']} kernels profiled; see ncu_{which}.log"
    return found


def ncu_markdown(report: dict) -> str:
    p = Point(**report["point"])
    br, bc = report["block"]
    lines = [f"DRAM bytes of one problem ({p.label}), measured by ncu beside the model "
             f"(cuflash's tiles {br}x{bc}, {report['block_from']})", "",
             "| problem | kernels | read GB | write GB | total GB | model GB | measured / model | note |",
             "|---|---|---|---|---|---|---|---|"]
    for which, e in report["problems"].items():
        measured = e.get("total")
        ratio = measured / e["model"] if measured else None
        other = e.get("lower_bound", e.get("seed_model"))
        note = (f"lower bound {other / 1e9:.3f} GB" if "lower_bound" in e
                else f"the seed's four passes: {other / 1e9:.3f} GB")
        if e.get("error"):
            note += f"; {e['error'][:200]}"
        lines.append(f"| {which} | {e.get('kernels', '')} | {fmt(gb(e.get(NCU_METRICS[0])), '.3f')} "
                     f"| {fmt(gb(e.get(NCU_METRICS[1])), '.3f')} | {fmt(gb(measured), '.3f')} | {e['model'] / 1e9:.3f} "
                     f"| {fmt(ratio, '.2f')} | {note} |")
    return "\n".join(lines) + "\n"


def gb(x):
    return None if x is None else x / 1e9


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------


def make_meta(dev, name: str, preset: Preset, command: str, started: datetime.datetime) -> dict:
    """What the JSON says besides the points: the machine, the versions, the command and how it measured."""
    return {"schema": SCHEMA, "mode": "gpu" if dev.gpu else "cpu", "preset": name, "command": command,
            "started": started.isoformat(timespec="seconds"), "env": environment(dev),
            "method": {"timing": dev.timing, "warmup": preset.warmup, "repeats": preset.repeats,
                       "budget_s_per_backend": preset.budget_s,
                       "rotation": "each call takes the next of several input sets whose total exceeds twice the "
                                   "L2 cache (between 2 and 8 sets)",
                       "flops": "cuflash.cost.flops: 4*B*H*n*m*d dense, causal counted pair by pair",
                       "peak_memory": dev.memory,
                       "max_abs_err": f"against float64 attention on {ROWS_CHECKED} rows of the first and last "
                                      "batch item of the first input set"},
            "notes": []}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="default: sweep on a GPU, cpu without one")
    p.add_argument("--tiny", action="store_true", help="CI mode: --preset tiny on the CPU (seconds)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU exists")
    p.add_argument("--out", type=Path, help="folder for results.json, results.md and plots "
                                            "(default bench/results/<date>/<preset>)")
    p.add_argument("--backends", help="comma-separated name prefixes, e.g. cuflash,torch-flash "
                                      "(default: all on a GPU; cuflash,naive on the CPU)")
    p.add_argument("--blocks", help="forced cuflash tilings, e.g. 128x64,64x64 (default: the preset's)")
    p.add_argument("--time-limit", type=float, help="seconds; later points are recorded as skipped")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--ncu", action="store_true", help="measure DRAM bytes with ncu (GPU) into --out")
    p.add_argument("--ncu-timeout", type=float, default=60.0, help="seconds per ncu run (default 60)")
    p.add_argument("--ncu-problem", choices=("naive", "cuflash"), help=argparse.SUPPRESS)  # what ncu runs
    return p.parse_args(argv)


def parse_blocks(text):
    try:
        return tuple(tuple(int(x) for x in b.split("x")) for b in text.split(",") if b)
    except ValueError:
        raise SystemExit(f"--blocks: expected e.g. 128x64,64x64, got {text!r}") from None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.ncu_problem:
        return ncu_problem(args.ncu_problem)
    today = datetime.date.today().isoformat()
    if args.ncu:
        return ncu_measure(args.out or ROOT / "bench" / "results" / today / "ncu", args.ncu_timeout)

    gpu = not (args.cpu or args.tiny) and cuda_device_count() > 0
    name = "tiny" if args.tiny else args.preset or ("sweep" if gpu else "cpu")
    preset = PRESETS[name]
    if preset.gpu and not gpu:
        print(f"preset {name} needs a CUDA GPU and none is usable here; on the CPU use --preset cpu or --tiny",
              file=sys.stderr)
        return 2
    dev = Gpu() if gpu else Cpu()
    blocks = parse_blocks(args.blocks) if args.blocks is not None else preset.blocks
    runners = runners_for(dev, blocks, [w for w in (args.backends or "").split(",") if w])
    out = args.out or ROOT / "bench" / "results" / today / name
    started = datetime.datetime.now(datetime.timezone.utc)
    meta = make_meta(dev, name, preset, command_line(argv), started)
    progress(f"{name}: {len(preset.points)} points x {len(runners)} backends on "
             f"{meta['env'].get('gpu') or 'the CPU'}, into {out}")
    results = run_sweep(dev, preset, list(preset.points), runners, out, meta, args.time_limit)
    results["wall_s"] = round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1)
    plots = [] if args.no_plots else draw_plots(results, out)
    write_reports(results, out, plots=False)
    for note in results["notes"]:
        progress(note)
    progress(f"wrote {out / 'results.json'}, {out / 'results.md'}" + "".join(f", {p.name}" for p in plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
