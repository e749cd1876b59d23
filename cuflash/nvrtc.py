"""NVRTC without a GPU: header discovery for CuPy, and compiling kernels to cubins with ptxas's resource report.

NVRTC's low-level API (cupy.cuda.nvrtc) compiles for any architecture without a device; ptxas's verbose report,
passed through NVRTC's log, gives registers, spills and static shared memory per kernel. The cupy backend uses
include_dirs(); tests/test_compile.py and bench/compile_report.py use compile_report().
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from . import kernels

STD = "--std=c++17"


@functools.lru_cache(maxsize=None)
def include_dirs() -> Tuple[str, ...]:
    """Directories holding cuda_fp16.h and cuda_bf16.h, which CuPy does not ship: the CUDA runtime wheel
    (nvidia-cuda-runtime-cu12's nvidia/cuda_runtime/include, or CUDA 13's nvidia/cu13/include), else the
    toolkit CuPy found. Searched once per process: every cupy-backend call asks."""
    found = []
    try:
        import nvidia
        for root in nvidia.__path__:
            for sub in ("cuda_runtime/include", "cu13/include", "cu12/include"):
                path = os.path.join(root, sub)
                if os.path.isfile(os.path.join(path, "cuda_fp16.h")):
                    found.append(path)
    except ImportError:
        pass
    if not found:
        try:
            from cupy import _environment
            cuda_path = _environment.get_cuda_path()
        except Exception:
            cuda_path = None
        for base in filter(None, (cuda_path, os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"))):
            path = os.path.join(base, "include")
            if os.path.isfile(os.path.join(path, "cuda_fp16.h")):
                found.append(path)
                break
    return tuple(found)


def options(arch: Optional[str] = None) -> List[str]:
    # Unannotated functions (the forward's generic lambda) are device code, as in CuPy's RawModule compiles.
    opts = [STD, "--device-as-default-execution-space"] + [f"-I{path}" for path in include_dirs()]
    if arch:
        opts.append(f"-arch={arch}")
    return opts


@dataclass
class Usage:
    """ptxas's figures for one kernel."""

    name: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    static_smem: int


class CompileError(RuntimeError):
    pass


def compile_program(src: str, names: Iterable[str], arch: str, extra=()):
    """(cubin bytes, log, {name expression: lowered name}) of src compiled for arch ("sm_80")."""
    from cupy.cuda import nvrtc

    names = list(names)
    prog = nvrtc.createProgram(src, "cuflash.cu", [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, options(arch) + ["-Xptxas=-v"] + list(extra))
        except nvrtc.NVRTCError as exc:
            raise CompileError(f"{exc}\n{nvrtc.getProgramLog(prog)}") from None
        log = nvrtc.getProgramLog(prog)
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in names}
        return whole_elf(nvrtc.getCUBIN(prog)), log, lowered
    finally:
        nvrtc.destroyProgram(prog)


def whole_elf(cubin: bytes) -> bytes:
    """CuPy's getCUBIN strips a last byte as if the cubin were a NUL-terminated string (as PTX is); cuobjdump then
    refuses the file. Pad an ELF back to the end its own header gives (its tables end in zero bytes)."""
    import struct

    if len(cubin) < 64 or cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        return cubin
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return cubin + bytes(max(0, end - len(cubin)))


ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers(.*)")
SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> Dict[str, Usage]:
    """Usage per mangled kernel name from ptxas's -v lines."""
    usage, current = {}, None
    for line in log.splitlines():
        if (match := ENTRY.search(line)):
            current = Usage(match.group(1), match.group(2), 0, 0, 0, 0, 0)
            usage[current.name] = current
        elif current and (match := SPILL.search(line)):
            current.stack, current.spill_stores, current.spill_loads = map(int, match.groups())
        elif current and (match := USED.search(line)):
            current.registers = int(match.group(1))
            smem = SMEM.search(match.group(2))
            current.static_smem = int(smem.group(1)) if smem else 0
    return usage


def compile_report(names: Iterable[str], arch: str, entry: str) -> Dict[str, Usage]:
    """ptxas's usage of each instantiation (by name expression) of kernels/`entry` compiled for arch."""
    names = list(names)
    _, log, lowered = compile_program(kernels.source(entry), names, arch)
    usage = parse_ptxas(log)
    return {name: usage[lowered[name]] for name in names}


def check_asserts(entry: str, asserts: Iterable[str], arch: str = "sm_80") -> None:
    """Compile C++ static_asserts after kernels/`entry`; CompileError names the ones that fail."""
    compile_program(kernels.source(entry) + "\n".join(asserts) + "\n", [], arch)


def check_shared_layout(family, expected: Dict[str, int], arch: str = "sm_80") -> None:
    """That the family's shared-memory struct has the bytes of the Python model for each layout (its template
    arguments, "__half, 64, 64, 64, 64" -> bytes)."""
    struct = f"cuflash::{family.shared_struct}"
    check_asserts(family.source, [f'static_assert({struct}<{args}>::bytes == {nbytes}, "model: {args} -> {nbytes}");'
                                  for args, nbytes in expected.items()], arch)
