"""The geometry table each launch writes and the parameter struct every kernel takes are declared once
(launch.GEOMETRY, launch.PARAMS: NumPy structured dtypes); the compiler checks them against the C structs and enums
the kernels read, field by field. g++ evaluates the asserts (NVRTC has no offsetof); host and device lay out these
structs of 8-byte fields (and a last int) alike."""

import pytest

from cuflash import kernels, launch, simt, tiling
from cuflash.kernels import mods as kernel_mods

pytestmark = pytest.mark.skipif(not simt.available(), reason=str(simt.unavailable_reason()))


def test_geometry_table_layout_equals_the_kernels():
    asserts = launch.layout_asserts()
    structs = (launch.OPERAND_STRIDES, launch.GEOMETRY, launch.PAGES, launch.DROPPING, kernel_mods.TABLE,
               kernel_mods.VISITS, kernel_mods.ARGS) + \
        tuple(launch.PARAMS.values())
    every_field = sum(len(dtype.names) for dtype in structs)
    assert len(asserts) == 3 + len(launch.OPERANDS) + len(launch.FLAGS) + 3 + len(structs) + every_field
    drift = compiler_verdict(asserts)
    assert drift is None, f"launch.py's declared table differs from what the kernels read:\n{drift}"


def compiler_verdict(asserts, source="block.cuh"):
    """None when the kernel source compiles with the asserts after it; else the compiler's diagnostics."""
    try:
        simt.check(kernels.source(source) + "\n".join(asserts), source)
    except simt.CompileError as error:
        return str(error)
    return None


@pytest.mark.parametrize("drift", ["cuflash::kMaxBatchDims == 6", "(int)cuflash::kLse == 6", "kBiasHides == 64",
                                   "Geometry, split_out) == 904", "sizeof(cuflash::OperandStrides) == 64",
                                   "Params<double>, scale) == 392", "Params<__half>, flags) == 392",
                                   "Pages, stride_v) == 40",
                                   "mods::Args, error) == 632", "mods::Visits, owned) == 64",
                                   "cuflash::mods::kMaxTables == 8"])
def test_a_drifted_declaration_is_caught(drift):
    asserts = [a.replace(drift, drift[:-1] + "1", 1) for a in launch.layout_asserts()]
    assert sum(drift in a for a in launch.layout_asserts()) == 1
    assert "static assert" in compiler_verdict(asserts)


def test_the_table_is_what_the_launch_writes():
    import numpy as np
    table = np.zeros((), launch.GEOMETRY)
    assert launch.GEOMETRY.itemsize == 8 * (2 + launch.MAX_BATCH_DIMS + len(launch.OPERANDS) *
                                            (2 + launch.MAX_BATCH_DIMS) + 3)
    assert table.reshape(1).view(np.int64).shape == (launch.GEOMETRY.itemsize // 8,)


FAMILIES = sorted({family for families in tiling.FAMILIES_OF.values() for family in families}, key=repr)


def limit_asserts(family, drift=0):
    return [f'static_assert(({expr}) == {value + drift}, "{family.title}: {expr} == {value + drift}");'
            for expr, value in family.limits().items()]


@pytest.mark.parametrize("family", FAMILIES, ids=repr)
def test_every_limit_a_family_shares_with_its_kernel_holds(family):
    """Each limit is defined once in the family's description and once in its kernel's CUDA: a static_assert per
    pair, compiled after the kernel's source."""
    asserts = limit_asserts(family)
    assert asserts
    drift = compiler_verdict(asserts, family.source)
    assert drift is None, f"{family!r} and its kernel disagree on a limit:\n{drift}"


@pytest.mark.parametrize("family", FAMILIES[:1], ids=repr)
def test_a_drifted_limit_is_caught(family):
    assert "static assert" in compiler_verdict(limit_asserts(family, drift=1), family.source)
