"""ncu: the DRAM bytes of one naive and one cuflash problem, each profiled in a child run of this benchmark,
beside cuflash's traffic model."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Tuple

from cuflash import cost

from .devices import Gpu, cuda_device_count
from .environment import ROOT, command_line
from .inputs import InputSets
from .peers import heuristic_plan, naive_attention, naive_bytes_per_pair
from .points import Point
from .reports import fmt


NCU_POINT = Point("float16", 1, 16, 4096, 4096, 128, False)
ASSUMED_BLOCK = (128, 64)  # the model's tiles when the planner cannot be asked
NCU_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
         "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def ncu_problem(which: str) -> int:
    """The process ncu profiles: warm up, then run one problem between cudaProfilerStart and cudaProfilerStop."""
    import cupy

    dev = Gpu()
    sets = InputSets(dev, NCU_POINT, 1)
    q, k, v = sets.native_arrays()[0]
    if which == "naive":
        def call():
            return naive_attention(cupy, q, k, v, None, 1.0 / math.sqrt(NCU_POINT.d))
    else:
        import cuflash

        def call():
            return cuflash.attention(q, k, v, backend="cupy")
    for _ in range(2):
        call()
    dev.sync()
    cupy.cuda.profiler.start()
    call()
    dev.sync()
    cupy.cuda.profiler.stop()
    return 0


def parse_ncu_csv(text: str) -> dict:
    """Sum each metric over the kernels of ncu's CSV (--csv --print-units base); the header starts with "ID"."""
    start = next((i for i, line in enumerate(text.splitlines()) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no CSV table in ncu's output")
    totals = {m: 0.0 for m in NCU_METRICS}
    kernels = set()
    for row in csv.DictReader(io.StringIO("\n".join(text.splitlines()[start:]))):
        name = row.get("Metric Name")
        if name in totals:
            value = float(row["Metric Value"].replace(",", ""))
            totals[name] += value * UNITS.get(row.get("Metric Unit", "byte"), 1)
            kernels.add(row.get("ID"))
    return {"kernels": len(kernels), **totals, "total": sum(totals.values())}


def ncu_models(point: Point, block: Tuple[int, int]) -> dict:
    """Predicted DRAM bytes: cuflash's tile walk (and its compulsory lower bound), naive attention as written."""
    bh, itemsize = point.batch * point.heads, 2
    walk = dict(itemsize=itemsize, Br=block[0], Bc=block[1], causal=point.causal, lse=False)
    operands = bh * (point.n + 2 * point.m) * point.d * itemsize + bh * point.n * point.d * itemsize
    return {
        "cuflash": {"model": cost.kernel_traffic(bh, point.n, point.m, point.d, **walk).total,
                    "lower_bound": cost.compulsory_traffic(bh, point.n, point.m, point.d, **walk).total},
        "naive": {"model": point.pairs * naive_bytes_per_pair(itemsize) + operands,
                  "seed_model": point.batch * cost.standard_traffic_bytes(point.n, point.heads, point.d)},
    }


def ncu_measure(out: Path, timeout: float) -> int:
    """Run ncu on both problems, write ncu.json and ncu.md into out, print the table. 0 when both measured."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    chosen = heuristic_plan(NCU_POINT)[0] if cuda_device_count() else None
    block = chosen or ASSUMED_BLOCK
    models = ncu_models(NCU_POINT, block)
    report = {"point": asdict(NCU_POINT), "block": list(block), "block_from": "planner" if chosen else "assumed",
              "metrics": list(NCU_METRICS),
              "command": command_line(sys.argv[1:]), "problems": {}}
    ncu = shutil.which("ncu")
    for which in ("naive", "cuflash"):
        entry = dict(models[which])
        if ncu is None:
            entry["error"] = "ncu is not on PATH"
        else:
            entry.update(ncu_run(ncu, which, out, timeout))
        report["problems"][which] = entry
    (out / "ncu.json").write_text(json.dumps(report, indent=1) + "\n")
    text = ncu_markdown(report)
    (out / "ncu.md").write_text(text)
    print(text)
    return 0 if all("total" in e for e in report["problems"].values()) else 1


def ncu_run(ncu: str, which: str, out: Path, timeout: float) -> dict:
    cmd = [ncu, "--profile-from-start", "off", "--metrics", ",".join(NCU_METRICS), "--csv", "--print-units", "base",
           sys.executable, "-m", __package__, "--ncu-problem", which]
    # the child finds this checkout's bench and cuflash wherever ncu starts it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"ncu took more than {timeout:.0f} s"}
    (out / f"ncu_{which}.csv").write_text(done.stdout)
    (out / f"ncu_{which}.log").write_text(done.stderr)
    try:
        found = parse_ncu_csv(done.stdout)
    except ValueError as exc:
        tail = " ".join((done.stdout + done.stderr).split()[-60:])
        return {"error": f"{exc} (exit {done.returncode}): {tail}"}
    if done.returncode != 0 or not found["kernels"]:
        found["error"] = f"exit {done.returncode}, {found['kernels']} kernels profiled; see ncu_{which}.log"
    return found


def ncu_markdown(report: dict) -> str:
    p = Point(**report["point"])
    br, bc = report["block"]
    lines = [f"DRAM bytes of one problem ({p.label}), measured by ncu beside the model "
             f"(cuflash's tiles {br}x{bc}, {report['block_from']})", "",
             "| problem | kernels | read GB | write GB | total GB | model GB | measured / model | note |",
             "|---|---|---|---|---|---|---|---|"]
    for which, e in report["problems"].items():
        measured = e.get("total")
        ratio = measured / e["model"] if measured else None
        other = e.get("lower_bound", e.get("seed_model"))
        note = (f"lower bound {other / 1e9:.3f} GB" if "lower_bound" in e
                else f"the seed's four passes: {other / 1e9:.3f} GB")
        if e.get("error"):
            note += f"; {e['error'][:200]}"
        lines.append(f"| {which} | {e.get('kernels', '')} | {fmt(gb(e.get(NCU_METRICS[0])), '.3f')} "
                     f"| {fmt(gb(e.get(NCU_METRICS[1])), '.3f')} | {fmt(gb(measured), '.3f')} | {e['model'] / 1e9:.3f} "
                     f"| {fmt(ratio, '.2f')} | {note} |")
    return "\n".join(lines) + "\n"


def gb(x):
    return None if x is None else x / 1e9
