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
from collections.abc import Callable
from typing import Any

import numpy as np

from ._backend import cupy_module, is_cupy_array

_DL_CPU = 1  # DLPack device types (dlpack.h: kDLCPU, kDLCUDA, kDLCUDAHost)
_DL_CUDA = 2
_DL_CUDA_HOST = 3
_TORCH_DEVICES = {"cpu": _DL_CPU, "cuda": _DL_CUDA}  # others: asked of __dlpack_device__()


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

    __slots__ = ("arrays", "framework", "given", "originals")

    def __init__(
        self, arrays: dict[str, Any], originals: dict[int, Any], framework: str,
        given: dict[str, Any],
    ) -> None:  # fmt: skip
        self.arrays = arrays  # by argument name, NumPy or CuPy
        self.originals = originals  # id of a native array -> the caller's object it came from
        self.framework = framework
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
        return _export(result, self.framework)


def _import_call(given: dict[str, Any]) -> _Imported:
    """Import the DLPack arguments of one call (by name) as NumPy or CuPy arrays.

    Raises:
        TypeError: arrays of two frameworks in one call, or a tensor on a device cupaged does
            not run on.
    """
    foreign, native = set(), False
    arrays, originals = {}, {}
    for name, x in given.items():
        if isinstance(x, np.ndarray) or is_cupy_array(x):
            native = True
            continue
        framework = framework_of(x)
        array = _import(name, x, framework)
        foreign.add(framework)
        arrays[name] = array
        originals[id(array)] = x
    if len(foreign) > 1 or native:
        described = ", ".join(f"{n}: {_kind(x)}" for n, x in given.items())
        kinds = sorted(foreign | ({"numpy/cupy"} if native else set()))
        raise TypeError(
            f"expected the arrays of one call from one framework, got a mix of "
            f"{' and '.join(kinds)} ({described})"
        )
    return _Imported(arrays, originals, foreign.pop(), given)


def _export(result: Any, framework: str) -> Any:
    """A NumPy or CuPy array as ``framework``'s array, through DLPack (no copy). cupaged's 16-bit
    integer results are bfloat16 patterns (its bfloat16 storage): they go back as bfloat16. An
    exporter of another framework gets the NumPy or CuPy array itself."""
    if framework == "torch":
        import torch

        tensor = torch.from_dlpack(result)
        if tensor.dtype in (torch.uint16, torch.int16):
            return tensor.view(torch.bfloat16)
        return tensor
    if framework in ("jax", "jaxlib"):
        import jax.numpy as jnp

        return jnp.from_dlpack(result)
    return result


def _import(name: str, x: Any, framework: str) -> Any:
    """One foreign array as a NumPy or CuPy array (no copy).

    Nothing is remembered between calls: a kept import would keep the caller's tensor alive
    (its DLPack export holds it), and on CUDA it would skip the stream handshake that orders
    the producer's pending work before cupaged's kernels.
    """
    if not (hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__")):
        raise TypeError(
            f"expected {name} to be a NumPy or CuPy array or an object with __dlpack__, got "
            f"{_kind(x)}"
        )
    source = x
    if framework == "torch":  # its device attribute is cheaper than __dlpack_device__()
        import torch

        if x.dtype == torch.bfloat16:  # NumPy and CuPy 13 import no bfloat16: its int16 view
            source = x.view(torch.int16)
        device = _TORCH_DEVICES.get(x.device.type)
    else:
        device = None
    try:
        if device is None:
            device = int(x.__dlpack_device__()[0])
        return _from_dlpack(name, source, device)
    except (BufferError, RuntimeError, ValueError) as error:  # the framework's own refusal
        raise TypeError(
            f"expected {name} importable through DLPack (a dense tensor in host or CUDA "
            f"memory, not requiring grad), got {_kind(x)}: {error}"
        ) from None


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
