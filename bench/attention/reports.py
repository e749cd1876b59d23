"""The reports in --out: results.json as measured, and results.md with one row per point and backend, opened
on a GPU by the tensor-core targets met or not. The plots are plots.py's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

from cuflash import cost

from .plots import draw_plots
from .points import HALF


def write_reports(results: dict, out: Path, plots: bool) -> List[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results))
    return draw_plots(results, out) if plots else []


def fmt(x, spec) -> str:
    return "" if x is None else format(x, spec)


def scaled(x, factor):
    return None if x is None else x * factor


def rate_unit(mode: str):
    """TFLOP/s on a GPU, GFLOP/s on a CPU: (label, factor applied to tflops)."""
    return ("TFLOP/s", 1.0) if mode == "gpu" else ("GFLOP/s", 1e3)


def markdown(results: dict) -> str:
    env = results["env"]
    where = env.get("gpu") or env.get("cpu")
    unit, factor = rate_unit(results["mode"])
    lines = [f"# cuflash attention benchmark: {results['preset']} on {where}", "",
             f"- date: {results['started']}", f"- command: `{results['command']}`",
             "- versions: " + ", ".join(f"{k} {env.get(k)}" for k in
                                        ("python", "numpy", "cupy", "torch", "cuflash", "driver", "cuda_runtime")
                                        if env.get(k) is not None),
             f"- time: {results['method']['timing']}; the median of up to {results['method']['repeats']} calls "
             f"after {results['method']['warmup']} warm-up calls",
             f"- peer: {results['peer']} (\"vs peer\" > 1 means faster than it)", ""]
    lines += [f"| matmul | via | {unit} |", "|---|---|---|"]
    for dtype, peak in results["matmul_peak"].items():
        shape = "x".join(map(str, peak["shape"]))
        lines.append(f"| {dtype} {shape} | {peak['via']} | {fmt(scaled(peak['tflops'], factor), '.4g')} |")
    lines += targets_table(results["points"]) if results["mode"] == "gpu" else []
    lines += ["", f"| dtype | B×H | n | m | d | causal | backend | ms | {unit} | of matmul | vs peer | peak MiB "
              "| max err | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in results["points"]:
        lines += [markdown_row(p, r, factor) for r in p["results"]]
    return "\n".join(lines) + "\n"


def target_tflops(p: dict) -> Optional[float]:
    """The tensor-core issue's forward targets on the H200 (n = m, float16/bfloat16), None where it sets none."""
    if p["n"] != p["m"] or p["dtype"] not in HALF:
        return None
    if p["causal"]:
        return 300.0 if p["d"] == 128 and p["n"] >= 8192 else None
    return {128: 370.0, 64: 320.0}.get(p["d"])


def targets_table(points: List[dict]) -> List[str]:
    """Per point with a target: cuflash's fastest variant against the target and against torch-flash."""
    lines = ["", "| target | point | cuflash (fastest variant) TFLOP/s | torch-flash TFLOP/s | met |",
             "|---|---|---|---|---|"]
    for p in points:
        target = target_tflops(p)
        if target is None:
            continue
        ok = [r for r in p["results"] if r["status"] == "ok"]
        best = max((r for r in ok if r["backend"] == "cuflash"), key=lambda r: r["tflops"] or 0, default=None)
        peer = next((r for r in ok if r["name"] == "torch-flash"), None)
        fast = best is not None and (best["tflops"] or 0) >= target
        met = fast and (peer is None or best["time_ms"] <= peer["time_ms"])
        label = f"{p['dtype']} {p['batch']}×{p['heads']} n={p['n']} d={p['d']}{' causal' if p['causal'] else ''}"
        mine = f"{fmt(best['tflops'], '.1f')} ({best['name']})" if best else ""
        lines.append(f"| {target:.0f} | {label} | {mine} | {fmt(peer and peer['tflops'], '.1f')} "
                     f"| {'yes' if met else 'no'} |")
    return lines if len(lines) > 3 else []


def plan_note(r: dict) -> str:
    """cuflash's tiling and key splits where the run recorded them: "128x64", "8x32, 8 splits"."""
    block, splits = r.get("block"), r.get("splits")
    if not block:
        return ""
    return f"{block[0]}x{block[1]}" + (f", {splits} splits" if splits and splits > 1 else "")


def markdown_row(p: dict, r: dict, factor: float) -> str:
    peak = r.get("peak_bytes")
    note = plan_note(r) if r["status"] == "ok" else f"{r['status']}: {r['reason'][:120]}".replace("|", "/")
    cells = [p["dtype"], f"{p['batch']}×{p['heads']}", p["n"], p["m"], p["d"], "yes" if p["causal"] else "",
             r["name"], fmt(r.get("time_ms"), ".3f"), fmt(scaled(r.get("tflops"), factor), ".4g"),
             fmt(r.get("matmul_fraction"), ".2f"), fmt(r.get("vs_peer"), ".2f"),
             fmt(None if peak is None else peak / cost.MiB, ".1f"), fmt(r.get("max_abs_err"), ".1e"), note]
    return "| " + " | ".join(map(str, cells)) + " |"
