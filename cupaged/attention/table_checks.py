"""The checked path's verdict on a batch's block tables and lengths: one kernel, one read-back.

Every checked decode and prefill call (one-shot, plan, ``update``) checks, before any narrowing
cast, that each length is in ``[0, max_blocks * block_size]`` and that each table entry a length
reaches names a block of the cache. ``check_tables`` (cuda/check_tables.cu) computes that
verdict in one launch, on the arrays' own dtypes, on either backend (the CPU backend's for NumPy
arrays), and the host reads its few verdicts back in one copy: on a GPU one launch and one
synchronisation, where array operations took a launch each. A bad verdict goes to
``raise_table_error`` (``cupaged._arrays.checks``), whose array operations name the row.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays.checks import INT32_MAX, raise_table_error, table_limit
from ..backend import array_module, to_numpy
from ..kernels.args import CheckTablesArgs
from ..kernels.launch_checks import check_tables_launch
from ..kernels.loader import get_kernel
from .layer import device_of

_INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def check_decode_tables(
    block_tables: Any,
    context_lens: Any,
    block_size: int,
    num_blocks: int,
    window_left: int = -1,
    first_keys: Any = None,
) -> int:
    """Check a decode batch's lengths and the block ids they reach; return the longest context.

    Sequence ``i`` reads entries ``0 .. ceil(context_lens[i] / block_size) - 1`` of row ``i``
    (with a window, from the block of position ``context_lens[i] - 1 - window_left`` on: the
    entries before it may be released, ``-1``); those must name blocks of the cache, whatever
    the entries beyond hold (padding). Runs on the arrays' device, on their own dtypes (an int64
    ``2**32 + 1`` is out of range, not block 1), as one launch of ``check_tables`` and one
    read-back of a few ints (one synchronisation on a GPU); only a failing call runs array
    operations, to name the row.

    Args:
        block_tables: ``[num_seqs, max_blocks]`` int32 or int64.
        context_lens: ``[num_seqs]`` int32 or int64.
        window_left: the decode query sees positions ``len - 1 - window_left ..``; -1: all.
        first_keys: instead of ``window_left``, the first position each row's queries reach
            (host int64 ``[num_seqs]``; a prefill's window, :func:`check_prefill_tables`).

    Returns:
        ``max(context_lens)`` (0 for an empty batch), as a Python int.

    Raises:
        ValueError: a length negative, past the table (``max_blocks * block_size``) or past
            ``MAX_CONTEXT_LEN``; or a block id out of range (the message names the row).
    """
    num_seqs, max_blocks = block_tables.shape
    if num_seqs == 0:
        return 0
    limit = table_limit(max_blocks, block_size)
    xp = array_module(block_tables)
    tables, lens = _operand(xp, block_tables), _operand(xp, context_lens)
    device = device_of(xp)
    name, grid, block = check_tables_launch(tables.dtype, lens.dtype, num_seqs, device)
    verdicts = xp.empty(grid, np.int32)  # every block writes its own: nothing to zero
    args = CheckTablesArgs(
        verdicts=verdicts,
        block_tables=tables,
        context_lens=lens,
        first_keys=lens if first_keys is None else xp.asarray(first_keys, dtype=np.int64),
        num_seqs=np.int32(num_seqs),
        max_blocks=np.int32(max_blocks),
        block_size=np.int32(block_size),
        num_blocks=np.int64(num_blocks),
        limit=np.int32(limit),
        window_left=np.int32(min(max(window_left, -1), INT32_MAX)),
        has_first_keys=np.int32(first_keys is not None),
    )
    get_kernel(device, "check_tables.cu", name)(grid, block, tuple(args))
    verdict = int(to_numpy(verdicts).max())
    if verdict > limit:
        raise_table_error(
            block_tables, context_lens, block_size, num_blocks, window_left, first_keys
        )
    return verdict


def check_prefill_tables(
    block_tables: Any,
    context_lens: Any,
    block_size: int,
    num_blocks: int,
    first_keys: np.ndarray | None = None,
) -> int:
    """:func:`check_decode_tables` for a prefill batch whose queries reach keys from
    ``first_keys[i]`` on (a window: ``max(0, L - n - window_left)``, host int64 ``[num_seqs]``;
    ``None``: from 0). The entries before a row's first key are never read (they may be
    released, ``-1``), so they are not checked.
    """
    return check_decode_tables(
        block_tables, context_lens, block_size, num_blocks, first_keys=first_keys
    )


def _operand(xp: Any, x: Any) -> Any:
    """``x`` as ``check_tables`` reads it: C-contiguous int32 or int64 (the callers check the
    dtype; any other is widened), copied only where it is not already."""
    if x.dtype not in _INDEX_DTYPES:
        x = x.astype(np.int64)
    return x if x.flags.c_contiguous else xp.ascontiguousarray(x)
