"""CUDA C++ sources of the kernels, assembled into one string.

CuPy's disk cache hashes the source string and the options, not files reached through -I, so every local header
(`#include "x.cuh"` of a file in this directory) is pasted in textually, each once: an edited header can never
run stale. Other includes (`<cuda_fp16.h>`, the emulator's "cuflash_simt.h") stay includes.

The string carries #line directives, so that whatever reads it (NVRTC's errors, g++'s, the emulator's messages,
AddressSanitizer's and ThreadSanitizer's reports) names the true file, cuflash/kernels/NAME, and line.
"""

from __future__ import annotations

import functools
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def read(name: str) -> str:
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()


def path_of(name: str) -> str:
    """How the assembled source names a kernel file: its path in the project."""
    return f"cuflash/kernels/{name}"


def _inline(name: str, seen: set, mods: str) -> list:
    if name in seen:  # #pragma once, textually
        return []
    seen.add(name)
    lines = [f'#line 1 "{path_of(name)}"']
    for number, line in enumerate(read(name).splitlines(), start=1):
        match = LOCAL_INCLUDE.match(line)
        if match and os.path.isfile(os.path.join(HERE, match.group(1))):
            lines.extend(_inline(match.group(1), seen, mods))
            lines.append(f'#line {number + 1} "{path_of(name)}"')  # back in this file, after the include
        else:
            lines.append("" if line.strip() == "#pragma once" else line)
    if name == MODS and mods:  # a kernel's generated mods, once what they call is declared
        lines += ['#line 1 "generated mods (cuflash/kernels/mods.py)"'] + mods.splitlines()
    return lines


MODS = "mods.cuh"


@functools.lru_cache(maxsize=256)
def source(entry: str = "forward.cuh", mods: str = "", paged: bool = False, dropout: bool = False) -> str:
    """The one source string of `entry` with its local headers resolved; mods: the CUDA of a kernel's mods
    (kernels/mods.py), placed right after mods.cuh; paged: the kernels walk the pages of paged keys and values
    (tile.cuh's kPaged); dropout: they drop probabilities (tile.cuh's kDropout)."""
    defines = ["#define CUFLASH_PAGED 1"] * paged + ["#define CUFLASH_DROPOUT 1"] * dropout
    return "\n".join(defines + _inline(entry, set(), mods)) + "\n"
