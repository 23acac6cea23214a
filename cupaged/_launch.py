"""The launch table: every kernel's instantiation name, grid, block, shared memory and split plan.

This is the only module that computes launch configurations; the functions in ``ops`` ask it and
never compute a grid themselves. An unsupported shape raises here, before anything is compiled,
and says what is supported.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._util import cdiv
from .dtypes import itemsize

C_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
SLOT_C_TYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}

HEAD_DIMS = tuple(range(64, 257, 16))  # 64, 80, 96, ..., 256
MAX_BLOCK_SIZE = 256

DECODE_THREADS = 128  # kDecodeThreads in cuda/paged_attention.cu
WRITE_THREADS = 128
COPY_THREADS = 256
# The CPU backend runs a block's threads one after another as fibers, so a copy or a KV write
# gains nothing from more than one warp there and pays a fiber start per thread (about 50 ns): it
# runs them with one.
CPU_COPY_THREADS = 32
# Split-K: a split holds at least this many tokens, so that its fixed cost (loading the queries,
# writing a partial row and its log-sum-exp) stays small against the K/V it reads.
MIN_SPLIT_TOKENS = 256
# The CPU backend plans splits as an H100/H200 (132 multiprocessors) would, so that the CPU runs
# the same split decisions that the GPU makes.
NOMINAL_SM_COUNT = 132
# Shared memory a kernel may use without opting in (cudaFuncAttributeMaxDynamicSharedMemorySize).
DEFAULT_SHARED_MEMORY = 48 * 1024


@dataclass(frozen=True, slots=True)
class DecodeLaunch:
    """How :func:`cupaged.paged_attention` runs for one batch shape.

    Attributes:
        name: ``paged_decode`` instantiation (a RawModule name expression).
        merge_name: ``paged_decode_merge`` instantiation, used when ``num_splits > 1``.
        grid: ``(num_kv_heads, num_seqs, num_splits)``.
        block: ``(DECODE_THREADS,)``.
        shared_mem: dynamic shared memory in bytes.
        num_splits: thread blocks per (sequence, KV head); 1 means no split-K.
        partition_tokens: tokens per split (a multiple of the tile).
        merge_grid: ``(num_q_heads, num_seqs)``.
    """

    name: str
    merge_name: str
    grid: tuple[int, int, int]
    block: tuple[int]
    shared_mem: int
    num_splits: int
    partition_tokens: int
    merge_grid: tuple[int, int]


def check_decode_shape(dtype: str, head_dim: int, block_size: int) -> None:
    """Raise ``ValueError`` listing what is supported when the kernels cannot take this shape."""
    if dtype not in C_TYPES:
        raise ValueError(f"expected dtype one of {tuple(C_TYPES)}, got {dtype}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(
            f"expected head_dim in 64..256, a multiple of 16 ({', '.join(map(str, HEAD_DIMS))}), "
            f"got {head_dim}"
        )
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"expected block_size in 1..{MAX_BLOCK_SIZE}, got {block_size}")


def decode_tile(dtype: str, head_dim: int) -> int:
    """Tokens per shared-memory tile: about 16 KiB of K or V, between 8 and 64 tokens."""
    tile = 64
    while tile > 8 and tile * head_dim * itemsize(dtype) > 16 * 1024:
        tile //= 2
    return tile


def decode_shared_memory(dtype: str, head_dim: int, group: int, tile: int) -> int:
    """Bytes of dynamic shared memory of ``paged_decode`` (layout: see cuda/paged_attention.cu)."""
    floats = 2 * group * head_dim + group * tile + (3 * group + 3) // 4 * 4
    return 4 * floats + tile * head_dim * itemsize(dtype)


def num_splits(num_seqs: int, num_kv_heads: int, max_context: int, sm_count: int) -> int:
    """Split-K heuristic: fill one wave of multiprocessors at small batch, never split at large.

    A batch whose (sequence, KV head) pairs already cover every multiprocessor gets one split;
    otherwise each pair is split until the GPU is full, but no split is shorter than
    ``MIN_SPLIT_TOKENS``.
    """
    pairs = max(num_seqs * num_kv_heads, 1)
    if pairs >= sm_count:
        return 1
    return max(1, min(cdiv(sm_count, pairs), cdiv(max_context, MIN_SPLIT_TOKENS)))


def decode_launch(
    dtype: str,
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    max_context: int,
    sm_count: int = NOMINAL_SM_COUNT,
    splits: int | None = None,
) -> DecodeLaunch:
    """The launch of ``paged_decode`` (and its merge) for one batch shape.

    Args:
        max_context: longest context in the batch (tokens); sizes the splits.
        sm_count: multiprocessors of the device.
        splits: force this many splits (tests); the heuristic decides when ``None``.
    """
    check_decode_shape(dtype, head_dim, block_size)
    tile = decode_tile(dtype, head_dim)
    if splits is None:
        splits = num_splits(num_seqs, num_kv_heads, max_context, sm_count)
    if splits < 1:
        raise ValueError(f"expected splits >= 1, got {splits}")
    per_split = cdiv(max(max_context, 1), splits)
    partition = cdiv(per_split, tile) * tile
    splits = max(1, cdiv(max_context, partition))
    c_type = C_TYPES[dtype]
    return DecodeLaunch(
        name=f"cupaged::paged_decode<{c_type}, {head_dim}, {block_size}, {tile}>",
        merge_name=f"cupaged::paged_decode_merge<{c_type}, {head_dim}>",
        grid=(num_kv_heads, num_seqs, splits),
        block=(DECODE_THREADS,),
        shared_mem=decode_shared_memory(dtype, head_dim, group, tile),
        num_splits=splits,
        partition_tokens=partition,
        merge_grid=(num_kv_heads * group, num_seqs),
    )


PREFILL_THREADS = 128  # a template argument of paged_prefill: no constant to keep equal
# Rows of a prefill thread block (query tokens x the query heads of one KV head's group): a tile
# of max(1, PREFILL_ROWS // G) query tokens, so that a KV tile loaded once serves about this many
# rows whatever the GQA ratio.
PREFILL_ROWS = 16
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z


@dataclass(frozen=True, slots=True)
class PrefillLaunch:
    """How :func:`cupaged.paged_prefill` runs for one batch shape.

    Attributes:
        name: ``paged_prefill`` instantiation (a RawModule name expression).
        grid: ``(ceil(max_query_len / query_rows), num_kv_heads, num_seqs)``.
        block: ``(PREFILL_THREADS,)``.
        shared_mem: dynamic shared memory in bytes.
        query_rows: query tokens per thread block.
    """

    name: str
    grid: tuple[int, int, int]
    block: tuple[int]
    shared_mem: int
    query_rows: int


def prefill_shared_memory(dtype: str, head_dim: int, rows: int, tile: int) -> int:
    """Bytes of dynamic shared memory of ``paged_prefill`` (layout: see cuda/paged_prefill.cu)."""
    floats = 2 * rows * head_dim + rows * tile + (3 * rows + 3) // 4 * 4
    return 4 * floats + tile * head_dim * itemsize(dtype)


def prefill_launch(
    dtype: str,
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    max_query_len: int,
) -> PrefillLaunch:
    """The launch of ``paged_prefill`` for one batch shape.

    Args:
        max_query_len: most query tokens of one sequence in the batch; sizes the grid (a query
            tile past a sequence's own count returns at once).
    """
    check_decode_shape(dtype, head_dim, block_size)
    for what, value in (("num_seqs", num_seqs), ("num_kv_heads", num_kv_heads)):
        if not 1 <= value <= MAX_GRID_YZ:
            raise ValueError(f"expected {what} in 1..{MAX_GRID_YZ} (one launch), got {value}")
    tile = decode_tile(dtype, head_dim)
    query_rows = max(1, PREFILL_ROWS // group)
    tiles = max(1, cdiv(max_query_len, query_rows))
    return PrefillLaunch(
        name=(
            f"cupaged::paged_prefill<{C_TYPES[dtype]}, {head_dim}, {block_size}, {tile}, "
            f"{PREFILL_THREADS}>"
        ),
        grid=(tiles, num_kv_heads, num_seqs),
        block=(PREFILL_THREADS,),
        shared_mem=prefill_shared_memory(dtype, head_dim, query_rows * group, tile),
        query_rows=query_rows,
    )


def write_kv_launch(
    dtype: str,
    slot_dtype: np.dtype,
    num_tokens: int,
    row_bytes: int,
    aligned: bool,
    num_kv_heads: int = 1,
    device: str = "cuda",
) -> tuple[str, tuple[int], tuple[int]]:
    """``(name, grid, block)`` of ``write_kv``; 16-byte vectors when rows and pointers allow.

    A token's block has one thread per vector of its ``num_kv_heads`` rows (whole warps, at most
    ``WRITE_THREADS``, or ``CPU_COPY_THREADS`` on the CPU backend): more would only start and stop.
    """
    vec = 16 // itemsize(dtype) if aligned and row_bytes % 16 == 0 else 1
    name = f"cupaged::write_kv<{C_TYPES[dtype]}, {SLOT_C_TYPES[np.dtype(slot_dtype)]}, {vec}>"
    vectors = num_kv_heads * row_bytes // (vec * itemsize(dtype))
    most = CPU_COPY_THREADS if device == "cpu" else WRITE_THREADS
    return name, (num_tokens,), (_whole_warps(vectors, most),)


def _whole_warps(items: int, most: int) -> int:
    """Threads for ``items`` parallel items: whole warps of 32, at least one, at most ``most``."""
    return min(most, max(32, cdiv(items, 32) * 32))


_COPY_WORDS = ((16, "uint4"), (4, "unsigned int"), (2, "unsigned short"))


def copy_blocks_launch(
    block_bytes: int, aligned: bool, num_pairs: int, num_layers: int, device: str = "cuda"
) -> tuple[str, tuple[int, int, int], tuple[int], int]:
    """``(name, grid, block, word_bytes)`` of ``copy_blocks``: the widest word that divides a block.

    One thread per word of a block (whole warps, at most ``COPY_THREADS``, each striding; at most
    ``CPU_COPY_THREADS`` on the CPU backend).
    """
    most = CPU_COPY_THREADS if device == "cpu" else COPY_THREADS
    for word, c_type in _COPY_WORDS:
        if block_bytes % word == 0 and (aligned or word <= 2):
            return (
                f"cupaged::copy_blocks<{c_type}>",
                (num_pairs, num_layers, 2),
                (_whole_warps(block_bytes // word, most),),
                word,
            )
    raise ValueError(f"expected a block of an even number of bytes, got {block_bytes}")


# The decode step's planner (cuda/decode_plan.cu): one thread block, one thread per run of
# sequences. A GPU takes kPlanMaxThreads; the CPU backend runs threads as fibers, and a thread
# costs more to start there than a few more sequences' lengths cost to add up.
PLAN_NAME = "cupaged::plan_decode"
PLAN_MAX_THREADS = 256  # kPlanMaxThreads in cuda/decode_plan.cu


def plan_threads(num_seqs: int, device: str = "cuda") -> int:
    """Threads of the decode planner for a batch: whole warps, at most ``PLAN_MAX_THREADS``."""
    most = CPU_COPY_THREADS if device == "cpu" else PLAN_MAX_THREADS
    return _whole_warps(num_seqs, most)
