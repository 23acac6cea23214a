"""Prefill attention planned once per step and run per layer: :class:`PrefillPlan`.

A prefill or mixed step attends every layer over the same block tables, lengths and packed query
rows, so everything that depends on them alone is done once: the checks, the host lengths that
size the grid and the split-K plan, the int32 copies the kernels read, the scratch buffers of
split-K, and the resolved kernels. ``run`` is then the prefill launch and its merge::

    plan = cupaged.PrefillPlan(tables, lens, query_start_loc, cache.k[0], num_q_heads)  # per step
    for layer in range(num_layers):
        out = plan.run(q[layer], cache.k[layer], cache.v[layer])                       # per layer

The launch geometry depends on the lengths' values (the longest query run, the KV ranges of the
query tiles), which the plan reads on the host once. A caller that already has them on the host
(``StepPlan.query_start_loc``, lengths it counted) passes NumPy arrays, and nothing is read back
from the device.

Over an fp8 cache (docs/fp8.md) a plan is made for one query dtype (``q_dtype``: the tensor-core
path or not depends on it) and every ``run`` takes that layer's ``k_scale`` / ``v_scale``; a
device array of scales is read by the kernel, never by the host (but for the checked mode's
one check).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .._arrays.checks import (
    as_bool,
    as_int,
    check_index_array,
    check_num_blocks,
    check_shape,
    element_type,
)
from .._arrays.interop import takes_dlpack
from ..backend import array_module, to_numpy
from ..dtypes import dtype_name
from ..kernels.args import PrefillMergeArgs, merge_record, with_fields
from ..kernels.launch_decode import check_decode_shape, query_dtype
from ..kernels.launch_prefill import PREFILL_MERGE_THREADS, PrefillLaunch
from ..kernels.loader import get_kernel
from ..variants import Variants, check_sinks, check_variants
from .layer import (
    LayerArrays,
    attention_kernel,
    check_layer_and_heads,
    device_of,
    target,
)
from .prefill_batch import PrefillBuffers, PrefillShape, host_plan, new_record
from .scales import kv_scale_args, own_scales, trusted_memory
from .table_checks import check_prefill_tables

Q_AXES = ("total_query_tokens", "num_q_heads", "head_dim")


class PrefillPlan:
    """The prefill attention of one step, planned once and run for every layer.

    Sequence ``i``'s ``n_i`` query rows are ``query_start_loc[i] : query_start_loc[i + 1]`` of
    every layer's ``q``; ``context_lens[i]`` counts its cached tokens *including* them (written
    with :func:`cupaged.write_kv` first), so its query ``j`` sits at position
    ``context_lens[i] - n_i + j`` (see :func:`cupaged.paged_prefill`)::

        plan = PrefillPlan(tables, lens, starts, cache.k[0], 8)    # checks, host lengths, kernels
        out = plan.run(q, cache.k[layer], cache.v[layer])           # per layer: the launches

    Attention variants (``window_left``, ``logits_soft_cap``, ``alibi_slopes``; docs/variants.md)
    are fixed when planning and compiled into the kernels (what is off costs nothing); a layer's
    attention sinks go to ``run(..., sinks=)``, so one plan serves layers with and without them.

    Example:
        >>> import numpy as np, cupaged
        >>> cache = cupaged.PagedCache(8, block_size=16, num_kv_heads=2, head_dim=64,
        ...                            dtype="float32", device="cpu")
        >>> sid = cache.add_sequence()
        >>> step = cache.step([sid], num_tokens=[5], tables=True)
        >>> kv = np.zeros((5, 2, 64), np.float32)
        >>> cupaged.write_kv(cache.k[0], cache.v[0], kv, kv, step.slots)
        >>> plan = cupaged.PrefillPlan(step.block_tables, step.context_lens,
        ...                            step.query_start_loc, cache.k[0], 8)
        >>> plan.run(np.ones((5, 8, 64), np.float32), cache.k[0], cache.v[0]).shape
        (5, 8, 64)

    Args:
        block_tables: ``[num_seqs, max_blocks]`` int32 or int64, on the cache's device; the
            plan keeps its own int32 copy (a later write to the caller's array does not reach
            the kernels).
        context_lens: ``[num_seqs]`` int32 or int64, on the cache's device or a host (NumPy)
            array; copied alike.
        query_start_loc: ``[num_seqs + 1]`` int32 or int64, on the cache's device or a host
            array: 0, non-decreasing; its last value is the rows of every ``run``'s ``q``.
            Always checked (it is read on the host to size the grid), with
            ``n_i <= context_lens[i]``.
        k_cache: one layer of the cache, ``[num_blocks, num_kv_heads, block_size, head_dim]``
            (``cache.k[0]``): the layout, dtype and device every ``run`` must match.
        num_q_heads: query heads, a multiple of ``num_kv_heads``.
        scale: softmax scale; ``head_dim ** -0.5`` when ``None``.
        causal: mask the tokens after each query's position (``True``, prefill), or attend to
            the whole context (``False``). A bool.
        num_splits: cut every query tile's KV range into about this many pieces, one thread
            block each, merged by log-sum-exp (split-K); the heuristic in
            ``cupaged.kernels.launch_prefill`` decides when ``None`` (it splits only batches too
            small to fill the GPU). Refused with ``batch_invariant=True``.
        batch_invariant: ``True``: every query row's output is bitwise the same in any batch and
            at any position in it (on one device and build; docs/batch-invariance.md): no
            split-K, so a row's KV range is walked by one thread block in one order (a query
            tile's rows are its own sequence's, from that sequence's first row, in either
            mode). ``False`` (default): split-K when the batch is small, whose pieces depend on
            the whole batch's tokens.
        checked: check, once here, that every context length is in
            ``[0, max_blocks * block_size]`` and every block id a length reaches is in
            ``[0, num_blocks)``, on the arrays' own dtypes before they are narrowed to int32
            (one synchronisation on a GPU). ``checked=False`` *trusts* the caller: a bad id or
            length reads outside the cache (garbage output or a crash). Pass it only for tables
            and lengths built by cupaged (``PagedCache.block_tables``, ``StepPlan``). With a
            window, only the entries from each sequence's first reachable key,
            ``max(0, context_lens[i] - n_i - window_left)``, on are checked (and read). It
            checks each :meth:`run`'s scale arrays too (positive and finite; one more
            synchronisation); ``checked=False`` trusts them as well.
        tables_checked: the checks of the tables and lengths alone: ``None``, as ``checked``;
            ``False`` trusts them (``PagedCache`` passes it for its own) while each run's
            arguments are still checked as ``checked`` says.
        trusted_scales: arrays whose values were checked when they were written (``PagedCache``
            passes its K and V scales): a run's scale array that is one of them, or a view of
            one, is not checked again.
        window_left: a query at position ``p`` attends keys from ``p - window_left`` on (causal
            or not); ``-1``: no window. The kernels skip the KV tiles before each query tile's
            window and never read the table entries before a sequence's first reachable key
            (a sliding-window cache releases them, ``-1``).
        logits_soft_cap: ``> 0``: scores soft-capped, ``cap * tanh(s / cap)``; ``0.0``: none.
        alibi_slopes: ``[num_q_heads]`` float32 on the cache's device (``s += slope[h] * (j -
            p)``), or ``None``; the plan keeps its own copy. Sinks, learned per layer, go to
            :meth:`run`.
        q_dtype: over an fp8 cache, the dtype of every ``run``'s queries (and output):
            ``"float32"``, ``"float16"`` (``None``) or ``"bfloat16"``; for another cache
            ``None`` or the cache's dtype.
        kv_dtype: the fp8 format of a ``uint8`` cache (``"float8_e4m3"``, ``"float8_e5m2"``);
            ``None`` for a cache whose dtype says what it holds.

    Raises:
        TypeError: arrays on different devices, wrong dtypes, a ``causal`` that is not a bool,
            a variant of the wrong type, a ``q_dtype`` the cache does not take, a ``uint8``
            cache without ``kv_dtype`` or a ``kv_dtype`` for a cache that is not fp8.
        ValueError: wrong shapes, an unsupported head_dim or block_size (the message lists the
            supported ones), a bad ``query_start_loc``, ``n_i > context_lens[i]``, (checked)
            bad context lengths or block ids, a bad variant (``window_left < -1``, a negative
            or non-finite soft-cap, slopes of the wrong shape), or ``num_splits`` with
            ``batch_invariant=True``.
    """

    __slots__ = (
        "_arrays",
        "_buffers",
        "_fill",
        "_fits",
        "_kernel",
        "_launch",
        "_merge",
        "_merge_fill",
        "_record",
        "_shape",
        "_sinks_kernels",
        "_trusted",
        "_values",
        "_variants",
        "_xp",
        "batch_invariant",
        "causal",
        "checked",
        "num_seqs",
        "total_query_tokens",
    )

    @takes_dlpack
    def __init__(
        self,
        block_tables: Any,
        context_lens: Any,
        query_start_loc: Any,
        k_cache: Any,
        num_q_heads: int,
        *,
        scale: float | None = None,
        causal: bool = True,
        num_splits: int | None = None,
        batch_invariant: bool = False,
        checked: bool = True,
        tables_checked: bool | None = None,
        trusted_scales: tuple[Any, ...] = (),
        window_left: int = -1,
        logits_soft_cap: float = 0.0,
        alibi_slopes: Any = None,
        q_dtype: str | None = None,
        kv_dtype: Any = None,
    ) -> None:
        xp = array_module(block_tables, k_cache)
        if tables_checked is None:
            tables_checked = checked
        else:
            tables_checked = as_bool(tables_checked, "tables_checked")
        check_metadata_devices(xp, context_lens, query_start_loc)
        num_blocks, num_kv_heads, block_size, head_dim, num_q_heads = check_layer_and_heads(
            k_cache, num_q_heads
        )
        causal = as_bool(causal, "causal")
        variants = check_variants(xp, num_q_heads, window_left, logits_soft_cap, alibi_slopes)
        splits = None if num_splits is None else as_int(num_splits, "num_splits")
        if splits is not None and splits < 1:
            raise ValueError(f"expected num_splits >= 1, got {splits}")
        batch_invariant = as_bool(batch_invariant, "batch_invariant")
        if batch_invariant:
            if splits is not None:
                raise ValueError(
                    f"expected num_splits=None with batch_invariant=True (which never splits), "
                    f"got num_splits={splits}"
                )
            splits = 1  # split-K's pieces follow the batch's tokens; one block walks a range
        dtype = element_type(k_cache, kv_dtype)
        q_dtype = query_dtype(dtype, None if q_dtype is None else dtype_name(q_dtype))
        check_decode_shape(dtype, head_dim, block_size)
        num_seqs, max_blocks = check_batch_arrays(block_tables, context_lens, query_start_loc)
        check_num_blocks(num_blocks)
        self.num_seqs = num_seqs
        self.causal, self.checked = causal, checked  # (checked: of each run's arguments)
        self.batch_invariant = batch_invariant
        self._trusted = trusted_memory(trusted_scales)
        self._xp, self._variants = xp, variants
        self._shape = PrefillShape(
            device_of(xp),
            dtype,
            q_dtype,
            num_seqs,
            max_blocks,
            num_blocks,
            num_kv_heads,
            num_q_heads,
            head_dim,
            block_size,
            causal,
            splits,
            variants,
            target(device_of(xp)),
        )
        self._sinks_kernels = self._launch = self._record = self._kernel = self._values = None
        self._buffers = PrefillBuffers()
        self._plan_batch(block_tables, context_lens, query_start_loc, tables_checked, scale)
        self._arrays = LayerArrays(
            xp,
            dtype,
            tuple(k_cache.shape),
            Q_AXES,
            (self.total_query_tokens, num_q_heads, head_dim),
            kv_dtype=kv_dtype,
            q_dtype=q_dtype,
        )

    def _plan_batch(
        self,
        block_tables: Any,
        context_lens: Any,
        query_start_loc: Any,
        tables_checked: bool,
        scale: float | None = None,
    ) -> None:
        """Plan the batch of these tables and lengths (the shapes the plan was made for): check
        them, read the lengths on the host (nothing to read for host arrays), decide the launch,
        and lay the plan's own int32 copies (one upload of the lengths and ``query_start_loc``,
        packed; the tables copied on the device) into buffers kept from an earlier batch of
        these shapes, the split-K scratch too when large enough. ``scale``: the first batch's
        (the records keep it).

        Lengths and starts equal to the last batch's (a model's next layer) keep what was
        decided and uploaded from them: the same values pass the same host checks to the same
        launch. The tables are copied (and, checked, checked) every time.

        The host checks and the launch come before anything of the plan is written; on a GPU the
        checked mode's table check reads the plan's own copy of the lengths (equal to the
        caller's: they were checked in range on the host before narrowing), so a failing
        check leaves the copies written: a plan whose re-planning raised is thrown away
        (``paged_prefill``'s reuse never keeps one).
        """
        xp, buffers, shape = self._xp, self._buffers, self._shape
        host_starts, host_lens = to_numpy(query_start_loc), to_numpy(context_lens)
        values = (host_starts.dtype, host_starts.tobytes(), host_lens.dtype, host_lens.tobytes())
        same = values == self._values
        self._values = None  # until this batch is planned whole
        if not same:
            launch, fits = host_plan(shape, host_starts, host_lens)
            total = int(host_starts[-1])
            partial = buffers.partial(xp, total, shape.num_q_heads, launch, shape.head_dim)
            # From here on the plan's own buffers are written (for a new plan: made).
            buffers.upload_metadata(xp, host_lens, host_starts)
        buffers.copy_tables(xp, block_tables)
        if tables_checked:  # on the caller's tables, before they are narrowed to int32
            first_keys = _first_keys(self._variants, host_starts, host_lens)
            # the plan's int32 lengths where they equal the caller's (all within the table)
            lens = buffers.lens if (fits if not same else self._fits) else xp.asarray(context_lens)
            check_prefill_tables(block_tables, lens, shape.block_size, shape.num_blocks, first_keys)
        if not same:
            self.total_query_tokens, self._launch, self._fits = total, launch, fits
            self._sinks_kernels = None
            if launch is not None:
                self._lay_out(launch, partial, scale)
        self._values = values

    def _lay_out(self, launch: PrefillLaunch, partial: tuple[Any, Any], scale: Any) -> None:
        """The kernels and argument records of a batch's launch, over the plan's buffers."""
        shape, (partial_out, partial_lse) = self._shape, partial
        if self._kernel is None or shape.device == "cpu":  # the CPU's workers follow the grid
            self._kernel = attention_kernel(
                shape.device, "paged_prefill.cu", launch, shape.group, shape.head_dim
            )
        record = self._record
        if record is None:
            record = new_record(self._xp, shape, launch, self._buffers, partial_lse, scale)
        elif (
            record.partial_out is partial_out
            and record.num_splits == launch.num_splits
            and record.partition_tokens == launch.partition_tokens
        ):
            return  # the records of the last batch hold
        self._record = record = with_fields(  # the split-K scratch may have grown
            record,
            partial_out=partial_out,
            partial_lse=partial_lse,
            partition_tokens=np.int32(launch.partition_tokens),
            num_splits=np.int32(launch.num_splits),
        )
        self._fill = record.filler()
        self._merge = None
        if launch.num_splits > 1:
            self._merge = get_kernel(shape.device, "paged_prefill.cu", launch.merge_name)
            self._merge_fill = merge_record(record, PrefillMergeArgs).filler()

    @property
    def num_splits(self) -> int:
        """Thread blocks per query tile and head chunk (1: no split-K, no merge launch)."""
        return 1 if self._launch is None else self._launch.num_splits

    @property
    def kernel_name(self) -> str | None:
        """The instantiation the launch table picked (a RawModule name expression, e.g.
        ``cupaged::paged_prefill_flash<__half, 128, 16, 16, 128, 2, 128>``); ``None`` when nothing
        runs (no query tokens). What benchmarks print beside their times."""
        return None if self._launch is None else self._launch.name

    @property
    def window_left(self) -> int:
        """The sliding window: a query at position ``i`` sees keys from ``i - window_left`` on
        (``-1``: no window)."""
        return self._variants.window_left

    @property
    def logits_soft_cap(self) -> float:
        """The soft-cap of the scores, ``cap * tanh(s / cap)`` (``0.0``: none)."""
        return self._variants.logits_soft_cap

    @takes_dlpack
    def run(
        self,
        q: Any,
        k_cache: Any,
        v_cache: Any,
        *,
        k_scale: Any = None,
        v_scale: Any = None,
        sinks: Any = None,
        out: Any = None,
        kv_dtype: Any = None,
    ) -> Any:
        """Prefill attention of one layer: what :func:`cupaged.paged_prefill` computes.

        Args:
            q: ``[total_query_tokens, num_q_heads, head_dim]``, the cache's element type (over
                fp8: the plan's ``q_dtype``).
            k_cache: one layer, the planned layout (``cache.k[layer]``), C-contiguous, 16-byte
                aligned.
            v_cache: same shape and dtype as ``k_cache``.
            k_scale, v_scale: an fp8 cache's scales of this layer (it holds ``x / scale``):
                ``None`` (1.0), a positive finite number, or a float32 ``[]``, ``[1]`` or
                ``[num_kv_heads]`` array on the cache's device, which the kernel reads (checked
                on the device with the plan's ``checked``, one synchronisation, unless it is
                one of the plan's ``trusted_scales``; trusted without). ``None`` for any other
                cache.
            sinks: optional ``[num_q_heads]`` float32 attention sinks of this layer, on the
                cache's device: a learned logit per query head in each row's softmax
                denominator only (gpt-oss). The first run with sinks loads their kernels.
            out: optional ``[total_query_tokens, num_q_heads, head_dim]`` C-contiguous output,
                ``q``'s dtype: ``q`` itself (in place) or memory that does not overlap ``q``.
            kv_dtype: ``None``, or the plan's fp8 format, checked: an fp8 plan reads ``uint8``
                caches in its own format, and a PyTorch fp8 tensor's dtype fills this in.

        Returns:
            ``out`` (a new array when ``None``), in ``q``'s dtype.

        Raises:
            TypeError, ValueError: an argument that does not match the plan (a ``kv_dtype``
                naming another format included), an ``out`` that overlaps ``q`` without being
                ``q``, sinks not a float32 ``[num_q_heads]`` array
                of the plan's device, or a bad scale (not positive and finite, of the wrong
                shape, dtype or device; any scale for a cache that is not fp8): nothing is run.
        """
        if kv_dtype is not None:
            self._arrays.check_kv_dtype(kv_dtype)
        if sinks is not None:
            sinks = check_sinks(self._xp, self._shape.num_q_heads, sinks)
        scales = None  # the plan's record holds those of 1.0
        if k_scale is not None or v_scale is not None:
            elem, heads = self._arrays.dtype, self._shape.num_kv_heads
            checked = self.checked and not own_scales(self._trusted, k_scale, v_scale)
            scales = kv_scale_args(self._xp, elem, heads, k_scale, v_scale, checked=checked)
        out, q, k_cache, v_cache, out_storage, _ = self._arrays.views(q, k_cache, v_cache, out)
        launch = self._launch
        if launch is None:
            return out
        if sinks is None:
            kernel, merge = self._kernel, self._merge
        else:
            kernel, merge = self._sinks_kernels or self._load_sinks_kernels()
        args = self._fill(out_storage, q, k_cache, v_cache, scales, sinks)
        kernel(launch.grid, launch.block, args, shared_mem=launch.shared_mem)
        if merge is not None:
            threads = (PREFILL_MERGE_THREADS,)
            merge(launch.merge_grid, threads, self._merge_fill(out_storage, sinks))
        return out

    def _load_sinks_kernels(self) -> tuple[Any, Any]:
        """The kernel and merge of a run with sinks, loaded on the first one (most plans never
        run with sinks: their kernels are not compiled)."""
        launch, shape = self._launch, self._shape
        sinks_launch = dataclasses.replace(launch, name=launch.sinks_name)
        kernel = attention_kernel(
            shape.device, "paged_prefill.cu", sinks_launch, shape.group, shape.head_dim
        )
        merge = None
        if self._merge is not None:
            merge = get_kernel(shape.device, "paged_prefill.cu", launch.sinks_merge_name)
        self._sinks_kernels = (kernel, merge)
        return self._sinks_kernels


def replan(
    plan: PrefillPlan,
    block_tables: Any,
    context_lens: Any,
    query_start_loc: Any,
    *,
    tables_checked: bool,
) -> None:
    """Re-plan ``plan`` for another batch of the shapes it was made for (the one-shot
    :func:`cupaged.paged_prefill`'s reuse, ``cupaged/attention/reuse.py``): what a new plan of
    these arrays would check and decide, in the plan's own buffers. The caller has checked the
    arrays' shapes, dtypes and devices against the plan's (its reuse key).

    Raises:
        ValueError: what :class:`PrefillPlan` raises for these arrays, or another count of
            query tokens than planned; the plan may then hold this batch's copies and must be
            thrown away.
    """
    total = int(to_numpy(query_start_loc)[-1])
    if total != plan.total_query_tokens:
        raise ValueError(
            f"expected query_start_loc to end at the plan's {plan.total_query_tokens} query "
            f"tokens, got {total}"
        )
    batch = (block_tables, context_lens, query_start_loc, tables_checked)
    plan._plan_batch(*batch)  # private: the plan's own module re-plans it


def check_metadata_devices(xp: Any, context_lens: Any, query_start_loc: Any) -> None:
    """The lengths and ``query_start_loc`` of a prefill on the tables' device (``xp``) or in
    host memory (NumPy: the form that is never read back from a GPU).

    Raises:
        TypeError: an array of another kind, naming it.
    """
    for name, x in (("context_lens", context_lens), ("query_start_loc", query_start_loc)):
        if type(x) is not np.ndarray and array_module(x) is not xp:
            raise TypeError(
                f"expected {name} on the cache's device or in host memory, got {type(x).__name__}"
            )


def check_batch_arrays(block_tables: Any, context_lens: Any, query_start_loc: Any) -> tuple:
    """The shapes and index dtypes of a prefill's tables and lengths (metadata only):
    ``(num_seqs, max_blocks)``.

    Raises:
        ValueError, TypeError: naming the array, what was expected and what arrived.
    """
    num_seqs, max_blocks = check_shape(
        "block_tables", block_tables, [("num_seqs", None), ("max_blocks", None)]
    )
    check_shape("context_lens", context_lens, [("num_seqs", num_seqs)])
    check_shape("query_start_loc", query_start_loc, [("num_seqs + 1", num_seqs + 1)])
    for name, x in (
        ("block_tables", block_tables),
        ("context_lens", context_lens),
        ("query_start_loc", query_start_loc),
    ):
        check_index_array(name, x)
    return num_seqs, max_blocks


def _first_keys(variants: Variants, host_starts: np.ndarray, host_lens: np.ndarray) -> Any:
    """The first key position any query of each sequence may see, ``max(0, L - n -
    window_left)`` (host, int64), or ``None`` without a window (every entry from 0 is read)."""
    if variants.window_left < 0:
        return None
    past = host_lens.astype(np.int64) - np.diff(host_starts.astype(np.int64))
    return variants.first_key(past)
