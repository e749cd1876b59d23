"""The assembled kernel source carries #line directives: every report (g++'s and NVRTC's errors, the emulator's
source errors and runtime messages, AddressSanitizer's reports) names the true file, cuflash/kernels/NAME, and its
line."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cuflash import kernels, simt, tiling
from cuflash.simt import _source

HERE = Path(__file__).resolve().parent
BAD_TILE = "cuflash::fwd<float, 7, 16, 16, 16, 4>"  # Br = 7: the kernel's static_assert on its tile shape


def line_of(name, text):
    """The line of cuflash/kernels/NAME that holds text (exactly one)."""
    lines = [i for i, line in enumerate(kernels.read(name).splitlines(), 1) if text in line]
    assert len(lines) == 1, (name, text, lines)
    return lines[0]


def test_every_assembled_line_is_where_its_directive_says():
    """Walk the assembled source as a preprocessor would: each line is the named file's line of that number."""
    files = {}
    for source in (kernels.source(family.source) for family in tiling.FAMILIES):
        check_directives(source, files)
    assert set(files) == {"forward_mma.cuh", "forward.cuh", "block.cuh", "tile.cuh", "common.cuh",
                          "mma_tile.cuh", "ptx.cuh", "mods.cuh"}


def check_directives(source, files):
    for pos in [m.start() for m in re.finditer(r"^", source, flags=re.M)][:-1]:
        line = source[pos:source.find("\n", pos)]
        if line.startswith("#line"):
            continue
        file, number = _source._location(source, pos, "?")
        assert file.startswith("cuflash/kernels/"), (file, line)
        name = file.rsplit("/", 1)[1]
        text = files.setdefault(name, kernels.read(name).splitlines())
        original = text[number - 1]
        assert line == ("" if original.strip() == "#pragma once" else original), (file, number)


@pytest.mark.skipif(not simt.available(), reason=str(simt.unavailable_reason()))
def test_gxx_errors_name_the_true_line():
    with pytest.raises(simt.CompileError) as error:
        simt.RawModule(code=kernels.source("forward.cuh"), name_expressions=[BAD_TILE], filename="forward.cuh")
    line = line_of("forward.cuh", "static_assert(Br % RG == 0")
    assert re.search(rf"cuflash/kernels/forward\.cuh:{line}:\d+: error: static assertion failed", str(error.value)), \
        str(error.value)[-3000:]


def test_nvrtc_errors_name_the_true_line():
    from cuflash import nvrtc
    with pytest.raises(nvrtc.CompileError) as error:
        nvrtc.compile_program(kernels.source("forward.cuh"), [BAD_TILE], "sm_80")
    line = line_of("forward.cuh", "static_assert(Br % RG == 0")
    assert f"cuflash/kernels/forward.cuh({line}): error: static assertion failed" in str(error.value), \
        str(error.value)[-3000:]


def test_emulator_source_errors_name_the_true_line():
    declaration = "extern __shared__ __align__(16) unsigned char smem[];"
    source = kernels.source("forward.cuh").replace(declaration, "extern __shared__ unsigned char smem[16];", 1)
    line = line_of("forward.cuh", declaration)
    with pytest.raises(_source.SourceError, match=rf"^cuflash/kernels/forward\.cuh:{line}: cannot read this extern"):
        _source.rewrite(source, "forward.cuh")


# Project helpers misused from a probe kernel: the emulator's message must name the line inside the helper.
MISUSE_PROBE = '''
#line 1 "misuse_probe.cu"
extern "C" __global__ void misuse_probe(const __half* g, float* out, int which) {
  if (which == 0 && threadIdx.x < 16) out[threadIdx.x] = cuflash::lanes_max<4>(1.f);  // half a warp
  if (which == 1)  // a "shared" tile in global memory
    cuflash::load_tile_async<__half, 16, 16, 24, 32>(reinterpret_cast<__half*>(out), g, 16, 1, 16, 16, true);
}
'''


@pytest.fixture(scope="module")
def misuse_probe():
    return simt.RawModule(code=kernels.source("forward_mma.cuh") + MISUSE_PROBE, filename="forward_mma.cuh")


@pytest.mark.skipif(not simt.available(), reason=str(simt.unavailable_reason()))
@pytest.mark.parametrize("which,file,text,words", [
    (0, "tile.cuh", "x = max_(x, __shfl_xor_sync(0xffffffffu, x, offset));", "lanes 0-15 wait at __shfl_xor_sync"),
    (1, "tile.cuh", "ptx::cp_async_cg16(dst + r * LD + c, from, valid * (int)sizeof(T));",
     "is not 16 bytes of this block's"),
])
def test_emulator_messages_name_the_true_file_and_line_of_a_kernel_helper(misuse_probe, which, file, text, words):
    g, out = np.zeros(16 * 16, np.float16), np.zeros(32 * 16, np.float32)
    with pytest.raises(simt.LaunchError, match=words) as error:
        misuse_probe.get_function("misuse_probe")((1,), (32,), (g, out, np.int32(which)))
    where = rf"\(cuflash/kernels/{re.escape(file)}:{line_of(file, text)}\b"
    assert re.search(where, str(error.value)), str(error.value)


@pytest.mark.skipif(not simt.available(), reason=str(simt.unavailable_reason()))
def test_asan_reports_name_the_true_line_of_a_kernel_helper():
    env = simt.memcheck_env(mode=None)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(HERE / "simt" / "lines_child.py")], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode != 0 and "AddressSanitizer: heap-buffer-overflow" in r.stderr, r.stdout + r.stderr[-4000:]
    line = line_of("tile.cuh",
                   "dst[r * LD + c] = (r < rows && c < cols) ? row_at(src, r, row_stride, walk)[c * col_stride]")
    assert re.search(rf"cuflash/kernels/tile\.cuh:{line}\b", r.stderr), r.stderr[-4000:]
