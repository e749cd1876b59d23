"""cuflash.dask scaling, side by side in one run: one long causal problem as cuflash.attention on the numpy backend
in this process, and as cuflash.dask.attention on a dask.distributed LocalCluster of 1 and of 2 worker
processes, on the same inputs.

    python -m bench.dask_scaling --out DIR           # n = m = 65536, d = 64, float32, causal, chunks of 8192
    python -m bench.dask_scaling --tiny --out DIR    # seconds: the CI smoke run
    python -m bench.dask_scaling --gpu --out DIR     # CuPy chunks on every GPU (dask-cuda's LocalCUDACluster)

Each time is the median of perf_counter timings after a warm-up run (which also imports cuflash on the workers).
The cluster's inputs are persisted on its workers before timing, so a time is the graph's computation and the
result's trip back, not the inputs' first transfer. Each worker process runs one task at a time, with the
machine's cores shared out among the workers for BLAS. Rates count the visible pairs' FLOPs (4 d per pair);
each run is also given as a speed ratio to the in-process call, with its task counts (chunk-pair tasks, all
tasks). The result of each run is compared with the in-process call's.
Output: results.json and results.md in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, List

import numpy as np

import cuflash
from cuflash import cost

SCHEMA = "cuflash-bench-dask/1"


@dataclass(frozen=True)
class Point:
    heads: int
    n: int
    d: int
    chunk: int
    causal: bool = True

    def flops(self) -> float:
        return cost.flops(self.heads, self.n, self.n, self.d, causal=self.causal)


def point(tiny: bool, gpu: bool = False) -> Point:
    if tiny:
        return Point(1, 512, 16, 128)
    return Point(8 if gpu else 1, 65536, 64 if not gpu else 128, 8192)


def median_seconds(call: Callable, repeats: int, budget_s: float) -> List[float]:
    call()  # warm-up
    times, begin = [], time.perf_counter()
    while len(times) < repeats and (len(times) < 2 or time.perf_counter() - begin < budget_s):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def inputs(p: Point, xp=np):
    rng = np.random.default_rng(0)
    return [xp.asarray(rng.standard_normal((p.heads, p.n, p.d), dtype=np.float32)) for _ in range(3)]


def record(name: str, p: Point, times: List[float], **extra) -> dict:
    median = float(np.median(times))
    return {"name": name, **asdict(p), "status": "ok", "time_s": median, "times_s": times,
            "gflops": p.flops() / median / 1e9, **extra}


def in_process(p: Point, q, k, v, repeats: int, budget_s: float):
    result = cuflash.attention(q, k, v, causal=p.causal)
    times = median_seconds(lambda: cuflash.attention(q, k, v, causal=p.causal), repeats, budget_s)
    return record("in process", p, times, workers=0), result


def on_cluster(p: Point, q, k, v, cluster, workers: int, expected, repeats: int, budget_s: float) -> dict:
    import dask.array as da
    import distributed

    import cuflash.dask
    with distributed.Client(cluster) as client:
        chunks = (1, p.chunk, p.d)
        dq, dk, dv = client.persist([da.from_array(x, chunks=chunks, asarray=False) for x in (q, k, v)])
        distributed.wait([dq, dk, dv])
        out = cuflash.dask.attention(dq, dk, dv, causal=p.causal)
        graph = out.__dask_graph__()
        pairs = sum(1 for key in graph if isinstance(key, tuple) and "pair" in key)
        result = client.compute(out).result()
        times = median_seconds(lambda: client.compute(out).result(), repeats, budget_s)
    error = float(np.abs(np.asarray(to_host(result)) - to_host(expected)).max())
    return record(f"dask, {workers} worker{'s' if workers > 1 else ''}", p, times, workers=workers,
                  pair_tasks=pairs, tasks=len(graph), max_abs_diff=error)


def to_host(x):
    return x.get() if hasattr(x, "get") else x


def cpu_cluster(workers: int):
    from distributed import LocalCluster
    threads = str(max(1, (os.cpu_count() or 1) // workers))  # BLAS threads per worker: the cores shared out
    env = {name: threads for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None, env=env)


def gpu_cluster(workers: int):
    from dask_cuda import LocalCUDACluster
    import cupy
    count = cupy.cuda.runtime.getDeviceCount()
    return LocalCUDACluster(CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(min(workers, count))),
                            dashboard_address=None)


def run(p: Point, worker_counts, repeats: int, budget_s: float, gpu: bool) -> List[dict]:
    xp = __import__("cupy") if gpu else np
    q, k, v = inputs(p, xp)
    base, expected = in_process(p, q, k, v, repeats, budget_s)
    records = [base]
    for workers in worker_counts:
        with (gpu_cluster if gpu else cpu_cluster)(workers) as cluster:
            records.append(on_cluster(p, q, k, v, cluster, workers, expected, repeats, budget_s))
    for r in records:
        r["speedup"] = base["time_s"] / r["time_s"]  # > 1: faster than the in-process call
    return records


def markdown(records: List[dict]) -> str:
    lines = ["| run | heads | n = m | d | chunk | s | GFLOP/s | vs in-process | pair tasks | tasks | max abs diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['name']} | {r['heads']} | {r['n']} | {r['d']} | {r['chunk']} | {r['time_s']:.2f} | "
                     f"{r['gflops']:.1f} | {r['speedup']:.2f}x | {r.get('pair_tasks', '-')} | {r.get('tasks', '-')} | "
                     f"{r.get('max_abs_diff', 0):.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dask_scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--gpu", action="store_true", help="CuPy chunks on a LocalCUDACluster (needs dask-cuda)")
    parser.add_argument("--n", type=int, help="n = m (default 65536)")
    parser.add_argument("--chunk", type=int, help="query and key chunk length (default 8192)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds of timed runs per peer, at most")
    args = parser.parse_args(argv)
    p = point(args.tiny, args.gpu)
    p = Point(p.heads, args.n or p.n, p.d, args.chunk or p.chunk)
    records = run(p, args.workers, args.repeats, args.budget, args.gpu)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"schema": SCHEMA, "machine": platform.platform(), "cpus": os.cpu_count(), "records": records}
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    (args.out / "results.md").write_text(markdown(records))
    print(markdown(records), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
