"""The simt backend: the CUDA kernels on NumPy arrays, run on the CPU by the project's emulator (cuflash.simt).

Planning and launching are the cupy backend's (cuflash.tiling, cuflash.launch); only the module differs. The
emulated device plans as an NVIDIA H100 (227 KiB of shared memory per block) unless DEVICE is changed. The mode
(fast, memcheck, race) and schedule come from $CUFLASH_SIMT_MODE and $CUFLASH_SIMT_SEED (see cuflash/simt).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Set, Tuple

from .. import blocked, kernels, launch, tiling
from ..devices import DeviceLimits

ARRAYS = "numpy"

DEVICE = DeviceLimits.known("H100")
OPTIONS = ("--std=c++17",)

_functions: Dict[Tuple[str, str], Any] = {}  # (name expression, mode) -> compiled kernel, once per process


def unavailable():
    from .. import simt
    return simt.unavailable_reason()


def run(problem, out, lse, block=None):
    if problem.has_mods:  # not compiled into the kernels yet: the blocked algorithm, as the cupy backend
        blocked.run(problem, out, lse)
        return
    launch.run(problem, out, lse, tiling.plan(problem.shape, DEVICE, block), get_kernel)


def run_backward(problem, dout, out, lse, grads, block=None):
    """The backward kernels (kernels/backward.cuh) as planned; past their head dims, the blocked backward (the
    numpy backend's, on these NumPy arrays)."""
    plans = None if problem.has_mods else tiling.backward_plans(problem.shape, DEVICE, block)
    if plans is None:
        blocked.run_backward(problem, dout, out, lse, grads)
        return
    compile_together(plans)
    launch.run_backward(problem, plans, dout, out, lse, grads, get_kernel)


def mode() -> str:
    return os.environ.get("CUFLASH_SIMT_MODE") or "fast"


def function(plan: tiling.Plan):
    """The plan's kernel compiled for this mode (once per process), the emulator's Function."""
    compiled = _functions.get((plan.name, mode()))
    if compiled is None:
        compile_together([plan])
        compiled = _functions[(plan.name, mode())]
    return compiled


def get_kernel(plan: tiling.Plan):
    """launch.GetKernel: the plan's kernel, launched on the emulator (profile mode: the arrays its Params point
    into counted as global memory)."""
    kernel = function(plan)
    return lambda one: kernel(one.grid, one.block, one.args, shared_mem=one.shared_mem, arrays=one.arrays)


def compile_together(plans) -> None:
    """Compile the plans' kernels not compiled yet in this mode, those of one source in one module: one g++ run
    (the emulator's runtime parsed once) for the backward's two kernels."""
    from .. import simt

    todo: Dict[str, Set[str]] = {}
    for plan in plans:
        if (plan.name, mode()) not in _functions:
            todo.setdefault(plan.source, set()).add(plan.name)
    for source, names in todo.items():
        module = simt.RawModule(code=kernels.source(source), options=OPTIONS, name_expressions=sorted(names),
                                max_dynamic_shared=DEVICE.smem_per_block, filename=source)
        for name in names:
            function = module.get_function(name)
            function.max_dynamic_shared_size_bytes = DEVICE.smem_per_block
            _functions[(name, mode())] = function
