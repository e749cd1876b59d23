"""Hypothesis profiles: `ci` (derandomized, bounded, no deadline) is the default so a red run reproduces;
`fuzz` (many random examples) is for long runs by hand: HYPOTHESIS_PROFILE=fuzz python -m pytest tests.

And no quiet skips: with the test extra installed, a missing compiler or NVRTC fails the run at its start with
what to install, instead of letting whole modules skip and the suite go green on the NumPy backend alone.
Set CUFLASH_TESTS_ALLOW_MISSING=1 to run what can run anyway."""

import importlib.metadata
import importlib.util
import os
import sys

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))  # tests import reference and strategies by name

settings.register_profile(
    "ci", derandomize=True, max_examples=60, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "fuzz", max_examples=2000, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TEST_EXTRA_MARKER = "nvidia-cuda-cuobjdump"  # a package only the test extra installs


def test_extra_installed() -> bool:
    try:
        importlib.metadata.distribution(TEST_EXTRA_MARKER)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def missing_tools() -> list:
    """What the suite needs to prove the kernels and this machine lacks, each with what to install."""
    from cuflash import nvrtc, simt

    missing = []
    if not simt.available():
        missing.append(f"{simt.unavailable_reason()} (Debian: apt-get install g++)")
    else:
        for name, path in (("AddressSanitizer", simt.libasan_path()), ("ThreadSanitizer", simt.libtsan_path())):
            if path is None:
                missing.append(f"the C++ compiler's {name} runtime, for the emulator's memcheck and race modes "
                               f"(it comes with g++: apt-get install g++)")
    try:
        from cupy.cuda import nvrtc as binding
        binding.getVersion()
        if not nvrtc.include_dirs():
            missing.append("cuda_fp16.h for NVRTC (pip install -e '.[cuda12]', which brings nvidia-cuda-runtime-cu12)")
    except Exception as exc:  # no CuPy, or no NVRTC library
        missing.append(f"NVRTC through CuPy ({type(exc).__name__}: {exc}); pip install -e '.[test,cuda12]'")
    for module, what in (("torch", "PyTorch, for the cuflash.torch adapter's tests"),
                         ("transformers", "transformers, for the adapter's tests inside real models"),
                         ("distributed", "dask and distributed, for cuflash.dask's tests"),
                         ("sphinx", "Sphinx and the docs extra's tools, for the test that builds the documentation"),
                         ("sphinx_gallery", "sphinx-gallery, for the documentation's gallery"),
                         ("pydata_sphinx_theme", "the PyData Sphinx theme, for the documentation"),
                         ("numpydoc", "numpydoc, for the documentation's reference pages"),
                         ("myst_parser", "MyST, for the documentation's Markdown pages"),
                         ("matplotlib", "matplotlib, for the gallery's figures")):
        if importlib.util.find_spec(module) is None:
            missing.append(f"{what} (pip install -e '.[test]'; it pins torch's CPU build)")
    return missing


def pytest_sessionstart(session):
    if os.environ.get("CUFLASH_TESTS_ALLOW_MISSING") or not test_extra_installed():
        return
    missing = missing_tools()
    if missing:
        pytest.exit("the test extra is installed but the suite cannot prove the kernels here; missing:\n  - "
                    + "\n  - ".join(missing) + "\n(CUFLASH_TESTS_ALLOW_MISSING=1 runs what can run)", returncode=4)
