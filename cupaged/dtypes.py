"""Element types of the cache: float32, float16 and bfloat16.

CuPy has no bfloat16 dtype (cupy issue 7527), so a bfloat16 cache stores the 16-bit patterns in
``uint16`` arrays and is named by ``dtype="bfloat16"``. On NumPy, ``ml_dtypes.bfloat16`` arrays are
accepted too, and ``int16`` arrives from PyTorch or JAX through DLPack; both are viewed as ``uint16``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ._backend import array_module


@dataclass(frozen=True, slots=True)
class ElementType:
    """One element type of the cache: how arrays store it and how the kernels name it.

    Attributes:
        name: ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        storage: the array dtype that stores it (``uint16`` for bfloat16: CuPy has none).
        c_type: the kernels' template argument for it (``__half``).
        carriers: array dtypes whose elements hold it (for bfloat16 also ``int16``, which
            arrives from PyTorch or JAX through DLPack, and ``ml_dtypes.bfloat16``).
    """

    name: str
    storage: np.dtype
    c_type: str
    carriers: tuple[np.dtype, ...]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.storage.itemsize


# The one element-type table; everything below, and the launch table's C types, read it.
ELEMENT_TYPES = {
    t.name: t
    for t in (
        ElementType("float32", np.dtype(np.float32), "float", (np.dtype(np.float32),)),
        ElementType("float16", np.dtype(np.float16), "__half", (np.dtype(np.float16),)),
        ElementType(
            "bfloat16",
            np.dtype(np.uint16),
            "__nv_bfloat16",
            (np.dtype(np.uint16), np.dtype(np.int16), np.dtype(ml_dtypes.bfloat16)),
        ),
    )
}
DTYPE_NAMES = tuple(ELEMENT_TYPES)
# Views of the table that the launch path reads with one dictionary lookup.
C_TYPES = {t.name: t.c_type for t in ELEMENT_TYPES.values()}
ITEMSIZES = {t.name: t.itemsize for t in ELEMENT_TYPES.values()}
_BY_ARRAY_DTYPE = {c: t.name for t in ELEMENT_TYPES.values() for c in t.carriers}
# Carriers viewed as their storage dtype (int16 and ml_dtypes.bfloat16 as uint16).
_STORAGE_VIEWS = {
    c: t.storage for t in ELEMENT_TYPES.values() for c in t.carriers if c != t.storage
}


def dtype_name(dtype: Any) -> str:
    """Canonical name of an element type given as a string or a NumPy-compatible dtype.

    ``"bfloat16"``, ``ml_dtypes.bfloat16`` and ``"bf16"`` all name bfloat16; ``uint16`` does not
    (it is how bfloat16 is *stored*, but as a request it is ambiguous).

    Raises:
        TypeError: the dtype is not one of float32, float16, bfloat16.
    """
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        return "bfloat16"
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        np_dtype = None
    if np_dtype == np.dtype(ml_dtypes.bfloat16):
        return "bfloat16"
    if np_dtype is not None and np_dtype.name in ELEMENT_TYPES:
        return np_dtype.name
    raise TypeError(f"expected dtype one of {DTYPE_NAMES}, got {dtype!r}")


def storage_dtype(name: str) -> np.dtype:
    """The array dtype that stores elements of type ``name`` (``uint16`` for bfloat16)."""
    return ELEMENT_TYPES[dtype_name(name)].storage


def itemsize(name: str) -> int:
    """Bytes per element of type ``name``."""
    return ELEMENT_TYPES[dtype_name(name)].itemsize


def array_dtype_name(x: Any) -> str:
    """Element type that the array ``x`` holds: its dtype, or bfloat16 for 16-bit integer carriers.

    Raises:
        TypeError: ``x`` holds none of float32, float16 or bfloat16 patterns.
    """
    name = _BY_ARRAY_DTYPE.get(x.dtype)
    if name is not None:
        return name
    if x.dtype.name in ELEMENT_TYPES:  # float32 or float16 in the other byte order
        return x.dtype.name
    raise TypeError(
        f"expected an array of float32, float16 or bfloat16 (stored as uint16), got dtype {x.dtype}"
    )


def as_storage(x: Any) -> Any:
    """View ``x`` in its storage dtype (bfloat16 carriers become ``uint16``); no copy."""
    storage = _STORAGE_VIEWS.get(x.dtype)
    return x if storage is None else x.view(storage)


def to_float(x: Any, dtype: Any = np.float32) -> Any:
    """Widen an array of any cache element type to float32 (or float64), exactly.

    The way back from a bfloat16 cache or kernel output: ``uint16`` (or ``int16``) bit patterns and
    ``ml_dtypes.bfloat16`` arrays become the float32 values they hold. bfloat16 is the upper half
    of a float32, so widening it is a shift of its bit pattern; that works unchanged on NumPy and
    CuPy arrays (CuPy has no bfloat16 dtype).

    >>> import numpy as np, cupaged
    >>> bits = cupaged.from_float(np.array([1.0, -2.5, 3.14159], np.float32), "bfloat16")
    >>> bits.dtype, cupaged.to_float(bits).tolist()
    (dtype('uint16'), [1.0, -2.5, 3.140625])

    Args:
        x: float32, float16, or bfloat16 (``uint16``/``int16`` bits or ``ml_dtypes.bfloat16``)
            array of any shape, NumPy or CuPy.
        dtype: ``numpy.float32`` (the default) or ``numpy.float64``.

    Returns:
        An array of ``x``'s shape in ``dtype``, on ``x``'s device (``x`` itself when nothing changes).

    Raises:
        TypeError: ``x`` holds none of float32, float16 or bfloat16 patterns.
    """
    if array_dtype_name(x) == "bfloat16":
        bits = as_storage(x).astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).astype(dtype, copy=False)
    return x.astype(dtype, copy=False)


def float32_to_bfloat16_bits(x: Any) -> Any:
    """Round a float32 array to bfloat16 (round to nearest, ties to even); return ``uint16`` bits.

    Written in array ops because CuPy has no bfloat16 type; the tests check it against
    ``ml_dtypes.bfloat16`` on NumPy. NaNs stay NaNs (quiet), infinities stay infinities.
    """
    bits = x.astype(np.float32, copy=False).view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = (bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)
    quiet_nan = (bits >> np.uint32(16)) | np.uint32(0x0040)
    is_nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return array_module(x).where(is_nan, quiet_nan, rounded).astype(np.uint16)


def from_float(x: Any, name: Any, like: Any = None) -> Any:
    """Round a float array to a cache element type, in the dtype that stores it.

    The way into a bfloat16 cache from float32 activations: ``name="bfloat16"`` rounds to nearest
    (ties to even, as ``ml_dtypes`` and CUDA's ``__float2bfloat16`` do) and returns the ``uint16``
    bit patterns that a bfloat16 cache holds, on NumPy and CuPy alike; see :func:`to_float` for an
    example of the round trip.

    Args:
        x: float32 or float64 array of any shape (NumPy or CuPy).
        name: target element type: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (or a dtype
            naming one of them, ``ml_dtypes.bfloat16`` included).
        like: optional array whose bfloat16 carrier dtype (``uint16``, ``int16`` or
            ``ml_dtypes.bfloat16``) the result is viewed as.

    Returns:
        An array of ``x``'s shape: float32, float16, or for bfloat16 ``uint16`` bits (``like``'s
        carrier dtype when given), on ``x``'s device.

    Raises:
        TypeError: ``name`` is not one of float32, float16, bfloat16.
    """
    name = dtype_name(name)
    if name != "bfloat16":
        return x.astype(name)
    bits = float32_to_bfloat16_bits(x.astype(np.float32))
    if like is not None and _BY_ARRAY_DTYPE.get(like.dtype) == "bfloat16":
        return bits.view(like.dtype)
    return bits
