"""Inputs a new user met: each class of them, on the numpy and simt backends (both kernels), held to the reference.

Window sides of any size, byte orders NumPy accepts, numpy.ma arrays, a -inf bias hiding a key that holds NaN,
scalars and flags as NumPy takes them, DeviceLimits.of() without CuPy, python -m cuflash at every legal size and
a one-line error for every bad one, and the public API's types."""

import subprocess
import sys

import numpy as np
import pytest

import cuflash
from cuflash import BlockConfig
from cuflash.__main__ import main
from reference import assert_accurate
from strategies import randn

BIG = np.iinfo(np.int64).max


@pytest.fixture(params=["numpy", "simt-fma", "simt-mma"])
def run(request):
    """attention on one backend and kernel: the tensor-core kernel for float16, the CUDA-core one otherwise."""
    backend, _, kernel = request.param.partition("-")

    def call(q, k, v, **options):
        if kernel == "mma":
            q, k, v = (x.astype(np.float16) for x in (q, k, v))
        block = {"fma": BlockConfig(16, 16), "mma": BlockConfig.mma(32, 16, 2), "": None}[kernel]
        return cuflash.attention(q, k, v, backend=backend, block=block, return_lse=True, **options), (q, k, v)
    return call


@pytest.mark.parametrize("window", [(2, BIG), (BIG, 0), (2**63, 0), (2**70, -(2**70)), (-(2**63), None),
                                    (None, 2**63), (3, 40 + 37), (3, 40 + 36)])
def test_window_sides_of_any_size(run, window):
    """A side at or past n + m reaches past every key (unbounded); one at or below -(n + m) hides every key."""
    (out, lse), (q, k, v) = run(randn(0, (40, 8)), randn(1, (37, 8)), randn(2, (37, 5)), window=window)
    assert_accurate(out, q, k, v, lse=lse, window=window)


def test_any_byte_order():
    """Big-endian operands (as FITS files hold them), bias and out= are taken as NumPy takes them."""
    q, k, v = randn(0, (2, 9, 8)), randn(1, (2, 11, 8)), randn(2, (2, 11, 4))
    bias = randn(3, (9, 11))
    big = [x.astype(x.dtype.newbyteorder(">")) for x in (q, k, v, bias)]
    for backend in ("numpy", "simt"):
        out = np.full((2, 9, 4), np.nan, dtype=">f4")
        result = cuflash.attention(*big[:3], bias=big[3], out=out, backend=backend)
        assert result is out and out.dtype == np.dtype(">f4")
        assert_accurate(out.astype(np.float32), q, k, v, bias=bias)
        assert cuflash.attention(q.astype(">f8"), k, v, backend=backend).dtype == np.float64


@pytest.mark.parametrize("where", ["q", "k", "v", "mask", "bias", "out"])
def test_masked_arrays_are_refused_with_a_pointer_to_mask(where):
    arrays = dict(q=randn(0, (4, 8)), k=randn(0, (5, 8)), v=randn(0, (5, 3)), mask=np.ones((4, 5), bool),
                  bias=np.zeros((4, 5), np.float32), out=np.zeros((4, 3), np.float32))
    arrays[where] = np.ma.masked_array(arrays[where], mask=np.zeros(arrays[where].shape, bool))
    q, k, v = arrays.pop("q"), arrays.pop("k"), arrays.pop("v")
    with pytest.raises(TypeError, match=rf"{where} is a numpy.ma masked array.*mask="):
        cuflash.attention(q, k, v, **arrays)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN + -inf in the reference
def test_a_minus_inf_bias_hides_its_key_like_the_mask(run):
    """NaN and inf in keys and values that only a -inf bias hides never reach the output (by selection, as with
    mask=), whether the bias hides a key from every row or from some rows."""
    n, m = 33, 47
    q, k, v = randn(0, (2, n, 16)), randn(1, (2, m, 16)), randn(2, (2, m, 8))
    bias = randn(3, (n, m))
    bias[:, [0, 20, 46]] = -np.inf  # hidden from every row
    bias[5:, 10] = -np.inf  # hidden from rows 5.. only
    k[:, [0, 20]] = np.nan
    v[:, [20, 46]] = np.inf
    v[:, 10] = np.nan  # reaches rows 0..4, which see key 10, and no other
    (out, lse), (q, k, v) = run(q, k, v, bias=bias, causal=True)
    assert np.isnan(out[:, :5]).any() and not np.isnan(out[:, 5:]).any()
    assert_accurate(out, q, k, v, lse=lse, bias=bias, causal=True)


def test_scalars_and_flags_like_numpy():
    q = randn(0, (4, 8))
    expected = cuflash.attention(q, q, q, scale=0.5)
    for scale in (np.array(0.5), np.float32(0.5), np.array(0.5, np.float16), 0.5):
        np.testing.assert_array_equal(cuflash.attention(q, q, q, scale=scale), expected)
    assert_accurate(expected, q, q, q, scale=0.5)
    with pytest.raises(ValueError, match="scale must be a finite real number, got a number of 401 digits"):
        cuflash.attention(q, q, q, scale=10**400)
    for scale in (np.array([0.5]), "0.5", True, 1j):
        with pytest.raises(TypeError, match="scale must be a real number"):
            cuflash.attention(q, q, q, scale=scale)
    for flag in ("causal", "return_lse"):
        for value in ("no", 1, None, np.array([True])):
            with pytest.raises(TypeError, match=f"{flag} must be True or False"):
                cuflash.attention(q, q, q, **{flag: value})
    out, lse = cuflash.attention(q, q, q, return_lse=np.True_, causal=np.False_)
    assert_accurate(out, q, q, q, lse=lse)


def test_device_limits_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy now fails as if it were not installed
    with pytest.raises(cuflash.BackendUnavailableError, match=r"needs CuPy.*DeviceLimits.known"):
        cuflash.DeviceLimits.of()


@pytest.mark.parametrize("argv", [["--n", "64", "--m", "32", "--causal"], ["--d", "0"], ["--heads", "0"],
                                  ["--n", "0"], ["--m", "0"], ["--batch", "0"], ["--n", "5", "--m", "0", "--causal"],
                                  ["--n", "40", "--m", "7", "--causal", "--d", "3", "--dtype", "float16"]])
def test_demo_runs_every_legal_size(argv, capsys):
    assert main(argv + ["--heads", "2"] if "--heads" not in argv else argv) == 0
    printed = capsys.readouterr().out
    assert "nan" not in printed and "check:" in printed


@pytest.mark.parametrize("argv, words", [(["--n", "-3"], "-3 is negative"), (["--d", "x"], "'x' is not an integer"),
                                         (["--heads", "-1"], "-1 is negative"),
                                         (["--backend", "gpu"], "invalid choice")])
def test_demo_refuses_bad_sizes_in_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_demo_says_why_a_backend_cannot_run(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert main(["--backend", "cupy", "--n", "8"]) == 2
    err = capsys.readouterr().err
    assert "backend 'cupy' is unavailable: CuPy is not installed" in err and len(err.strip().splitlines()) == 1


def test_public_api_is_typed(tmp_path):
    """py.typed ships, and mypy sees return_lse's overloads: an array, or a pair of arrays."""
    from importlib.resources import files
    assert files("cuflash").joinpath("py.typed").is_file()
    source = tmp_path / "use.py"
    source.write_text("import numpy as np\nimport cuflash\nq = np.ones((2, 3))\n"
                      "reveal_type(cuflash.attention(q, q, q, return_lse=True))\n"
                      "out, lse = cuflash.attention(q, q, q, return_lse=True, scale=np.float32(0.5), causal=np.True_,"
                      " precision='tf32')\n"
                      "cuflash.attention(q, q, q, causal='yes')\n")
    result = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), str(source)],
                            capture_output=True, text=True, timeout=300)
    assert 'Revealed type is "tuple[Any, Any]"' in result.stdout, result.stdout + result.stderr
    assert 'use.py:6: error: No overload variant of "attention"' in result.stdout, result.stdout  # causal='yes'
    assert result.stdout.count("error:") == 1, result.stdout
