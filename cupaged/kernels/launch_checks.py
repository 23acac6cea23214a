"""The table checks' launch: ``check_tables`` (cuda/check_tables.cu), the verdict of the checked
path on a batch's block tables and lengths: its instantiation, grid and block.

One warp per row, up to ``CHECK_THREADS`` per block and ``CHECK_MAX_BLOCKS`` blocks (a longer
batch's warps take several rows each): each block writes one verdict, which the host reads back
in one copy, so the blocks are few. On the CPU backend one thread walks every row: a launch there
costs a fiber per CUDA thread, and the walk is a few loads per row.
"""

from __future__ import annotations

import numpy as np

from .._util import cdiv
from .launch_decode import whole_warps

CHECK_C_TYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
CHECK_THREADS = 256  # kCheckMaxThreads, the kernel's launch bounds
CHECK_MAX_BLOCKS = 32  # verdicts read back: at most 128 bytes


def check_tables_launch(
    table_dtype: np.dtype, len_dtype: np.dtype, num_seqs: int, device: str = "cuda"
) -> tuple[str, tuple[int], tuple[int]]:
    """``(name, grid, block)`` of ``check_tables`` for a batch of ``num_seqs`` rows (at least
    one) of ``table_dtype`` ids and ``len_dtype`` lengths (int32 or int64 each)."""
    name = (
        f"cupaged::check_tables<{CHECK_C_TYPES[np.dtype(table_dtype)]}, "
        f"{CHECK_C_TYPES[np.dtype(len_dtype)]}>"
    )
    if device == "cpu":
        return name, (1,), (1,)
    threads = whole_warps(32 * num_seqs, CHECK_THREADS)  # a warp per row
    return name, (min(cdiv(num_seqs, threads // 32), CHECK_MAX_BLOCKS),), (threads,)
