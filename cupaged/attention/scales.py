"""The scales of an fp8 cache, checked once for every function that takes them.

An fp8 cache holds ``fp8(x / scale)`` and is read as ``fp8 * scale`` (docs/fp8.md), with one
scale for K and one for V, each either one value for the whole layer or one per KV head:

- a real Python (or NumPy) number: positive and finite in float32, checked on the host;
- a 0-d, ``[1]`` or ``[num_kv_heads]`` float32 array on the cache's device: checked in checked
  mode (one synchronisation, like the other checks), trusted with ``checked=False``, and read by
  the kernel where it lies, so that a step never waits on it;
- ``None``: 1.0.

The kernels take both as six arguments (``cuda/common.cuh``, "fp8 caches"; the record
``cupaged.kernels.args.ScaleArgs``): for each of K and V a value, an array and a stride, the
head's scale ``value * array[head * stride]``; a number is the value over an array of 1.0, an
array 1.0 over itself. Scales are refused for a cache that is not fp8: they would silently do
nothing.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import array_module
from ..dtypes import is_fp8
from ..kernels.args import ScaleArgs

# (array module, CUDA device) -> a float32 [1] array of 1.0: the array under a number's scale.
_ONES: dict[tuple, Any] = {}
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _ones(xp: Any) -> Any:
    """A float32 ``[1]`` array of 1.0 on ``xp``'s current device, made once per device."""
    key = (xp, None if xp is np else xp.cuda.Device().id)
    ones = _ONES.get(key)
    if ones is None:
        ones = _ONES[key] = xp.ones(1, np.float32)
    return ones


def kv_scale_args(
    xp: Any, elem: str, num_kv_heads: int, k_scale: Any, v_scale: Any, *, checked: bool = True
) -> ScaleArgs:
    """The six kernel arguments of ``k_scale`` and ``v_scale`` for a cache of element type
    ``elem`` on ``xp``'s device.

    For a cache that is not fp8 both must be ``None``; the arguments are then those of 1.0 (the
    kernels of such a cache never read them).

    Raises:
        TypeError: a scale that is neither a number nor a float32 array of the cache's device.
        ValueError: scales for a cache that is not fp8; a number that is not positive and finite;
            an array of another shape; (checked) an array with an element that is not positive
            and finite.
    """
    if not is_fp8(elem):
        if k_scale is not None or v_scale is not None:
            raise ValueError(
                f"expected k_scale=None and v_scale=None for a {elem} cache (scales apply to fp8 "
                f"caches only), got k_scale={_shown(k_scale)}, v_scale={_shown(v_scale)}"
            )
        ones = _ones(xp)
        return ScaleArgs(
            k_scale=np.float32(1.0),
            v_scale=np.float32(1.0),
            k_scales=ones,
            v_scales=ones,
            k_scale_stride=np.int32(0),
            v_scale_stride=np.int32(0),
        )
    k_value, k_array, k_stride = _scale_args(xp, num_kv_heads, k_scale, "k_scale")
    v_value, v_array, v_stride = _scale_args(xp, num_kv_heads, v_scale, "v_scale")
    if checked:
        arrays = [a for a, scale in ((k_array, k_scale), (v_array, v_scale)) if _is_array(scale)]
        if arrays:
            _check_positive(xp, arrays)
    return ScaleArgs(
        k_scale=k_value,
        v_scale=v_value,
        k_scales=k_array,
        v_scales=v_array,
        k_scale_stride=k_stride,
        v_scale_stride=v_stride,
    )


def scale_value(scale: Any, what: str) -> float:
    """A number-valued scale, checked: real, positive and finite in float32, as a float."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        # (a complex number too: its imaginary part would be dropped without a word)
        raise TypeError(
            f"expected {what} to be a real number or a float32 array, got {_shown(scale)}"
        )
    try:
        value = float(scale)
    except OverflowError:  # an int past float64's range: past float32's too
        raise ValueError(
            f"expected {what} positive and finite (in float32), got an int of "
            f"{int(scale).bit_length()} bits (float32's largest is {_FLOAT32_MAX:.4g})"
        ) from None
    # float32 as the kernels take it: a value past float32's range is infinite there.
    if not (math.isfinite(value) and 0.0 < value <= _FLOAT32_MAX):
        raise ValueError(f"expected {what} positive and finite (in float32), got {value!r}")
    if np.float32(value) == 0.0:
        raise ValueError(f"expected {what} positive in float32, got {value!r} (0 in float32)")
    return value


def _is_array(scale: Any) -> bool:
    """An array scale (a NumPy scalar such as ``np.float32(2)`` is a number)."""
    return hasattr(scale, "shape") and not isinstance(scale, np.generic)


def _scale_args(xp: Any, num_kv_heads: int, scale: Any, what: str) -> tuple[Any, Any, Any]:
    """``(value, array, stride)`` of one scale (the module docstring)."""
    if scale is None:
        return np.float32(1.0), _ones(xp), np.int32(0)
    if not _is_array(scale):
        return np.float32(scale_value(scale, what)), _ones(xp), np.int32(0)
    try:
        module = array_module(scale)
    except TypeError:
        module = None
    if module is not xp:
        raise TypeError(
            f"expected {what} as a number or a float32 {xp.__name__} array (the cache's device), "
            f"got {type(scale).__module__}.{type(scale).__name__}"
        )
    if xp is not np and scale.device.id != xp.cuda.Device().id:
        raise TypeError(
            f"expected {what} on CUDA device {xp.cuda.Device().id} (the cache's), got one on "
            f"device {scale.device.id}"
        )
    if scale.dtype != np.float32:
        raise TypeError(f"expected {what} of dtype float32, got {scale.dtype}")
    shape = tuple(scale.shape)
    if shape in ((), (1,)):
        stride = 0
    elif shape == (num_kv_heads,):
        stride = 1
    else:
        raise ValueError(
            f"expected {what} of shape () or (num_kv_heads={num_kv_heads},), got {shape}"
        )
    return np.float32(1.0), xp.ascontiguousarray(scale.reshape(-1)), np.int32(stride)


def _check_positive(xp: Any, arrays: list[Any]) -> None:
    """Every element of every array positive and finite: one transfer of one flag."""
    ok = xp.stack([xp.all(xp.isfinite(a) & (a > 0)) for a in arrays]).all()
    if not bool(ok):
        raise ValueError(
            "expected k_scale and v_scale positive and finite, got an array with an element "
            "that is zero, negative, infinite or NaN"
        )


def _shown(x: Any) -> str:
    if x is None or isinstance(x, (int, float)):
        return repr(x)
    return f"{type(x).__module__}.{type(x).__name__}"


def own_scales(trusted: tuple[Any, ...], k_scale: Any, v_scale: Any) -> bool:
    """Whether every array among ``k_scale`` and ``v_scale`` is one of ``trusted`` (a plan's
    :func:`trusted_memory`) or a view whose base is; numbers and ``None`` are checked on the
    host whatever this says."""
    for scale in (k_scale, v_scale):
        if hasattr(scale, "shape") and not isinstance(scale, np.generic):
            base = getattr(scale, "base", None)
            if not any(scale is array or base is array for array in trusted):
                return False
    return True


def trusted_memory(arrays: Any) -> tuple[Any, ...]:
    """``arrays`` and the arrays that own their memory: the bases a view of one of them names
    (NumPy names the owner; a view of a view may name the view)."""
    found: list[Any] = []
    for array in arrays:
        base = getattr(array, "base", None)
        found += [array] if base is None else [array, base]
    return tuple(found)
