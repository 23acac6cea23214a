"""The serving engine's argument checks, with "expected X, got Y" messages.

The engine is written against cupaged's public API only (an example a user can copy, held to it
by ``tests/serving/test_demo_public.py``), so it does not borrow cupaged's private checks
(``cupaged._arrays.checks.as_int``): these follow the same rules.
"""

from __future__ import annotations

import numbers
import operator
from typing import Any

import numpy as np


def as_int(value: Any, what: str) -> int:
    """``value`` as a Python int: NumPy integers taken; bools and floats (``nan``, ``2.5`` and
    ``3.0`` alike) refused with a ``TypeError``."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"expected {what} to be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"expected {what} to be an int, got {type(value).__name__}") from None


def at_least(value: Any, least: int, what: str) -> int:
    """``value`` as a Python int (:func:`as_int`), at least ``least`` (else ``ValueError``)."""
    n = as_int(value, what)
    if n < least:
        raise ValueError(f"expected {what} >= {least}, got {n}")
    return n


def as_real(value: Any, what: str) -> float:
    """``value`` as a Python float: NumPy floats and ints taken; bools, complex numbers and
    strings refused with a ``TypeError`` (range checks are the caller's: NaN passes here)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"expected {what} to be a real number, got {type(value).__name__}")
    return float(value)
