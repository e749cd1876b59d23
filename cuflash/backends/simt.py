"""The simt backend: the CUDA kernels on NumPy arrays, run on the CPU by the project's emulator (cuflash.simt).

Planning and launching are the cupy backend's (cuflash.tiling, cuflash.launch); only the module differs. The
emulated device plans as an NVIDIA H100 (227 KiB of shared memory per block) unless DEVICE is changed. The mode
(fast, memcheck, race) and schedule come from $CUFLASH_SIMT_MODE and $CUFLASH_SIMT_SEED (see cuflash/simt).
"""

from __future__ import annotations

import os

from .. import launch, tiling

ARRAYS = "numpy"

DEVICE = tiling.DeviceLimits.known("H100")
OPTIONS = ("--std=c++17",)

_functions = {}  # (name expression, mode) -> compiled kernel, once per process


def unavailable():
    from .. import simt
    return simt.unavailable_reason()


def run(problem, out, lse, block=None):
    config = tiling.resolve(block, problem, DEVICE)
    launch.run(problem, out, lse, config, get_kernel, tiling.key_splits(problem, config, DEVICE))


def get_kernel(name: str, shared_mem: int):
    from .. import simt

    key = (name, os.environ.get("CUFLASH_SIMT_MODE") or "fast")
    function = _functions.get(key)
    if function is None:
        module = simt.RawModule(code=launch.source(), options=OPTIONS, name_expressions=[name],
                                max_dynamic_shared=DEVICE.smem_per_block, filename="forward.cuh")
        function = module.get_function(name)
        function.max_dynamic_shared_size_bytes = DEVICE.smem_per_block
        _functions[key] = function
    return function
