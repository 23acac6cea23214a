"""Decode's launches: the thread-block layout, shared memory, instantiation names and occupancy
of ``paged_decode`` / ``paged_decode_mma`` and their merge (cuda/paged_attention.cu), and the
decode planner's block (cuda/decode_plan.cu).

The launch table is three modules, one per kernel family, and callers import each name from the
one that defines it: this one, ``launch_prefill`` and ``launch_copies`` (``write_kv``,
``copy_blocks``). The shape check, the queries' element type, CUDA's grid limits, the
whole-warp rule and the name-expression rule live here because every attention launch starts
from them, prefill's too; so the other two import them from here, never the other way round.
What the table knows of the GPU is ``target``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._util import cdiv
from ..dtypes import C_TYPES, Q_DTYPE_NAMES, is_fp8, itemsize
from ..variants import NO_VARIANTS, SINKS, WINDOW, Variants
from .target import DECODE_REGISTERS, NOMINAL_TARGET, Target, ctas_per_sm

HEAD_DIMS = tuple(range(64, 257, 16))  # 64, 80, 96, ..., 256
MAX_BLOCK_SIZE = 256
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z
MAX_GRID_X = 2**31 - 1
# Split-K (decode's and prefill's): a split holds at least this many tokens, so that its fixed
# cost (loading the queries, writing a partial row and its log-sum-exp) stays small against the
# K/V it reads.
MIN_SPLIT_TOKENS = 256
# Batch-invariant decode (DecodePlan(batch_invariant=True), docs/batch-invariance.md): every
# sequence is cut into pieces of this many attended tokens (rounded up to the launch's tile),
# whatever the batch. MIN_SPLIT_TOKENS, the smallest piece the default split makes, so that no
# piece costs more in fixed work (its queries, its partial row and their merge) than the
# default's do: a lone sequence that the default cuts at its floor (up to this many tokens per
# item that fills the GPU) is cut alike, and a 4k context still gives 16 pieces per KV head.
# Larger batches pay more items and merge traffic than the default's (2 G / this of the K/V
# bytes: the docs' table).
INVARIANT_SPLIT_TOKENS = MIN_SPLIT_TOKENS


# paged_decode (cuda/paged_attention.cu): a ring of DECODE_STAGES shared-memory stages of K and V,
# each about DECODE_STAGE_BYTES of K (and as much of V), and thread blocks of about
# DECODE_TARGET_THREADS threads. The layout goes to the kernel as template arguments.
DECODE_STAGES = 3
DECODE_STAGE_BYTES = 4096
DECODE_TARGET_THREADS = 128
DECODE_MAX_TOKENS_PER_THREAD = 8  # TPZ: scores a thread keeps in registers per head and stage
# Above head_dim 128 and below 256, a lane of a wide group (16 elements, two heads) keeps at most
# this many tokens: ptxas holds the 8-token kernels at 128 registers on sm_90 and spills 8 bytes
# from head_dim 144 to 240 (fp16, G 16); 6 tokens fit in 127-128 with no spill on sm_80 and
# sm_90. head_dim 256 keeps 8 (128 registers, no spill; 6 would take 138 on sm_90).
DECODE_WIDE_HEAD_TOKENS = 6
DECODE_WIDE_LANE_GROUP = 4  # from this GQA group on, a lane owns 16 elements of a row, not 8
# paged_decode_merge: blocks of MERGE_THREADS threads (at most kMergeMaxThreads, its launch
# bounds: tests/kernels/test_decode_merge.py reads it), laid out by decode_merge_launch.
MERGE_THREADS = 128
MERGE_MAX_ROWS = 32  # items of a sequence one merge block adds at once (its rows)
# A split sequence's pieces are merged by the decode launch's last thread block (one launch a
# step) unless that block could read more than this many bytes of partial rows: it reads them
# from L2 alone, at one SM's share of L2's bandwidth (about 64-128 bytes a cycle: 1 MiB in 5-9
# us), where paged_decode_merge spreads them over many blocks. 1 x 32k at G 4, head_dim 128
# (67 pieces at most, 137 KB) fuses; one KV head of G 16 cut into 128 pieces (1 MiB) does not.
# Not measured: the next GPU run times both (issue 37).
FUSED_MERGE_MAX_BYTES = 256 * 1024
# Query heads of one decode thread block: a larger GQA group is cut into chunks of at most this
# many (DecodeChunk in cuda/common.cuh), so that a thread's q rows and accumulators stay in
# registers (a group of 48 in one block took 255 registers and spilled 596 bytes; of 128, 25 KB).
DECODE_MAX_CHUNK = 16
# The tensor-core path (paged_decode_mma): fp16/bf16 chunks of decode_mma_min_group(target) to
# 16 query heads, the rows of WMMA m16n16k16 products, where the CUDA-core loop is issue-bound
# (the issue model of scripts/kernel-report: docs/kernels.md, "Tensor cores"). DECODE_MMA_WARPS
# warps per block, a stage of 16 tokens per warp, DECODE_MMA_STAGES stages (a 64-token stage is
# 4x the CUDA-core path's). Up to head_dim 128: above it a warp's accumulators and q fragments outgrow
# the registers (with 2 warps: 168-255 registers and spills at 192 and 256; with 4, stages of
# 150 KB at 256, one block per SM), so those head_dims keep the CUDA-core kernel.
#
# DECODE_MMA_MIN_GROUP: the smallest group on tensor cores, by compute capability (the nearest
# listed at or below the target's). On an H200 (18 bytes of DRAM per SM cycle) the CUDA-core
# loop's modelled issue time at head_dim 128 is 0.7x (G = 2) and 1.0x (G = 4) its DRAM time, and
# the MMA kernel forced there measured 92 % of copy bandwidth at G = 2 and 4 against 81 % and
# 73 % on CUDA cores (docs/kernels.md, "Tensor cores"); a single head (15 of the 16 MMA rows
# wasted) is faster on CUDA cores (94-97 % against 85-90 %). The A100 (10-13 bytes per SM cycle)
# fits two blocks of the MMA ring per SM, as an H100 does. V100, T4 and the 8.6/8.9 GPUs (A10, L4, L40,
# RTX: 2-7 bytes per SM cycle) leave the CUDA-core loop further under its DRAM time and grant the
# MMA ring one block per SM at head_dim 128: nothing measured there, they keep G >= 8.
DECODE_MMA_MIN_GROUP = {70: 8, 80: 2, 86: 8, 90: 2}
DECODE_MMA_MAX_HEAD_DIM = 128
DECODE_MMA_WARPS = 4
DECODE_MMA_STAGES = 2
DECODE_MMA_DTYPES = ("float16", "bfloat16")

# The decode step's planner (cuda/decode_plan.cu): one thread block, one thread per run of
# sequences, up to PLAN_MAX_THREADS (its launch bounds, kPlanMaxThreads: tests/kernels/test_kernel_args.py
# reads it from the source).
PLAN_NAME = "cupaged::plan_decode"
PLAN_MAX_THREADS = 256


def whole_warps(items: int, most: int) -> int:
    """Threads for ``items`` parallel items: whole warps of 32, at least one, at most ``most``."""
    return min(most, max(32, cdiv(items, 32) * 32))


def plan_threads(num_seqs: int) -> int:
    """Threads of the decode planner for a batch: whole warps, at most ``PLAN_MAX_THREADS``, on
    both backends."""
    return whole_warps(num_seqs, PLAN_MAX_THREADS)


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
    :func:`decode_mma_min_group` heads or more up to head_dim 128, where the target has WMMA for the
    query's type (bf16 from sm_80) and grants the kernel's shared memory (a T4's 64 KB do not
    hold head_dim 128's stages); elsewhere the CUDA-core kernel, which fits all. Over fp8 the
    same rule: the kernel loads its fragments from the staged fp8 rows and converts them in
    registers (a ring of half the 16-bit one's bytes; docs/kernels.md).
    """
    q_dtype = query_dtype(dtype, q_dtype)
    if not (
        q_dtype in DECODE_MMA_DTYPES
        and group >= decode_mma_min_group(target)
        and head_dim <= DECODE_MMA_MAX_HEAD_DIM
        and target.has_wmma(q_dtype)
    ):
        return False
    return target.fits(decode_shared_memory(dtype, head_dim, _decode_mma_geometry(group)))


def decode_mma_min_group(target: Target = NOMINAL_TARGET) -> int:
    """The smallest GQA group that decodes on tensor cores on ``target`` (where its dtype,
    head_dim and shared memory allow: :func:`uses_decode_mma`): ``DECODE_MMA_MIN_GROUP`` of the
    nearest compute capability listed at or below the target's.

    >>> [decode_mma_min_group(Target.of_arch(a)) for a in (75, 80, 86, 89, 90)]
    [8, 2, 8, 8, 2]
    """
    return DECODE_MMA_MIN_GROUP[max(a for a in DECODE_MMA_MIN_GROUP if a <= target.arch)]


def _decode_mma_geometry(group: int) -> DecodeGeometry:
    """``paged_decode_mma``'s layout: every chunk is the 16 rows of the MMA (padded), so one
    instantiation, ``CHUNK = 16``, serves every group that takes the tensor cores."""
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
        merge_block: ``(MERGE_THREADS,)``, the threads of a ``paged_decode_merge`` block; its
            layout over a work list, grid and block: :func:`decode_merge_launch` (the kernel
            also takes this block over the grid ``(num_q_heads, num_seqs)``, one block a row).
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


def check_block_elements(num_kv_heads: int, block_size: int, head_dim: int) -> None:
    """Raise ``ValueError`` when one block of a layer holds 2^32 elements or more: the K/V
    rings compute a block's offset as a 32 x 32 -> 64-bit product of a 32-bit stride."""
    if num_kv_heads * block_size * head_dim >= 2**32:
        raise ValueError(
            f"expected num_kv_heads * block_size * head_dim < 2**32 (the elements of one block), "
            f"got {num_kv_heads} * {block_size} * {head_dim}"
        )


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
      ``DECODE_MAX_TOKENS_PER_THREAD`` per thread (``DECODE_WIDE_HEAD_TOKENS`` for wide lanes
      at head_dim 144-240, where 8 spill on sm_90).

    fp16/bf16 queries in groups of :func:`decode_mma_min_group` or more (2 on sm_80/sm_90, 8
    elsewhere) up to head_dim 128 where the target has the tensor cores and the shared memory
    for them (``uses_decode_mma``; ``q_dtype``: the queries' type
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
    most = DECODE_MAX_TOKENS_PER_THREAD
    if 128 < head_dim < 256 and chunk >= DECODE_WIDE_LANE_GROUP:
        most = DECODE_WIDE_HEAD_TOKENS
    tokens = min(most, max(1, tile_target // bdz))
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
        ring_row, q_row = ldk, ldk
        if is_fp8(dtype):  # fp8 rows padded to an odd number of 16 bytes; q_s in whole pairs
            ring_row = head_dim + (32 if head_dim // 16 % 2 else 16)
            q_row = 32 * cdiv(head_dim, 32) + 8
        return (
            2 * geometry.stages * tile * ring_row * itemsize(dtype)
            + 16 * q_row * 2
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
    variants: Variants = NO_VARIANTS,
    *,
    q_dtype: str | None = None,
) -> DecodeLaunch:
    """The launch of ``paged_decode`` (and its merge) over a work list of ``capacity`` items, on
    ``target`` (the kernel that compiles and fits there).

    Nothing here depends on the context lengths: the work list carries them. ``variants``: the
    plan's attention variants (``cupaged.variants``), whose ``VARIANT`` bits name the kernels;
    the window's and the sinks' are not the kernel's (the planner's work list holds the
    window, ``sinks_name`` adds the sinks), so a window alone runs the plain kernels.
    ``dtype`` is the cache's element type, ``q_dtype`` the queries' (and the output's) over an
    fp8 cache (:func:`query_dtype`): the kernels are instantiated for both (``T`` the query's,
    the last argument ``KV`` the cache's, spelled only for fp8, so that the 16/32-bit names stay
    as they were).
    """
    check_decode_shape(dtype, head_dim, block_size)
    q_dtype = query_dtype(dtype, q_dtype)
    if not 1 <= capacity <= MAX_GRID_YZ:
        raise ValueError(f"expected a work list of 1..{MAX_GRID_YZ} items, got {capacity}")
    check_block_elements(num_kv_heads, block_size, head_dim)
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
    variant = variants.flags() & ~(WINDOW | SINKS)
    kv = C_TYPES[dtype] if is_fp8(dtype) else None
    return DecodeLaunch(
        name=_decode_instantiation(stem, variant, kv),
        merge_name=instantiation(merge, 0),
        grid=(num_kv_heads * geo.head_chunks, capacity),
        block=(geo.bdx, geo.bdy, geo.bdz),
        shared_mem=decode_shared_memory(dtype, head_dim, geo),
        tile=geo.tile,
        merge_block=(MERGE_THREADS,),
        geometry=geo,
        sinks_name=_decode_instantiation(stem, variant | SINKS, kv),
        sinks_merge_name=instantiation(merge, SINKS),
    )


def fuses_merge(pieces: int, chunk: int, head_dim: int) -> bool:
    """Whether a plan whose sequences are cut into at most ``pieces`` items each merges them
    in the decode launch (its last block, over the ``chunk`` query heads it computed) rather
    than in ``paged_decode_merge``: ``FUSED_MERGE_MAX_BYTES`` of float32 partial rows at most.

    >>> fuses_merge(67, 4, 128), fuses_merge(128, 16, 128)
    (True, False)
    """
    return pieces * chunk * head_dim * 4 <= FUSED_MERGE_MAX_BYTES


def decode_merge_launch(
    head_dim: int, num_q_heads: int, num_rows: int, capacity: int, *, fixed: bool = False
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(grid, block)`` of ``paged_decode_merge`` over ``num_rows`` output rows (sequences, or
    a cascade's rows) whose pieces fill a work list of ``capacity`` items.

    A block of ``MERGE_THREADS`` threads is ``rows`` items at once (the pieces a row has on
    average, ``capacity / num_rows``, rounded up to a power of two, at most
    ``MERGE_MAX_ROWS``) by ``lanes`` 4-float vectors of a head's row; the head's row is cut
    into ``slices`` of ``lanes`` vectors, each a block: a lone long sequence's merge is then
    as many blocks as its heads x slices, each thread adding a few items, not one block per
    head looping over every item. The pieces come from the device's planner, so the layout
    holds for any count: a row of more pieces than ``rows`` loops over them.

    A row's sums run in an order the block's ``rows`` fix (each row's items in turn, then the
    tree). ``fixed`` (batch-invariant plans): ``MERGE_MAX_ROWS`` rows whatever the work list,
    so that a sequence's bits depend on its own pieces alone.

    >>> decode_merge_launch(128, 32, 1, 67)  # 1 x 32k: 256 blocks, 2 items per thread
    ((256, 1), (4, 32))
    >>> decode_merge_launch(128, 32, 64, 130)  # 64 sequences of ~2 pieces: 1 slice
    ((32, 64), (32, 4))
    >>> decode_merge_launch(64, 8, 4, 4)  # 1 piece each: a row is 16 lanes, 8 rows
    ((8, 4), (16, 8))
    """
    vectors = head_dim // 4
    pieces = cdiv(max(capacity, 1), max(num_rows, 1))
    rows = MERGE_MAX_ROWS if fixed else min(MERGE_MAX_ROWS, _next_power_of_two(pieces))
    lanes = min(MERGE_THREADS // rows, _next_power_of_two(vectors))
    rows = MERGE_THREADS // lanes
    slices = cdiv(vectors, lanes)
    return (num_q_heads * slices, num_rows), (lanes, rows)


def _decode_instantiation(stem: str, variant: int, kv_c_type: str | None) -> str:
    """A decode kernel's name expression; over fp8 every template argument is spelled, the
    ``VARIANT`` and then the cache's element type ``KV`` (whose default is the query's)."""
    if kv_c_type is None:
        return instantiation(stem, variant)
    return f"{stem}, {variant}, {kv_c_type}>"


def instantiation(stem: str, variant: int) -> str:
    """A kernel's name expression: its ``VARIANT`` template argument (last, default 0) is
    written only when some variant is on, so that the plain kernels keep their names."""
    return f"{stem}, {variant}>" if variant else f"{stem}>"


def invariant_work(num_seqs: int, longest: int, tile: int) -> tuple[int, int]:
    """The work list of a batch-invariant decode plan: ``(capacity, chunk)``.

    ``chunk`` is ``INVARIANT_SPLIT_TOKENS`` rounded up to the launch's ``tile``, the same for
    every batch of a shape. ``longest`` bounds every sequence's attended tokens (the table's
    width, window-capped), so ``capacity - num_seqs = num_seqs * ceil(longest / chunk)`` is at
    least ``ceil(total / chunk)`` for any lengths the table holds, and the planner's chunk
    (cuda/decode_plan.cu: ``round_up(max(min_chunk, ceil(total / (capacity - num_seqs))),
    tile)``) is then exactly ``chunk``: a sequence's pieces depend on its own length alone.
    At least one item, so that an empty plan has a valid launch.

    >>> invariant_work(4, 1000, 64), invariant_work(4, 1000, 24), invariant_work(3, 0, 64)
    ((20, 256), (20, 264), (3, 256))
    """
    chunk = cdiv(INVARIANT_SPLIT_TOKENS, tile) * tile
    return max(1, num_seqs * (1 + cdiv(max(longest, 0), chunk))), chunk


def decode_ctas_per_sm(
    dtype: str, head_dim: int, group: int, block_size: int, *, q_dtype: str | None = None
) -> int:
    """Theoretical ``paged_decode`` thread blocks per multiprocessor of an H100, as the cubins
    of :data:`NOMINAL_TARGET`'s kernels give it.

    From the block's threads, the registers ptxas gives the instantiation for sm_90
    (``DECODE_REGISTERS``) and its shared memory, by the occupancy calculator's rules
    (:func:`ctas_per_sm`). The CPU backend plans its splits with it, as an H100 would; a GPU asks
    CUDA's occupancy calculator about the loaded kernel instead (``DecodePlan``). The table is
    of block size 16, where it equals the cubins (tests/kernels/test_kernel_report.py holds it against
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
