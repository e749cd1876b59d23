"""CUDA C++ sources of the kernels, assembled into one string.

CuPy's disk cache hashes the source string and the options, not files reached through -I, so every local header
(`#include "x.cuh"` of a file in this directory) is pasted in textually, each once: an edited header can never
run stale. Other includes (`<cuda_fp16.h>`, the emulator's "cuflash_simt.h") stay includes.
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


def _inline(name: str, seen: set) -> list:
    if name in seen:  # #pragma once, textually
        return []
    seen.add(name)
    lines = [f"// ---- {name}"]
    for line in read(name).splitlines():
        match = LOCAL_INCLUDE.match(line)
        if match and os.path.isfile(os.path.join(HERE, match.group(1))):
            lines.extend(_inline(match.group(1), seen))
        elif line.strip() != "#pragma once":
            lines.append(line)
    return lines


@functools.lru_cache(maxsize=None)
def source(entry: str = "forward.cuh") -> str:
    """The one source string of `entry` with its local headers resolved."""
    return "\n".join(_inline(entry, set())) + "\n"
