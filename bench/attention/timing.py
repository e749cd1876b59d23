"""Timing: seconds per call after warm-up (calls grouped where one is too short to time), the rates they
give, and the matmul peak those rates are compared with, measured in the same run."""

from __future__ import annotations

import math
import time
from typing import List, Optional, Tuple

import numpy as np

from .failures import one_line
from .inputs import float_dtype
from .peers import import_torch
from .points import Point, Preset


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
