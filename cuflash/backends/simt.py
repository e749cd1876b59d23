"""The simt backend: the CUDA kernels on NumPy arrays, run on the CPU by the project's emulator (cuflash.simt).

Planning and launching are the cupy backend's (cuflash.tiling, cuflash.launch); only the module differs. The
emulated device plans as an NVIDIA H100 (227 KiB of shared memory per block) unless DEVICE is changed. The mode
(fast, memcheck, race) and schedule come from $CUFLASH_SIMT_MODE and $CUFLASH_SIMT_SEED (see cuflash/simt).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Set, Tuple

from .. import blocked, launch, tiling
from ..devices import DeviceLimits

ARRAYS = "numpy"

DEVICE = DeviceLimits.known("H100")
OPTIONS = ("--std=c++17",)

_functions: Dict[Tuple[Tuple[str, str], str], Any] = {}  # (plan.kernel, mode) -> compiled kernel, once per process


def unavailable():
    from .. import simt
    return simt.unavailable_reason()


def run(problem, out, lse, block=None):
    """The forward kernel as planned, its mods compiled in; mods the kernels cannot take run the blocked
    algorithm."""
    patterns, why_not = launch.kernel_patterns(problem, forward=True)
    if why_not is not None:
        blocked.run(problem, out, lse)
        return
    plan = tiling.plan(problem.shape, DEVICE, block).with_mods(patterns and patterns.mods)
    launch.run(problem, out, lse, plan, get_kernel, patterns)


def run_backward(problem, dout, out, lse, grads, block=None):
    """The backward kernels (kernels/backward.cuh) as planned, their mods compiled in; past their head dims, or with
    mods they cannot take, the blocked backward (the numpy backend's, on these NumPy arrays)."""
    patterns, why_not = launch.kernel_patterns(problem, forward=False)
    plans = None if why_not else tiling.backward_plans(problem.shape, DEVICE, block)
    if plans is None:
        blocked.run_backward(problem, dout, out, lse, grads)
        return
    plans = tuple(plan.with_mods(patterns and patterns.mods) for plan in plans)
    compile_together(plans)
    launch.run_backward(problem, plans, dout, out, lse, grads, get_kernel, patterns)


def mode() -> str:
    return os.environ.get("CUFLASH_SIMT_MODE") or "fast"


def function(plan: tiling.Plan):
    """The plan's kernel compiled for this mode (once per process), the emulator's Function."""
    compiled = _functions.get((plan.kernel, mode()))
    if compiled is None:
        compile_together([plan])
        compiled = _functions[(plan.kernel, mode())]
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

    todo: Dict[Tuple[str, str, str], Set[str]] = {}  # (code, file, mods' key) -> names
    for plan in plans:
        if (plan.kernel, mode()) not in _functions:
            todo.setdefault((plan.code, plan.source, plan.kernel[1]), set()).add(plan.name)
    for (code, source, key), names in todo.items():
        module = simt.RawModule(code=code, options=OPTIONS, name_expressions=sorted(names),
                                max_dynamic_shared=DEVICE.smem_per_block, filename=source)
        for name in names:
            function = module.get_function(name)
            function.max_dynamic_shared_size_bytes = DEVICE.smem_per_block
            _functions[((name, key), mode())] = function
