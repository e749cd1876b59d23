"""bench/io_model.py: the seed's tables verbatim, and the script run end to end in its tiny CI mode."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from bench import io_model
from cuflash import tiling

ROOT = Path(__file__).resolve().parents[1]

# The seed document's printed output, copied as it stands (its GB and MB are GiB and MiB).
SEED_OUTPUT = """\
=== Standard vs FlashAttention Memory (32 heads, d_head=128) ===
   Seq len   Standard (MB)   Flash (MB)   Memory reduction   Savings (MB)
------------------------------------------------------------------------
       512           32.0         16.1               2.0×          15.9
     1,024           96.0         32.1               3.0×          63.9
     2,048          320.0         64.2               5.0×         255.8
     4,096         1152.0        128.5               9.0×        1023.5
     8,192         4352.0        257.0              16.9×        4095.0
    16,384        16896.0        514.0              32.9×       16382.0
    32,768        66560.0       1028.0              64.7×       65532.0

=== Score Matrix Alone (the N×N bottleneck) ===
   Seq len  Score matrix (GB)
------------------------------
       512              0.02
     1,024              0.06
     2,048              0.25
     4,096              1.00
     8,192              4.00
    16,384             16.00
    32,768             64.00

=== SRAM Usage vs Block Size (d_head=128, BF16) ===
   Block   Q (KB)   KV (KB)   Out (KB)   Stats   Total (KB)  Fits 192KB?  Arith. intens.
------------------------------------------------------------------------------------
      16      4.0       8.0       4.0    0.1        16.1          YES           16.0
      32      8.0      16.0       8.0    0.2        32.2          YES           32.0
      64     16.0      32.0      16.0    0.5        64.5          YES           64.0
     128     32.0      64.0      32.0    1.0       129.0          YES          128.0
     256     64.0     128.0      64.0    2.0       258.0           NO          256.0
     512    128.0     256.0     128.0    4.0       516.0           NO          512.0

=== Optimal Block Size Selection ===
Criteria: largest block that fits SRAM → highest arithmetic intensity
  SRAM= 96 KB → optimal block_size=  64  AI=64.0 ops/byte
  SRAM=192 KB → optimal block_size= 128  AI=128.0 ops/byte
  SRAM=384 KB → optimal block_size= 256  AI=256.0 ops/byte

=== HBM Traffic: Standard vs FlashAttention ===
   Seq len   Std HBM (GB)   Flash HBM (GB)   HBM I/O reduction
-----------------------------------------------------------------
       512          0.08           0.016                 5.0x
     1,024          0.28           0.031                 9.0x
     2,048          1.06           0.062                17.0x
     4,096          4.12           0.125                33.0x
     8,192         16.25           0.250                65.0x
    16,384         64.50           0.500               129.0x

=== Context Windows Enabled by FlashAttention (A100, 20 GB budget) ===
              Method   Max seq (A100)              Bottleneck
----------------------------------------------------------------
       Standard attn          16,384            N x N in HBM
      FlashAttention         262,144         Block fits SRAM
"""


def run_script(*args):
    done = subprocess.run([sys.executable, "-m", "bench.io_model", *args], capture_output=True, text=True,
                          encoding="utf-8", timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def have_matplotlib():
    return importlib.util.find_spec("matplotlib") is not None


def test_seed_tables_verbatim():
    assert io_model.seed_tables() == SEED_OUTPUT.rstrip("\n")


def test_our_tables_say_where_the_seed_differs():
    text = io_model.our_tables(128, 64)
    assert "   4,096       0.125          2.062       0.125       2.063         1.094   32 / 16.5" in text
    block_128 = "   128     129.0" + "".join(f"{x:>14}" for x in ("NO", "NO", "yes", "NO", "NO", "yes"))
    assert block_128 in text  # V100, T4, A100, A10, L4, H100
    assert "163 KiB" in text and "192 KB" in text


def test_our_tables_use_the_planners_tiling():
    table = io_model.planner_table()
    for device in tiling.KNOWN:
        config = tiling.choose(io_model.SEED_SHAPE, device)
        row = next(line for line in table.splitlines() if line[:18].strip() == device.name)
        assert f"{config.Br} x {config.Bc}" in row and config.variant in row
    assert "A100                  mma  128 x 64     4     111.2     163      2.063   1.094   32 / 16.5" in table
    t4 = run_script("--no-plots", "--gpu", "T4")
    assert "Br=32, Bc=64" in t4  # the T4's 64 KiB hold 32-row query tiles: twice the H100's K/V passes
    assert "Br=64, Bc=32" in run_script("--no-plots", "--br", "64", "--bc", "32")


def test_tiny_run_prints_the_seed_and_ours():
    out = run_script("--tiny", "--no-plots")
    assert out.startswith(SEED_OUTPUT)
    for key in ("1152.0", "128.5", "9.0×", "4.12", "0.125", "33.0x", "129.0", "16,384", "262,144",
                "Our kernel's HBM traffic", "Br=128, Bc=64"):
        assert key in out
    assert "plots:" not in out


@pytest.mark.skipif(not have_matplotlib(), reason="matplotlib is a bench-only dependency")
def test_tiny_run_draws_the_plots(tmp_path):
    out = run_script("--tiny", "--out", str(tmp_path))
    assert "plots:" in out
    for name in ("memory.png", "sram.png", "traffic.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_plots_are_skipped_unless_asked(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert io_model.main(["--tiny"]) == 0
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert io_model.main(["--tiny", "--out", str(tmp_path)]) == 2
    assert "need matplotlib" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
