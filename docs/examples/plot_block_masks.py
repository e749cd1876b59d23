"""
A block mask's tiles
====================

``cuflash.block_mask`` evaluates a ``mask_mod`` tile by tile and records, for every (query tile, key tile),
whether the pattern hides it, shows it whole, or shows it in part. Only the tiles it shows are computed, and the
pattern is evaluated only on the partial ones. Here are the tiles of four patterns at n = m = 1024 on 64 x 64
tiles; each title gives the share of tiles computed (``density``).
"""

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap

import cuflash
from cuflash import mods

n = m = 1024
ids = np.repeat(np.arange(5), [100, 300, 150, 350, 124])  # five packed documents of different lengths
patterns = {
    "causal": mods.causal,
    "sliding window (128 keys)": mods.and_masks(mods.causal, mods.sliding_window(128)),
    "5 packed documents, causal": mods.and_masks(mods.causal, mods.documents(ids)),
    "prefix-LM (prefix 300)": mods.prefix_lm(300),
}

colors = ListedColormap(["white", "#f4a261", "#264653"])  # hidden, partial, full
fig, axes = plt.subplots(1, 4, figsize=(13, 4.2), constrained_layout=True)
for ax, (title, mask_mod) in zip(axes, patterns.items()):
    pattern = cuflash.block_mask(mask_mod, (), n, m, block=(64, 64))
    ax.imshow(pattern.kinds, cmap=colors, vmin=0, vmax=2)
    ax.set_title(f"{title}\n{pattern.density:.0%} of the tiles", fontsize=10)
    ax.set_xlabel("key tile")
    ax.set_ylabel("query tile")
handles = [plt.Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="grey") for c in colors.colors]
fig.legend(handles, ["hidden: skipped", "partial: the mod decides", "full: no mask work"],
           loc="outside lower center", ncol=3)
plt.show()

# %%
# The ``repr`` of a block mask draws the same tiles as text:

print(cuflash.block_mask(mods.causal, (), 512, 512, block=(64, 64)))
