"""
Time and memory against n
=========================

Naive attention materializes the n x m score matrix; cuflash sweeps key tiles with an online softmax, so its
working set is one tile of rows by keys whatever n. This example times both on NumPy arrays (one head, d = 64,
float32, n = m) and records each call's peak of allocated memory (``tracemalloc``). The sizes are small so that it
runs in a second or two; ``python -m bench.attention --tiny`` measures the same comparison at larger sizes.
"""

import time
import tracemalloc

import matplotlib.pyplot as plt
import numpy as np

import cuflash


def naive(q, k, v):
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def measure(fn, *args):
    """(best time of two in ms, peak allocated MiB) of fn(*args)."""
    times = []
    for _ in range(2):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    tracemalloc.start()
    fn(*args)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return 1e3 * min(times), peak / 2**20


rng = np.random.default_rng(0)
sizes = [256, 512, 1024, 2048]
results = {"naive NumPy": [], "cuflash (numpy backend)": []}
for n in sizes:
    q, k, v = (rng.standard_normal((n, 64), dtype=np.float32) for _ in range(3))
    results["naive NumPy"].append(measure(naive, q, k, v))
    results["cuflash (numpy backend)"].append(measure(cuflash.attention, q, k, v))

fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
for label, points in results.items():
    left.plot(sizes, [t for t, _ in points], "o-", label=label)
    right.plot(sizes, [mib for _, mib in points], "o-", label=label)
left.set(xscale="log", yscale="log", xlabel="n = m", ylabel="time (ms)", title="time")
right.set(xscale="log", yscale="log", xlabel="n = m", ylabel="peak allocated (MiB)", title="memory")
for ax in (left, right):
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.legend()
plt.show()

# %%
# The naive path's peak grows as n², the score matrix's; cuflash's grows as n, its inputs' and output's.

for n, (t0, m0), (t1, m1) in zip(sizes, *results.values()):
    print(f"n = {n:5d}: naive {t0:7.1f} ms {m0:7.1f} MiB   cuflash {t1:7.1f} ms {m1:6.1f} MiB")
