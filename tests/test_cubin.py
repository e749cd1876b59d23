"""SASS of the tensor-core kernel: NVRTC compiles each configuration the dispatcher chooses (per head dim, on an
A100 for sm_80 and an H100/H200 for sm_90) without a GPU, and cuobjdump reads the cubin. Each kernel must use the
tensor cores (HMMA), ldmatrix (LDSM) and cp.async (LDGSTS), and must not touch local memory (LDL/STL: spills or
register arrays indexed at run time). The shared-memory model is checked against the kernel's own layout, and a
table of registers and shared memory per configuration is printed (pytest -s shows it).

Needs NVRTC (nvidia-cuda-nvrtc-cu12), cuobjdump and nvdisasm (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm); skips
when they are missing."""

from __future__ import annotations

import functools
import glob
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor

import ml_dtypes
import numpy as np
import pytest

from cuflash import DeviceLimits, kernels, tiling
from cuflash.kernels import backward_mma, forward_mma
from cuflash.family import Shape

F16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
# Every head-dim bucket's tile, each at its largest D (d = 96 takes d = 128's tile with fewer registers).
HEAD_DIMS = (32, 64, 128, 160, 192, 224, 256)
GPUS = {"sm_80": DeviceLimits.known("A100"), "sm_90": DeviceLimits.known("H200")}


def cuobjdump():
    """The cuobjdump executable: on PATH, or from the nvidia-cuda-cuobjdump wheel; None unless nvdisasm (which
    cuobjdump 13 runs for -sass) sits beside it or on PATH."""
    candidates = [shutil.which("cuobjdump")]
    try:
        import nvidia
        candidates += [path for root in nvidia.__path__
                       for path in sorted(glob.glob(os.path.join(root, "*", "bin", "cuobjdump")))]
    except ImportError:
        pass
    for path in filter(None, candidates):
        beside = os.path.join(os.path.dirname(path), "nvdisasm")
        if os.access(path, os.X_OK) and (os.access(beside, os.X_OK) or shutil.which("nvdisasm")):
            return path
    return None


def nvrtc_unavailable():
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception as exc:  # no CuPy, or no NVRTC library
        return f"NVRTC is not available: {exc}"
    return None


pytestmark = [
    pytest.mark.skipif(nvrtc_unavailable() is not None, reason=str(nvrtc_unavailable())),
    pytest.mark.skipif(cuobjdump() is None, reason="cuobjdump or nvdisasm is missing: "
                       "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"),
]


def chosen(arch):
    """(workload, config, split) the dispatcher picks per head dim and dtype on the arch's GPU: every tile for
    float16, one for bfloat16 (the same code but for the mma's type and its conversions), float32 in three TF32
    passes and in one, float64, and two with split keys (float partial results written from the fragments)."""
    device = GPUS[arch]
    pairs = [Shape(F16, d, d) for d in HEAD_DIMS] + [Shape(BF16, 128, 128)] + \
        [Shape(F32, d, d) for d in (64, 128, 192)] + \
        [Shape(F32, d, d, precision="tf32") for d in (64, 256)] + [Shape(F64, d, d) for d in (32, 64, 160)]
    pairs = [w for w in pairs if tiling.choose(w, device).variant == "mma"]  # A100's float64 at 160: CUDA cores
    return [(w, tiling.choose(w, device), False) for w in pairs] + \
        [(w, tiling.choose(w, device), True) for w in (Shape(F16, 64, 64), Shape(F16, 128, 128))]


@functools.lru_cache(maxsize=None)
def compiled():
    """Both archs' forward and backward programs, compiled two at a time (NVRTC is most of this file's time)."""
    jobs = [(kind, arch) for kind in ("forward", "backward") for arch in sorted(GPUS)]
    with ProcessPoolExecutor(max_workers=2) as pool:
        return dict(zip(jobs, pool.map(compile_job, jobs)))


def compile_job(job):
    kind, arch = job
    return compile_forward(arch) if kind == "forward" else compile_backward(arch)


def build(arch):
    return compiled()[("forward", arch)]


def build_backward(arch):
    return compiled()[("backward", arch)]


def compile_forward(arch):
    """{name expression: (SASS text, ptxas usage)} for every chosen configuration, from one NVRTC program."""
    from cuflash import nvrtc

    names = sorted({tiling.family_of(c).name_expression(w, c, split) for w, c, split in chosen(arch)})
    cubin, log, lowered = nvrtc.compile_program(kernels.source(forward_mma.FORWARD.source), names, arch)
    usage = nvrtc.parse_ptxas(log)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernels.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([cuobjdump(), "-sass", path], capture_output=True, text=True, check=True).stdout
        resources = subprocess.run([cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True,
                                   check=True).stdout
    functions = split_functions(sass)
    return {name: (functions[lowered[name]], usage[lowered[name]], resources) for name in names}


def split_functions(sass: str):
    """SASS text per mangled function name."""
    parts = re.split(r"^\s*Function : (\S+)\s*$", sass, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def opcodes(text: str):
    return set(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", text))


# What each dtype's kernel must use: tensor cores (HMMA; DMMA for float64), ldmatrix where fragments are 16-bit
# or 32-bit matrices (float64's are plain 8-byte loads), cp.async.
EXPECTED = {"float16": ("HMMA", "LDSM", "LDGSTS"), "bfloat16": ("HMMA", "LDSM", "LDGSTS"),
            "float32": ("HMMA", "LDSM", "LDGSTS"), "float64": ("DMMA", "LDGSTS")}


@pytest.mark.parametrize("arch", sorted(GPUS))
def test_sass_uses_tensor_cores_ldmatrix_and_cp_async_without_local_memory(arch):
    built = build(arch)
    rows = []
    for workload, config, split in chosen(arch):
        name = tiling.family_of(config).name_expression(workload, config, split)
        sass, usage, _ = built[name]
        ops = opcodes(sass)
        assert config.variant == "mma", (workload, config)
        missing = set(EXPECTED[workload.dtype.name]) - ops
        assert not missing, f"{name} on {arch} lacks {sorted(missing)}"
        if workload.dtype == F32:  # the tensor cores take TF32 operands, rounded by cvt.rna.tf32.f32
            assert "HMMA.1688.F32.TF32" in sass, f"{name} on {arch}: no TF32 HMMA"
        local = sorted(op for op in ops if op in ("LDL", "STL"))
        assert not local, f"{name} on {arch} uses local memory ({local}): spills or run-time indexed registers"
        assert usage.spill_stores == usage.spill_loads == 0 and usage.stack == 0, usage
        smem = forward_mma.FORWARD.shared_memory_bytes(workload, config)
        assert smem <= GPUS[arch].smem_per_block
        rows.append(f"{arch}  {np.dtype(workload.dtype).name:8} d={workload.d:<3}  {str(config):38} "
                    f"{'split' if split else '':5} {usage.registers:3} registers  {smem / 1024:6.1f} KiB shared")
    print("\n" + "\n".join(rows))


@pytest.mark.parametrize("arch", ["sm_80"])
def test_shared_memory_model_matches_the_kernel(arch):
    """The tensor-core forward's shared_memory_bytes equals MmaShared<...>::bytes (a static_assert per layout)."""
    from cuflash import nvrtc

    layouts = {}
    for ctype, dtype in (("__half", F16), ("__nv_bfloat16", BF16), ("float", F32), ("double", F64)):
        for (d, e) in ((32, 32), (64, 59), (128, 128), (256, 256), (100, 200)):
            for config in forward_mma.CANDIDATES + (tiling.BlockConfig.mma(64, 64, 4, stages=3),):
                w = Shape(dtype, d, e)
                args = (f"{ctype}, {config.Br}, {config.Bc}, {forward_mma.bucket(d)}, {forward_mma.bucket(e)}, "
                        f"{config.warps}, {config.stages}" + (", true" if dtype == F32 else ""))  # 3xTF32's Lo
                layouts[args] = forward_mma.FORWARD.shared_memory_bytes(w, config)
    nvrtc.check_shared_layout(forward_mma.FORWARD, layouts, arch)


# ----------------------------------------------------------------------------------------------------------------
# The tensor-core backward (kernels/backward_mma.cuh)


def chosen_backward(arch):
    """(workload, plan) of both backward kernels the planner picks per head dim on the arch's GPU."""
    device = GPUS[arch]
    workloads = [Shape(F16, 64, 64), Shape(F16, 128, 128), Shape(BF16, 64, 64), Shape(F16, 128, 40)] + \
        [Shape(F32, 64, 64), Shape(F32, 128, 128), Shape(F32, 64, 64, precision="tf32"), Shape(F64, 64, 64),
         Shape(F64, 128, 128)]
    return [(w, plan) for w in workloads for plan in tiling.backward_plans(w, device)
            if plan.config.variant == "mma"]


def compile_backward(arch):
    from cuflash import nvrtc

    names = sorted({plan.name for _, plan in chosen_backward(arch)})
    cubin, log, lowered = nvrtc.compile_program(kernels.source(backward_mma.DQ.source), names, arch)
    usage = nvrtc.parse_ptxas(log)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernels.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([cuobjdump(), "-sass", path], capture_output=True, text=True, check=True).stdout
    functions = split_functions(sass)
    return {name: (functions[lowered[name]], usage[lowered[name]]) for name in names}


@pytest.mark.parametrize("arch", sorted(GPUS))
def test_backward_sass_uses_tensor_cores_without_local_memory(arch):
    built = build_backward(arch)
    rows = []
    for workload, plan in chosen_backward(arch):
        sass, usage = built[plan.name]
        ops = opcodes(sass)
        assert plan.config.variant == "mma", (workload, plan.config)
        missing = ({"DMMA", "LDGSTS"} if workload.dtype == F64 else {"HMMA", "LDSM", "LDGSTS"}) - ops
        assert not missing, f"{plan.name} on {arch} lacks {sorted(missing)}"
        local = sorted(op for op in ops if op in ("LDL", "STL"))
        assert not local, f"{plan.name} on {arch} uses local memory ({local})"
        assert usage.spill_stores == usage.spill_loads == 0 and usage.stack == 0, usage
        assert plan.shared_mem <= GPUS[arch].smem_per_block
        rows.append(f"{arch}  {workload}  {plan.name:52} {usage.registers:3} registers  "
                    f"{plan.shared_mem / 1024:6.1f} KiB shared")
    print("\n" + "\n".join(rows))


def test_backward_shared_memory_model_matches_the_kernel():
    from cuflash import nvrtc

    for family in (backward_mma.DQ, backward_mma.DKDV):
        layouts = {}
        for dtype, precision in ((F16, "highest"), (BF16, "highest"), (F32, "highest"), (F32, "tf32"),
                                 (F64, "highest")):
            for d, e in ((32, 32), (64, 59), (128, 100)):
                shape = Shape(dtype, d, e, precision=precision)
                taken = [c for c in family.candidates(shape)[0] if not family.config_reasons(shape, c)]
                for config in taken[:6]:  # the configurations the kernel takes (its struct asserts their shapes)
                    args = ", ".join(map(str, family.template_args(shape, config, False)[:6]))
                    keys_own = "true" if family.kind == "dkdv" else "false"
                    low_parts = "true" if family.low_parts(shape) else "false"
                    layouts[f"{args}, {keys_own}, {config.stages}, {low_parts}"] = \
                        family.shared_memory_bytes(shape, config)
        nvrtc.check_shared_layout(family, layouts)


@pytest.mark.parametrize("arch", sorted(GPUS))
def test_backward_steady_loops_hold_the_hot_path(arch):
    """bench/sass_report.py on the backward's SASS: the swept-tile loop it counts is the steady loop, compiled
    apart from the tiles that need visibility, masks, biases or checks, so its span (every instruction in it) stays
    near the steady path (it was 40 to 80 instructions per HMMA with the cold paths inside), and each tile runs
    all of its products (three in dQ's kernel, four in dK dV's) on tensor cores and its copies through cp.async."""
    from bench import sass_report

    built = build_backward(arch)
    for workload, plan in chosen_backward(arch):
        report = sass_report.analyze(built[plan.name][0], plan)
        path, span = sass_report.classes(report.path), sass_report.classes(report.span)
        own, swept = (plan.config.Bc, plan.config.Br) if plan.family.kind == "dkdv" else \
            (plan.config.Br, plan.config.Bc)
        D, E = plan.family.buckets(workload, plan.config)
        split = plan.family.column_split(workload)  # float64's dK dV at D + E > 128: a pair of warps per 16 keys
        mt = own * split // (16 * plan.config.warps)
        # S and dP over the head dims (n8 tiles of swept columns), then dQ (or dV and dK, a share of their columns)
        # over the swept tile
        grads = (E // split, D // split) if plan.family.kind == "dkdv" else (D,)
        expected = mt * (swept // 8 * (D + E) // 16 + sum(width // 8 for width in grads) * swept // 16)
        # per m16 x n8 x k16 product: one HMMA.16816; two m16n8k8 in each TF32 pass (three passes for 3xTF32, one
        # for TF32); eight DMMA (two m8n8k4 for the m16 rows, per k4)
        item = workload.dtype.itemsize
        expected *= 8 if item == 8 else 2 * (3 if workload.precision == "highest" else 1) if item == 4 else 1
        assert path["tensor"] == expected, (plan.name, path["tensor"], expected)
        assert path["tensor"] == span["tensor"] > 0, plan.name
        assert path["local"] == 0 and path["cp_async"] > 0, plan.name
        path_total, span_total = sum(report.path.values()), sum(report.span.values())
        assert span_total <= 1.5 * path_total, (plan.name, path_total, span_total)
        assert span_total <= 12 * span["tensor"], (plan.name, span_total, span["tensor"])
