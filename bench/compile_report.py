"""Compile report: every CUDA-core instantiation the heuristic chooses (the forward's and the backward's two
kernels), compiled with NVRTC for each architecture (no GPU needed); ptxas's registers, spills and static shared
memory beside the model's dynamic shared memory.

    python -m bench.compile_report [--arch sm_80 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor

from cuflash import kernels, nvrtc, tiling
from cuflash.dtypes import FLOATS
from cuflash.family import Shape

ARCH_DEVICES = {"sm_75": "T4", "sm_80": "A100", "sm_86": "A10", "sm_89": "L4", "sm_90": "H100"}
HEAD_DIMS = (16, 64, 128, 256, 512)


def chosen(arch: str, head_dims=HEAD_DIMS):
    """{name expression: its plan} of what the CUDA-core heuristic picks on arch's device: the forward,
    the forward for decoding (one query per head over 32k keys: split keys, partial results in the accumulator
    type) and both backward kernels (CUDA-core, head dims up to theirs)."""
    device = tiling.DeviceLimits.known(ARCH_DEVICES[arch])
    result = {}
    for dtype in FLOATS:
        for d in head_dims:
            try:
                plan = tiling.plan(Shape(dtype, d, d), device, "fma")
            except ValueError:
                continue  # nothing fits this device
            result[plan.name] = plan
            decoding = tiling.plan(Shape(dtype, d, d, n=1, m=1 << 15), device)
            if decoding.splits > 1:
                result[decoding.name] = decoding
            try:
                backward = tiling.backward_plans(Shape(dtype, d, d), device, "fma")
            except ValueError:
                continue  # past the backward kernels' head dims
            for plan in backward:
                result[plan.name] = plan
    return result


def _report(arch, names_by_source):
    """ptxas's usage of each instantiation, one NVRTC program per kernel source ({source: [names]})."""
    usage = {}
    for source, names in sorted(names_by_source.items()):
        usage.update(_compiled(arch, source, sorted(names)))
    return usage


def _compiled(arch, source, names):
    key = hashlib.sha256((kernels.source(source) + arch + "\n".join(names)).encode()).hexdigest()[:24]
    cache = os.path.join(tempfile.gettempdir(), f"cuflash-compile-{key}.json")
    if os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)
    usage = {name: vars(u) for name, u in nvrtc.compile_report(names, arch, source).items()}
    with open(cache + ".tmp", "w") as f:
        json.dump(usage, f)
    os.replace(cache + ".tmp", cache)
    return usage


def report(archs=tuple(ARCH_DEVICES), head_dims=HEAD_DIMS, workers=2):
    """[(arch, name, registers, spill stores, spill loads, stack frame, static smem, model dynamic smem)]."""
    plans = {arch: chosen(arch, head_dims) for arch in archs}
    by_source = []
    for arch in archs:
        names: dict = {}
        for name, plan in plans[arch].items():
            names.setdefault(plan.source, []).append(name)
        by_source.append(names)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        usages = dict(zip(archs, pool.map(_report, archs, by_source)))
    rows = []
    for arch in archs:
        for name, plan in plans[arch].items():
            u = usages[arch][name]
            rows.append((arch, name, u["registers"], u["spill_stores"], u["spill_loads"], u["stack"],
                         u["static_smem"], plan.shared_mem))
    return rows


def main():
    parser = argparse.ArgumentParser(prog="python -m bench.compile_report", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", choices=sorted(ARCH_DEVICES))
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = report(tuple(args.arch or ARCH_DEVICES))
    print(f"{'arch':6} {'instantiation':48} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'static':>6} "
          f"{'dynamic smem':>12}")
    for arch, name, regs, st, ld, stack, static, smem in rows:
        print(f"{arch:6} {name:48} {regs:4d} {f'{st}/{ld}':>11} {stack:5d} {static:6d} {smem:12d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
