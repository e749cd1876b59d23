"""The PNG plots of a run, drawn with matplotlib where it is installed: rate and peak memory against n = m,
one panel per dtype, head dim and causal."""

from __future__ import annotations

from pathlib import Path
from typing import List

from cuflash import cost


def draw_plots(results: dict, out: Path) -> List[Path]:
    """Rate (GPU: TFLOP/s; CPU: ms) and peak memory against n, one panel per dtype, d and causal (n == m only)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        results.setdefault("notes", []).append("plots skipped: matplotlib is not installed")
        return []
    gpu = results["mode"] == "gpu"
    panels = {}
    for p in results["points"]:
        if p["n"] == p["m"]:
            panels.setdefault((p["dtype"], p["d"], p["causal"]), []).append(p)
    metrics = [("tflops" if gpu else "time_ms", "TFLOP/s" if gpu else "ms", "rate.png"),
               ("peak_bytes", "peak memory (MiB)", "memory.png")]
    paths = []
    for key, label, name in metrics:
        if not panels:
            break
        fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
        for ax, ((dtype, d, causal), points) in zip(axes[0], sorted(panels.items())):
            plot_panel(ax, points, key)
            ax.set_title(f"{dtype} d={d}{' causal' if causal else ''}", fontsize=9)
            ax.set_xlabel("n = m")
            ax.set_ylabel(label)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=60 if results["preset"] == "tiny" else 110)
        plt.close(fig)
        paths.append(out / name)
    return paths


def plot_panel(ax, points, key):
    names = [r["name"] for r in points[0]["results"]]
    for name in names:
        xs, ys = [], []
        for p in sorted(points, key=lambda p: p["n"]):
            r = next((r for r in p["results"] if r["name"] == name and r["status"] == "ok"), None)
            if r is not None and r.get(key) is not None:
                xs.append(p["n"])
                ys.append(r[key] / cost.MiB if key == "peak_bytes" else r[key])
        if xs:
            ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
