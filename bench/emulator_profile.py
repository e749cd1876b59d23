"""Emulator profile: shared-memory bank conflicts, global-memory sectors and barriers of the kernels the planner
picks, counted by the SIMT emulator's profile mode, per kernel and source line (no GPU).

    python -m bench.emulator_profile [--dtype float16 ...] [--d 64 ...] [--n 128] [--m 128] [--causal]
                                     [--kind forward|backward|all] [--block mma|fma|BrxBc] [--lines 15]
                                     [--json FILE] [--tiny]

Each problem runs through cuflash.attention (and cuflash.attention_backward for the backward kernels) on the
simt backend in profile mode: the planner's launches, the project's kernels, on the CPU. Per warp-wide request
(the k-th execution of one instruction by the lanes of a warp): shared-memory wavefronts in Nsight Compute's
model (32 banks of 4 bytes; 8-byte accesses in two phases of 16 lanes, 16-byte accesses, ldmatrix and cp.async's
shared side in four of 8; distinct words of one bank serialize, the same word is a broadcast), the ideal
wavefronts (one per phase), their difference (bank conflicts), the 32-byte sectors each global request touches,
and __syncthreads() per warp. These are emulator counts: they follow the source as g++ compiles it at -O1, each
access with the width the source gives it, so an instruction nvcc merges, splits or keeps in registers counts
differently; bench/device_check.sh records Nsight Compute's own figures beside them on a machine with a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import List, Optional, Sequence

import numpy as np

import cuflash
from cuflash import bfloat16, tiling
from cuflash.family import Shape

SCHEMA = "cuflash-emulator-profile/1"
DTYPES = {"float16": np.float16, "bfloat16": bfloat16, "float32": np.float32, "float64": np.float64}
MODEL = ("Nsight Compute's shared-memory model: 32 banks of 4 bytes; a warp-wide request is served in phases of "
         "128 bytes (32 lanes of up to 4 bytes, 16 of 8, 8 of 16: ldmatrix's rows and cp.async's destinations "
         "too); a phase takes as many wavefronts as the most distinct words one bank holds (the same word is a "
         "broadcast); ideal: one per phase; conflicts = wavefronts - ideal. Global: distinct 32-byte sectors per "
         "request. Barriers: __syncthreads() executed per warp. A request: the k-th execution of one "
         "instruction by the lanes of a warp between two barriers. Emulator counts from g++ -O1 code.")


@contextlib.contextmanager
def profile_mode():
    """The simt backend compiles and launches in profile mode inside (its mode is read at each call)."""
    saved = os.environ.get("CUFLASH_SIMT_MODE")
    os.environ["CUFLASH_SIMT_MODE"] = "profile"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUFLASH_SIMT_MODE", None)
        else:
            os.environ["CUFLASH_SIMT_MODE"] = saved


def planned(dtype: str, d: int, n: int, m: int, block, kind: str) -> List[tiling.Plan]:
    """The plans the simt backend will launch for this problem, of the kinds asked for."""
    from cuflash.backends import simt as backend

    shape = Shape(DTYPES[dtype], d, d, n, m, 1)
    plans = [tiling.plan(shape, backend.DEVICE, block)] if kind in ("forward", "all") else []
    if kind in ("backward", "all"):
        plans += list(tiling.backward_plans(shape, backend.DEVICE, block) or ())
    return plans


def inputs(dtype: str, d: int, n: int, m: int):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, n, d)).astype(DTYPES[dtype])
    k, v = (rng.standard_normal((1, m, d)).astype(DTYPES[dtype]) for _ in range(2))
    return q, k, v, rng.standard_normal((1, n, d)).astype(DTYPES[dtype])


def run_problem(dtype: str, d: int, n: int, m: int, causal: bool, block, kind: str) -> List[dict]:
    """Profiles of the problem's planned kernels, one dict per kernel."""
    from cuflash.backends import simt as backend

    plans = planned(dtype, d, n, m, block, kind)
    q, k, v, dout = inputs(dtype, d, n, m)
    with profile_mode():
        for plan in plans:  # compiled before the calls: launches from here on are this run's
            backend.get_kernel(plan).profiles.clear()
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, backend="simt", block=block)
        if kind in ("backward", "all"):
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, backend="simt", block=block)
        rows = []
        for plan in plans:
            fn = backend.get_kernel(plan)
            profile = sum(fn.profiles[1:], fn.profiles[0]) if fn.profiles else None
            rows.append(row(dtype, d, n, m, causal, plan, profile))
    return rows


def row(dtype, d, n, m, causal, plan, profile) -> dict:
    config = plan.config
    result = {"dtype": dtype, "d": d, "n": n, "m": m, "causal": causal, "kind": plan.family.kind,
              "kernel": plan.name, "block": f"{config.Br}x{config.Bc}", "threads": plan.block[0],
              "shared_mem": plan.shared_mem}
    if profile is None:
        return {**result, "note": "not launched"}
    return {**result, **profile.to_dict()}


def short_name(name: str) -> str:
    return name.replace("cuflash::", "")


def location(line: dict) -> str:
    return f"{os.path.basename(line['file'])}:{line['line']}"


COLUMNS = ("line", "shared req", "wavefronts", "ideal", "conflicts", "global req", "sectors", "sect/req",
           "barriers")


def line_cells(r: dict) -> List[str]:
    per = f"{r['sectors'] / r['global_requests']:.1f}" if r["global_requests"] else "-"
    return [location(r), str(r["shared_requests"]), str(r["wavefronts"]), str(r["ideal"]), str(r["conflicts"]),
            str(r["global_requests"]), str(r["sectors"]), per, str(r["barriers"])]


def table(rows: Sequence[dict], lines: int) -> str:
    """Per kernel: its hottest source lines (shared wavefronts + sectors + barriers), then its totals."""
    out = []
    for r in rows:
        title = (f"{short_name(r['kernel'])} ({r['kind']}, {r['dtype']}, d = {r['d']}, n = {r['n']}, m = {r['m']}"
                 f"{', causal' if r['causal'] else ''}; block {r['block']}, {r['threads']} threads)")
        out.append(title)
        if "note" in r:
            out.append(f"  {r['note']}\n")
            continue
        t = r["totals"]
        cells = [COLUMNS] + [line_cells(x) for x in r["lines"][:lines]]
        cells.append(line_cells({"file": "total", "line": "", **t, "barriers": t["barrier_warps"]}))
        widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
        for c in cells:
            out.append("  " + "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in
                                        enumerate(zip(c, widths))))
        out.append(f"  bank conflicts: {t['conflicts']} of {t['wavefronts']} shared wavefronts (loads "
                   f"{t['shared_load_conflicts']}, stores {t['shared_store_conflicts']}; ldmatrix "
                   f"{t['ldsm_conflicts']} in {t['ldsm_requests']} requests)\n")
    return "\n".join(out)


def run(dtypes, head_dims, n, m, causal, block, kind) -> List[dict]:
    return [r for dtype in dtypes for d in head_dims for r in run_problem(dtype, d, n, m, causal, block, kind)]


def parse_block(text: str):
    from bench.sass_report import parse_block as parse
    return parse(text)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.emulator_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES), help="default: float16 and float32")
    parser.add_argument("--d", action="append", type=int, help="head dim (d = e; default 64)")
    parser.add_argument("--n", type=int, default=128, help="queries (default 128)")
    parser.add_argument("--m", type=int, default=128, help="keys (default 128)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--block", type=parse_block, help="force the kernels: mma, fma or BrxBc")
    parser.add_argument("--kind", choices=("forward", "backward", "all"), default="forward")
    parser.add_argument("--lines", type=int, default=15, help="source lines shown per kernel (default 15)")
    parser.add_argument("--json", help="write every kernel's counts, all its lines, to this file")
    parser.add_argument("--tiny", action="store_true", help="CI mode: the float16 forward, d = 32, n = m = 64")
    args = parser.parse_args(argv)
    from cuflash import simt

    if not simt.available():
        print(f"emulator_profile: {simt.unavailable_reason()}", file=sys.stderr)
        return 2
    if args.tiny:
        dtypes, dims, n, m, kind = ["float16"], [32], 64, 64, "forward"
    else:
        dtypes, dims, n, m, kind = args.dtype or ["float16", "float32"], args.d or [64], args.n, args.m, args.kind
    rows = run(dtypes, dims, n, m, args.causal, args.block, kind)
    print("Emulator counts (the SIMT emulator's profile mode, not a GPU's)\n")
    print(table(rows, args.lines))
    if args.json:
        command = "python -m bench.emulator_profile " + " ".join(sys.argv[1:] if argv is None else argv)
        with open(args.json, "w") as f:
            json.dump({"schema": SCHEMA, "command": command.strip(), "model": MODEL, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
