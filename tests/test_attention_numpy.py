"""Properties of cuflash.attention on the NumPy backend against the float64 reference."""

from hypothesis import given, settings

from harness import check_case
from strategies import LENGTHS, cases

# Past the default key tile (512): the online softmax's rescaling across key tiles, under the default tiling.
KEY_LENGTHS = LENGTHS + (600, 1100, 1100)


@given(cases(key_lengths=KEY_LENGTHS))
def test_matches_reference(case):
    check_case(case, backend="numpy")


@given(cases(lengths=(1, 5, 33, 64, 97), head_dims=(1, 3, 16, 59), max_batch_dims=1))
@settings(max_examples=40)
def test_small_blocks_match_reference(case):
    """Tiny tiles exercise the online-softmax rescaling across many key tiles and straddling windows."""
    for block in ((1, 1), (7, 5), (16, 64)):
        check_case(case, backend="numpy", block=block)


@given(cases(masks=False, biases=False, mixed_dtypes=False))
def test_default_backend_is_numpy_for_numpy_arrays(case):
    check_case(case, backend=None)
