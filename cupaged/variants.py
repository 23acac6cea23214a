"""The attention variants' arguments, checked once for every function that takes them.

One definition (docs/variants.md): for a query at position ``i`` and a key at position ``j``::

    s = scale * q.k
    if logits_soft_cap > 0:  s = logits_soft_cap * tanh(s / logits_soft_cap)
    if alibi_slopes given:   s += alibi_slopes[h] * (j - i)
    keys with j < i - window_left are not attended                 (window_left = -1: no window)
    out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sinks[h] - m)),  m = max(s, sinks[h])

A query that sees no key gets a zero row, with or without a sink. The kernels take the variants
as bits of one template argument (``VARIANT``, the constants below, checked against
``cuda/common.cuh`` by a test): what is off costs nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._arrays.checks import MAX_CONTEXT_LEN, as_int
from .backend import array_module

# The largest soft-cap: the kernels take it as a float32 (a larger one would be Inf there, and
# Inf * tanh(s / Inf) is NaN).
MAX_SOFT_CAP = float(np.finfo(np.float32).max)

# Bits of the kernels' VARIANT template argument, defined here once for the Python side (the
# launch table, the plans and the tests take them from here). cuda/common.cuh names the same bits
# (kWindow, kSoftCap, kAlibi, kSinks): tests/kernels/test_kernel_args.py reads them there and holds them,
# and the four trailing variant arguments of every kernel with a VARIANT, against these.
WINDOW = 1
SOFT_CAP = 2
ALIBI = 4
SINKS = 8


@dataclass(frozen=True)
class Variants:
    """The variants of a plan, checked: ``window_left`` (-1: none), ``logits_soft_cap`` (0.0:
    none) and the plan's own float32 copy of ``alibi_slopes`` (``None``: none)."""

    window_left: int = -1
    logits_soft_cap: float = 0.0
    alibi_slopes: Any = None

    def flags(self, sinks: bool = False) -> int:
        """The ``VARIANT`` template argument of a kernel that runs these variants (and sinks)."""
        bits = WINDOW if self.window_left >= 0 else 0
        bits |= SOFT_CAP if self.logits_soft_cap > 0 else 0
        bits |= ALIBI if self.alibi_slopes is not None else 0
        return bits | (SINKS if sinks else 0)

    def first_key(self, last_query: Any) -> Any:
        """The first key position that a query at ``last_query`` (an int, or an integer array of
        positions on any device) may see: ``max(0, last_query - window_left)``; 0 without a
        window."""
        if self.window_left < 0:
            return 0 * last_query
        if isinstance(last_query, (int, np.integer)):
            return max(int(last_query) - self.window_left, 0)
        return array_module(last_query).maximum(last_query - self.window_left, 0)


NO_VARIANTS = Variants()


def check_variants(
    xp: Any,
    num_q_heads: int,
    window_left: Any = -1,
    logits_soft_cap: Any = 0.0,
    alibi_slopes: Any = None,
) -> Variants:
    """Check the planning-time variants and return them (the slopes copied, float32, C order).

    A window of ``MAX_CONTEXT_LEN`` (``2**30``) or more is kept as that one: no context is
    longer, so it attends the same keys.

    Raises:
        TypeError: ``window_left`` not an int, ``logits_soft_cap`` not a real number, or slopes
            that are not a float32 array of ``xp``'s device.
        ValueError: ``window_left < -1``, a negative or non-finite soft-cap (or one past float32),
            or slopes of a shape other than ``[num_q_heads]``.
    """
    # No context is longer than MAX_CONTEXT_LEN: a wider window is that one (and fits an int32).
    window = min(check_window_left(window_left), MAX_CONTEXT_LEN)
    cap = _as_real(logits_soft_cap, "logits_soft_cap")
    if not (math.isfinite(cap) and 0 <= cap <= MAX_SOFT_CAP):
        raise ValueError(
            f"expected logits_soft_cap finite, >= 0 (0: none) and at most {MAX_SOFT_CAP:.4g} (a "
            f"float32), got {cap!r}"
        )
    slopes = None
    if alibi_slopes is not None:
        slopes = check_head_vector(xp, num_q_heads, alibi_slopes, "alibi_slopes").copy()
    if window == -1 and cap == 0.0 and slopes is None:
        return NO_VARIANTS
    return Variants(window, cap, slopes)


def check_window_left(window_left: Any) -> int:
    """``window_left`` as an int, ``-1`` (no window) or more: the one check of a window, for the
    attention functions, the plans, the block manager and ``CacheSpec``.

    Raises:
        TypeError: not an int. ValueError: below -1.
    """
    window = as_int(window_left, "window_left")
    if window < -1:
        raise ValueError(f"expected window_left >= -1 (-1: no window), got {window}")
    return window


def check_sinks(xp: Any, num_q_heads: int, sinks: Any) -> Any:
    """``sinks`` checked (``None``, or a float32 ``[num_q_heads]`` array of ``xp``'s device),
    C-contiguous; not copied (a run reads it at once)."""
    if sinks is None:
        return None
    return check_head_vector(xp, num_q_heads, sinks, "sinks")


def check_head_vector(xp: Any, num_q_heads: int, x: Any, name: str) -> Any:
    """A per-query-head float32 vector: ``[num_q_heads]`` on ``xp``'s device, C-contiguous."""
    kinds = (np.ndarray,) if xp is np else (xp.ndarray,)
    if not isinstance(x, kinds):
        raise TypeError(
            f"expected {name} to be a float32 {xp.__name__} array of shape ({num_q_heads},) "
            f"(the inputs' device), got {type(x).__module__}.{type(x).__name__}"
        )
    if x.dtype != np.float32:
        raise TypeError(f"expected {name} of dtype float32, got {x.dtype}")
    if tuple(x.shape) != (num_q_heads,):
        raise ValueError(
            f"expected {name} of shape (num_q_heads={num_q_heads},), got {tuple(x.shape)}"
        )
    return xp.ascontiguousarray(x)


def _as_real(value: Any, what: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"expected {what} to be a real number, got {type(value).__name__}")
    if isinstance(value, np.complexfloating):
        raise TypeError(f"expected {what} to be a real number, got {type(value).__name__}")
    return float(value)
