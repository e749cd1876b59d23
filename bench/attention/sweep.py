"""The sweep: every backend on every point, a record for each even when a backend cannot run, the reports
rewritten after every point, the progress lines, and the JSON's header (schema, machine, method)."""

from __future__ import annotations

import datetime
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

import numpy as np

from .accuracy import ROWS_CHECKED, reference, sample
from .environment import environment
from .failures import is_cannot_run, one_line
from .inputs import InputSets, set_count
from .peers import Runner, peer_name
from .points import Point, Preset
from .reports import fmt, rate_unit, scaled, write_reports
from .timing import matmul_peak, rates, relate, time_calls

SCHEMA = "cuflash-bench-attention/1"


def make_meta(dev, name: str, preset: Preset, command: str, started: datetime.datetime) -> dict:
    """What the JSON says besides the points: the machine, the versions, the command and how it measured."""
    return {"schema": SCHEMA, "mode": "gpu" if dev.gpu else "cpu", "preset": name, "command": command,
            "started": started.isoformat(timespec="seconds"), "env": environment(dev),
            "method": {"timing": dev.timing, "warmup": preset.warmup, "repeats": preset.repeats,
                       "budget_s_per_backend": preset.budget_s,
                       "rotation": "each call takes the next of several input sets whose total exceeds twice the "
                                   "L2 cache (between 2 and 8 sets)",
                       "flops": "cuflash.cost.flops: 4*B*H*n*m*d dense, causal counted pair by pair",
                       "peak_memory": dev.memory,
                       "max_abs_err": f"against float64 attention on {ROWS_CHECKED} rows of the first and last "
                                      "batch item of the first input set"},
            "notes": []}


def measure(dev, runner: Runner, point: Point, sets: InputSets, preset: Preset, ref) -> dict:
    """One backend on one point: the times, the error on sampled rows, the peak memory, or why it did not run."""
    rec = {"name": runner.name, "backend": runner.backend, "variant": runner.variant, "status": "ok", "reason": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call = runner.prepare(dev, point, sets)
            rec["block"] = getattr(call, "block", None)
            rec["splits"] = getattr(call, "splits", None)
            times, rec["calls_per_sample"] = time_calls(dev, call, preset.warmup, preset.repeats, preset.budget_s)
            rows, expected = ref
            rec["max_abs_err"] = float(np.max(np.abs(sample(call(0), rows) - expected)))
            rec["peak_bytes"] = dev.peak_bytes(lambda: call(0), runner.allocator)
            rec["peak_bytes_method"] = dev.memory[runner.allocator]
            rec.update(rates(point, times))
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run a point must not end the sweep
            rec["status"] = "skipped" if is_cannot_run(exc) else "error"
            said = [one_line(w.message, 300) for w in caught if "kernel not used" in str(w.message)
                    or "Memory efficient" in str(w.message) or "cuDNN" in str(w.message)]
            rec["reason"] = "; ".join([one_line(exc)] + sorted(set(said))[:4])
            dev.release()
    return rec


def run_sweep(dev, preset: Preset, points, runners, out: Path, meta: dict, time_limit: Optional[float]) -> dict:
    peer = peer_name(dev)
    results = dict(meta, peer=peer, matmul_peak={}, points=[], complete=False)
    for dtype in sorted({p.dtype for p in points}):
        results["matmul_peak"][dtype] = peak = matmul_peak(dev, dtype, preset.matmul, preset)
        unit, factor = rate_unit(results["mode"])
        progress(f"matmul peak {dtype} {preset.matmul}^3: " + (f"{peak['tflops'] * factor:.4g} {unit} via {peak['via']}"
                                                              if peak["tflops"] else f"failed {peak['tries']}"))
    begin = time.perf_counter()
    for index, point in enumerate(points, 1):
        late = time_limit is not None and index > 1 and time.perf_counter() - begin > time_limit
        entry = dict(asdict(point), flops=point.flops(), input_sets=0, input_note=None)
        entry["results"] = run_point(dev, preset, point, runners, entry, late)
        relate(entry["results"], peer, results["matmul_peak"].get(point.dtype, {}).get("tflops"))
        results["points"].append(entry)
        for r in entry["results"]:
            progress(f"[{index}/{len(points)}] {point.label} | {describe(r, results['mode'])}")
        write_reports(results, out, plots=False)
    results["complete"] = True
    return results


def run_point(dev, preset, point, runners, entry, late) -> List[dict]:
    if late:
        return [dict(name=r.name, backend=r.backend, variant=r.variant, status="skipped",
                     reason="the sweep's --time-limit was reached") for r in runners]
    try:
        sets = InputSets(dev, point, set_count(dev, point))
        ref = reference(sets, point)
    except Exception as exc:  # noqa: BLE001 - no inputs: every backend is skipped with the reason
        dev.release()
        return [dict(name=r.name, backend=r.backend, variant=r.variant, status="skipped",
                     reason=f"could not make the inputs: {one_line(exc)}") for r in runners]
    entry["input_sets"], entry["input_note"] = len(sets.arrays), sets.reason
    records = [measure(dev, r, point, sets, preset, ref) for r in runners]
    del sets
    dev.release()
    return records


def describe(r: dict, mode: str) -> str:
    if r["status"] != "ok":
        return f"{r['name']:<16} {r['status']}: {r['reason'][:150]}"
    unit, factor = rate_unit(mode)
    parts = [f"{r['name']:<16} {r['time_ms']:9.3f} ms", f"{fmt(scaled(r['tflops'], factor), '8.4g')} {unit}"]
    if r.get("matmul_fraction") is not None:
        parts.append(f"{r['matmul_fraction']:.2f} of matmul")
    if r.get("vs_peer") is not None:
        parts.append(f"{r['vs_peer']:.2f}x peer")
    parts.append(f"err {r['max_abs_err']:.1e}")
    return "  ".join(parts)


def progress(line: str):
    print(line, file=sys.stderr, flush=True)
