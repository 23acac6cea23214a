"""Cascade's launch: the thread-block layout, shared memory and instantiation name of
``cascade_shared`` (cuda/cascade.cu, tensor cores: fp16/bf16 queries) or, over a float32 cache,
``cascade_shared_cores`` (CUDA cores), the shared level of cascade decode attention.

The suffix level and the merge are decode's own launches (``launch_decode``). A tile of the
shared level is up to ``rows_per_tile`` query rows (a group's rows x its GQA heads, flattened)
over one token range that their block tables share; the planner cuts a group of ``n`` rows of
``G`` heads into ``ceil(n * G / rows_per_tile)`` tiles, each of which reads the shared K/V once,
so the larger ``rows_per_tile``, the fewer bytes::

    rows of a group (n = 3 sequences, G = 4 heads)   tiles of rows_per_tile = 8
    seq a: a0 a1 a2 a3 | seq b: b0 b1 b2 b3 | seq c: c0 c1 c2 c3
    [ tile 0: a0 .. b3 (8 rows)            ] [ tile 1: c0 .. c3 (4 rows, 4 zero) ]
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import C_TYPES, is_fp8, itemsize
from ..variants import NO_VARIANTS, SINKS, Variants
from .launch_decode import check_block_elements, check_decode_shape, query_dtype
from .target import NOMINAL_TARGET, Target

# The tensor-core layout: CASCADE_WARPS warps of 32 threads, a stage of 16 tokens per warp,
# CASCADE_STAGES stages in the cp.async ring (as paged_decode_mma). The rows of a tile: at most
# 64 up to head_dim 128, where the block's K/V ring, q rows and scores (108 KiB at head_dim 128,
# fp16) let two blocks share an H100's multiprocessor and a lane keeps 64 accumulators; at most
# 32 above, where 64 rows' accumulators (128 per lane) would outgrow the registers. Fewer (16 or
# 32) where no group of the step has more rows: a tile's shared-memory and tensor-core work
# grows with its rows, zero rows included, while its K/V bytes do not.
CASCADE_WARPS = 4
CASCADE_STAGES = 2
CASCADE_ROWS = 64
CASCADE_WIDE_ROWS = 32  # head_dim above CASCADE_ROWS_MAX_HEAD_DIM
CASCADE_ROWS_MAX_HEAD_DIM = 128
CASCADE_SMALL_ROWS = (16, 32)  # the smaller tiles, for steps whose groups fit them
CASCADE_Q_DTYPES = ("float16", "bfloat16")  # the WMMA operand types
CASCADE_CACHE_DTYPES = ("float16", "bfloat16", "float8_e4m3", "float8_e5m2", "float32")
CASCADE_NAME = "cupaged::cascade_shared"
# The CUDA-core kernel (float32 queries over a float32 cache): CORES_WARPS warps, a stage of 32
# tokens (one per lane), each warp owning ROWS / CORES_WARPS rows in registers. At most 32 rows:
# a lane holds 4 * ceil(head_dim / 128) accumulators per row (64 at 32 rows of 256), and the
# block's ring, q rows and P (87 KiB at head_dim 128) let two blocks share an H100's
# multiprocessor; 16 where no group of the step has more rows, or where a GPU's shared memory
# takes no more (an A100 at head_dim 256).
CORES_NAME = "cupaged::cascade_shared_cores"
CORES_WARPS = 4
CORES_STAGES = 2
CORES_TILE = 32
CORES_ROWS = 32
CORES_SMALL_ROWS = (16,)


@dataclass(frozen=True, slots=True)
class CascadeLaunch:
    """How ``cascade_shared`` (or, over float32, ``cascade_shared_cores``) runs for one shape.

    Attributes:
        name: the instantiation (a RawModule name expression), every template argument spelled:
            ``cupaged::cascade_shared<T, HEAD_DIM, BLOCK_SIZE, ROWS, WARPS, STAGES, VARIANT, KV>``
            (``cascade_shared_cores<...>`` the same).
        block: ``(32, warps, 1)``; the grid is ``(num_kv_heads, num_tiles)``.
        shared_mem: dynamic shared memory in bytes (``CascadeLayout::kBytes``, or
            ``CascadeCoresLayout::kBytes``).
        rows_per_tile: the most query rows a tile may hold (``ROWS``, a multiple of 16).
        tile: tokens per pipeline stage (a tile's range may start and end anywhere).
        warps: warps per thread block.
        stages: stages of the ``cp.async`` ring.
    """

    name: str
    block: tuple[int, int, int]
    shared_mem: int
    rows_per_tile: int
    tile: int
    warps: int
    stages: int


def check_cascade_shape(dtype: str, q_dtype: str, head_dim: int, block_size: int) -> None:
    """Raise ``ValueError`` naming what the cascade kernels support when they cannot take this
    shape: fp16/bf16 queries (the tensor cores' operands) over fp16, bf16 or fp8 caches, or
    float32 queries over a float32 cache (CUDA cores); a 16/32-bit cache of the queries' own
    type, head_dim 64..256 in multiples of 16, block sizes 1..256."""
    if dtype == "float32" or q_dtype == "float32":
        if (dtype, q_dtype) != ("float32", "float32"):
            raise ValueError(
                f"expected float32 queries over a float32 cache (CUDA cores) or queries of one "
                f"of {CASCADE_Q_DTYPES} over a cache of the same type or fp8 (tensor cores) for "
                f"the cascade kernel, got {q_dtype} queries over a {dtype} cache"
            )
    elif q_dtype not in CASCADE_Q_DTYPES:
        raise ValueError(
            f"expected queries of one of {CASCADE_Q_DTYPES} for the cascade kernel (tensor "
            f"cores), or float32 over a float32 cache, got {q_dtype}"
        )
    if dtype not in CASCADE_CACHE_DTYPES:
        raise ValueError(f"expected a cache of one of {CASCADE_CACHE_DTYPES}, got {dtype}")
    if not is_fp8(dtype) and dtype != q_dtype:
        raise ValueError(f"expected queries of the cache's type {dtype}, got {q_dtype}")
    check_decode_shape(dtype, head_dim, block_size)  # head_dim and block_size: decode's


def cascade_rows(head_dim: int, rows: int | None = None, *, cores: bool = False) -> int:
    """Query rows per tile (``ROWS``) at ``head_dim``: the most the registers allow, or, for a
    step whose groups have at most ``rows`` query rows each, the smallest tile that holds one
    (the same number of tiles, so the same K/V bytes, with less work per tile). ``cores``: the
    CUDA-core kernel's (float32), 32 or 16.

    >>> cascade_rows(128), cascade_rows(128, 32), cascade_rows(128, 33), cascade_rows(256, 64)
    (64, 32, 64, 32)
    >>> cascade_rows(256, cores=True), cascade_rows(64, 16, cores=True)
    (32, 16)
    """
    if cores:
        most, small = CORES_ROWS, CORES_SMALL_ROWS
    else:
        wide = head_dim > CASCADE_ROWS_MAX_HEAD_DIM
        most, small = CASCADE_WIDE_ROWS if wide else CASCADE_ROWS, CASCADE_SMALL_ROWS
    if rows is None:
        return most
    if rows < 1:
        raise ValueError(f"expected a group of at least 1 query row, got {rows}")
    return next((r for r in small if rows <= r < most), most)


def cascade_shared_memory(dtype: str, head_dim: int, rows: int, warps: int, stages: int) -> int:
    """Bytes of dynamic shared memory of ``cascade_shared`` (``CascadeLayout::kBytes`` in
    cuda/cascade.cu): the K/V ring (over fp8 of unpadded fp8 rows, and one stage converted to
    the queries' type), the q rows, the scores (P overwrites them), the warps' O tiles, and two
    floats per row."""
    tile, ldk = 16 * warps, head_dim + 8
    ring_row, converted = (head_dim, 2 * tile * ldk * 2) if is_fp8(dtype) else (ldk, 0)
    return (
        2 * stages * tile * ring_row * itemsize(dtype)
        + converted
        + rows * ldk * 2
        + rows * (tile + 4) * 4
        + warps * 16 * 20 * 4
        + 2 * rows * 4
    )


def cascade_cores_shared_memory(head_dim: int, rows: int, stages: int) -> int:
    """Bytes of dynamic shared memory of ``cascade_shared_cores`` (``CascadeCoresLayout::kBytes``
    in cuda/cascade.cu): the K/V ring of float rows padded by 4, the q rows, and P."""
    ldk = head_dim + 4
    return 4 * (2 * stages * CORES_TILE * ldk + rows * ldk + rows * CORES_TILE)


def cascade_launch(
    dtype: str,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    gpu: Target = NOMINAL_TARGET,
    variants: Variants = NO_VARIANTS,
    *,
    q_dtype: str | None = None,
    rows: int | None = None,
) -> CascadeLaunch:
    """The launch of ``cascade_shared`` over a ``dtype`` cache on ``gpu``, or of
    ``cascade_shared_cores`` over a float32 one (float32 queries; any GPU with the shared memory).

    ``q_dtype``: the queries' type over an fp8 cache (:func:`~.launch_decode.query_dtype`,
    float16 when ``None``). ``variants``: the plan's (``cupaged.variants``); their ``VARIANT``
    bits name the kernel as decode's do, the window's included (this kernel masks each row's
    window itself: the rows of a tile have different positions), the sinks' never (the merge
    adds a sink once per row). ``rows``: the most query rows (members x ``group``) of one group
    of the step, when known: a step of small groups takes smaller tiles (:func:`cascade_rows`);
    ``None``: the largest. ``group`` and ``num_kv_heads`` change no template argument otherwise;
    they are checked against the kernel's limits.

    Raises:
        ValueError: a shape the kernel does not take (:func:`check_cascade_shape`), or a GPU
            without the tensor cores or shared memory for it.
    """
    q_dtype = query_dtype(dtype) if q_dtype is None else q_dtype
    check_cascade_shape(dtype, q_dtype, head_dim, block_size)
    if group < 1 or num_kv_heads < 1:
        raise ValueError(
            f"expected at least one KV head and one query head per KV head, got "
            f"{num_kv_heads} and {group}"
        )
    check_block_elements(num_kv_heads, block_size, head_dim)
    variant = variants.flags() & ~SINKS
    if dtype == "float32":
        return _cores_launch(head_dim, block_size, gpu, variant, rows)
    tile_rows, warps, stages = cascade_rows(head_dim, rows), CASCADE_WARPS, CASCADE_STAGES
    shared_mem = cascade_shared_memory(dtype, head_dim, tile_rows, warps, stages)
    if not gpu.has_wmma(q_dtype) or not gpu.fits(shared_mem):
        raise ValueError(
            f"expected a GPU with {q_dtype} tensor cores and {shared_mem} bytes of shared memory "
            f"per block for the cascade kernel, got sm_{gpu.arch} with {gpu.shared_memory}"
        )
    kv = C_TYPES[dtype]
    shape = f"{C_TYPES[q_dtype]}, {head_dim}, {block_size}, {tile_rows}, {warps}, {stages}"
    return CascadeLaunch(
        name=f"{CASCADE_NAME}<{shape}, {variant}, {kv}>",
        block=(32, warps, 1),
        shared_mem=shared_mem,
        rows_per_tile=tile_rows,
        tile=16 * warps,
        warps=warps,
        stages=stages,
    )


def _cores_launch(
    head_dim: int, block_size: int, gpu: Target, variant: int, rows: int | None
) -> CascadeLaunch:
    """``cascade_shared_cores``'s launch (float32), the shape checked."""
    tile_rows, warps, stages = cascade_rows(head_dim, rows, cores=True), CORES_WARPS, CORES_STAGES
    shared_mem = cascade_cores_shared_memory(head_dim, tile_rows, stages)
    if not gpu.fits(shared_mem):  # an A100 at head_dim 256: the smaller tile, more of them
        tile_rows = CORES_SMALL_ROWS[0]
        shared_mem = cascade_cores_shared_memory(head_dim, tile_rows, stages)
    if not gpu.fits(shared_mem):
        raise ValueError(
            f"expected a GPU with {shared_mem} bytes of shared memory per block for the cascade "
            f"kernel, got sm_{gpu.arch} with {gpu.shared_memory}"
        )
    shape = f"float, {head_dim}, {block_size}, {tile_rows}, {warps}, {stages}"
    return CascadeLaunch(
        name=f"{CORES_NAME}<{shape}, {variant}, float>",
        block=(32, warps, 1),
        shared_mem=shared_mem,
        rows_per_tile=tile_rows,
        tile=CORES_TILE,
        warps=warps,
        stages=stages,
    )
