"""Arrays of other frameworks at the public boundary: DLPack in, the caller's own type out.

NumPy and CuPy arrays pass through as they are (a type test per argument). Any other object with
``__dlpack__`` and ``__dlpack_device__`` (a PyTorch tensor, a JAX array) is imported without a
copy: a PyTorch CPU tensor through ``Tensor.numpy()`` (the view ``numpy.from_dlpack`` would
make, at a fraction of the cost), other host memory through ``numpy.from_dlpack``, CUDA memory
through ``cupy.from_dlpack`` (which hands the producer CuPy's current stream, so that the
producer's pending work is ordered before cupaged's kernels on that stream). A result goes back
as an array of the framework of the call's foreign arrays, again without a copy
(``torch.from_numpy`` for a NumPy result to PyTorch, DLPack otherwise). :func:`takes_dlpack` is
the one mechanism that every public function taking arrays goes through.

Nothing is kept between calls, not even by a plan that runs every layer with the same cache
tensors: a kept import would hold the caller's tensor alive, would skip the stream handshake on
CUDA, and would have to be checked on every use against a tensor moved or resized in place
(``set_``, ``resize_``): on the CPU, checking its address, shape, strides and dtype costs about
what ``Tensor.numpy()`` does.

bfloat16: NumPy cannot import a bfloat16 tensor, so a PyTorch ``bfloat16`` CPU tensor is
imported as its ``uint16`` view (cupaged's bfloat16 storage, which a plan's fast checks expect;
through ``int16`` on a PyTorch without ``torch.uint16``), and a bfloat16 result is handed back
as ``torch.bfloat16``. On CUDA (and for a CPU tensor that goes the general way, through
DLPack) the ``int16`` view is taken on every CuPy: it is a bfloat16 carrier everywhere, and
CuPy 13 has no bfloat16 dtype to import it as.

The arrays of one call come from one framework: mixing NumPy with PyTorch (or CuPy with
PyTorch) is refused, as mixing NumPy and CuPy is.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
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
    arrays of one call must come from one framework. The result is handed back as that
    framework's array without a copy (:func:`_export`; each array of a returned tuple alike); a
    returned array that is one of the call's own (an ``out=`` the caller gave) comes back as the
    caller's very object. A ``TypeError`` or ``ValueError`` of the call names, after its
    message, the framework's own dtype and device of each foreign argument.
    """
    names = tuple(inspect.signature(function).parameters)

    @functools.wraps(function)
    def boundary(*args: Any, **kwargs: Any) -> Any:
        if not (_any_foreign(args) or kwargs and _any_foreign(kwargs.values())):
            return function(*args, **kwargs)
        call = _Imported(names, args, kwargs)
        try:
            result = function(*call.args, **call.kwargs)
        except (TypeError, ValueError) as error:
            if error.args and isinstance(error.args[0], str):
                error.args = (f"{error.args[0]} ({call.described})", *error.args[1:])
            raise
        return call.back(result)

    return boundary


def _any_foreign(values: Any) -> bool:
    for x in values:
        if type(x) is not np.ndarray and hasattr(x, "__dlpack__") and not is_native(x):
            return True
    return False


def _cpu_tensor_views(values: Any, torch: _Torch, originals: list) -> tuple[Any, ...] | None:
    """``values`` with each PyTorch CPU tensor replaced by its NumPy view (``Tensor.numpy()``;
    bfloat16: of its ``uint16`` view), the pairs appended to ``originals``; ``None`` when one of
    them needs the general way (another array, a tensor on a device, one that requires grad or
    that ``numpy()`` refuses), which then names what it refuses."""
    tensor, bfloat16, bits16 = torch.tensor, torch.bfloat16, torch.bits16
    views = []
    for x in values:
        if isinstance(x, tensor):
            if not x.is_cpu or x.requires_grad:
                return None
            try:
                view = x.view(bits16).numpy() if x.dtype is bfloat16 else x.numpy()
            except (RuntimeError, TypeError, ValueError):  # a lazy negation, a sparse tensor
                return None
            originals.append((view, x))
            views.append(view)
        elif type(x) is np.ndarray or hasattr(x, "__dlpack__"):
            return None
        else:
            views.append(x)
    return tuple(views)


class _Imported:
    """One call's arguments with its foreign arrays imported (``args``, ``kwargs``), and how
    results go back as the caller's arrays. It lives for the call only: nothing of the caller's
    is kept after it.

    A call whose arrays are all PyTorch CPU tensors (the common case: a layer's call; any
    subclass of ``torch.Tensor``) takes :func:`_cpu_tensor_views`. Any other call goes the
    general way, argument by argument: :func:`_refuse_what_dlpack_would_lose` for tensors, then
    DLPack (:func:`_import`), whose refusal names the cause.

    Raises:
        TypeError: arrays of two frameworks in one call, or a foreign array that cannot be
            imported (a tensor on a device cupaged does not run on, one that requires grad,
            one with a lazy negation or conjugation).
    """

    __slots__ = ("_call", "_frameworks", "_originals", "_torch", "args", "framework", "kwargs")

    def __init__(self, names: tuple[str, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        self._call = (names, args, kwargs)  # the caller's own, for names and error messages
        self._torch = torch = _torch_types()
        # (imported array, the caller's object it came from): a call has a handful, so a list
        # searched by identity beats a dictionary keyed by id().
        self._originals = []
        self.args = _cpu_tensor_views(args, torch, self._originals)
        self.kwargs = kwargs
        if self.args is not None and kwargs:
            values = _cpu_tensor_views(kwargs.values(), torch, self._originals)
            self.kwargs = None if values is None else dict(zip(kwargs, values, strict=True))
        if self.args is not None and self.kwargs is not None:
            self.framework = "torch"
            return
        self._originals.clear()
        self._frameworks = set()
        self.args = tuple(self._import_arg(i, x) for i, x in enumerate(args))
        self.kwargs = kwargs
        if kwargs:
            imported = (self._import_arg(i, x) for i, x in enumerate(kwargs.values(), len(args)))
            self.kwargs = dict(zip(kwargs, imported, strict=True))
        if len(self._frameworks) > 1:
            described = ", ".join(f"{n}: {_kind(x)}" for n, x in self.given().items())
            raise TypeError(
                f"expected the arrays of one call from one framework, got a mix of "
                f"{' and '.join(sorted(self._frameworks))} ({described})"
            )
        (self.framework,) = self._frameworks  # _any_foreign found one

    def _import_arg(self, i: int, x: Any) -> Any:
        """Argument ``i`` (positional ones first) imported when it has ``__dlpack__``, through
        DLPack, after the refusals of :func:`_refuse_what_dlpack_would_lose` for a tensor."""
        if not hasattr(x, "__dlpack__"):
            return x
        names, args, kwargs = self._call
        if i < len(args):
            name = names[i] if i < len(names) else f"argument {i}"
        else:
            name = list(kwargs)[i - len(args)]
        torch = self._torch
        if isinstance(x, torch.tensor):
            framework = "torch"
            _refuse_what_dlpack_would_lose(name, x)
            source = x.view(torch.int16) if x.dtype is torch.bfloat16 else x
            array = _import(name, source, framework, shown=x)
        else:
            framework = framework_of(x)
            if is_native(x):
                self._frameworks.add("numpy/cupy")
                return x
            array = _import(name, x, framework)
        self._frameworks.add(framework)
        self._originals.append((array, x))
        return array

    def given(self) -> dict[str, Any]:
        """The call's arrays by name (its ``__dlpack__`` arguments)."""
        names, args, kwargs = self._call
        arrays = {n: x for n, x in zip(names, args, strict=False) if hasattr(x, "__dlpack__")}
        return arrays | {n: x for n, x in kwargs.items() if hasattr(x, "__dlpack__")}

    @property
    def described(self) -> str:
        """``"arrived as torch arrays: k torch.int8 on cpu, ..."``, for error messages."""
        return f"arrived as {self.framework} arrays: " + ", ".join(
            f"{n} {getattr(x, 'dtype', '?')} on {_device(x)}" for n, x in self.given().items()
        )

    def back(self, result: Any) -> Any:
        if isinstance(result, tuple):
            return tuple(self.back(x) for x in result)
        if result is None or not is_native(result):
            return result
        for array, original in self._originals:
            if array is result:
                return original
        return _export(result, self.framework, self._torch)


def _export(result: Any, framework: str, torch: _Torch) -> Any:
    """A NumPy or CuPy array as ``framework``'s array, without a copy. cupaged's 16-bit integer
    results are bfloat16 patterns (its bfloat16 storage): they go back as bfloat16. An exporter
    of another framework gets the NumPy or CuPy array itself.

    A writable NumPy array goes to PyTorch through ``torch.from_numpy``, the same view as
    ``torch.from_dlpack`` at a fraction of its cost; a dtype that PyTorch's NumPy bridge lacks
    (``ml_dtypes``), a read-only array and a CuPy array go through DLPack.
    """
    if framework == "torch":
        tensor = None
        if type(result) is np.ndarray and result.flags.writeable:
            try:
                tensor = torch.from_numpy(result)
            except (TypeError, ValueError):  # not a dtype or layout of the bridge: DLPack's
                pass
        if tensor is None:
            tensor = torch.from_dlpack(result)
        if result.dtype.char in "hH":  # int16, uint16
            return tensor.view(torch.bfloat16)
        return tensor
    if framework in ("jax", "jaxlib"):
        import jax.numpy as jnp

        return jnp.from_dlpack(result)
    return result


class _NotImported:
    """Stands for ``torch.Tensor`` while PyTorch is not imported: no argument is one."""


@dataclass(frozen=True, slots=True)
class _Torch:
    """What the boundary uses of PyTorch, looked up once per ``torch`` module.

    ``bits16``: the dtype whose view of a bfloat16 tensor ``Tensor.numpy()`` takes, which has no
    bfloat16: ``torch.uint16`` (cupaged's bfloat16 storage, so a plan's fast checks pass), or
    ``int16`` on a PyTorch before 2.3. Where ``numpy()`` refuses it, the call goes through DLPack.
    """

    tensor: type
    bfloat16: Any = None
    int16: Any = None
    bits16: Any = None
    from_numpy: Callable[[Any], Any] | None = None
    from_dlpack: Callable[[Any], Any] | None = None


_NO_TORCH = _Torch(_NotImported)


def _torch_types() -> _Torch:
    """PyTorch's types and bridges, or :data:`_NO_TORCH` while it is not imported."""
    torch = sys.modules.get("torch")
    return _NO_TORCH if torch is None else _torch_of(torch)


@functools.cache
def _torch_of(torch: Any) -> _Torch:
    bits16 = getattr(torch, "uint16", torch.int16)
    return _Torch(
        torch.Tensor, torch.bfloat16, torch.int16, bits16, torch.from_numpy, torch.from_dlpack
    )


def _refuse_what_dlpack_would_lose(name: str, x: Any) -> None:
    """Refuse a PyTorch tensor whose values are not its memory's: a lazy negation or conjugation
    (``z.conj().imag`` has the negative bit) exports the memory as it is, so the kernels would
    read the values un-negated. And a tensor that requires grad, which DLPack refuses, except
    through the ``int16`` view a bfloat16 one is imported by (the view does not require grad).

    Raises:
        TypeError: naming the tensor and the call that resolves it.
    """
    if x.requires_grad:
        raise TypeError(
            f"expected {name} not requiring grad (pass tensor.detach()), got {_kind(x)} "
            f"that requires grad"
        )
    if x.is_neg() or x.is_conj():
        bit, fix = ("negative", "resolve_neg()") if x.is_neg() else ("conjugate", "resolve_conj()")
        raise TypeError(
            f"expected {name} with its values in its memory (pass tensor.{fix}), got {_kind(x)} "
            f"with the {bit} bit set"
        )


def _import(name: str, x: Any, framework: str, shown: Any = None) -> Any:
    """One foreign array as a NumPy or CuPy array, through DLPack (no copy); ``shown``, the
    caller's object that errors name (``x`` when ``None``). Nothing is remembered between
    calls (the module docstring says why).
    """
    if not hasattr(x, "__dlpack_device__"):
        raise TypeError(
            f"expected {name} to be a NumPy or CuPy array or an object with __dlpack__, got "
            f"{_kind(x if shown is None else shown)}"
        )
    try:
        if framework == "torch":  # cheaper than asking __dlpack_device__()
            device = _DL_CUDA if x.is_cuda else _DL_CPU if x.is_cpu else None
        else:
            device = None
        if device is None:
            device = int(x.__dlpack_device__()[0])
        return _from_dlpack(name, x, device)
    except (BufferError, RuntimeError, ValueError) as error:  # the framework's own refusal
        raise TypeError(
            f"expected {name} importable through DLPack (a dense tensor in host or CUDA "
            f"memory, not requiring grad), got {_kind(x if shown is None else shown)}: {error}"
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
