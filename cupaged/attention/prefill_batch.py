"""What a :class:`~cupaged.PrefillPlan` keeps from batch to batch of its shape, and decides per
batch on the host: :class:`PrefillShape` (what it fixed when made), :func:`host_plan` (the host
checks of a batch's metadata and its launch), :class:`PrefillBuffers` (its own device copies
and split-K scratch) and :func:`new_record` (the kernel's argument record over them).

The one-shot :func:`cupaged.paged_prefill` re-plans a kept plan at every call
(``prefill.replan``), so this is its per-call host path: no allocation once the buffers exist,
one upload of the metadata, one copy of the tables.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .._arrays.checks import INT32_MAX, MAX_CONTEXT_LEN, check_query_start_loc, table_limit
from ..kernels.args import PrefillArgs
from ..kernels.launch_prefill import PrefillLaunch, prefill_launch
from ..kernels.target import Target
from ..variants import Variants
from .layer import copy_into, owned_int32, planned_tail


class PrefillBuffers:
    """A plan's own device arrays, kept from batch to batch of one shape: the int32 tables, the
    int32 lengths and ``query_start_loc`` packed in one array (one upload), and the split-K
    scratch (grown, never shrunk: a launch of fewer splits uses its first rows)."""

    __slots__ = ("lens", "meta", "partial_lse", "partial_out", "splits", "starts", "tables")

    def __init__(self) -> None:
        self.tables = self.meta = self.lens = self.starts = None
        self.partial_out = self.partial_lse = None
        self.splits = 0

    def partial(self, xp: Any, total: int, heads: int, launch: Any, head_dim: int) -> tuple:
        """``(partial_out, partial_lse)`` for ``launch``: ``[total, heads, splits(, head_dim)]``
        float32 with split-K, else one float32 each (never read; no null pointers)."""
        splits = 1 if launch is None else launch.num_splits
        if self.partial_out is None or splits > self.splits:
            if splits > 1:
                split_shape = (total, heads, splits)
                partial_out = xp.empty((*split_shape, head_dim), np.float32)
                partial_lse = xp.empty(split_shape, np.float32)
            else:
                partial_out = partial_lse = xp.empty(1, np.float32)
            self.partial_out, self.partial_lse, self.splits = partial_out, partial_lse, splits
        return self.partial_out, self.partial_lse

    def upload_metadata(self, xp: Any, host_lens: np.ndarray, host_starts: np.ndarray) -> None:
        """The lengths and starts, narrowed to int32 on the host (checked first), into the
        packed buffer (made at the first batch): one asynchronous copy on the current stream
        (CuPy's ``ndarray.set`` with the stream: ``cudaMemcpyAsync``, no allocation)."""
        num_seqs = len(host_lens)
        if xp is np and self.meta is not None:
            self.lens[...], self.starts[...] = host_lens, host_starts
            return
        packed = np.empty(2 * num_seqs + 1, np.int32)
        packed[:num_seqs], packed[num_seqs:] = host_lens, host_starts
        if self.meta is None:
            self.meta = packed if xp is np else xp.asarray(packed)
            self.lens, self.starts = self.meta[:num_seqs], self.meta[num_seqs:]
        else:
            self.meta.set(packed, stream=xp.cuda.get_current_stream())

    def copy_tables(self, xp: Any, block_tables: Any) -> None:
        """The tables into the plan's int32 copy (made at the first batch), narrowed on the
        device: one ``cudaMemcpyAsync`` for int32 C-contiguous tables."""
        if self.tables is None:
            self.tables = owned_int32(xp, block_tables)
        else:
            copy_into(self.tables, block_tables)


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillShape:
    """What a :class:`PrefillPlan` fixes when made, for every batch it plans: the device, the
    cache's and the queries' element types, the tables' and the cache's shapes, the heads, and
    the options that shape a launch (``splits``: a forced count, 1 batch-invariant, ``None``
    the heuristic's), and the GPU launches are planned for (the current device's then)."""

    device: str
    dtype: str
    q_dtype: str
    num_seqs: int
    max_blocks: int
    num_blocks: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    block_size: int
    causal: bool
    splits: int | None
    variants: Variants
    target: Target

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads


def host_plan(
    shape: PrefillShape, host_starts: np.ndarray, host_lens: np.ndarray
) -> tuple[PrefillLaunch | None, bool]:
    """What a batch's host metadata decides for a plan of ``shape``: its launch (``None``: no
    query tokens), after the host checks, and whether every length is within the table (then
    the plan's int32 copy is what the checked mode's table check reads).

    Raises:
        ValueError: a bad ``query_start_loc``, ``n_i > context_lens[i]``, too many query tokens,
            or a launch past the grid's limits.
    """
    total = int(host_starts[-1])
    if total > INT32_MAX:
        raise ValueError(f"expected at most {INT32_MAX} query tokens, got {total}")
    max_query_len = check_query_start_loc(host_starts, host_lens, total)
    longest = int(host_lens.max(initial=0))  # lengths are >= 0 (checked)
    fits = longest <= table_limit(shape.max_blocks, shape.block_size)
    if not total:
        return None, fits
    if longest > MAX_CONTEXT_LEN:  # the launch's arithmetic is on capped lengths
        host_lens = np.minimum(host_lens.astype(np.int64), MAX_CONTEXT_LEN)
    launch = prefill_launch(
        shape.dtype,
        shape.num_seqs,
        shape.num_kv_heads,
        shape.group,
        shape.head_dim,
        shape.block_size,
        max_query_len,
        query_start_loc=host_starts,
        context_lens=host_lens,
        causal=shape.causal,
        splits=shape.splits,
        total_query_tokens=total,
        target=shape.target,
        variants=shape.variants,
        q_dtype=shape.q_dtype,
    )
    return launch, fits


def new_record(
    xp: Any,
    shape: PrefillShape,
    launch: PrefillLaunch,
    buffers: PrefillBuffers,
    spare: Any,
    scale: float | None,
) -> PrefillArgs:
    """The kernel's record of a plan's first launch over its ``buffers``: the layer's arrays
    (``None`` here), a run's scales and sinks go in at each run; ``spare``, a real float32
    array, where a variant's pointer is unused."""
    return PrefillArgs(
        out=None,
        partial_out=spare,
        partial_lse=spare,
        q=None,
        k_cache=None,
        v_cache=None,
        block_tables=buffers.tables,
        context_lens=buffers.lens,
        query_start_loc=buffers.starts,
        num_kv_heads=np.int32(shape.num_kv_heads),
        group_size=np.int32(shape.group),
        heads_per_block=np.int32(launch.heads_per_block),
        max_blocks=np.int32(shape.max_blocks),
        num_seqs=np.int32(shape.num_seqs),
        query_rows=np.int32(launch.query_rows),
        causal=np.int32(shape.causal),
        partition_tokens=np.int32(launch.partition_tokens),
        num_splits=np.int32(launch.num_splits),
        **planned_tail(
            xp, shape.dtype, shape.head_dim, shape.num_kv_heads, scale, shape.variants, spare
        ),
    )
