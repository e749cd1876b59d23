"""Profile mode's counts, read back from a launch: per source line and kind of access, the warp-wide requests,
shared-memory wavefronts (ideal and actual: their difference is the bank conflicts), global-memory sectors and
barriers, as runtime/profile.h counted them."""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
from collections import defaultdict
from dataclasses import asdict, dataclass, fields, replace
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

OPS = ("ld", "st", "atom", "ldsm", "cp.async", "bar")  # ProfKind's order
SPACES = ("shared", "global", "")  # ProfSpace's order


class _Row(ctypes.Structure):
    """ProfRow of runtime/profile.h."""
    _fields_ = [("pc", ctypes.c_ulonglong), ("file", ctypes.c_char_p), ("line", ctypes.c_int),
                ("kind", ctypes.c_int), ("space", ctypes.c_int), ("requests", ctypes.c_ulonglong),
                ("wavefronts", ctypes.c_ulonglong), ("ideal", ctypes.c_ulonglong), ("sectors", ctypes.c_ulonglong),
                ("bytes", ctypes.c_ulonglong), ("barriers", ctypes.c_ulonglong), ("warps", ctypes.c_ulonglong)]


@dataclass(frozen=True)
class Access:
    """One source line's accesses of one kind: `op` is ld, st, atom (plain accesses), ldsm, cp.async or bar
    (__syncthreads), `space` shared, global or '' (a barrier). Shared: wavefronts, and ideal the fewest
    wavefronts those requests could take. Global: 32-byte sectors and bytes the lanes asked for. Barriers: the
    times a block passed it (barriers) and the warp instructions that makes (warps)."""
    file: str
    line: int
    op: str
    space: str
    requests: int = 0
    wavefronts: int = 0
    ideal: int = 0
    sectors: int = 0
    bytes: int = 0
    barriers: int = 0
    warps: int = 0

    @property
    def conflicts(self) -> int:
        return self.wavefronts - self.ideal

    @property
    def key(self) -> Tuple[str, int, str, str]:
        return self.file, self.line, self.op, self.space

    def __add__(self, other: "Access") -> "Access":
        return replace(self, **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)
                                if f.name not in ("file", "line", "op", "space")})


@dataclass(frozen=True)
class Line:
    """One source line, all its accesses together: the table's row."""
    file: str
    line: int
    shared_requests: int = 0
    wavefronts: int = 0
    ideal: int = 0
    global_requests: int = 0
    sectors: int = 0
    barriers: int = 0

    @property
    def conflicts(self) -> int:
        return self.wavefronts - self.ideal

    @property
    def traffic(self) -> int:
        """What ranks lines hottest first: shared wavefronts, global sectors and barriers together."""
        return self.wavefronts + self.sectors + self.barriers

    def as_dict(self) -> dict:
        return {**asdict(self), "conflicts": self.conflicts}


@dataclass
class Profile:
    """The counts of one kernel's launches (launches: how many were added together)."""
    kernel: str
    accesses: List[Access]
    launches: int = 1

    def lines(self) -> List[Line]:
        """Per source line, hottest first."""
        acc: Dict[Tuple[str, int], dict] = defaultdict(lambda: defaultdict(int))
        for a in self.accesses:
            d = acc[(a.file, a.line)]
            if a.space == "shared":
                d["shared_requests"] += a.requests
                d["wavefronts"] += a.wavefronts
                d["ideal"] += a.ideal
            elif a.space == "global":
                d["global_requests"] += a.requests
                d["sectors"] += a.sectors
            d["barriers"] += a.warps
        rows = [Line(file, line, **d) for (file, line), d in acc.items()]
        return sorted(rows, key=lambda r: (-r.traffic, r.file, r.line))

    def totals(self) -> dict:
        """Sums over the kernel, also by kind: what Nsight Compute's per-kernel metrics count."""
        def total(field: str, op: Optional[str] = None, space: str = "shared") -> int:
            return sum(getattr(a, field) for a in self.accesses if a.space == space and op in (None, a.op))

        result = {key: total(key) for key in ("wavefronts", "ideal", "conflicts")}
        result["shared_requests"] = total("requests")
        for op, name in (("ld", "shared_load"), ("st", "shared_store"), ("ldsm", "ldsm"), ("cp.async", "cp_async")):
            result.update({f"{name}_requests": total("requests", op), f"{name}_wavefronts": total("wavefronts", op),
                           f"{name}_conflicts": total("conflicts", op)})
        result.update(global_requests=total("requests", space="global"), sectors=total("sectors", space="global"))
        for op, name in (("ld", "global_load"), ("st", "global_store"), ("atom", "global_atom"),
                         ("cp.async", "cp_async_global")):
            result.update({f"{name}_requests": total("requests", op, "global"),
                           f"{name}_sectors": total("sectors", op, "global")})
        result.update(barriers=total("barriers", space=""), barrier_warps=total("warps", space=""))
        return result

    def __add__(self, other: "Profile") -> "Profile":
        merged: Dict[tuple, Access] = {a.key: a for a in self.accesses}
        for a in other.accesses:
            merged[a.key] = merged[a.key] + a if a.key in merged else a
        return Profile(self.kernel, list(merged.values()), self.launches + other.launches)

    def to_dict(self) -> dict:
        return {"kernel": self.kernel, "launches": self.launches, "totals": self.totals(),
                "lines": [r.as_dict() for r in self.lines()]}


def array_ranges(args: Sequence) -> np.ndarray:
    """[lo, hi) byte ranges of the arguments that are arrays: what the kernel sees as global memory."""
    lohi = []
    for a in args:
        if isinstance(a, np.ndarray) and a.size:
            lo, hi = _byte_bounds(a)
            lohi += [lo, hi]
    return np.array(lohi or [0, 0], dtype=np.uint64)


def _byte_bounds(a: np.ndarray) -> Tuple[int, int]:
    """NumPy 2 moved byte_bounds to numpy.lib.array_utils."""
    utils = getattr(np.lib, "array_utils", None)
    return (utils.byte_bounds if utils is not None else getattr(np, "byte_bounds"))(a)


def name_arrays(lib, args: Sequence) -> None:
    lohi = array_ranges(args)
    lib.cuflash_simt_profile_arrays(lohi.ctypes.data_as(ctypes.c_void_p), len(lohi) // 2)


def read(lib, library_path: str, kernel: str) -> Profile:
    """The last launch's counts, their instructions resolved to source lines."""
    lib.cuflash_simt_profile_rows.restype = ctypes.c_int
    n = lib.cuflash_simt_profile_rows(None, 0)
    rows = (_Row * max(1, n))()
    lib.cuflash_simt_profile_rows(rows, n)
    rows = rows[:n]
    where = source_lines(library_path, tuple(sorted({r.pc for r in rows if r.pc})))
    merged: Dict[tuple, Access] = {}
    for r in rows:
        file, line = where.get(r.pc, ("??", 0)) if r.pc else ((r.file or b"").decode(), r.line)
        a = Access(file, line, OPS[r.kind], SPACES[r.space], r.requests, r.wavefronts, r.ideal, r.sectors,
                   r.bytes, r.barriers, r.warps)
        merged[a.key] = merged[a.key] + a if a.key in merged else a
    return Profile(kernel, list(merged.values()))


@functools.lru_cache(maxsize=64)
def source_lines(library_path: str, offsets: Tuple[int, ...]) -> Dict[int, Tuple[str, int]]:
    """file:line of each return address (offset in the library): the call's own line (address - 1), in the
    innermost inlined frame that is the kernel's source (a relative path: the project's #line names, or the
    module's filename), not the runtime's or the standard library's headers (absolute paths)."""
    tool = shutil.which("addr2line")
    if not offsets or tool is None:
        return {}
    out = subprocess.run([tool, "-e", library_path, "-a", "-i", *[hex(o - 1) for o in offsets]],
                         capture_output=True, text=True).stdout
    frames: Dict[int, List[Tuple[str, int]]] = {}
    current: Optional[int] = None
    for text in out.splitlines():
        if text.startswith("0x"):
            current = int(text, 16) + 1
            frames[current] = []
        elif current is not None:
            frames[current].append(_file_line(text))
    return {pc: _pick(fs) for pc, fs in frames.items()}


def _file_line(text: str) -> Tuple[str, int]:
    file, _, line = text.rpartition(":")
    line = line.split(" ")[0]
    return file, int(line) if line.isdigit() else 0


def _pick(frames: Iterable[Tuple[str, int]]) -> Tuple[str, int]:
    frames = list(frames)
    for file, line in frames:
        if file and not os.path.isabs(file) and file != "??":
            return os.path.normpath(file), line  # the debug info names it under the build directory
    return frames[0] if frames else ("??", 0)
