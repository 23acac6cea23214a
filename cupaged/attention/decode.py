"""Decode attention planned once per step and run per layer: :class:`DecodePlan`.

A decode step attends every layer over the same block tables and lengths, so everything that
depends on them alone is done once: the checks, the plan's own int32 copies of the tables and
lengths (a later write to the caller's arrays cannot reach a kernel), the split of the work into
items balanced by tokens (planned on the device by ``cuda/decode_plan.cu``, no read-back), the
scratch buffers of split-K, and the resolved kernels and launch geometry. ``run`` is then the
decode launch (which merges the split sequences' pieces too), nothing else::

    plan = cupaged.DecodePlan(tables, lens, cache.k[0], num_q_heads)     # once per step
    for layer in range(num_layers):
        out = plan.run(q[layer], cache.k[layer], cache.v[layer])         # per layer

The launch geometry depends on the batch size and the cache layout, never on the lengths'
values: :meth:`DecodePlan.update` re-plans a new step into the same buffers, so a CUDA graph
captured around ``run`` replays for any lengths (pad the batch to a fixed size with zero-length
rows). ``update`` checks the arrays it is given unless told ``checked=False``, whatever the plan
was built with: a plan from the cache trusts the cache's tables, not later arrays.

The attention variants (``cupaged/variants.py``; docs/variants.md) of a model are fixed when
planning: ``window_left`` goes to the planner, whose items cover only the tokens the window
sees (a 32k context with a 4k window reads about 4k tokens' K/V, split as a 4k context is),
``logits_soft_cap`` and ``alibi_slopes`` to the kernel's ``VARIANT``. ``sinks`` are learned per
layer, so they are an argument of ``run``; the kernels with the sinks bit are loaded at the
first run that passes them.

An fp8 cache (docs/fp8.md) is planned for one query type, ``q_dtype`` (float32, float16, the
default, or bfloat16: it picks the kernel, tensor cores for 16-bit queries in large groups);
``kv_dtype`` names the format of a ``uint8`` cache (a GPU's). The scales are per layer, so they
are arguments of ``run``: ``k_scale`` / ``v_scale``, each a positive finite number or a float32
array of shape ``()``, ``[1]`` or ``[num_kv_heads]`` on the plan's device, ``None`` for 1.0.
The kernel reads a device array where it lies; the host checks its values only in the plan's
``checked`` mode (one synchronisation), which a plan keeps apart from the checks of its tables:
``PagedCache``'s plans trust the cache's own tables and scales (``tables_checked=False``,
``trusted_scales``), never a scale array of the caller's. Scales for a cache that is not fp8 are
refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .._arrays.checks import (
    MAX_CONTEXT_LEN,
    as_bool,
    as_int,
    check_index_array,
    check_num_blocks,
    check_shape,
    element_type,
)
from .._arrays.interop import takes_dlpack
from .._util import cdiv
from ..backend import array_module, to_numpy
from ..dtypes import dtype_name, is_fp8, itemsize
from ..kernels.args import DecodeArgs, DecodeMergeArgs, PlanDecodeArgs, merge_record, with_fields
from ..kernels.launch_decode import (
    MAX_GRID_YZ,
    MIN_SPLIT_TOKENS,
    PLAN_NAME,
    check_decode_shape,
    decode_ctas_per_sm,
    decode_launch,
    decode_merge_launch,
    fuses_merge,
    invariant_work,
    plan_threads,
    query_dtype,
)
from ..kernels.loader import get_kernel
from ..variants import check_sinks, check_variants
from .cascade import (
    CascadeLevels,
    CascadeWork,
    DecodeGeometry,
    checked_host_tables,
    first_attended,
    shared_level,
)
from .layer import (
    DECODE_Q_AXES,
    LayerArrays,
    attention_kernel,
    check_layer_and_heads,
    copy_into,
    ctas_per_sm,
    device_of,
    owned_int32,
    planned_tail,
    target,
)
from .scales import kv_scale_args, own_scales, trusted_memory
from .table_checks import check_decode_tables

Q_AXES = DECODE_Q_AXES


class DecodePlan:
    """The decode attention of one step, planned once and run for every layer.

    Args:
        block_tables: ``[num_seqs, max_blocks]`` int32 or int64; the plan keeps its own int32
            copy (a later write to the caller's array does not reach the kernels).
        context_lens: ``[num_seqs]`` int32 or int64 (copied alike).
        k_cache: one layer of the cache, ``[num_blocks, num_kv_heads, block_size, head_dim]``
            (``cache.k[0]``): the layout, dtype and device every ``run`` must match.
        num_q_heads: query heads, a multiple of ``num_kv_heads``.
        scale: softmax scale; ``head_dim ** -0.5`` when ``None``.
        num_splits: cut every sequence into at most this many pieces of equal length (tests and
            experiments; a count above the pieces of whole tiles a context holds gives those
            pieces); ``None`` balances the work by tokens over the device (see
            ``cuda/decode_plan.cu``). Refused with ``batch_invariant=True``.
        cascade: rows sharing leading blocks (forks, prefix-cache hits) read them once
            (docs/cascade.md): ``None`` when that saves ``MIN_SAVED_BYTES`` of K/V per layer
            (cupaged/attention/cascade.py), ``True`` whenever two rows share a block, ``False``
            never; off with ``batch_invariant=True``. Its buffers are per step: a CUDA graph of
            ``run`` needs ``False``. On a GPU it reads ``host_tables`` (without them ``None``
            plans no cascade, never synchronising for it, and ``True`` reads the tables back).
        host_tables: ``(block_tables, context_lens)``: NumPy copies (any width holding every
            length's blocks), held equal to them by the tables' checks, else *trusted*
            (``PagedCache.decode_plan``'s own); their shapes are checked always.
        batch_invariant: ``True``: a sequence's output is bitwise the same in any batch, at any
            position in it (on one device and build; docs/batch-invariance.md). Every sequence
            is cut into pieces of a fixed size (``INVARIANT_SPLIT_TOKENS`` of
            ``cupaged.kernels.launch_decode``, rounded up to the kernel's tile) merged in
            order, so its reduction order depends on its own length alone; the work list holds
            ``num_seqs * (1 + ceil(max_blocks * block_size / chunk))`` items (window-capped),
            whatever the lengths, and so do the split-K buffers. ``False`` (default): the work
            is balanced by tokens over the batch, and a sequence's last bits depend on the
            others' lengths.
        max_context_len: the longest context, used only with ``num_splits`` and
            ``checked=False`` to size the pieces without a read-back; a wrong value changes how
            the work is cut, never the result.
        checked: check, once here, that every length is in ``[0, max_blocks * block_size]`` and
            every block id a length reaches is in ``[0, num_blocks)`` (one synchronisation on a
            GPU), and at each :meth:`run` that the scale arrays it is given are positive and
            finite (one more). ``checked=False`` *trusts* the caller in both: a bad id or length
            reads outside the cache, a bad scale gives NaN. Lengths up to 2^30 (what the
            checks admit) are what the kernels are built for: the planner cuts any int length
            in full, but the kernels' token positions are 32-bit and a length within a stage
            of 2^31 would wrap in the last one.
        tables_checked: the checks of the tables and lengths alone: ``None``, as ``checked``;
            ``False`` trusts them (tables that cupaged built: ``PagedCache`` passes it for its
            own) while each run's arguments are still checked as ``checked`` says.
        trusted_scales: arrays whose values were checked when they were written (``PagedCache``
            passes its ``[num_layers, num_kv_heads]`` K and V scales): a run's scale array that
            is one of them, or a view of one, is not checked again.
        window_left: sliding window: the query (position ``len - 1``) attends the keys from
            position ``len - 1 - window_left`` on (``window_left + 1`` keys at most); ``-1``,
            all. The kernels read no table entry before the window, and ``checked`` checks
            only the entries the window reaches: a sliding-window cache's released ``-1``
            entries before it are fine::

                window_left = 4, len = 12, block_size = 4:   first key 12 - 1 - 4 = 7
                position   0 1 2 3 | 4 5 6 7 | 8 9 10 11
                table      -1      | 17      | 3             entry 0 never read

        logits_soft_cap: ``s = cap * tanh(s / cap)`` on each scaled score (before ALiBi);
            ``0.0``, none.
        alibi_slopes: ``[num_q_heads]`` float32 on the plan's device: ``s += slopes[h] * (j -
            i)`` for key position ``j`` and the query's ``i = len - 1``; copied (the plan keeps
            its own). ``None``, none.
        q_dtype: over fp8, every run's query type (module docstring); else None or the cache's.
        kv_dtype: the fp8 format of a ``uint8`` cache; ``None`` otherwise.

    Raises:
        TypeError: arrays on different devices, or wrong dtypes (``q_dtype``, ``kv_dtype`` too).
        ValueError: wrong shapes, an unsupported head_dim or block_size, a bad variant
            (``window_left < -1``, a negative or non-finite soft-cap, slopes of the wrong
            shape), or (checked) bad lengths or block ids, ``num_splits`` with
            ``batch_invariant=True``, or a batch-invariant work list past CUDA's grid limit.

    Example::

        plan = DecodePlan(tables, lens, cache.k[0], 32, window_left=4095)  # Mistral's 4096
        out = plan.run(q, cache.k[0], cache.v[0], sinks=layer_sinks)      # gpt-oss: sinks
    """

    __slots__ = (
        "_arrays",
        "_block",
        "_capacity",
        "_cascade",
        "_cascade_args",
        "_device",
        "_fill",
        "_grid",
        "_host_tables",
        "_kernel",
        "_layout",
        "_lens",
        "_launch",
        "_merge",
        "_merge_counters",
        "_merge_launch",
        "_num_q_heads",
        "_plan_args",
        "_planner",
        "_planner_block",
        "_fp8",
        "_seq_items",
        "_shared_level",
        "_shared_mem",
        "_sink_kernels",
        "_tables",
        "_tile",
        "_trusted",
        "_variants",
        "_work",
        "_xp",
        "batch_invariant",
        "checked",
        "num_seqs",
    )

    @takes_dlpack
    def __init__(
        self,
        block_tables: Any,
        context_lens: Any,
        k_cache: Any,
        num_q_heads: int,
        *,
        scale: float | None = None,
        num_splits: int | None = None,
        batch_invariant: bool = False,
        cascade: bool | None = None,
        host_tables: tuple[Any, Any] | None = None,
        max_context_len: int | None = None,
        checked: bool = True,
        tables_checked: bool | None = None,
        trusted_scales: tuple[Any, ...] = (),
        window_left: int = -1,
        logits_soft_cap: float = 0.0,
        alibi_slopes: Any = None,
        q_dtype: Any = None,
        kv_dtype: Any = None,
    ) -> None:
        xp = array_module(block_tables, context_lens, k_cache)
        tables_checked = (
            checked if tables_checked is None else as_bool(tables_checked, "tables_checked")
        )
        num_blocks, num_kv_heads, block_size, head_dim, num_q_heads = check_layer_and_heads(
            k_cache, num_q_heads
        )
        dtype = element_type(k_cache, kv_dtype)
        q_dtype = query_dtype(dtype, None if q_dtype is None else dtype_name(q_dtype))
        check_decode_shape(dtype, head_dim, block_size)
        num_seqs, max_blocks = check_shape(
            "block_tables", block_tables, [("num_seqs", None), ("max_blocks", None)]
        )
        check_shape("context_lens", context_lens, [("num_seqs", num_seqs)])
        check_index_array("block_tables", block_tables)
        check_index_array("context_lens", context_lens)
        check_num_blocks(num_blocks)
        group = num_q_heads // num_kv_heads
        device = device_of(xp)
        variants = check_variants(xp, num_q_heads, window_left, logits_soft_cap, alibi_slopes)
        window = variants.window_left

        max_context = None
        if tables_checked:  # on the caller's arrays, before they are narrowed to int32
            max_context = check_decode_tables(
                block_tables, context_lens, block_size, num_blocks, window
            )
        splits = None if num_splits is None else as_int(num_splits, "num_splits")
        if splits is not None and splits < 1:
            raise ValueError(f"expected num_splits >= 1, got {splits}")
        batch_invariant = as_bool(batch_invariant, "batch_invariant")
        if batch_invariant and splits is not None:
            raise ValueError(
                f"expected num_splits=None with batch_invariant=True (its pieces have a fixed "
                f"size, whatever the batch), got num_splits={splits}"
            )
        if cascade is not None:
            cascade = as_bool(cascade, "cascade")
        if cascade and batch_invariant:
            raise ValueError(
                "expected cascade=None or False with batch_invariant=True (a shared level "
                "changes a row's reduction with the batch), got cascade=True"
            )
        gpu = target(device)
        # The kernel and its layout depend on the shape and the GPU, not on the work list's
        # length: planned (and, with sequences, loaded) first, so that its occupancy can size it.
        launch = decode_launch(
            dtype, num_kv_heads, group, head_dim, block_size, 1, gpu, variants, q_dtype=q_dtype
        )
        tile = launch.tile  # pieces are whole stages
        kernel = None
        if num_seqs and device == "cuda":  # its occupancy sizes the work list
            kernel = attention_kernel(device, "paged_attention.cu", launch, group, head_dim)
        fill = wave = 0  # items that fill the device, for the default split; items per wave
        if splits is None and not batch_invariant:
            # Thread blocks per multiprocessor x multiprocessors, over the thread blocks of one
            # item (KV heads x head chunks).
            if kernel is None:
                ctas = decode_ctas_per_sm(dtype, head_dim, group, block_size, q_dtype=q_dtype)
            else:
                ctas = ctas_per_sm(kernel, launch)
            fill = cdiv(ctas * gpu.sm_count, launch.grid[0])
            wave = ctas * gpu.sm_count // launch.grid[0]  # whole items (decode_plan.cu)
        longest = None  # the longest context, read for a count of splits
        if splits is not None and splits > 1:
            longest = max_context
            if longest is None and max_context_len is None:
                longest = int(to_numpy(context_lens).max()) if num_seqs else 0
            elif longest is None:
                longest = as_int(max_context_len, "max_context_len")
        capacity, min_chunk = _work_list(
            num_seqs, max_blocks * block_size, tile, window, splits, batch_invariant, fill, longest
        )
        launch = decode_launch(
            dtype,
            num_kv_heads,
            group,
            head_dim,
            block_size,
            capacity,
            gpu,
            variants,
            q_dtype=q_dtype,
        )
        self._xp = xp
        self._device = device
        self._layout = tuple(k_cache.shape)
        self._arrays = LayerArrays(
            xp, dtype, self._layout, Q_AXES, (num_seqs, num_q_heads, head_dim), kv_dtype, q_dtype
        )
        self._fp8 = is_fp8(dtype)  # then each run passes its scales, checked there
        self._capacity = capacity
        self._tile = tile
        self.num_seqs = num_seqs
        self.batch_invariant = batch_invariant
        self.checked = checked  # of each run's arguments
        self._trusted = trusted_memory(trusted_scales)
        self._variants = variants
        self._tables = owned_int32(xp, block_tables)
        self._lens = owned_int32(xp, context_lens)
        self._num_q_heads = np.int32(num_q_heads)
        self._sink_kernels = None
        self._cascade = self._shared_level = None
        self._host_tables = checked_host_tables(
            host_tables, self._tables, self._lens, block_size, tables_checked
        )
        if num_seqs == 0:
            return
        # Of the final launch: the CPU backend caps its helper threads by the launch's blocks.
        self._kernel = attention_kernel(device, "paged_attention.cu", launch, group, head_dim)
        self._grid, self._block, self._shared_mem = launch.grid, launch.block, launch.shared_mem
        self._launch = launch
        self._merge = get_kernel(device, "paged_attention.cu", launch.merge_name)  # a cascade's
        self._planner = get_kernel(device, "decode_plan.cu", PLAN_NAME)
        self._planner_block = (plan_threads(num_seqs),)
        self._work = xp.empty((capacity, 4), np.int32)
        self._seq_items = xp.empty((num_seqs, 2), np.int32)
        if capacity > num_seqs:
            partial_out = xp.empty((capacity, num_q_heads, head_dim), np.float32)
            partial_lse = xp.empty((capacity, num_q_heads), np.float32)
        else:  # never split: unused by the kernel; real arrays, so that no pointer is null
            partial_out = partial_lse = xp.empty(1, np.float32)
        # A split sequence's last thread block merges its pieces (paged_attention.cu, "the last
        # block merges"): one counter per sequence and thread block of an item, zeroed once here
        # and by that block after each use, so that a run (or a graph's replay) is one launch;
        # unless a sequence's pieces are too many for one block (fuses_merge): then a merge launch.
        self._merge_counters = self._merge_launch = None
        pieces = min(capacity - num_seqs + 1, cdiv(max_blocks * block_size, min_chunk) + 1)
        if capacity > num_seqs and fuses_merge(pieces, launch.geometry.chunk, head_dim):
            self._merge_counters = xp.zeros((num_seqs, launch.grid[0]), np.int32)
        elif capacity > num_seqs:  # (grid, block), then its filler below
            self._merge_launch = decode_merge_launch(
                head_dim, num_q_heads, num_seqs, capacity, fixed=batch_invariant
            )
        # The layer's arrays (None here) and an fp8 run's scales go in at each run.
        args = DecodeArgs(
            out=None,
            partial_out=partial_out,
            partial_lse=partial_lse,
            q=None,
            k_cache=None,
            v_cache=None,
            block_tables=self._tables,
            work=self._work,
            seq_items=self._seq_items,
            merge_counters=None,  # the cascade's record: paged_decode_merge follows
            context_lens=self._lens,
            num_kv_heads=np.int32(num_kv_heads),
            group_size=np.int32(group),
            max_blocks=np.int32(max_blocks),
            **planned_tail(xp, dtype, head_dim, num_kv_heads, scale, variants, partial_lse),
        )
        merge_args = merge_record(
            args, DecodeMergeArgs, seq_items=self._seq_items, num_q_heads=self._num_q_heads
        )
        self._fill = with_fields(args, merge_counters=self._merge_counters).filler()
        if self._merge_launch is not None:
            self._merge_launch = (*self._merge_launch, merge_args.filler())
        self._cascade_args = (args, merge_args)
        if cascade is not False and not batch_invariant and num_seqs > 1:
            self._shared_level = shared_level(
                device, args, dtype, q_dtype, self._layout, group, variants, cascade is True
            )
        plan_args = PlanDecodeArgs(
            work=self._work,
            seq_items=self._seq_items,
            context_lens=self._lens,
            num_seqs=np.int32(num_seqs),
            capacity=np.int32(capacity),
            min_chunk=np.int32(min_chunk),
            tile=np.int32(tile),
            window_left=np.int32(window),
            wave_items=np.int32(wave),
        )
        self._plan_args = tuple(plan_args)  # a plain tuple, as every launch passes one
        self._plan()

    def _plan(self) -> None:
        """Plan the work list on the device."""
        self._planner((1,), self._planner_block, self._plan_args)
        if self._device == "cpu":
            # The CPU backend has run the planner already and the list is in host memory: launch
            # the items it holds, not the capacity (an idle thread block still starts all its
            # fibers there; on a GPU it costs next to nothing, and the fixed grid is what a CUDA
            # graph needs).
            first, count = self._seq_items[-1]
            self._grid = (self._grid[0], int(first) + int(count))
        if self._shared_level is not None:
            self._cascade = self._plan_cascade()

    def _plan_cascade(self) -> CascadeLevels | None:
        """The step's cascade from the plan's tables (on the host), or ``None``: nothing shared,
        or too little (``cascade=None``), or a work list past CUDA's grid limit."""
        return self._shared_level.plan(
            (self._tables, self._lens),
            self._host_tables,
            self._cascade_args,
            kv_bytes=self._kv_bytes(),
            tile=self._tile,
            fill_blocks=max(self._capacity - self.num_seqs, 1),
        )

    def _kv_bytes(self) -> int:
        """Bytes of one cache element (an fp8 cache's one byte, a bfloat16's two)."""
        return 1 if self._fp8 else itemsize(self._arrays.dtype)

    @property
    def cascade(self) -> CascadeWork | None:
        """The step's cascade (its shared nodes, work and byte counts), ``None`` when the plan
        attends without one (docs/cascade.md)."""
        return None if self._cascade is None else self._cascade.work

    @property
    def kv_bytes_plain(self) -> int:
        """K/V bytes per layer that the plain plan reads: every attended key of every row, K
        and V of every KV head (one read-back of the lengths on a GPU)."""
        lens = to_numpy(self._lens).astype(np.int64)
        _, num_kv_heads, _, head_dim = self._layout
        attended = lens - first_attended(lens, self._variants.window_left)
        return int(attended.sum()) * 2 * head_dim * num_kv_heads * self._kv_bytes()

    @property
    def kv_bytes_read(self) -> int:
        """K/V bytes per layer that this plan reads: :attr:`kv_bytes_plain`, or less with a
        cascade (its shared ranges once per tile of query rows)."""
        if self._cascade is not None:
            return self._cascade.work.bytes_read
        return self.kv_bytes_plain

    @property
    def window_left(self) -> int:
        """The sliding window the plan attends (``-1``: none), read-only."""
        return self._variants.window_left

    @property
    def logits_soft_cap(self) -> float:
        """The soft-cap of the plan's scores (``0.0``: none), read-only."""
        return self._variants.logits_soft_cap

    @property
    def num_items(self) -> int:
        """Capacity of the work list: the decode launch's thread blocks per KV head."""
        return self._capacity

    def work(self) -> np.ndarray:
        """The planned work list on the host, ``[num_items, 4]`` rows ``(seq, begin, end,
        count)`` (``seq = -1``: idle), for tests and inspection (one read-back on a GPU)."""
        if self.num_seqs == 0:
            return np.empty((0, 4), np.int32)
        return to_numpy(self._work)

    @takes_dlpack
    def update(
        self,
        block_tables: Any,
        context_lens: Any,
        *,
        checked: bool = True,
        host_tables: tuple[Any, Any] | None = None,
    ) -> None:
        """Re-plan for a new step of the same batch size into the same buffers (same launch
        geometry, same device pointers: a captured CUDA graph stays valid). The arrays are
        copied into the plan's own.

        Args:
            block_tables: ``[num_seqs, max_blocks]`` int32 or int64, the planned shape.
            context_lens: ``[num_seqs]`` int32 or int64.
            checked: check them as the constructor does (lengths within the table, the block
                ids they reach within the cache, with the plan's window, on their own dtypes
                before the narrowing to int32; one synchronisation on a GPU), whether or not
                the plan was built checked; the later runs check their scale arrays as it says
                too. ``checked=False`` *trusts* the caller: pass it only for tables and lengths
                that cupaged built (``PagedCache.block_tables``) and scales checked already, as
                a CUDA graph's replay loop does.
            host_tables: the new tables' host copies, as the constructor takes them (the
                cascade's; ``None`` on a GPU: no cascade this step unless ``cascade=True``).

        Raises:
            TypeError: arrays on another device, or of a dtype other than int32 / int64.
            ValueError: a shape differs from the planned one, or (checked) bad lengths or ids;
                the plan is unchanged.
        """
        xp = array_module(block_tables, context_lens)
        if xp is not self._xp:
            raise TypeError(
                f"expected {self._xp.__name__} arrays (the plan's device), got {xp.__name__} arrays"
            )
        table_axes = list(zip(("num_seqs", "max_blocks"), self._tables.shape, strict=True))
        check_shape("block_tables", block_tables, table_axes)
        check_shape("context_lens", context_lens, [("num_seqs", self.num_seqs)])
        check_index_array("block_tables", block_tables)
        check_index_array("context_lens", context_lens)
        num_blocks, _, block_size, _ = self._layout
        if checked:
            check_decode_tables(
                block_tables, context_lens, block_size, num_blocks, self._variants.window_left
            )
        host = checked_host_tables(host_tables, block_tables, context_lens, block_size, checked)
        copy_into(self._tables, block_tables)
        copy_into(self._lens, context_lens)
        self._host_tables = host
        self.checked = checked
        if self.num_seqs:
            self._plan()

    @takes_dlpack
    def run(
        self,
        q: Any,
        k_cache: Any,
        v_cache: Any,
        *,
        sinks: Any = None,
        out: Any = None,
        k_scale: Any = None,
        v_scale: Any = None,
        kv_dtype: Any = None,
    ) -> Any:
        """Decode attention of one layer: what :func:`cupaged.paged_attention` computes, with
        the plan's variants.

        Args:
            q: ``[num_seqs, num_q_heads, head_dim]``, the cache's element type (fp8: q_dtype).
            k_cache: one layer, the planned layout (``cache.k[layer]``), C-contiguous, 16-byte
                aligned.
            v_cache: same shape and dtype as ``k_cache``.
            sinks: optional ``[num_q_heads]`` float32 on the plan's device, this layer's learned
                attention sinks: ``exp(sinks[h] - m)`` joins each row's softmax denominator
                (never its numerator); a context of length 0 still gets a zero row.
            out: optional ``[num_seqs, num_q_heads, head_dim]`` C-contiguous output, ``q``'s
                dtype: ``q`` itself (in place) or memory that does not overlap ``q``.
            k_scale, v_scale: an fp8 cache's scales (the module docstring); ``None``, 1.0.
            kv_dtype: ``None``, or the plan's fp8 format, checked: an fp8 plan reads ``uint8``
                caches in its own format, and a PyTorch fp8 tensor's dtype fills this in.

        Returns:
            ``out`` (a new array when ``None``), in ``q``'s dtype.

        Raises:
            TypeError, ValueError: arguments unlike the plan's (a ``kv_dtype`` naming another
                format included), an ``out`` that overlaps ``q`` without being ``q``, bad sinks
                or scales (nothing runs).
        """
        if kv_dtype is not None:
            self._arrays.check_kv_dtype(kv_dtype)
        out, q, k_cache, v_cache, out_storage, _ = self._arrays.views(q, k_cache, v_cache, out)
        if sinks is not None:
            sinks = check_sinks(self._xp, int(self._num_q_heads), sinks)
        scales = None  # the plan's record holds those of 1.0
        if self._fp8 or k_scale is not None or v_scale is not None:  # unchecked: no host read
            heads, dtype = self._layout[1], self._arrays.dtype
            checked = self.checked and not own_scales(self._trusted, k_scale, v_scale)
            scales = kv_scale_args(self._xp, dtype, heads, k_scale, v_scale, checked=checked)
        if self.num_seqs == 0:
            return out
        if sinks is None:
            kernel, merge = self._kernel, self._merge
        else:
            if self._sink_kernels is None:  # loaded at the first run with sinks
                heads = (int(self._num_q_heads), *self._layout[1:])
                self._sink_kernels = _sink_kernels(self._device, self._launch, *heads)
            kernel, merge = self._sink_kernels
        if self._cascade is not None:
            geometry = DecodeGeometry(self._grid[0], self._block, self._shared_mem)
            layer = (out_storage, q, k_cache, v_cache)
            self._cascade.run((kernel, merge), geometry, layer, scales, sinks)
            return out
        # One launch: a split sequence's last thread block merges its pieces.
        args = self._fill(out_storage, q, k_cache, v_cache, scales, sinks)
        try:
            kernel(self._grid, self._block, args, shared_mem=self._shared_mem)
            if self._merge_launch is not None:  # too many pieces for the last block
                grid, block, fill = self._merge_launch
                merge(grid, block, fill(out_storage, sinks))
        except BaseException:
            # A launch stopped part way (the CPU backend's KernelError, an interrupt) may leave
            # tickets taken: the next run must find every counter 0 again.
            if self._merge_counters is not None:
                self._merge_counters.fill(0)
            raise
        return out


def _work_list(
    num_seqs: int,
    width: int,
    tile: int,
    window: int,
    splits: int | None,
    batch_invariant: bool,
    fill: int,
    longest: int | None,
) -> tuple[int, int]:
    """The work list's ``(capacity, min_chunk)``, the planner's inputs (cuda/decode_plan.cu), for
    a batch of ``num_seqs`` over a table of ``width`` tokens: batch-invariant (fixed pieces,
    room for any lengths), balanced by tokens (``fill`` spare items), never split
    (``splits == 1``) or ``splits`` pieces of the ``longest`` context.

    Raises:
        ValueError: a work list past CUDA's grid limit (it is one grid axis).
    """
    if batch_invariant:
        attended = _attended(min(width, MAX_CONTEXT_LEN), window)
        capacity, min_chunk = invariant_work(num_seqs, attended, tile)
    elif splits is None:
        capacity, min_chunk = num_seqs + fill, MIN_SPLIT_TOKENS
    elif splits == 1:
        capacity, min_chunk = num_seqs, tile
    else:
        longest = min(max(longest, 1), width, MAX_CONTEXT_LEN)
        longest = _attended(longest, window)  # the pieces cut what is attended
        # No more pieces than whole tiles in the longest context: a larger count cuts the same
        # way, and would only lengthen the work list.
        splits = min(splits, cdiv(longest, tile))
        # capacity - num_seqs = num_seqs * splits keeps the planner's bound at or below this
        # chunk, so every sequence of the longest length gets exactly `splits` pieces.
        capacity = num_seqs * (splits + 1)
        min_chunk = cdiv(cdiv(longest, splits), tile) * tile
    if capacity <= MAX_GRID_YZ:
        return capacity, min_chunk
    if splits is not None and splits > 1:
        raise ValueError(
            f"expected num_seqs * (num_splits + 1) <= {MAX_GRID_YZ} (the work list is one grid "
            f"axis), got {num_seqs} sequences and {splits} splits; pass fewer splits, or "
            f"num_splits=None"
        )
    if batch_invariant:
        raise ValueError(
            f"expected num_seqs * (1 + ceil(attended / {min_chunk})) <= {MAX_GRID_YZ} with "
            f"batch_invariant=True (the work list is one grid axis; attended: max_blocks * "
            f"block_size, window-capped), got {num_seqs} sequences and {capacity} items; pass "
            f"fewer sequences or a narrower table"
        )
    raise ValueError(
        f"expected at most {MAX_GRID_YZ - (capacity - num_seqs)} sequences in one decode plan "
        f"(the work list is one grid axis), got {num_seqs}"
    )


def _sink_kernels(
    device: str, launch: Any, num_q_heads: int, num_kv_heads: int, _: int, head_dim: int
) -> tuple[Any, Any]:
    """The decode kernel and merge of ``launch`` with the sinks bit (a plan of a model without
    sinks never compiles them); the sizes: the query heads, then a layer's but num_blocks."""
    group = num_q_heads // num_kv_heads
    sinks_launch = dataclasses.replace(launch, name=launch.sinks_name)
    return (
        attention_kernel(device, "paged_attention.cu", sinks_launch, group, head_dim),
        get_kernel(device, "paged_attention.cu", launch.sinks_merge_name),
    )


def _attended(max_context: int, window_left: int) -> int:
    """The most keys a decode query attends in a batch whose longest context is
    ``max_context``: all of them, or ``window_left + 1`` with a window."""
    return max_context if window_left < 0 else min(max_context, window_left + 1)
