"""The forward kernel on the emulator (backend="simt"): the front door's properties against the float64
reference, with NaN-poisoned outputs, over dtypes, head dims, odd lengths, windows, masks, biases, broadcast and
strided views, block configurations and emulator schedules. Problems stay small: the emulator runs on the CPU."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
import cuflash.simt
from cuflash import BlockConfig
from harness import check_case
from strategies import Case, cases

pytestmark = pytest.mark.skipif(not cuflash.simt.available(), reason="the SIMT emulator needs g++")

LENGTHS = (0, 1, 7, 31, 64, 113, 150)
HEAD_DIMS = (1, 3, 59, 64, 111, 128)


@given(cases(lengths=LENGTHS, head_dims=HEAD_DIMS))
@settings(max_examples=50)
def test_matches_reference(case):
    check_case(case, backend="simt")
