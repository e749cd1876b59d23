"""Attention patterns as functions against the same patterns as dense arrays, side by side in one run: each pattern
through mask_mod / score_mod (its block mask made once, as a model reuses it across layers) beside the equivalent
dense mask= or bias= array, and beside plain attention, on the numpy backend or (--backend cupy) on a CUDA GPU.

    python -m bench.patterns --out DIR                                   # n = m = 8192, d = 64, float32
    python -m bench.patterns --tiny --out DIR                            # seconds: the CI smoke run
    python -m bench.patterns --backend cupy --dtype float16 --out DIR    # CuPy arrays on the current GPU

Patterns: 16 packed documents, a sliding window of 512 keys (also as window=), a 2-D neighbourhood (a 64 x 128
image, radius 8), block-sparse layouts at densities 5% to 50% (time against density), soft-capping and ALiBi.
Each time is the median of five calls after a warm-up one, the calls of a pattern (with mods, plain, dense) taking
turns: perf_counter timings on the CPU, CUDA event pairs on a GPU (bench.attention's timing of a call); the block
mask's own build is timed apart (build_ms), on the GPU with CuPy. Peak memory is tracemalloc's on the CPU and the
growth of CuPy's memory pool on a GPU, of one call. Every result is compared with the dense call's (max abs
difference). Targets (CPU figures): documents through mask_mod at least 8x faster than the dense mask, and softcap
at most 1.6x the plain call. Output: results.json and results.md in --out.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
import tracemalloc
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np

import cuflash
from bench.attention.devices import Cpu, Gpu
from cuflash import mods

SCHEMA = "cuflash-bench-patterns/1"
TARGETS = {"documents": ("mask_mod_speedup", ">=", 8.0), "softcap": ("plain_ratio", "<=", 1.6)}
REPEATS = 5
TIMING = {"numpy": "time.perf_counter around each call", "cupy": "a CUDA event pair around each call"}


def median_times(*calls: Callable[[], object], repeats: int = REPEATS, dev=None) -> List[float]:
    """The median time of each call, the calls taking turns (so a slow spell of the machine falls on all); dev
    (bench.attention's Cpu or Gpu, default the CPU) times one call."""
    dev = dev or Cpu()
    for call in calls:
        call()  # warm-up (on a GPU: the kernels' compilation)
    dev.sync()
    times: List[List[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, kept in zip(calls, times):
            kept.append(dev.time_call(call))
    return [float(np.median(kept)) for kept in times]


def peak_bytes(call: Callable[[], object], dev=None) -> int:
    """The peak memory of one call: tracemalloc's on the CPU, the memory pool's growth on a GPU."""
    return int((dev or Cpu()).peak_bytes(call, "device"))


def host(x) -> np.ndarray:
    """x as a NumPy array (a CuPy array copied back)."""
    return x.get() if hasattr(x, "get") else np.asarray(x)


def patterns(n: int, tiny: bool, xp=np) -> Dict[str, dict]:
    """name -> the pattern as keywords for mods, and the same as dense keywords (mask= / bias=); the arrays of
    xp (the captured ones too: a GPU's mods read device tables)."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    documents = 16
    ids = np.repeat(np.arange(documents), -(-n // documents))[:n]
    width = max(2, n // 16)  # the 2-D image: n // width rows of `width` tokens
    radius = 2 if tiny else 8
    window = 32 if tiny else 512
    slopes = np.array([0.25])
    found = {
        "documents": (dict(mask_mod=mods.documents(xp.asarray(ids))), dict(mask=ids[:, None] == ids[None, :])),
        "sliding_window": (dict(mask_mod=mods.sliding_window(window)), dict(mask=(j >= i - window) & (j <= i))),
        "sliding_window (window=)": (dict(window=(window, 0)), dict(mask=(j >= i - window) & (j <= i))),
        "neighbourhood_2d": (dict(mask_mod=lambda b, qi, kj: (np.abs(qi // width - kj // width) <= radius) &
                                  (np.abs(qi % width - kj % width) <= radius)),
                             dict(mask=(np.abs(i // width - j // width) <= radius) &
                                  (np.abs(i % width - j % width) <= radius))),
        "softcap": (dict(score_mod=mods.softcap(30.0)), None),
        "alibi": (dict(score_mod=mods.alibi(xp.asarray(slopes))), dict(bias=(-slopes[0] * np.abs(i - j))[None])),
    }
    tile = 128 if not tiny else 16
    rng = np.random.default_rng(0)
    for density in (0.05, 0.1, 0.25, 0.5):
        tiles = rng.random((-(-n // tile), -(-n // tile))) < density
        found[f"block_sparse {int(100 * density)}%"] = (
            dict(mask_mod=lambda b, qi, kj, tiles=xp.asarray(tiles): tiles[qi // tile, kj // tile]),
            dict(mask=np.repeat(np.repeat(tiles, tile, 0), tile, 1)[:n, :n]))
    return {name: (modded, None if dense is None else {key: xp.asarray(x) for key, x in dense.items()})
            for name, (modded, dense) in found.items()}


def measure(name, modded, dense, q, k, v, dev=None) -> dict:
    dev = dev or Cpu()
    record: dict = {"name": name}
    plain = lambda: cuflash.attention(q, k, v)  # noqa: E731
    call = modded
    if "mask_mod" in modded:  # the block mask made once (timed apart), as a model reuses it across layers
        device = dev.xp.cuda.Device().id if dev.gpu else None
        start = time.perf_counter()
        made = cuflash.block_mask(modded["mask_mod"], (1,), q.shape[-2], k.shape[-2], device=device)
        record["build_ms"] = 1e3 * (time.perf_counter() - start)
        record["density"] = made.density
        call = dict(block_mask=made)
    with_mods = lambda: cuflash.attention(q, k, v, **call)  # noqa: E731
    reference = plain if dense is None else (lambda: cuflash.attention(q, k, v, **dense))
    timed = median_times(with_mods, plain, *(() if dense is None else (reference,)), dev=dev)
    record["time_ms"], record["plain_ms"] = 1e3 * timed[0], 1e3 * timed[1]
    record["peak_mib"] = peak_bytes(with_mods, dev) / 2**20
    record["plain_ratio"] = record["time_ms"] / record["plain_ms"]
    if dense is not None:
        record["dense_ms"] = 1e3 * timed[2]
        record["dense_peak_mib"] = peak_bytes(reference, dev) / 2**20
        record["mask_mod_speedup"] = record["dense_ms"] / record["time_ms"]
        expected = host(reference()).astype(np.float64)
    else:  # softcap: the dense formula in float64
        xp = dev.xp
        s = xp.einsum("bid,bjd->bij", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[-1])
        s = 30.0 * xp.tanh(s / 30.0)
        p = xp.exp(s - s.max(-1, keepdims=True))
        expected = host((p / p.sum(-1, keepdims=True)) @ v.astype(np.float64))
    record["max_abs_difference"] = float(np.abs(host(with_mods()).astype(np.float64) - expected).max())
    target = TARGETS.get(name)
    if target:
        key, sign, value = target
        met = record[key] >= value if sign == ">=" else record[key] <= value
        record["target"] = f"{key} {sign} {value}: {'met' if met else 'missed'}"
    return record


def markdown(report) -> str:
    lines = [f"# Patterns on the {report['backend']} backend: n = m = {report['n']}, d = {report['d']}, "
             f"{report['dtype']}",
             "", f"`{report['command']}` on {report['machine']}. Medians of {REPEATS} calls after a warm-up "
             f"({report['timing']}).", "",
             "| pattern | tiles shown | with mods (ms) | dense array (ms) | speed-up over dense | x plain | "
             "peak MiB (mods / dense) | block mask build (ms) | max abs diff | target |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["records"]:
        density = f"{100 * r['density']:.1f}%" if "density" in r else "-"
        dense = f"{r['dense_ms']:.1f}" if "dense_ms" in r else "-"
        speedup = f"{r['mask_mod_speedup']:.1f}x" if "mask_mod_speedup" in r else "-"
        peak = f"{r['peak_mib']:.1f} / {r['dense_peak_mib']:.1f}" if "dense_peak_mib" in r else f"{r['peak_mib']:.1f}"
        build = f"{r['build_ms']:.1f}" if "build_ms" in r else "-"
        lines.append(f"| {r['name']} | {density} | {r['time_ms']:.1f} | {dense} | {speedup} | "
                     f"{r['plain_ratio']:.2f} | {peak} | {build} | {r['max_abs_difference']:.1e} | "
                     f"{r.get('target', '')} |")
    return "\n".join(lines) + "\n"


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float16", "float32", "float64"])
    parser.add_argument("--backend", default="numpy", choices=["numpy", "cupy"],
                        help="numpy: NumPy arrays on the CPU; cupy: CuPy arrays on the current CUDA device")
    parser.add_argument("--tiny", action="store_true", help="n = 256, d = 16: the CI smoke run")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    n, d = (256, 16) if args.tiny else (args.n, args.d)
    dev = Gpu() if args.backend == "cupy" else Cpu()
    rng = np.random.default_rng(1)
    q, k, v = (dev.xp.asarray(rng.standard_normal((1, n, d)).astype(args.dtype)) for _ in range(3))
    records = [measure(name, modded, dense, q, k, v, dev)
               for name, (modded, dense) in patterns(n, args.tiny, dev.xp).items()]
    options = "" if args.backend == "numpy" and args.dtype == "float32" else \
        f" --backend {args.backend} --dtype {args.dtype}"
    report = {"schema": SCHEMA, "command": "python -m bench.patterns" + (" --tiny" if args.tiny else
                                                                         f" --n {n} --d {d}") + options,
              "machine": machine(dev), "backend": args.backend, "n": n, "d": d, "dtype": args.dtype,
              "timing": TIMING[args.backend], "records": records}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "results.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def machine(dev) -> str:
    name = dev.props["name"] if dev.gpu else None
    where = f"{name.decode() if isinstance(name, bytes) else name}, " if dev.gpu else ""
    return f"{where}{platform.machine()}, {platform.python_implementation()} {platform.python_version()}, " \
        f"NumPy {np.__version__}"


if __name__ == "__main__":
    raise SystemExit(main())
