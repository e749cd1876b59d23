"""Print the seed's I/O and memory tables, ours beside them, and draw them as PNG plots.

    python -m bench.io_model                  # tables, plots into bench/results/io_model/
    python -m bench.io_model --no-plots       # tables only
    python -m bench.io_model --tiny           # the CI mode: seconds, plots into a temporary folder

The seed's tables come out digit for digit as the seed printed them (its GB and MB are GiB and MiB).
Our tables use the tiling Br x Bc that the planner (cuflash.tiling.choose) picks for the seed's setting
(float16, d = 128) on --gpu (default H100), or --br/--bc; one table shows the planner's pick on every GPU
it knows, with the shared memory that tiling takes and the traffic it causes.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

from cuflash import cost, tiling
from cuflash.family import Shape

HEADS, D, DTYPE_BYTES = cost.SEED_HEADS, cost.SEED_D, cost.SEED_DTYPE_BYTES
MEMORY_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
TRAFFIC_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
SEED_SRAM_BUDGETS_KB = (96, 192, 384)
CONTEXT_BUDGET = 20 * cost.GiB
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "io_model"


# ---------------------------------------------------------------------------------------------------------
# The seed's tables, laid out exactly as it printed them
# ---------------------------------------------------------------------------------------------------------


def memory_table(lengths=MEMORY_LENGTHS) -> str:
    lines = [
        f"=== Standard vs FlashAttention Memory ({HEADS} heads, d_head={D}) ===",
        "   Seq len   Standard (MB)   Flash (MB)   Memory reduction   Savings (MB)",
        "-" * 72,
    ]
    for n in lengths:
        std = cost.standard_memory_bytes(n, HEADS, D) / cost.MiB
        flash = cost.flash_memory_bytes(n, HEADS, D) / cost.MiB
        lines.append(f"{n:>10,}{std:>15.1f}{flash:>13.1f}{std / flash:>18.1f}×{std - flash:>14.1f}")
    return "\n".join(lines)


def score_table(lengths=MEMORY_LENGTHS) -> str:
    lines = ["=== Score Matrix Alone (the N×N bottleneck) ===", "   Seq len  Score matrix (GB)", "-" * 30]
    for n in lengths:
        lines.append(f"{n:>10,}{cost.score_matrix_bytes(n, HEADS) / cost.GiB:>18.2f}")
    return "\n".join(lines)


def sram_table(blocks=cost.SEED_BLOCKS) -> str:
    lines = [
        f"=== SRAM Usage vs Block Size (d_head={D}, BF16) ===",
        "   Block   Q (KB)   KV (KB)   Out (KB)   Stats   Total (KB)  Fits 192KB?  Arith. intens.",
        "-" * 84,
    ]
    for b in blocks:
        use = cost.sram_bytes(b, D)
        kb = [x / cost.KiB for x in (use.q, use.kv, use.out, use.stats, use.total)]
        fits = "YES" if use.total <= cost.SEED_A100_SRAM else "NO"
        ai = cost.seed_arithmetic_intensity(b, D)
        lines.append(f"{b:>8}{kb[0]:>9.1f}{kb[1]:>10.1f}{kb[2]:>10.1f}{kb[3]:>7.1f}{kb[4]:>12.1f}{fits:>13}{ai:>15.1f}")
    return "\n".join(lines)


def best_block_table(budgets_kb=SEED_SRAM_BUDGETS_KB) -> str:
    lines = ["=== Optimal Block Size Selection ===",
             "Criteria: largest block that fits SRAM → highest arithmetic intensity"]
    for kb in budgets_kb:
        b = cost.best_block(kb * cost.KiB, D)
        ai = cost.seed_arithmetic_intensity(b, D)
        lines.append(f"  SRAM={kb:>3} KB → optimal block_size={b:>4}  AI={ai:.1f} ops/byte")
    return "\n".join(lines)


def traffic_table(lengths=TRAFFIC_LENGTHS) -> str:
    lines = ["=== HBM Traffic: Standard vs FlashAttention ===",
             "   Seq len   Std HBM (GB)   Flash HBM (GB)   HBM I/O reduction", "-" * 65]
    for n in lengths:
        std = cost.standard_traffic_bytes(n, HEADS, D) / cost.GiB
        flash = cost.flash_traffic_bytes(n, HEADS, D) / cost.GiB
        lines.append(f"{n:>10,}{std:>14.2f}{flash:>16.3f}{std / flash:>20.1f}x")
    return "\n".join(lines)


def context_table(budget=CONTEXT_BUDGET) -> str:
    lines = [f"=== Context Windows Enabled by FlashAttention (A100, {budget / cost.GiB:.0f} GB budget) ===",
             "              Method   Max seq (A100)              Bottleneck", "-" * 64]
    for label, method, bottleneck in (("Standard attn", "standard", "N x N in HBM"),
                                      ("FlashAttention", "flash", "Block fits SRAM")):
        n = cost.max_context(HEADS, D, budget, method)
        lines.append(f"{label:>20}{n:>16,}{bottleneck:>24}")
    return "\n".join(lines)


def seed_tables() -> str:
    return "\n\n".join([memory_table(), score_table(), sram_table(), best_block_table(), traffic_table(),
                        context_table()])


# ---------------------------------------------------------------------------------------------------------
# Ours beside the seed's
# ---------------------------------------------------------------------------------------------------------


def kernel_traffic_table(br: int, bc: int, lengths=TRAFFIC_LENGTHS) -> str:
    """Seed's flash traffic (K, V once; and its hbm_io_cost with ceil(n/Br) passes) vs our kernel's."""
    lines = [
        f"=== Our kernel's HBM traffic ({HEADS} heads, d={D}, fp16, Br={br}, Bc={bc}; GiB) ===",
        "   Seq len  Seed table  Seed n_blocks  Compulsory   Our loads  Causal loads  K/V passes",
        "-" * 87,
    ]
    for n in lengths:
        seed = cost.flash_traffic_bytes(n, HEADS, D) / cost.GiB
        seed_passes = cost.flash_traffic_bytes(n, HEADS, D, kv_passes=math.ceil(n / br)) / cost.GiB
        least = cost.compulsory_traffic(HEADS, n, n, D, Br=br, Bc=bc).total / cost.GiB
        loads = cost.kernel_traffic(HEADS, n, n, D, Br=br, Bc=bc).total / cost.GiB
        causal = cost.kernel_traffic(HEADS, n, n, D, Br=br, Bc=bc, causal=True).total / cost.GiB
        passes = f"{cost.kv_passes(n, n, br, bc):.0f} / {cost.kv_passes(n, n, br, bc, causal=True):.1f}"
        lines.append(f"{n:>10,}{seed:>12.3f}{seed_passes:>15.3f}{least:>12.3f}{loads:>12.3f}{causal:>14.3f}"
                     f"{passes:>12}")
    lines += [
        "Seed table: K and V read once. Seed n_blocks: its hbm_io_cost_gb, K and V read ceil(n/Br) times.",
        "Compulsory: each distinct byte once, plus a float32 lse per row. Our loads: what the kernel asks of",
        "memory (dense / causal), an upper bound on DRAM traffic since L2 may serve repeated K/V tiles.",
    ]
    return "\n".join(lines)


def flops_table(br: int, bc: int, lengths=TRAFFIC_LENGTHS) -> str:
    lines = [
        f"=== FLOPs and arithmetic intensity ({HEADS} heads, d={D}, fp16, Br={br}, Bc={bc}) ===",
        "   Seq len  Dense GFLOP  Causal GFLOP  Causal/dense  Dense FLOP/B  Causal FLOP/B",
        "-" * 78,
    ]
    for n in lengths:
        dense = cost.flops(HEADS, n, n, D)
        causal = cost.flops(HEADS, n, n, D, causal=True)
        ai = cost.kernel_arithmetic_intensity(HEADS, n, n, D, Br=br, Bc=bc)
        ai_causal = cost.kernel_arithmetic_intensity(HEADS, n, n, D, Br=br, Bc=bc, causal=True)
        lines.append(f"{n:>10,}{dense / 1e9:>13.1f}{causal / 1e9:>14.1f}{causal / dense:>14.4f}{ai:>14.1f}"
                     f"{ai_causal:>15.1f}")
    lines.append("Causal pairs are counted exactly: n(n+1)/2, not n^2/2. FLOP/B: over all of our kernel's loads.")
    return "\n".join(lines)


def smem_limit_table(blocks=cost.SEED_BLOCKS) -> str:
    gpus = list(cost.BLOCK_SMEM_LIMIT)
    head = f"{'Block':>6}{'Seed KiB':>10}" + "".join(f"{g:>14}" for g in gpus)
    lines = ["=== The seed's shared memory per block vs what one block can get (d=128, 2 bytes) ===",
             " " * 16 + "".join(f"{cost.BLOCK_SMEM_LIMIT[g] // cost.KiB:>10} KiB" for g in gpus),
             head, "-" * len(head)]
    for b in blocks:
        need = cost.sram_bytes(b, D).total
        fits = "".join(f"{'yes' if need <= cost.BLOCK_SMEM_LIMIT[g] else 'NO':>14}" for g in gpus)
        lines.append(f"{b:>6}{need / cost.KiB:>10.1f}{fits}")
    lines += [
        "The seed's 192 KB is the A100's L1 + shared memory per SM; a block can have 163 KiB of it",
        f"(and {cost.DEFAULT_BLOCK_SMEM // cost.KiB} KiB anywhere without opting in). Block 128 (129 KiB) fits an A100 "
        "or H100, not a V100, T4, A10 or L4;",
        "block 64 (64.5 KiB) misses a T4's 64 KiB by half a KiB.",
    ]
    return "\n".join(lines)


SEED_SHAPE = Shape(np.float16, D, D)


def planner_tiling(gpu: str):
    """The planner's configuration for the seed's setting (float16, d = 128) on a known GPU."""
    return tiling.choose(SEED_SHAPE, tiling.DeviceLimits.known(gpu))


def planner_table(n: int = 4096) -> str:
    """What the planner picks on each known GPU, its shared memory, and the traffic that tiling causes."""
    lines = [
        f"=== The planner's tiling per GPU ({HEADS} heads, d={D}, fp16, n = m = {n:,}; traffic in GiB) ===",
        f"{'GPU':<18}{'kernel':>7}{'Br x Bc':>10}{'warps':>6}{'smem KiB':>10}{'of KiB':>8}{'Our loads':>11}"
        f"{'Causal':>8}{'K/V passes':>12}",
        "-" * 90,
    ]
    for device in tiling.KNOWN:
        config = tiling.choose(SEED_SHAPE, device)
        smem = tiling.shared_memory_bytes(SEED_SHAPE, config)
        walk = dict(Br=config.Br, Bc=config.Bc)
        loads = cost.kernel_traffic(HEADS, n, n, D, **walk).total / cost.GiB
        causal = cost.kernel_traffic(HEADS, n, n, D, causal=True, **walk).total / cost.GiB
        passes = f"{cost.kv_passes(n, n, config.Br, config.Bc):.0f} / " \
                 f"{cost.kv_passes(n, n, config.Br, config.Bc, causal=True):.1f}"
        lines.append(f"{device.name:<18}{config.variant:>7}{f'{config.Br} x {config.Bc}':>10}{config.warps:>6}"
                     f"{smem / cost.KiB:>10.1f}{device.smem_per_block // cost.KiB:>8}{loads:>11.3f}"
                     f"{causal:>8.3f}{passes:>12}")
    lines += [
        "The seed's traffic table reads K and V once; a kernel reads them once per query tile it visits, so a",
        "GPU whose shared memory holds only smaller query tiles (Br) moves more: the tiling is the planner's,",
        "the limit is what one block may take (the seed's 192 KB is the A100's L1 + shared memory per SM).",
    ]
    return "\n".join(lines)


def our_tables(br: int, bc: int) -> str:
    return "\n\n".join([kernel_traffic_table(br, bc), flops_table(br, bc), planner_table(), smem_limit_table()])


# ---------------------------------------------------------------------------------------------------------
# Plots (matplotlib, a bench-only dependency)
# ---------------------------------------------------------------------------------------------------------

STANDARD_COLOR, FLASH_COLOR = "tab:orange", "tab:blue"


def plot_memory(plt, path, lengths, dpi):
    """Figure 1: memory footprint vs sequence length."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(lengths, [cost.standard_memory_bytes(n, HEADS, D) / cost.MiB for n in lengths], "o-",
            color=STANDARD_COLOR, label="standard attention")
    ax.plot(lengths, [cost.flash_memory_bytes(n, HEADS, D) / cost.MiB for n in lengths], "o-",
            color=FLASH_COLOR, label="FlashAttention")
    _log_axes(ax, "memory (MiB)", f"Memory footprint ({HEADS} heads, d={D}, fp16)")
    _save(fig, path, dpi)


def plot_traffic(plt, path, lengths, br, bc, dpi):
    """Figure 3: HBM traffic vs sequence length, with our kernel's loads beside the seed's model."""
    fig, ax = plt.subplots(figsize=(6, 4))
    series = [
        ("standard attention", STANDARD_COLOR, "o-", lambda n: cost.standard_traffic_bytes(n, HEADS, D)),
        ("FlashAttention, seed (K, V once)", FLASH_COLOR, "o-", lambda n: cost.flash_traffic_bytes(n, HEADS, D)),
        (f"our kernel's loads (Br={br}, Bc={bc})", FLASH_COLOR, "s--",
         lambda n: cost.kernel_traffic(HEADS, n, n, D, Br=br, Bc=bc).total),
        ("our kernel's loads, causal", FLASH_COLOR, "^:",
         lambda n: cost.kernel_traffic(HEADS, n, n, D, Br=br, Bc=bc, causal=True).total),
    ]
    for label, color, style, bytes_of in series:
        ax.plot(lengths, [bytes_of(n) / cost.GiB for n in lengths], style, color=color, label=label)
    _log_axes(ax, "HBM traffic (GiB)", f"HBM traffic, forward ({HEADS} heads, d={D}, fp16)")
    _save(fig, path, dpi)


def plot_sram(plt, path, blocks, dpi):
    """Figure 2: the seed's shared memory per block size against the seed's 192 KB and real per-block limits."""
    fig, (ax, ax_ai) = plt.subplots(1, 2, figsize=(10, 4))
    need = [cost.sram_bytes(b, D).total / cost.KiB for b in blocks]
    colors = ["tab:green" if x * cost.KiB <= cost.SEED_A100_SRAM else "tab:red" for x in need]
    labels = [str(b) for b in blocks]
    bars = ax.bar(labels, need, color=colors)
    ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.axhline(cost.SEED_A100_SRAM / cost.KiB, color="black", label="seed: 192 KB (A100 L1+shared per SM)")
    for name, style in (("A100", "--"), ("H100/H200", "-."), ("A10/RTX 3090", ":"), ("T4", (0, (1, 3)))):
        ax.axhline(cost.BLOCK_SMEM_LIMIT[name] / cost.KiB, color="gray", linestyle=style,
                   label=f"{name}: {cost.BLOCK_SMEM_LIMIT[name] // cost.KiB} KiB per block")
    ax.set(xlabel="block size (Br = Bc)", ylabel="shared memory (KiB)",
           title=f"Seed's shared memory per block (d={D}, 2 bytes)")
    ax.legend(fontsize=7, loc="upper left")
    ax_ai.plot(labels, [cost.seed_arithmetic_intensity(b, D) for b in blocks], "o-", color=FLASH_COLOR)
    ax_ai.set(xlabel="block size", ylabel="FLOP / byte",
              title="Seed's arithmetic intensity (K, V loads of one step)")
    ax_ai.grid(True, alpha=0.3)
    _save(fig, path, dpi)


def _log_axes(ax, ylabel, title):
    ax.set_xscale("log", base=2)
    ax.set(yscale="log", xlabel="sequence length n", ylabel=ylabel, title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig, path, dpi):
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    fig.clf()


def draw_plots(out: Path, br: int, bc: int, tiny: bool):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    lengths = MEMORY_LENGTHS[::3] if tiny else tuple(2**k for k in range(9, 18))
    dpi = 50 if tiny else 120
    paths = [out / "memory.png", out / "sram.png", out / "traffic.png"]
    plot_memory(plt, paths[0], lengths, dpi)
    plot_sram(plt, paths[1], cost.SEED_BLOCKS, dpi)
    plot_traffic(plt, paths[2], lengths, br, bc, dpi)
    plt.close("all")
    return paths


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.io_model", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help=f"folder for the PNG plots (default {DEFAULT_OUT}; "
                        "with --tiny a temporary folder)")
    parser.add_argument("--no-plots", action="store_true", help="print the tables only")
    parser.add_argument("--tiny", action="store_true", help="CI mode: small, fast plots in a temporary folder")
    parser.add_argument("--gpu", default="H100", help="the GPU whose planner tiling our tables use (default H100; "
                        "any of " + ", ".join(d.name for d in tiling.KNOWN) + ")")
    parser.add_argument("--br", type=int, help="query tile rows instead of the planner's (with --bc)")
    parser.add_argument("--bc", type=int, help="key tile rows instead of the planner's (with --br)")
    args = parser.parse_args(argv)
    if (args.br is None) != (args.bc is None):
        parser.error("--br and --bc go together")
    try:
        config = planner_tiling(args.gpu)
    except ValueError as exc:
        parser.error(str(exc))
    br, bc = (args.br, args.bc) if args.br is not None else (config.Br, config.Bc)

    print(seed_tables())
    print()
    print(our_tables(br, bc))
    if args.no_plots:
        return 0
    if not have_matplotlib():
        if args.out is not None:
            print("error: plots need matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
        print("\nmatplotlib is not installed: no plots (pip install matplotlib, or pass --no-plots)")
        return 0
    out = args.out or (Path(tempfile.mkdtemp(prefix="io_model-")) if args.tiny else DEFAULT_OUT)
    paths = draw_plots(out, br, bc, args.tiny)
    print("\nplots: " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
