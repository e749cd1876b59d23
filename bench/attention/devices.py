"""The CPU and a CUDA GPU behind one interface: time a call, measure its peak memory, say how much memory is
free and how large the cache is, make random arrays, release memory and describe the device."""

from __future__ import annotations

import gc
import os
import sys
import time
import tracemalloc
from typing import Any, Optional

import numpy as np

from cuflash import cost

from .environment import cpu_model, cuda_version, nvidia_smi_driver


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
