"""A CPU stand-in for CuPy that is as strict as CuPy about devices: the ``strict`` device of the
tests' ``xp`` fixture.

On a machine without a GPU every array of the suite is a NumPy array, so a test that hands a
device array to ``np.testing``, or widens one with ``np.asarray``, passes here and fails on the
first GPU (the first GPU run found 22 such tests). Installed as the ``cupy`` module for one test
(:func:`installed`), this module makes the library take its CUDA paths (``device="cuda"``, its
arrays, its kernel loader, its launch limits) with every array living in host memory, and the
kernels run on cupaged's CPU backend underneath. Its arrays behave as CuPy's do where a test or
the library can go wrong:

- They are not NumPy arrays and refuse implicit conversion to one: ``np.asarray(x)``,
  ``np.testing.assert_allclose(x, ...)``, ``np.array([x])`` raise CuPy's ``TypeError``. The way
  to the host is explicit: ``x.get()``, ``cupy.asnumpy(x)``, ``cupaged.to_numpy(x)``.
- Arithmetic, ufuncs and NumPy functions mixing them with NumPy arrays raise ``TypeError``, as
  CuPy's do (NumPy and Python scalars are fine); uploads are explicit (``cupy.asarray``), except
  where CuPy uploads itself: values assigned into an array and index arrays.
- Reductions and scalar indexing give 0-d arrays, not NumPy scalars; ``x.flags`` has CuPy's
  fields only (no ``writeable``); there is no ``ctypes``, ``tobytes`` or buffer protocol.
- A kernel (``cupy.RawModule(code=...).get_function(name)``) refuses NumPy array arguments and a
  launch asking for more dynamic shared memory than it was opted into
  (``max_dynamic_shared_size_bytes``), as the CUDA driver does.

The "device" reports the limits of the CPU backend's nominal GPU (``NOMINAL_TARGET``: sm_90, its
multiprocessors and shared memory), so that its launch plans pick the kernels the CPU backend
runs, and its version is 14.2 (native bfloat16 arrays, as on the GPU run that found the bugs):
like CuPy, it has no array of a dtype without a C type (fp8 crosses as ``uint8`` bytes).
What it does not model: streams and asynchrony (every call completes at once), several
devices, DLPack export. It models stream capture (``Stream.begin_capture`` / ``end_capture``,
``Graph.launch``) as CUDA's rules have it: while a stream captures, a kernel launch is recorded,
not run (it holds its arrays, as a graph holds their addresses), and what a capture may not do
raises: an allocation (an array that owns new memory), a host read (``get``, ``asnumpy``,
``int()`` / ``bool()`` / ``float()`` of an array), an upload of host data.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import types
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np

__version__ = "14.2.0"

_IMPLICIT = (
    "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
    "NumPy array explicitly."
)
_DL_CUDA = 2  # DLPack's kDLCUDA: what a CuPy array reports


def _device_value(x: Any) -> Any:
    """``x`` as NumPy sees it inside this module: a stand-in array's host array, a sequence of
    them element by element, anything else as it is; a NumPy array is refused, as CuPy refuses
    one beside its own arrays."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, np.ndarray):
        raise TypeError(f"Unsupported type {type(x)}")
    if isinstance(x, (list, tuple)):
        return type(x)(_device_value(item) for item in x)
    return x


def _device_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {name: _device_value(value) for name, value in kwargs.items()}


def _wrap(result: Any) -> Any:
    """A NumPy result as the stand-in's: arrays and NumPy scalars (CuPy's reductions give 0-d
    arrays) become stand-in arrays, the arrays of a tuple or list each alike."""
    if isinstance(result, np.ndarray):
        return ndarray._of(result)
    if isinstance(result, np.generic):
        return ndarray._of(np.asarray(result))
    if isinstance(result, (tuple, list)):
        return type(result)(_wrap(item) for item in result)
    return result


def _index(key: Any) -> Any:
    """An index as NumPy takes it: stand-in arrays unwrapped; NumPy index arrays are fine (CuPy
    uploads them)."""
    if isinstance(key, ndarray):
        return key._a
    if isinstance(key, tuple):
        return tuple(_index(item) for item in key)
    return key


# The dtypes CuPy has a C type for (bool, the integers, float16/32/64, complex64/128); CuPy 14
# adds ml_dtypes.bfloat16 (cupy#9494). No fp8: an fp8 cache is uint8 bytes on a GPU.
_DTYPE_CHARS = frozenset("?bhilqBHILQefdFD")


def _check_dtype(dtype: np.dtype) -> None:
    native_bfloat16 = int(__version__.split(".")[0]) >= 14
    if dtype.char in _DTYPE_CHARS or (native_bfloat16 and dtype == np.dtype(ml_dtypes.bfloat16)):
        return
    raise ValueError(f"Unsupported dtype {dtype}")


class _Flags:
    """CuPy's ``ndarray.flags``: contiguity and ownership, nothing about writability."""

    __slots__ = ("c_contiguous", "f_contiguous", "owndata")

    def __init__(self, array: np.ndarray) -> None:
        self.c_contiguous = array.flags.c_contiguous
        self.f_contiguous = array.flags.f_contiguous
        self.owndata = array.flags.owndata

    def __getitem__(self, name: str) -> bool:
        return getattr(self, name.lower())


class _Memory:
    """``ndarray.data``: the device pointer (here, the host address) of the first element."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def copy_from_device_async(self, src: _Memory, size: int, stream: Any = None) -> None:
        """CuPy's device-to-device copy of ``size`` bytes from ``src`` (here at once)."""
        if not isinstance(src, _Memory):
            raise TypeError(
                f"Argument 'src' has incorrect type (expected MemoryPointer, got {src})"
            )
        ctypes.memmove(self.ptr, src.ptr, size)


# The methods of CuPy's ndarray that this stand-in forwards to NumPy's (results wrapped).
_METHODS = frozenset(
    "all any argmax argmin argsort astype clip conj copy cumsum diagonal dot fill flatten item "
    "max mean min nonzero prod ravel repeat reshape round sort squeeze std sum swapaxes take "
    "tolist transpose var view".split()
)


class ndarray(np.lib.mixins.NDArrayOperatorsMixin):  # noqa: N801  (CuPy's name)
    """An array on the stand-in device: a NumPy array that only this module unwraps."""

    __slots__ = ("__weakref__", "_a")
    __array_priority__ = 100.0

    def __init__(self, shape: Any, dtype: Any = float, order: str = "C") -> None:
        if _capture.graph is not None:
            _refuse_in_capture("an allocation (new device memory)")
        self._a = np.empty(shape, dtype, order=order)

    @classmethod
    def _of(cls, array: np.ndarray) -> ndarray:
        _check_dtype(array.dtype)
        if _capture.graph is not None and array.flags.owndata:
            _refuse_in_capture("an allocation (new device memory)")
        x = object.__new__(cls)
        x._a = array
        return x

    # -- what CuPy's arrays say about themselves

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a))
    data = property(lambda self: _Memory(self._a.__array_interface__["data"][0]))
    device = property(lambda self: cuda.Device(0))
    T = property(lambda self: ndarray._of(self._a.T))
    real = property(lambda self: ndarray._of(self._a.real))
    imag = property(lambda self: ndarray._of(self._a.imag))

    @property
    def base(self) -> ndarray | None:
        return None if self._a.base is None else ndarray._of(self._a.base)

    def __getattr__(self, name: str) -> Any:
        if name in _METHODS:
            method = getattr(self._a, name)

            def forwarded(*args: Any, **kwargs: Any) -> Any:
                return _wrap(method(*_device_value(args), **_device_kwargs(kwargs)))

            return forwarded
        raise AttributeError(
            f"'cupy.ndarray' object (the strict stand-in) has no attribute {name!r}"
        )

    # -- the way to the host is explicit

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise TypeError(_IMPLICIT)

    def get(self, stream: Any = None, order: str = "C", out: np.ndarray | None = None) -> Any:
        """A host copy (into ``out`` when given)."""
        _no_host_read()
        if out is None:
            return np.array(self._a, order=order, copy=True)
        out[...] = self._a
        return out

    def set(self, array: np.ndarray, stream: Any = None) -> None:
        """Upload ``array`` into this C-contiguous array, which has its shape and dtype."""
        if array.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {array.shape}")
        if array.dtype != self.dtype:
            raise TypeError(f"{array.dtype} array cannot be set to {self.dtype} array")
        if not self._a.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        self._a[...] = array

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_DL_CUDA, 0)

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise BufferError("the strict CuPy stand-in does not export through DLPack")

    # -- NumPy's protocols: the stand-in's arrays only, or NumPy and Python scalars

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        out = kwargs.get("out")
        result = getattr(ufunc, method)(*_device_value(inputs), **_device_kwargs(kwargs))
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(result)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        return _wrap(func(*_device_value(args), **_device_kwargs(kwargs)))

    # -- Python's protocols (CuPy synchronises for the scalar ones)

    def __getitem__(self, key: Any) -> Any:
        return _wrap(self._a[_index(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        if _capture.graph is not None and isinstance(value, (np.ndarray, list, tuple)):
            _refuse_in_capture("an upload of host data")
        self._a[_index(key)] = value._a if isinstance(value, ndarray) else value

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Iterator[ndarray]:
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (ndarray._of(row) for row in self._a)

    def __bool__(self) -> bool:
        _no_host_read()
        return bool(self._a)

    def __int__(self) -> int:
        _no_host_read()
        return int(self._a)

    def __float__(self) -> float:
        _no_host_read()
        return float(self._a)

    def __complex__(self) -> complex:
        return complex(self._a)

    def __index__(self) -> int:
        return self._a.__index__()

    def __repr__(self) -> str:
        return repr(self._a)

    def __str__(self) -> str:
        return str(self._a)

    __hash__ = None  # type: ignore[assignment]


# ----------------------------------------------------------------------------- the module's API


def asarray(a: Any, dtype: Any = None, order: Any = None, *, blocking: bool = False) -> ndarray:
    """``a`` on the device: a stand-in array as it is (or converted), anything else uploaded."""
    if isinstance(a, ndarray):
        converted = np.asarray(a._a, dtype=dtype, order=order)
        return a if converted is a._a else ndarray._of(converted)
    return ndarray._of(np.array(_device_value(a) if _holds_device(a) else a, dtype, order=order))


def array(obj: Any, dtype: Any = None, copy: bool = True, order: str = "K", ndmin: int = 0) -> Any:
    """A new device array of ``obj`` (a copy unless ``copy=False`` allows none)."""
    if isinstance(obj, ndarray) and not copy:
        return asarray(obj, dtype)
    host = obj._a if isinstance(obj, ndarray) else obj
    return ndarray._of(np.array(host, dtype, copy=True, order=order, ndmin=ndmin))


def _holds_device(a: Any) -> bool:
    return isinstance(a, (list, tuple)) and any(isinstance(item, ndarray) for item in a)


def ascontiguousarray(a: ndarray, dtype: Any = None) -> ndarray:
    """A C-contiguous device array of ``a`` (a stand-in array: CuPy does not upload here)."""
    if not isinstance(a, ndarray):
        raise TypeError(f"Argument 'a' has incorrect type (expected cupy.ndarray, got {type(a)})")
    return asarray(a, dtype, order="C")


def asnumpy(a: Any, stream: Any = None, order: str = "C", out: Any = None) -> np.ndarray:
    """A host copy of a device array; anything else through ``numpy.asarray``."""
    if isinstance(a, ndarray):
        return a.get(order=order, out=out)
    return np.asarray(a, order=order)


def get_array_module(*args: Any) -> types.ModuleType:
    """This module when an argument is one of its arrays, else NumPy."""
    return sys.modules[__spec__.name] if any(isinstance(x, ndarray) for x in args) else np


def from_dlpack(x: Any) -> ndarray:
    """The stand-in's own arrays only: no other producer has memory on its device."""
    if isinstance(x, ndarray):
        return x
    raise TypeError(f"the strict CuPy stand-in imports only its own arrays, got {type(x)}")


class _Ufunc:
    """A NumPy ufunc over the stand-in's arrays, with the methods the suite uses."""

    def __init__(self, ufunc: np.ufunc) -> None:
        self._ufunc = ufunc
        self.__name__ = ufunc.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _wrap(self._ufunc(*_device_value(args), **_device_kwargs(kwargs)))

    def __getattr__(self, method: str) -> Any:
        bound = getattr(self._ufunc, method)
        if not callable(bound):
            return bound
        return lambda *args, **kwargs: _wrap(bound(*_device_value(args), **_device_kwargs(kwargs)))


def _like(function: Any) -> Any:
    """A ``*_like`` creation function: CuPy takes a host prototype too (only its shape and
    dtype are read)."""

    def like(prototype: Any, *args: Any, **kwargs: Any) -> ndarray:
        host = prototype._a if isinstance(prototype, ndarray) else prototype
        return _wrap(function(host, *args, **kwargs))

    return like


def __getattr__(name: str) -> Any:
    """Every other NumPy name: functions and ufuncs over the stand-in's arrays; dtypes,
    constants and types as NumPy has them."""
    value = getattr(np, name)
    if isinstance(value, np.ufunc):
        return _Ufunc(value)
    if name in ("empty_like", "zeros_like", "ones_like", "full_like"):
        return _like(value)
    if callable(value) and not isinstance(value, type):
        return lambda *args, **kwargs: _wrap(value(*_device_value(args), **_device_kwargs(kwargs)))
    return value


# ----------------------------------------------------------------------------- cupy.cuda


def _nominal():
    from cupaged.kernels.target import NOMINAL_TARGET

    return NOMINAL_TARGET


class _Device:
    """``cupy.cuda.Device``: one device, id 0, with the nominal GPU's limits."""

    def __init__(self, device: Any = None) -> None:
        self.id = 0 if device is None else int(device)
        if self.id != 0:
            raise ValueError(f"the strict CuPy stand-in has one device, 0; got {device!r}")

    @property
    def compute_capability(self) -> str:
        return str(_nominal().arch)

    @property
    def attributes(self) -> dict[str, int]:
        target = _nominal()
        return {
            "MultiProcessorCount": target.sm_count,
            "MaxSharedMemoryPerBlockOptin": target.shared_memory,
        }

    def use(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _Stream:
    """``cupy.cuda.Stream``: every call has completed when it returns."""

    ptr = 0
    null: _Stream

    def __init__(self, non_blocking: bool = False) -> None:
        self.ptr = id(self)  # (the null stream's is 0)

    def synchronize(self) -> None:
        _no_host_read()

    def use(self) -> _Stream:
        return self

    def __enter__(self) -> _Stream:
        _capture.current.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _capture.current.pop()

    def begin_capture(self, mode: Any = None) -> None:
        """Record the launches on this stream into a graph, until :meth:`end_capture`."""
        if self is _Stream.null:
            raise RuntimeError(
                "cudaErrorStreamCaptureUnsupported: the legacy stream cannot be captured"
            )
        if _capture.graph is not None:
            raise RuntimeError("cudaErrorIllegalState: a capture is under way")
        _capture.graph, _capture.stream = Graph(), self

    def end_capture(self) -> Graph:
        """The captured graph (``cudaErrorStreamCaptureInvalidated`` after a refused call)."""
        if _capture.stream is not self:
            raise RuntimeError("cudaErrorIllegalState: this stream is not capturing")
        graph, invalid = _capture.graph, _capture.invalidated
        _capture.graph = _capture.stream = None
        _capture.invalidated = False
        if invalid:
            raise RuntimeError("cudaErrorStreamCaptureInvalidated: a call the capture refused")
        return graph


_Stream.null = _Stream()
_Stream.null.ptr = 0


class Graph:
    """``cupy.cuda.graph.Graph``: the launches of a capture, replayed by :meth:`launch` on the
    arrays they were captured with (their contents as they are at the replay)."""

    def __init__(self) -> None:
        self.launches: list[tuple[Any, ...]] = []

    def launch(self, stream: Any = None) -> None:
        if _capture.graph is not None:
            _refuse_in_capture("a graph launch")
        for kernel, grid, block, args, shared_mem in self.launches:
            kernel._run(grid, block, args, shared_mem)


class _Capture:
    """The stand-in's one capture: the graph being recorded (``None``: none), its stream,
    whether a refused call invalidated it, and the streams entered (``with stream:``)."""

    graph: Graph | None = None
    stream: _Stream | None = None
    invalidated = False
    current: list[_Stream] = [_Stream.null]  # the streams entered, innermost last


_capture = _Capture()


def _refuse_in_capture(what: str) -> None:
    """Raise as CUDA does for ``what`` during a capture, and invalidate the capture."""
    _capture.invalidated = True
    raise RuntimeError(
        f"cudaErrorStreamCaptureUnsupported: {what} is not permitted while a stream is "
        f"capturing a CUDA graph"
    )


def _no_host_read() -> None:
    if _capture.graph is not None:
        _refuse_in_capture("a host read (a synchronisation)")


def _is_capturing(stream: Any) -> int:
    """``cudaStreamIsCapturing``: 1 (active) on the capturing stream, else 0."""
    return int(_capture.stream is not None and stream == _capture.stream.ptr)


class RawKernel:
    """A kernel of ``cuda/`` as the CPU backend runs it, launched as CuPy launches one."""

    _by_ptr: dict[int, RawKernel] = {}

    def __init__(self, source: str, name: str) -> None:
        from cupaged.kernels.target import DEFAULT_SHARED_MEMORY

        self.name, self._source = name, source
        self._cpu = None  # built at the first launch: the loader holds its lock while loading this
        self._opted_in = DEFAULT_SHARED_MEMORY
        self.kernel = types.SimpleNamespace(ptr=id(self))  # the handle the driver's calls take
        RawKernel._by_ptr[id(self)] = self

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._opted_in

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        """The opt-in, which CUDA refuses above the device's limit per block."""
        limit = _nominal().shared_memory
        if not 0 <= value <= limit:
            raise RuntimeError(
                f"CUDA_ERROR_INVALID_VALUE: {self.name} opting into {value} bytes of dynamic "
                f"shared memory, the device allows {limit}"
            )
        self._opted_in = value

    def __call__(self, grid: Any, block: Any, args: Any, *, shared_mem: int = 0, **kw: Any) -> None:
        from cupaged.kernels import loader as _kernels

        if shared_mem > self.max_dynamic_shared_size_bytes:
            raise RuntimeError(
                f"CUDA_ERROR_INVALID_VALUE: {self.name} launched with {shared_mem} bytes of "
                f"dynamic shared memory, opted into {self.max_dynamic_shared_size_bytes}"
            )
        for arg in args:
            if isinstance(arg, np.ndarray):
                raise TypeError(f"Unsupported type {type(arg)}")
        if self._cpu is None:
            self._cpu = _kernels.get_kernel("cpu", self._source, self.name)
        if _capture.graph is not None:  # recorded with its arrays, run at each replay
            _capture.graph.launches.append((self, grid, block, tuple(args), shared_mem))
            return
        self._run(grid, block, args, shared_mem)

    def _run(self, grid: Any, block: Any, args: Any, shared_mem: int) -> None:
        values = tuple(arg._a if isinstance(arg, ndarray) else arg for arg in args)
        self._cpu(grid, block, values, shared_mem=shared_mem)


class RawModule:
    """``cupy.RawModule(code=..., name_expressions=...)`` over a file of ``cuda/``: the source
    text names its file, which the CPU backend builds."""

    def __init__(self, code: str, options: Any = (), name_expressions: Any = (), **kw: Any):
        from cupaged.backend import kernel_dir

        sources = [p.name for p in sorted(kernel_dir().glob("*.cu")) if p.read_text() == code]
        if len(sources) != 1:
            raise ValueError("the strict CuPy stand-in runs the kernels of cuda/ only")
        self._source = sources[0]
        self._names = tuple(name_expressions)

    def get_function(self, name: str) -> RawKernel:
        if name not in self._names:
            raise ValueError(f"{name!r} is not one of the module's name expressions")
        return RawKernel(self._source, name)


def _occupancy(ptr: int, threads: int, shared_mem: int) -> int:
    """Blocks per multiprocessor of a loaded kernel, as CUDA's calculator gives them for an
    H100 kernel of 64 registers per thread: the stand-in has no cubin, so its split plans may
    differ from the CPU backend's (``decode_ctas_per_sm``, the cubins' registers), as a
    real GPU's may; the work list's length depends on it, never a result."""
    from cupaged.kernels.target import ctas_per_sm

    assert ptr in RawKernel._by_ptr, "occupancy asked of a kernel the stand-in did not load"
    return ctas_per_sm(threads, 64, shared_mem)


cuda = types.SimpleNamespace(
    Device=_Device,
    Stream=_Stream,
    is_available=lambda: True,
    get_current_stream=lambda: _capture.current[-1],
    graph=types.SimpleNamespace(Graph=Graph),
    get_cuda_path=lambda: None,
    runtime=types.SimpleNamespace(
        getDevice=lambda: 0,
        getDeviceCount=lambda: 1,
        getDeviceProperties=lambda device: {"name": b"strict CuPy stand-in (CPU)"},
        memGetInfo=lambda: (16 * 2**30, 16 * 2**30),
        streamIsCapturing=_is_capturing,
    ),
    driver=types.SimpleNamespace(occupancyMaxActiveBlocksPerMultiprocessor=_occupancy),
)


# ----------------------------------------------------------------------------- installing it


@contextlib.contextmanager
def installed(version: str = "14.2.0") -> Iterator[types.ModuleType]:
    """Inside, ``import cupy`` (and cupaged's CuPy) is this module, of CuPy version ``version``
    ("13.6.0": no bfloat16 arrays, a bfloat16 cache is ``uint16``), and a GPU is "available"."""
    global __version__
    from helpers import forget_cuda_state

    this = sys.modules[__spec__.name]
    saved, saved_version = sys.modules.get("cupy"), __version__
    sys.modules["cupy"], __version__ = this, version
    forget_cuda_state()
    try:
        yield this
    finally:
        _capture.graph = _capture.stream = None
        _capture.invalidated, _capture.current[:] = False, [_Stream.null]
        if saved is None:
            sys.modules.pop("cupy", None)
        else:
            sys.modules["cupy"] = saved
        __version__ = saved_version
        forget_cuda_state()
        RawKernel._by_ptr.clear()
