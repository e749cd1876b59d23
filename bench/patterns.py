"""Attention patterns as functions against the same patterns as dense arrays, side by side in one run, on the numpy
backend: each pattern through mask_mod / score_mod (its block mask made once, as a model reuses it across layers)
beside the equivalent dense mask= or bias= array, and beside plain attention.

    python -m bench.patterns --out DIR          # n = m = 8192, d = 64, float32, one batch item
    python -m bench.patterns --tiny --out DIR   # seconds: the CI smoke run

Patterns: 16 packed documents, a sliding window of 512 keys (also as window=), a 2-D neighbourhood (a 64 x 128
image, radius 8), block-sparse layouts at densities 5% to 50% (time against density), soft-capping and ALiBi.
Each time is the median of perf_counter timings of five calls after a warm-up one, the calls of a pattern
(with mods, plain, dense) taking turns; the block mask's own build is timed apart
(build_ms). Peak memory is tracemalloc's, of one call. Every result is compared with the dense
call's (max abs difference). Targets: documents through mask_mod at least 8x faster than the dense mask, and
softcap at most 1.6x the plain call. Output: results.json and results.md in --out.
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
from cuflash import mods

SCHEMA = "cuflash-bench-patterns/1"
TARGETS = {"documents": ("mask_mod_speedup", ">=", 8.0), "softcap": ("plain_ratio", "<=", 1.6)}
REPEATS = 5


def median_times(*calls: Callable[[], object], repeats: int = REPEATS) -> List[float]:
    """The median time of each call, the calls taking turns (so a slow spell of the machine falls on all)."""
    for call in calls:
        call()  # warm-up
    times: List[List[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, kept in zip(calls, times):
            start = time.perf_counter()
            call()
            kept.append(time.perf_counter() - start)
    return [float(np.median(kept)) for kept in times]


def peak_bytes(call: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def patterns(n: int, tiny: bool) -> Dict[str, dict]:
    """name -> the pattern as keywords for mods, and the same as dense keywords (mask= / bias=)."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    documents = 16
    ids = np.repeat(np.arange(documents), -(-n // documents))[:n]
    width = max(2, n // 16)  # the 2-D image: n // width rows of `width` tokens
    radius = 2 if tiny else 8
    window = 32 if tiny else 512
    slopes = np.array([0.25])
    found = {
        "documents": (dict(mask_mod=mods.documents(ids)), dict(mask=ids[:, None] == ids[None, :])),
        "sliding_window": (dict(mask_mod=mods.sliding_window(window)), dict(mask=(j >= i - window) & (j <= i))),
        "sliding_window (window=)": (dict(window=(window, 0)), dict(mask=(j >= i - window) & (j <= i))),
        "neighbourhood_2d": (dict(mask_mod=lambda b, qi, kj: (np.abs(qi // width - kj // width) <= radius) &
                                  (np.abs(qi % width - kj % width) <= radius)),
                             dict(mask=(np.abs(i // width - j // width) <= radius) &
                                  (np.abs(i % width - j % width) <= radius))),
        "softcap": (dict(score_mod=mods.softcap(30.0)), None),
        "alibi": (dict(score_mod=mods.alibi(slopes)), dict(bias=(-slopes[0] * np.abs(i - j))[None])),
    }
    tile = 128 if not tiny else 16
    rng = np.random.default_rng(0)
    for density in (0.05, 0.1, 0.25, 0.5):
        tiles = rng.random((-(-n // tile), -(-n // tile))) < density
        found[f"block_sparse {int(100 * density)}%"] = (
            dict(mask_mod=lambda b, qi, kj, tiles=tiles: tiles[qi // tile, kj // tile]),
            dict(mask=np.repeat(np.repeat(tiles, tile, 0), tile, 1)[:n, :n]))
    return found


def measure(name, modded, dense, q, k, v) -> dict:
    record: dict = {"name": name}
    plain = lambda: cuflash.attention(q, k, v)  # noqa: E731
    call = modded
    if "mask_mod" in modded:  # the block mask made once (timed apart), as a model reuses it across layers
        start = time.perf_counter()
        made = cuflash.block_mask(modded["mask_mod"], (1,), q.shape[-2], k.shape[-2])
        record["build_ms"] = 1e3 * (time.perf_counter() - start)
        record["density"] = made.density
        call = dict(block_mask=made)
    with_mods = lambda: cuflash.attention(q, k, v, **call)  # noqa: E731
    reference = plain if dense is None else (lambda: cuflash.attention(q, k, v, **dense))
    timed = median_times(with_mods, plain, *(() if dense is None else (reference,)))
    record["time_ms"], record["plain_ms"] = 1e3 * timed[0], 1e3 * timed[1]
    record["peak_mib"] = peak_bytes(with_mods) / 2**20
    record["plain_ratio"] = record["time_ms"] / record["plain_ms"]
    if dense is not None:
        record["dense_ms"] = 1e3 * timed[2]
        record["dense_peak_mib"] = peak_bytes(reference) / 2**20
        record["mask_mod_speedup"] = record["dense_ms"] / record["time_ms"]
        expected = reference()
    else:  # softcap: the dense formula in float64
        s = np.einsum("bid,bjd->bij", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[-1])
        s = 30.0 * np.tanh(s / 30.0)
        p = np.exp(s - s.max(-1, keepdims=True))
        expected = (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)
    record["max_abs_difference"] = float(np.abs(with_mods() - expected).max())
    target = TARGETS.get(name)
    if target:
        key, sign, value = target
        met = record[key] >= value if sign == ">=" else record[key] <= value
        record["target"] = f"{key} {sign} {value}: {'met' if met else 'missed'}"
    return record


def markdown(report) -> str:
    lines = [f"# Patterns on the numpy backend: n = m = {report['n']}, d = {report['d']}, {report['dtype']}",
             "", f"`{report['command']}` on {report['machine']}. Medians of {REPEATS} calls after a warm-up.", "",
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
    parser.add_argument("--tiny", action="store_true", help="n = 256, d = 16: the CI smoke run")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    n, d = (256, 16) if args.tiny else (args.n, args.d)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, n, d)).astype(np.float32) for _ in range(3))
    records = [measure(name, modded, dense, q, k, v) for name, (modded, dense) in patterns(n, args.tiny).items()]
    report = {"schema": SCHEMA, "command": "python -m bench.patterns" + (" --tiny" if args.tiny else
                                                                         f" --n {n} --d {d}"),
              "machine": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}, "
                         f"NumPy {np.__version__}",
              "n": n, "d": d, "dtype": "float32", "records": records}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "results.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
