"""The backward pass on the CPU, side by side in one run: cuflash.attention_backward (the numpy backend) beside
naive NumPy backward (scores and probabilities materialized) and PyTorch's CPU scaled_dot_product_attention
backward, on the same inputs.

    python -m bench.backward --out DIR           # n = m from 512 to 4096, d = 64, float32, causal and not
    python -m bench.backward --tiny --out DIR    # seconds: the CI smoke run

Each time is the median of perf_counter timings after a warm-up call, of the backward alone (the forward's out
and lse, or torch's autograd graph, made once beforehand). Rates count the backward's five matmuls (2.5 times
the forward's FLOPs, causal pairs exactly); each peer is also given as a speed ratio to cuflash. Peak memory is
tracemalloc's (NumPy's allocations; torch's are not seen). dq of head 0 is compared with float64.
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
BACKWARD_FLOP_FACTOR = 2.5  # five n x m x d matmuls (S, dP, dV, dQ, dK) against the forward's two


@dataclass(frozen=True)
class Point:
    heads: int
    n: int
    d: int
    causal: bool

    def flops(self) -> float:
        return BACKWARD_FLOP_FACTOR * cost.flops(self.heads, self.n, self.n, self.d, causal=self.causal)


def points(tiny: bool) -> List[Point]:
    lengths = (64, 256) if tiny else (512, 1024, 2048, 4096)
    return [Point(2 if tiny else 4, n, 16 if tiny else 64, causal) for n in lengths for causal in (False, True)]


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
    q, k, v, dout = (rng.standard_normal((point.heads, point.n, point.d), dtype=np.float32) for _ in range(4))
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
    lines = ["| heads | n = m | d | causal | peer | ms | GFLOP/s | cuflash faster by | peak MiB | dq rel. error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r["status"] != "ok":
            lines.append(f"| {r['heads']} | {r['n']} | {r['d']} | {r['causal']} | {r['name']} | {r['reason']} |"
                         f" | | | |")
            continue
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
        lines.append(f"| {r['heads']} | {r['n']} | {r['d']} | {r['causal']} | {r['name']} | {r['time_ms']:.1f} | "
                     f"{r['gflops']:.1f} | {r['cuflash_speedup']:.2f}x | {peak} | {r['dq_rel_error']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.backward", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for results.json and results.md")
    parser.add_argument("--tiny", action="store_true", help="two small lengths: seconds, for CI")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget", type=float, default=20.0, help="seconds one peer may spend on one point")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of: {', '.join(PEERS)}")
    args = parser.parse_args(argv)
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
