"""Independent pieces of NumPy work on worker threads, each BLAS call on one thread.

NumPy's matmul and ufuncs release the GIL, so pieces of work that write disjoint outputs run side by side on
threads. OpenBLAS would otherwise start its own threads inside every call, and two layers of threads on the same
cores slow each other down: while pieces run here, OpenBLAS is held to one thread (a process-wide setting; the
first of overlapping callers saves it, the last restores it). Where OpenBLAS is not found (another BLAS, or a
platform without /proc/self/maps) everything runs on the calling thread, in the same order.

Results never depend on the number of threads: each piece runs its own work in a fixed order, pieces share no
output, and OpenBLAS is held to one thread for two or more pieces even when they all run on the calling thread
(its threaded products can differ from its one-thread products in the last bit), so the bits are those of a run
on one thread.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, List, Optional, Sequence, TypeVar

T = TypeVar("T")

ENVIRONMENT = "CUFLASH_NUM_THREADS"  # how many worker threads; 1 runs everything on the calling thread
# The entry points of OpenBLAS's thread count, under the names its builds export (NumPy's wheels carry a
# scipy-openblas build whose symbols have a prefix and a 64-bit-integer suffix).
_SETTERS = ("openblas_set_num_threads", "openblas_set_num_threads64_", "scipy_openblas_set_num_threads64_",
            "scipy_openblas_set_num_threads")
_GETTERS = ("openblas_get_num_threads", "openblas_get_num_threads64_", "scipy_openblas_get_num_threads64_",
            "scipy_openblas_get_num_threads")


class _Blas:
    """OpenBLAS's thread count, found once among the libraries loaded into this process."""

    def __init__(self) -> None:
        self.get: Optional[Callable[[], int]] = None
        self.set: Optional[Callable[[int], None]] = None
        self.lock = threading.Lock()
        self.holders = 0
        self.saved = 1
        for path in _loaded_libraries("openblas"):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            getter = next((getattr(lib, name) for name in _GETTERS if hasattr(lib, name)), None)
            setter = next((getattr(lib, name) for name in _SETTERS if hasattr(lib, name)), None)
            if getter is not None and setter is not None:
                getter.restype, getter.argtypes = ctypes.c_int, []
                setter.restype, setter.argtypes = None, [ctypes.c_int]
                self.get, self.set = getter, setter
                return

    def hold_one(self) -> None:
        assert self.get is not None and self.set is not None
        with self.lock:
            if self.holders == 0:
                self.saved = int(self.get())
                self.set(1)
            self.holders += 1

    def release(self) -> None:
        assert self.set is not None
        with self.lock:
            self.holders -= 1
            if self.holders == 0:
                self.set(self.saved)


def _loaded_libraries(word: str) -> List[str]:
    """Paths of the shared libraries loaded into this process whose file name holds `word` (Linux only)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if word in os.path.basename(p).lower())


_blas: Optional[_Blas] = None
_blas_lock = threading.Lock()


def blas() -> _Blas:
    global _blas
    with _blas_lock:
        if _blas is None:
            _blas = _Blas()
        return _blas


def count() -> int:
    """Worker threads to use: CUFLASH_NUM_THREADS if set, else the cores this process may run on; 1 where BLAS's
    own thread count cannot be held to one (threads would then multiply with BLAS's)."""
    told = os.environ.get(ENVIRONMENT, "").strip()
    if told:
        return max(1, int(told))
    if blas().set is None:
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def run_all(work: Callable[[T], None], pieces: Iterable[T], threads: Optional[int] = None) -> None:
    """work(piece) for every piece, on up to `threads` worker threads (default count()), each BLAS call on one
    thread whenever there are two or more pieces (a single piece keeps BLAS's own threads). The pieces must write
    disjoint outputs. The first exception raised by a piece is raised here, after every piece has finished."""
    pieces = list(pieces)
    threads = min(count() if threads is None else threads, len(pieces))
    control = blas()
    if len(pieces) <= 1 or control.set is None:
        for piece in pieces:
            work(piece)
        return
    control.hold_one()
    try:
        if threads <= 1:
            for piece in pieces:
                work(piece)
            return
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cuflash") as pool:
            futures = [pool.submit(work, piece) for piece in pieces]
        for future in futures:
            future.result()
    finally:
        control.release()


def consecutive_groups(items: Sequence[T], key: Callable[[T], object]) -> List[List[T]]:
    """items split into runs of consecutive items with equal keys (compared with ==: keys need not hash)."""
    groups: List[List[T]] = []
    for item in items:
        if groups and key(groups[-1][0]) == key(item):
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups
