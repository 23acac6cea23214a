"""Argument checks shared by the public boundaries, with "expected X, got Y" messages."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from .._util import cdiv
from ..backend import array_module
from ..dtypes import ITEMSIZES as ITEMSIZES
from ..dtypes import Q_DTYPE_NAMES, array_dtype_name


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


def as_bool(value: Any, what: str) -> bool:
    """``value`` as a Python bool (a NumPy bool included; anything else refused, not tested for
    truth: ``"no"`` is truthy, ``None`` falsy)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"expected {what} to be a bool, got {type(value).__name__}")
    return bool(value)


def check_shape(name: str, x: Any, dims: list[tuple[str, int | None]]) -> tuple[int, ...]:
    """Check that ``x`` has one axis per entry of ``dims``, of the given size where not ``None``.

    Raises:
        ValueError: e.g. "expected k of shape (num_tokens, num_kv_heads=8, head_dim=128), got
            (5, 4, 128)".
    """
    shape = tuple(x.shape)
    if len(shape) == len(dims):  # a plain loop: every one-shot call checks about seven shapes
        for (_, size), got in zip(dims, shape, strict=True):
            if size is not None and size != got:
                break
        else:
            return shape
    wanted = ", ".join(axis if size is None else f"{axis}={size}" for axis, size in dims)
    raise ValueError(f"expected {name} of shape ({wanted}), got {shape}")


def check_dtype(name: str, x: Any, expected: str, why: str = "", kv_dtype: Any = None) -> None:
    """Check the element type of ``x`` (bfloat16 carriers count as bfloat16; ``kv_dtype`` names
    the fp8 of a ``uint8`` array).

    Raises:
        TypeError: e.g. "expected k of dtype float16 (the cache's dtype), got float32".
    """
    got = _dtype_shown(x, kv_dtype)
    if got != expected:
        suffix = f" ({why})" if why else ""
        raise TypeError(f"expected {name} of dtype {expected}{suffix}, got {got}")


def check_fp8_source(name: str, x: Any, expected: str) -> str:
    """The element type of ``x``, values that an fp8 cache quantizes as it takes them: float32,
    float16 or bfloat16 (``dtypes.Q_DTYPE_NAMES``).

    Raises:
        TypeError: "expected {name} of dtype {expected}, got {what x holds}".
    """
    got = _dtype_shown(x)
    if got not in Q_DTYPE_NAMES:
        raise TypeError(f"expected {name} of dtype {expected}, got {got}")
    return got


def _dtype_shown(x: Any, kv_dtype: Any = None) -> str:
    """The element type ``x`` holds, or (none of cupaged's) its dtype as NumPy writes it."""
    try:
        return array_dtype_name(x, kv_dtype)
    except TypeError:
        return str(x.dtype)


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
    num_seqs, num_q_heads, head_dim = check_shape(
        "q", q, [("num_seqs", None), ("num_q_heads", None), ("head_dim", None)]
    )
    return _check_paged_kv(
        q, num_q_heads, head_dim, k_cache, v_cache, block_tables, context_lens, num_seqs
    )


def _check_paged_kv(
    q: Any,
    num_q_heads: int,
    head_dim: int,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    context_lens: Any,
    num_seqs: int | None,
) -> AttentionDims:
    """The checks that decode and prefill share: caches, dtypes, tables, lengths, GQA ratio.

    ``num_seqs`` is the table's row count to expect (decode: one row per query), or ``None`` to
    take it from ``block_tables`` (prefill).
    """
    axes = ("num_blocks", "num_kv_heads", "block_size", "head_dim")
    num_blocks, num_kv_heads, block_size, _ = check_shape(
        "k_cache", k_cache, [(axis, None) for axis in axes[:3]] + [("head_dim", head_dim)]
    )
    check_shape("v_cache", v_cache, list(zip(axes, k_cache.shape, strict=True)))
    elem = array_dtype_name(q)
    check_dtype("k_cache", k_cache, elem, "q's dtype")
    check_dtype("v_cache", v_cache, elem, "q's dtype")
    num_seqs, max_blocks = check_shape(
        "block_tables", block_tables, [("num_seqs", num_seqs), ("max_blocks", None)]
    )
    check_shape("context_lens", context_lens, [("num_seqs", num_seqs)])
    check_index_array("block_tables", block_tables)
    check_index_array("context_lens", context_lens)
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
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


def check_block_ids(
    tables: np.ndarray,
    lens: np.ndarray,
    block_size: int,
    num_blocks: int,
    first_keys: np.ndarray | None = None,
) -> None:
    """Check that every block-table entry a sequence uses names a block of the cache.

    Row ``i`` uses the entries of positions ``first_keys[i] .. lens[i] - 1`` (from 0 when
    ``first_keys`` is ``None``): a sliding window's released entries before it are not read.

    Raises:
        ValueError: naming the first row with an out-of-range id.
    """
    firsts = [0] * len(lens) if first_keys is None else first_keys.tolist()
    for i, (length, first) in enumerate(zip(lens.tolist(), firsts, strict=True)):
        used = tables[i, min(first, length) // block_size : cdiv(length, block_size)]
        if used.size and (used.min() < 0 or used.max() >= num_blocks):
            raise ValueError(
                f"expected block ids in [0, {num_blocks}) in row {i} of block_tables, "
                f"got {used.tolist()}"
            )


# The kernels index blocks, slots' blocks and token positions with 32-bit ints (offsets into the
# cache are 64-bit). Longer contexts than this are refused, so that no position arithmetic in a
# kernel (a split's end, a tile's end) can overflow.
INT32_MAX = 2**31 - 1
MAX_CONTEXT_LEN = 2**30
# Index arrays up to this size are checked as Python lists when they live on the host: cheaper
# than the sort-based array checks below up to about 200 slots or 300 copy pairs (the timings:
# docs/benchmarks.md, "Small index checks").
SMALL_INDEX_ARRAY = 128

# The launch path's names for the element-type table's lookups (cupaged/dtypes.py).
element_type = array_dtype_name


def check_writable(name: str, x: Any) -> None:
    """Refuse an output that must not be written (a read-only NumPy array, or one over ``bytes``).

    Raises:
        ValueError: "expected k_cache writable, got a read-only array".
    """
    flags = x.flags
    if not getattr(flags, "writeable", True):
        raise ValueError(
            f"expected {name} writable (a kernel writes into it), got a read-only array; pass "
            f"a writable copy, e.g. numpy.array({name})"
        )


def check_num_blocks(num_blocks: int) -> None:
    """Refuse a cache whose block ids do not fit the kernels' 32-bit ints."""
    if num_blocks > INT32_MAX:
        raise ValueError(f"expected at most {INT32_MAX} blocks in the cache, got {num_blocks}")


def _host(flags: Any) -> np.ndarray:
    """One device-to-host transfer of a small summary array (a no-op view on NumPy)."""
    return flags.get() if hasattr(flags, "get") else np.asarray(flags)


def check_slots(slots: Any, capacity: int) -> None:
    """Check a slot mapping before a write: every slot ``-1`` or in ``[0, capacity)``, none twice.

    Runs on the array's device, on its own dtype (no narrowing first); one transfer of two flags.

    Raises:
        ValueError: a slot out of range (the message shows the first ones), or one used twice
            (two writes to one slot race).
    """
    if slots.size <= SMALL_INDEX_ARRAY and isinstance(slots, np.ndarray):
        values = slots.tolist()
        bad = [s for s in values if s < -1 or s >= capacity]
        used = [s for s in values if s >= 0]
        repeated = len(set(used)) != len(used)
    else:
        xp = array_module(slots)
        out_of_range = (slots < -1) | (slots >= capacity)
        ordered = xp.sort(slots)
        twice = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
        summary = _host(xp.stack([out_of_range.any(), twice.any()]))
        bad = _host(slots[out_of_range][:8]).tolist() if summary[0] else []
        repeated = bool(summary[1])
    if bad:
        raise ValueError(
            f"expected slot_mapping values in [0, {capacity}) (num_blocks * block_size) or -1, "
            f"got {bad[:8]}"
        )
    if repeated:
        raise ValueError("expected distinct slots in slot_mapping, got a slot written twice")


def check_copy_pairs(src: Any, dst: Any, num_blocks: int) -> None:
    """Check copy pairs: ids in ``[0, num_blocks)``, distinct destinations, no id both a source
    and a destination (the pairs are copied in parallel).

    Runs on the arrays' device, on their own dtypes (no narrowing first).

    Raises:
        ValueError: naming the offending ids.
    """
    if (
        src.size <= SMALL_INDEX_ARRAY
        and isinstance(src, np.ndarray)
        and isinstance(dst, np.ndarray)
    ):
        sources, targets = src.tolist(), dst.tolist()
        ids = sources + targets
        out_of_range = min(ids) < 0 or max(ids) >= num_blocks
        repeated = len(set(targets)) != len(targets)
        both = bool(set(sources) & set(targets))
    else:
        xp = array_module(src)
        ids = xp.concatenate([src.astype(np.int64), dst.astype(np.int64)])
        ordered_dst = xp.sort(dst)
        n = src.size
        ordered_ids = xp.sort(
            xp.concatenate([xp.unique(src).astype(np.int64), xp.unique(dst).astype(np.int64)])
        )
        summary = _host(
            xp.stack(
                [
                    ((ids < 0) | (ids >= num_blocks)).any(),
                    (ordered_dst[1:] == ordered_dst[:-1]).any() if n > 1 else xp.asarray(False),
                    (ordered_ids[1:] == ordered_ids[:-1]).any()
                    if ordered_ids.size > 1
                    else xp.asarray(False),
                ]
            )
        )
        out_of_range, repeated, both = (bool(f) for f in summary)
    if out_of_range:
        raise ValueError(
            f"expected block ids in [0, {num_blocks}) in src and dst, got src "
            f"{_shown(src)} and dst {_shown(dst)}"
        )
    if repeated:
        raise ValueError(f"expected distinct destination blocks, got dst {_shown(dst)}")
    if both:
        raise ValueError(
            f"expected no block both a source and a destination, got src {_shown(src)} and "
            f"dst {_shown(dst)}"
        )


def _shown(x: Any) -> str:
    values = _host(x[:8]).tolist()
    return f"{values}{' ...' if x.size > 8 else ''}"


def raise_table_error(
    block_tables: Any,
    context_lens: Any,
    block_size: int,
    num_blocks: int,
    window_left: int = -1,
    first_keys: Any = None,
) -> NoReturn:
    """Raise the error that names the first bad row of a batch whose tables the checked path
    (``cupaged.attention.table_checks``, one kernel) found bad: a length first, else a block id.

    Array operations on the arrays' device, on their own dtypes: they run only on failure.

    Raises:
        ValueError: a length negative, past the table (``max_blocks * block_size``) or past
            ``MAX_CONTEXT_LEN``; or a block id out of range (the message names the row).
        AssertionError: no row is bad (the kernel and these operations disagree).
    """
    _, max_blocks = block_tables.shape
    limit = table_limit(max_blocks, block_size)
    xp = array_module(block_tables)
    lens = context_lens.astype(np.int64, copy=False)
    bad_len = (lens < 0) | (lens > limit)
    if bool(_host(bad_len.any())):
        row = int(_host(xp.argmax(bad_len)))
        raise ValueError(
            f"expected context_lens in [0, {limit}] (max_blocks * block_size = "
            f"{max_blocks * block_size}, at most {MAX_CONTEXT_LEN}), got {int(_host(lens[row]))} "
            f"in row {row}"
        )
    # Entry j holds keys j * block_size .. + block_size - 1: a row reads it when its first key
    # is before the row's length, and (a window) when its last key reaches the window's first,
    # len - 1 - window_left; viewed unsigned, a negative id is huge, so one comparison finds it.
    starts = xp.arange(0, max_blocks * block_size, block_size)[None, :]
    used = starts < context_lens[:, None]
    if first_keys is not None:
        used &= starts >= (xp.asarray(first_keys) // block_size * block_size)[:, None]
    elif window_left >= 0:
        used &= starts + (block_size + window_left) >= context_lens[:, None]
    bad_rows = ((_unsigned(block_tables) >= num_blocks) & used).any(axis=1)
    row = int(_host(xp.argmax(bad_rows)))
    require(bool(_host(bad_rows[row])), "check_tables found a bad row, the array operations none")
    reached = _host(block_tables[row][used[row]])
    raise ValueError(
        f"expected block ids in [0, {num_blocks}) in row {row} of block_tables (the "
        f"entries its {int(_host(lens[row]))} tokens reach), got {_shown(reached)}"
    )


def table_limit(max_blocks: int, block_size: int) -> int:
    """The longest context a table of ``max_blocks`` entries may claim: its capacity, at most
    ``MAX_CONTEXT_LEN``."""
    return min(max_blocks * block_size, MAX_CONTEXT_LEN)


def _unsigned(x: Any) -> Any:
    """``x`` (int32 or int64) viewed as the unsigned type of its size: no copy, and a negative
    value becomes one above every signed one."""
    if x.dtype not in _UNSIGNED:  # (the callers check index dtypes; any other is widened)
        x = x.astype(np.int64)
    return x.view(_UNSIGNED[x.dtype])


_UNSIGNED = {np.dtype(np.int32): np.dtype(np.uint32), np.dtype(np.int64): np.dtype(np.uint64)}


def check_prefill_args(
    q: Any, k_cache: Any, v_cache: Any, block_tables: Any, context_lens: Any, query_start_loc: Any
) -> AttentionDims:
    """Check the shapes and dtypes of a prefill call (metadata only: no device sync).

    ``q`` is ``[total_query_tokens, num_q_heads, head_dim]``; the returned ``num_seqs`` is the
    number of block-table rows.

    Raises:
        ValueError: a shape is wrong, or ``num_q_heads`` is not a multiple of ``num_kv_heads``.
        TypeError: a dtype is wrong.
    """
    _, num_q_heads, head_dim = check_shape(
        "q", q, [("total_query_tokens", None), ("num_q_heads", None), ("head_dim", None)]
    )
    dims = _check_paged_kv(
        q, num_q_heads, head_dim, k_cache, v_cache, block_tables, context_lens, None
    )
    check_shape("query_start_loc", query_start_loc, [("num_seqs + 1", dims.num_seqs + 1)])
    check_index_array("query_start_loc", query_start_loc)
    return dims


def check_query_start_loc(starts: np.ndarray, lens: np.ndarray, total: int) -> int:
    """Check host copies of ``query_start_loc`` and ``context_lens``; return the longest query run.

    On the arrays' own dtypes (before any narrowing): ``starts`` begins at 0, never decreases and
    ends at ``total`` (the rows of ``q``); each sequence's query count ``n_i`` is at most its
    ``context_lens[i]`` (its queries are the last ``n_i`` tokens of its context).

    Raises:
        ValueError: naming the first offending sequence.
    """
    starts = starts.astype(np.int64, copy=False)
    lens = lens.astype(np.int64, copy=False)
    if starts[0] != 0 or starts[-1] != total:
        raise ValueError(
            f"expected query_start_loc to start at 0 and end at total_query_tokens={total}, "
            f"got {int(starts[0])} .. {int(starts[-1])}"
        )
    counts = np.diff(starts)
    if counts.size and counts.min() < 0:
        i = int(np.argmax(counts < 0))
        raise ValueError(
            f"expected query_start_loc non-decreasing, got {int(starts[i])} then "
            f"{int(starts[i + 1])} at sequence {i}"
        )
    if lens.size and lens.min() < 0:
        i = int(np.argmax(lens < 0))
        raise ValueError(f"expected context_lens >= 0, got {int(lens[i])} in row {i}")
    if counts.size and (counts > lens).any():
        i = int(np.argmax(counts > lens))
        raise ValueError(
            f"expected at most context_lens[{i}]={int(lens[i])} query tokens for sequence {i} "
            f"(its queries are the last tokens of its context), got {int(counts[i])}"
        )
    return int(counts.max()) if counts.size else 0
