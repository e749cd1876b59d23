"""The geometry table each launch writes is declared once (launch.GEOMETRY, a NumPy structured dtype); the
compiler checks it against the C structs and enums the kernels read, field by field. g++ evaluates the asserts
(NVRTC has no offsetof); host and device lay out these all-int64 structs alike."""

import pytest

from cuflash import kernels, launch, simt

pytestmark = pytest.mark.skipif(not simt.available(), reason=str(simt.unavailable_reason()))


def test_geometry_table_layout_equals_the_kernels():
    asserts = launch.layout_asserts()
    every_field = len(launch.OPERAND_STRIDES.names) + len(launch.GEOMETRY.names)
    assert len(asserts) == 2 + len(launch.OPERANDS) + len(launch.FLAGS) + 2 + every_field
    drift = compiler_verdict(asserts)
    assert drift is None, f"launch.py's declared table differs from what the kernels read:\n{drift}"


def compiler_verdict(asserts):
    """None when the kernels' headers compile with the asserts; else the compiler's diagnostics."""
    try:
        simt.check(kernels.source("forward_common.cuh") + "\n".join(asserts), "forward_common.cuh")
    except simt.CompileError as error:
        return str(error)
    return None


@pytest.mark.parametrize("drift", ["cuflash::kMaxBatchDims == 6", "(int)cuflash::kLse == 6", "kBiasHides == 64",
                                   "Geometry, split_out) == 904", "sizeof(cuflash::OperandStrides) == 64"])
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
