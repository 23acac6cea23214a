"""The instantiations the report compiles: what the launch tables pick on each architecture.

Architectures are named as NVRTC names them (``sm_90``); their limits and the GPUs built on them
are ``cupaged/kernels/target.py``'s (``SM_LIMITS``, ``GPUS``), the one table of them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from cupaged._util import cdiv
from cupaged.dtypes import FP8_NAMES, Q_DTYPE_NAMES, itemsize
from cupaged.kernels import launch_cascade, launch_copies, launch_decode, launch_prefill
from cupaged.kernels import target as _gpu_target

# The architectures of the GPUs the kernels are tuned for (T4, A100, H100/H200). sm_70 (V100) is
# not among them: the nvdisasm of CUDA 13 refuses its cubins.
ARCHS = tuple(sorted({f"sm_{gpu.arch}" for gpu in _gpu_target.GPUS.values()}))
GPU_NAMES = tuple(_gpu_target.GPUS)


def arch_of(gpu: str) -> str:
    """``gpu``'s architecture as NVRTC names it: ``"H100"`` -> ``"sm_90"``."""
    return f"sm_{_gpu_target.GPUS[gpu].arch}"


def sm_limits(arch: str) -> _gpu_target.SmLimits:
    """The published per-SM limits of ``arch`` (``"sm_90"``)."""
    return _gpu_target.SM_LIMITS[int(arch.removeprefix("sm_"))]


# The cache's element type of each row (an fp8 row's queries are float16). fp8 rows are on
# request (--dtype float8_e4m3,...): their instruction counts, spills and DRAM bytes are
# reported as for any row; the shared-memory bank models are written for 16/32-bit tiles and
# are not applied to them.
DTYPES = (*Q_DTYPE_NAMES, *FP8_NAMES)
DEFAULT_DTYPES = Q_DTYPE_NAMES
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)  # the page sizes of the goal (DESIGN.md §7)
GROUPS = (1, 4, 8, 16)
# --group takes up to this many query heads per KV head (Falcon-7B's 71, 128 for multi-query
# attention over 128 heads): the launch table cuts a group of more than 16 into chunks.
MAX_GROUP = 128
SOURCES = {
    "paged_decode": "paged_attention.cu",
    "paged_decode_merge": "paged_attention.cu",
    "paged_prefill": "paged_prefill.cu",
    "paged_prefill_merge": "paged_prefill.cu",
    "cascade_shared": "cascade.cu",
    "write_kv": "write_kv.cu",
    "copy_blocks": "copy_blocks.cu",
}


@dataclass(frozen=True, slots=True)
class Launch:
    """One row's instantiation and launch: what the launch table gives for it."""

    kernel: str  # a key of SOURCES
    name: str  # the name expression
    dtype: str  # "" where the kernel has none (copy_blocks)
    head_dim: int  # 0 where the kernel is not specialised on it
    threads: int
    block_size: int = 0  # 0 where the kernel is not specialised on it, as group
    group: int = 0
    dynamic_smem: int = 0
    tile: int = 0  # K/V tokens per shared-memory tile (decode, prefill), else 0
    note: str = ""
    chunk: int = 0  # query heads per thread block (decode, prefill), else 0
    head_chunks: int = 1  # thread blocks per KV head that share each K/V tile


def kv_tile_bytes(launch: Launch) -> int:
    """The bytes of K and V in one of ``launch``'s tiles, at the cache's element size."""
    return 2 * launch.tile * launch.head_dim * itemsize(launch.dtype)


def target_of(arch: str) -> _gpu_target.Target:
    """The launch tables' target for ``arch`` (``"sm_90"``): its published limits."""
    return _gpu_target.Target.of_arch(int(arch.removeprefix("sm_")))


def _note(*parts: str) -> str:
    return ", ".join(part for part in parts if part)


def _chunks_note(chunk: int, head_chunks: int) -> str:
    return f"{chunk}-head chunks x {head_chunks}" if head_chunks > 1 else ""


def _cascade_launches(
    dtype: str, head_dim: int, block_size: int, target: _gpu_target.Target
) -> list[Launch]:
    """``cascade_shared`` at its largest tile and at 32 rows (a group of 8 sequences of GQA 4),
    where the launch table has it (fp16/bf16 queries, fp8 caches under float16; a GPU with the
    tensor cores and the shared memory); over float32, ``cascade_shared_cores`` at 32 and 16
    rows (CUDA cores)."""
    out = []
    for rows in (None, 32) if dtype != "float32" else (None, 16):
        try:
            c = launch_cascade.cascade_launch(dtype, 1, 1, head_dim, block_size, target, rows=rows)
        except ValueError:  # a GPU without what it needs
            return []
        cores = "CUDA cores" if dtype == "float32" else "tensor cores"
        note = f"{c.rows_per_tile} query rows, {cores}"
        launch = Launch(
            "cascade_shared",
            c.name,
            dtype,
            head_dim,
            32 * c.warps,
            block_size=block_size,
            note=note,
            dynamic_smem=c.shared_mem,
            tile=c.tile,
            chunk=c.rows_per_tile,
        )
        if launch not in out:
            out.append(launch)
    return out


def launches(args: argparse.Namespace, arch: str) -> list[Launch]:
    """Every launch the filters select, as the launch table plans them for ``arch``: the kernel
    that compiles and fits there (bf16 below sm_80 and what outgrows a T4's shared memory take
    the CUDA-core kernels), and the chunks a large GQA group is cut into."""
    target = target_of(arch)
    out: list[Launch] = []
    for dtype in args.dtypes:
        for head_dim in args.head_dims:
            for block_size in args.block_sizes:
                for group in args.groups:
                    d = launch_decode.decode_launch(
                        dtype, 1, group, head_dim, block_size, 1, target=target
                    )
                    geo = d.geometry
                    note = _note(
                        "tensor cores" if geo.mma else "", _chunks_note(geo.chunk, geo.head_chunks)
                    )
                    out.append(
                        Launch(
                            "paged_decode",
                            d.name,
                            dtype,
                            head_dim,
                            geo.threads,
                            block_size=block_size,
                            group=group,
                            note=note,
                            dynamic_smem=d.shared_mem,
                            tile=d.tile,
                            chunk=geo.chunk,
                            head_chunks=geo.head_chunks,
                        )
                    )
                    p = launch_prefill.prefill_launch(
                        dtype, 1, 1, group, head_dim, block_size, 64, target=target
                    )
                    chunks = cdiv(group, p.heads_per_block)
                    note = _note(
                        f"{p.query_rows} query rows", _chunks_note(p.heads_per_block, chunks)
                    )
                    out.append(
                        Launch(
                            "paged_prefill",
                            p.name,
                            dtype,
                            head_dim,
                            p.block[0],
                            block_size=block_size,
                            group=group,
                            note=note,
                            dynamic_smem=p.shared_mem,
                            tile=p.tile,
                            chunk=p.heads_per_block,
                            head_chunks=chunks,
                        )
                    )
                out += _cascade_launches(dtype, head_dim, block_size, target)
            d = launch_decode.decode_launch(dtype, 1, 1, head_dim, 16, 1, target=target)
            out.append(
                Launch("paged_decode_merge", d.merge_name, dtype, head_dim, d.merge_block[0])
            )
            p = launch_prefill.prefill_launch(dtype, 1, 1, 1, head_dim, 16, 64, target=target)
            out.append(
                Launch("paged_prefill_merge", p.merge_name, dtype, head_dim, p.merge_block[0])
            )
        for slot in (np.int32, np.int64):
            for aligned in (True, False):
                # 8 KV heads of 128 elements: whole warps of the widest vector the row allows.
                name, _, block = launch_copies.write_kv_launch(
                    dtype, np.dtype(slot), 1, 128 * itemsize(dtype), aligned, 8
                )
                note = "aligned" if aligned else "unaligned"
                out.append(Launch("write_kv", name, dtype, 0, block[0], note=note))
    for block_bytes, aligned in ((16 * 8 * 128 * 2, True), (12, True), (6, True)):
        name, _, block, word = launch_copies.copy_blocks_launch(block_bytes, aligned, 1, 1)
        out.append(Launch("copy_blocks", name, "", 0, block[0], note=f"{word}-byte words"))
    return [launch for launch in out if launch.kernel in args.kernels]
