"""The launch table: every kernel's instantiation name, grid, block, shared memory and split plan.

This is the only module that computes launch configurations; the functions in ``ops`` ask it and
never compute a grid themselves. An unsupported shape raises here, before anything is compiled,
and says what is supported. A launch is the same on both backends, but for the two stride kernels
(``CPU_STRIDE_THREADS``); how the CPU backend spreads a launch's blocks over its OS threads is its
own policy (``cupaged/_cpu/threads.py``). What the table knows of the GPU it plans for (shared
memory per architecture, WMMA, occupancy) is ``cupaged/_gpu_target.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._gpu_target import DECODE_REGISTERS, NOMINAL_TARGET, Target, ctas_per_sm

# Unused here: the launch table's users (ops, tests, scripts) read these two limits from it.
from ._gpu_target import DEFAULT_SHARED_MEMORY as DEFAULT_SHARED_MEMORY
from ._gpu_target import NOMINAL_SM_COUNT as NOMINAL_SM_COUNT
from ._prefill_work import PrefillWork as PrefillWork
from ._prefill_work import prefill_work
from ._util import cdiv
from ._variants import SINKS, WINDOW
from .dtypes import C_TYPES, Q_DTYPE_NAMES, is_fp8, itemsize

SLOT_C_TYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}

HEAD_DIMS = tuple(range(64, 257, 16))  # 64, 80, 96, ..., 256
MAX_BLOCK_SIZE = 256

WRITE_THREADS = 128
COPY_THREADS = 256
# The one block shape that differs between the backends (DecodePlan also launches only the work
# items it planned there, not the capacity). The CPU backend runs a block's threads one after
# another, each started by a call that costs many words of a copy loop, so copy_blocks and
# write_kv, whose threads only stride over the words they move, run one thread per block there
# whatever the size; every other kernel launches as on the GPU (the numbers: docs/benchmarks.md,
# "One launch geometry and the helper threads of the CPU backend"). tests/test_ops.py runs both
# on the CPU backend with several threads too, as the GPU splits the words.
CPU_STRIDE_THREADS = 1
# Split-K: a split holds at least this many tokens, so that its fixed cost (loading the queries,
# writing a partial row and its log-sum-exp) stays small against the K/V it reads.
MIN_SPLIT_TOKENS = 256


# paged_decode (cuda/paged_attention.cu): a ring of DECODE_STAGES shared-memory stages of K and V,
# each about DECODE_STAGE_BYTES of K (and as much of V), and thread blocks of about
# DECODE_TARGET_THREADS threads. The layout goes to the kernel as template arguments.
DECODE_STAGES = 3
DECODE_STAGE_BYTES = 4096
DECODE_TARGET_THREADS = 128
DECODE_MAX_TOKENS_PER_THREAD = 8  # TPZ: scores a thread keeps in registers per head and stage
DECODE_WIDE_LANE_GROUP = 4  # from this GQA group on, a lane owns 16 elements of a row, not 8
MERGE_THREADS = 128  # paged_decode_merge: any block size works (it strides by blockDim.x)
# Query heads of one decode thread block: a larger GQA group is cut into chunks of at most this
# many (DecodeChunk in cuda/common.cuh), so that a thread's q rows and accumulators stay in
# registers (a group of 48 in one block took 255 registers and spilled 596 bytes; of 128, 25 KB).
DECODE_MAX_CHUNK = 16
# The tensor-core path (paged_decode_mma): fp16/bf16 chunks of DECODE_MMA_MIN_GROUP to 16 query
# heads, the rows of WMMA m16n16k16 products, where the CUDA-core loop is issue-bound (the issue
# model of scripts/kernel-report: docs/kernels.md, "Tensor cores"). DECODE_MMA_WARPS warps per
# block, a stage of 16 tokens per warp, DECODE_MMA_STAGES stages (a 64-token stage is 4x the
# CUDA-core path's). Up to head_dim 128: above it a warp's accumulators and q fragments outgrow
# the registers (with 2 warps: 168-255 registers and spills at 192 and 256; with 4, stages of
# 150 KB at 256, one block per SM), so those head_dims keep the CUDA-core kernel.
DECODE_MMA_MIN_GROUP = 8
DECODE_MMA_MAX_HEAD_DIM = 128
DECODE_MMA_WARPS = 4
DECODE_MMA_STAGES = 2
DECODE_MMA_DTYPES = ("float16", "bfloat16")


def decode_chunk(group: int) -> int:
    """Query heads per decode thread block: the group up to ``DECODE_MAX_CHUNK``, else the
    group cut into ``ceil(group / DECODE_MAX_CHUNK)`` chunks as even as whole heads allow (71:
    5 chunks of 15, the last 11).

    >>> decode_chunk(8), decode_chunk(48), decode_chunk(71), decode_chunk(128)
    (8, 16, 15, 16)
    """
    if group < 1:
        raise ValueError(f"expected a GQA group of at least 1 query head per KV head, got {group}")
    return cdiv(group, cdiv(group, DECODE_MAX_CHUNK))


def query_dtype(dtype: str, q_dtype: str | None = None) -> str:
    """The element type of the queries (and the output) of an attention launch over a ``dtype``
    cache: the cache's own (``q_dtype`` ``None`` or equal to it), or over fp8 ``q_dtype``, one
    of float32, float16 and bfloat16 (float16 when ``None``).

    Raises:
        TypeError: another ``q_dtype``.
    """
    if not is_fp8(dtype):
        if q_dtype not in (None, dtype):
            raise TypeError(f"expected q_dtype None or {dtype} (the cache's), got {q_dtype!r}")
        return dtype
    if q_dtype is None:
        return "float16"
    if q_dtype not in Q_DTYPE_NAMES:
        raise TypeError(f"expected q_dtype one of {Q_DTYPE_NAMES} over fp8, got {q_dtype!r}")
    return q_dtype


def uses_decode_mma(
    dtype: str,
    group: int,
    head_dim: int,
    target: Target = NOMINAL_TARGET,
    *,
    q_dtype: str | None = None,
) -> bool:
    """Whether decode runs on tensor cores (``paged_decode_mma``) for this shape and GPU.

    fp16/bf16 queries (of a cache of their type, or of an fp8 cache: ``q_dtype``), groups of
    ``DECODE_MMA_MIN_GROUP`` heads or more up to head_dim 128, where the target has WMMA for the
    query's type (bf16 from sm_80) and grants the kernel's shared memory (a T4's 64 KB do not
    hold head_dim 128's stages); elsewhere the CUDA-core kernel, which fits all. Over fp8 the
    same rule: the kernel converts each staged fp8 stage to the query's type in shared memory
    (its ring of fp8 stages and the two converted tiles take about the shared memory of the
    16-bit ring), with registers and spills as the 16-bit kernel's (docs/kernels.md).
    """
    q_dtype = query_dtype(dtype, q_dtype)
    if not (
        q_dtype in DECODE_MMA_DTYPES
        and group >= DECODE_MMA_MIN_GROUP
        and head_dim <= DECODE_MMA_MAX_HEAD_DIM
        and target.has_wmma(q_dtype)
    ):
        return False
    return target.fits(decode_shared_memory(dtype, head_dim, _decode_mma_geometry(group)))


def _decode_mma_geometry(group: int) -> DecodeGeometry:
    """``paged_decode_mma``'s layout: every chunk is the 16 rows of the MMA (padded), so one
    instantiation, ``CHUNK = 16``, serves every group of 8 heads or more."""
    chunks = cdiv(group, DECODE_MAX_CHUNK)
    return DecodeGeometry(
        32, DECODE_MMA_WARPS, 1, 16, DECODE_MMA_STAGES, 16, True, DECODE_MAX_CHUNK, chunks
    )


@dataclass(frozen=True, slots=True)
class DecodeGeometry:
    """The thread-block layout of one ``paged_decode`` instantiation (cuda/paged_attention.cu).

    Attributes:
        bdx: lanes across a head vector (each owns 8 elements: one or two 16-byte vectors).
        bdy: thread rows over the GQA group, ``heads_per_thread`` query heads each.
        bdz: token lanes; each takes ``tokens_per_thread`` consecutive tokens of a stage.
        tokens_per_thread: TPZ.
        stages: shared-memory stages of the ``cp.async`` ring.
        heads_per_thread: ``ceil(chunk / bdy)``.
        mma: the tensor-core kernel, ``paged_decode_mma``: then ``bdx`` is 32 (a warp), ``bdy``
            the warps, ``bdz`` 1, ``tokens_per_thread`` 16 (the tokens of a warp's score tile)
            and ``heads_per_thread`` 16 (the rows of the MMA: the chunk, padded).
        chunk: query heads per thread block (:func:`decode_chunk`).
        head_chunks: thread blocks per KV head and work item, ``ceil(group / chunk)``.
    """

    bdx: int
    bdy: int
    bdz: int
    tokens_per_thread: int
    stages: int
    heads_per_thread: int
    mma: bool = False
    chunk: int = 1
    head_chunks: int = 1

    @property
    def tile(self) -> int:
        """Tokens per stage."""
        if self.mma:
            return 16 * self.bdy
        return self.bdz * self.tokens_per_thread

    @property
    def threads(self) -> int:
        return self.bdx * self.bdy * self.bdz


@dataclass(frozen=True, slots=True)
class DecodeLaunch:
    """How ``paged_decode`` and ``paged_decode_merge`` run for one shape and work-list capacity.

    Attributes:
        name: ``paged_decode`` instantiation (a RawModule name expression).
        merge_name: ``paged_decode_merge`` instantiation.
        grid: ``(num_kv_heads * head_chunks, capacity)``: one thread block per (KV head, head
            chunk, work item).
        block: ``(bdx, bdy, bdz)``.
        shared_mem: dynamic shared memory in bytes.
        tile: tokens per pipeline stage (work items are whole stages but a sequence's last).
        merge_block: threads of ``paged_decode_merge``; its grid is ``(num_q_heads, num_seqs)``.
        geometry: the layout behind ``name`` and ``block``.
        sinks_name: ``name`` for a run with attention sinks (the sinks bit added to its
            ``VARIANT``: a single-item sequence's sink joins at its normalisation).
        sinks_merge_name: the merge for a run with sinks (a split sequence's sink joins there).
    """

    name: str
    merge_name: str
    grid: tuple[int, int]
    block: tuple[int, int, int]
    shared_mem: int
    tile: int
    merge_block: tuple[int]
    geometry: DecodeGeometry
    sinks_name: str
    sinks_merge_name: str


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


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def decode_geometry(
    dtype: str,
    head_dim: int,
    group: int,
    target: Target = NOMINAL_TARGET,
    *,
    q_dtype: str | None = None,
) -> DecodeGeometry:
    """The ``paged_decode`` layout for a shape (see cuda/paged_attention.cu's header), over the
    chunk of query heads one thread block serves (:func:`decode_chunk`).

    - ``bdx``: a lane owns 8 elements of a row (16 bytes of a 16-bit type, 2 x 16 of float32,
      8 bytes of fp8: the same elements as fp16), 16 from G = 4 (``DECODE_WIDE_LANE_GROUP``:
      half the shuffles and the redundant softmax per score, the issue model's largest costs
      there), rounded up to a power of two: head_dim 80 at fp16 is 10 busy lanes of 16.
    - ``bdy``: two query heads per thread (one for G = 1), more above G = 16, so that K and V
      read from shared memory once serve two heads' dot products.
    - ``bdz``: a power of two that brings the block to ``DECODE_TARGET_THREADS`` in whole warps.
    - tokens per thread: a stage of about ``DECODE_STAGE_BYTES`` of K, at most
      ``DECODE_MAX_TOKENS_PER_THREAD`` per thread.

    fp16/bf16 queries in groups of 8 or more up to head_dim 128 where the target has the tensor
    cores and the shared memory for them (``uses_decode_mma``; ``q_dtype``: the queries' type
    over an fp8 cache) take the tensor-core kernel's layout instead: ``DECODE_MMA_WARPS``
    warps, 16 tokens per warp and stage.
    """
    if uses_decode_mma(dtype, group, head_dim, target, q_dtype=q_dtype):
        return _decode_mma_geometry(group)
    chunk = decode_chunk(group)
    chunks = cdiv(group, chunk)
    size = itemsize(dtype)
    unit = 8 if is_fp8(dtype) else 16 // size  # LaneUnit<KV>: elements per shared-memory read
    lane_units = (2 if size == 4 else 1) * (2 if chunk >= DECODE_WIDE_LANE_GROUP else 1)
    bdx = min(32, _next_power_of_two(cdiv(head_dim // unit, lane_units)))
    heads_per_thread = 1 if chunk == 1 else max(2, cdiv(chunk, 8))
    bdy = cdiv(chunk, heads_per_thread)
    bdz = 1
    while bdx * bdy * bdz < DECODE_TARGET_THREADS or (bdx * bdy * bdz) % 32:
        bdz *= 2
    # fp8 stages hold the tokens of a 16-bit one (half the bytes): the scores a thread keeps stay
    # as many as over fp16 (twice the tokens spilled on sm_80 from G = 8).
    tile_target = max(1, DECODE_STAGE_BYTES // (head_dim * max(size, 2)))
    tokens = min(DECODE_MAX_TOKENS_PER_THREAD, max(1, tile_target // bdz))
    return DecodeGeometry(
        bdx, bdy, bdz, tokens, DECODE_STAGES, heads_per_thread, False, chunk, chunks
    )


def decode_shared_memory(dtype: str, head_dim: int, geometry: DecodeGeometry) -> int:
    """Bytes of dynamic shared memory of ``paged_decode`` over a ``dtype`` cache: the K/V
    stages, or (when larger) the partial results of the token lanes that overlay them after the
    loop."""
    if geometry.mma:  # DecodeMmaLayout::kBytes in cuda/paged_attention.cu
        tile, ldk = geometry.tile, head_dim + 8
        scores = max(16 * (tile + 4) * 4, geometry.bdy * 16 * 20 * 4)  # the O tiles share it
        # Over fp8: a ring of unpadded fp8 rows, and K and V of one stage converted to q's type.
        ring_row, converted = (head_dim, 2 * tile * ldk * 2) if is_fp8(dtype) else (ldk, 0)
        return (
            2 * geometry.stages * tile * ring_row * itemsize(dtype)
            + converted
            + 16 * ldk * 2
            + scores
            + 16 * (tile + 8) * 2
            + 2 * 16 * 4
        )
    stages = 2 * geometry.stages * geometry.tile * head_dim * itemsize(dtype)
    heads = geometry.bdy * geometry.heads_per_thread
    merge = 4 * geometry.bdz * heads * (head_dim + 2) if geometry.bdz > 1 else 0
    return max(stages, merge)


def decode_launch(
    dtype: str,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    capacity: int,
    target: Target = NOMINAL_TARGET,
    variant: int = 0,
    *,
    q_dtype: str | None = None,
) -> DecodeLaunch:
    """The launch of ``paged_decode`` (and its merge) over a work list of ``capacity`` items, on
    ``target`` (the kernel that compiles and fits there).

    Nothing here depends on the context lengths: the work list carries them. ``variant``: the
    attention variants' ``VARIANT`` bits (``cupaged._variants``); the window's and the sinks'
    are not the kernel's (the planner's work list holds the window, ``sinks_name`` adds the
    sinks), so a window alone runs the plain kernels. ``dtype`` is the cache's element type,
    ``q_dtype`` the queries' (and the output's) over an fp8 cache (:func:`query_dtype`): the
    kernels are instantiated for both (``T`` the query's, the last argument ``KV`` the cache's,
    spelled only for fp8, so that the 16/32-bit names stay as they were).
    """
    check_decode_shape(dtype, head_dim, block_size)
    q_dtype = query_dtype(dtype, q_dtype)
    if not 1 <= capacity <= MAX_GRID_YZ:
        raise ValueError(f"expected a work list of 1..{MAX_GRID_YZ} items, got {capacity}")
    if num_kv_heads * block_size * head_dim >= 2**32:  # the kernel's 32-bit block stride
        raise ValueError(
            f"expected num_kv_heads * block_size * head_dim < 2**32 (the elements of one block), "
            f"got {num_kv_heads} * {block_size} * {head_dim}"
        )
    geo = decode_geometry(dtype, head_dim, group, target, q_dtype=q_dtype)
    if num_kv_heads * geo.head_chunks > MAX_GRID_X:
        raise ValueError(
            f"expected num_kv_heads * ceil(group / {geo.chunk}) <= {MAX_GRID_X} (one grid axis), "
            f"got {num_kv_heads} * {geo.head_chunks}"
        )
    c_type = C_TYPES[q_dtype]
    shape = f"{c_type}, {head_dim}, {block_size}, {geo.chunk}"
    if geo.mma:
        stem = f"cupaged::paged_decode_mma<{shape}, {geo.bdy}, {geo.stages}"
    else:
        layout = f"{geo.bdx}, {geo.bdy}, {geo.bdz}, {geo.tokens_per_thread}, {geo.stages}"
        stem = f"cupaged::paged_decode<{shape}, {layout}"
    merge = f"cupaged::paged_decode_merge<{c_type}, {head_dim}"  # the output's type only
    variant &= ~(WINDOW | SINKS)
    kv = C_TYPES[dtype] if is_fp8(dtype) else None
    return DecodeLaunch(
        name=_decode_instantiation(stem, variant, kv),
        merge_name=_instantiation(merge, 0),
        grid=(num_kv_heads * geo.head_chunks, capacity),
        block=(geo.bdx, geo.bdy, geo.bdz),
        shared_mem=decode_shared_memory(dtype, head_dim, geo),
        tile=geo.tile,
        merge_block=(MERGE_THREADS,),
        geometry=geo,
        sinks_name=_decode_instantiation(stem, variant | SINKS, kv),
        sinks_merge_name=_instantiation(merge, SINKS),
    )


def _decode_instantiation(stem: str, variant: int, kv_c_type: str | None) -> str:
    """A decode kernel's name expression; over fp8 every template argument is spelled, the
    ``VARIANT`` and then the cache's element type ``KV`` (whose default is the query's)."""
    if kv_c_type is None:
        return _instantiation(stem, variant)
    return f"{stem}, {variant}, {kv_c_type}>"


def decode_may_split(
    capacity: int, num_seqs: int, min_chunk: int, tile: int, max_context: int | None
) -> bool:
    """Whether the decode planner (cuda/decode_plan.cu) can cut any sequence into several items.

    Its items hold ``chunk >= round_up(min_chunk, tile)`` tokens, so a step whose longest
    context (known on the host: ``max_context``) is at most that splits nothing, and one with no
    spare items (``capacity == num_seqs``) never does. ``max_context=None`` (unknown without a
    read-back): it may.

    >>> decode_may_split(40, 8, 256, 64, 256), decode_may_split(40, 8, 256, 64, 257)
    (False, True)
    """
    if capacity <= num_seqs:
        return False
    return max_context is None or max_context > cdiv(min_chunk, tile) * tile


def decode_ctas_per_sm(
    dtype: str, head_dim: int, group: int, block_size: int, *, q_dtype: str | None = None
) -> int:
    """Theoretical ``paged_decode`` thread blocks per multiprocessor of an H100, as the cubins
    of :data:`NOMINAL_TARGET`'s kernels give it.

    From the block's threads, the registers ptxas gives the instantiation for sm_90
    (``DECODE_REGISTERS``) and its shared memory, by the occupancy calculator's rules
    (:func:`ctas_per_sm`). The CPU backend plans its splits with it, as an H100 would; a GPU asks
    CUDA's occupancy calculator about the loaded kernel instead (``DecodePlan``). The table is
    of block size 16, where it equals the cubins (tests/test_kernel_report.py holds it against
    fresh ones); other block sizes change the address arithmetic (``pos / BLOCK_SIZE``) by -40
    to +16 registers, and the blocks per multiprocessor by up to two (sampled at block sizes 1,
    7, 32 and 256: 163 of 2,496 instantiations differ, by one but for two at block size 1).
    Only the work list's length depends on it, never a result. An fp8 cache without a row of
    its own in the table takes the row of its queries' type (``q_dtype``): the fp8 kernels keep
    the lane layout, and about the registers, of the 16-bit ones.

    >>> decode_ctas_per_sm("float16", 128, 1, 16), decode_ctas_per_sm("float16", 128, 8, 16)
    (8, 2)
    """
    check_decode_shape(dtype, head_dim, block_size)
    q_dtype = query_dtype(dtype, q_dtype)
    geo = decode_geometry(dtype, head_dim, group, q_dtype=q_dtype)
    row = DECODE_REGISTERS.get((dtype, head_dim)) or DECODE_REGISTERS[(q_dtype, head_dim)]
    registers = row[geo.chunk - 1]
    return max(1, ctas_per_sm(geo.threads, registers, decode_shared_memory(dtype, head_dim, geo)))


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
# Split-K aims for this many thread blocks per multiprocessor: as many as fit one (4, the launch
# bounds of cuda/paged_prefill.cu), since a block of 4 warps alone leaves an SM's issue slots idle
# while its loads are in flight. A heuristic, not a limit: any count gives the same result.
PREFILL_SPLIT_BLOCKS_PER_SM = 4
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z
MAX_GRID_X = 2**31 - 1
NO_SPLIT_PARTITION = 2**31 - 1  # partition_tokens of a launch without splits (one int32)


@dataclass(frozen=True, slots=True)
class PrefillLaunch:
    """How :func:`cupaged.paged_prefill` runs for one batch shape.

    Attributes:
        name: ``paged_prefill`` or ``paged_prefill_mma`` (tensor cores: fp16/bf16 up to
            head_dim 128) instantiation (a RawModule name expression).
        merge_name: ``paged_prefill_merge`` instantiation, used when ``num_splits > 1``.
        grid: ``(units * head_chunks * num_splits, num_kv_heads, 1)``, ``units`` the aligned
            tiles of the packed query rows plus one head tile per sequence.
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


def uses_prefill_mma(
    dtype: str, head_dim: int, target: Target = NOMINAL_TARGET, *, q_dtype: str | None = None
) -> bool:
    """Whether ``paged_prefill`` runs on tensor cores (``paged_prefill_mma``) for this shape and
    GPU: fp16/bf16 queries (over their own cache or fp8, converted to theirs in shared memory)
    up to head_dim 128 where the target has WMMA for the queries' dtype (bf16 from sm_80) and
    grants the kernel's shared memory (a T4's 64 KB hold it up to head_dim 96); elsewhere the
    CUDA-core kernel (float32 queries over fp8 too)."""
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
    units: int, kv_tokens: int, max_end: int, tile: int, sm_count: int, splits: int | None
) -> int:
    """Tokens per split of one query tile's KV range; ``max_end`` or more means no split.

    Split-K only when the thread blocks without it (``units``) do not cover the multiprocessors.
    It is balanced by tokens: every thread block reads at most ``partition`` tokens, the batch's
    KV tokens spread over ``PREFILL_SPLIT_BLOCKS_PER_SM`` blocks per multiprocessor, and no split
    is shorter than ``MIN_SPLIT_TOKENS`` (a split's fixed cost: its queries, its partial rows and
    their merge).
    ``splits`` forces a count (tests): the longest range is cut into about that many pieces.
    """
    longest = max(max_end, 1)
    if splits is not None:
        if splits < 1:
            raise ValueError(f"expected num_splits >= 1, got {splits}")
        per_split = cdiv(longest, splits)
    elif units >= sm_count or longest <= MIN_SPLIT_TOKENS:
        return cdiv(longest, tile) * tile
    else:
        per_split = max(MIN_SPLIT_TOKENS, cdiv(kv_tokens, sm_count * PREFILL_SPLIT_BLOCKS_PER_SM))
    return cdiv(per_split, tile) * tile


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
    variant: int = 0,
    window_left: int = -1,
    *,
    q_dtype: str | None = None,
) -> PrefillLaunch:
    """The launch of ``paged_prefill`` (and its merge) for one batch shape.

    ``dtype`` is the cache's element type; ``q_dtype`` the queries' and the output's
    (``query_dtype``: over fp8 float32, float16 or bfloat16, float16 when ``None``). An fp8
    instantiation spells both types (``VARIANT`` written even when 0, then the cache's).

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
        variant: the attention variants' ``VARIANT`` bits (``cupaged._variants``) without the
            sinks bit, which ``sinks_name`` / ``sinks_merge_name`` add.
        window_left: the window (with its bit in ``variant``): a tile's KV range, and so the
            split-K plan, starts at its first query's first key.
    """
    if sm_count is None:
        sm_count = target.sm_count
    check_decode_shape(dtype, head_dim, block_size)
    q_dtype = query_dtype(dtype, q_dtype)
    num_q_heads = num_kv_heads * group
    if num_seqs < 1:
        raise ValueError(f"expected num_seqs >= 1, got {num_seqs}")
    for what, value in (("num_kv_heads", num_kv_heads), ("num_q_heads", num_q_heads)):
        if not 1 <= value <= MAX_GRID_YZ:
            raise ValueError(f"expected {what} in 1..{MAX_GRID_YZ} (one launch), got {value}")
    tile = prefill_tile(dtype, head_dim)
    mma = uses_prefill_mma(dtype, head_dim, target, q_dtype=q_dtype)
    rows_per_block = PREFILL_MMA_ROWS if mma else PREFILL_ROWS
    heads = min(group, PREFILL_ROWS)
    chunks = cdiv(group, heads)
    query_rows = max(1, rows_per_block // heads)
    # Aligned tiles of the packed rows, then one head tile per sequence (cuda/paged_prefill.cu).
    rows = total_query_tokens if total_query_tokens else max_query_len * num_seqs
    tiles = max(1, cdiv(rows, query_rows) + num_seqs)
    num_splits, partition = 1, NO_SPLIT_PARTITION
    if query_start_loc is not None and context_lens is not None:
        work = prefill_work(query_start_loc, context_lens, query_rows, causal, window_left)
        units = work.query_tiles * num_kv_heads * chunks
        partition = prefill_partition(
            units, work.kv_tokens * num_kv_heads * chunks, work.max_end, tile, sm_count, splits
        )
        num_splits = max(1, cdiv(work.max_end, partition))
        if num_splits == 1:
            partition = NO_SPLIT_PARTITION
    if tiles * chunks * num_splits > MAX_GRID_X:
        raise ValueError(
            f"expected at most {MAX_GRID_X} thread blocks per KV head, got "
            f"{tiles * chunks * num_splits}"
        )
    c_type = C_TYPES[q_dtype]
    kernel = (
        f"cupaged::{'paged_prefill_mma' if mma else 'paged_prefill'}<{c_type}, {head_dim}, "
        f"{block_size}, {tile}, {rows_per_block}, {PREFILL_STAGES}, {PREFILL_THREADS}"
    )
    merge = f"cupaged::paged_prefill_merge<{c_type}, {head_dim}, {PREFILL_MERGE_THREADS}"
    variant &= ~SINKS
    # With split-K a sink joins in the merge, once per row; the merge reads only the window
    # (which splits a row takes) and the sinks.
    sinks_variant = variant | SINKS if num_splits == 1 else variant
    kv_type = C_TYPES[dtype] if is_fp8(dtype) else None
    return PrefillLaunch(
        name=_prefill_instantiation(kernel, variant, kv_type),
        merge_name=_instantiation(merge, variant & WINDOW),
        grid=(tiles * chunks * num_splits, num_kv_heads, 1),
        block=(PREFILL_THREADS,),
        shared_mem=_prefill_shared_memory(mma, dtype, head_dim, tile),
        query_rows=query_rows,
        heads_per_block=heads,
        tile=tile,
        num_splits=num_splits,
        partition_tokens=partition,
        merge_grid=(max(total_query_tokens, 1), num_q_heads),
        merge_block=(PREFILL_MERGE_THREADS,),
        sinks_name=_prefill_instantiation(kernel, sinks_variant, kv_type),
        sinks_merge_name=_instantiation(merge, variant & WINDOW | SINKS),
    )


def _prefill_instantiation(stem: str, variant: int, kv_type: str | None) -> str:
    """A prefill kernel's name expression: over fp8 both trailing template arguments (``VARIANT``,
    then the cache's type ``KV``, whose default is the queries' type), else ``_instantiation``."""
    return _instantiation(stem, variant) if kv_type is None else f"{stem}, {variant}, {kv_type}>"


def _instantiation(stem: str, variant: int) -> str:
    """A kernel's name expression: its ``VARIANT`` template argument (last, default 0) is
    written only when some variant is on, so that the plain kernels keep their names."""
    return f"{stem}, {variant}>" if variant else f"{stem}>"


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
    return name, (num_tokens,), (_whole_warps(vectors, WRITE_THREADS),)


def _whole_warps(items: int, most: int) -> int:
    """Threads for ``items`` parallel items: whole warps of 32, at least one, at most ``most``."""
    return min(most, max(32, cdiv(items, 32) * 32))


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
        threads = _whole_warps(block_bytes // word, COPY_THREADS)
    return f"cupaged::copy_blocks<{c_type}>", (num_pairs, num_layers, 2), (threads,), word


# The decode step's planner (cuda/decode_plan.cu): one thread block, one thread per run of
# sequences, up to kPlanMaxThreads.
PLAN_NAME = "cupaged::plan_decode"
PLAN_MAX_THREADS = 256  # kPlanMaxThreads in cuda/decode_plan.cu


def plan_threads(num_seqs: int, device: str = "cuda") -> int:
    """Threads of the decode planner for a batch: whole warps, at most ``PLAN_MAX_THREADS``, on
    both backends (``device`` is accepted for the callers that still pass it)."""
    return _whole_warps(num_seqs, PLAN_MAX_THREADS)


def decode_merge_block(launch: DecodeLaunch, device: str = "cuda") -> tuple[int]:
    """Threads of ``paged_decode_merge``: ``launch.merge_block``, on both backends (``device`` is
    accepted for the callers that still pass it)."""
    return launch.merge_block
