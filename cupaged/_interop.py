"""Arrays of other frameworks at the public boundary: DLPack in, the caller's own type out.

NumPy and CuPy arrays pass through as they are (a type check per array). Any other object with
``__dlpack__`` and ``__dlpack_device__`` (a PyTorch tensor, a JAX array) is imported without a
copy: ``numpy.from_dlpack`` for host memory, ``cupy.from_dlpack`` for CUDA memory (which hands
the producer CuPy's current stream, so that the producer's pending work is ordered before
cupaged's kernels on that stream). A result goes back through the same protocol as the
framework of the call's foreign arrays, again without a copy (:func:`takes_dlpack`, the one
mechanism that every public function taking arrays goes through).

bfloat16: NumPy cannot import a bfloat16 DLPack tensor, so a PyTorch ``bfloat16`` tensor is
imported as its ``int16`` view (one of the bfloat16 carriers that ``cupaged.dtypes`` knows) and a
bfloat16 result is handed back as ``torch.bfloat16``. On CUDA the same view is taken: CuPy 13
has no bfloat16 dtype either.

The arrays of one call come from one framework: mixing NumPy with PyTorch (or CuPy with
PyTorch) is refused, as mixing NumPy and CuPy is.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ._backend import cupy_module, is_cupy_array

_DL_CPU = 1  # DLPack device types (dlpack.h: kDLCPU, kDLCUDA, kDLCUDAHost)
_DL_CUDA = 2
_DL_CUDA_HOST = 3


def is_native(x: Any) -> bool:
    """A NumPy or CuPy array (or ``None``): what cupaged computes on."""
    return x is None or type(x) is np.ndarray or isinstance(x, np.ndarray) or is_cupy_array(x)


def framework_of(x: Any) -> str:
    """The top-level module of ``x``'s type (``"torch"``, ``"jax"``, ``"jaxlib"``)."""
    return type(x).__module__.split(".", 1)[0]


def takes_dlpack(function: Callable[..., Any]) -> Callable[..., Any]:
    """Let ``function`` take arrays of any framework that speaks DLPack, and hand its results back
    as the caller's type.

    A call whose arrays are all NumPy or CuPy goes straight through (a type test per argument).
    Otherwise every argument with ``__dlpack__`` is imported without a copy (:func:`_import`); the
    arrays of one call must come from one framework. The result is handed back through DLPack as
    that framework's array (each array of a returned tuple alike); a returned array that is one
    of the call's own (an ``out=`` the caller gave) comes back as the caller's very object. A
    ``TypeError`` or ``ValueError`` of the call names, after its message, the framework's own
    dtype and device of each foreign argument.
    """
    names = tuple(inspect.signature(function).parameters)

    @functools.wraps(function)
    def boundary(*args: Any, **kwargs: Any) -> Any:
        if not (_any_foreign(args) or _any_foreign(kwargs.values())):
            return function(*args, **kwargs)
        given = {n: x for n, x in zip(names, args, strict=False) if hasattr(x, "__dlpack__")}
        given.update((n, x) for n, x in kwargs.items() if hasattr(x, "__dlpack__"))
        imported = _import_call(given)
        arrays = imported.arrays
        args = tuple(arrays.get(n, x) for n, x in zip(names, args, strict=False))
        kwargs = {n: arrays.get(n, x) for n, x in kwargs.items()}
        try:
            result = function(*args, **kwargs)
        except (TypeError, ValueError) as error:
            if error.args and isinstance(error.args[0], str):
                error.args = (f"{error.args[0]} ({imported.described})", *error.args[1:])
            raise
        return imported.back(result)

    return boundary


def _any_foreign(values: Any) -> bool:
    for x in values:
        if type(x) is not np.ndarray and hasattr(x, "__dlpack__") and not is_native(x):
            return True
    return False


class _Imported:
    """The native arrays of one call, and how results go back as the caller's arrays."""

    __slots__ = ("arrays", "bfloat16", "framework", "given", "originals")

    def __init__(
        self, arrays: dict[str, Any], originals: dict[int, Any], framework: str,
        bfloat16: bool, given: dict[str, Any],
    ) -> None:  # fmt: skip
        self.arrays = arrays  # by argument name, NumPy or CuPy
        self.originals = originals  # id of a native array -> the caller's object it came from
        self.framework = framework
        self.bfloat16 = bfloat16  # a foreign bfloat16 tensor came in: 16-bit results go back so
        self.given = given  # the caller's arrays by name, for error messages

    @property
    def described(self) -> str:
        """``"arrived as torch arrays: k torch.int8 on cpu, ..."``, for error messages."""
        return f"arrived as {self.framework} arrays: " + ", ".join(
            f"{n} {getattr(x, 'dtype', '?')} on {_device(x)}" for n, x in self.given.items()
        )

    def back(self, result: Any) -> Any:
        if isinstance(result, tuple):
            return tuple(self.back(x) for x in result)
        if result is None or not is_native(result):
            return result
        original = self.originals.get(id(result))
        if original is not None:
            return original
        return _export(result, self.framework, self.bfloat16)


def _import_call(given: dict[str, Any]) -> _Imported:
    """Import the DLPack arguments of one call (by name) as NumPy or CuPy arrays.

    Raises:
        TypeError: arrays of two frameworks in one call, or a tensor on a device cupaged does
            not run on.
    """
    foreign, native = set(), False
    arrays, originals, bfloat16 = {}, {}, False
    for name, x in given.items():
        if isinstance(x, np.ndarray) or is_cupy_array(x):
            native = True
            continue
        hit = _recent.get(id(x))  # a tensor imported lately: no framework test, no import
        if hit is not None and hit[0]() is x and hit[1] == _memo_key(x):
            framework, array, was_bfloat16 = hit[2], hit[3], hit[4]
        else:
            framework = framework_of(x)
            array, was_bfloat16 = _import(name, x, framework)
        foreign.add(framework)
        arrays[name] = array
        originals[id(array)] = x
        bfloat16 |= was_bfloat16
    if len(foreign) > 1 or native:
        described = ", ".join(f"{n}: {_kind(x)}" for n, x in given.items())
        kinds = sorted(foreign | ({"numpy/cupy"} if native else set()))
        raise TypeError(
            f"expected the arrays of one call from one framework, got a mix of "
            f"{' and '.join(kinds)} ({described})"
        )
    return _Imported(arrays, originals, foreign.pop(), bfloat16, given)


def _export(result: Any, framework: str, bfloat16: bool) -> Any:
    """A NumPy or CuPy array as ``framework``'s array, through DLPack (no copy)."""
    if framework == "torch":
        import torch

        tensor = torch.from_dlpack(result)
        if bfloat16 and tensor.dtype in (torch.uint16, torch.int16):
            return tensor.view(torch.bfloat16)
        return tensor
    if framework in ("jax", "jaxlib"):
        import jax.numpy as jnp

        return jnp.from_dlpack(result)
    raise TypeError(f"expected arrays of PyTorch or JAX to hand back, got {framework} arrays")


# Tensors imported lately, by the id of the caller's object: a model hands the same cache layers
# (and often the same output buffers) to every step, and an import costs more than the rest of a
# plan's run. An entry is used only while it is still that object, at the same address, shape and
# strides (a tensor resized or re-pointed in place is imported again).
_recent: dict[int, tuple[Any, tuple | None, str, Any, bool]] = {}
_RECENT_MOST = 256


def _import(name: str, x: Any, framework: str) -> tuple[Any, bool]:
    """One foreign array as NumPy or CuPy, and whether it held bfloat16."""
    if not (hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__")):
        raise TypeError(
            f"expected {name} to be a NumPy or CuPy array or an object with __dlpack__, got "
            f"{_kind(x)}"
        )
    if framework != "torch":
        return _from_dlpack(name, x, int(x.__dlpack_device__()[0])), False
    import torch

    bfloat16 = x.dtype == torch.bfloat16
    source = x.view(torch.int16) if bfloat16 else x  # NumPy and CuPy 13 import no bfloat16
    array = _from_dlpack(name, source, _DL_CUDA if x.is_cuda else _DL_CPU)
    if len(_recent) >= _RECENT_MOST:
        _recent.clear()
    _recent[id(x)] = (weakref.ref(x), _memo_key(x), framework, array, bfloat16)
    return array, bfloat16


def _memo_key(x: Any) -> tuple:
    """What must not have changed for a remembered import of ``x`` to stand (PyTorch: the
    address, shape and strides; ``None`` for another framework's array, which is not kept)."""
    data_ptr = getattr(x, "data_ptr", None)
    return (data_ptr(), x.shape, x.stride()) if data_ptr is not None else None


def _from_dlpack(name: str, x: Any, device_type: int) -> Any:
    if device_type in (_DL_CPU, _DL_CUDA_HOST):
        return np.from_dlpack(x)
    if device_type == _DL_CUDA:
        cupy = cupy_module()
        if cupy is None:
            raise TypeError(
                f"expected {name} in host memory (CuPy is not installed), got CUDA memory"
            )
        return cupy.from_dlpack(x)  # hands the producer CuPy's current stream
    raise TypeError(
        f"expected {name} in host or CUDA memory, got DLPack device type {device_type} ({_kind(x)})"
    )


def _device(x: Any) -> str:
    device = getattr(x, "device", None)
    return "?" if device is None or callable(device) else str(device)


def _kind(x: Any) -> str:
    """``torch.Tensor(dtype=torch.float16, device=cpu)``-like description of an argument."""
    kind = f"{type(x).__module__}.{type(x).__name__}"
    dtype, device = getattr(x, "dtype", None), getattr(x, "device", None)
    if dtype is not None:
        kind += f" of dtype {dtype}"
    if device is not None and not callable(device):
        kind += f" on {device}"
    return kind
