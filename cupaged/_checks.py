"""Argument checks shared by the public boundaries, with "expected X, got Y" messages."""

from __future__ import annotations

import operator
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class AttentionDims:
    """Sizes read off the arguments of a decode-attention call."""

    num_seqs: int
    num_q_heads: int
    head_dim: int
    num_blocks: int
    num_kv_heads: int
    block_size: int
    max_blocks: int
    dtype: str


def check_attention_args(
    q: Any, k_cache: Any, v_cache: Any, block_tables: Any, context_lens: Any
) -> AttentionDims:
    """Check the shapes and dtypes of a decode-attention call (metadata only: no device sync).

    Raises:
        ValueError: a shape is wrong, or ``num_q_heads`` is not a multiple of ``num_kv_heads``.
        TypeError: a dtype is wrong.
    """
    axes = ("num_blocks", "num_kv_heads", "block_size", "head_dim")
    num_seqs, num_q_heads, head_dim = check_shape(
        "q", q, [("num_seqs", None), ("num_q_heads", None), ("head_dim", None)]
    )
    num_blocks, num_kv_heads, block_size, _ = check_shape(
        "k_cache", k_cache, [(axis, None) for axis in axes[:3]] + [("head_dim", head_dim)]
    )
    check_shape("v_cache", v_cache, list(zip(axes, k_cache.shape, strict=True)))
    elem = array_dtype_name(q)
    check_dtype("k_cache", k_cache, elem, "q's dtype")
    check_dtype("v_cache", v_cache, elem, "q's dtype")
    _, max_blocks = check_shape(
        "block_tables", block_tables, [("num_seqs", num_seqs), ("max_blocks", None)]
    )
    check_shape("context_lens", context_lens, [("num_seqs", num_seqs)])
    check_index_array("block_tables", block_tables)
    check_index_array("context_lens", context_lens)
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"expected num_q_heads to be a multiple of num_kv_heads={num_kv_heads}, "
            f"got {num_q_heads}"
        )
    return AttentionDims(
        num_seqs, num_q_heads, head_dim, num_blocks, num_kv_heads, block_size, max_blocks, elem
    )


def check_context_lens(lens: np.ndarray, capacity: int) -> None:
    """Check host-side context lengths against ``max_blocks * block_size``.

    Raises:
        ValueError: a length is negative or exceeds the table's capacity.
    """
    if lens.size and (lens.min() < 0 or lens.max() > capacity):
        raise ValueError(
            f"expected context_lens in [0, {capacity}] (max_blocks * block_size), "
            f"got values in [{lens.min()}, {lens.max()}]"
        )


def check_block_ids(tables: np.ndarray, lens: np.ndarray, block_size: int, num_blocks: int) -> None:
    """Check that every block-table entry a sequence uses names a block of the cache.

    Raises:
        ValueError: naming the first row with an out-of-range id.
    """
    for i, length in enumerate(lens.tolist()):
        used = tables[i, : -(-length // block_size)]
        if used.size and (used.min() < 0 or used.max() >= num_blocks):
            raise ValueError(
                f"expected block ids in [0, {num_blocks}) in row {i} of block_tables, "
                f"got {used.tolist()}"
            )
