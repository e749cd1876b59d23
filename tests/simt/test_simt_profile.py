"""Profile mode: per source line, shared-memory wavefronts and bank conflicts as Nsight Compute counts them,
global sectors per request and barriers, on kernels whose counts are known by construction
(tests/simt_kernels/profile.cu)."""

import re

import numpy as np
import pytest
import simt_util

from cuflash import simt

pytestmark = pytest.mark.skipif(not simt.available(), reason=str(simt.unavailable_reason()))
SRC = "profile.cu"


def line(marker):
    return int(re.search(r":(\d+)", simt_util.site(SRC, marker, with_ptx=True).pattern).group(1))


def module():
    return simt_util.module(SRC, (), with_ptx=True, mode="profile")


def run(kernel, grid, block, args):
    fn = module().get_function(kernel)
    fn(grid, block, args)
    return fn.last_profile


def aligned(n, dtype=np.float32):
    """arange(n) at a 128-byte boundary, as cudaMalloc's are (NumPy only promises 16 bytes)."""
    raw = np.zeros(n * np.dtype(dtype).itemsize + 128, np.uint8)
    skip = -raw.ctypes.data % 128
    x = raw[skip:skip + n * np.dtype(dtype).itemsize].view(dtype)
    x[:] = np.arange(n)
    return x


def at(profile, marker, op, space):
    """The one Access of that kind on the marker's line."""
    found = [a for a in profile.accesses if (a.file, a.line, a.op, a.space) == ("kernel.cu", line(marker), op, space)]
    assert len(found) == 1, (marker, op, space, profile.accesses)
    return found[0]


@pytest.mark.parametrize("stride, wavefronts", [(1, 1), (2, 2), (32, 32), (0, 1)])
def test_shared_float_loads(stride, wavefronts):
    x = np.arange(1024, dtype=np.float32)
    out = np.zeros(32, np.float32)
    p = run("shared_stride", (1,), (32,), (x, out, np.int32(stride)))
    np.testing.assert_array_equal(out, x[np.arange(32) * stride % 1024])  # the kernel still computes
    a = at(p, "PROFILE_STRIDE", "ld", "shared")
    assert (a.requests, a.wavefronts, a.ideal, a.conflicts) == (1, wavefronts, 1, wavefronts - 1)
    fill = at(p, "PROFILE_FILL", "st", "shared")  # 32 iterations of 32 consecutive floats
    assert (fill.requests, fill.wavefronts, fill.conflicts) == (32, 32, 0)


def test_requests_are_per_warp_and_per_execution():
    x = np.arange(1024, dtype=np.float32)
    p = run("shared_stride", (3,), (96,), (x, np.zeros(96, np.float32), np.int32(1)))
    assert at(p, "PROFILE_STRIDE", "ld", "shared").requests == 3 * 3  # blocks x warps
    # Threads 0-63 store 11 times (t + 960 < 1024), 64-95 ten times: warps 0 and 1 make 11 requests, warp 2 ten.
    assert at(p, "PROFILE_FILL", "st", "shared").requests == 3 * (11 + 11 + 10)
    assert p.launches == 1 and p.kernel == "shared_stride"


@pytest.mark.parametrize("stride, wavefronts", [(1, 4), (8, 32)])
def test_shared_16_byte_loads_take_quarter_warp_phases(stride, wavefronts):
    x = np.arange(256, dtype=np.float32)
    p = run("shared_vector", (1,), (32,), (x, np.zeros(128, np.float32), np.int32(stride)))
    a = at(p, "PROFILE_VECTOR", "ld", "shared")
    assert (a.requests, a.wavefronts, a.ideal, a.conflicts) == (1, wavefronts, 4, wavefronts - 4)


@pytest.mark.parametrize("pitch, wavefronts", [(72, 4), (64, 32)])
def test_ldmatrix_padded_and_unpadded_rows(pitch, wavefronts):
    tile = np.arange(32 * 72, dtype=np.uint16)
    p = run("ldmatrix_pitch", (1,), (32,), (tile, np.zeros(128, np.uint32), np.int32(pitch)))
    a = at(p, "PROFILE_LDMATRIX", "ldsm", "shared")
    assert (a.requests, a.wavefronts, a.ideal, a.conflicts) == (1, wavefronts, 4, wavefronts - 4)


@pytest.mark.parametrize("stride, sectors", [(1, 4), (8, 32), (0, 1)])
def test_global_sectors_per_request(stride, sectors):
    x = aligned(256)
    p = run("global_stride", (2,), (32,), (x, aligned(32), np.int32(stride)))
    a = at(p, "PROFILE_GLOBAL", "ld", "global")
    assert (a.requests, a.sectors, a.bytes) == (2, 2 * sectors, 2 * 128)
    st = at(p, "PROFILE_GLOBAL", "st", "global")
    assert (st.requests, st.sectors) == (2, 2 * 4)


def test_barriers_per_block_and_warp():
    p = run("barriers", (2,), (64,), (np.zeros(64, np.float32), np.int32(5)))
    a = at(p, "PROFILE_BARRIER", "bar", "")
    assert (a.barriers, a.warps) == (2 * 5, 2 * 5 * 2)
    assert p.totals()["barrier_warps"] == 20
    assert not [x for x in p.accesses if x.space == "shared"]  # the runtime's own accesses are not counted


def test_lines_rank_hottest_first_and_profiles_add_up():
    x = np.arange(1024, dtype=np.float32)
    fn = module().get_function("shared_stride")
    fn.profiles.clear()
    for stride in (32, 1):
        fn((1,), (32,), (x, np.zeros(32, np.float32), np.int32(stride)))
    total = sum(fn.profiles[1:], fn.profiles[0])
    assert total.launches == 2
    assert at(total, "PROFILE_STRIDE", "ld", "shared").conflicts == 31
    rows = total.lines()
    assert rows[0].line == line("PROFILE_FILL") and rows[0].wavefronts == 64
    assert [r.traffic for r in rows] == sorted((r.traffic for r in rows), reverse=True)
