"""Shared helpers of the emulator's tests: kernel sources, compiled modules (cached per process), and the clean
kernels that the memcheck and race passes both run."""

import functools
import re
from pathlib import Path

import numpy as np

from cuflash import simt

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "tests" / "simt_kernels"
HEADERS = ROOT / "cuflash" / "kernels"


def source(name: str, with_ptx: bool = False) -> str:
    """One source string, as the project builds them: common.cuh (+ ptx.cuh and the wrappers only the tests use,
    ptx_extra.cuh) + the test kernels. Pasted, not included, so that the emulator's build cache sees every byte."""
    ptx = [HEADERS / "ptx.cuh", KERNELS / "ptx_extra.cuh"] if with_ptx else []
    parts = [HEADERS / "common.cuh"] + ptx + [KERNELS / name]
    return "".join(p.read_text() + "\n" for p in parts)


def site(name: str, marker: str, with_ptx: bool = False) -> re.Pattern:
    """How the emulator's messages name the line of tests/simt_kernels/NAME that carries the marker comment: the
    source string has no #line directives and module() gives it no file name, so the file is RawModule's default,
    kernel.cu, and the line is the marker's line in the whole string (after common.cuh and the PTX headers)."""
    lines = [i for i, line in enumerate(source(name, with_ptx).splitlines(), 1) if marker in line]
    assert len(lines) == 1, (name, marker, lines)
    return re.compile(rf"\bkernel\.cu:{lines[0]}\b")


@functools.lru_cache(maxsize=None)
def module(name: str, names: tuple = (), with_ptx: bool = False, mode: str = "fast", **kw) -> simt.RawModule:
    return simt.RawModule(code=source(name, with_ptx), name_expressions=names, mode=mode, **kw)


def check_reductions(mode: str, schedule) -> None:
    """Block reductions through shared memory and through shuffles, clean in any mode and schedule."""
    mod = module("basics.cu", ("reduce_shared<128>",), mode=mode)
    x = np.random.default_rng(0).standard_normal(7 * 128 - 3).astype(np.float32)
    out = np.zeros(7, np.float32)
    mod.get_function("reduce_shared<128>")((7,), (128,), (x, out, np.int64(x.size), np.int32(2)), seed=schedule)
    np.testing.assert_allclose(out, np.pad(x, (0, 3)).reshape(7, 128).sum(1), rtol=1e-5, atol=1e-4)
    y = np.random.default_rng(1).standard_normal(3 * 96)
    s = np.zeros(3)
    mod.get_function("reduce_shuffle")((3,), (96,), (y, s, np.int32(y.size)), seed=schedule)
    np.testing.assert_allclose(s, y.reshape(3, 96).sum(1))


def check_ptx_kernels(mode: str) -> None:
    """An mma tile and cp.async groups through their emulated twins, clean in any mode."""
    from ptx_cases import ALL_NAMES, tile_case
    mod = module("ptx_tests.cu", ALL_NAMES, with_ptx=True, mode=mode)
    (a, b, c), want = tile_case(np.float16, True, np.random.default_rng(0))
    d = np.zeros((16, 8), np.float32)
    mod.get_function("mma_tile<__half, true>")((1,), (32,), (a, b, c, d))
    np.testing.assert_allclose(d, want, rtol=1e-5, atol=1e-5)
    if mode == "fast":  # it reads inside cp.async windows on purpose, which the sanitizer modes report
        src = np.ones((64, 4), np.float32)
        outs = [np.zeros((n, 4), np.float32) for n in (64, 128, 64)]
        mod.get_function("cp_async_order")((1,), (64,), (src, src, *outs, np.int32(8)))
        assert (outs[2][:, :2] == 1).all() and (outs[2][:, 2:] == 0).all()
    for schedule in ("forward", "reverse", 3):
        for kernel in ("window_read", "stage_reuse"):
            assert check_cp_async_window(mode, kernel, 1, schedule), (kernel, schedule)


def check_cp_async_window(mode: str, kernel: str, fixed: int, seed=None, blocks: int = 2, tiles: int = 4) -> bool:
    """Runs a kernel of cp_async_window.cu (the bug when fixed=0, its twin when 1); True when its output is right."""
    mod = module("cp_async_window.cu", (), with_ptx=True, mode=mode)
    n = tiles if kernel == "stage_reuse" else 1
    x = np.random.default_rng(7).standard_normal((blocks, n, 64, 4)).astype(np.float32)
    out = np.zeros((blocks, 64, 4), np.float32)
    extra = (np.int32(tiles),) if kernel == "stage_reuse" else ()
    mod.get_function(kernel)((blocks,), (64,), (x, out, *extra, np.int32(fixed)), seed=seed)
    want = np.roll(x, -1, axis=2).sum(1)
    return bool(np.allclose(out, want, rtol=1e-5, atol=1e-5))
