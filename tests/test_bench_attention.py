"""bench/attention/ and bench/device_check.sh: the tiny CPU run end to end, the GPU path on NumPy posing as
CuPy, the bookkeeping of backends that cannot run, the ncu parsing, and the device script's dry run."""

import datetime
import importlib.util
import json
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from bench.attention import peers, timing
from bench.attention.accuracy import reference
from bench.attention.devices import Cpu, Gpu
from bench.attention.failures import Skip
from bench.attention.inputs import InputSets
from bench.attention.ncu import NCU_POINT, ncu_measure, ncu_models, parse_ncu_csv
from bench.attention.peers import Runner, heuristic_plan, runners_for
from bench.attention.plots import draw_plots
from bench.attention.points import PRESETS, Point, Preset, decode
from bench.attention.reports import plan_note, targets_table
from bench.attention.sweep import SCHEMA, make_meta, measure, run_sweep
from cuflash import cost

ROOT = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "-m", "bench.attention"]  # from ROOT, as the README runs it
DEVICE_CHECK = ROOT / "bench" / "device_check.sh"


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", timeout=120, cwd=ROOT, **kw)


# ---------------------------------------------------------------------------------------------------------
# The tiny CPU run, as CI runs it


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    done = run([*COMMAND, "--tiny", "--out", str(out)])
    assert done.returncode == 0, done.stderr
    return out, done


def test_tiny_run_records_every_point(tiny):
    out, done = tiny
    results = json.loads((out / "results.json").read_text())
    assert results["schema"] == SCHEMA and results["mode"] == "cpu" and results["preset"] == "tiny"
    assert results["complete"] is True and results["wall_s"] > 0
    assert results["command"].startswith("python -m bench.attention --tiny --out ")
    assert {"python", "numpy", "cpu", "git_commit"} <= set(results["env"])
    assert {"timing", "warmup", "repeats", "rotation", "flops", "peak_memory", "max_abs_err"} <= set(results["method"])
    assert results["peer"] == "naive-numpy"
    assert results["matmul_peak"]["float32"]["tflops"] > 0

    assert len(results["points"]) == len(PRESETS["tiny"].points)
    for p in results["points"]:
        point = Point(**{k: p[k] for k in ("dtype", "batch", "heads", "n", "m", "d", "causal")})
        assert p["flops"] == cost.flops(p["batch"] * p["heads"], p["n"], p["m"], p["d"], causal=p["causal"])
        assert p["input_sets"] >= 2, point
        assert [r["name"] for r in p["results"]] == ["cuflash", "cuflash[32x32]", "naive-numpy"]
        for r in p["results"]:
            assert r["status"] == "ok", r
            assert r["time_ms"] > 0 and r["tflops"] > 0 and r["matmul_fraction"] > 0
            assert np.median(r["times_ms"]) == pytest.approx(r["time_ms"])
            assert r["max_abs_err"] < 1e-5
            assert r["peak_bytes"] > 0 and "tracemalloc" in r["peak_bytes_method"]
        naive = p["results"][-1]
        assert naive["vs_peer"] == 1.0
    assert "[6/6] float32" in done.stderr  # the progress display


def test_tiny_run_writes_a_markdown_table(tiny):
    out, _ = tiny
    text = (out / "results.md").read_text()
    assert text.startswith("# cuflash attention benchmark: tiny on ")
    assert "`python -m bench.attention --tiny --out " in text
    header = ("| dtype | B×H | n | m | d | causal | backend | ms | GFLOP/s | of matmul | vs peer | peak MiB "
              "| max err | note |")
    assert header in text
    rows = [line for line in text.splitlines() if line.startswith("| float32 | ")]
    assert len(rows) == 3 * len(PRESETS["tiny"].points)
    assert "| float32 | 2×2 | 256 | 256 | 16 | yes | naive-numpy | " in text


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is a bench-only dependency")
def test_tiny_run_draws_plots(tiny):
    out, _ = tiny
    for name in ("rate.png", "memory.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_plots_are_skipped_with_a_note(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    results = {"mode": "cpu", "preset": "tiny", "points": []}
    assert draw_plots(results, tmp_path) == []
    assert results["notes"] == ["plots skipped: matplotlib is not installed"]


def test_a_gpu_preset_without_a_gpu_says_so():
    done = run([*COMMAND, "--preset", "fa2", "--cpu"])
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr


# ---------------------------------------------------------------------------------------------------------
# Presets


def test_fa2_preset_is_the_tensor_core_targets():
    points = PRESETS["fa2"].points
    assert {p.dtype for p in points} == {"float16", "bfloat16"}
    assert {p.d for p in points} == {64, 128}
    assert sorted({p.n for p in points}) == [1024, 2048, 4096, 8192, 16384]
    assert {p.causal for p in points} == {False, True}
    for p in points:
        assert p.m == p.n and p.batch * p.n == 16384 and p.heads * p.d == 2048
    dense = Point("float16", 2, 16, 8192, 8192, 128, False)
    assert dense.flops() == 4 * 2 * 16 * 8192 * 8192 * 128


def test_presets_cover_the_sweep():
    for name, preset in PRESETS.items():
        assert preset.points and preset.repeats >= 3 and preset.warmup >= 1, name
        assert preset.gpu == (name in ("fa2", "sweep", "short")), name
    sweep = PRESETS["sweep"].points
    assert any(p.m > p.n for p in sweep) and any(p.m < p.n for p in sweep)
    assert {"float16", "bfloat16", "float32"} <= {p.dtype for p in sweep}
    short = PRESETS["short"].points
    assert len(short) <= 10 and any(p.causal for p in short) and any(p.m != p.n for p in short)
    assert {"float32", "float64"} <= {p.dtype for p in short} and {"float32", "float64"} <= {p.dtype for p in sweep}


# ---------------------------------------------------------------------------------------------------------
# A backend that cannot run a point is recorded, never fatal


def failing_runner(exc):
    def prepare(dev, point, sets):
        raise exc

    return Runner("broken", "test", "x", prepare)


@pytest.mark.parametrize("exc, status", [
    (Skip("PyTorch is not installed"), "skipped"),
    (RuntimeError("No available kernel. Aborting execution."), "skipped"),
    (type("BackendUnavailableError", (RuntimeError,), {})("no cupy backend"), "skipped"),
    (ZeroDivisionError("a bug"), "error"),
])
def test_a_failing_backend_is_recorded_with_its_reason(exc, status):
    dev, point = Cpu(), Point("float32", 1, 2, 8, 8, 4, False)
    sets = InputSets(dev, point, 2)
    rec = measure(dev, failing_runner(exc), point, sets, PRESETS["tiny"], reference(sets, point))
    assert rec["status"] == status
    assert str(exc) in rec["reason"]
    assert "time_ms" not in rec


def test_points_after_the_time_limit_are_skipped(tmp_path):
    dev, preset = Cpu(), PRESETS["tiny"]
    runners = runners_for(dev, (), [])
    meta = make_meta(dev, "tiny", preset, "test", datetime.datetime.now())
    results = run_sweep(dev, preset, list(preset.points[:2]), runners, tmp_path, meta, time_limit=0.0)
    first, second = results["points"]
    assert all(r["status"] == "ok" for r in first["results"])
    assert all(r["status"] == "skipped" and "time-limit" in r["reason"] for r in second["results"])


# ---------------------------------------------------------------------------------------------------------
# The GPU path, run on NumPy posing as CuPy


class FakeEvent:
    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


def fake_cupy():
    """NumPy with the few CUDA calls the benchmark makes: enough to walk its GPU path on a CPU."""
    cp = types.ModuleType("cupy")
    cp.__version__ = "fake"
    cp.__getattr__ = lambda name: getattr(np, name)
    props = {"name": b"Fake GPU", "major": 9, "minor": 0, "multiProcessorCount": 1, "l2CacheSize": 2**16,
             "totalGlobalMem": 2**30}
    runtime = types.SimpleNamespace(getDeviceProperties=lambda i: props, getDeviceCount=lambda: 1,
                                    memGetInfo=lambda: (2**30, 2**30), driverGetVersion=lambda: 13000,
                                    runtimeGetVersion=lambda: 13000)
    pool = types.SimpleNamespace(total_bytes=lambda: 0, free_bytes=lambda: 0, free_all_blocks=lambda: None)

    class RandomState(np.random.RandomState):
        def standard_normal(self, size=None, dtype=np.float64):
            return super().standard_normal(size).astype(dtype)

    cp.cuda = types.SimpleNamespace(runtime=runtime, Event=FakeEvent,
                                    Device=lambda: types.SimpleNamespace(id=0, synchronize=lambda: None),
                                    get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3)
    cp.get_default_memory_pool = lambda: pool
    cp.random = types.SimpleNamespace(RandomState=RandomState)
    return cp


def no_torch(dev):
    raise Skip("PyTorch is not installed")


def test_the_gpu_path_runs_every_backend_or_says_why(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    for module in (peers, timing):
        monkeypatch.setattr(module, "import_torch", no_torch)  # the same answer on every machine
    monkeypatch.setitem(sys.modules, "torch", None)  # and no seconds spent importing it for the versions
    dev = Gpu()
    points = (Point("float16", 2, 2, 32, 32, 16, False), Point("float16", 2, 2, 32, 64, 16, True),
              Point("bfloat16", 1, 2, 32, 32, 16, True))
    preset = Preset(points, ((32, 32),), True, 1, 3, 64, budget_s=0.1)
    runners = runners_for(dev, preset.blocks, [])
    assert [r.name for r in runners] == ["cuflash", "cuflash[32x32]", "cuflash[tf32]", "cuflash[fma]", "naive-cupy",
                                         "torch-flash",
                                         "torch-efficient", "torch-cudnn", "torch-math"]
    meta = make_meta(dev, "fake", preset, "test", datetime.datetime.now())
    results = run_sweep(dev, preset, list(points), runners, tmp_path, meta, None)

    assert results["env"]["gpu"] == "Fake GPU" and results["env"]["cuda_runtime"] == "13.0"
    assert results["peer"] == "torch-flash"
    assert results["matmul_peak"]["float16"]["via"] == "cupy"
    assert "torch" in results["matmul_peak"]["float16"]["tries"]
    for p in results["points"]:
        by_name = {r["name"]: r for r in p["results"]}
        naive = by_name["naive-cupy"]
        assert naive["status"] == "ok" and naive["max_abs_err"] < 0.05, naive
        assert naive["vs_peer"] is None  # the peer did not run
        for name, r in by_name.items():
            assert r["status"] in ("ok", "skipped", "error") and (r["status"] == "ok") == (r["reason"] is None)
            if name.startswith("torch"):
                assert r["status"] == "skipped" and r["reason"] == "PyTorch is not installed"
    table = (tmp_path / "results.md").read_text()
    assert "| float16 | 2×2 | 32 | 64 | 16 | yes | naive-cupy | " in table and "TFLOP/s" in table


def test_the_targets_table_compares_cuflash_with_the_target_and_the_peer():
    def point(n, causal, cuflash_tflops, peer_tflops):
        results = [{"name": "cuflash", "backend": "cuflash", "status": "ok", "tflops": cuflash_tflops,
                    "time_ms": 1 / cuflash_tflops},
                   {"name": "torch-flash", "backend": "torch-sdpa", "status": "ok", "tflops": peer_tflops,
                    "time_ms": 1 / peer_tflops}]
        return dict(dtype="float16", batch=16384 // n, heads=16, n=n, m=n, d=128, causal=causal, results=results)

    lines = targets_table([point(4096, False, 400.0, 390.0), point(4096, False, 380.0, 390.0),
                                 point(1024, True, 100.0, 90.0), point(8192, True, 310.0, 300.0)])
    rows = lines[3:]
    assert len(rows) == 3  # causal at n < 8k has no target
    assert rows[0].startswith("| 370 |") and rows[0].endswith("| yes |")
    assert rows[1].endswith("| no |")  # above the target but slower than torch-flash
    assert rows[2].startswith("| 300 |") and rows[2].endswith("| yes |")


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not a dependency of cuflash")
def test_torch_sdpa_runs_through_dlpack_on_the_cpu(tmp_path):
    dev = Cpu()
    points = (Point("float32", 1, 2, 32, 32, 16, False), Point("float32", 1, 2, 16, 48, 16, True))
    preset = Preset(points, (), False, 1, 3, 64, budget_s=0.1)
    runners = runners_for(dev, (), ["naive", "torch-math"])
    meta = make_meta(dev, "torch", preset, "test", datetime.datetime.now())
    results = run_sweep(dev, preset, list(points), runners, tmp_path, meta, None)
    for p in results["points"]:
        math_ = next(r for r in p["results"] if r["name"] == "torch-math")
        assert math_["status"] == "ok" and math_["max_abs_err"] < 1e-5, math_  # bottom-right causal for n != m


# ---------------------------------------------------------------------------------------------------------
# ncu


NCU_HEADER = ("ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
              "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value")
NCU_ROWS = (("0", "gemm", "(256, 1, 1)", "(8, 8, 1)", "dram__bytes_read.sum", "byte", "1,048,576"),
            ("0", "gemm", "(256, 1, 1)", "(8, 8, 1)", "dram__bytes_write.sum", "byte", "4096"),
            ("1", "softmax", "(128, 1, 1)", "(64, 1, 1)", "dram__bytes_read.sum", "Mbyte", "2.5"),
            ("1", "softmax", "(128, 1, 1)", "(64, 1, 1)", "dram__bytes_write.sum", "byte", "0"))


def ncu_line(fields):
    return ",".join(f'"{x}"' for x in fields)


# What ncu --csv prints: its own lines, then one row per kernel and metric.
NCU_CSV = "\n".join(
    ["==PROF== Connected to process 123 (python)", '==PROF== Profiling "gemm": 0%....50%....100% - 1 pass',
     ncu_line(NCU_HEADER)] +
    [ncu_line((i, "123", "python", "127.0.0.1", kernel, "1", "7", block, grid, "0", "9.0",
               "Command line profiler metrics", metric, unit, value))
     for i, kernel, block, grid, metric, unit, value in NCU_ROWS] +
    ["==PROF== Disconnected from process 123", ""])


def test_ncu_csv_is_summed_over_kernels():
    found = parse_ncu_csv(NCU_CSV)
    assert found["kernels"] == 2
    assert found["dram__bytes_read.sum"] == 1048576 + 2.5e6
    assert found["dram__bytes_write.sum"] == 4096
    assert found["total"] == 1048576 + 2.5e6 + 4096
    with pytest.raises(ValueError):
        parse_ncu_csv("==ERROR== ERR_NVGPUCTRPERM")


def test_ncu_models_come_from_cost():
    p = NCU_POINT
    models = ncu_models(p, (128, 64))
    bh = p.batch * p.heads
    assert models["cuflash"]["model"] == cost.kernel_traffic(bh, p.n, p.m, p.d, Br=128, Bc=64, lse=False).total
    assert models["cuflash"]["lower_bound"] < models["cuflash"]["model"] < models["naive"]["seed_model"]
    assert models["naive"]["model"] > models["naive"]["seed_model"]  # as written it makes more passes


def test_ncu_without_ncu_reports_why(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert ncu_measure(tmp_path / "ncu", timeout=5) == 1
    report = json.loads((tmp_path / "ncu" / "ncu.json").read_text())
    assert all(e["error"] == "ncu is not on PATH" for e in report["problems"].values())
    assert "measured by ncu beside the model" in (tmp_path / "ncu" / "ncu.md").read_text()


# ---------------------------------------------------------------------------------------------------------
# device_check.sh


def test_device_check_is_valid_bash():
    done = run(["bash", "-n", str(DEVICE_CHECK)])
    assert done.returncode == 0, done.stderr


def test_device_check_dry_run_lists_the_steps(tmp_path):
    out = tmp_path / "check"
    done = run(["bash", str(DEVICE_CHECK), "--dry-run", str(out)])
    assert done.returncode == 0, done.stderr
    steps = [line.split()[0] for line in done.stdout.splitlines()[1:]]
    assert steps == ["env", "tests", "tests-ptx", "tests-patterns", "demo", "sweep", "backward", "patterns",
                     "sequences", "ncu", "profile"]
    limits = [int(line.split()[1].rstrip("s")) for line in done.stdout.splitlines()[1:]]
    assert sum(limits) <= 600  # the whole stays under 10 minutes
    assert "-m gpu" in done.stdout and "--preset short" in done.stdout and "--ncu" in done.stdout
    assert "-m bench.backward --gpu" in done.stdout
    assert "-k mod or pattern or block_mask or sink or varlen or paged" in done.stdout
    assert "-m bench.patterns --backend cupy" in done.stdout and "-m bench.sequences --gpu" in done.stdout
    assert "-m bench.emulator_profile --ncu" in done.stdout
    assert not out.exists()


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU driver")
def test_device_check_without_a_gpu_stops_with_a_summary(tmp_path):
    done = run(["bash", str(DEVICE_CHECK), str(tmp_path)])
    assert done.returncode == 2, done.stdout + done.stderr
    summary = (tmp_path / "summary.md").read_text()
    assert "no CUDA GPU here" in summary and "| step | exit | seconds | log | note |" in summary


def test_the_planners_choice_is_recorded_per_point(monkeypatch):
    """Decoding points get other tiles and split keys than the tensor-core targets: the record says which."""
    from cuflash import tiling
    h100 = tiling.DeviceLimits.known("H100")
    monkeypatch.setattr(tiling.DeviceLimits, "of", classmethod(lambda cls, device=None: h100))
    decoding = decode("float16", 128, (32768,))[0]
    assert heuristic_plan(decoding) == ((8, 32), 8)  # 16 heads: 16 blocks, 8 splits in one wave
    assert heuristic_plan(PRESETS["fa2"].points[0]) == ((128, 128), 1)  # d = 64: two m16 tiles per warp, 128 keys
    assert plan_note({"block": (8, 32), "splits": 8}) == "8x32, 8 splits"
    assert plan_note({"block": (128, 64), "splits": 1}) == "128x64"
    assert plan_note({"block": None}) == ""
