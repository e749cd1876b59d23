"""Packed sequences and a paged KV cache, each beside the way it replaces, in one run.

    python -m bench.sequences --out DIR          # the numpy backend, float32
    python -m bench.sequences --tiny --out DIR   # seconds: the CI smoke run
    python -m bench.sequences --gpu --out DIR    # CuPy arrays (float16) on the current CUDA device

Packed against padded: a batch of sequences of skewed lengths (most short, a few long: lengths drawn from a
log-normal, capped at the longest) through attention_varlen, beside the same batch padded to the longest and run
through attention with a key-padding mask. Work is proportional to sum n_s^2 against batch * max^2, so the ideal
time ratio (packed over padded) is that quotient; the report gives the measured ratio beside it.

Decoding from a paged cache: every sequence of the batch has one new query over its cached keys, in pages of 16
rows in a shuffled order; attention_paged (appending the step's key and value) beside gathering each step's pages
into a contiguous array and calling attention on it. The figure is tokens per second (sequences x steps per
second); on a GPU also the share of its memory bandwidth the cache reads take (bytes of K and V read per second
over the device's peak, from its memory clock and bus width).

Times are medians of REPEATS calls after a warm-up, the compared calls taking turns; on a GPU, CUDA events.
Output: results.json and results.md in --out.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np

import cuflash

SCHEMA = "cuflash-bench-sequences/1"
REPEATS = 5
PAGE = 16


def median_times(device, *calls: Callable[[], object], repeats: int = REPEATS) -> List[float]:
    """The median time of each call (seconds), the calls taking turns."""
    for call in calls:
        call()
        device.sync()
    kept: List[List[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, times in zip(calls, kept):
            times.append(device.time_call(call))
    return [float(np.median(times)) for times in kept]


def skewed_lengths(rng, batch: int, longest: int) -> np.ndarray:
    """Most sequences short, a few near the longest (log-normal, capped), the first one the longest."""
    lengths = np.minimum(longest, np.maximum(1, rng.lognormal(np.log(longest / 8), 1.0, batch).astype(int)))
    lengths[0] = longest
    return lengths


def packed_against_padded(device, rng, dtype, batch: int, longest: int, heads: int, d: int) -> dict:
    xp = device.xp
    lengths = skewed_lengths(rng, batch, longest)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    total = int(cu[-1])
    q, k, v = (xp.asarray(rng.standard_normal((total, heads, d)).astype(dtype)) for _ in range(3))
    padded = [xp.zeros((batch, heads, longest, d), dtype) for _ in range(3)]
    for s in range(batch):  # each sequence into its row, (heads, length, d)
        for x, whole in zip(padded, (q, k, v)):
            x[s, :, :lengths[s]] = whole[cu[s]:cu[s + 1]].transpose(1, 0, 2)
    keys = xp.asarray(np.arange(longest)[None, :] < lengths[:, None])[:, None, None, :]
    cu_device = xp.asarray(cu)
    packed = lambda: cuflash.attention_varlen(q, k, v, cu_device, cu_device, max_seqlen_q=longest,  # noqa: E731
                                              max_seqlen_k=longest)
    pad = lambda: cuflash.attention(*padded, mask=keys)  # noqa: E731
    timed = median_times(device, packed, pad)
    got, full = packed(), pad()
    difference = max(float(abs(got[cu[s]:cu[s + 1]] - full[s, :, :lengths[s]].transpose(1, 0, 2)).max())
                     for s in range(batch))
    ideal = float((lengths.astype(float) ** 2).sum() / (batch * longest ** 2))
    return {"name": "packed against padded", "dtype": np.dtype(dtype).name, "batch": batch, "longest": longest,
            "heads": heads, "d": d,
            "lengths": lengths.tolist(), "packed_ms": 1e3 * timed[0], "padded_ms": 1e3 * timed[1],
            "ratio": timed[0] / timed[1], "ideal_ratio": ideal, "max_abs_difference": difference}


def decoding(device, rng, dtype, batch: int, cached: int, heads: int, kv_heads: int, d: int) -> dict:
    """One decoding step of every sequence: attention_paged appending its key and value, against gathering the
    pages into a contiguous (batch, heads, keys, d) array and calling attention."""
    xp = device.xp
    pages_each = -(-(cached + 1) // PAGE)
    order = rng.permutation(batch * pages_each)
    table = xp.asarray(order.reshape(batch, pages_each))
    k_cache, v_cache = (xp.asarray(rng.standard_normal((batch * pages_each, PAGE, kv_heads, d)).astype(dtype))
                        for _ in range(2))
    lengths = xp.full((batch,), cached, np.int64)
    q = xp.asarray(rng.standard_normal((batch, 1, heads, d)).astype(dtype))
    k_new, v_new = (xp.asarray(rng.standard_normal((batch, 1, kv_heads, d)).astype(dtype)) for _ in range(2))
    groups = heads // kv_heads
    paged = lambda: cuflash.attention_paged(q, k_cache, v_cache, table, lengths, k_new=k_new,  # noqa: E731
                                            v_new=v_new)

    def gathered():  # the same keys (the new one already in its page) as one contiguous array per step
        keys = (k_cache[table].reshape(batch, -1, kv_heads, d)[:, :cached + 1]).transpose(0, 2, 1, 3)
        values = (v_cache[table].reshape(batch, -1, kv_heads, d)[:, :cached + 1]).transpose(0, 2, 1, 3)
        grouped = q.reshape(batch, kv_heads, groups, d)[:, :, :, None]
        return cuflash.attention(grouped, keys[:, :, None], values[:, :, None])
    timed = median_times(device, paged, gathered)
    out = paged()
    expected = gathered().reshape(batch, heads, d)
    read = 2 * batch * (cached + 1) * kv_heads * d * np.dtype(dtype).itemsize  # bytes of K and V the step reads
    record = {"name": "decoding from a paged cache", "dtype": np.dtype(dtype).name, "batch": batch, "cached": cached,
              "heads": heads,
              "kv_heads": kv_heads, "d": d, "page_size": PAGE, "paged_ms": 1e3 * timed[0],
              "gathered_ms": 1e3 * timed[1], "tokens_per_s": batch / timed[0],
              "gathered_tokens_per_s": batch / timed[1], "speedup": timed[1] / timed[0],
              "max_abs_difference": float(abs(out[:, 0] - expected).max()), "bytes_read": read}
    peak = getattr(device, "props", None) and peak_bandwidth(device.props)
    if peak:
        record["hbm_fraction"] = read / timed[0] / peak
    return record


def peak_bandwidth(props) -> Optional[float]:
    """Bytes per second a GPU's memory moves at most: double data rate at its memory clock (kHz) over its bus
    (None where the device does not say)."""
    if not props.get("memoryClockRate") or not props.get("memoryBusWidth"):
        return None
    return 2 * props["memoryClockRate"] * 1e3 * props["memoryBusWidth"] / 8


def markdown(report) -> str:
    packed, decode = report["records"]
    share = f"{100 * decode['hbm_fraction']:.0f}%" if "hbm_fraction" in decode else "-"
    lines = [f"# Packed sequences and a paged cache on {report['device']}", "",
             f"`{report['command']}` on {report['machine']}. Medians of {REPEATS} calls after a warm-up.", "",
             "| packed against padded | batch | longest | packed (ms) | padded (ms) | ratio | ideal ratio | "
             "max abs diff |", "|---|---|---|---|---|---|---|---|",
             f"| {packed['dtype']}, {packed['heads']} heads, d = {packed['d']} | {packed['batch']} | "
             f"{packed['longest']} | "
             f"{packed['packed_ms']:.1f} | {packed['padded_ms']:.1f} | {packed['ratio']:.3f} | "
             f"{packed['ideal_ratio']:.3f} | {packed['max_abs_difference']:.1e} |", "",
             "| decoding, one query per sequence | batch | cached keys | paged (ms) | gathered (ms) | tokens/s paged "
             "| tokens/s gathered | speed-up | HBM share | max abs diff |", "|---|---|---|---|---|---|---|---|---|---|",
             f"| {decode['dtype']}, {decode['heads']} heads over {decode['kv_heads']}, d = {decode['d']}, pages of "
             f"{decode['page_size']} | {decode['batch']} | {decode['cached']} | {decode['paged_ms']:.2f} | "
             f"{decode['gathered_ms']:.2f} | {decode['tokens_per_s']:.0f} | {decode['gathered_tokens_per_s']:.0f} | "
             f"{decode['speedup']:.2f}x | {share} | {decode['max_abs_difference']:.1e} |"]
    return "\n".join(lines) + "\n"


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes: the CI smoke run")
    parser.add_argument("--gpu", action="store_true", help="CuPy arrays on the current CUDA device")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from bench.attention.devices import Cpu, Gpu
    device = Gpu() if args.gpu else Cpu()
    rng = np.random.default_rng(0)
    if args.tiny:
        sizes = dict(batch=6, longest=64, heads=2, d=16), dict(batch=3, cached=100, heads=4, kv_heads=2, d=16)
    elif args.gpu:
        sizes = dict(batch=64, longest=4096, heads=16, d=128), dict(batch=64, cached=8192, heads=32, kv_heads=8,
                                                                     d=128)
    else:
        sizes = dict(batch=16, longest=2048, heads=4, d=64), dict(batch=16, cached=4096, heads=8, kv_heads=2, d=64)
    dtype = np.float16 if args.gpu else np.float32  # a GPU serves 16-bit caches; the CPU computes in float32
    records = [packed_against_padded(device, rng, dtype, **sizes[0]), decoding(device, rng, dtype, **sizes[1])]
    command = "python -m bench.sequences" + (" --tiny" if args.tiny else "") + (" --gpu" if args.gpu else "")
    report = {"schema": SCHEMA, "command": command, "backend": "cupy" if args.gpu else "numpy",
              "device": device.env().get("gpu", "the CPU (numpy backend)"),
              "machine": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}, "
                         f"NumPy {np.__version__}", "timing": device.timing, "records": records}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "results.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
