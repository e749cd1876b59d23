"""RawModule and Function with the shape of CuPy's, over a g++-built library called through ctypes."""

from __future__ import annotations

import ctypes
import os
import threading
from collections import OrderedDict

import numpy as np

from ..devices import DeviceLimits
from . import _build, _profile, _source
from ._build import CompileError

# Bytes of dynamic shared memory a block may opt into on an H100/H200 (227 KiB): the table of known GPUs' figure.
H100_SHARED = DeviceLimits.known("H100").smem_per_block
DEFAULT_DYNAMIC_SHARED = 49152  # what a kernel may use before opting in, as on every GPU since Volta
DEFAULT_STACK = 256 * 1024
_ORDERS = {"forward": 0, "reverse": 1}

MEMCHECK_HINT = ("run Python with AddressSanitizer preloaded: "
                 "LD_PRELOAD=$(g++ -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 python ...")
RACE_HINT = ("run Python with ThreadSanitizer preloaded: LD_PRELOAD=$(g++ -print-file-name=libtsan.so) "
             "TSAN_OPTIONS='halt_on_error=1 exitcode=66' python ... (the Python executable itself, not a shell "
             "wrapper such as a pyenv shim); cuflash.simt.sanitizer_env('race') gives that environment")
# What each sanitizer mode preloads, the options it runs with, and what to say when it is missing.
_SANITIZERS = {
    "memcheck": ("libasan", "ASAN_OPTIONS", "detect_leaks=0", "AddressSanitizer", MEMCHECK_HINT),
    # A race report ends the process at once with exit status 66: it cannot pass unnoticed.
    "race": ("libtsan", "TSAN_OPTIONS", "halt_on_error=1 exitcode=66", "ThreadSanitizer", RACE_HINT),
}


class LaunchError(RuntimeError):
    """A launch the emulator refused or stopped: a bad configuration, a barrier some thread never reaches,
    a warp collective missing lanes, a deadlock, __trap() or a failed assert. The message names the kernel,
    the block and the threads."""


def available() -> bool:
    """Whether the emulator can build kernels here (it needs g++ or $CXX, on Linux)."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    if os.name != "posix":
        return "the SIMT emulator runs on Linux"
    if _build.compiler() is None:
        return "the SIMT emulator needs a C++17 compiler: install g++ or set $CXX"
    return None


def check(code: str, filename: str = "kernel.cu") -> None:
    """Compile kernel source as a module would, without building one (static_asserts only). Unlike NVRTC, g++
    has offsetof, so struct layouts the launch code declares are checked here."""
    body, _ = _source.rewrite(code, filename)
    _build.check_syntax(f'#include "cuflash_simt.h"\n#line 1 "{filename}"\n{body}\n', filename)


def _runtime_loaded(name: str) -> bool:
    try:
        with open("/proc/self/maps") as f:
            return name in f.read()
    except OSError:
        return name in os.environ.get("LD_PRELOAD", "")


def asan_loaded() -> bool:
    """Whether AddressSanitizer's runtime is in this process (it must be preloaded for memcheck)."""
    return _runtime_loaded("libasan")


def tsan_loaded() -> bool:
    """Whether ThreadSanitizer's runtime is in this process (it must be preloaded for race mode)."""
    return _runtime_loaded("libtsan")


def _runtime_path(name: str) -> str | None:
    import subprocess

    compiler = _build.compiler()
    if compiler is None:
        return None
    try:
        path = subprocess.run([compiler, f"-print-file-name={name}.so"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


def libasan_path() -> str | None:
    """The compiler's AddressSanitizer runtime, or None when it has none."""
    return _runtime_path("libasan")


def libtsan_path() -> str | None:
    """The compiler's ThreadSanitizer runtime, or None when it has none."""
    return _runtime_path("libtsan")


def sanitizer_env(sanitizer="memcheck", base=None, mode=...) -> dict:
    """An environment for a child Python that runs kernels under the sanitizer of mode `sanitizer` ("memcheck":
    AddressSanitizer, "race": ThreadSanitizer): base (default os.environ) with its runtime preloaded and its
    options set, and CUFLASH_SIMT_MODE set to `mode` (default: `sanitizer`; None removes it). Start the child
    with sys.executable: a shell wrapper around Python may not survive the preload. RuntimeError when the
    compiler has no such runtime."""
    if sanitizer not in _SANITIZERS:
        raise ValueError(f"sanitizer must be one of {tuple(_SANITIZERS)}, not {sanitizer!r}")
    lib, var, options, what, _ = _SANITIZERS[sanitizer]
    path = _runtime_path(lib)
    if path is None:
        raise RuntimeError(f"the C++ compiler has no {what} runtime ({lib}.so): {sanitizer} mode cannot run")
    env = dict(os.environ if base is None else base, LD_PRELOAD=path)
    env[var] = options
    mode = sanitizer if mode is ... else mode
    if mode is None:
        env.pop("CUFLASH_SIMT_MODE", None)
    else:
        env["CUFLASH_SIMT_MODE"] = mode
    return env


def memcheck_env(base=None, mode="memcheck") -> dict:
    """sanitizer_env("memcheck", base, mode): a child Python with AddressSanitizer preloaded."""
    return sanitizer_env("memcheck", base, mode)


def _resolve_mode(mode):
    mode = mode or os.environ.get("CUFLASH_SIMT_MODE") or "fast"
    if mode not in _build.MODES:
        raise ValueError(f"mode must be one of {_build.MODES}, not {mode!r}")
    if mode in _SANITIZERS:
        lib, _, _, what, hint = _SANITIZERS[mode]
        if not _runtime_loaded(lib):
            raise RuntimeError(f"{mode} mode needs {what} in the process; {hint}")
    return mode


def _resolve_schedule(seed):
    """'forward' (default), 'reverse', or an int seed for a random order; $CUFLASH_SIMT_SEED when None."""
    if seed is None:
        seed = os.environ.get("CUFLASH_SIMT_SEED") or "forward"
        if seed.lstrip("-").isdigit():
            seed = int(seed)
    if isinstance(seed, str):
        if seed not in _ORDERS:
            raise ValueError(f"seed must be an int, 'forward' or 'reverse', not {seed!r}")
        return _ORDERS[seed], 0
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return 2, int(seed) & 0xFFFFFFFFFFFFFFFF
    raise TypeError(f"seed must be an int, 'forward' or 'reverse', not {seed!r}")


_libs: dict[str, ctypes.CDLL] = {}
_libs_lock = threading.Lock()
KEEP_STACKS = 8  # modules whose idle fiber stacks stay mapped between launches (the most recently launched)
_launched: "OrderedDict[str, ctypes.CDLL]" = OrderedDict()


def _keep_stacks_of(path: str, lib: ctypes.CDLL) -> None:
    """Mark lib as just launched; unmap the idle fiber stacks of modules launched longer ago than the last
    KEEP_STACKS, so that a process loading hundreds of modules keeps a bounded number of memory mappings."""
    with _libs_lock:
        _launched[path] = lib
        _launched.move_to_end(path)
        stale = [_launched.popitem(last=False)[1] for _ in range(len(_launched) - KEEP_STACKS)]
    for old in stale:
        old.cuflash_simt_unmap_idle_stacks()


def _load(path) -> ctypes.CDLL:
    with _libs_lock:
        lib = _libs.get(str(path))
        if lib is None:
            lib = ctypes.CDLL(str(path))
            lib.cuflash_simt_count.restype = ctypes.c_int
            lib.cuflash_simt_name.restype = ctypes.c_char_p
            lib.cuflash_simt_name.argtypes = [ctypes.c_int]
            lib.cuflash_simt_signature.restype = ctypes.c_char_p
            lib.cuflash_simt_signature.argtypes = [ctypes.c_int]
            lib.cuflash_simt_unmap_idle_stacks.restype = None
            lib.cuflash_simt_launch.restype = ctypes.c_int
            lib.cuflash_simt_launch.argtypes = [
                ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong,
                ctypes.c_ulonglong, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int, ctypes.c_ulonglong,
                ctypes.c_char_p, ctypes.c_ulonglong]
            _libs[str(path)] = lib
        return lib


class RawModule:
    """The emulator's twin of ``cupy.RawModule``: the same CUDA C++ source, options and name expressions,
    compiled by g++ for the CPU.

    Beyond CuPy's arguments: ``mode`` ("fast", "memcheck" with AddressSanitizer, "race" with ThreadSanitizer or
    "profile", which counts each launch's memory requests into ``Function.last_profile``; default
    $CUFLASH_SIMT_MODE or "fast"), ``seed`` (the schedule: "forward", "reverse" or an int for a random
    order; default $CUFLASH_SIMT_SEED or "forward"), ``workers`` (OS threads running blocks; default
    $CUFLASH_SIMT_WORKERS or the CPU count), ``max_dynamic_shared`` (the emulated device's per-block limit),
    ``stack_size`` (bytes per CUDA thread) and ``filename`` (the name messages give the source)."""

    def __init__(self, *, code=None, path=None, options=(), name_expressions=None, mode=None, seed=None,
                 workers=None, max_dynamic_shared=H100_SHARED, stack_size=DEFAULT_STACK, filename=None,
                 backend="nvrtc", translate_cucomplex=False, enable_cooperative_groups=False, jitify=False):
        if (code is None) == (path is None):
            raise TypeError("give exactly one of code= and path=")
        if path is not None:
            with open(path) as f:
                code = f.read()
            filename = filename or os.path.basename(path)
        self.code = code
        self.options = tuple(options)
        self.name_expressions = tuple(name_expressions or ())
        self.mode = _resolve_mode(mode)
        self.seed = seed
        self.workers = workers
        self.max_dynamic_shared = int(max_dynamic_shared)
        self.stack_size = int(stack_size)
        self.filename = filename or "kernel.cu"
        try:
            _, externc = _source.rewrite(code, self.filename)
        except _source.SourceError as e:
            raise CompileError(str(e)) from None
        self._kernels = list(self.name_expressions) + [k for k in externc if k not in self.name_expressions]
        if not self._kernels:
            raise ValueError("no kernels: pass name_expressions, or define extern \"C\" __global__ functions")
        tu = _source.translation_unit(code, self._kernels, self.filename)
        self.library_path = _build.build(tu, self.mode, self.options, self.filename)
        self._lib = _load(self.library_path)
        self._functions: dict[str, Function] = {}

    def compile(self, log_stream=None):
        """Already compiled at construction (CuPy compiles lazily); kept for the same interface."""

    def get_function(self, name: str) -> "Function":
        fn = self._functions.get(name)
        if fn is None:
            if name not in self._kernels:
                raise KeyError(f"{name!r} is not a kernel of this module; it has {self._kernels}")
            fn = Function(self, self._kernels.index(name), name)
            self._functions[name] = fn
        return fn


class Function:
    """One kernel: call it as ``fn(grid, block, args, shared_mem=0)`` like CuPy's ``Function``. Arguments are
    checked against the kernel's parameter types, more strictly than CuPy does (see ``_convert``)."""

    def __init__(self, module: RawModule, index: int, name: str):
        self.module = module
        self.name = name
        self._index = index
        sig = module._lib.cuflash_simt_signature(index).decode()
        self.signature = tuple(sig.split(",")) if sig else ()
        self.num_args = len(self.signature)
        self._max_dynamic = DEFAULT_DYNAMIC_SHARED
        # Profile mode: the counts of the last launch, and of every launch since profiles was last cleared.
        self.last_profile: _profile.Profile | None = None
        self.profiles: list[_profile.Profile] = []

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._max_dynamic

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n: int):
        n = int(n)
        if not 0 <= n <= self.module.max_dynamic_shared:
            raise ValueError(f"max_dynamic_shared_size_bytes={n} for kernel {self.name!r}: the emulated device "
                             f"allows at most {self.module.max_dynamic_shared} bytes per block")
        self._max_dynamic = n

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False,
                 seed=None, workers=None, arrays=()):
        """Launch (CuPy's arguments, and the emulator's seed and workers). arrays: in profile mode, arrays the
        kernel reaches through pointers inside a struct argument, counted as global memory like array
        arguments."""
        grid, block = _dims(grid, "grid", self.name), _dims(block, "block", self.name)
        _check_config(self.name, grid, block)
        shared_mem = int(shared_mem)
        if shared_mem > self._max_dynamic:
            raise LaunchError(
                f"kernel {self.name!r}: the launch asks for {shared_mem} bytes of dynamic shared memory, more than "
                f"the {self._max_dynamic} the function allows; set max_dynamic_shared_size_bytes first (the "
                f"emulated device allows up to {self.module.max_dynamic_shared})")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"kernel {self.name!r}: args must be a tuple, not {type(args).__name__}")
        if len(args) != self.num_args:
            raise TypeError(f"kernel {self.name!r} takes {self.num_args} arguments "
                            f"({', '.join(map(c_name, self.signature))}), {len(args)} given")
        holders = [_convert(self.name, i, code, a) for i, (code, a) in enumerate(zip(self.signature, args))]
        argv = (ctypes.c_void_p * max(1, len(holders)))(*[ctypes.addressof(h) for h in holders])
        order, seed_value = _resolve_schedule(seed if seed is not None else self.module.seed)
        nworkers = (workers or self.module.workers or int(os.environ.get("CUFLASH_SIMT_WORKERS", 0)) or
                    os.cpu_count() or 1)
        err = ctypes.create_string_buffer(8192)
        profiling = self.module.mode == "profile"
        if profiling:
            _profile.name_arrays(self.module._lib, tuple(args) + tuple(arrays))
        rc = self.module._lib.cuflash_simt_launch(
            self._index, argv, (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem,
            self.module.max_dynamic_shared, order, seed_value, nworkers, self.module.stack_size, err, len(err))
        _keep_stacks_of(str(self.module.library_path), self.module._lib)
        if rc:
            raise LaunchError(err.value.decode(errors="replace"))
        if profiling:
            self.last_profile = _profile.read(self.module._lib, str(self.module.library_path), self.name)
            self.profiles.append(self.last_profile)


def _dims(v, what, name):
    t = (v,) if isinstance(v, (int, np.integer)) else tuple(v)
    if not 1 <= len(t) <= 3 or not all(isinstance(x, (int, np.integer)) for x in t):
        raise TypeError(f"kernel {name!r}: {what} must be an int or a tuple of up to three ints, not {v!r}")
    return tuple(int(x) for x in t) + (1,) * (3 - len(t))


def _check_config(name, grid, block):
    reasons = []
    if min(grid) < 1 or min(block) < 1:
        reasons.append(f"every dimension must be at least 1 (grid {grid}, block {block})")
    if block[0] > 1024 or block[1] > 1024 or block[2] > 64:
        reasons.append(f"block {block} exceeds the per-dimension limits (1024, 1024, 64)")
    if block[0] * block[1] * block[2] > 1024:
        reasons.append(f"block {block} has {block[0] * block[1] * block[2]} threads, more than 1024")
    if grid[0] > 2**31 - 1 or grid[1] > 65535 or grid[2] > 65535:
        reasons.append(f"grid {grid} exceeds the limits (2**31 - 1, 65535, 65535)")
    if reasons:
        raise LaunchError(f"kernel {name!r}: invalid launch configuration: " + "; ".join(reasons))


# ---- argument checking -------------------------------------------------------------------------------------
_C_NAMES = {"b1": "bool", "i1": "signed char", "u1": "unsigned char", "i2": "short", "u2": "unsigned short",
            "i4": "int", "u4": "unsigned int", "i8": "long long", "u8": "unsigned long long", "f2": "__half",
            "bf2": "__nv_bfloat16", "f4": "float", "f8": "double"}
_NUMPY_NAMES = {"b1": "bool_", "i1": "int8", "u1": "uint8", "i2": "int16", "u2": "uint16", "i4": "int32",
                "u4": "uint32", "i8": "int64", "u8": "uint64", "f2": "float16", "f4": "float32", "f8": "float64"}


def c_name(code: str) -> str:
    if code == "p*":
        return "pointer"
    if code.startswith("p"):
        return c_name(code[1:]) + "*"
    if code.startswith("s"):
        return f"struct of {code[1:]} bytes"
    return _C_NAMES.get(code, code)


def dtype_code(dt: np.dtype) -> str:
    dt = np.dtype(dt)
    if dt.name == "bfloat16":
        return "bf2"
    if dt.kind == "b":
        return "b1"
    if dt.kind in "iuf":
        return f"{dt.kind}{dt.itemsize}"
    return f"s{dt.itemsize}"


def _pointee_accepts(code: str, dt: np.dtype) -> bool:
    have = dtype_code(dt)
    if code == "*" or have == code:
        return True
    if code in ("f2", "bf2"):  # 16-bit floats also travel as raw uint16 (CuPy has no bfloat16)
        return have in ("u2", "i2")
    if code[0] in "iu" and have[0] in "iu":  # signedness is the kernel's business
        return code[1:] == have[1:]
    return code == "b1" and have in ("u1", "i1")


def _convert(kernel, i, code, value):
    """A ctypes object holding argument i as the kernel's parameter type expects it, or a TypeError that says
    what was expected. Like CuPy, a Python int is a long long and a float a double; unlike CuPy, a mismatch
    is an error, not a silent misread."""
    where = f"kernel {kernel!r}, argument {i} ({c_name(code)})"
    if code.startswith("p"):
        if value is None:
            return ctypes.c_void_p(None)
        if isinstance(value, np.ndarray):
            if not _pointee_accepts(code[1:], value.dtype):
                raise TypeError(f"{where}: got an array of {value.dtype}")
            return ctypes.c_void_p(value.ctypes.data)
        kind = "a CuPy array (the emulator runs on NumPy arrays)" if hasattr(value, "__cuda_array_interface__") \
            else type(value).__name__
        raise TypeError(f"{where}: a pointer takes a NumPy array, got {kind}")
    if code.startswith("s"):
        raw = value.tobytes() if isinstance(value, (np.void, np.ndarray, np.generic)) else None
        if raw is None or len(raw) != int(code[1:]):
            raise TypeError(f"{where}: pass a NumPy scalar or structured value of exactly {code[1:]} bytes")
        return ctypes.create_string_buffer(raw, len(raw))
    if isinstance(value, np.generic):
        have = dtype_code(value.dtype)
    elif isinstance(value, bool):
        have, value = "b1", np.bool_(value)
    elif isinstance(value, int):
        have, value = "i8", np.int64(value)  # what CuPy passes for a Python int
    elif isinstance(value, float):
        have, value = "f8", np.float64(value)
    else:
        raise TypeError(f"{where}: got {type(value).__name__}")
    if have != code:
        hint = f"; pass numpy.{_NUMPY_NAMES[code]}(...)" if code in _NUMPY_NAMES else ""
        raise TypeError(f"{where}: got {c_name(have)} ({type(value).__name__}){hint}")
    raw = np.asarray(value).tobytes()
    return ctypes.create_string_buffer(raw, len(raw))
