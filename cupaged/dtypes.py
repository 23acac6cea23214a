"""Element types of the cache: float32, float16, bfloat16 and the two fp8 formats.

bfloat16 has three carriers, all taken wherever an array is: ``uint16`` bit patterns,
``ml_dtypes.bfloat16``, and ``int16`` (how PyTorch and JAX hand it over through DLPack). The
kernels get every one as its ``uint16`` view. A cache's own arrays (:func:`cache_dtype`) are
native ``ml_dtypes.bfloat16`` on CuPy 14 and later (cupy#9494; its DLPack export names them
bfloat16, so ``torch.from_dlpack(cache.k[layer])`` is a ``torch.bfloat16`` tensor), and
``uint16`` on CuPy 13, which has no bfloat16 (cupy issue 7527), and on NumPy, whose DLPack
export refuses ``ml_dtypes`` dtypes: there ``torch.from_dlpack`` views the bits and
``.view(torch.bfloat16)`` names them.

fp8 (docs/fp8.md) is a cache type only, never a query's: ``float8_e4m3`` is OCP E4M3
(``ml_dtypes.float8_e4m3fn``: max 448, NaN, no infinity) and ``float8_e5m2`` is E5M2 (max 57344).
CuPy has no fp8 dtype, so a GPU fp8 cache is a ``uint8`` array named by the cache's dtype; on the
CPU it is an ``ml_dtypes`` fp8 array. A ``uint8`` array cannot say which fp8 it holds: the calls
that take one take ``kv_dtype=`` too.
"""

from __future__ import annotations

import functools
import reprlib
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .backend import array_module, is_cupy_array


@dataclass(frozen=True, slots=True)
class ElementType:
    """One element type of the cache: how arrays store it and how the kernels name it.

    Attributes:
        name: ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"float8_e4m3"`` or
            ``"float8_e5m2"``.
        storage: the array dtype that the kernels are handed (``uint16`` for bfloat16, ``uint8``
            for fp8), and that stores it where no native dtype does (:func:`cache_dtype`).
        c_type: the kernels' template argument for it (``__half``, ``__nv_fp8_e4m3``).
        carriers: array dtypes whose elements say they hold it (for bfloat16 also ``int16``,
            which arrives from PyTorch or JAX through DLPack, and ``ml_dtypes.bfloat16``; for
            fp8 its ``ml_dtypes`` dtype, not ``uint8``, which holds either format).
        host: the dtype of a NumPy (CPU) cache of it: ``storage``, but ``ml_dtypes`` fp8.
        max: the largest finite value (fp8: what a write clamps to), else None.
    """

    name: str
    storage: np.dtype
    c_type: str
    carriers: tuple[np.dtype, ...]
    host: np.dtype | None = None
    max: float | None = None

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
        *(
            ElementType(name, np.dtype(np.uint8), c_type, (np.dtype(fp8),), np.dtype(fp8), fmax)
            for name, c_type, fp8, fmax in (
                ("float8_e4m3", "__nv_fp8_e4m3", ml_dtypes.float8_e4m3fn, 448.0),
                ("float8_e5m2", "__nv_fp8_e5m2", ml_dtypes.float8_e5m2, 57344.0),
            )
        ),
    )
}
DTYPE_NAMES = tuple(ELEMENT_TYPES)
FP8_NAMES = ("float8_e4m3", "float8_e5m2")
# What a query (and an attention output) may be: every element type but fp8.
Q_DTYPE_NAMES = tuple(name for name in DTYPE_NAMES if name not in FP8_NAMES)
# Names that mean an element type besides the canonical ones (case-insensitive).
_ALIASES = {
    "bf16": "bfloat16",
    "fp8": "float8_e4m3",
    "fp8_e4m3": "float8_e4m3",
    "fp8_e5m2": "float8_e5m2",
    "float8_e4m3fn": "float8_e4m3",
}
# Views of the table that the launch path reads with one dictionary lookup.
C_TYPES = {t.name: t.c_type for t in ELEMENT_TYPES.values()}
ITEMSIZES = {t.name: t.itemsize for t in ELEMENT_TYPES.values()}
_BY_ARRAY_DTYPE = {c: t.name for t in ELEMENT_TYPES.values() for c in t.carriers}
# Carriers viewed as their storage dtype (int16 and ml_dtypes.bfloat16 as uint16).
_STORAGE_VIEWS = {
    c: t.storage for t in ELEMENT_TYPES.values() for c in t.carriers if c != t.storage
}


# Names what a refusal got, cut short: a list or an array given as a dtype can be long.
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80


def dtype_name(dtype: Any) -> str:
    """Canonical name of an element type given as a string or a NumPy-compatible dtype.

    ``"bfloat16"``, ``ml_dtypes.bfloat16`` and ``"bf16"`` all name bfloat16; ``"fp8"``,
    ``"fp8_e4m3"`` and ``ml_dtypes.float8_e4m3fn`` name float8_e4m3, ``"fp8_e5m2"`` and
    ``ml_dtypes.float8_e5m2`` float8_e5m2. ``uint16`` and ``uint8`` name nothing (they are how
    bfloat16 and fp8 are *stored*, but as a request they are ambiguous).

    Raises:
        TypeError: the dtype is none of the element types, or is ``ml_dtypes.float8_e4m3`` (the
            IEEE-like E4M3 with infinities, max 240; cupaged's ``float8_e4m3`` is OCP E4M3).
    """
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype.lower(), dtype.lower())
        if name in ELEMENT_TYPES:
            return name
    try:
        np_dtype = np.dtype(dtype)
    except Exception:  # not a dtype (TypeError), or one NumPy refuses otherwise (ValueError, ...)
        np_dtype = None
    if np_dtype == np.dtype(ml_dtypes.float8_e4m3):
        raise TypeError(
            "expected OCP float8_e4m3 (ml_dtypes.float8_e4m3fn: max 448, no infinity), got "
            "ml_dtypes.float8_e4m3 (IEEE-like, max 240), which no kernel reads"
        )
    if np_dtype is not None:
        name = _ALIASES.get(np_dtype.name, np_dtype.name)
        if name in ELEMENT_TYPES:
            return name
    raise TypeError(f"expected dtype one of {DTYPE_NAMES}, got {_SHORT.repr(dtype)}")


def is_fp8(name: str) -> bool:
    """Whether the element type ``name`` (canonical) is one of the fp8 formats."""
    return name in FP8_NAMES


def fp8_max(name: str) -> float:
    """The largest finite value of an fp8 format: 448 (e4m3), 57344 (e5m2)."""
    value = ELEMENT_TYPES[dtype_name(name)].max
    if value is None:
        raise TypeError(f"expected an fp8 dtype, one of {FP8_NAMES}, got {name!r}")
    return value


def cache_dtype(name: str, xp: Any = np) -> np.dtype:
    """The array dtype of a cache of element type ``name`` on ``xp``'s device: the storage
    dtype, but ``ml_dtypes`` fp8 on NumPy, and ``ml_dtypes.bfloat16`` on CuPy 14 and later (the
    module docstring says why NumPy keeps ``uint16``)."""
    element = ELEMENT_TYPES[dtype_name(name)]
    if xp is np:
        return element.storage if element.host is None else element.host
    if element.name == "bfloat16" and native_bfloat16(xp):
        return np.dtype(ml_dtypes.bfloat16)
    return element.storage


@functools.cache
def native_bfloat16(xp: Any) -> bool:
    """Whether the CuPy module ``xp`` has ``ml_dtypes.bfloat16`` arrays (CuPy 14 on: cupy#9494,
    with DLPack import and export of them since cupy#9670). Read from the version, so that no
    device is needed to tell; NumPy answers ``False`` (its caches keep ``uint16``)."""
    version = getattr(xp, "__version__", "0")
    major = version.split(".", 1)[0]
    return xp is not np and major.isdigit() and int(major) >= 14


def storage_dtype(name: str) -> np.dtype:
    """The array dtype that stores elements of type ``name`` (``uint16`` for bfloat16)."""
    return ELEMENT_TYPES[dtype_name(name)].storage


def itemsize(name: str) -> int:
    """Bytes per element of type ``name``."""
    return ELEMENT_TYPES[dtype_name(name)].itemsize


def array_dtype_name(x: Any, kv_dtype: Any = None) -> str:
    """Element type that the array ``x`` holds: its dtype, bfloat16 for 16-bit integer carriers,
    or, for a ``uint8`` array, the fp8 format ``kv_dtype`` names.

    Raises:
        TypeError: ``x`` holds none of the element types; a ``uint8`` array without
            ``kv_dtype``; a ``kv_dtype`` that is not fp8, or is given for an array that holds
            another type.
    """
    if kv_dtype is not None:
        return _named_fp8(x, kv_dtype)
    name = _BY_ARRAY_DTYPE.get(x.dtype)
    if name is not None:
        return name
    if x.dtype.name in ("float32", "float16"):  # in the other byte order
        return x.dtype.name
    if x.dtype == np.uint8:
        raise TypeError(
            "expected kv_dtype='float8_e4m3' or 'float8_e5m2' with a uint8 array: its bytes "
            "may hold either fp8 format"
        )
    raise TypeError(
        "expected an array of float32, float16, bfloat16 (stored as uint16) or fp8 (ml_dtypes, "
        f"or uint8 with kv_dtype), got dtype {x.dtype}"
    )


def _named_fp8(x: Any, kv_dtype: Any) -> str:
    """``kv_dtype`` checked against the array it names: an fp8 format, for a ``uint8`` array or
    an fp8 array of that format."""
    name = dtype_name(kv_dtype)
    if not is_fp8(name):
        raise TypeError(f"expected kv_dtype one of {FP8_NAMES} (it names fp8 bytes), got {name}")
    if x.dtype == np.uint8 or _BY_ARRAY_DTYPE.get(x.dtype) == name:
        return name
    raise TypeError(f"expected a uint8 or {name} array with kv_dtype={name!r}, got dtype {x.dtype}")


def carriers(name: str) -> tuple[np.dtype, ...]:
    """The array dtypes that hold elements of type ``name`` (bfloat16: ``uint16``, ``int16``,
    ``ml_dtypes.bfloat16``)."""
    return ELEMENT_TYPES[dtype_name(name)].carriers


def as_storage(x: Any) -> Any:
    """View ``x`` in its storage dtype (bfloat16 carriers become ``uint16``); no copy."""
    storage = _STORAGE_VIEWS.get(x.dtype)
    return x if storage is None else x.view(storage)


def to_float(x: Any, dtype: Any = np.float32, kv_dtype: Any = None) -> Any:
    """Widen an array of any cache element type to float32 (or float64), exactly.

    The way back from a bfloat16 or fp8 cache or a bfloat16 kernel output: ``uint16`` (or
    ``int16``) bit patterns and ``ml_dtypes.bfloat16`` arrays become the float32 values they hold,
    as do fp8 arrays (``ml_dtypes``, or ``uint8`` bytes with ``kv_dtype``). bfloat16 is the upper
    half of a float32, so widening it is a shift of its bit pattern, and an fp8 byte indexes a
    table of its 256 values; both work unchanged on NumPy and CuPy arrays (CuPy has neither type).

    >>> import numpy as np, cupaged
    >>> bits = cupaged.from_float(np.array([1.0, -2.5, 3.14159], np.float32), "bfloat16")
    >>> bits.dtype, cupaged.to_float(bits).tolist()
    (dtype('uint16'), [1.0, -2.5, 3.140625])
    >>> cupaged.to_float(cupaged.from_float(np.array([0.3, 500.0]), "float8_e4m3")).tolist()
    [0.3125, 448.0]

    Args:
        x: float32, float16, bfloat16 (``uint16``/``int16`` bits or ``ml_dtypes.bfloat16``) or
            fp8 array of any shape, NumPy or CuPy.
        dtype: ``numpy.float32`` (the default) or ``numpy.float64``.
        kv_dtype: for a ``uint8`` array, the fp8 format its bytes hold.

    Returns:
        An array of ``x``'s shape in ``dtype``, on ``x``'s device (``x`` itself when nothing changes).

    Raises:
        TypeError: ``x`` is an array of another framework (a PyTorch tensor: ``tensor.float()``
            widens it), or holds none of the element types (a ``uint8`` array without
            ``kv_dtype`` included).
    """
    _refuse_foreign(x, "tensor.float()")
    name = array_dtype_name(x, kv_dtype)
    if name == "bfloat16":
        bits = as_storage(x).astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).astype(dtype, copy=False)
    if is_fp8(name):
        return _fp8_values(name, array_module(x))[as_storage(x)].astype(dtype, copy=False)
    return x.astype(dtype, copy=False)


def _refuse_foreign(x: Any, conversion: str) -> None:
    """Refuse an array of another framework (one with ``__dlpack__`` that is not a NumPy or CuPy
    array): the conversions here are of cupaged's own storage, and a framework converts its own
    arrays (``conversion``, PyTorch's way). NumPy scalars and anything else pass as before.

    Raises:
        TypeError: naming the array's type and its framework's conversion.
    """
    if hasattr(x, "__dlpack__") and not (isinstance(x, np.ndarray) or is_cupy_array(x)):
        raise TypeError(
            f"expected a NumPy or CuPy array, got {type(x).__module__}.{type(x).__name__} (its "
            f"framework converts it: {conversion} for a PyTorch tensor)"
        )


@functools.lru_cache(maxsize=8)
def _fp8_host_tables(name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values, finite)`` of an fp8 format: float32 ``values[byte]`` of all 256 bytes (NaN
    for its NaN bytes), and the ascending non-negative finite values, ``finite[code]`` for the
    codes 0 .. max (the positive bytes are ordered as their values)."""
    values = np.arange(256, dtype=np.uint8).view(ELEMENT_TYPES[name].host).astype(np.float32)
    top = int(np.flatnonzero(values[:128] == ELEMENT_TYPES[name].max)[0])
    return values, values[: top + 1].astype(np.float64)


# (name, array module, CUDA device) -> the tables of _fp8_host_tables on that device.
_FP8_TABLES: dict[tuple, tuple[Any, Any]] = {}


def _fp8_tables(name: str, xp: Any) -> tuple[Any, Any]:
    """:func:`_fp8_host_tables` on ``xp``'s current device, copied there once."""
    key = (name, xp, xp.cuda.Device().id if xp is not np else None)
    tables = _FP8_TABLES.get(key)
    if tables is None:
        tables = _FP8_TABLES[key] = tuple(map(xp.asarray, _fp8_host_tables(name)))
    return tables


def _fp8_values(name: str, xp: Any) -> Any:
    return _fp8_tables(name, xp)[0]


def float_to_fp8_bits(x: Any, name: str) -> Any:
    """Round a float array to an fp8 format as a write does; return its ``uint8`` bytes.

    ``clamp(x, -max, max)`` rounded to the nearest fp8 value, ties to the even code (max 448 for
    float8_e4m3, 57344 for float8_e5m2; infinities clamp to +-max); NaN becomes the byte
    ``0x7F``, a NaN of both formats (as CUDA's conversion gives). Written in array ops (a search
    in the table of the format's values, in float64, where every distance is exact) because CuPy
    has no fp8 type; the tests check it against ``ml_dtypes`` on NumPy, and the write kernel
    against it.
    """
    name = dtype_name(name)
    xp = array_module(x)
    finite = _fp8_tables(name, xp)[1]
    x = x.astype(np.float64, copy=False)
    a = xp.minimum(xp.abs(x), finite[-1])
    hi = xp.minimum(xp.searchsorted(finite, a), len(finite) - 1)  # NaN sorts last
    lo = xp.maximum(hi - 1, 0)
    below, above = a - finite[lo], finite[hi] - a
    up = (above < below) | ((above == below) & (hi % 2 == 0))
    code = xp.where(up, hi, lo).astype(np.uint8) | (xp.signbit(x).astype(np.uint8) << 7)
    return xp.where(xp.isnan(x), np.uint8(0x7F), code).astype(np.uint8)


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
    (ties to even, as ``ml_dtypes`` and CUDA's ``__float2bfloat16`` do) and returns ``uint16`` bit
    patterns, on NumPy and CuPy alike (``like=cache.k`` gives the cache's own carrier, native
    ``ml_dtypes.bfloat16`` on CuPy 14); every carrier takes the plans' fast path. See
    :func:`to_float` for an example of the round trip. An fp8 name quantizes as :func:`float_to_fp8_bits` (clamped,
    nearest even; no scale: divide by it first).

    Args:
        x: float32 or float64 array of any shape (NumPy or CuPy).
        name: target element type (or a dtype naming one, ``ml_dtypes.bfloat16`` included).
        like: optional array whose carrier dtype the result is viewed as (bfloat16: ``uint16``,
            ``int16`` or ``ml_dtypes.bfloat16``; fp8: ``uint8`` or its ``ml_dtypes`` dtype).

    Returns:
        An array of ``x``'s shape: float32, float16, for bfloat16 ``uint16`` bits, for fp8 the
        ``ml_dtypes`` array on NumPy and ``uint8`` bytes on CuPy (``like``'s carrier dtype when
        given), on ``x``'s device.

    Raises:
        TypeError: ``x`` is an array of another framework (a PyTorch tensor:
            ``tensor.to(dtype)`` rounds it), or ``name`` is none of the element types.
    """
    _refuse_foreign(x, "tensor.to(dtype)")
    name = dtype_name(name)
    if is_fp8(name):
        bits = float_to_fp8_bits(x, name)
        if like is not None and like.dtype in (np.dtype(np.uint8), ELEMENT_TYPES[name].host):
            return bits.view(like.dtype)
        return bits.view(cache_dtype(name, array_module(x)))
    if name != "bfloat16":
        return x.astype(name)
    bits = float32_to_bfloat16_bits(x.astype(np.float32))
    if like is not None and _BY_ARRAY_DTYPE.get(like.dtype) == "bfloat16":
        return bits.view(like.dtype)
    return bits
