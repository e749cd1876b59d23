"""Shared helpers of the emulator's tests: kernel sources and compiled modules (cached per process)."""

import functools
from pathlib import Path

from cuflash import simt

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "tests" / "simt_kernels"
HEADERS = ROOT / "cuflash" / "kernels"


def source(name: str, with_ptx: bool = False) -> str:
    """One source string, as the project builds them: common.cuh (+ ptx.cuh) + the test kernels."""
    parts = [HEADERS / "common.cuh"] + ([HEADERS / "ptx.cuh"] if with_ptx else []) + [KERNELS / name]
    return "".join(p.read_text() + "\n" for p in parts)


@functools.lru_cache(maxsize=None)
def module(name: str, names: tuple = (), with_ptx: bool = False, mode: str = "fast", **kw) -> simt.RawModule:
    return simt.RawModule(code=source(name, with_ptx), name_expressions=names, mode=mode, **kw)
