"""NVRTC compile checks without a GPU: the CUDA-core instantiations the heuristic chooses (forward and backward)
compile for sm_75 ... sm_90 with no spills and no static shared memory, and each kernel's shared-memory layout
equals the Python model (static_asserts the compiler evaluates). Needs CuPy's NVRTC binding and the CUDA fp16
headers."""

import pytest

from cuflash import nvrtc, tiling
from cuflash.kernels import backward as fma_backward, forward as fma_forward
from cuflash.family import C_TYPES, Shape
from cuflash.dtypes import FLOATS


def _nvrtc_ready():
    try:
        from cupy.cuda import nvrtc as binding
        binding.getVersion()
    except Exception as exc:
        return f"NVRTC is not available: {exc}"
    if not nvrtc.include_dirs():
        return "cuda_fp16.h not found (pip install nvidia-cuda-runtime-cu12)"
    return None


pytestmark = pytest.mark.skipif(_nvrtc_ready() is not None, reason=str(_nvrtc_ready()))


def test_shared_memory_layout_equals_the_model():
    expected = {}
    for dtype in FLOATS:
        for d, e in ((1, 1), (59, 3), (64, 64), (111, 256), (256, 128), (512, 512)):
            for config in (tiling.BlockConfig(64, 64), tiling.BlockConfig(16, 48, 8), tiling.BlockConfig(4, 16, 2),
                           tiling.BlockConfig(32, 16, 2, stages=2)):
                w = Shape(dtype, d, e)
                if d > fma_forward.MAX_BUCKET[dtype.name]:
                    continue
                ctype = C_TYPES[dtype.name]
                D, E = fma_forward.bucket(d), fma_forward.bucket(e)
                args = f"{ctype}, {config.Br}, {config.Bc}, {D}, {E}, {config.stages}"
                expected[args] = tiling.shared_memory_bytes(w, config)
    nvrtc.check_shared_layout(fma_forward.FORWARD, expected)


def test_backward_shared_memory_layout_equals_the_model():
    """Both backward kernels' layouts (BackwardShared, keys or queries as the block's own rows)."""
    for family in (fma_backward.DQ, fma_backward.DKDV):
        expected = {}
        for dtype in FLOATS:
            for d, e in ((1, 1), (59, 3), (64, 64), (111, 256)):
                for config in (tiling.BlockConfig(64, 64, 8), tiling.BlockConfig(16, 48, 8),
                               tiling.BlockConfig(32, 16, 2), tiling.BlockConfig(16, 32, 2, stages=2)):
                    args = ", ".join(map(str, family.template_args(Shape(dtype, d, e), config, False)[:5]))
                    keys_own = "true" if family.kind == "dkdv" else "false"
                    expected[f"{args}, {keys_own}, {config.stages}"] = \
                        family.shared_memory_bytes(Shape(dtype, d, e), config)
        nvrtc.check_shared_layout(family, expected)


def test_chosen_instantiations_compile_without_spills():
    """Every arch's chosen instantiations, except where an arch of the same major version chooses the very same
    ones (sm_89's L4 and sm_86's A10): those compile once, for the first (`python -m bench.compile_report` compiles
    all five)."""
    from bench import compile_report

    archs, seen = [], set()
    for arch in compile_report.ARCH_DEVICES:
        key = (arch[3], frozenset(compile_report.chosen(arch, (64, 256))))
        if key not in seen:
            seen.add(key)
            archs.append(arch)
    assert archs == ["sm_75", "sm_80", "sm_86", "sm_90"]
    rows = compile_report.report(tuple(archs), head_dims=(64, 256))
    assert {row[0] for row in rows} == set(archs)
    assert any("bwd_dq" in row[1] for row in rows) and any("bwd_dkdv" in row[1] for row in rows)
    for arch, name, regs, spill_stores, spill_loads, stack, static_smem, smem in rows:
        assert (spill_stores, spill_loads) == (0, 0), f"{name} spills on {arch}"
        assert stack == 0, f"{name} on {arch} has a {stack}-byte stack frame: local memory"
        assert static_smem == 0, f"{name} on {arch}: all shared memory is dynamic (the model's {smem} bytes)"
        assert regs <= 255
