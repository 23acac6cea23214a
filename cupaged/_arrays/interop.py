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

fp8: a PyTorch ``float8_e4m3fn`` or ``float8_e5m2`` tensor is a cache of that format. On both
devices it is imported as its ``uint8`` bytes (CuPy has no fp8 dtype; one path for both, so that
CPU tests cover what CUDA runs), and the tensor's dtype names the format: the call's
``kv_dtype`` is filled in from it, or checked against it when the caller gave one
(:func:`_with_kv_dtype`; a plan's ``run`` checks it against the plan's format). PyTorch's other
one-byte floats are refused.

The arrays of one call come from one framework: mixing NumPy with PyTorch (or CuPy with
PyTorch) is refused, as mixing NumPy and CuPy is.
"""

from __future__ import annotations

import functools
import inspect
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend import cupy_module, is_cupy_array
from ..dtypes import dtype_name

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
    A call whose arrays are all PyTorch CPU tensors (a layer's) takes the lean way,
    :func:`_cpu_tensor_call`. Otherwise every argument with ``__dlpack__`` is
    imported without a copy (:class:`_Imported`); the arrays of one call must come from one
    framework. The result is handed back as that framework's array without a copy
    (:func:`_export`; each array of a returned tuple alike); a returned array that is one of the
    call's own (an ``out=`` the caller gave) comes back as the caller's very object. A
    ``TypeError`` or ``ValueError`` of the call names, after its message, the framework's own
    dtype and device of each foreign argument.
    """
    names = tuple(inspect.signature(function).parameters)

    @functools.wraps(function)
    def boundary(*args: Any, **kwargs: Any) -> Any:
        if not (_any_foreign(args) or kwargs and _any_foreign(kwargs.values())):
            return function(*args, **kwargs)
        result = _cpu_tensor_call(function, names, args, kwargs)
        if result is not _DECLINED:
            return result
        call = _Imported(names, args, kwargs)
        try:
            result = function(*call.args, **call.kwargs)
        except (TypeError, ValueError) as error:
            _name_arrays(error, call.framework, names, args, kwargs)
            raise
        return _back(result, call.imported, call.originals, call.framework, call.torch)

    return boundary


# The exact types found native so far (NumPy's, then CuPy's array type the first time one
# arrives): a CuPy argument then costs one set lookup, not a module lookup and an isinstance.
_NATIVE_TYPES = {np.ndarray, type(None)}


def _any_foreign(values: Any) -> bool:
    """Whether one of ``values`` is a foreign array: it has ``__dlpack__`` (asked of the object,
    so that a proxy's counts) and is not a NumPy or CuPy array. An object whose attribute
    lookup raises counts as one: the general way then refuses it by name (:func:`_speaks_dlpack`)."""
    try:
        for x in values:
            if type(x) in _NATIVE_TYPES or not hasattr(x, "__dlpack__"):
                continue
            if not is_native(x):
                return True
            if is_cupy_array(x):
                _NATIVE_TYPES.add(type(x))
    except Exception:  # a __dlpack__ property that raises (hasattr passes on only AttributeError)
        return True
    return False


def _speaks_dlpack(name: str, x: Any) -> bool:
    """Whether argument ``name`` has ``__dlpack__``.

    Raises:
        TypeError: asking raised (a property that fails), naming the argument.
    """
    try:
        return hasattr(x, "__dlpack__")
    except Exception as error:
        raise TypeError(
            f"expected {name} to be a NumPy or CuPy array or an object with __dlpack__, got "
            f"{_kind(x)} whose __dlpack__ raised {type(error).__name__}: {error}"
        ) from error


_DECLINED = object()  # what _cpu_tensor_call returns for a call it leaves to the general way


def _cpu_tensor_call(function: Callable[..., Any], names: tuple, args: tuple, kwargs: dict) -> Any:
    """``function`` called with NumPy views of the call's PyTorch CPU tensors (its only arrays:
    a layer's call), its result handed back as tensors: the lean way, one pass over the
    arguments. :data:`_DECLINED` (nothing called) when a tensor needs the general way.
    """
    given = (*args, *kwargs.values()) if kwargs else args
    torch = _torch_types()
    views = _cpu_tensor_views(given, torch)
    if views is None:
        return _DECLINED
    try:
        if kwargs:
            n = len(args)
            result = function(*views[:n], **dict(zip(kwargs, views[n:], strict=True)))
        else:
            result = function(*views)
    except (TypeError, ValueError) as error:
        _name_arrays(error, "torch", names, args, kwargs)
        raise
    return _back(result, views, given, "torch", torch)


def _cpu_tensor_views(values: Any, torch: _Torch) -> tuple[Any, ...] | None:
    """``values`` with each PyTorch tensor replaced by its NumPy view (``Tensor.numpy()``;
    bfloat16: of its ``uint16`` view); ``None`` when one of them needs the general way (another
    array, a tensor on a device, one that requires grad or that ``numpy()`` refuses), which then
    names what it refuses.

    A tensor off the CPU is asked for first (a layer's call on CUDA declines at once, without
    an exception); ``numpy()`` itself refuses one that requires grad and one with a lazy
    negation, but the ``uint16`` view of a bfloat16 tensor does not require grad, so that one is
    asked too.
    """
    tensor, bfloat16 = torch.tensor, torch.bfloat16
    views = []
    for x in values:
        if isinstance(x, tensor):
            if not x.is_cpu:
                return None
            try:
                if x.dtype is not bfloat16:
                    x = x.numpy()
                elif x.requires_grad:
                    return None
                else:
                    x = x.view(torch.bits16).numpy()
            except (RuntimeError, TypeError, ValueError):  # fp8, a lazy negation, sparse, ...
                return None
        elif type(x) is np.ndarray:
            return None
        else:
            try:
                if hasattr(x, "__dlpack__"):
                    return None
            except Exception:  # a __dlpack__ property that raises: the general way names it
                return None
        views.append(x)
    return tuple(views)


def _back(result: Any, imported: Any, originals: Any, framework: str, torch: _Torch) -> Any:
    """``result`` handed back to the caller: an array that is one of ``imported`` as the object
    of ``originals`` it came from (an ``out=`` the caller gave), any other NumPy or CuPy array
    as ``framework``'s (:func:`_export`), each of a tuple alike, anything else as it is."""
    if type(result) is not np.ndarray:  # the common case, a NumPy array, first
        if isinstance(result, tuple):
            return tuple(_back(x, imported, originals, framework, torch) for x in result)
        if result is None or not is_native(result):
            return result
    for array, original in zip(imported, originals, strict=True):
        if array is result:
            return original
    return _export(result, framework, torch)


def _name_arrays(error: Exception, framework: str, names: tuple, args: tuple, kwargs: dict) -> None:
    """Append to ``error``'s message the framework's own dtype and device of each of the call's
    arrays (``"arrived as torch arrays: k torch.int8 on cpu, ..."``)."""
    if error.args and isinstance(error.args[0], str):
        described = ", ".join(
            f"{n} {_shown_dtype(x)} on {_device(x)}" for n, x in _given(names, args, kwargs).items()
        )
        message = f"{error.args[0]} (arrived as {framework} arrays: {described})"
        error.args = (message, *error.args[1:])


def _given(names: tuple, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arrays by name (its ``__dlpack__`` arguments; an object whose lookup raises
    is left out: this only describes the call)."""
    arrays = {n: x for n, x in zip(names, args, strict=False) if _has_dlpack(x)}
    return arrays | {n: x for n, x in kwargs.items() if _has_dlpack(x)}


def _has_dlpack(x: Any) -> bool | None:
    """Whether ``x`` has ``__dlpack__``; ``None`` when asking raised (a property that fails)."""
    try:
        return hasattr(x, "__dlpack__")
    except Exception:
        return None


class _Imported:
    """One call's arguments with its foreign arrays imported (``args``, ``kwargs``), the general
    way: argument by argument, :func:`_refuse_what_dlpack_would_lose` for tensors, then DLPack
    (:func:`_import`), whose refusal names the cause. It lives for the call only: nothing of the
    caller's is kept after it.

    ``imported`` and ``originals`` pair each imported array with the caller's object it came
    from (a call has a handful, so lists searched by identity beat a dictionary keyed by id()).

    Raises:
        TypeError: arrays of two frameworks in one call, or a foreign array that cannot be
            imported (a tensor on a device cupaged does not run on, one that requires grad,
            one with a lazy negation or conjugation, a one-byte float of a format no kernel
            reads); fp8 caches that :func:`_with_kv_dtype` refuses.
    """

    __slots__ = (
        "_call",
        "_fp8",
        "_frameworks",
        "args",
        "framework",
        "imported",
        "kwargs",
        "originals",
        "torch",
    )

    def __init__(self, names: tuple[str, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        self._call = (names, args, kwargs)  # the caller's own, for names and error messages
        self.torch = _torch_types()
        self.imported, self.originals = [], []
        self._frameworks = set()
        self._fp8 = set()  # the formats of the fp8 caches, imported as bytes
        self.args = tuple(self._import_arg(i, x) for i, x in enumerate(args))
        self.kwargs = kwargs
        if kwargs:
            imported = (self._import_arg(i, x) for i, x in enumerate(kwargs.values(), len(args)))
            self.kwargs = dict(zip(kwargs, imported, strict=True))
        if self._fp8:
            self.kwargs = _with_kv_dtype(self._fp8, names, self.kwargs)
        if len(self._frameworks) > 1:
            described = ", ".join(f"{n}: {_kind(x)}" for n, x in _given(*self._call).items())
            raise TypeError(
                f"expected the arrays of one call from one framework, got a mix of "
                f"{' and '.join(sorted(self._frameworks))} ({described})"
            )
        # One, unless an argument's __dlpack__ came and went between the boundary's look and
        # this import (a property that raises for some objects): then a call of native arrays.
        self.framework = self._frameworks.pop() if self._frameworks else "numpy/cupy"

    def _import_arg(self, i: int, x: Any) -> Any:
        """Argument ``i`` (positional ones first) imported when it has ``__dlpack__``, through
        DLPack, after the refusals of :func:`_refuse_what_dlpack_would_lose` for a tensor."""
        names, args, kwargs = self._call
        if i < len(args):
            name = names[i] if i < len(names) else f"argument {i}"
        else:
            name = list(kwargs)[i - len(args)]
        if not _speaks_dlpack(name, x):
            return x
        torch = self.torch
        if isinstance(x, torch.tensor):
            framework = "torch"
            _refuse_what_dlpack_would_lose(name, x)
            fp8 = torch.fp8.get(x.dtype)
            if fp8 is None and x.dtype.is_floating_point and x.dtype.itemsize == 1:
                raise TypeError(
                    f"expected {name} in an fp8 format that cupaged reads (torch.float8_e4m3fn "
                    f"or torch.float8_e5m2), got {_kind(x)}"
                )
            if x.dtype is torch.bfloat16:
                source = x.view(torch.int16)
            else:
                source = x if fp8 is None else x.view(torch.uint8)
            array = _import(name, source, framework, shown=x)
            if fp8 is not None and name in ("k_cache", "v_cache"):
                self._fp8.add(fp8)  # other arguments are never fp8: the function refuses bytes
        else:
            framework = framework_of(x)
            if is_native(x):
                self._frameworks.add("numpy/cupy")
                return x
            array = _import(name, x, framework)
        self._frameworks.add(framework)
        self.imported.append(array)
        self.originals.append(x)
        return array


def _with_kv_dtype(formats: set[str], names: tuple, kwargs: dict) -> dict:
    """``kwargs`` with ``kv_dtype`` naming ``formats``, the format of the call's fp8 caches that
    arrived as ``uint8`` bytes, when the caller gave none (``kv_dtype`` is keyword-only wherever
    it is taken: every function that takes a cache, and the plans' ``run``, which check it
    against their own format).

    Raises:
        TypeError: caches of two formats; a ``kv_dtype`` that names another; or a function that
            takes no ``kv_dtype``, which could not check the bytes against a format.
    """
    if len(formats) > 1:
        got = " and ".join(sorted(formats))
        raise TypeError(f"expected the fp8 caches of one call in one format, got {got}")
    (fp8,) = formats
    if "kv_dtype" not in names:
        raise TypeError(
            f"expected no fp8 cache here (this function takes no kv_dtype to check a {fp8} "
            f"tensor's format against), got one"
        )
    given = kwargs.get("kv_dtype")
    if given is None:
        return kwargs | {"kv_dtype": fp8}
    if dtype_name(given) != fp8:
        raise TypeError(
            f"expected kv_dtype={fp8!r}, the format of the call's fp8 caches (or none), got "
            f"kv_dtype={given!r}"
        )
    return kwargs


def _export(result: Any, framework: str, torch: _Torch) -> Any:
    """A NumPy or CuPy array as ``framework``'s array, without a copy. cupaged's 16-bit integer
    results are bfloat16 patterns (its bfloat16 storage): they go back as bfloat16. An exporter
    of another framework gets the NumPy or CuPy array itself.

    A writable NumPy array goes to PyTorch through ``torch.from_numpy``, the same view as
    ``torch.from_dlpack`` at a fraction of its cost; a read-only array and a CuPy array go
    through DLPack. A PyTorch caller never gets an ``ml_dtypes`` result, which neither bridge
    takes: queries and outputs are never fp8, and its bfloat16 arrives as ``uint16``.
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
    ``fp8``: ``torch.float8_e4m3fn`` and ``torch.float8_e5m2`` by the names of their formats
    (PyTorch's ``fnuz`` formats and ``float8_e8m0fnu`` are other formats, which no kernel reads).
    """

    tensor: type
    bfloat16: Any = None
    int16: Any = None
    bits16: Any = None
    from_numpy: Callable[[Any], Any] | None = None
    from_dlpack: Callable[[Any], Any] | None = None
    uint8: Any = None
    fp8: dict[Any, str] = field(default_factory=dict)  # PyTorch's fp8 dtypes that cupaged reads


_NO_TORCH = _Torch(_NotImported)


def _torch_types() -> _Torch:
    """PyTorch's types and bridges, or :data:`_NO_TORCH` while it is not imported."""
    torch = sys.modules.get("torch")
    return _NO_TORCH if torch is None else _torch_of(torch)


@functools.cache
def _torch_of(torch: Any) -> _Torch:
    bits16 = getattr(torch, "uint16", torch.int16)
    fp8 = {}  # cupaged's names decide which of PyTorch's one-byte floats are its formats
    for name in dir(torch):
        if name.startswith("float8_"):
            try:
                fp8[getattr(torch, name)] = dtype_name(name)
            except TypeError:  # another format (fnuz, e8m0)
                pass
    return _Torch(
        torch.Tensor,
        torch.bfloat16,
        torch.int16,
        bits16,
        torch.from_numpy,
        torch.from_dlpack,
        torch.uint8,
        fp8,
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

    Raises:
        TypeError: naming the argument, for whatever the producer does wrong: no
            ``__dlpack_device__``, one that raises or does not return ``(device_type,
            device_id)``, a device cupaged does not run on, or a ``__dlpack__`` export that
            fails (with any exception: it is the producer's code).
    """
    shown = x if shown is None else shown
    if framework == "torch":  # cheaper than asking __dlpack_device__()
        device = _DL_CUDA if x.is_cuda else _DL_CPU if x.is_cpu else None
    else:
        device = None
    if device is None:
        device = _device_type(name, x, shown)
    from_dlpack = _importer(name, device, shown)
    try:
        return from_dlpack(x)
    except Exception as error:  # the producer's own refusal, or its failure
        raise _not_importable(name, shown, error) from error


def _not_importable(name: str, shown: Any, error: BaseException) -> TypeError:
    """The refusal of argument ``name`` whose DLPack export (``__dlpack_device__()`` or
    ``__dlpack__()``) raised ``error``: the framework's own refusal or a failure of its code."""
    return TypeError(
        f"expected {name} importable through DLPack (a dense tensor in host or CUDA memory, "
        f"not requiring grad), got {_kind(shown)}: {_said(error)}"
    )


def _device_type(name: str, x: Any, shown: Any) -> int:
    """The DLPack device type that ``x.__dlpack_device__()`` reports, checked.

    Raises:
        TypeError: no ``__dlpack_device__``, one that raises, or a result that is not a
            ``(device_type, device_id)`` pair of ints.
    """
    try:
        report = x.__dlpack_device__
    except Exception as error:  # AttributeError, or a property that raises
        raise TypeError(
            f"expected {name} to be a NumPy or CuPy array or an object with __dlpack__ and "
            f"__dlpack_device__, got {_kind(shown)} ({_said(error)})"
        ) from None
    try:
        device = report()
    except Exception as error:  # the framework's refusal (a meta tensor), or its failure
        raise _not_importable(name, shown, error) from error
    try:
        device_type, _ = device
        return operator.index(device_type)
    except (TypeError, ValueError):
        raise TypeError(
            f"expected {name}.__dlpack_device__() to return (device_type, device_id) ints, got "
            f"{device!r} from {_kind(shown)}"
        ) from None


def _importer(name: str, device_type: int, shown: Any) -> Callable[[Any], Any]:
    """The ``from_dlpack`` of the array module for memory of DLPack ``device_type``."""
    if device_type in (_DL_CPU, _DL_CUDA_HOST):
        return np.from_dlpack
    if device_type == _DL_CUDA:
        cupy = cupy_module()
        if cupy is None:
            raise TypeError(
                f"expected {name} in host memory (CuPy is not installed), got CUDA memory"
            )
        return cupy.from_dlpack  # hands the producer CuPy's current stream
    raise TypeError(
        f"expected {name} in host or CUDA memory, got DLPack device type {device_type} "
        f"({_kind(shown)})"
    )


def _said(error: BaseException) -> str:
    """An exception as ``"KeyError: 'x'"``; a framework's refusal (``BufferError``,
    ``RuntimeError``, ``ValueError``) by its message alone, as it reads best."""
    if isinstance(error, (BufferError, RuntimeError, ValueError)):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _shown_dtype(x: Any) -> str:
    dtype = _attribute(x, "dtype")
    return "?" if dtype is None else str(dtype)


def _device(x: Any) -> str:
    device = _attribute(x, "device")
    return "?" if device is None or callable(device) else str(device)


def _kind(x: Any) -> str:
    """``torch.Tensor(dtype=torch.float16, device=cpu)``-like description of an argument."""
    kind = f"{type(x).__module__}.{type(x).__name__}"
    dtype, device = _attribute(x, "dtype"), _attribute(x, "device")
    if dtype is not None:
        kind += f" of dtype {dtype}"
    if device is not None and not callable(device):
        kind += f" on {device}"
    return kind


def _attribute(x: Any, name: str) -> Any:
    """``x.name``, or ``None`` when ``x`` has none or asking raises: for error messages, which
    must not fail on the object they describe."""
    try:
        return getattr(x, name, None)
    except Exception:
        return None
