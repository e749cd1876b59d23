"""The cupy backend's own code (cuflash/backends/cupy.py, the front door on CuPy arrays, DeviceLimits.of, the
launch path, python -m cuflash's GPU path) run on the CPU: a stand-in `cupy` module holds NumPy memory and runs
kernels on the SIMT emulator.

Only the stand-in differs from CuPy. Every call it answers has CuPy 14's signature and, where CuPy is stricter than
NumPy, CuPy's checks: RawModule takes options as a tuple and gets no -arch (CuPy appends its own), get_function
takes one of the name expressions, a launch takes grid and block tuples and converts arguments as CuPy's
_pointer does (arrays by pointer, Python int as long long, float as double, NumPy scalars by their type), the
dynamic shared memory above 48 KiB needs max_dynamic_shared_size_bytes first, implicit conversion to NumPy is an
error, and a launch on a device other than the arrays' fails (on a GPU it would be an illegal address).
"""

from __future__ import annotations

import contextlib
import operator
import sys
import time
import types

import ml_dtypes
import numpy as np
import pytest

import cuflash
import cuflash.simt
from cuflash import api, blockmask, kernels, launch, mods, tiling
from cuflash.backends import cupy as cupy_backend
from harness import check_case
from reference import assert_accurate
from strategies import Case, make_view

pytestmark = pytest.mark.skipif(not cuflash.simt.available(), reason="the SIMT emulator needs g++")

H100 = tiling.DeviceLimits.known("H100")
DEVICES = 2


# ----------------------------------------------------------------------------------------------------------------
# The stand-in cupy module


class _State:
    current = 0  # the current device (cudaGetDevice)
    bfloat16 = True  # whether this "CuPy" computes in bfloat16 (CuPy 14 does; 13 does not)
    launches = []  # (name, grid, block, shared_mem, device) of every kernel launch
    host_copies = 0  # host-to-device copies (asarray of host data)
    allocations = 0  # arrays made on the device (empty, zeros, host copies)
    device_syncs = 0  # cudaDeviceSynchronize calls


class MemoryPointer:
    def __init__(self, ptr, device_id):
        self.ptr = ptr
        self.device_id = device_id


class Device:
    """cupy.cuda.Device(device=None): a context manager making `id` the current device."""

    def __init__(self, device=None):
        if device is None:
            device = _State.current
        self.id = device.id if isinstance(device, Device) else operator.index(device)
        if not 0 <= self.id < DEVICES:
            raise RuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id}")
        self._saved = []

    def __enter__(self):
        self._saved.append(_State.current)
        _State.current = self.id
        return self

    def __exit__(self, *exc):
        _State.current = self._saved.pop()

    def use(self):
        _State.current = self.id

    def synchronize(self):
        _State.device_syncs += 1

    @property
    def compute_capability(self):
        return "90"

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


def _bf16_check(dtype):
    if dtype is not None and not _State.bfloat16 and np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16):
        raise TypeError("Unsupported dtype bfloat16")


class ndarray:
    """A CuPy array over NumPy memory, on one device."""

    def __init__(self, array, device_id):
        assert isinstance(array, np.ndarray)
        self._a = array
        self._device_id = device_id

    shape = property(lambda self: self._a.shape)
    ndim = property(lambda self: self._a.ndim)
    dtype = property(lambda self: self._a.dtype)
    strides = property(lambda self: self._a.strides)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    data = property(lambda self: MemoryPointer(self._a.ctypes.data, self._device_id))
    device = property(lambda self: Device(self._device_id))

    def __array__(self, *args, **kwargs):  # CuPy refuses implicit conversion
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    def _wrap(self, a):
        return ndarray(a, self._device_id)

    def __getitem__(self, key):  # an element is a 0-d array, as in CuPy
        return self._wrap(np.asarray(self._a[_unwrap(key)]))

    def __setitem__(self, key, value):
        self._a[_unwrap(key)] = value._a if isinstance(value, ndarray) else value

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        _bf16_check(dtype)
        _bf16_check(self.dtype)
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return self._wrap(self._a.astype(dtype, order=order, casting=casting or "unsafe", copy=True))

    def reshape(self, *shape, order="C"):
        return self._wrap(self._a.reshape(*shape, order=order))

    def copy(self, order="C"):
        return self._wrap(self._a.copy(order=order))

    def transpose(self, *axes):
        return self._wrap(self._a.transpose(*axes))

    def get(self, stream=None, order="C", out=None, blocking=True):
        return np.array(self._a, order=order, copy=True)

    def __repr__(self):
        return f"shim.ndarray({self._a!r}, device={self._device_id})"

    def max(self, axis=None, out=None, keepdims=False):
        return self._wrap(np.asarray(self._a.max(axis=axis, keepdims=keepdims)))

    def sum(self, axis=None, dtype=None, out=None, keepdims=False):
        return self._wrap(np.asarray(self._a.sum(axis=axis, dtype=dtype, keepdims=keepdims)))

    def min(self, axis=None, out=None, keepdims=False):
        return self._wrap(np.asarray(self._a.min(axis=axis, keepdims=keepdims)))

    def __neg__(self):
        return self._wrap(-self._a)

    def __abs__(self):
        return self._wrap(abs(self._a))

    def __invert__(self):
        return self._wrap(~self._a)

    def all(self, axis=None, out=None, keepdims=False):
        return self._wrap(np.asarray(self._a.all(axis=axis, keepdims=keepdims)))

    def ravel(self, order="C"):
        return self._wrap(self._a.ravel(order=order))

    def any(self, axis=None, out=None, keepdims=False):
        return self._wrap(np.asarray(self._a.any(axis=axis, keepdims=keepdims)))

    def tolist(self):
        return self._a.tolist()

    def __bool__(self):  # CuPy reads a one-element array back (a synchronization)
        return bool(self._a)

    def __int__(self):
        return int(self._a)

    def __float__(self):
        return float(self._a)

    __array_ufunc__ = None  # NumPy scalars and arrays defer to CuPy's operators, as with CuPy's own ndarray


def _elementwise(function, keywords=False):
    """A CuPy ufunc (or a function of arrays: keywords passed on): arrays of one device (the current one for
    scalars alone), no host arrays."""
    def apply(*args, out=None, **options):
        if any(isinstance(x, np.ndarray) for x in args + (out,)):
            raise TypeError("Unsupported type <class 'numpy.ndarray'>")
        assert keywords or not options, options
        _same_device(*args, *([out] if out is not None else []))
        if out is not None:  # in place, as CuPy's ufuncs take out=
            function(*(_unwrap(x) for x in args), out=out._a)
            return out
        device = next((x._device_id for x in args if isinstance(x, ndarray)), _State.current)
        return ndarray(np.asarray(function(*(_unwrap(x) for x in args), **options)), device)
    return apply


def _joined(function, arrays, axis):
    """cupy.stack and cupy.concatenate: arrays of one device."""
    arrays = list(arrays)
    if any(not isinstance(x, ndarray) for x in arrays):
        raise TypeError("Only cupy arrays can be joined")
    _same_device(*arrays)
    return arrays[0]._wrap(function([x._a for x in arrays], axis=axis))


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_"):
    _op = getattr(operator, _name)
    setattr(ndarray, f"__{_name.rstrip('_')}__", _elementwise(_op))
    if _name in ("add", "sub", "mul", "truediv", "floordiv", "mod"):
        setattr(ndarray, f"__r{_name}__", _elementwise(lambda a, b, _op=_op: _op(b, a)))

def _in_place(name):
    """x op= y in place, as CuPy does (Python's fallback would rebind x to a new array)."""
    def apply(self, other):
        _same_device(self, other)
        getattr(operator, name)(self._a, _unwrap(other))
        return self
    return apply


for _name in ("iadd", "isub", "imul", "itruediv"):
    setattr(ndarray, f"__{_name}__", _in_place(_name))

ndarray.__module__ = "cupy"  # what the front door routes by


def _unwrap(x):
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, tuple):
        return tuple(_unwrap(y) for y in x)
    return x


def _same_device(*arrays):
    ids = {a._device_id for a in arrays if isinstance(a, ndarray)}
    if len(ids) > 1:
        raise ValueError(f"The device where the array resides ({sorted(ids)}) is different from the current device")


def asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    _bf16_check(dtype)
    if isinstance(a, ndarray):
        if a._device_id != _State.current:  # CuPy copies across devices
            return ndarray(np.array(a._a, dtype=dtype, order="K", copy=True), _State.current)
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    host = np.array(a, dtype=dtype, order="C" if order is None else order, copy=True)
    _bf16_check(host.dtype)
    _State.host_copies += 1
    _State.allocations += 1
    return ndarray(host, _State.current)


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    return a.get(order=order) if isinstance(a, ndarray) else np.asarray(a, order=order)


def empty(shape, dtype=float, order="C"):
    _State.allocations += 1
    return ndarray(np.full(shape, np.nan if np.dtype(dtype).kind == "f" else 0, dtype=dtype, order=order),
                   _State.current)  # NaN: what was never written shows


def zeros(shape, dtype=float, order="C"):
    _State.allocations += 1
    return ndarray(np.zeros(shape, dtype=dtype, order=order), _State.current)


def broadcast_to(array, shape):
    if not isinstance(array, ndarray):
        raise TypeError(f"broadcast_to takes a cupy.ndarray, got {type(array).__name__}")
    return array._wrap(np.broadcast_to(array._a, shape))


def ascontiguousarray(a, dtype=None):
    return a._wrap(np.ascontiguousarray(a._a, dtype=dtype))


def may_share_memory(a, b, max_work=None):
    return a._device_id == b._device_id and np.may_share_memory(a._a, b._a)


def copyto(dst, src, casting="same_kind", where=None):
    if not isinstance(dst, ndarray):
        raise TypeError("copyto() argument 1 must be cupy.ndarray")
    _bf16_check(dst.dtype)
    _bf16_check(src.dtype)
    _same_device(dst, src)
    np.copyto(dst._a, src._a, casting=casting)


def pad(array, pad_width, mode="constant", **kwargs):
    return array._wrap(np.pad(array._a, pad_width, mode=mode, **kwargs))


def as_strided(x, shape=None, strides=None):
    return x._wrap(np.lib.stride_tricks.as_strided(x._a, shape=shape, strides=strides))


class CUDARuntimeError(RuntimeError):
    pass


def getDeviceProperties(device):
    device = operator.index(device)  # a Cython int argument
    if not 0 <= device < DEVICES:
        raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
    return {  # CuPy's keys; an H100's values
        "name": b"NVIDIA H100 80GB HBM3", "major": 9, "minor": 0, "multiProcessorCount": H100.sm_count,
        "sharedMemPerBlock": 49152, "sharedMemPerBlockOptin": H100.smem_per_block,
        "sharedMemPerMultiprocessor": H100.smem_per_sm, "regsPerMultiprocessor": 65536, "regsPerBlock": 65536,
        "maxThreadsPerMultiProcessor": 2048, "maxBlocksPerMultiProcessor": 32, "maxThreadsPerBlock": 1024,
        "reservedSharedMemPerBlock": 1024, "warpSize": 32, "maxGridSize": (2**31 - 1, 65535, 65535),
        "maxThreadsDim": (1024, 1024, 64), "totalGlobalMem": 80 * 2**30, "memoryClockRate": 2619000,
        "memoryBusWidth": 5120,
    }


class Stream:
    null = None

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self.ptr = 0 if null else id(self)
        self.device_id = _State.current

    capturing = False  # inside Stream.begin_capture() ... end_capture()

    def synchronize(self):
        if self.capturing:
            raise RuntimeError("cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing")

    def is_capturing(self):
        return self.capturing


Stream.null = Stream(null=True)


def get_current_stream(device_id=-1):
    return Stream.null


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def synchronize(self):
        pass


def get_elapsed_time(start_event, end_event):
    return (end_event._t - start_event._t) * 1e3  # milliseconds, as CuPy gives


# Kernels: CuPy's RawModule / RawKernel over the emulator's, with CuPy's argument conversion.

_POINTER_NUMPY_TYPES = {np.dtype(c).type for c in "?bhilqBHILQefdFD"}


def _pointer(x, device_id):
    """What CuPy's function._pointer makes of a launch argument, as the emulator takes it."""
    if x is None:
        return None
    if isinstance(x, ndarray):
        if x._device_id != device_id:
            raise RuntimeError(f"an array on device {x._device_id} passed to a kernel launched on device {device_id}: "
                               f"cudaErrorIllegalAddress on a GPU")
        return x._a
    if isinstance(x, np.ndarray):  # by value, size one only
        if x.size != 1:
            raise TypeError(f"You are trying to pass a numpy.ndarray of shape {x.shape} as a kernel parameter.")
        return x.reshape(())[()]
    if type(x) not in _POINTER_NUMPY_TYPES:
        if isinstance(x, int):  # bool too: CuPy tests int first
            return np.int64(x)
        if isinstance(x, float):
            return np.float64(x)
        raise TypeError(f"Unsupported type {type(x)}")
    return x


class RawKernel:
    def __init__(self, module, name):
        self._module = module
        self.name = name
        self._per_device = {}  # CuPy loads the module once per device; attributes are per device

    @property
    def kernel(self):
        dev = _State.current
        fn = self._per_device.get(dev)
        if fn is None:
            m = self._module
            sim = cuflash.simt.RawModule(code=m.code, options=emulator_options(m.options),
                                         name_expressions=list(m.name_expressions),
                                         max_dynamic_shared=H100.smem_per_block, filename=kernel_file(m.code))
            fn = self._per_device[dev] = sim.get_function(self.name)
        return fn

    max_dynamic_shared_size_bytes = property(
        lambda self: self.kernel.max_dynamic_shared_size_bytes,
        lambda self, value: setattr(self.kernel, "max_dynamic_shared_size_bytes", value))
    local_size_bytes = property(lambda self: (self.kernel, 0)[1])
    num_regs = property(lambda self: (self.kernel, 128)[1])
    shared_size_bytes = property(lambda self: (self.kernel, 0)[1])
    max_threads_per_block = property(lambda self: (self.kernel, 1024)[1])

    def __call__(self, grid, block, args, **kwargs):
        shared_mem = kwargs.pop("shared_mem", 0)
        kwargs.pop("stream", None)
        kwargs.pop("enable_cooperative_groups", None)
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
        for what, value in (("grid", grid), ("block", block)):
            if not isinstance(value, tuple):  # Function.__call__(tuple grid, tuple block, ...)
                raise TypeError(f"Argument '{what}' has incorrect type (expected tuple, got {type(value).__name__})")
        dev = _State.current
        converted = tuple(_pointer(a, dev) for a in args)
        _State.launches.append((self.name, grid, block, shared_mem, dev))
        self.kernel(grid, block, converted, shared_mem=operator.index(shared_mem))


def emulator_options(options):
    """NVRTC's options as the emulator takes them, without the -I to CUDA's headers (it has its own stand-ins,
    found first): the same build as the simt backend's, so the kernels other tests built serve here too."""
    return tuple(o for o in options if not o.startswith("-I"))


def kernel_file(code):
    """The kernel file whose assembled source `code` is, with the mods it carries (the name the simt backend
    builds it under)."""
    mods_text = generated_mods(code)
    return next((name for name in ("forward.cuh", "forward_mma.cuh", "backward.cuh", "backward_mma.cuh")
                 for paged in (False, True) if kernels.source(name, mods_text, paged) == code), "cuflash.cu")


def generated_mods(code):
    """The CUDA of the mods kernels.source placed in `code` ("" for none): its lines after their #line marker,
    up to the next #line."""
    lines = code.split("\n")
    marker = '#line 1 "generated mods (cuflash/kernels/mods.py)"'
    if marker not in lines:
        return ""
    start = lines.index(marker) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("#line "))
    return "\n".join(lines[start:end])


class RawModule:
    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=None):
        if (code is None) == (path is None):
            raise TypeError("Exactly one of `code` and `path` keyword arguments must be given.")
        if not isinstance(code, str) or not isinstance(options, tuple):  # Cython: str code, tuple options
            raise TypeError("RawModule takes code as str and options as a tuple")
        if any(o.startswith(("-arch", "--gpu-architecture")) for o in options):
            raise ValueError("CuPy appends -arch for the current device; another one fails in NVRTC")
        self.code, self.options = code, options
        self.name_expressions = tuple(name_expressions) if name_expressions is not None else None

    def get_function(self, name):
        if not self.name_expressions or name not in self.name_expressions:
            raise RuntimeError(f"CUDA_ERROR_NOT_FOUND: named symbol not found ({name!r} is no name expression)")
        kernel = RawKernel(self, name)
        kernel.kernel  # CuPy compiles and loads here
        return kernel


def make_shim():
    shim = types.ModuleType("cupy")
    shim.__version__ = "14.2.0"
    for name in ("ndarray", "asarray", "asnumpy", "empty", "zeros", "broadcast_to", "ascontiguousarray",
                 "may_share_memory", "copyto", "pad", "RawModule", "RawKernel"):
        setattr(shim, name, globals()[name])
    for name in ("where", "exp", "log", "isfinite", "matmul"):
        setattr(shim, name, _elementwise(getattr(np, name)))
    for name in sorted(mods.UNARY | mods.BINARY | {"divide", "trunc"}):  # CuPy's ufuncs a mod is evaluated with
        setattr(shim, name, _elementwise(getattr(np, name)))
    shim.swapaxes = lambda x, a, b: x._wrap(np.swapaxes(x._a, a, b))
    for name in ("minimum", "searchsorted", "cumsum", "take_along_axis", "argmax", "moveaxis"):
        setattr(shim, name, _elementwise(getattr(np, name), keywords=True))
    shim.get_default_memory_pool = lambda: types.SimpleNamespace(  # what the benchmarks read of CuPy's pool
        total_bytes=lambda: 0, free_bytes=lambda: 0, free_all_blocks=lambda: None)
    shim.full = lambda shape, value, dtype=None: ndarray(np.full(shape, _unwrap(value), dtype=dtype), _State.current)
    for name in ("stack", "concatenate"):
        setattr(shim, name, lambda arrays, axis=0, _f=getattr(np, name): _joined(_f, arrays, axis))
    shim.nonzero = lambda x: tuple(x._wrap(i) for i in np.nonzero(x._a))
    shim.arange = lambda *args, **kwargs: ndarray(np.arange(*args, **kwargs), _State.current)
    shim.inf = np.inf
    for name in ("bool_", "float16", "float32", "float64", "int32", "int64"):
        setattr(shim, name, getattr(np, name))
    shim.lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(as_strided=as_strided))
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: DEVICES, getDevice=lambda: _State.current, getDeviceProperties=getDeviceProperties,
        CUDARuntimeError=CUDARuntimeError, driverGetVersion=lambda: 12090, runtimeGetVersion=lambda: 12090)
    cuda = types.ModuleType("cupy.cuda")
    cuda.Device, cuda.runtime, cuda.Stream, cuda.Event = Device, runtime, Stream, Event
    cuda.get_current_stream, cuda.get_elapsed_time = get_current_stream, get_elapsed_time
    shim.cuda = cuda
    return shim


@contextlib.contextmanager
def installed(monkeypatch):
    """The stand-in as `cupy` while the context lasts (monkeypatch undoes it), with the caches of the real CuPy's
    objects emptied: compiled functions, device limits, resident tables and the bfloat16 probe."""
    shim = make_shim()
    monkeypatch.setitem(sys.modules, "cupy", shim)
    monkeypatch.setitem(sys.modules, "cupy.cuda", shim.cuda)
    monkeypatch.setattr(cupy_backend, "_functions", {})
    monkeypatch.setattr(cupy_backend, "_limits", {})
    monkeypatch.setattr(launch, "_resident", {})
    monkeypatch.setattr(launch, "_captured", set())
    api.cupy_bfloat16_problem.cache_clear()
    monkeypatch.setattr(_State, "current", 0)
    monkeypatch.setattr(_State, "bfloat16", True)
    monkeypatch.setattr(_State, "launches", [])
    try:
        yield shim
    finally:
        api.cupy_bfloat16_problem.cache_clear()


@contextlib.contextmanager
def stand_in():
    """installed() for a block of code (another test file's, or one hypothesis example's)."""
    with pytest.MonkeyPatch.context() as monkeypatch, installed(monkeypatch) as shim:
        yield shim


@pytest.fixture
def cupy(monkeypatch):
    with installed(monkeypatch) as shim:
        yield shim


# ----------------------------------------------------------------------------------------------------------------
# The tests


def _case(dtypes, shapes, options=None, views=None, out_kind="contiguous", seed=0):
    rng = np.random.default_rng(seed)
    views = views or ("contiguous",) * 3
    q, k, v = (make_view(rng, s, t, kind) for s, t, kind in zip(shapes, dtypes, views))
    return Case(q, k, v, dict(options or {}), out_kind)


F16, BF16, F32, F64 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float64)


def test_device_limits_read_through_cupy(cupy):
    limits = tiling.DeviceLimits.of(1)
    assert limits == tiling.DeviceLimits.of(cupy.cuda.Device(1))
    assert (limits.name, limits.compute_capability, limits.smem_per_block) == ("NVIDIA H100 80GB HBM3", (9, 0),
                                                                               H100.smem_per_block)
    assert (limits.sm_count, limits.smem_per_sm, limits.smem_reserved_per_block) == (132, 233472, 1024)


def test_backend_is_available_and_chosen_for_cupy_arrays(cupy):
    assert cupy_backend.unavailable() is None
    import cuflash.backends as registry
    assert registry.get(None, cupy) is cupy_backend


def test_float16_on_the_tensor_core_kernel(cupy):
    # d = 128: the planner's tiles need more than 48 KiB of shared memory, so the launch must opt in
    case = _case((F16,) * 3, ((2, 40, 128), (2, 70, 128), (2, 70, 128)), {"causal": True})
    check_case(case, backend="cupy", to_device=cupy.asarray)
    name, grid, block, shared_mem, dev = _State.launches[-1]
    assert name.startswith("cuflash::fwd_mma<__half") and shared_mem > 48 * 1024 and dev == 0


@pytest.mark.parametrize("dtype, precision, kernel", [(F32, "fma", "fwd<float,"), (F64, "fma", "fwd<double,"),
                                                      (F32, None, "fwd_mma<float,"), (F32, "tf32", "fwd_mma<float,"),
                                                      (F64, None, "fwd_mma<double,")])
def test_float32_float64_on_either_kernel(cupy, dtype, precision, kernel):
    """precision="fma": the CUDA-core kernel; otherwise the tensor cores (the emulated H100 has float64 ones)."""
    case = _case((dtype,) * 3, ((1, 2, 33, 59), (1, 2, 45, 59), (1, 2, 45, 24)),
                 views=("strided", "reversed", "offset"), out_kind="strided")
    check_case(case, backend="cupy", to_device=cupy.asarray, precision=precision)
    assert _State.launches[-1][0].startswith(f"cuflash::{kernel}")


def test_head_dims_past_the_largest_tile(cupy):
    """d in slices and e in column blocks: three launches over views of v and out, lse written by the first."""
    case = _case((F32,) * 3, ((2, 9, 530), (2, 21, 530), (2, 21, 1100)), {"causal": True}, out_kind="strided")
    check_case(case, backend="cupy", to_device=cupy.asarray)
    names = [launch[0] for launch in _State.launches[-3:]]
    assert names == ["cuflash::fwd<float, 16, 32, 512, 512, 8, true>"] * 3


def test_split_keys_for_decoding(cupy):
    """One query per head over many keys: split keys, partial results in float32 scratch, merged with CuPy ops."""
    case = _case((F16,) * 3, ((2, 2, 1, 64), (2, 1, 1500, 64), (2, 1, 1500, 64)), {"causal": True})
    check_case(case, backend="cupy", to_device=cupy.asarray)
    name, grid, *_ = _State.launches[-1]
    assert name == "cuflash::fwd<__half, 8, 32, 64, 64, 4, false, true, 2>" and grid[0] == 2  # 2 splits x 1 tile


def test_mask_bias_window_and_grouped_query_heads(cupy):
    rng = np.random.default_rng(3)
    # GQA: 4 query heads share 2 key/value heads through a size-1 axis; a broadcast mask and a float16 bias.
    q = rng.standard_normal((2, 2, 2, 30, 32)).astype(np.float16)
    k = rng.standard_normal((2, 2, 1, 50, 32)).astype(np.float16)
    v = make_view(rng, (2, 2, 1, 50, 32), F16, "stride0")
    mask = rng.random((30, 50)) < 0.8
    bias = rng.standard_normal((2, 1, 1, 30, 50)).astype(np.float16)
    case = Case(q, k, v, {"mask": mask, "bias": bias, "window": (20, 3), "causal": True}, "reversed")
    check_case(case, backend="cupy", to_device=cupy.asarray)


def test_bfloat16_and_a_cast_out(cupy):
    case = _case((BF16,) * 3, ((3, 17, 64), (3, 29, 64), (3, 29, 64)), {"bias": np.zeros((17, 29), np.float32)})
    check_case(case, backend="cupy", to_device=cupy.asarray)
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((9, 16)).astype(ml_dtypes.bfloat16) for _ in range(3))
    out = cupy.zeros((9, 16), dtype=np.float32)  # another dtype: a scratch result is cast into it
    assert cuflash.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), out=out) is out
    result = out.get()
    np.testing.assert_array_equal(result, result.astype(ml_dtypes.bfloat16).astype(np.float32))  # bf16 values
    assert_accurate(result.astype(ml_dtypes.bfloat16), q, k, v)


def test_bfloat16_without_cupy_support_is_a_clear_error(cupy):
    q = cupy.asarray(np.zeros((4, 16), np.float16))
    bias = cupy.asarray(np.zeros((4, 4), ml_dtypes.bfloat16))
    _State.bfloat16 = False  # now an array this CuPy can hold but not compute on, as CuPy 13's
    with pytest.raises(TypeError, match=r"attention: this CuPy cannot compute in bfloat16"):
        cuflash.attention(q, q, q, bias=bias)


def test_out_overlapping_an_input(cupy):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 8, 16)).astype(np.float32)
    q = cupy.asarray(x)
    result = cuflash.attention(q, q, q, out=q)  # computed into a scratch array, then copied
    assert result is q
    assert_accurate(result.get(), x, x, x)


def test_repeated_calls_copy_nothing_to_the_device(cupy):
    """The launch's geometry table is made once per device: a loop of
    calls with the same shapes neither blocks on a host-to-device copy nor allocates beyond its own output."""
    rng = np.random.default_rng(3)
    q, k, v = (cupy.asarray(rng.standard_normal((2, 8, 16)).astype(np.float32)) for _ in range(3))
    first = cuflash.attention(q, k, v)
    copies, allocations = _State.host_copies, _State.allocations
    again = cuflash.attention(q, k, v)
    assert (_State.host_copies - copies, _State.allocations - allocations) == (0, 1)  # the new output alone
    np.testing.assert_array_equal(again.get(), first.get())
    with cupy.cuda.Device(1):  # another device gets its own copies
        q1, k1, v1 = (cupy.asarray(x.get()) for x in (q, k, v))
        copies = _State.host_copies
        np.testing.assert_array_equal(cuflash.attention(q1, k1, v1).get(), first.get())
        assert _State.host_copies - copies >= 1
    assert all(array.device.id == device for (device, *_), array in launch._resident.items())


def test_graph_capture_needs_a_warm_up_call(cupy, monkeypatch):
    """A call with new shapes copies its geometry table to the device, which a CUDA graph cannot capture: a clear
    error says to warm up first; after a warm-up the same call records only launches."""
    rng = np.random.default_rng(4)
    q, k, v = (cupy.asarray(rng.standard_normal((2, 8, 16)).astype(np.float32)) for _ in range(3))
    monkeypatch.setattr(Stream, "capturing", True)
    with pytest.raises(RuntimeError, match="make one call outside the capture first"):
        cuflash.attention(q, k, v)
    monkeypatch.setattr(Stream, "capturing", False)
    warm = cuflash.attention(q, k, v)
    monkeypatch.setattr(Stream, "capturing", True)
    copies = _State.host_copies
    np.testing.assert_array_equal(cuflash.attention(q, k, v).get(), warm.get())
    assert _State.host_copies == copies


def test_resident_tables_outlive_every_launch_that_may_read_them(cupy, monkeypatch):
    """Evicting a kept geometry table waits for its device first (a kernel queued on another stream may still
    read it), and a table that a graph capture used is never evicted (every replay reads it)."""
    monkeypatch.setattr(launch, "RESIDENT_LIMIT", 4)
    monkeypatch.setattr(launch, "_captured", set())
    rng = np.random.default_rng(9)

    def call(n):
        q, k, v = (cupy.asarray(rng.standard_normal((2, n, 16)).astype(np.float32)) for _ in range(3))
        return cuflash.attention(q, k, v)

    call(8)  # the warm-up
    monkeypatch.setattr(Stream, "capturing", True)
    call(8)  # captured: its tables now belong to a graph
    monkeypatch.setattr(Stream, "capturing", False)
    held = set(launch._captured)
    assert held and held <= set(launch._resident)
    syncs, free = _State.device_syncs, 4 - len(launch._resident)
    for n in range(9, 20):  # new shapes: each a new table, past the limit
        call(n)
    assert held <= set(launch._resident) and len(launch._resident) <= 4
    assert _State.device_syncs - syncs >= 11 - free  # an eviction per table past the limit, each after a synchronize


def test_operands_on_another_device_run_there(cupy):
    rng = np.random.default_rng(8)
    with cupy.cuda.Device(1):
        q, k, v = (cupy.asarray(rng.standard_normal((2, 8, 16)).astype(np.float32)) for _ in range(3))
    assert _State.current == 0
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    assert out.device.id == lse.device.id == 1 and _State.launches[-1][-1] == 1
    assert _State.current == 0
    assert_accurate(out.get(), q.get(), k.get(), v.get(), lse=lse.get())


def test_operands_on_two_devices_are_refused(cupy):
    q = cupy.asarray(np.zeros((8, 16), np.float32))
    with cupy.cuda.Device(1):
        k = cupy.asarray(np.zeros((8, 16), np.float32))
    with pytest.raises(ValueError, match=r"attention: operands are on different devices"):
        cuflash.attention(q, k, q)


def test_python_m_cuflash_on_the_gpu_path(cupy, capsys):
    from cuflash import __main__ as demo
    args = ["--heads", "2", "--n", "96", "--d", "64", "--causal", "--check-rows", "8"]
    assert demo.main(args) == 0
    text = capsys.readouterr().out
    assert "backend: cupy on NVIDIA H100 80GB HBM3" in text and "float16" in text


def test_harness_keeps_views_on_the_device(cupy):
    from harness import on_device, poisoned_out
    rng = np.random.default_rng(9)
    for x in (poisoned_out((2, 5, 6), F32, "strided"), poisoned_out((2, 5, 6), F16, "reversed"),
              make_view(rng, (3, 4, 7), F64, "stride0"), make_view(rng, (3, 4, 7), BF16, "transposed")):
        moved = on_device(x, cupy.asarray)
        assert moved.strides == x.strides
        np.testing.assert_array_equal(moved.get(), x)


# ----------------------------------------------------------------------------------------------------------------
# The backward on CuPy arrays: the backward kernels (the simt backend runs the same source and plans on NumPy
# arrays), and past their head dims the blocked path on the array library's matmul


def _backward_case(rng, d):
    q = rng.standard_normal((2, 4, 30, d)).astype(np.float32)
    k = rng.standard_normal((2, 1, 300, d)).astype(np.float32)  # grouped-query heads, several key tiles
    v = rng.standard_normal((2, 1, 300, 8)).astype(np.float32)
    mask = rng.random((30, 300)) < 0.9
    bias = rng.standard_normal((4, 30, 300)).astype(np.float32)
    k[..., 5, :], v[..., 6, :] = np.nan, np.inf
    mask[:, 5:7] = False  # hidden non-finite keys and values
    options = dict(mask=mask, bias=bias, causal=True, window=(200, None))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    return (dout, q, k, v, out, lse), options


@pytest.mark.parametrize("d, twin", [(16, "simt"), (300, "numpy")])
def test_backward_on_cupy_arrays_bit_for_bit(cupy, d, twin):
    """d = 16: the kernels (float32's on tensor cores), the same bits as the simt backend's; d = 300, past the
    kernels: the blocked path, the same bits as the numpy backend's."""
    from reference import assert_grads_accurate
    arrays, options = _backward_case(np.random.default_rng(21), d)
    expected = cuflash.attention_backward(*arrays, bias_grad=True, backend=twin, **options)
    device_options = dict(options, mask=cupy.asarray(options["mask"]), bias=cupy.asarray(options["bias"]))
    before = len(_State.launches)
    grads = cuflash.attention_backward(*(cupy.asarray(x) for x in arrays), bias_grad=True, **device_options)
    kernels = {name.split("<")[0] for name, *_ in _State.launches[before:]}
    assert kernels == ({"cuflash::bwd_mma_dq", "cuflash::bwd_mma_dkdv"} if twin == "simt" else set())  # 3xTF32
    assert all(isinstance(g, cupy.ndarray) for g in grads)
    for got, want in zip(grads, expected):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert got.get().tobytes() == want.tobytes()
    assert_grads_accurate([g.get() for g in grads], *arrays[:4], **options)


def test_patterns_through_the_kernels_on_cupy_arrays(cupy):
    """Mods closing over host arrays (read as device tables), device sinks and a block mask: the cupy backend runs
    the same kernels as the simt backend, forward and backward, with the same bits; a read past a captured array
    is its IndexError (a score_mod's flagged by the kernels, a mask_mod's found building its block mask)."""
    rng = np.random.default_rng(31)
    q, k, v = (rng.standard_normal((2, 3, length, 16)).astype(np.float16) for length in (40, 56, 56))
    ids, slopes = np.sort(rng.integers(0, 3, 56)), rng.random(3)
    made = cuflash.block_mask(mods.documents(ids), (2, 3), 40, 56, block=(16, 16))
    sinks = rng.standard_normal(3).astype(np.float32)
    options = dict(score_mod=mods.alibi(slopes), block_mask=made, causal=True)
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend="simt", sinks=sinks, **options)
    dout = rng.standard_normal(out.shape).astype(np.float16)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="simt", sinks=sinks, **options)
    device = [cupy.asarray(x) for x in (dout, q, k, v)]
    before = len(_State.launches)
    got, got_lse = cuflash.attention(*device[1:], return_lse=True, sinks=cupy.asarray(sinks), **options)
    got_grads = cuflash.attention_backward(*device, got, got_lse, sinks=cupy.asarray(sinks), **options)
    kernels = {name.split("<")[0] for name, *_ in _State.launches[before:]}
    assert kernels == {"cuflash::fwd_mma", "cuflash::bwd_mma_dq", "cuflash::bwd_mma_dkdv"}
    for a, b in zip((got, got_lse) + got_grads, (out, lse) + grads):
        assert a.get().tobytes() == b.tobytes()
    launched = len(_State.launches)
    with pytest.raises(IndexError, match="score_mod: an index is out of bounds for table0"):  # the kernels' flag
        cuflash.attention(*device[1:], score_mod=lambda s, b, h, i, j: s + ids[i + 20])
    assert len(_State.launches) > launched
    with pytest.raises(IndexError, match="mask_mod: index 56 is out of bounds for axis 0 of table0"):
        cuflash.attention(*device[1:], mask_mod=lambda b, h, i, j: ids[i + 20] < 2)  # its block mask's build


def test_a_mask_mod_alone_gets_a_block_mask_made_on_the_arrays_device(cupy, monkeypatch):
    """mask_mod= alone on CuPy arrays: a block mask is made with CuPy on the arrays' device, once, and the kernels
    visit only the tiles it shows: one made to hide a tile the pattern shows (a lie the kernels cannot see
    through) gives the simt backend's bits through that mask, and not the honest result."""
    rng = np.random.default_rng(32)
    q, k, v = (rng.standard_normal((1, 2, 256, 16)).astype(np.float16) for _ in range(3))
    pattern = mods.documents(np.sort(rng.integers(0, 3, 256)))
    honest = cuflash.attention(q, k, v, mask_mod=pattern, causal=True, backend="simt")
    made = []
    real = blockmask._from_mod

    def lying(*args):
        mask = real(*args)
        kinds = mask.kinds.copy()
        kinds[tuple(np.argwhere(kinds != blockmask.HIDDEN)[-1])] = blockmask.HIDDEN  # the last row tile's last
        made.append((args[-1], blockmask.BlockMask(kinds, mask.shape, mask.block, mask.mask_mod,
                                                   function=mask.function)))
        return made[-1][1]
    monkeypatch.setattr(blockmask, "_from_mod", lying)
    monkeypatch.setattr(blockmask, "_cache", type(blockmask._cache)())
    with cupy.cuda.Device(1):
        device = [cupy.asarray(x) for x in (q, k, v)]
    got = [cuflash.attention(*device, mask_mod=pattern, causal=True) for _ in range(2)]
    assert [xp for xp, _ in made] == [cupy] and _State.launches[-1][-1] == 1  # made once, with CuPy
    expected = cuflash.attention(q, k, v, block_mask=made[0][1], causal=True, backend="simt")
    assert got[0].get().tobytes() == got[1].get().tobytes() == expected.tobytes()
    assert not np.array_equal(expected, honest)


def test_packed_sequences_on_cupy_arrays(cupy):
    """attention_varlen on CuPy arrays with host offsets (copied to the device) and device sinks: the same kernels
    and bits as the simt backend, forward and backward; bad device offsets are found by one reduction."""
    from test_varlen import mods_of, packed
    queries, keys = [5, 0, 21, 3], [7, 4, 18, 0]
    q, k, v, cu_q, cu_k = packed(41, queries, keys, (4, 2), 16, 16, np.float16)
    score_mod, mask_mod, _ = mods_of((4, 2), len(queries))
    sinks = np.linspace(-1, 1, 4).astype(np.float32)
    options = dict(score_mod=score_mod, mask_mod=mask_mod, causal=True)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, backend="simt", sinks=sinks, **options)
    dout = np.random.default_rng(42).standard_normal(out.shape).astype(np.float16)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, backend="simt", sinks=sinks,
                                              **options)
    device = [cupy.asarray(x) for x in (dout, q, k, v)]
    before = len(_State.launches)
    got, got_lse = cuflash.attention_varlen(*device[1:], cu_q, cupy.asarray(cu_k), return_lse=True,
                                            sinks=cupy.asarray(sinks), **options)
    got_grads = cuflash.attention_varlen_backward(*device, got, got_lse, cupy.asarray(cu_q), cu_k,
                                                  sinks=cupy.asarray(sinks), **options)
    kernels = {name.split("<")[0] for name, *_ in _State.launches[before:]}
    assert kernels == {"cuflash::fwd_mma", "cuflash::bwd_mma_dq", "cuflash::bwd_mma_dkdv"}
    for a, b in zip((got, got_lse) + got_grads, (out, lse) + grads):
        assert isinstance(a, cupy.ndarray) and a.get().tobytes() == b.tobytes()
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        cuflash.attention_varlen(*device[1:], cu_q, cupy.asarray(np.array([0, 11, 7, 29, 29])))
    with pytest.raises(TypeError, match="cu_seqlens_q is a CuPy array but q, k and v are NumPy arrays"):
        cuflash.attention_varlen(q, k, v, cupy.asarray(cu_q), cu_k)


def test_paged_cache_on_cupy_arrays(cupy):
    """attention_paged on CuPy caches with a host page table (copied to the device) and device lengths: the new rows
    land in the device caches, and the paged kernels (split keys too) give the simt backend's bits; a bad page id
    is found on the device (one reduction read back) before anything is written."""
    from test_paged import paged_case
    q, k_cache, v_cache, table, cached, k_new, v_new = paged_case(17, 3, [20, 0, 37], 1, 1, (4, 2), 16, 16,
                                                                  np.float16, spare=0)
    device = [cupy.asarray(x) for x in (q, k_cache, v_cache, k_new, v_new)]
    for splits in (None, 2):
        k_host, v_host = k_cache.copy(), v_cache.copy()
        out, lse = cuflash.attention_paged(q, k_host, v_host, table, cached, k_new=k_new, v_new=v_new,
                                           backend="simt", num_splits=splits, return_lse=True)
        k_dev, v_dev = device[1].copy(), device[2].copy()
        before = len(_State.launches)
        got, got_lse = cuflash.attention_paged(device[0], k_dev, v_dev, table, cupy.asarray(cached),
                                               k_new=device[3], v_new=device[4], num_splits=splits, return_lse=True)
        kernels = {name.split("<")[0] for name, *_ in _State.launches[before:]}
        assert kernels == ({"cuflash::fwd_mma"} if splits is None else {"cuflash::fwd"})  # forced splits: decoding
        assert got.get().tobytes() == out.tobytes() and got_lse.get().tobytes() == lse.tobytes()
        assert k_dev.get().tobytes() == k_host.tobytes() and v_dev.get().tobytes() == v_host.tobytes()
    bad = table.copy()
    bad[2, 0] = 99
    with pytest.raises(ValueError, match=r"block_table\[2, 0\] = 99 is not a page"):
        cuflash.attention_paged(device[0], device[1], device[2], cupy.asarray(bad), cached, k_new=device[3],
                                v_new=device[4])
    assert device[1].get().tobytes() == k_cache.tobytes()  # nothing written


def test_dropout_on_cupy_arrays(cupy):
    """attention and attention_backward with dropout on CuPy arrays: the planner's dropout kernels (not the blocked
    algorithm) give the simt backend's bits, forward and backward."""
    rng = np.random.default_rng(31)
    q, k, v = (rng.standard_normal((2, length, 32)).astype(np.float16) for length in (40, 70, 70))
    options = dict(causal=True, dropout_p=0.2, seed=2**50 + 99)
    out, lse = cuflash.attention(q, k, v, backend="simt", return_lse=True, **options)
    dout = rng.standard_normal(out.shape).astype(np.float16)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="simt", **options)
    device = [cupy.asarray(x) for x in (q, k, v, dout)]
    before = len(_State.launches)
    got, got_lse = cuflash.attention(*device[:3], return_lse=True, **options)
    got_grads = cuflash.attention_backward(device[3], *device[:3], got, got_lse, **options)
    assert {name.split("<")[0] for name, *_ in _State.launches[before:]} == \
        {"cuflash::fwd_mma", "cuflash::bwd_mma_dq", "cuflash::bwd_mma_dkdv"}
    assert got.get().tobytes() == out.tobytes() and got_lse.get().tobytes() == lse.tobytes()
    assert all(g.get().tobytes() == w.tobytes() for g, w in zip(got_grads, grads))


def test_the_sequences_benchmark_on_the_gpu_path(cupy, tmp_path):
    """bench.sequences --gpu --tiny through the stand-in: CuPy arrays, event timing, the HBM share from the device's
    memory clock and bus width (the timings mean nothing here)."""
    import json
    from bench import sequences
    assert sequences.main(["--tiny", "--gpu", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    packed, decode = report["records"]
    assert report["backend"] == "cupy" and decode["dtype"] == "float16" and "hbm_fraction" in decode
    assert packed["max_abs_difference"] < 1e-2 and decode["max_abs_difference"] < 1e-2
