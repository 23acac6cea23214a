"""Argument checks shared by the public boundaries, with "expected X, got Y" messages."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from .dtypes import array_dtype_name


def require(condition: bool, message: str) -> None:
    """Raise ``AssertionError(message)`` for a broken internal invariant.

    Unlike an ``assert`` statement it survives ``python -O``: ``check_invariants`` must always check.
    """
    if not condition:
        raise AssertionError(message)


def as_int(value: Any, what: str) -> int:
    """``value`` as a Python int (NumPy integers included; bools and floats rejected)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"expected {what} to be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"expected {what} to be an int, got {type(value).__name__}") from None


def check_shape(name: str, x: Any, dims: list[tuple[str, int | None]]) -> tuple[int, ...]:
    """Check that ``x`` has one axis per entry of ``dims``, of the given size where not ``None``.

    Raises:
        ValueError: e.g. "expected k of shape (num_tokens, num_kv_heads=8, head_dim=128), got
            (5, 4, 128)".
    """
    shape = tuple(x.shape)
    ok = len(shape) == len(dims) and all(
        size is None or size == got for (_, size), got in zip(dims, shape, strict=True)
    )
    if not ok:
        wanted = ", ".join(axis if size is None else f"{axis}={size}" for axis, size in dims)
        raise ValueError(f"expected {name} of shape ({wanted}), got {shape}")
    return shape


def check_dtype(name: str, x: Any, expected: str, why: str = "") -> None:
    """Check the element type of ``x`` (bfloat16 carriers count as bfloat16).

    Raises:
        TypeError: e.g. "expected k of dtype float16 (the cache's dtype), got float32".
    """
    try:
        got = array_dtype_name(x)
    except TypeError:
        got = str(x.dtype)
    if got != expected:
        suffix = f" ({why})" if why else ""
        raise TypeError(f"expected {name} of dtype {expected}{suffix}, got {got}")


def check_index_array(name: str, x: Any) -> None:
    """Check that ``x`` holds int32 or int64 indices.

    Raises:
        TypeError: another dtype arrived.
    """
    if x.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise TypeError(f"expected {name} of dtype int32 or int64, got {x.dtype}")
