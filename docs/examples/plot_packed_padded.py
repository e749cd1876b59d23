"""
Packed against padded
=====================

A batch of sequences of different lengths can be padded to the longest and masked, or packed one after another
along one axis and attended with ``cuflash.attention_varlen``, each sequence only to its own keys. The padded
call's work is batch x longest², the packed call's the sum of the squared lengths. This example draws both
layouts' work and times the two calls on NumPy arrays (2 heads, d = 32, float32, 10 sequences of skewed lengths
up to 512).
"""

import time

import matplotlib.pyplot as plt
import numpy as np

import cuflash

rng = np.random.default_rng(1)
lengths = np.sort(np.minimum(512, (rng.pareto(1.5, 10) * 60).astype(int) + 8))[::-1]
cu = np.concatenate([[0], np.cumsum(lengths)])
total, longest, heads, d = int(cu[-1]), int(lengths.max()), 2, 32
q, k, v = (rng.standard_normal((total, heads, d), dtype=np.float32) for _ in range(3))

# The padded layout: (batch, heads, longest, d), with a key-padding mask.
padded = [np.zeros((len(lengths), heads, longest, d), np.float32) for _ in range(3)]
for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
    for x, y in zip(padded, (q, k, v)):
        x[s, :, : b - a] = y[a:b].transpose(1, 0, 2)
pad = (np.arange(longest) < lengths[:, None])[:, None, None, :]


def best_ms(fn):
    times = []
    for _ in range(2):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


packed_ms = best_ms(lambda: cuflash.attention_varlen(q, k, v, cu, cu))
padded_ms = best_ms(lambda: cuflash.attention(*padded, mask=pad))
ideal = float((lengths.astype(float) ** 2).sum() / (len(lengths) * longest**2))

fig, (work, times) = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True,
                                  gridspec_kw={"width_ratios": [2, 1]})
x = np.arange(len(lengths))
work.bar(x, np.full(len(lengths), longest**2), color="#e9c46a", label="padded: longest²")
work.bar(x, lengths.astype(float) ** 2, color="#2a9d8f", label="packed: n_s²")
work.set(xlabel="sequence", ylabel="score elements per head", title="the work of each sequence")
work.legend()
times.bar(["padded", "packed"], [padded_ms, packed_ms], color=["#e9c46a", "#2a9d8f"])
times.set(ylabel="time (ms)", title=f"time: packed/padded {packed_ms / padded_ms:.2f}\n(ideal work ratio {ideal:.2f})")
plt.show()

# %%
# The packed call gives what the padded one gives on every real row:

out = cuflash.attention_varlen(q, k, v, cu, cu)
reference = cuflash.attention(*padded, mask=pad)
rows = [reference[s, :, : b - a].transpose(1, 0, 2) for s, (a, b) in enumerate(zip(cu[:-1], cu[1:]))]
print("lengths:", lengths.tolist())
print("largest difference:", float(np.abs(out - np.concatenate(rows)).max()))
