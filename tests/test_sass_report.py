"""bench/sass_report.py: the loop finder and the steady state's path on a hand-written SASS snippet (no compiler
needed), and the script's tiny CI mode end to end (NVRTC and cuobjdump: skips without them, as test_cubin.py)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import sass_report
from cuflash import BlockConfig, DeviceLimits, tiling
from cuflash.family import Shape
from test_cubin import cuobjdump, nvrtc_unavailable

ROOT = Path(__file__).resolve().parents[1]

MISSING = nvrtc_unavailable() or (None if cuobjdump() else "cuobjdump or nvdisasm is missing: "
                                   "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
needs_tools = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

# A key-tile loop [0x30, 0xf0] around an inner loop [0x50, 0x80] that a guard may skip, a cold block a branch
# skips, two products (the second after a branch that would jump over it), then an out-of-line stub whose jump
# back into the loop is no loop, and the trap after the exit.
SNIPPET = [
    (0x00, "S2R R0, SR_TID.X"),
    (0x10, "ISETP.GE.AND P0, PT, R0, 0x10, PT"),
    (0x20, "@P0 EXIT"),
    (0x30, "IMAD.MOV.U32 R2, RZ, RZ, RZ"),
    (0x40, "@P3 BRA 0x90"),
    (0x50, "LDS R5, [R2]"),
    (0x60, "FFMA R6, R5, R5, R6"),
    (0x70, "IADD3 R2, R2, 0x4, RZ"),
    (0x80, "@P5 BRA 0x50"),
    (0x90, "@P1 BRA 0xc0"),
    (0xa0, "LDG.E R7, desc[UR4][R8.64]"),
    (0xb0, "FFMA R6, R7, R7, R6"),
    (0xc0, "HMMA.16816.F32 R12, R16, R20, R12"),
    (0xd0, "@P4 BRA 0xf0"),
    (0xe0, "HMMA.16816.F32 R12, R16, R22, R12"),
    (0xf0, "@P2 BRA 0x30"),
    (0x100, "EXIT"),
    (0x110, "WARPSYNC.COLLECTIVE R9, 0x120"),
    (0x120, "BRA 0x40"),
    (0x130, "BRA 0x130"),
]


def snippet_code():
    text = "\n".join(f"        /*{addr:04x}*/{'':19}{ins} ;{'':20}/* 0x000fe20000000f00 */" for addr, ins in SNIPPET)
    return sass_report.parse(f"\tFunction : _Z6kernelv\n{text}\n")


def classes_of(counts):
    return {cls: n for cls, n in sass_report.classes(counts).items() if n}


def test_parse_reads_predicates_opcodes_and_targets():
    code = snippet_code()
    assert [ins.addr for ins in code] == [addr for addr, _ in SNIPPET]
    assert code[2].pred == "@P0" and code[2].base == "EXIT"
    assert code[12].op == "HMMA.16816.F32" and sass_report.classify(code[12]) == "tensor"
    assert [sass_report.branch_target(code[i]) for i in (4, 8, 15, 18)] == [0x90, 0x50, 0x30, 0x40]
    assert not sass_report.falls_through(code[16]) and sass_report.falls_through(code[15])


def test_loop_finder_nests_the_inner_loop_and_ignores_stubs_and_traps():
    code = snippet_code()
    loops = sass_report.find_loops(code)
    assert len(loops) == 1  # the stub's jump back (0x120 -> 0x40) and the trap (0x130) are not loops
    outer = sass_report.key_loop(code, loops)
    assert (code[outer.head].addr, code[outer.end].addr) == (0x30, 0xf0)
    [inner] = outer.children
    assert (code[inner.head].addr, code[inner.end].addr) == (0x50, 0x80) and not inner.children
    assert sass_report.kind_of(code, inner) == "fma"


def test_path_weights_required_inner_loops_and_skips_cold_code_but_no_product():
    code = snippet_code()
    outer = sass_report.find_loops(code)[0]
    inner = outer.children[0]
    once = sass_report.iteration(code, inner)
    assert sum(once.values()) == 4
    cost = {inner.head: sass_report.scaled(once, 3)}
    # Required, three trips: the head, the guard, 3 x 4 inside, the cold block skipped, both products and the
    # branch before the second (it may not jump over a product), the latch.
    path = sass_report.cheapest_path(code, outer, cost, [[inner]])
    assert classes_of(path) == {"integer": 4, "branch": 7, "shared_load": 3, "fma": 3, "tensor": 2}
    # Not required: the guard skips it (a cold loop).
    path = sass_report.cheapest_path(code, outer, cost, [])
    assert classes_of(path) == {"integer": 1, "branch": 4, "tensor": 2}
    # The span: every instruction of the loop once, the inner loop three times.
    assert sum(sass_report.span_tally(code, outer, {inner.head: 3}).values()) == 9 + 12


def test_trip_counts_follow_the_template_arguments():
    device = DeviceLimits.known("H100")
    plan = tiling.plan(Shape(np.float32, 64, 64, 4096, 4096, precision="fma"), device, (64, 64))
    steps = sass_report.steps(plan)
    threads = 32 * plan.config.warps
    assert [s.name for s in steps] == ["K_j", "V_j", "S = Q K^T over d", "O += P V over Bc"]
    assert steps[0].work == 64 * 64 // 4 // threads  # 16-byte chunks of K_j per thread
    rows = 64 // (threads // 16)
    assert steps[2].work == rows * (64 // 16) * 64  # FMAs per thread of S = Q K^T
    once = {("fma", "FFMA"): 2 * rows * (64 // 16)}  # a loop unrolled twice
    assert sass_report.per_iteration(steps[2], once) == (steps[2].work, 2 * rows * 4)


def test_float32_and_float64_tensor_core_steps_count_their_products():
    """Their Q K^T runs as a loop of steps: its tensor instructions per warp and tile, by precision."""
    device = DeviceLimits.known("H100")
    for dtype, precision, per_step in ((np.float32, "highest", 3), (np.float32, "tf32", 1), (np.float64, "highest", 2)):
        plan = tiling.plan(Shape(dtype, 64, 64, 4096, 4096, precision=precision), device, BlockConfig.mma(64, 32))
        steps = sass_report.steps(plan)
        assert [s.name for s in steps] == ["K_j", "V_j", "S = Q K^T over d"] and steps[2].kind == "tensor"
        step = 32 // np.dtype(dtype).itemsize  # a step covers 32 bytes of a Q and K row
        assert steps[2].work == 1 * (32 // 8) * (64 // step) * per_step
        assert sass_report.per_iteration(steps[2], {("tensor", "HMMA.1688.F32.TF32"): 4}) == (steps[2].work, 4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("sass")
    done = subprocess.run([sys.executable, "-m", "bench.sass_report", "--tiny", "--json", str(out / "report.json"),
                           "--sass-dir", str(out / "sass")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    return out, done.stdout


@needs_tools
def test_tiny_run_prints_writes_json_and_sass(tiny):
    out, stdout = tiny
    assert "Estimates" in stdout and "TFLOP/s" in stdout and "fwd_mma<128,128,64,64,4,2>" in stdout
    report = json.loads((out / "report.json").read_text())
    assert report["schema"] == sass_report.SCHEMA
    assert {"command", "estimates", "method", "rates", "rows"} <= set(report)
    [row] = report["rows"]
    assert {"kernel", "usage", "per_tile", "span", "opcodes", "inner_loops", "instructions_per_mma",
            "ldmatrix_per_mma", "clocks_per_tile", "bound", "tflops"} <= set(row)
    assert row["bound"] in row["clocks_per_tile"] and row["tflops"] > 0
    [sass] = (out / "sass").glob("*.sass")
    assert "HMMA" in sass.read_text()


@needs_tools
def test_a_kernel_compiled_with_mods_is_reported_without_a_bound():
    """--mods: the forward compiled with a soft-cap score_mod (no steady loop, every tile per element): it has
    its registers, no local memory and a note instead of a bound, and fewer registers than 255."""
    rows, _ = sass_report.run(["H100"], ["float16"], [64], 16384, 16384, kernels_wanted="forward", mods="softcap")
    [row] = rows
    assert row["mods"].startswith("batch axes 2; score_mod(multiply(") and "tanh" in row["mods"] and "bound" not in row
    assert row["usage"]["spill_stores"] == 0 and row["span"]["local"] == 0 and row["usage"]["registers"] < 255
    assert any("compiled with mods" in note for note in row["notes"])


@needs_tools
def test_a_dropout_kernels_keep_bits_count_once_a_tile():
    """--dropout: the planner's float16 forward at d = 64 compiled with dropout (128 x 64 tiles where the keep bits
    would spill 128 x 128): no local memory, and its keep-bit loop (two Philox calls and a byte stored per
    iteration) weighted by its trip count, Br x Bc / 8 bytes over 128 threads, on the path and in the span."""
    rows, _ = sass_report.run(["H100"], ["float16"], [64], 16384, 16384, kernels_wanted="forward", dropout=True)
    [row] = rows
    assert row["dropout"] and row["config"] == str(BlockConfig.mma(128, 64, 4))
    assert row["usage"]["spill_stores"] == row["usage"]["stack"] == 0 and row["span"]["local"] == 0
    [keep] = [x for x in row["inner_loops"] if x["step"] == "keep bits"]
    assert keep["trips"] == 128 * 8 // 128 and keep["iteration"] > 100  # two Philox calls of ~60 instructions
    assert row["per_tile"]["instructions"] > keep["trips"] * keep["iteration"]
    assert row["opcodes"]["STS.U8"] == keep["trips"]


@needs_tools
def test_tensor_core_forward_counts(tiny):
    """The float16 forward at d = 64 on an H100: every product on tensor cores, each tile's K/V prefetch
    (16-byte chunks unrolled in the steady loop, which holds no inner loop), no local memory, and issue 12's
    targets for the steady loop: at most 4.3 instructions per HMMA on its path and in its span (O_i's rescale
    branch included), at most 0.32 ldmatrix per HMMA."""
    out, _ = tiny
    [row] = json.loads((out / "report.json").read_text())["rows"]
    tile = row["per_tile"]
    plan = tiling.plan(Shape(np.float16, 64, 64, 16384, 16384), DeviceLimits.known("H100"))
    mt, nt, kd, et = plan.config.Br // (16 * plan.config.warps), plan.config.Bc // 8, 64 // 16, 64 // 8
    assert tile["tensor"] == mt * (nt * kd + et * plan.config.Bc // 16) > 0
    assert tile["local"] == 0 and row["span"]["local"] == 0
    assert not any(op.split(".")[0] in ("LDL", "STL") for op in row["opcodes"])
    [sass] = (out / "sass").glob("*.sass")
    assert not {"LDL", "STL"} & {ins.base for ins in sass_report.parse(sass.read_text())}
    assert row["inner_loops"] == [] and row["notes"] == [] and row["loads"] == "unrolled"
    assert tile["cp_async"] == 2 * plan.config.Bc * 64 * 2 // 16 // (32 * plan.config.warps)
    assert row["instructions_per_mma"] <= 4.3 and row["span_per_mma"] <= 4.3 and row["ldmatrix_per_mma"] <= 0.32


# A key-tile loop [0x10, 0x80] whose loads take one of two ways: a load loop [0x20, 0x30] (strided views, short
# tiles) or two unrolled 16-byte cp.async copies (full tiles).
UNROLLED = [
    (0x00, "S2R R0, SR_TID.X"),
    (0x10, "@P0 BRA 0x40"),
    (0x20, "LDGSTS.E.BYPASS.128.ZFILL [R2], desc[UR4][R4.64], P1"),
    (0x30, "@P2 BRA 0x20"),
    (0x40, "@!P0 BRA 0x70"),
    (0x50, "LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64]"),
    (0x60, "LDGSTS.E.BYPASS.128 [R3+0x1200], desc[UR4][R8.64]"),
    (0x70, "HMMA.16816.F32 R12, R16, R20, R12"),
    (0x80, "@P3 BRA 0x10"),
    (0x90, "EXIT"),
]


def test_unrolled_loads_are_a_way_through_the_tile():
    text = "\n".join(f"        /*{a:04x}*/{'':19}{ins} ;{'':20}/* 0x000fe20000000f00 */" for a, ins in UNROLLED)
    code = sass_report.parse(f"\tFunction : _Z6kernelv\n{text}\n")
    [loop] = sass_report.find_loops(code)
    [inner] = loop.children
    cost = {inner.head: sass_report.scaled(sass_report.iteration(code, inner), 2)}
    through_loop = sass_report.cheapest_path(code, loop, cost, [[inner]])
    assert sum(through_loop.values()) == 1 + 2 * 2 + 1 + 1 + 1
    unrolled = sass_report.unrolled_copies_path(code, loop, cost, 2)
    assert sum(unrolled.values()) == 1 + 1 + 2 + 1 + 1
    assert classes_of(unrolled)["cp_async"] == 2
    assert sass_report.unrolled_copies_path(code, loop, cost, 3) is None  # fewer copies than the tile's chunks


# Two key-tile loops holding the same products: the other tiles' (a mask's branch inside) and the steady state's,
# compiled apart and smaller.
TWO_LOOPS = [
    (0x00, "HMMA.16816.F32 R12, R16, R20, R12"),
    (0x10, "@P0 BRA 0x30"),
    (0x20, "LDG.E.U8 R2, desc[UR4][R4.64]"),
    (0x30, "@P1 BRA 0x00"),
    (0x40, "HMMA.16816.F32 R12, R16, R20, R12"),
    (0x50, "@P2 BRA 0x40"),
    (0x60, "EXIT"),
]


def test_the_key_loop_is_the_smallest_of_those_with_the_most_products():
    text = "\n".join(f"        /*{a:04x}*/{'':19}{ins} ;{'':20}/* 0x000fe20000000f00 */" for a, ins in TWO_LOOPS)
    code = sass_report.parse(f"\tFunction : _Z6kernelv\n{text}\n")
    loops = sass_report.find_loops(code)
    assert len(loops) == 2
    assert code[sass_report.key_loop(code, loops).head].addr == 0x40


# The forward's steady tiles: a hot loop [0x20, 0x40] holding a tile's loads and products, inside a loop [0x10, 0x50]
# that only adds the rare rescale (when a row's max grows); then a loop [0x70, 0xb0] whose products sit in an
# inner loop [0x80, 0x90] without its loads.
HOT_AND_RARE = [
    (0x00, "S2R R0, SR_TID.X"),
    (0x10, "FMUL R12, R12, R30"),
    (0x20, "LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]"),
    (0x30, "HMMA.16816.F32 R12, R16, R20, R12"),
    (0x40, "@!P1 BRA 0x20"),
    (0x50, "@P2 BRA 0x10"),
    (0x60, "EXIT"),
]
PRODUCTS_APART = [
    (0x70, "LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]"),
    (0x80, "HMMA.16816.F32 R12, R16, R20, R12"),
    (0x90, "@P1 BRA 0x80"),
    (0xa0, "FMUL R12, R12, R30"),
    (0xb0, "@P2 BRA 0x70"),
    (0xc0, "EXIT"),
]


def test_the_key_loop_is_the_hot_loop_inside_a_rare_path():
    for snippet, key in ((HOT_AND_RARE, (0x20, 0x40)), (PRODUCTS_APART, (0x70, 0xb0))):
        text = "\n".join(f"        /*{a:04x}*/{'':19}{ins} ;{'':20}/* 0x000fe20000000f00 */" for a, ins in snippet)
        code = sass_report.parse(f"\tFunction : _Z6kernelv\n{text}\n")
        loop = sass_report.key_loop(code, sass_report.find_loops(code))
        assert (code[loop.head].addr, code[loop.end].addr) == key


# The CUDA-core kernels' shape: a key-tile loop [0x10, 0xb0] whose loads are a load loop [0x20, 0x30] or two
# unrolled 16-byte loads, and whose product is an inner FMA loop [0x80, 0xa0] either way (behind the guard that
# skips a loop of no trips).
UNROLLED_THEN_PRODUCTS = [
    (0x00, "S2R R0, SR_TID.X"),
    (0x10, "@P0 BRA 0x40"),
    (0x20, "LDG.E.128 R4, desc[UR4][R2.64]"),
    (0x30, "@P2 BRA 0x20"),
    (0x40, "@!P0 BRA 0x70"),
    (0x50, "LDG.E.128 R8, desc[UR4][R6.64]"),
    (0x60, "LDG.E.128 R12, desc[UR4][R6.64+0x1000]"),
    (0x70, "@!P5 BRA 0xb0"),
    (0x80, "FFMA R20, R21, R22, R20"),
    (0x90, "FFMA R23, R21, R24, R23"),
    (0xa0, "@P3 BRA 0x80"),
    (0xb0, "@P4 BRA 0x10"),
    (0xc0, "EXIT"),
]


def test_unrolled_loads_still_pass_the_product_loops():
    """The unrolled way through a tile passes its loads and the products' inner loops, never skips them."""
    text = "\n".join(f"        /*{a:04x}*/{'':19}{ins} ;{'':20}/* 0x000fe20000000f00 */"
                     for a, ins in UNROLLED_THEN_PRODUCTS)
    code = sass_report.parse(f"\tFunction : _Z6kernelv\n{text}\n")
    [loop] = sass_report.find_loops(code)
    load, product = sorted(loop.children, key=lambda c: c.head)
    cost = {load.head: sass_report.scaled(sass_report.iteration(code, load), 2),
            product.head: sass_report.scaled(sass_report.iteration(code, product), 10)}
    unrolled = sass_report.unrolled_copies_path(code, loop, cost, 2, [[product]])
    assert classes_of(unrolled)["fma"] == 20 and classes_of(unrolled)["global"] == 2
    assert sum(unrolled.values()) == 1 + 1 + 2 + 1 + 3 * 10 + 1
    assert sass_report.unrolled_copies_path(code, loop, cost, 3, [[product]]) is None
    assert "fma" not in classes_of(sass_report.unrolled_copies_path(code, loop, cost, 2))  # the guard's way
