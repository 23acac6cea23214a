"""Prefill's launches: the tile, rows, shared memory, split-K plan and instantiation names of
``paged_prefill_flash`` / ``paged_prefill_mma`` / ``paged_prefill`` and their merge
(cuda/paged_prefill.cu).

The shape check, the queries' element type, CUDA's grid limits and the name-expression rule are
decode's module's (``launch_decode``), which every attention launch starts from; what the table
knows of the GPU is ``target``. An unsupported shape raises here, before anything is compiled,
and says what is supported.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .._util import cdiv
from ..dtypes import C_TYPES, is_fp8, itemsize
from ..variants import NO_VARIANTS, SINKS, WINDOW, Variants
from .launch_decode import (
    MAX_GRID_X,
    MAX_GRID_YZ,
    MIN_SPLIT_TOKENS,
    check_block_elements,
    check_decode_shape,
    instantiation,
    query_dtype,
)
from .prefill_work import prefill_work
from .target import NOMINAL_TARGET, Target

PREFILL_THREADS = 128  # a template argument of paged_prefill: no constant to keep equal
# Rows of a prefill thread block (query tokens x the query heads of one KV head's group, a
# template argument): a tile of max(1, PREFILL_ROWS // G) query tokens, so that a KV tile loaded
# once serves about this many rows whatever the GQA ratio; a group of more than PREFILL_ROWS
# heads is cut into chunks of PREFILL_ROWS heads, one thread block each.
PREFILL_ROWS = 16
# Shared-memory stages of the cp.async ring (a template argument): tile t + STAGES - 1 is in
# flight while tile t is computed.
PREFILL_STAGES = 2
# K (or V) bytes of one prefill tile: 32 tokens of fp16 at head_dim 128, so that the ring
# (STAGES x K and V, padded rows) and the queries stay near 45 KiB and 5 blocks fit an H100 SM.
PREFILL_TILE_BYTES = 8 * 1024
PREFILL_MERGE_THREADS = 128
# The tensor-core path (paged_prefill_mma) for queries of these dtypes (over a cache of theirs, or
# fp8 converted to theirs in shared memory) up to PREFILL_MMA_MAX_HEAD_DIM (its output
# accumulators take head_dim / 4 registers per thread): PREFILL_MMA_ROWS rows per thread block (16
# per warp, the M of WMMA m16n16k16), 4 times the FMA path's, so that each KV tile loaded serves 4
# times the rows (docs/prefill.md, "Tensor cores"); same threads, tile and ring.
PREFILL_MMA_DTYPES = ("float16", "bfloat16")
PREFILL_MMA_MAX_HEAD_DIM = 128
PREFILL_MMA_ROWS = 64
# The FlashAttention-2 kind of kernel (paged_prefill_flash: mma.sync m16n8k16 and ldmatrix, the
# softmax in registers) for 16-bit queries over their own cache or fp8 (converted in registers)
# from sm_80, where m16n8k16 exists for fp16 and bf16, every head_dim. Its warps own two 16-row
# MMA tiles each up to PREFILL_FLASH_WIDE_HEAD_DIM (128 rows per thread block: each K and V
# fragment a warp loads serves 32 rows, halving the shared-memory reads per FLOP), one above it
# (64 rows: O alone takes head_dim / 2 registers per row tile); keys per tile: the largest of
# flash_tiles(rows) whose shared memory (queries and a ring of two K/V stages) lets
# PREFILL_FLASH_BLOCKS blocks share a multiprocessor (its __launch_bounds__); two row tiles stop
# at 32 keys, whose scores take as many registers as 64 keys of one.
PREFILL_FLASH_DTYPES = ("float16", "bfloat16")
PREFILL_FLASH_MIN_ARCH = 80
PREFILL_FLASH_WIDE_HEAD_DIM = 128
PREFILL_FLASH_BLOCKS = 2
# Its ring's stages, deepest first: three (two tiles in flight while one computes: its tiles of 16
# or 32 keys compute in less time than an L2 read takes to land) where two blocks still fit.
PREFILL_FLASH_STAGES = (3, 2)
# A forced split-K count (tests) cuts paged_prefill_flash's ranges into multiples of this many
# keys, not of its tile (prefill_partition).
FLASH_SPLIT_GRANULE = 16
# Split-K aims for this many thread blocks per multiprocessor: as many as fit one (4, the launch
# bounds of cuda/paged_prefill.cu up to head_dim 192, kPrefillBlocks; tests/kernels/test_kernel_args.py
# reads it there), since a block of 4 warps alone leaves an SM's issue slots idle while its loads
# are in flight. A heuristic, not a limit: any count gives the same result.
PREFILL_SPLIT_BLOCKS_PER_SM = 4
NO_SPLIT_PARTITION = 2**31 - 1  # partition_tokens of a launch without splits (one int32)


@dataclass(frozen=True, slots=True)
class PrefillLaunch:
    """How :func:`cupaged.paged_prefill` runs for one batch shape.

    Attributes:
        name: ``paged_prefill_flash`` (mma.sync: fp16/bf16 from sm_80), ``paged_prefill_mma``
            (WMMA: fp8 caches under 16-bit queries, sm_75) or ``paged_prefill`` (CUDA cores)
            instantiation (a RawModule name expression).
        merge_name: ``paged_prefill_merge`` instantiation, used when ``num_splits > 1``.
        grid: ``(units * head_chunks * num_splits, num_kv_heads, 1)``, ``units`` the runs of
            ``query_rows`` packed rows plus one per sequence (each sequence's tiles start at its
            first row: cuda/paged_prefill.cu, "Query tiles").
        block: ``(PREFILL_THREADS,)``.
        shared_mem: dynamic shared memory in bytes.
        query_rows: query tokens per thread block.
        heads_per_block: query heads of a KV head's group per thread block (``min(G, 16)``).
        tile: KV tokens per shared-memory tile.
        num_splits: thread blocks per (query tile, head chunk); 1 means no split-K.
        partition_tokens: KV tokens per split (a multiple of the tile).
        merge_grid: ``(total_query_tokens, num_q_heads)``.
        merge_block: ``(PREFILL_MERGE_THREADS,)``.
        sinks_name: the kernel's instantiation for a run with attention sinks: ``name`` with
            the sinks bit of its ``VARIANT`` without split-K, ``name`` itself with it (the
            sink then joins in the merge, once per row).
        sinks_merge_name: the merge's instantiation for a run with sinks.
    """

    name: str
    merge_name: str
    grid: tuple[int, int, int]
    block: tuple[int]
    shared_mem: int
    query_rows: int
    heads_per_block: int
    tile: int
    num_splits: int
    partition_tokens: int
    merge_grid: tuple[int, int]
    merge_block: tuple[int]
    sinks_name: str
    sinks_merge_name: str


def prefill_tile(dtype: str, head_dim: int) -> int:
    """KV tokens per prefill tile: ``PREFILL_TILE_BYTES`` of K, a power of two from 8 to 32 (one
    lane per token in the kernel's scoring)."""
    tile = 32
    while tile > 8 and tile * head_dim * itemsize(dtype) > PREFILL_TILE_BYTES:
        tile //= 2
    return tile


def flash_rows(head_dim: int, target: Target = NOMINAL_TARGET, dtype: str = "float16") -> int:
    """Rows (query tokens x query heads) of a ``paged_prefill_flash`` thread block: 128 (two
    16-row MMA tiles per warp) up to ``PREFILL_FLASH_WIDE_HEAD_DIM`` where two such blocks share
    a multiprocessor (not on the 99 KB of sm_86/sm_89 at head_dim 128), else 64."""
    if head_dim <= PREFILL_FLASH_WIDE_HEAD_DIM:
        smallest = flash_tiles(head_dim, 128)[-1]
        if _two_fit(_flash_shared_memory(dtype, head_dim, smallest, 128, 2), target):
            return 128
    return 64


def flash_tiles(head_dim: int, rows: int) -> tuple[int, ...]:
    """The tiles ``paged_prefill_flash`` may take at ``head_dim`` and ``rows``, largest first,
    so that no instantiation spills (scripts/kernel-report; NVRTC 12.9, sm_80 and sm_90, every
    dtype and variant): with two row tiles per warp, 32 keys up to head_dim 96 and 16 above it
    (the scores of 32 keys and O of two row tiles outgrow 255 registers at head_dim 112-128);
    with one, 32 up to head_dim 192 and 16 above (O alone takes 128 registers at 256)."""
    if rows == 128:
        return (32, 16) if head_dim <= 96 else (16,)
    return (32, 16) if head_dim <= 192 else (16,)


@functools.cache  # pure, and asked several times per plan (uses_prefill_flash, the launch)
def flash_geometry(
    head_dim: int, target: Target = NOMINAL_TARGET, dtype: str = "float16"
) -> tuple[int, int, int]:
    """``(rows, tile, stages)`` of ``paged_prefill_flash``: the largest of ``flash_tiles``, then
    the deepest ring (``PREFILL_FLASH_STAGES``: two tiles in flight while one computes, or one),
    whose shared memory lets ``PREFILL_FLASH_BLOCKS`` blocks share a multiprocessor; else the
    smallest tile and two stages (one block)."""
    rows = flash_rows(head_dim, target, dtype)
    tiles = flash_tiles(head_dim, rows)
    for tile in tiles:
        for stages in PREFILL_FLASH_STAGES:
            if _two_fit(_flash_shared_memory(dtype, head_dim, tile, rows, stages), target):
                return rows, tile, stages
    return rows, tiles[-1], PREFILL_FLASH_STAGES[-1]


def flash_tile(head_dim: int, target: Target = NOMINAL_TARGET, dtype: str = "float16") -> int:
    """Keys per tile of ``paged_prefill_flash`` (``flash_geometry``)."""
    return flash_geometry(head_dim, target, dtype)[1]


def _two_fit(shared_mem: int, target: Target) -> bool:
    """Whether ``PREFILL_FLASH_BLOCKS`` blocks of ``shared_mem`` bytes share a multiprocessor,
    whose shared memory is what one block may opt into plus the 1 KiB the system reserves per
    block."""
    return PREFILL_FLASH_BLOCKS * (shared_mem + 1024) <= target.shared_memory + 1024


def _flash_shared_memory(dtype: str, head_dim: int, tile: int, rows: int, stages: int) -> int:
    """q_s (16-bit) and the ring (the cache's type) of ``paged_prefill_flash``, rows padded by 16
    bytes."""
    stage_row = head_dim * itemsize(dtype) + 16
    return rows * 2 * (head_dim + 8) + stages * 2 * tile * stage_row


def uses_prefill_flash(
    dtype: str, head_dim: int, target: Target = NOMINAL_TARGET, *, q_dtype: str | None = None
) -> bool:
    """Whether ``paged_prefill`` runs on ``paged_prefill_flash`` for this shape and GPU: fp16 or
    bf16 queries over a cache of their own type or fp8 (converted in registers), from sm_80,
    where its shared memory fits."""
    q = query_dtype(dtype, q_dtype)
    own_or_fp8 = dtype == q or is_fp8(dtype)
    if q not in PREFILL_FLASH_DTYPES or not own_or_fp8 or target.arch < PREFILL_FLASH_MIN_ARCH:
        return False
    rows, tile, stages = flash_geometry(head_dim, target, dtype)
    return target.fits(_flash_shared_memory(dtype, head_dim, tile, rows, stages))


def uses_prefill_mma(
    dtype: str, head_dim: int, target: Target = NOMINAL_TARGET, *, q_dtype: str | None = None
) -> bool:
    """Whether ``paged_prefill`` runs on WMMA (``paged_prefill_mma``) for this shape and GPU:
    fp16/bf16 queries (over their own cache or fp8, converted to theirs in shared memory) up to
    head_dim 128 where ``paged_prefill_flash`` does not run, the target has WMMA for the queries'
    dtype (bf16 from sm_80) and grants the kernel's shared memory (a T4's 64 KB hold it up to
    head_dim 96); elsewhere the CUDA-core kernel (float32 queries over fp8 too)."""
    if uses_prefill_flash(dtype, head_dim, target, q_dtype=q_dtype):
        return False
    q = query_dtype(dtype, q_dtype)
    if not (
        q in PREFILL_MMA_DTYPES and head_dim <= PREFILL_MMA_MAX_HEAD_DIM and target.has_wmma(q)
    ):
        return False
    tile = prefill_tile(dtype, head_dim)
    return target.fits(_prefill_shared_memory(True, dtype, head_dim, tile))


def prefill_rows(
    dtype: str, head_dim: int, target: Target = NOMINAL_TARGET, *, q_dtype: str | None = None
) -> int:
    """Rows (query tokens x query heads) of one prefill thread block."""
    if uses_prefill_flash(dtype, head_dim, target, q_dtype=q_dtype):
        return flash_rows(head_dim, target, dtype)
    mma = uses_prefill_mma(dtype, head_dim, target, q_dtype=q_dtype)
    return PREFILL_MMA_ROWS if mma else PREFILL_ROWS


def prefill_shared_memory(
    dtype: str,
    head_dim: int,
    tile: int,
    target: Target = NOMINAL_TARGET,
    *,
    q_dtype: str | None = None,
) -> int:
    """Bytes of dynamic shared memory of ``paged_prefill`` (layout: see cuda/paged_prefill.cu)."""
    if uses_prefill_flash(dtype, head_dim, target, q_dtype=q_dtype):
        rows, _, stages = flash_geometry(head_dim, target, dtype)
        return _flash_shared_memory(dtype, head_dim, tile, rows, stages)
    mma = uses_prefill_mma(dtype, head_dim, target, q_dtype=q_dtype)
    return _prefill_shared_memory(mma, dtype, head_dim, tile)


def _prefill_shared_memory(mma: bool, dtype: str, head_dim: int, tile: int) -> int:
    """``dtype``: the cache's (the tensor-core path's queries are 16-bit whatever it is)."""
    if mma:  # paged_prefill_mma: q_s, the ring, fp8's converted stage, s_s, p_s, special_s
        rows, row = PREFILL_MMA_ROWS, 2 * (head_dim + 8)
        stage_row = head_dim * itemsize(dtype) + 16
        converted = 2 * tile * row if is_fp8(dtype) else 0
        return (
            rows * row
            + PREFILL_STAGES * 2 * tile * stage_row
            + converted
            + rows * (tile + 4) * 4
            + rows * (tile + 8) * 2
            + rows * head_dim
        )
    floats = PREFILL_ROWS * head_dim + PREFILL_ROWS * (tile + 4) + 2 * PREFILL_ROWS
    padded_row = head_dim * itemsize(dtype) + 16
    return 4 * floats + PREFILL_STAGES * 2 * tile * padded_row


def prefill_partition(
    units: int,
    kv_tokens: int,
    max_end: int,
    tile: int,
    sm_count: int,
    splits: int | None,
    forced_granule: int | None = None,
) -> int:
    """Tokens per split of one query tile's KV range; ``max_end`` or more means no split.

    Split-K only when the thread blocks without it (``units``) do not cover the multiprocessors.
    It is balanced by tokens: every thread block reads at most ``partition`` tokens, the batch's
    KV tokens spread over ``PREFILL_SPLIT_BLOCKS_PER_SM`` blocks per multiprocessor, and no split
    is shorter than ``MIN_SPLIT_TOKENS`` (a split's fixed cost: its queries, its partial rows and
    their merge).
    ``splits`` forces a count (tests): the longest range is cut into about that many pieces,
    each a multiple of ``forced_granule`` tokens (the tile when ``None``): paged_prefill_flash
    takes any multiple of 16 (a split may end inside one of its key tiles, as a range's last
    tile does), so that a forced split cuts short ranges too.
    """
    longest = max(max_end, 1)
    if splits is not None:
        if splits < 1:
            raise ValueError(f"expected num_splits >= 1, got {splits}")
        granule = forced_granule or tile
        return cdiv(cdiv(longest, splits), granule) * granule
    elif units >= sm_count or longest <= MIN_SPLIT_TOKENS:
        return cdiv(longest, tile) * tile
    else:
        per_split = max(MIN_SPLIT_TOKENS, cdiv(kv_tokens, sm_count * PREFILL_SPLIT_BLOCKS_PER_SM))
    return cdiv(per_split, tile) * tile


@dataclass(frozen=True, slots=True)
class PrefillGeometry:
    """What a prefill launch takes from its shapes, dtypes, GPU and variants alone, never from
    the batch's lengths: the kernel, its tile and shared memory, the query tiles' rows (see
    :class:`PrefillLaunch` for the fields they share). ``sinks_name``: the kernel of a run with
    sinks when the launch does not split (with split-K the sink joins in the merge, and the
    kernel is ``name``)."""

    name: str
    merge_name: str
    sinks_name: str
    sinks_merge_name: str
    shared_mem: int
    query_rows: int
    heads_per_block: int
    head_chunks: int
    tile: int
    flash: bool


@functools.lru_cache(maxsize=256)  # pure, and asked by every plan (the one-shot's per call)
def prefill_geometry(
    dtype: str,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    target: Target = NOMINAL_TARGET,
    variant: int = 0,
    q_dtype: str | None = None,
) -> PrefillGeometry:
    """The part of :func:`prefill_launch` that the lengths do not change; ``variant``: the
    plan's ``Variants.flags()`` (the sinks bit off).

    Raises:
        ValueError: an unsupported shape (the message lists the supported ones), or head
            counts past one launch's grid.
    """
    check_decode_shape(dtype, head_dim, block_size)
    q_dtype = query_dtype(dtype, q_dtype)
    num_q_heads = num_kv_heads * group
    for what, value in (("num_kv_heads", num_kv_heads), ("num_q_heads", num_q_heads)):
        if not 1 <= value <= MAX_GRID_YZ:
            raise ValueError(f"expected {what} in 1..{MAX_GRID_YZ} (one launch), got {value}")
    flash = uses_prefill_flash(dtype, head_dim, target, q_dtype=q_dtype)
    mma = uses_prefill_mma(dtype, head_dim, target, q_dtype=q_dtype)
    if flash:  # its ring's cache offsets are 32-bit per block (common.cuh, KvRing SPLIT_KV)
        check_block_elements(num_kv_heads, block_size, head_dim)
        rows_per_block, tile, stages = flash_geometry(head_dim, target, dtype)
        kind = "flash"
        shared_mem = _flash_shared_memory(dtype, head_dim, tile, rows_per_block, stages)
    else:
        tile, stages = prefill_tile(dtype, head_dim), PREFILL_STAGES
        rows_per_block = PREFILL_MMA_ROWS if mma else PREFILL_ROWS
        kind = "mma" if mma else ""
        shared_mem = _prefill_shared_memory(mma, dtype, head_dim, tile)
    heads = min(group, PREFILL_ROWS)
    c_type = C_TYPES[q_dtype]
    kernel = (
        f"cupaged::paged_prefill{'_' + kind if kind else ''}<{c_type}, {head_dim}, "
        f"{block_size}, {tile}, {rows_per_block}, {stages}, {PREFILL_THREADS}"
    )
    merge = f"cupaged::paged_prefill_merge<{c_type}, {head_dim}, {PREFILL_MERGE_THREADS}"
    kv_type = C_TYPES[dtype] if is_fp8(dtype) else None
    # The merge reads only the window (which splits a row takes) and the sinks.
    return PrefillGeometry(
        name=_prefill_instantiation(kernel, variant, kv_type),
        merge_name=instantiation(merge, variant & WINDOW),
        sinks_name=_prefill_instantiation(kernel, variant | SINKS, kv_type),
        sinks_merge_name=instantiation(merge, variant & WINDOW | SINKS),
        shared_mem=shared_mem,
        query_rows=max(1, rows_per_block // heads),
        heads_per_block=heads,
        head_chunks=cdiv(group, heads),
        tile=tile,
        flash=flash,
    )


def prefill_launch(
    dtype: str,
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    max_query_len: int,
    query_start_loc: np.ndarray | None = None,
    context_lens: np.ndarray | None = None,
    causal: bool = True,
    sm_count: int | None = None,
    splits: int | None = None,
    total_query_tokens: int = 0,
    target: Target = NOMINAL_TARGET,
    variants: Variants = NO_VARIANTS,
    *,
    q_dtype: str | None = None,
) -> PrefillLaunch:
    """The launch of ``paged_prefill`` (and its merge) for one batch shape.

    ``dtype`` is the cache's element type; ``q_dtype`` the queries' and the output's
    (``query_dtype``: over fp8 float32, float16 or bfloat16, float16 when ``None``). An fp8
    instantiation spells both types (``VARIANT`` written even when 0, then the cache's).
    What the lengths do not change comes from :func:`prefill_geometry` (kept per shape).

    Args:
        max_query_len: most query tokens of one sequence in the batch; with ``num_seqs``, sizes
            the grid when ``total_query_tokens`` is not given (a bound: blocks past the rows of
            q return at once).
        query_start_loc: host copy of ``query_start_loc``, and
        context_lens: host copy of the lengths: the split-K decision's input (``prefill_work``);
            no split when ``None``.
        causal: whether the tiles' KV ranges end at their last query (the split-K input too).
        sm_count: multiprocessors of the device; ``target.sm_count`` when ``None``.
        splits: force about this many splits (tests); the heuristic decides when ``None``.
        total_query_tokens: rows of ``q``; sizes the grid and the merge grid.
        target: the GPU planned for: the kernel that compiles and fits there.
        variants: the plan's attention variants (``cupaged.variants``): their ``VARIANT``
            bits name the kernels (the sinks bit, a run's, goes to ``sinks_name`` /
            ``sinks_merge_name``), and with a window a tile's KV range, and so the split-K
            plan, starts at its first query's first key.
    """
    if sm_count is None:
        sm_count = target.sm_count
    geometry = prefill_geometry(
        dtype, num_kv_heads, group, head_dim, block_size, target, variants.flags(), q_dtype
    )
    if num_seqs < 1:
        raise ValueError(f"expected num_seqs >= 1, got {num_seqs}")
    chunks, query_rows = geometry.head_chunks, geometry.query_rows
    # Runs of query_rows packed rows, then one unit per sequence (cuda/paged_prefill.cu).
    rows = total_query_tokens if total_query_tokens else max_query_len * num_seqs
    tiles = max(1, cdiv(rows, query_rows) + num_seqs)
    num_splits, partition = 1, NO_SPLIT_PARTITION
    if query_start_loc is not None and context_lens is not None:
        window_left = variants.window_left
        work = prefill_work(query_start_loc, context_lens, query_rows, causal, window_left)
        units = work.query_tiles * num_kv_heads * chunks
        partition = prefill_partition(
            units,
            work.kv_tokens * num_kv_heads * chunks,
            work.max_end,
            geometry.tile,
            sm_count,
            splits,
            FLASH_SPLIT_GRANULE if geometry.flash else None,
        )
        num_splits = max(1, cdiv(work.max_end, partition))
        if num_splits == 1:
            partition = NO_SPLIT_PARTITION
    if tiles * chunks * num_splits > MAX_GRID_X:
        raise ValueError(
            f"expected at most {MAX_GRID_X} thread blocks per KV head, got "
            f"{tiles * chunks * num_splits}"
        )
    return PrefillLaunch(
        name=geometry.name,
        merge_name=geometry.merge_name,
        grid=(tiles * chunks * num_splits, num_kv_heads, 1),
        block=(PREFILL_THREADS,),
        shared_mem=geometry.shared_mem,
        query_rows=query_rows,
        heads_per_block=geometry.heads_per_block,
        tile=geometry.tile,
        num_splits=num_splits,
        partition_tokens=partition,
        merge_grid=(max(total_query_tokens, 1), num_kv_heads * group),
        merge_block=(PREFILL_MERGE_THREADS,),
        # With split-K a sink joins in the merge, once per row.
        sinks_name=geometry.sinks_name if num_splits == 1 else geometry.name,
        sinks_merge_name=geometry.sinks_merge_name,
    )


def _prefill_instantiation(stem: str, variant: int, kv_type: str | None) -> str:
    """A prefill kernel's name expression: over fp8 both trailing template arguments (``VARIANT``,
    then the cache's type ``KV``, whose default is the queries' type), else ``instantiation``."""
    return instantiation(stem, variant) if kv_type is None else f"{stem}, {variant}, {kv_type}>"
