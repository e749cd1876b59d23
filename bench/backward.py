"""The backward pass, side by side in one run. On the CPU: cuflash.attention_backward (the numpy backend) beside
naive NumPy backward (scores and probabilities materialized) and PyTorch's CPU scaled_dot_product_attention
backward, on the same inputs. On a machine with a CUDA GPU (--gpu): cuflash's backward kernels on CuPy arrays,
backward alone and forward + backward, beside torch SDPA's flash and memory-efficient backends.

    python -m bench.backward --out DIR           # n = m 512 to 4096, d = 64, float32 and float64, causal and not
    python -m bench.backward --tiny --out DIR    # seconds: the CI smoke run
    python -m bench.backward --gpu --out DIR     # float16 and bfloat16, d = 64 and 128, n = m 1024 to 8192

Each time is the median of perf_counter timings after a warm-up call, of the backward alone (the forward's out
and lse, or torch's autograd graph, made once beforehand). Rates count the backward's five matmuls (2.5 times
the forward's FLOPs, causal pairs exactly); each peer is also given as a speed ratio to cuflash. Peak memory is
tracemalloc's (NumPy's allocations; torch's are not seen). dq of head 0 is compared with float64.
On the GPU each time is the median of CUDA event timings (on the null stream, which torch's default stream
joins) after two warm-up calls, and rates are TFLOP/s (forward + backward counts 3.5 times the forward's FLOPs);
each row is also a speed ratio to torch's flash backend at the same point.
Output: results.json and results.md in --out.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, List

import numpy as np

import cuflash
from cuflash import cost

SCHEMA = "cuflash-bench-backward/1"
CPU_DTYPES = ("float32", "float64")
BACKWARD_FLOP_FACTOR = 2.5  # five n x m x d matmuls (S, dP, dV, dQ, dK) against the forward's two


@dataclass(frozen=True)
class Point:
    heads: int
    n: int
    d: int
    causal: bool
    dtype: str = "float32"  # the CPU run's; the GPU run names its dtypes apart

    def flops(self) -> float:
        return BACKWARD_FLOP_FACTOR * cost.flops(self.heads, self.n, self.n, self.d, causal=self.causal)


def points(tiny: bool) -> List[Point]:
    lengths = (64, 256) if tiny else (512, 1024, 2048, 4096)
    return [Point(2 if tiny else 4, n, 16 if tiny else 64, causal, dtype)
            for dtype in CPU_DTYPES for n in lengths for causal in (False, True)]


# ----------------------------------------------------------------------------------------------------------------
# The peers: each prepare(inputs) returns a call that computes (dq, dk, dv)


def cuflash_peer(q, k, v, dout, causal):
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    return lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)


def naive_peer(q, k, v, dout, causal):
    """The textbook backward with the n x m scores and probabilities in memory (what cuflash avoids)."""
    n, m, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1 / math.sqrt(d)
    hidden = np.triu(np.ones((n, m), bool), m - n + 1) if causal else None

    def call():
        s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
        if hidden is not None:
            s[..., hidden] = -np.inf
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        dv = np.matmul(np.swapaxes(p, -1, -2), dout)
        dp = np.matmul(dout, np.swapaxes(v, -1, -2))
        ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
        return np.matmul(ds, k) * scale, np.matmul(np.swapaxes(ds, -1, -2), q) * scale, dv
    return call


def torch_peer(q, k, v, dout, causal):
    import torch
    tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
    n, m = q.shape[-2], k.shape[-2]
    mask = torch.ones(n, m, dtype=torch.bool).tril(m - n) if causal else None  # bottom-right, as cuflash's
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask)
    tdout = torch.from_numpy(dout)

    def call():
        return torch.autograd.grad(out, (tq, tk, tv), tdout, retain_graph=True)
    return call


PEERS = {"cuflash": cuflash_peer, "naive numpy": naive_peer, "torch sdpa": torch_peer}


# ----------------------------------------------------------------------------------------------------------------
# Measuring


def median_seconds(call: Callable, repeats: int, budget_s: float) -> List[float]:
    call()  # warm-up
    times, begin = [], time.perf_counter()
    while len(times) < repeats and (len(times) < 3 or time.perf_counter() - begin < budget_s):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def peak_bytes(call: Callable) -> int:
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def dq_error(dq, q, k, v, dout, causal) -> float:
    """Largest |dq - float64 dq| over head 0, relative to the largest |float64 dq|."""
    q64, k64, v64, do64 = (np.asarray(x[0], np.float64) for x in (q, k, v, dout))
    want = naive_peer(q64, k64, v64, do64, causal)()[0]
    got = np.asarray(dq[0] if not hasattr(dq, "detach") else dq[0].detach().numpy(), np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def measure(point: Point, peers: List[str], repeats: int, budget_s: float, seed: int = 0) -> List[dict]:
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal((point.heads, point.n, point.d)).astype(point.dtype) for _ in range(4))
    records = []
    for name in peers:
        record = {"name": name, **asdict(point)}
        try:
            call = PEERS[name](q, k, v, dout, point.causal)
        except ImportError as exc:
            records.append({**record, "status": "skipped", "reason": str(exc)})
            continue
        times = median_seconds(call, repeats, budget_s)
        median = float(np.median(times))
        records.append({**record, "status": "ok", "time_ms": median * 1e3, "times_ms": [t * 1e3 for t in times],
                        "gflops": point.flops() / median / 1e9,
                        "peak_mib": peak_bytes(call) / 2**20 if name != "torch sdpa" else None,
                        "dq_rel_error": dq_error(call()[0], q, k, v, dout, point.causal)})
    base = next((r["time_ms"] for r in records if r["name"] == "cuflash" and r["status"] == "ok"), None)
    for r in records:
        if r["status"] == "ok" and base:
            r["cuflash_speedup"] = r["time_ms"] / base  # > 1: cuflash is that many times faster
    return records


def markdown(records: List[dict]) -> str:
    lines = ["| dtype | heads | n = m | d | causal | peer | ms | GFLOP/s | cuflash faster by | peak MiB "
             "| dq rel. error |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        head = f"| {r.get('dtype', 'float32')} | {r['heads']} | {r['n']} | {r['d']} | {r['causal']} | {r['name']} |"
        if r["status"] != "ok":
            lines.append(f"{head} {r['reason']} | | | | |")
            continue
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
        lines.append(f"{head} {r['time_ms']:.1f} | "
                     f"{r['gflops']:.1f} | {r['cuflash_speedup']:.2f}x | {peak} | {r['dq_rel_error']:.1e} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# On a GPU

GPU_DTYPES = ("float16", "bfloat16")
GPU_PEERS = ("cuflash", "torch-flash", "torch-efficient")


def gpu_points(tiny: bool) -> List[Point]:
    lengths = (1024,) if tiny else (1024, 4096, 8192)
    return [Point(16, n, d, causal) for d in (64, 128) for n in lengths for causal in (False, True)]


def gpu_calls(peer: str, q, k, v, dout, causal):
    """(backward alone, forward + backward) on device arrays of q's dtype."""
    if peer == "cuflash":
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)

        def both():
            o, l = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            return cuflash.attention_backward(dout, q, k, v, o, l, causal=causal)
        return (lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)), both
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-efficient": SDPBackend.EFFICIENT_ATTENTION}[peer]
    tq, tk, tv = (torch.from_dlpack(x).detach().requires_grad_() for x in (q, k, v))
    tdout = torch.from_dlpack(dout)

    def forward():
        with sdpa_kernel(backend):  # n == m: torch's top-left causal is cuflash's bottom-right
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    out = forward()
    return (lambda: torch.autograd.grad(out, (tq, tk, tv), tdout, retain_graph=True),
            lambda: torch.autograd.grad(forward(), (tq, tk, tv), tdout))


def gpu_median_seconds(call: Callable, repeats: int) -> List[float]:
    import cupy
    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        call()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return times


def gpu_measure(point: Point, dtype: str, peers: List[str], repeats: int, seed: int = 0) -> List[dict]:
    import cupy
    rng = cupy.random.RandomState(seed)
    q, k, v, dout = (rng.standard_normal((1, point.heads, point.n, point.d), dtype=np.float32).astype(dtype)
                     for _ in range(4))
    forward_flops = cost.flops(point.heads, point.n, point.n, point.d, causal=point.causal)
    records = []
    for name in peers:
        record = {"name": name, **asdict(point), "dtype": dtype}
        try:
            calls = gpu_calls(name, q, k, v, dout, point.causal)
        except Exception as exc:  # torch missing, or the backend refuses this point
            records.append({**record, "status": "skipped", "reason": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        for what, call, factor in (("backward", calls[0], BACKWARD_FLOP_FACTOR),
                                   ("forward+backward", calls[1], BACKWARD_FLOP_FACTOR + 1)):
            times = gpu_median_seconds(call, repeats)
            median = float(np.median(times))
            records.append({**record, "what": what, "status": "ok", "time_ms": median * 1e3,
                            "times_ms": [t * 1e3 for t in times], "tflops": factor * forward_flops / median / 1e12})
    for r in records:
        base = next((x["time_ms"] for x in records if x["name"] == "torch-flash" and x["status"] == "ok"
                     and x["what"] == r.get("what")), None)
        if r["status"] == "ok" and base:
            r["speed_vs_torch_flash"] = base / r["time_ms"]  # > 1: faster than torch's flash backend
    return records


def gpu_markdown(records: List[dict]) -> str:
    lines = ["| dtype | heads | n = m | d | causal | peer | what | ms | TFLOP/s | speed vs torch flash |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        head = f"| {r['dtype']} | {r['heads']} | {r['n']} | {r['d']} | {r['causal']} | {r['name']} |"
        if r["status"] != "ok":
            lines.append(f"{head} skipped: {r['reason']} | | | |")
            continue
        ratio = r.get("speed_vs_torch_flash")
        lines.append(f"{head} {r['what']} | {r['time_ms']:.3f} | {r['tflops']:.1f} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} |")
    return "\n".join(lines) + "\n"


def gpu_main(args) -> int:
    records: List[dict] = []
    for point in gpu_points(args.tiny):
        for dtype in GPU_DTYPES:
            records += gpu_measure(point, dtype, list(GPU_PEERS), args.repeats)
            print(gpu_markdown(records).splitlines()[-1], flush=True)
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    report = {"schema": SCHEMA, "gpu": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
              "records": records}
    text = gpu_markdown(records)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(report, indent=1))
        (args.out / "results.md").write_text(f"# Backward on {report['gpu']}\n\n" + text)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.backward", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for results.json and results.md")
    parser.add_argument("--tiny", action="store_true", help="two small lengths: seconds, for CI")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget", type=float, default=20.0, help="seconds one peer may spend on one point")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of: {', '.join(PEERS)}")
    parser.add_argument("--gpu", action="store_true", help="CuPy arrays on the current CUDA device, beside torch")
    args = parser.parse_args(argv)
    if args.gpu:
        return gpu_main(args)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        parser.error(f"unknown peers {unknown}; choose from {', '.join(PEERS)}")
    records: List[dict] = []
    for point in points(args.tiny):
        records += measure(point, peers, 3 if args.tiny else args.repeats, 2.0 if args.tiny else args.budget)
        print(markdown(records[-len(peers):]).splitlines()[-1] if records else "", flush=True)
    report = {"schema": SCHEMA, "machine": platform.platform(), "python": platform.python_version(),
              "numpy": np.__version__, "records": records}
    text = markdown(records)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(report, indent=1))
        (args.out / "results.md").write_text("# Backward on the CPU\n\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
