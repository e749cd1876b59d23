"""The cupy backend: the CUDA kernels on CuPy arrays, compiled at run time by cupy.RawModule (NVRTC).

Planning and launching are shared with the simt backend (cuflash.tiling, cuflash.launch). Each instantiation is
compiled once per process and device from its family's assembled source string (CuPy's disk cache keys on it), with
-I for cuda_fp16.h/cuda_bf16.h (CuPy ships neither; the nvidia-cuda-runtime wheel does). After compiling, the
kernel's attributes are checked: a spill to local memory in a configuration the heuristic chooses is a bug.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict

from .. import blocked, launch, nvrtc, tiling
from ..devices import DeviceLimits

ARRAYS = "cupy"

_functions: Dict[tuple, Any] = {}  # (device id, options, name expression) -> cupy function
_limits: Dict[int, DeviceLimits] = {}  # device id -> DeviceLimits


def unavailable():
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install cuflash[cuda12] or cuflash[cuda13])"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "no CUDA device is visible"
    except Exception as exc:  # no driver, no device
        return f"CUDA is not usable here ({exc})"
    if not nvrtc.include_dirs():
        return ("cuda_fp16.h was not found: pip install nvidia-cuda-runtime-cu12 (CUDA 12) or nvidia-cuda-runtime "
                "(CUDA 13), or set CUDA_PATH to a CUDA toolkit")
    return None


def device_limits(device_id: int) -> DeviceLimits:
    limits = _limits.get(device_id)
    if limits is None:
        limits = _limits[device_id] = DeviceLimits.of(device_id)
    return limits


def run(problem, out, lse, block=None):
    device = out.device
    check_one_device({"q": problem.q, "k": problem.k, "v": problem.v, "mask": problem.mask, "bias": problem.bias,
                      "out": out, "lse": lse})
    with device:
        patterns, why_not = launch.kernel_patterns(problem, forward=True)
        if why_not is not None:  # mods the kernels cannot take: the blocked algorithm on CuPy's matmul
            blocked.run(problem, out, lse)
            return
        limits = device_limits(device.id)
        plan = tiling.plan(problem.shape, limits, block).with_mods(patterns and patterns.mods)
        launch.run(problem, out, lse, plan, kernels_for(device.id, limits, chosen=block is None), patterns)


def run_backward(problem, dout, out, lse, grads, block=None):
    """The backward kernels (kernels/backward.cuh) as planned; past their head dims or shared memory, the blocked
    backward (the numpy backend's, run on the CuPy arrays with CuPy's matmul; memory bounded, no atomics)."""
    device = grads[0].device
    check_one_device({"q": problem.q, "k": problem.k, "v": problem.v, "mask": problem.mask, "bias": problem.bias,
                      "dout": dout, "out": out, "lse": lse})
    with device:
        limits = device_limits(device.id)
        patterns, why_not = launch.kernel_patterns(problem, forward=False)
        plans = None if why_not else tiling.backward_plans(problem.shape, limits, block)
        if plans is None:
            blocked.run_backward(problem, dout, out, lse, grads)
            return
        plans = tuple(plan.with_mods(patterns and patterns.mods) for plan in plans)
        compile_together(device.id, plans, limits, check_spills=block is None)
        launch.run_backward(problem, plans, dout, out, lse, grads,
                            kernels_for(device.id, limits, chosen=block is None), patterns)


def check_one_device(operands) -> None:
    """Every pointer must be on the device the kernel runs on (else an illegal address, or a peer access)."""
    where = {name: x.device.id for name, x in operands.items() if x is not None}
    if len(set(where.values())) > 1:
        listed = ", ".join(f"{name} on {dev}" for name, dev in where.items())
        raise ValueError(f"attention: operands are on different devices ({listed}); move them to one device "
                         f"with cupy.asarray inside `with cupy.cuda.Device(i)`")


def kernels_for(device_id: int, limits, chosen: bool) -> launch.GetKernel:
    """get_kernel for launch.run: a plan's compiled kernel on this device (spills checked where the heuristic
    chose the configuration), launched by CuPy."""
    def get_kernel(plan):
        function = kernel(device_id, plan, limits, check_spills=chosen)
        return lambda one: function(one.grid, one.block, one.args, shared_mem=one.shared_mem)
    return get_kernel


def kernel(device_id: int, plan: tiling.Plan, limits, check_spills=True):
    key = (device_id, tuple(nvrtc.options()), plan.kernel)
    function = _functions.get(key)
    if function is None:
        compile_together(device_id, [plan], limits, check_spills)
        function = _functions[key]
    shared_mem = plan.shared_mem
    if shared_mem > limits.smem_default and function.max_dynamic_shared_size_bytes < shared_mem:
        function.max_dynamic_shared_size_bytes = shared_mem  # the opt-in above 48 KiB
    return function


def compile_together(device_id: int, plans, limits, check_spills=True) -> None:
    """Compile the plans' kernels not compiled yet on this device, those of one source in one module: one NVRTC
    run (the source parsed once) for the backward's two kernels, as the simt backend builds them."""
    import cupy

    options = tuple(nvrtc.options())  # no -arch: CuPy appends the current device's, and NVRTC refuses a second
    todo: Dict[str, Dict[str, tiling.Plan]] = {}  # code -> name -> plan
    for plan in plans:
        if (device_id, options, plan.kernel) not in _functions:
            todo.setdefault(plan.code, {})[plan.name] = plan
    for code, named in todo.items():
        module = cupy.RawModule(code=code, options=options, name_expressions=sorted(named))
        for name, plan in named.items():
            function = module.get_function(name)
            local = function.local_size_bytes
            if local and check_spills:
                warnings.warn(f"cuflash: {name} uses {local} bytes of local memory per thread on {limits.name} "
                              f"({function.num_regs} registers): a spill in a configuration the heuristic chose; "
                              f"please report it", RuntimeWarning, stacklevel=4)
            _functions[(device_id, options, plan.kernel)] = function
