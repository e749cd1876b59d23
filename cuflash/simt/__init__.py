"""cuflash.simt: run the project's CUDA C++ kernels on the CPU.

g++ compiles the same source NVRTC compiles, against ``cuflash_simt.h``, which runs every CUDA thread as a fiber;
``RawModule`` has the shape of ``cupy.RawModule`` so the ``simt`` backend shares planning and launching with the
``cupy`` backend. See README.md in this directory for the conventions kernels follow and the test commands.
"""

from ._build import CompileError, cache_dir
from ._module import (DEFAULT_DYNAMIC_SHARED, H100_SHARED, KEEP_STACKS, MEMCHECK_HINT, RACE_HINT, Function,
                      LaunchError, RawModule, asan_loaded, available, check, libasan_path, libtsan_path, memcheck_env,
                      sanitizer_env, tsan_loaded, unavailable_reason)
from ._source import SourceError

__all__ = ["RawModule", "Function", "check", "LaunchError", "CompileError", "SourceError", "available",
           "unavailable_reason", "asan_loaded", "libasan_path", "memcheck_env", "tsan_loaded", "libtsan_path",
           "sanitizer_env", "cache_dir", "H100_SHARED", "DEFAULT_DYNAMIC_SHARED", "MEMCHECK_HINT", "RACE_HINT"]
