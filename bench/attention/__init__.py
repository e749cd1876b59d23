"""Time cuflash.attention beside naive attention and PyTorch's SDPA, side by side in one run.

    python -m bench.attention --tiny --out DIR      # CI: seconds on any machine, NumPy backend vs naive NumPy
    python -m bench.attention --out DIR             # the default sweep on a CUDA GPU (the cpu preset without one)
    python -m bench.attention --preset fa2          # the tensor-core targets: 16k tokens per batch, hidden 2048
    python -m bench.attention --preset short        # the few points the device check runs
    python -m bench.attention --ncu --out DIR       # DRAM bytes measured by ncu beside the traffic model

Every backend of a point runs on the same inputs. A time is the median of per-call timings (CUDA events on a
GPU, perf_counter on the CPU) after warm-up, the calls cycling through enough input sets that the L2 cache
cannot serve a repeat. FLOPs are cost.flops (4*B*H*n*m*d, causal pairs counted exactly); each rate is also
given as a fraction of a large matmul timed in the same run, and as a speed ratio to the peer (PyTorch's flash
SDPA on a GPU, naive NumPy on the CPU). A point a backend cannot run is recorded with the reason, never fatal.
Output: results.json, results.md and PNG plots (with matplotlib) in --out, rewritten after every point.
"""

# The modules, in the order a run meets them: cli (the flags), points (problems and presets), devices (the
# CPU or a GPU: timing a call, peak memory, arrays), inputs (the rotated input sets), accuracy (the float64
# reference rows), peers (cuflash, naive attention, PyTorch's SDPA), timing (per-call times, rates, the matmul
# peak), sweep (every backend on every point), environment (machine, versions, command), reports (results.json,
# results.md), plots and ncu. This docstring is the command's --help.
