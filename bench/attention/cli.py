"""The command line: the flags, then the ncu child, the ncu measurement or a sweep of a preset into --out."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from . import __doc__ as USAGE  # the package's docstring is the command's help
from .devices import Cpu, Gpu, cuda_device_count
from .environment import ROOT, command_line
from .ncu import ncu_measure, ncu_problem
from .peers import runners_for
from .plots import draw_plots
from .points import PRESETS
from .reports import write_reports
from .sweep import make_meta, progress, run_sweep


def parse_args(argv):
    p = argparse.ArgumentParser(prog=f"python -m {__package__}", description=USAGE.splitlines()[0],
                                epilog=USAGE.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="default: sweep on a GPU, cpu without one")
    p.add_argument("--tiny", action="store_true", help="CI mode: --preset tiny on the CPU (seconds)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU exists")
    p.add_argument("--out", type=Path, help="folder for results.json, results.md and plots "
                                            "(default bench/results/attention/<preset>)")
    p.add_argument("--backends", help="comma-separated name prefixes, e.g. cuflash,torch-flash "
                                      "(default: all on a GPU; cuflash,naive on the CPU)")
    p.add_argument("--blocks", help="forced cuflash tilings, e.g. 128x64,64x64 (default: the preset's)")
    p.add_argument("--time-limit", type=float, help="seconds; later points are recorded as skipped")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--ncu", action="store_true", help="measure DRAM bytes with ncu (GPU) into --out")
    p.add_argument("--ncu-timeout", type=float, default=60.0, help="seconds per ncu run (default 60)")
    p.add_argument("--ncu-problem", choices=("naive", "cuflash"), help=argparse.SUPPRESS)  # what ncu runs
    return p.parse_args(argv)


def parse_blocks(text):
    try:
        return tuple(tuple(int(x) for x in b.split("x")) for b in text.split(",") if b)
    except ValueError:
        raise SystemExit(f"--blocks: expected e.g. 128x64,64x64, got {text!r}") from None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.ncu_problem:
        return ncu_problem(args.ncu_problem)
    if args.ncu:
        return ncu_measure(args.out or default_out("ncu"), args.ncu_timeout)
    return run_preset(args, argv)


def default_out(name: str) -> Path:
    """Where a run keeps its reports: one current folder per preset, rewritten in place (git keeps the history)."""
    return ROOT / "bench" / "results" / "attention" / name


def run_preset(args, argv) -> int:
    """Time the chosen preset's points on every chosen backend; write the reports and plots into --out."""
    gpu = not (args.cpu or args.tiny) and cuda_device_count() > 0
    name = "tiny" if args.tiny else args.preset or ("sweep" if gpu else "cpu")
    preset = PRESETS[name]
    if preset.gpu and not gpu:
        print(f"preset {name} needs a CUDA GPU and none is usable here; on the CPU use --preset cpu or --tiny",
              file=sys.stderr)
        return 2
    dev = Gpu() if gpu else Cpu()
    blocks = parse_blocks(args.blocks) if args.blocks is not None else preset.blocks
    runners = runners_for(dev, blocks, [w for w in (args.backends or "").split(",") if w])
    out = args.out or default_out(name)
    started = datetime.datetime.now(datetime.timezone.utc)
    meta = make_meta(dev, name, preset, command_line(argv), started)
    progress(f"{name}: {len(preset.points)} points x {len(runners)} backends on "
             f"{meta['env'].get('gpu') or 'the CPU'}, into {out}")
    results = run_sweep(dev, preset, list(preset.points), runners, out, meta, args.time_limit)
    results["wall_s"] = round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1)
    plots = [] if args.no_plots else draw_plots(results, out)
    write_reports(results, out, plots=False)
    for note in results["notes"]:
        progress(note)
    progress(f"wrote {out / 'results.json'}, {out / 'results.md'}" + "".join(f", {p.name}" for p in plots))
    return 0
