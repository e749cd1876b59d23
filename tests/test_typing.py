"""The package's type information holds: mypy finds no error in cuflash/, and every public name's annotations resolve
at run time (typing.get_type_hints: no name hidden behind TYPE_CHECKING, no forward reference left dangling)."""

import importlib
import inspect
import subprocess
import sys
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_MODULES = ("cuflash", "cuflash.torch", "cuflash.dask")


def test_the_package_is_mypy_clean(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "cuflash"],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0 and "Success: no issues found" in result.stdout, result.stdout + result.stderr


def public_names():
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
        for name in names:
            obj = getattr(module, name)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__.startswith("cuflash"):
                yield f"{module_name}.{name}", obj


@pytest.mark.parametrize("name, obj", list(public_names()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_public_name_has_hints_that_resolve(name, obj):
    typing.get_type_hints(obj)
    if inspect.isclass(obj):
        for _, method in inspect.getmembers(obj, inspect.isfunction):
            typing.get_type_hints(method)


def test_the_public_names_are_the_ones_the_readme_documents():
    names = [name for name, _ in public_names()]
    assert {"cuflash.attention", "cuflash.attention_backward", "cuflash.merge", "cuflash.BlockConfig",
            "cuflash.DeviceLimits", "cuflash.torch.attention", "cuflash.dask.attention"} <= set(names)
