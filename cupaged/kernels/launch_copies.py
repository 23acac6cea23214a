"""The copies' launches: ``write_kv`` (and ``write_kv_fp8``) and ``copy_blocks`` (cuda/write_kv.cu,
cuda/copy_blocks.cu): the instantiation, the word or vector each thread moves, grid and block.

Their threads only stride over the words they move, so their block is the one launch shape that
differs between the backends (``CPU_STRIDE_THREADS``).
"""

from __future__ import annotations

import numpy as np

from ..dtypes import C_TYPES, Q_DTYPE_NAMES, is_fp8, itemsize
from .launch_decode import whole_warps

SLOT_C_TYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}

WRITE_THREADS = 128
COPY_THREADS = 256
# The one block shape that differs between the backends (DecodePlan also launches only the work
# items it planned there, not the capacity). The CPU backend runs a block's threads one after
# another, each started by a call that costs many words of a copy loop, so copy_blocks and
# write_kv, whose threads only stride over the words they move, run one thread per block there
# whatever the size (check_tables too, launch_checks.py: one thread walks every row); every
# other kernel launches as on the GPU (the numbers: docs/benchmarks.md,
# "One launch geometry and the helper threads of the CPU backend"). tests/attention/test_ops.py runs both
# on the CPU backend with several threads too, as the GPU splits the words.
CPU_STRIDE_THREADS = 1


def write_kv_launch(
    dtype: str,
    slot_dtype: np.dtype,
    num_tokens: int,
    row_bytes: int,
    aligned: bool,
    num_kv_heads: int = 1,
    device: str = "cuda",
    *,
    src_dtype: str | None = None,
) -> tuple[str, tuple[int], tuple[int]]:
    """``(name, grid, block)`` of ``write_kv`` into a ``dtype`` cache of ``row_bytes`` rows;
    16-byte vectors when rows and pointers (``aligned``) allow. An fp8 cache takes
    ``write_kv_fp8``, which quantizes ``src_dtype`` (k's type, float16 when ``None``) as it
    writes, 16 or 8 elements per access where aligned (16-byte loads, a 16- or 8-byte store).

    A token's block has one thread per vector of its ``num_kv_heads`` rows (whole warps, at most
    ``WRITE_THREADS``; on the CPU backend ``CPU_STRIDE_THREADS``): more would only start and
    stop.
    """
    slot_c_type = SLOT_C_TYPES[np.dtype(slot_dtype)]
    if is_fp8(dtype):
        src = "float16" if src_dtype is None else src_dtype
        if is_fp8(src) or src not in C_TYPES:
            raise ValueError(f"expected src_dtype one of {Q_DTYPE_NAMES}, got {src}")
        vec = next(n for n in (16, 8, 1) if n == 1 or (aligned and row_bytes % n == 0))
        name = f"cupaged::write_kv_fp8<{C_TYPES[src]}, {slot_c_type}, {vec}, {C_TYPES[dtype]}>"
    else:
        if src_dtype not in (None, dtype):
            raise ValueError(f"expected src_dtype {dtype} (the cache's) or None, got {src_dtype}")
        vec = 16 // itemsize(dtype) if aligned and row_bytes % 16 == 0 else 1
        name = f"cupaged::write_kv<{C_TYPES[dtype]}, {slot_c_type}, {vec}>"
    vectors = num_kv_heads * row_bytes // (vec * itemsize(dtype))
    if device == "cpu":
        return name, (num_tokens,), (CPU_STRIDE_THREADS,)
    return name, (num_tokens,), (whole_warps(vectors, WRITE_THREADS),)


_COPY_WORDS = ((16, "uint4"), (4, "unsigned int"), (2, "unsigned short"), (1, "unsigned char"))


def copy_blocks_launch(
    block_bytes: int,
    aligned: bool,
    num_pairs: int,
    num_layers: int,
    device: str = "cuda",
    *,
    element_bytes: int = 2,
) -> tuple[str, tuple[int, int, int], tuple[int], int]:
    """``(name, grid, block, word_bytes)`` of ``copy_blocks``: the widest word that divides a block,
    at most ``min(2, element_bytes)`` bytes unless the caches are 16-byte ``aligned`` (fp8's
    1-byte elements may sit at any address, and an odd block moves byte by byte).

    One thread per word of a block (whole warps, at most ``COPY_THREADS``, each striding; on the
    CPU backend ``CPU_STRIDE_THREADS``).
    """
    small = min(2, element_bytes)
    word, c_type = next(
        (w, c) for w, c in _COPY_WORDS if block_bytes % w == 0 and (aligned or w <= small)
    )
    if device == "cpu":
        threads = CPU_STRIDE_THREADS
    else:
        threads = whole_warps(block_bytes // word, COPY_THREADS)
    return f"cupaged::copy_blocks<{c_type}>", (num_pairs, num_layers, 2), (threads,), word
