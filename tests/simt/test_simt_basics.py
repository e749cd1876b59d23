"""The emulator's core semantics: reductions, shuffles, votes, built-in variables, shared memory, schedules,
misuse reported as LaunchError, argument checking, compile errors and the build cache."""

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import simt_util

from cuflash import simt

pytestmark = pytest.mark.skipif(not simt.available(), reason=str(simt.unavailable_reason()))

NAMES = ("reduce_shared<128>", "reduce_shared<256>", "shuffle<float>", "shuffle<double>", "shuffle<int>",
         "shuffle<long long>")
SCHEDULES = ["forward", "reverse", 1, 2, 3]


@pytest.fixture(scope="module")
def mod():
    return simt_util.module("basics.cu", NAMES)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("grid,block,nt", [((7,), (128,), 128), ((3, 2, 2), (16, 16), 256), ((1,), (256,), 256)])
def test_shared_memory_reduction(mod, schedule, grid, block, nt):
    nblocks = int(np.prod(grid))
    x = np.random.default_rng(0).standard_normal(nblocks * nt - 5).astype(np.float32)  # a ragged tail
    out = np.full(nblocks, np.nan, np.float32)
    mod.get_function(f"reduce_shared<{nt}>")(grid, block, (x, out, np.int64(x.size), np.int32(2)), seed=schedule)
    want = np.pad(x, (0, 5)).reshape(nblocks, nt).astype(np.float64).sum(1)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("block", [32, 96, 1024])
def test_shuffle_reduction(mod, block):
    x = np.random.default_rng(1).standard_normal(5 * block - 3)
    out = np.zeros(5)
    mod.get_function("reduce_shuffle")((5,), (block,), (x, out, np.int32(x.size)), seed=7)
    np.testing.assert_allclose(out, np.pad(x, (0, 3)).reshape(5, block).sum(1), rtol=1e-12)


def shfl_reference(values, args, mode, width):
    """PTX shfl.sync per lane, following the ISA's pseudocode: only b[4:0] of the lane or delta operand counts,
    and CUDA's width gives c = ((32 - width) << 8) | (0 for up, 31 otherwise)."""
    out = np.empty_like(values)
    segmask = (32 - width) & 31
    cval = 0 if mode == 1 else 31
    for w in range(len(values) // 32):
        v, a = values[32 * w:32 * w + 32], args[32 * w:32 * w + 32]
        for lane in range(32):
            bval = int(a[lane]) & 31
            max_lane = (lane & segmask) | (cval & ~segmask)
            min_lane = lane & segmask
            if mode == 0:
                j = min_lane | (bval & ~segmask)
                ok = j <= max_lane
            elif mode == 1:
                j = lane - bval
                ok = j >= max_lane
            elif mode == 2:
                j = lane + bval
                ok = j <= max_lane
            else:
                j = lane ^ bval
                ok = j <= max_lane
            out[32 * w + lane] = v[j if ok else lane]
    return out


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("width", [32, 16, 8, 2])
def test_every_shuffle_against_numpy(mod, dtype, mode, width):
    rng = np.random.default_rng(mode * 100 + width)
    values = (rng.standard_normal(64) * 1000).astype(dtype)
    args = rng.integers(0, 32, 64).astype(np.int32)
    if mode == 3:
        args = rng.integers(0, 32, 64).astype(np.int32)  # xor masks reaching later segments keep their own value
    ctype = {"float32": "float", "float64": "double", "int32": "int", "int64": "long long"}[dtype]
    out = np.zeros_like(values)
    mod.get_function(f"shuffle<{ctype}>")((2,), (32,), (values, args, out, np.int32(mode), np.int32(width)),
                                          seed=mode)
    np.testing.assert_array_equal(out, shfl_reference(values, args, mode, width))


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("width", [32, 16, 4, 1])
def test_shuffle_operands_count_only_their_low_five_bits(mod, mode, width):
    """Lanes and deltas of 32 and more, negative ones and ones of 2^31 and more (the emulator once used the
    whole value: an up-shuffle by 33 returned the lane's own value, a huge delta indexed past the warp)."""
    big = [32, 33, 47, 63, 64, 95, -1, -31, -32, -33, 2**31 - 1, -2**31, 2**31 - 31, 1 << 20, 1 << 5, 36]
    args = np.array((big * 4)[:64], np.int64).astype(np.int32)  # 2^31 and more arrive as negative ints
    values = np.arange(64, dtype=np.int32) * 7 + 1
    out = np.zeros_like(values)
    mod.get_function("shuffle<int>")((2,), (32,), (values, args, out, np.int32(mode), np.int32(width)), seed=mode)
    np.testing.assert_array_equal(out, shfl_reference(values, args, mode, width))


def test_shuffle_up_by_33_is_up_by_one(mod):
    values = np.arange(32, dtype=np.int32) + 100
    out = np.zeros_like(values)
    mod.get_function("shuffle<int>")((1,), (32,), (values, np.full(32, 33, np.int32), out, np.int32(1),
                                                   np.int32(32)))
    np.testing.assert_array_equal(out, np.concatenate([[100], values[:-1]]))


def test_votes(mod):
    rng = np.random.default_rng(2)
    pred = (rng.random(128) < 0.5).astype(np.int32)
    pred[32:64] = 1  # one warp all true
    pred[64:96] = 0  # one all false
    out = np.zeros((128, 8), np.uint32)
    mod.get_function("votes")((1,), (128,), (pred, out))
    for w in range(4):
        p = pred[32 * w:32 * w + 32]
        ballot = sum(1 << i for i in range(32) if p[i])
        assert (out[32 * w:32 * w + 32, 0] == ballot).all()
        assert (out[32 * w:32 * w + 32, 1] == int(p.any())).all()
        assert (out[32 * w:32 * w + 32, 2] == int(p.all())).all()
        assert (out[32 * w:32 * w + 32, 6] == p.sum()).all()
    assert (out[:, 3] == pred.sum()).all()
    assert (out[:, 4] == 0).all() and (out[:, 5] == 1).all()
    assert (out[:, 7] == 0xFFFFFFFF).all()


@pytest.mark.parametrize("grid,block", [((2, 3, 2), (8, 4, 2)), ((3,), (40,)), ((1, 2), (5, 7, 3))])
def test_builtin_variables_and_warps(mod, grid, block):
    g, b = grid + (1,) * (3 - len(grid)), block + (1,) * (3 - len(block))
    nb, nt = int(np.prod(g)), int(np.prod(b))
    out = np.full((nb, nt, 14), -1, np.int32)
    mod.get_function("coords")(grid, block, (out,))
    t = np.arange(nt)
    tx, ty, tz = t % b[0], t // b[0] % b[1], t // (b[0] * b[1])  # x fastest
    bl = np.arange(nb)
    bx, by, bz = bl % g[0], bl // g[0] % g[1], bl // (g[0] * g[1])
    np.testing.assert_array_equal(out[..., 0], np.broadcast_to(tx, (nb, nt)))
    np.testing.assert_array_equal(out[..., 1], np.broadcast_to(ty, (nb, nt)))
    np.testing.assert_array_equal(out[..., 2], np.broadcast_to(tz, (nb, nt)))
    np.testing.assert_array_equal(out[..., 3], np.broadcast_to(bx[:, None], (nb, nt)))
    np.testing.assert_array_equal(out[..., 4], np.broadcast_to(by[:, None], (nb, nt)))
    np.testing.assert_array_equal(out[..., 5], np.broadcast_to(bz[:, None], (nb, nt)))
    assert (out[..., 6:9] == b).all() and (out[..., 9:12] == g).all() and (out[..., 12] == 32).all()
    np.testing.assert_array_equal(out[..., 13], np.broadcast_to(t - t % 32, (nb, nt)))  # warps of 32 linear ids


def test_fresh_shared_memory_is_nan_in_every_block(mod):
    out = np.zeros((3, 64, 2), np.float32)
    mod.get_function("read_fresh_shared")((3,), (64,), (out,), shared_mem=256, workers=1)
    assert np.isnan(out).all()


def test_missing_barrier_is_caught_by_some_schedule(mod):
    x = np.arange(256, dtype=np.float32)
    fn = mod.get_function("neighbour")
    want = np.roll(x.reshape(2, 128), 1, axis=1).ravel()  # out[t] = in[t - 1]
    for schedule in SCHEDULES:  # with the barrier, every schedule agrees
        out = np.zeros(256, np.float32)
        fn((2,), (128,), (x, out, np.int32(1), np.int32(-1)), seed=schedule)
        np.testing.assert_array_equal(out, want)
    wrong = []
    for schedule in SCHEDULES:  # without it, some threads read a neighbour's slot before it is written
        out = np.zeros(256, np.float32)
        fn((2,), (128,), (x, out, np.int32(0), np.int32(-1)), seed=schedule)
        wrong.append(np.flatnonzero(out != want))
    assert all(len(w) for w in wrong)
    assert len(wrong[0]) == 2 and len(wrong[1]) == 254  # forward: only thread 0 reads ahead; reverse: all but 127


def at(marker):
    """The file:line the messages give the marked line of basics.cu."""
    return simt_util.site("basics.cu", marker)


@pytest.mark.parametrize("which,words", [
    (0, ["barrier divergence", re.compile(r"block \([01],0,0\)"), at("DIVERGE_A"), at("DIVERGE_B")]),  # either block
    (1, ["exit", "__syncthreads()", "threads 0-47", at("EXIT_BARRIER")]),
    (2, ["__shfl_xor_sync", "mask 0xffffffff", "lanes 0-15", at("HALF_WARP_SHFL")]),
    (3, ["does not include the calling lane", at("MASK_WITHOUT_CALLER")]),
    (4, ["__trap()", "thread (5,0,0)"]),
    (5, ["assertion", "t != 7", "thread (7,0,0)", at("ASSERT")]),
    (6, ["deadlock", "__shfl_sync", "__syncthreads()", at("DEADLOCK_SHFL"), at("DEADLOCK_BARRIER")]),
])
def test_misuse_is_a_launch_error_naming_kernel_block_threads_file_and_line(mod, which, words):
    out = np.zeros(64, np.float32)
    with pytest.raises(simt.LaunchError) as e:
        mod.get_function("misuse")((2,), (64,), (out, np.int32(which)))
    msg = str(e.value)
    assert "kernel 'misuse'" in msg
    for w in words:
        assert (w.search(msg) if isinstance(w, re.Pattern) else w in msg), msg


def test_barriers_on_the_same_line_of_two_files_are_two_barriers():
    src = ('#line 10 "a.cu"\n__device__ void bar_a() { __syncthreads(); }\n'
           '#line 10 "b.cu"\n__device__ void bar_b() { __syncthreads(); }\n'
           '#line 1 "k.cu"\nextern "C" __global__ void k(float* out) {\n'
           '  if (threadIdx.x < 32) bar_a(); else bar_b();\n  out[threadIdx.x] = 1;\n}\n')
    with pytest.raises(simt.LaunchError, match="barrier divergence") as e:
        simt.RawModule(code=src).get_function("k")((1,), (64,), (np.zeros(64, np.float32),))
    assert "a.cu:10" in str(e.value) and "b.cu:10" in str(e.value), str(e.value)


def test_launch_after_a_failed_one_still_works(mod):
    with pytest.raises(simt.LaunchError):
        mod.get_function("misuse")((4,), (64,), (np.zeros(64, np.float32), np.int32(2)))
    test_shared_memory_reduction(mod, "forward", (7,), (128,), 128)


def test_dynamic_shared_memory_and_its_limits(mod):
    fn = mod.get_function("dynamic_fill")
    out = np.zeros(2 * 64 * 16, np.uint8)
    fn((2,), (64,), (out, np.int32(16)), shared_mem=64 * 16)
    want = (np.arange(64)[:, None] + np.arange(16)[None, :]).astype(np.uint8).ravel()
    np.testing.assert_array_equal(out, np.tile(want, 2))
    big = np.zeros(2 * 64 * 1024, np.uint8)
    with pytest.raises(simt.LaunchError, match="max_dynamic_shared_size_bytes"):
        fn((2,), (64,), (big, np.int32(1024)), shared_mem=64 * 1024)  # > 48 KiB without opting in
    fn.max_dynamic_shared_size_bytes = 64 * 1024
    fn((2,), (64,), (big, np.int32(1024)), shared_mem=64 * 1024)
    with pytest.raises(ValueError, match="232448"):
        fn.max_dynamic_shared_size_bytes = 232448 + 1
    small = simt_util.module("basics.cu", NAMES, max_dynamic_shared=101376)  # an sm_86 device
    with pytest.raises(ValueError, match="101376"):
        small.get_function("dynamic_fill").max_dynamic_shared_size_bytes = 128 * 1024


def test_static_plus_dynamic_shared_over_the_device_limit(mod):
    fn = mod.get_function("read_fresh_shared")  # 256 bytes of static shared memory
    fn.max_dynamic_shared_size_bytes = simt.H100_SHARED
    with pytest.raises(simt.LaunchError, match="static") as e:
        fn((1,), (64,), (np.zeros(128, np.float32),), shared_mem=simt.H100_SHARED)
    assert at("FRESH_STATIC").search(str(e.value)), str(e.value)  # the __shared__ declaration's file:line


def test_atomics_across_workers(mod):
    f, d = np.zeros(1, np.float32), np.zeros(1)
    i, u, m = np.zeros(1, np.int32), np.zeros(1, np.uint64), np.zeros(1, np.int32)
    mod.get_function("atomics")((200,), (64,), (f, d, i, u, m), workers=2)
    assert f[0] == 12800 and d[0] == 6400 and i[0] == 12800 and u[0] == 25600 and m[0] == 12799


def test_intrinsics_and_vector_types(mod):
    x = np.linspace(-1, 1, 32, dtype=np.float32)
    out, sizes = np.zeros((32, 8), np.float32), np.zeros(16, np.int32)
    mod.get_function("intrinsics")((1,), (32,), (x, out, sizes))
    np.testing.assert_allclose(out[:, 0], np.exp(x), rtol=1e-6)
    np.testing.assert_allclose(out[:, 1], np.exp2(x), rtol=1e-6)
    np.testing.assert_allclose(out[:, 2], x / 3, rtol=1e-6)
    np.testing.assert_array_equal(out[:, 3], np.maximum(x, 0.25))
    np.testing.assert_allclose(out[:, 4], 1 / np.sqrt(x + 2), rtol=1e-6)
    np.testing.assert_array_equal(out[:, 5], np.abs(x))
    np.testing.assert_array_equal(out[:, 6], np.minimum(np.arange(32), 3))
    np.testing.assert_array_equal(out[:, 7], x + 1)
    # CUDA's sizes and alignments: float2, float4, uint4, int4, __half2, __nv_bfloat162, double2, float3.
    np.testing.assert_array_equal(sizes, [8, 8, 16, 16, 16, 16, 16, 16, 4, 4, 4, 4, 16, 16, 12, 4])


def test_arguments_are_checked_against_parameter_types(mod):
    fn = mod.get_function("echo")
    assert fn.signature == ("pf8", "i4", "u4", "i8", "f4", "f8", "b1", "s16", "pf4")
    out = np.zeros(10)
    params = np.array((3, 2.5, -7), dtype=[("a", "<i4"), ("b", "<f4"), ("c", "<i8")])[()]
    fn((1,), (1,), (out, np.int32(-4), np.uint32(5), 2**40, np.float32(1.5), 0.25, True, params, None))
    np.testing.assert_array_equal(out, [-4, 5, 2**40, 1.5, 0.25, 1, 3, 2.5, -7, 1])
    good = [out, np.int32(1), np.uint32(1), 1, np.float32(1), 1.0, True, params, None]
    for i, bad, words in [(1, 1, "pass numpy.int32"), (4, 1.0, "pass numpy.float32"), (5, np.float32(1), "double"),
                          (0, np.zeros(10, np.float32), "array of float32"), (8, [1.0], "NumPy array"),
                          (7, np.int64(1), "16 bytes"), (2, np.int32(1), "unsigned int")]:
        args = list(good)
        args[i] = bad
        with pytest.raises(TypeError, match=words):
            fn((1,), (1,), tuple(args))
    with pytest.raises(TypeError, match="takes 9 arguments"):
        fn((1,), (1,), tuple(good[:3]))


def test_invalid_configurations(mod):
    fn = mod.get_function("coords")
    out = np.zeros(14 * 2048, np.int32)
    for grid, block in [((1,), (2048,)), ((0,), (32,)), ((1,), (1, 1, 65)), ((1, 70000), (1,))]:
        with pytest.raises(simt.LaunchError, match="invalid launch configuration"):
            fn(grid, block, (out,))


def test_compile_errors_carry_the_kernel_line():
    src = 'extern "C" __global__ void k(float* p) {\n  p[0] = 1;\n  undefined_thing(p);\n}\n'
    with pytest.raises(simt.CompileError, match=r"kernel\.cu:3"):
        simt.RawModule(code=src)
    with pytest.raises(simt.CompileError, match="namespace scope"):
        simt.RawModule(code='extern __shared__ float smem[];\nextern "C" __global__ void k() { smem[0] = 1; }\n')


def test_build_cache_and_options(tmp_path, monkeypatch):
    monkeypatch.setenv("CUFLASH_SIMT_CACHE", str(tmp_path))
    src = 'extern "C" __global__ void k(int* p) { p[threadIdx.x] = VALUE + (int)sizeof(__half); }\n'
    a = simt.RawModule(code=src, options=("-DVALUE=40", "--std=c++17", "-arch=sm_90"))
    t = time.perf_counter()
    b = simt.RawModule(code=src, options=("-DVALUE=40", "--std=c++17", "-arch=sm_90"))
    assert a.library_path == b.library_path and time.perf_counter() - t < 0.5
    c = simt.RawModule(code=src, options=("-DVALUE=1",))
    assert c.library_path != a.library_path and os.path.dirname(c.library_path) == str(tmp_path)
    p = np.zeros(4, np.int32)
    a.get_function("k")((1,), (4,), (p,))
    assert (p == 42).all()
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".build-")]  # no half-written leftovers


def test_every_runtime_part_is_in_the_build_key_and_the_package(tmp_path, monkeypatch):
    """cuflash_simt.h includes its parts from runtime/: each is hashed into the build cache's key (an edited part
    rebuilds, never runs stale) and shipped by the package data."""
    from cuflash.simt import _build
    here, headers = _build.HERE, _build.runtime_headers()
    parts = re.findall(r'^#include "([^"]+)"', (here / "cuflash_simt.h").read_text(), flags=re.M)
    assert len(parts) > 10 and {here / p for p in parts} <= set(headers)
    copy = tmp_path / "simt"
    for p in headers:
        (copy / p.relative_to(here)).parent.mkdir(parents=True, exist_ok=True)
        (copy / p.relative_to(here)).write_bytes(p.read_bytes())
    monkeypatch.setattr(_build, "HERE", copy)
    before = _build._runtime_digest()
    part = copy / "runtime" / "half.h"
    part.write_text(part.read_text() + "// edited\n")
    assert _build._runtime_digest() != before
    tomllib = pytest.importorskip("tomllib")
    setup = tomllib.loads((simt_util.ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = {p for package, patterns in setup["package-data"].items() if package in setup["packages"]
               for pattern in patterns for p in (simt_util.ROOT / package.replace(".", "/")).glob(pattern)}
    assert set(headers) <= shipped


def test_idle_fiber_stacks_of_modules_not_launched_lately_are_unmapped(tmp_path, monkeypatch):
    """Each module keeps a pool of fiber stacks (two memory mappings each); only the last KEEP_STACKS modules
    launched keep theirs, so a process that loads hundreds of modules stays far from vm.max_map_count. A module
    whose stacks went launches again on fresh ones."""
    monkeypatch.setenv("CUFLASH_SIMT_CACHE", str(tmp_path))
    keep = 2  # the rule is the same for any count: a few modules show it (each is a g++ build)
    monkeypatch.setattr(simt._module, "KEEP_STACKS", keep)
    src = 'extern "C" __global__ void k(int* p) { p[threadIdx.x] = VALUE; }\n'
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:  # g++ runs in parallel
        mods = list(pool.map(lambda i: simt.RawModule(code=src, options=(f"-DVALUE={i}",), workers=1),
                             range(3 * keep)))

    def maps():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    p = np.zeros(512, np.int32)
    mods[0].get_function("k")((1,), (512,), (p,))
    before = maps()
    for i, m in enumerate(mods):
        m.get_function("k")((1,), (512,), (p,))
        assert (p == i).all()
    grown = maps() - before
    assert grown < keep * 2 * 512 + 600, grown  # unbounded: 6 modules x 1024 mappings
    mods[0].get_function("k")((1,), (512,), (p,))  # its stacks were unmapped long ago
    assert (p == 0).all()


def test_reduction_speed(mod):
    """The issue's yardstick: 1000 blocks of 128 threads, 10 barriers per thread (prints the time)."""
    x = np.random.default_rng(3).standard_normal(1000 * 128).astype(np.float32)
    out = np.zeros(1000, np.float32)
    fn = mod.get_function("reduce10")
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn((1000,), (128,), (x, out))
        times.append(time.perf_counter() - t)
    print(f"\n1000 blocks x 128 threads x 10 barriers: {min(times) * 1e3:.1f} ms (best of 3, {os.cpu_count()} CPUs)")
    np.testing.assert_allclose(out, x.reshape(1000, 128).sum(1), rtol=1e-4, atol=1e-4)
    assert min(times) < 5.0


def test_fiber_stack_overflow_says_so(tmp_path):
    """A kernel whose locals overflow the per-thread stack kills the process (as a GPU kernel would fault), but
    first says what happened and what to change."""
    import subprocess
    import sys
    script = tmp_path / "overflow.py"
    script.write_text(
        "import numpy as np\nfrom cuflash import simt\n"
        "m = simt.RawModule(code='extern \"C\" __global__ void big(float* o) { volatile float a[40000]; "
        "for (int i = 0; i < 40000; i++) a[i] = i; o[threadIdx.x] = a[39999]; }', stack_size=64 * 1024)\n"
        "m.get_function('big')((1,), (4,), (np.zeros(4, np.float32),))\n")
    env = dict(os.environ, PYTHONPATH=str(simt_util.ROOT))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0
    assert "kernel 'big' overflowed its 65536-byte stack" in r.stderr and "stack_size=" in r.stderr, r.stderr


def test_the_runtime_header_is_precompiled_once_per_mode_and_flags(tmp_path, monkeypatch):
    """Modules that differ only in -D share one precompiled runtime header; -ftz=false (a flag the header reads)
    gets its own; each module still computes with its own definitions."""
    monkeypatch.setenv("CUFLASH_SIMT_CACHE", str(tmp_path))
    src = 'extern "C" __global__ void k(int* p) { p[threadIdx.x] = VALUE; }\n'
    p = np.zeros(32, np.int32)
    for value, ftz in ((1, ()), (2, ()), (3, ("-ftz=false",))):
        simt.RawModule(code=src, options=(f"-DVALUE={value}",) + ftz).get_function("k")((1,), (32,), (p,))
        assert (p == value).all()
    headers = sorted(tmp_path.glob("pch-*/cuflash_simt.h.gch"))
    assert len(headers) == 2, sorted(tmp_path.iterdir())
