"""Conversion between the two page-table formats of paged attention: dense and CSR.

*Dense* (vLLM, FlashAttention, :func:`cupaged.paged_attention`): one padded row of block ids per
sequence and the number of tokens of each. *CSR* (FlashInfer): the block ids of all sequences
concatenated, an offset array saying where each sequence's run starts, and the number of tokens in
each sequence's last block. One batch, ``block_size = 4``, sequences of 7 and 9 tokens::

    tokens       seq 0: |0 1 2 3|4 5 6 .|          seq 1: |0 1 2 3|4 5 6 7|8 . . .|
    blocks              |   5   |   2   |                 |   1   |   3   |   0   |

    dense   block_tables = [[5, 2, 0],     # row padded to max_blocks = 3; padding never read
                            [1, 3, 0]]
            context_lens = [7, 9]

    CSR     indptr        = [0, 2, 5]        # seq i owns indices[indptr[i]:indptr[i + 1]]
            indices       = [5, 2, 1, 3, 0]
            last_page_len = [3, 1]           # 7 = 4 * (2 - 1) + 3,  9 = 4 * (3 - 1) + 1

Invariants of the CSR form, for sequence ``i`` with ``n = indptr[i + 1] - indptr[i]`` blocks:

- ``indptr[0] == 0``, ``indptr`` is non-decreasing and ``indptr[-1] == len(indices)``;
- ``n > 0``: ``seq_len = block_size * (n - 1) + last_page_len[i]`` and
  ``1 <= last_page_len[i] <= block_size``;
- ``n == 0``: ``seq_len == 0`` and ``last_page_len[i] == 0``. This is cupaged's convention for an
  empty sequence (a dense row with ``context_lens[i] == 0``); FlashInfer has no empty sequences.

A sliding-window cache (``PagedCache(..., window_left=W)``) marks the blocks it released ``-1``
in its dense tables, before the window. Both conversions keep them where they are, as ``-1``:
entry ``k`` of a sequence's run is still its logical block ``k`` (positions ``k * block_size ..``),
so the lengths and ``last_page_len`` are unchanged and the round trip is exact. Such a CSR table
is attended with the same ``window_left``, which never reads them; a consumer that reads every
entry (FlashInfer without that window) must not be given one.

Both conversions run on NumPy and CuPy arrays alike, with whole-array operations only (no Python
loop over sequences or blocks), and return int32 arrays on the inputs' device. Sizing the output
reads one scalar back from the device (``indptr[-1]`` in :func:`~cupaged.to_csr`, the longest run in
:func:`~cupaged.from_csr`), so each call synchronises once. By default (``checked=True``) they
also check the values above, as everything public in cupaged does, on host copies of the
per-sequence arrays (and, for int64 block ids, a minimum and maximum read back from the device)
before any arithmetic that they bound and before any narrowing to int32: a negative length would
give a decreasing ``indptr``, a huge ``indptr`` a table of terabytes, an int64 id of
``2**32 + 1`` block 1. ``checked=False`` skips them and trusts the arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays.checks import INT32_MAX, as_int, check_context_lens, check_index_array, check_shape
from .._arrays.interop import takes_dlpack
from ..backend import array_module, to_numpy

INT32_MIN = -(2**31)


@takes_dlpack
def to_csr(
    block_tables: Any, context_lens: Any, block_size: int, *, checked: bool = True
) -> tuple[Any, Any, Any]:
    """Convert a dense, padded page table to the CSR form (FlashInfer's ``paged_kv_*`` arrays).

    Sequence ``i`` keeps the first ``ceil(context_lens[i] / block_size)`` entries of its row, in
    order; the padding after them is never read. Entries a sliding window released (``-1``)
    stay in place, as ``-1`` (see the module's docstring).

    Args:
        block_tables: ``[num_seqs, max_blocks]`` int32 or int64 physical block ids.
        context_lens: ``[num_seqs]`` int32 or int64, each in ``[0, max_blocks * block_size]``.
        block_size: tokens per block, a positive int (at most ``2**31 - 1``).
        checked: check, at the cost of a copy of the lengths to the host, that every context
            length is in ``[0, max_blocks * block_size]``, that the used block ids fit int32
            (an int64 table's are read back as a minimum and a maximum; padding may hold
            anything) and that there are at most ``2**31 - 1`` of them. ``False`` trusts the
            caller: a length outside that range gives an undefined result (an ``indptr`` that
            decreases, or an allocation as large as the length asks), an id outside int32 is
            narrowed to another block. Pass it only for tables that cupaged built, or that you
            checked once and reuse unchanged.

    Returns:
        ``(indptr, indices, last_page_len)`` on the inputs' device:

        - ``indptr``: ``[num_seqs + 1]`` int32, ``indptr[0] == 0``, non-decreasing;
        - ``indices``: ``[indptr[-1]]`` int32, the used block ids of every sequence, concatenated;
        - ``last_page_len``: ``[num_seqs]`` int32, in ``[1, block_size]``, or 0 for an empty
          sequence.

    Raises:
        TypeError: arrays on different devices, a dtype other than int32/int64, or a block size
            that is not an int.
        ValueError: wrong shapes, a block size out of range, or (checked) a context length out of
            range, a used block id outside int32, or more than ``2**31 - 1`` used blocks.

    Example:
        >>> import numpy as np
        >>> tables = np.array([[5, 2, 0], [1, 3, 0]], np.int32)
        >>> indptr, indices, last_page_len = to_csr(tables, np.array([7, 9], np.int32), 4)
        >>> indptr.tolist(), indices.tolist(), last_page_len.tolist()
        ([0, 2, 5], [5, 2, 1, 3, 0], [3, 1])
    """
    xp = array_module(block_tables, context_lens)
    block_size = _check_block_size(block_size)
    num_seqs, max_blocks = check_shape(
        "block_tables", block_tables, [("num_seqs", None), ("max_blocks", None)]
    )
    check_shape("context_lens", context_lens, [("num_seqs", num_seqs)])
    check_index_array("block_tables", block_tables)
    check_index_array("context_lens", context_lens)
    if checked:
        check_context_lens(to_numpy(context_lens), max_blocks * block_size)
    # int64 throughout: `len + block_size - 1` must not wrap for lengths near 2**31.
    lens = context_lens.astype(np.int64)
    n_blocks = (lens + (block_size - 1)) // block_size
    indptr = xp.zeros(num_seqs + 1, np.int64)
    indptr[1:] = xp.cumsum(n_blocks)
    nnz = int(indptr[-1])  # the one synchronisation: the size of `indices`
    if checked and nnz > INT32_MAX:
        raise ValueError(
            f"expected at most {INT32_MAX} used blocks in all (indptr is int32), got {nnz}"
        )
    row, col = _coordinates(xp, indptr, nnz)
    indices = block_tables[row, col]
    if checked:
        _check_int32_ids("the used entries of block_tables", indices)
    indices = indices.astype(np.int32)
    # An empty sequence has n_blocks == 0, so the clamp gives last_page_len == len == 0.
    last_page_len = lens - block_size * xp.maximum(n_blocks - 1, 0)
    return indptr.astype(np.int32), indices, last_page_len.astype(np.int32)


@takes_dlpack
def from_csr(
    indptr: Any, indices: Any, last_page_len: Any, block_size: int, *, checked: bool = True
) -> tuple[Any, Any]:
    """Convert a CSR page table (FlashInfer's ``paged_kv_*`` arrays) to the dense, padded form.

    Row ``i`` of the table holds ``indices[indptr[i]:indptr[i + 1]]`` followed by zeros; the table
    is as wide as the longest run, and at least one entry wide (kernels index a row's first entry).

    Args:
        indptr: ``[num_seqs + 1]`` int32 or int64; ``indptr[0] == 0``, non-decreasing,
            ``indptr[-1] == len(indices)``.
        indices: ``[nnz]`` int32 or int64 physical block ids; sequence ``i`` owns
            ``indices[indptr[i]:indptr[i + 1]]``, in logical order (``-1`` for a block a
            sliding window released, kept as it is).
        last_page_len: ``[num_seqs]`` int32 or int64 tokens in each sequence's last block: in
            ``[1, block_size]``, or 0 for a sequence without blocks.
        block_size: tokens per block, a positive int (at most ``2**31 - 1``).
        checked: check, at the cost of a copy of ``indptr`` and ``last_page_len`` to the host,
            the invariants just listed, that the block ids fit int32 (int64 ones are read back
            as a minimum and a maximum) and that every sequence length does. ``False`` trusts
            the caller: arrays that break them give an undefined result (an ``indptr`` entry
            of ``2**40`` asks for a table of terabytes, an id outside int32 is narrowed to
            another block). Pass it only for arrays that cupaged built, or that you checked
            once and reuse unchanged.

    Returns:
        ``(block_tables, context_lens)`` on the inputs' device:

        - ``block_tables``: ``[num_seqs, max(1, max_blocks)]`` int32, padded with 0;
        - ``context_lens``: ``[num_seqs]`` int32, ``block_size * (n - 1) + last_page_len`` for a
          sequence of ``n > 0`` blocks, 0 for a sequence without blocks.

    Raises:
        TypeError: arrays on different devices, a dtype other than int32/int64, or a block size
            that is not an int.
        ValueError: wrong shapes, a block size out of range, or (checked) a broken invariant, a
            block id outside int32 or a sequence longer than ``2**31 - 1`` tokens.

    Example:
        >>> import numpy as np
        >>> indptr = np.array([0, 2, 5], np.int32)
        >>> indices = np.array([5, 2, 1, 3, 0], np.int32)
        >>> tables, lens = from_csr(indptr, indices, np.array([3, 1], np.int32), 4)
        >>> tables.tolist(), lens.tolist()
        ([[5, 2, 0], [1, 3, 0]], [7, 9])
    """
    xp = array_module(indptr, indices, last_page_len)
    block_size = _check_block_size(block_size)
    (rows,) = check_shape("indptr", indptr, [("num_seqs + 1", None)])
    if rows == 0:
        raise ValueError("expected indptr of shape (num_seqs + 1,) with num_seqs >= 0, got (0,)")
    num_seqs = rows - 1
    (nnz,) = check_shape("indices", indices, [("nnz", None)])
    check_shape("last_page_len", last_page_len, [("num_seqs", num_seqs)])
    check_index_array("indptr", indptr)
    check_index_array("indices", indices)
    check_index_array("last_page_len", last_page_len)
    if checked:
        _check_csr_values(to_numpy(indptr), nnz, to_numpy(last_page_len), block_size)
        _check_int32_ids("indices", indices)
    offsets = indptr.astype(np.int64)
    n_blocks = offsets[1:] - offsets[:-1]
    width = max(1, int(n_blocks.max())) if num_seqs else 1  # the one synchronisation
    block_tables = xp.zeros((num_seqs, width), np.int32)
    row, col = _coordinates(xp, offsets, nnz)
    block_tables[row, col] = indices.astype(np.int32)
    full_blocks = block_size * (n_blocks - 1)
    context_lens = xp.where(n_blocks > 0, full_blocks + last_page_len.astype(np.int64), 0)
    return block_tables, context_lens.astype(np.int32)


def _coordinates(xp: Any, indptr: Any, nnz: int) -> tuple[Any, Any]:
    """Row and column in the dense table of each of the ``nnz`` CSR entries.

    ``row = repeat(arange(num_seqs), n_blocks)`` in spirit, but CuPy's ``repeat`` accepts an array
    of repeats only from 14.1 (cupy/cupy#9855; earlier versions raise, and loop in Python over a
    list), and cupaged supports CuPy 13. So the row is found by bisection, which every version runs
    as one kernel: entry ``k`` belongs to the last sequence whose run starts at or before ``k``.
    With ``side="right"`` an empty sequence (a repeated offset) is skipped, never chosen.
    """
    entries = xp.arange(nnz, dtype=np.int64)
    row = xp.searchsorted(indptr, entries, side="right") - 1
    return row, entries - indptr[row]


def _check_block_size(block_size: Any) -> int:
    block_size = as_int(block_size, "block_size")
    if block_size < 1:
        raise ValueError(f"expected block_size to be a positive int, got {block_size}")
    if block_size > INT32_MAX:  # lengths and offsets are int32, and int64 arithmetic must not wrap
        raise ValueError(f"expected block_size at most {INT32_MAX}, got {block_size}")
    return block_size


def _check_int32_ids(name: str, ids: Any) -> None:
    """Check that block ids fit int32 before they are narrowed to it (one read-back for int64).

    Raises:
        ValueError: naming the range that arrived.
    """
    if ids.dtype == np.int32 or ids.size == 0:
        return
    xp = array_module(ids)
    low, high = (int(v) for v in to_numpy(xp.stack((ids.min(), ids.max()))))
    if low < INT32_MIN or high > INT32_MAX:
        raise ValueError(
            f"expected block ids in [{INT32_MIN}, {INT32_MAX}] (int32) in {name}, got values in "
            f"[{low}, {high}]"
        )


def _check_csr_values(
    indptr: np.ndarray, nnz: int, last_page_len: np.ndarray, block_size: int
) -> None:
    """Check the CSR invariants on host copies (see the module docstring).

    Raises:
        ValueError: naming the first broken invariant and where it breaks.
    """
    if indptr[0] != 0:
        raise ValueError(f"expected indptr[0] == 0, got {indptr[0]}")
    n_blocks = np.diff(indptr.astype(np.int64))
    if (n_blocks < 0).any():
        i = int(np.argmax(n_blocks < 0))
        raise ValueError(
            f"expected indptr non-decreasing, got indptr[{i}] = {indptr[i]} > "
            f"indptr[{i + 1}] = {indptr[i + 1]}"
        )
    if indptr[-1] != nnz:
        raise ValueError(f"expected indptr[-1] == len(indices) = {nnz}, got {indptr[-1]}")
    bad = (n_blocks > 0) & ((last_page_len < 1) | (last_page_len > block_size))
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"expected last_page_len in [1, {block_size}] (block_size) for a sequence with "
            f"blocks, got {last_page_len[i]} for sequence {i}"
        )
    bad = (n_blocks == 0) & (last_page_len != 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"expected last_page_len 0 for a sequence without blocks, got {last_page_len[i]} "
            f"for sequence {i}"
        )
    # A sequence of more blocks than `longest` cannot fit int32; capping the count first keeps
    # `block_size * (n - 1)` below 2**31, so the int64 arithmetic cannot wrap.
    longest = INT32_MAX // block_size + 1
    capped = np.minimum(n_blocks, longest)
    lens = np.where(n_blocks > 0, block_size * (capped - 1) + last_page_len.astype(np.int64), 0)
    too_long = (n_blocks > longest) | (lens > INT32_MAX)
    if too_long.any():
        i = int(np.argmax(too_long))
        length = block_size * (int(n_blocks[i]) - 1) + int(last_page_len[i])
        raise ValueError(
            f"expected sequences of at most {INT32_MAX} tokens (context_lens is int32), got "
            f"{length} for sequence {i}"
        )
