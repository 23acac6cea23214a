"""The kernels' arguments by name: one record per ``__global__`` signature of ``cuda/*.cu``.

A kernel takes its arguments as one tuple in the order of its C++ parameters. Each record here
is that tuple (a ``NamedTuple``), its fields named as the ``.cu`` names the parameters, in their
order, each annotated with its C type (:data:`C_TYPES`), so that a plan sets every argument by
name and the order is written once. ``tests/kernels/test_kernel_args.py`` parses the signatures of
``cuda/*.cu`` and holds every record of :data:`KERNEL_ARGS` against them: a parameter reordered,
renamed, added or retyped there fails it, and so does a kernel without a record.

Two groups recur: the six scale arguments of an fp8 cache (:class:`ScaleArgs`, ``common.cuh``,
"fp8 caches"), and the four variant arguments that end every attention kernel's list
(``window_left, soft_cap, alibi_slopes, sinks``, ``common.cuh``, "Attention variants").

A plan builds its record once, with the values of every layer (its tables, work list, scalars)
and ``None`` where a layer's own go. ``filled`` gives a launch its tuple with the layer's values
in their places, set by name (at the fields' positions, read once from the names: ``_at``).
``filler`` makes, once per plan, a function that does the same on a run's hot path: the
record's runs between the layer's fields are sliced at plan time, so a run only joins them, as
cheaply as a tuple written out by hand; the positions it relies on are asserted here at import,
from the names. Both give a plain tuple, what CuPy and the CPU backend take (a record complete
at plan time, the planner's, is launched as ``tuple(record)``)::

    plan:   args = DecodeArgs(out=None, partial_out=..., q=None, ..., sinks=partial_lse)
            fill = args.filler()
    run:    kernel(grid, block, fill(out, q, k_cache, v_cache))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

# The annotations of the records' fields, one per C type of a kernel parameter. A pointer of any
# element type is an array (a CuPy array on a GPU, a NumPy array on the CPU backend); a scalar
# is the NumPy scalar of the exact C type, which both backends take as it is.
Array = Any
Int32 = np.int32
Int64 = np.int64
Float32 = np.float32
C_TYPES = {"Array": "pointer", "Int32": "int", "Int64": "long long", "Float32": "float"}


class ScaleArgs(NamedTuple):
    """The scales of an fp8 cache as the kernels take them (``cupaged.attention.scales``): for
    K and V a value, an array and a stride; the head's scale is ``value * array[head * stride]``.
    Every kernel that reads an fp8 cache takes these six, in this order, in its list."""

    k_scale: Float32
    v_scale: Float32
    k_scales: Array  # [1] or [num_kv_heads] float32
    v_scales: Array
    k_scale_stride: Int32
    v_scale_stride: Int32

    def named(self) -> dict[str, Any]:
        """The six as keywords of a kernel's record: ``DecodeArgs(..., **scales.named())``."""
        return self._asdict()


class WriteKvArgs(NamedTuple):
    """``write_kv`` (cuda/write_kv.cu): a 16/32-bit cache, written as it is."""

    k: Array  # [num_tokens, num_kv_heads, head_dim]
    v: Array
    k_cache: Array  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: Array
    slots: Array  # [num_tokens] int32 or int64
    num_kv_heads: Int32
    block_size: Int32
    head_dim: Int32

    def filled(self, k: Any, v: Any, k_cache: Any, v_cache: Any, slots: Any) -> tuple:
        """The arguments of one call: this record with its arrays in their places."""
        args = list(self)
        args[_WRITE.k], args[_WRITE.v] = k, v
        args[_WRITE.k_cache], args[_WRITE.v_cache] = k_cache, v_cache
        args[_WRITE.slots] = slots
        return tuple(args)

    def filler(self) -> Callable[[Any, Any, Any, Any, Any], tuple]:
        """``fill(k, v, k_cache, v_cache, slots)``: what :meth:`filled` gives, made fast."""
        sizes = self[_WRITE.slots + 1 :]

        def fill(k: Any, v: Any, k_cache: Any, v_cache: Any, slots: Any) -> tuple:
            return (k, v, k_cache, v_cache, slots, *sizes)

        return fill


class WriteKvFp8Args(NamedTuple):
    """``write_kv_fp8`` (cuda/write_kv.cu): an fp8 cache, quantized as it is written."""

    k: Array  # [num_tokens, num_kv_heads, head_dim], float32, float16 or bfloat16
    v: Array
    k_cache: Array  # [num_blocks, num_kv_heads, block_size, head_dim], fp8 bytes
    v_cache: Array
    slots: Array  # [num_tokens] int32 or int64
    num_kv_heads: Int32
    block_size: Int32
    head_dim: Int32
    k_scale: Float32
    v_scale: Float32
    k_scales: Array
    v_scales: Array
    k_scale_stride: Int32
    v_scale_stride: Int32

    def filled(
        self, k: Any, v: Any, k_cache: Any, v_cache: Any, slots: Any, scales: ScaleArgs
    ) -> tuple:
        """The arguments of one call: this record with its arrays and scales in their places."""
        args = list(self)
        args[_WRITE_FP8.k], args[_WRITE_FP8.v] = k, v
        args[_WRITE_FP8.k_cache], args[_WRITE_FP8.v_cache] = k_cache, v_cache
        args[_WRITE_FP8.slots] = slots
        args[_WRITE_FP8_SCALES] = scales
        return tuple(args)

    def filler(self) -> Callable[[Any, Any, Any, Any, Any, ScaleArgs], tuple]:
        """``fill(k, v, k_cache, v_cache, slots, scales)``: :meth:`filled`, made fast."""
        sizes = self[_WRITE_FP8.slots + 1 : _WRITE_FP8_SCALES.start]

        def fill(k: Any, v: Any, k_cache: Any, v_cache: Any, slots: Any, scales: Any) -> tuple:
            return (k, v, k_cache, v_cache, slots, *sizes, *scales)

        return fill


class CopyBlocksArgs(NamedTuple):
    """``copy_blocks`` (cuda/copy_blocks.cu): whole blocks, every layer, in words of ``W``."""

    k_cache: Array  # [num_layers, num_blocks, words_per_block]
    v_cache: Array
    src: Array  # [num_pairs] int32
    dst: Array  # [num_pairs] int32
    num_blocks: Int32
    words_per_block: Int64

    def filled(self, k_cache: Any, v_cache: Any, src: Any, dst: Any) -> tuple:
        """The arguments of one call: this record with its arrays in their places."""
        args = list(self)
        args[_COPY.k_cache], args[_COPY.v_cache] = k_cache, v_cache
        args[_COPY.src], args[_COPY.dst] = src, dst
        return tuple(args)

    def filler(self) -> Callable[[Any, Any, Any, Any], tuple]:
        """``fill(k_cache, v_cache, src, dst)``: what :meth:`filled` gives, made fast."""
        sizes = self[_COPY.dst + 1 :]

        def fill(k_cache: Any, v_cache: Any, src: Any, dst: Any) -> tuple:
            return (k_cache, v_cache, src, dst, *sizes)

        return fill


class PlanDecodeArgs(NamedTuple):
    """``plan_decode`` (cuda/decode_plan.cu): a decode step's work list, planned on the device.
    Every argument is the plan's own: the record is built once and launched at each update."""

    work: Array  # [capacity, 4] int32: {seq, begin, end, count}
    seq_items: Array  # [num_seqs, 2] int32: {first, count}
    context_lens: Array  # [num_seqs] int32
    num_seqs: Int32
    capacity: Int32
    min_chunk: Int32
    tile: Int32
    window_left: Int32
    # Items per wave of paged_decode on the device (decode_plan.cu's "Whole waves"); 0 keeps
    # the chunk as computed (batch-invariant plans, num_splits, the planner tests).
    wave_items: Int32 = np.int32(0)


class CheckTablesArgs(NamedTuple):
    """``check_tables`` (cuda/check_tables.cu): the checked path's verdict on a batch's tables
    and lengths, one per thread block. Every argument is the call's own."""

    verdicts: Array  # [grid] int32: the longest length, or limit + 1 (bad)
    block_tables: Array  # [num_seqs, max_blocks] int32 or int64
    context_lens: Array  # [num_seqs] int32 or int64
    first_keys: Array  # [num_seqs] int64, read if has_first_keys (else any array)
    num_seqs: Int32
    max_blocks: Int32
    block_size: Int32
    num_blocks: Int64
    limit: Int32
    window_left: Int32
    has_first_keys: Int32


# The layer's methods of the attention records (``filled`` and ``filler`` of DecodeArgs and
# PrefillArgs, of their merges), written once: each finds its record's field positions by the
# record's type in _LAYER_AT or _MERGE_AT (at the end, read from the names); a filler, once, at
# plan time.


def _layer_filled(
    record: Any,
    out: Any,
    q: Any,
    k_cache: Any,
    v_cache: Any,
    scales: ScaleArgs | None = None,
    sinks: Any = None,
) -> tuple:
    """The arguments of one layer's launch: this record with the layer's arrays in their
    places, and its scales and sinks when given (else the record's)."""
    at, scales_at = _LAYER_AT[type(record)]
    return _fill_layer(record, at, scales_at, out, q, k_cache, v_cache, scales, sinks)


def _fill_layer(
    record: Any,
    at: Any,
    scales_at: slice,
    out: Any,
    q: Any,
    k: Any,
    v: Any,
    scales: Any,
    sinks: Any,
) -> tuple:
    args = list(record)
    args[at.out], args[at.q], args[at.k_cache], args[at.v_cache] = out, q, k, v
    if scales is not None:
        args[scales_at] = scales
    if sinks is not None:
        args[at.sinks] = sinks
    return tuple(args)


def _layer_filler(record: Any) -> Callable[..., tuple]:
    """``fill(out, q, k_cache, v_cache, scales=None, sinks=None)``: :meth:`filled`, with
    the common run (no scales, no sinks) made fast: ``out``, the record's fields up to ``q``,
    then ``q``, ``k_cache``, ``v_cache`` and the rest."""
    at, scales_at = _LAYER_AT[type(record)]
    between, after = record[at.out + 1 : at.q], record[at.v_cache + 1 :]

    def fill(
        out: Any, q: Any, k_cache: Any, v_cache: Any, scales: Any = None, sinks: Any = None
    ) -> tuple:
        if scales is None and sinks is None:
            return (out, *between, q, k_cache, v_cache, *after)
        return _fill_layer(record, at, scales_at, out, q, k_cache, v_cache, scales, sinks)

    return fill


def _merge_filled(record: Any, out: Any, sinks: Any = None) -> tuple:
    """The arguments of one layer's merge: the layer's output, and its sinks when given."""
    return _fill_merge(record, _MERGE_AT[type(record)].sinks, out, sinks)


def _fill_merge(record: Any, sinks_at: int, out: Any, sinks: Any) -> tuple:
    args = list(record)
    args[0] = out  # (a merge's output leads: asserted below)
    if sinks is not None:
        args[sinks_at] = sinks
    return tuple(args)


def _merge_filler(record: Any) -> Callable[..., tuple]:
    """``fill(out, sinks=None)``: :meth:`filled`, with a run without sinks made fast (the
    output leads: ``out`` and the record's others)."""
    rest, sinks_at = record[1:], _MERGE_AT[type(record)].sinks

    def fill(out: Any, sinks: Any = None) -> tuple:
        if sinks is None:
            return (out, *rest)
        return _fill_merge(record, sinks_at, out, sinks)

    return fill


class DecodeArgs(NamedTuple):
    """``paged_decode`` and ``paged_decode_mma`` (cuda/paged_attention.cu; one interface)."""

    out: Array  # [num_seqs, num_q_heads, head_dim]: per layer
    partial_out: Array  # [capacity, num_q_heads, head_dim] float32
    partial_lse: Array  # [capacity, num_q_heads] float32
    q: Array  # [num_seqs, num_q_heads, head_dim]: per layer
    k_cache: Array  # [num_blocks, num_kv_heads, block_size, head_dim]: per layer
    v_cache: Array  # per layer
    block_tables: Array  # [num_seqs, max_blocks] int32
    work: Array  # [capacity, 4] int32
    seq_items: Array  # [num_seqs, 2] int32: {first, count}, read with merge_counters
    # [num_seqs, grid_x] int32, zero between launches: a split sequence's last block merges its
    # pieces (paged_attention.cu, "the last block merges"); None: paged_decode_merge will
    merge_counters: Array
    context_lens: Array  # [num_seqs] int32
    num_kv_heads: Int32
    group_size: Int32
    max_blocks: Int32
    scale: Float32
    k_scale: Float32  # the fp8 scales (ScaleArgs): a run's, else the plan's of 1.0
    v_scale: Float32
    k_scales: Array
    v_scales: Array
    k_scale_stride: Int32
    v_scale_stride: Int32
    window_left: Int32
    soft_cap: Float32
    alibi_slopes: Array  # [num_q_heads] float32, read with the ALiBi bit
    sinks: Array  # [num_q_heads] float32, read with the sinks bit: a run's

    filled = _layer_filled
    filler = _layer_filler


class DecodeMergeArgs(NamedTuple):
    """``paged_decode_merge`` (cuda/paged_attention.cu): a split sequence's items merged."""

    out: Array  # [num_seqs, num_q_heads, head_dim]: per layer
    partial_out: Array  # [capacity, num_q_heads, head_dim] float32
    partial_lse: Array  # [capacity, num_q_heads] float32
    seq_items: Array  # [num_seqs, 2] int32
    num_q_heads: Int32
    window_left: Int32
    soft_cap: Float32
    alibi_slopes: Array  # unused (the scores' variant)
    sinks: Array  # [num_q_heads] float32, with the sinks bit: a run's

    filled = _merge_filled
    filler = _merge_filler


class CascadeSharedArgs(NamedTuple):
    """``cascade_shared`` and ``cascade_shared_cores`` (cuda/cascade.cu; one interface): the
    shared level of cascade decode attention, its partial rows and log-sum-exps in the slots of
    ``members``, merged by ``paged_decode_merge``."""

    partial_out: Array  # [capacity, num_q_heads, head_dim] float32
    partial_lse: Array  # [capacity, num_q_heads] float32
    q: Array  # [num_seqs, num_q_heads, head_dim]: per layer
    k_cache: Array  # [num_blocks, num_kv_heads, block_size, head_dim]: per layer
    v_cache: Array  # per layer
    block_tables: Array  # [num_seqs, max_blocks] int32
    tiles: Array  # [num_tiles, 4] int32: {first_row, num_rows, begin, end}
    members: Array  # [num_members, 2] int32: {seq, slot}
    context_lens: Array  # [num_seqs] int32
    num_kv_heads: Int32
    group_size: Int32
    max_blocks: Int32
    scale: Float32
    k_scale: Float32  # the fp8 scales (ScaleArgs): a run's, else the plan's of 1.0
    v_scale: Float32
    k_scales: Array
    v_scales: Array
    k_scale_stride: Int32
    v_scale_stride: Int32
    window_left: Int32
    soft_cap: Float32
    alibi_slopes: Array  # [num_q_heads] float32, read with the ALiBi bit
    sinks: Array  # never read (the merge adds the sinks): any float32 array


class PrefillArgs(NamedTuple):
    """``paged_prefill``, ``paged_prefill_mma`` and ``paged_prefill_flash`` (cuda/paged_prefill.cu;
    one interface)."""

    out: Array  # [total_query_tokens, num_q_heads, head_dim]: per layer
    partial_out: Array  # [total_query_tokens, num_q_heads, num_splits, head_dim] float32
    partial_lse: Array  # [total_query_tokens, num_q_heads, num_splits] float32
    q: Array  # [total_query_tokens, num_q_heads, head_dim]: per layer
    k_cache: Array  # [num_blocks, num_kv_heads, block_size, head_dim]: per layer
    v_cache: Array  # per layer
    block_tables: Array  # [num_seqs, max_blocks] int32
    context_lens: Array  # [num_seqs] int32
    query_start_loc: Array  # [num_seqs + 1] int32
    num_kv_heads: Int32
    group_size: Int32
    heads_per_block: Int32
    max_blocks: Int32
    num_seqs: Int32
    query_rows: Int32
    causal: Int32
    partition_tokens: Int32
    num_splits: Int32
    scale: Float32
    k_scale: Float32  # the fp8 scales (ScaleArgs): a run's, else the plan's of 1.0
    v_scale: Float32
    k_scales: Array
    v_scales: Array
    k_scale_stride: Int32
    v_scale_stride: Int32
    window_left: Int32
    soft_cap: Float32
    alibi_slopes: Array  # [num_q_heads] float32, read with the ALiBi bit
    sinks: Array  # [num_q_heads] float32, read with the sinks bit (without split-K): a run's

    filled = _layer_filled
    filler = _layer_filler


class PrefillMergeArgs(NamedTuple):
    """``paged_prefill_merge`` (cuda/paged_prefill.cu): a split query row's pieces merged."""

    out: Array  # [total_query_tokens, num_q_heads, head_dim]: per layer
    partial_out: Array  # [total_query_tokens, num_q_heads, num_splits, head_dim] float32
    partial_lse: Array  # [total_query_tokens, num_q_heads, num_splits] float32
    context_lens: Array  # [num_seqs] int32
    query_start_loc: Array  # [num_seqs + 1] int32
    num_seqs: Int32
    causal: Int32
    partition_tokens: Int32
    num_splits: Int32
    query_rows: Int32
    window_left: Int32
    soft_cap: Float32
    alibi_slopes: Array  # unused (the scores' variant)
    sinks: Array  # [num_q_heads] float32, with the sinks bit: a run's

    filled = _merge_filled
    filler = _merge_filler


# Every kernel of cuda/, by (file, function name): its record (tests/kernels/test_kernel_args.py).
KERNEL_ARGS: dict[tuple[str, str], type] = {
    ("write_kv.cu", "write_kv"): WriteKvArgs,
    ("write_kv.cu", "write_kv_fp8"): WriteKvFp8Args,
    ("copy_blocks.cu", "copy_blocks"): CopyBlocksArgs,
    ("decode_plan.cu", "plan_decode"): PlanDecodeArgs,
    ("check_tables.cu", "check_tables"): CheckTablesArgs,
    ("paged_attention.cu", "paged_decode"): DecodeArgs,
    ("paged_attention.cu", "paged_decode_mma"): DecodeArgs,
    ("paged_attention.cu", "paged_decode_merge"): DecodeMergeArgs,
    ("cascade.cu", "cascade_shared"): CascadeSharedArgs,
    ("cascade.cu", "cascade_shared_cores"): CascadeSharedArgs,
    ("paged_prefill.cu", "paged_prefill"): PrefillArgs,
    ("paged_prefill.cu", "paged_prefill_mma"): PrefillArgs,
    ("paged_prefill.cu", "paged_prefill_flash"): PrefillArgs,
    ("paged_prefill.cu", "paged_prefill_merge"): PrefillMergeArgs,
}


def fields(record: type) -> tuple[str, ...]:
    """A record's field names: its kernel's parameters, in order."""
    return tuple(record.__annotations__)


def merge_record(record: Any, merge: type, **own: Any) -> Any:
    """The record of ``merge``, the kernel that merges the pieces of ``record``'s launch: every
    field the two share holds ``record``'s value (the partial buffers it writes, the lengths,
    the variants: what the merge must read as the kernel did), the others are ``own``.

    Raises:
        AttributeError: a field of ``merge`` that ``record`` lacks and ``own`` does not give.
    """
    shared = {name: getattr(record, name) for name in fields(merge) if name not in own}
    return merge(**shared, **own)


def with_fields(record: Any, **values: Any) -> Any:
    """``record`` with ``values`` in the fields they name, the others as they are (a plan that
    lays a step's own buffers into the records it built once: the one place that calls the
    ``NamedTuple``'s ``_replace``).

    Raises:
        ValueError: a name that is not a field of ``record``.
    """
    return record._replace(**values)


def _at(record: type) -> Any:
    """The record whose every field holds its own position: ``_at(DecodeArgs).q == 3``."""
    return record(*range(len(fields(record))))


def _span(record: type, group: type) -> slice:
    """Where ``group``'s fields sit in ``record``, one run in the same order."""
    names, run = fields(record), fields(group)
    where = slice(names.index(run[0]), names.index(run[0]) + len(run))
    assert names[where] == run, f"{group.__name__} split in {record.__name__}"
    return where


_WRITE = _at(WriteKvArgs)
_WRITE_FP8 = _at(WriteKvFp8Args)
_WRITE_FP8_SCALES = _span(WriteKvFp8Args, ScaleArgs)
_COPY = _at(CopyBlocksArgs)
_DECODE = _at(DecodeArgs)
_DECODE_SCALES = _span(DecodeArgs, ScaleArgs)
_DECODE_MERGE = _at(DecodeMergeArgs)
_PREFILL = _at(PrefillArgs)
_PREFILL_SCALES = _span(PrefillArgs, ScaleArgs)
_PREFILL_MERGE = _at(PrefillMergeArgs)

# What the fillers rely on, from the names: a copy's or a write's own arrays lead its list, an
# fp8 write's scales end it; an attention kernel's output leads and its q, K and V follow one
# another; a merge's output leads.
assert (
    fields(WriteKvArgs)[:5]
    == fields(WriteKvFp8Args)[:5]
    == ("k", "v", "k_cache", "v_cache", "slots")
)
assert _WRITE_FP8_SCALES.stop == len(fields(WriteKvFp8Args))
assert fields(CopyBlocksArgs)[:4] == ("k_cache", "v_cache", "src", "dst")
for _layer in (_DECODE, _PREFILL):
    assert _layer.out == 0 and (_layer.k_cache, _layer.v_cache) == (_layer.q + 1, _layer.q + 2)
assert _DECODE_MERGE.out == _PREFILL_MERGE.out == 0
_LAYER_AT = {DecodeArgs: (_DECODE, _DECODE_SCALES), PrefillArgs: (_PREFILL, _PREFILL_SCALES)}
_MERGE_AT = {DecodeMergeArgs: _DECODE_MERGE, PrefillMergeArgs: _PREFILL_MERGE}
