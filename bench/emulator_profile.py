"""Emulator profile: shared-memory bank conflicts, global-memory sectors and barriers of the kernels the planner
picks, counted by the SIMT emulator's profile mode, per kernel and source line (no GPU).

    python -m bench.emulator_profile [--dtype float16 ...] [--d 64 ...] [--n 128] [--m 128] [--causal]
                                     [--kind forward|backward|all] [--block mma|fma|BrxBc] [--lines 15]
                                     [--json FILE] [--tiny] [--visits]

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
from typing import Dict, List, Optional, Sequence

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


def aligned(x: np.ndarray, boundary: int = 256) -> np.ndarray:
    """x copied to a `boundary`-byte boundary, as cudaMalloc places arrays (NumPy only promises 16 bytes): the
    sectors a request touches depend on it."""
    raw = np.empty(x.nbytes + boundary, np.uint8)
    skip = -raw.ctypes.data % boundary
    out = raw[skip:skip + x.nbytes].view(x.dtype).reshape(x.shape)
    out[...] = x
    return out


def inputs(dtype: str, d: int, n: int, m: int):
    rng = np.random.default_rng(0)
    shapes = ((1, n, d), (1, m, d), (1, m, d), (1, n, d))  # q, k, v, dout
    return tuple(aligned(rng.standard_normal(shape).astype(DTYPES[dtype])) for shape in shapes)


def run_problem(dtype: str, d: int, n: int, m: int, causal: bool, block, kind: str) -> List[dict]:
    """Profiles of the problem's planned kernels, one dict per kernel."""
    from cuflash.backends import simt as backend

    plans = planned(dtype, d, n, m, block, kind)
    q, k, v, dout = inputs(dtype, d, n, m)
    with profile_mode():
        for plan in plans:  # compiled before the calls: launches from here on are this run's
            backend.function(plan).profiles.clear()
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, backend="simt", block=block)
        if kind in ("backward", "all"):
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, backend="simt", block=block)
        rows = []
        for plan in plans:
            fn = backend.function(plan)
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
                   f"{t['shared_load_conflicts']}, stores {t['shared_store_conflicts']}, ldmatrix "
                   f"{t['ldsm_conflicts']} in {t['ldsm_requests']} requests, cp.async {t['cp_async_conflicts']})\n")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------------------
# Nsight Compute beside the emulator (a machine with a CUDA GPU)

# (what, Nsight Compute's metric, the emulator's total it compares with). Metrics this ncu does not know are left
# out of its run and said so.
NCU_METRICS = (
    ("shared load instructions (LDS)", "smsp__sass_inst_executed_op_shared_ld.sum", "shared_load_requests"),
    ("shared store instructions (STS)", "smsp__sass_inst_executed_op_shared_st.sum", "shared_store_requests"),
    ("ldmatrix instructions (LDSM)", "smsp__sass_inst_executed_op_ldsm.sum", "ldsm_requests"),
    ("shared load wavefronts (LDS + LDSM)", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
     "shared_load_wavefronts+ldsm_wavefronts"),
    ("shared store wavefronts", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum", "shared_store_wavefronts"),
    ("shared load bank conflicts", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
     "shared_load_conflicts+ldsm_conflicts"),
    ("shared store bank conflicts", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
     "shared_store_conflicts"),
    ("global load requests", "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum", "global_load_requests"),
    ("global load sectors", "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", "global_load_sectors"),
    ("global store requests", "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum", "global_store_requests"),
    ("global store sectors", "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum", "global_store_sectors"),
    ("cp.async requests (LDGSTS)", "l1tex__t_requests_pipe_lsu_mem_global_op_ldgsts.sum", "cp_async_global_requests"),
    ("cp.async sectors", "l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum", "cp_async_global_sectors"),
    ("barrier instructions (per warp)", "smsp__inst_executed_op_barrier.sum", "barrier_warps"),
)


def emulator_value(totals: dict, key: str) -> int:
    return sum(totals[k] for k in key.split("+"))


def run_on_gpu(dtypes, dims, n: int, m: int, causal: bool, block, kind: str) -> int:
    """The process ncu profiles: each problem on the cupy backend, the second call of each between
    cudaProfilerStart and cudaProfilerStop (the first compiles)."""
    import cupy

    for dtype in dtypes:
        for d in dims:
            q, k, v, dout = (cupy.asarray(x) for x in inputs(dtype, d, n, m))

            def call():
                out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, backend="cupy", block=block)
                if kind in ("backward", "all"):
                    cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, backend="cupy", block=block)
                cupy.cuda.Device().synchronize()

            call()
            cupy.cuda.profiler.start()
            call()
            cupy.cuda.profiler.stop()
    return 0


def ncu_known(ncu: str) -> Optional[set]:
    """The base metric names this ncu can collect on this GPU, or None when it cannot say."""
    import subprocess

    done = subprocess.run([ncu, "--query-metrics", "--csv"], capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return {line.split(",")[0].strip('"') for line in done.stdout.splitlines()[1:]}


def parse_ncu(text: str, metrics: Sequence[str]) -> Dict[str, Dict[str, float]]:
    """Per kernel name, each metric summed over its launches, from ncu's CSV (--csv --print-units base)."""
    import csv
    import io

    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no CSV table in ncu's output")
    found: Dict[str, Dict[str, float]] = {}
    for r in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if r.get("Metric Name") in metrics:
            per = found.setdefault(r.get("Kernel Name", "?"), {})
            value = float(r["Metric Value"].replace(",", "") or 0)
            per[r["Metric Name"]] = per.get(r["Metric Name"], 0.0) + value
    return found


def matching(kernel: str, measured: Dict[str, Dict[str, float]]) -> Optional[Dict[str, float]]:
    """The ncu kernel whose demangled name holds the plan's name expression (spaces aside)."""
    want = "".join(kernel.split())
    for name, values in measured.items():
        if want in "".join(name.split()):
            return values
    return None


def ncu_compare(args, block, dtypes, dims, n, m, kind, out_dir: str) -> int:
    """Run the emulator's profile and ncu's on the same problems; write profile.json and profile.md into out_dir."""
    import shutil
    import subprocess

    os.makedirs(out_dir, exist_ok=True)
    rows = run(dtypes, dims, n, m, args.causal, block, kind)
    ncu = shutil.which("ncu")
    notes: List[str] = []
    metrics = [metric for _, metric, _ in NCU_METRICS]
    if ncu is None:
        notes.append("ncu is not on PATH: the emulator's counts only")
    else:
        known = ncu_known(ncu)
        if known is not None:
            missing = [x for x in metrics if x.rsplit(".", 1)[0] not in known]
            if missing:
                notes.append("this ncu does not know " + ", ".join(missing) + ": left out")
            metrics = [x for x in metrics if x not in missing]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    if ncu is not None and metrics:  # one run for every problem: one CUDA context, one NVRTC warm-up
        problem = [f"--{flag}={value}" for flag, values in (("dtype", dtypes), ("d", dims)) for value in values]
        cmd = [ncu, "--profile-from-start", "off", "--metrics", ",".join(metrics), "--csv", "--print-units", "base",
               sys.executable, "-m", "bench.emulator_profile", "--on-gpu", *problem, "--n", str(n), "--m", str(m),
               "--kind", kind] + (["--causal"] if args.causal else []) + (["--block", args.block] if args.block else [])
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.ncu_timeout)
            with open(os.path.join(out_dir, "ncu.csv"), "w") as f:
                f.write(done.stdout)
            with open(os.path.join(out_dir, "ncu.log"), "w") as f:
                f.write(done.stderr)
            measured = parse_ncu(done.stdout, metrics)
            for r in rows:
                r["ncu"] = matching(r["kernel"], measured)
        except subprocess.TimeoutExpired:
            notes.append(f"ncu took more than {args.ncu_timeout:.0f} s")
        except ValueError as exc:
            notes.append(f"{exc} (exit {done.returncode}); see ncu.log")
    with open(os.path.join(out_dir, "profile.json"), "w") as f:
        json.dump({"schema": SCHEMA, "model": MODEL, "ncu_metrics": [list(x) for x in NCU_METRICS],
                   "notes": notes, "rows": rows}, f, indent=1)
    text = ncu_markdown(rows, notes)
    with open(os.path.join(out_dir, "profile.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if ncu is None or all(r.get("ncu") for r in rows) else 1


def ncu_markdown(rows: Sequence[dict], notes: Sequence[str]) -> str:
    out = ["Shared-memory wavefronts, bank conflicts, global sectors and barriers: Nsight Compute beside the "
           "emulator's counts", ""]
    for r in rows:
        out += [f"{short_name(r['kernel'])} ({r['kind']}, {r['dtype']}, d = {r['d']}, n = {r['n']}, m = {r['m']})",
                "", "| what | ncu metric | ncu | emulator |", "|---|---|---|---|"]
        measured = r.get("ncu") or {}
        for what, metric, key in NCU_METRICS:
            value = measured.get(metric)
            shown = "-" if value is None else f"{value:.0f}"
            emulator = emulator_value(r["totals"], key) if "totals" in r else "-"
            out.append(f"| {what} | `{metric}` | {shown} | {emulator} |")
        out.append("")
    out += [f"- {note}" for note in notes]
    return "\n".join(out) + "\n"


def run(dtypes, head_dims, n, m, causal, block, kind) -> List[dict]:
    return [r for dtype in dtypes for d in head_dims for r in run_problem(dtype, d, n, m, causal, block, kind)]


# ----------------------------------------------------------------------------------------------------------------
# A block mask's tiles, visited


VISITS_BLOCK = (64, 64)  # the kernel's tiles, and the block mask's


def visit_line() -> int:
    """The line of the tensor-core forward's per-visit barrier (begin_tile's __syncthreads): each warp of a block
    passes it once per tile the block visits."""
    path = os.path.join(os.path.dirname(cuflash.__file__), "kernels", "forward_mma.cuh")
    lines = open(path).read().splitlines()
    start = next(i for i, text in enumerate(lines) if "void begin_tile()" in text)
    return next(i for i in range(start, len(lines)) if "__syncthreads();" in lines[i]) + 1


def visits_check(n: int = 512, documents: int = 5, d: int = 32) -> dict:
    """The float16 forward on 64 x 64 tiles through a block mask of packed causal documents (random lengths): the
    tiles its blocks visit, counted by the emulator's profile (barrier passes of visit_line per warp), against the
    tiles the block mask shows and those a causal mask alone would visit."""
    from cuflash import mods
    from cuflash.backends import simt as backend

    rng = np.random.default_rng(1)
    ids = np.sort(rng.integers(0, documents, n))
    pattern = mods.and_masks(mods.documents(ids), mods.causal)
    made = cuflash.block_mask(pattern, (1,), n, n, block=VISITS_BLOCK)
    q, k, v, _ = inputs("float16", d, n, n)
    config = tiling.BlockConfig(*VISITS_BLOCK, 4, 2, "mma")
    with profile_mode():
        for fn in backend._functions.values():
            fn.profiles.clear()
        cuflash.attention(q[None], k[None], v[None], block_mask=made, backend="simt", block=config)
        [fn] = [fn for fn in backend._functions.values() if fn.profiles]
        profile = sum(fn.profiles[1:], fn.profiles[0])
    line = visit_line()
    passes = sum(r.barriers for r in profile.lines() if r.file.endswith("forward_mma.cuh") and r.line == line)
    tiles = -(-n // VISITS_BLOCK[0])
    return {"n": n, "m": n, "documents": documents, "block": f"{VISITS_BLOCK[0]}x{VISITS_BLOCK[1]}",
            "kernel": profile.kernel,
            "tiles_shown": int(made.to_dense().sum()), "tiles_visited": passes // config.warps,
            "causal_tiles": tiles * (tiles + 1) // 2, "all_tiles": tiles * tiles,
            "counted_at": f"forward_mma.cuh:{line}"}


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
    parser.add_argument("--block", help="force the kernels: mma, fma or BrxBc")
    parser.add_argument("--kind", choices=("forward", "backward", "all"), default="forward")
    parser.add_argument("--lines", type=int, default=15, help="source lines shown per kernel (default 15)")
    parser.add_argument("--json", help="write every kernel's counts, all its lines, to this file")
    parser.add_argument("--tiny", action="store_true", help="CI mode: the float16 forward, d = 32, n = m = 64")
    parser.add_argument("--ncu", metavar="DIR", help="GPU: Nsight Compute's metrics beside the emulator's counts, "
                                                     "into DIR/profile.md and profile.json")
    parser.add_argument("--ncu-timeout", type=float, default=120.0, help="seconds per ncu run (default 120)")
    parser.add_argument("--on-gpu", action="store_true", help=argparse.SUPPRESS)  # the process ncu profiles
    parser.add_argument("--visits", action="store_true", help="the tiles a block mask's forward visits, counted, "
                                                              "against the tiles it shows")
    args = parser.parse_args(argv)
    block = parse_block(args.block) if args.block else None
    from cuflash import simt

    if not simt.available() and not args.on_gpu:
        print(f"emulator_profile: {simt.unavailable_reason()}", file=sys.stderr)
        return 2
    if args.visits:
        result = visits_check(n=256 if args.tiny else 512)
        print(f"Block mask of {result['documents']} packed causal documents, n = m = {result['n']}, tiles "
              f"{result['block']}: {result['tiles_shown']} tiles shown, {result['tiles_visited']} visited by "
              f"the kernel (emulator profile, {result['counted_at']}); causal alone: {result['causal_tiles']}, "
              f"all: {result['all_tiles']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"schema": SCHEMA, "visits": result}, f, indent=1)
        return 0 if result["tiles_visited"] == result["tiles_shown"] else 1
    if args.tiny:
        dtypes, dims, n, m, kind = ["float16"], [32], 64, 64, "forward"
    else:
        dtypes, dims, n, m, kind = args.dtype or ["float16", "float32"], args.d or [64], args.n, args.m, args.kind
    if args.on_gpu:
        return run_on_gpu(dtypes, dims, n, m, args.causal, block, kind)
    if args.ncu:
        return ncu_compare(args, block, dtypes, dims, n, m, kind, args.ncu)
    rows = run(dtypes, dims, n, m, args.causal, block, kind)
    print("Emulator counts (the SIMT emulator's profile mode, not a GPU's)\n")
    print(table(rows, args.lines))
    if args.json:
        command = "python -m bench.emulator_profile " + " ".join(sys.argv[1:] if argv is None else argv)
        with open(args.json, "w") as f:
            json.dump({"schema": SCHEMA, "command": command.strip(), "model": MODEL, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
