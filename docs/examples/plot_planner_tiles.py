"""
The planner's tile choice
=========================

On a GPU backend the planner chooses a kernel (tensor cores, ``mma``, or CUDA cores, ``fma``) and its tiles
(Br query rows, Bc keys) for each dtype, head dimension and GPU, within the GPU's shared memory and registers.
``cuflash.tiling.plan`` tells what would run for any shape on any GPU of the table, without the GPU: this example
draws its choice for the forward against d, for each dtype, on an H100 and an A100.
"""

import matplotlib.pyplot as plt
import numpy as np

import cuflash
from cuflash import tiling
from cuflash.family import Shape

dims = [16, 32, 64, 96, 128, 160, 192, 256]
dtypes = ["float16", "bfloat16", "float32", "float64"]
gpus = ["H100", "A100"]

fig, axes = plt.subplots(1, len(gpus), figsize=(13, 4.8), constrained_layout=True, sharey=True)
for ax, gpu in zip(axes, gpus):
    device = cuflash.DeviceLimits.known(gpu)
    for row, dtype in enumerate(dtypes):
        for x, d in enumerate(dims):
            plan = tiling.plan(Shape(np.dtype(dtype), d, d), device)
            config = plan.config
            tensor = config.variant == "mma"
            ax.scatter(x, row, s=plan.shared_mem / 300, color="#264653" if tensor else "#e76f51", alpha=0.8)
            ax.annotate(f"{config.Br}×{config.Bc}", (x, row), textcoords="offset points", xytext=(0, 14),
                        ha="center", fontsize=7)
    ax.set(title=f"{gpu} ({device.smem_per_block // 1024} KiB of shared memory per block)", xlabel="head dim d",
           xticks=range(len(dims)), xticklabels=dims, yticks=range(len(dtypes)), yticklabels=dtypes,
           ylim=(-0.6, len(dtypes) - 0.2))
handles = [plt.Line2D([], [], marker="o", ls="", color=c, label=label)
           for c, label in (("#264653", "tensor cores (mma)"), ("#e76f51", "CUDA cores (fma)"))]
fig.legend(handles=handles, loc="outside lower center", ncol=2)
fig.suptitle("Br × Bc of the forward; a marker's area is the block's shared memory")
plt.show()

# %%
# Each plan is complete: the kernel's name expression, its block and its shared memory.

for dtype in dtypes:
    plan = tiling.plan(Shape(np.dtype(dtype), 128, 128), cuflash.DeviceLimits.known("H100"))
    print(f"{dtype:9s} d = 128: {plan.config}  {plan.shared_mem // 1024} KiB  {plan.name}")
