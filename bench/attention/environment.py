"""What a run records about where it ran: the repository, Python's and the packages' versions, the git commit,
the CPU model, the NVIDIA driver and CUDA versions, and the command as typed."""

from __future__ import annotations

import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[2]  # the repository, two folders above bench/attention/


def environment(dev) -> dict:
    env = {"python": platform.python_version(), "platform": platform.platform(), "numpy": np.__version__}
    if dev.gpu:
        try:
            import torch  # noqa: F401 - its CUDA and cuDNN versions belong in the record
        except ImportError:
            pass
    for module in ("cupy", "torch", "ml_dtypes", "cuflash"):
        env[module] = module_version(module)
    loaded = sys.modules.get("torch")
    if loaded is not None:
        env["torch_cuda"] = getattr(loaded.version, "cuda", None)
        try:
            env["cudnn"] = loaded.backends.cudnn.version()
        except Exception:  # noqa: BLE001
            env["cudnn"] = None
    env["git_commit"] = git_commit()
    env.update(dev.env())
    return env


DISTRIBUTIONS = {"cupy": ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy")}


def module_version(name) -> Optional[str]:
    """The version of a module, without importing a heavy one that this run does not use."""
    from importlib import metadata

    if name in sys.modules:
        return getattr(sys.modules[name], "__version__", "unknown")
    for dist in DISTRIBUTIONS.get(name, (name,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def git_commit() -> Optional[str]:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def command_line(argv) -> str:
    """The command as run, with paths inside the repository written relative to it."""
    def rel(arg):
        path = Path(arg)
        if path.is_absolute():
            try:
                return str(path.resolve().relative_to(ROOT))
            except ValueError:
                pass
        return arg

    return " ".join(["python", "-m", __package__] + [shlex.quote(rel(a)) for a in argv])


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def nvidia_smi_driver() -> Optional[str]:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"
