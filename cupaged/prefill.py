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
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _launch
from ._attention import (
    LayerArrays,
    attention_kernel,
    check_layer_and_heads,
    device_of,
    owned_int32,
    target,
)
from ._backend import array_module, to_numpy
from ._checks import (
    INT32_MAX,
    MAX_CONTEXT_LEN,
    as_bool,
    as_int,
    check_decode_tables,
    check_index_array,
    check_num_blocks,
    check_query_start_loc,
    check_shape,
    element_type,
)
from ._kernels import get_kernel

Q_AXES = ("total_query_tokens", "num_q_heads", "head_dim")


class PrefillPlan:
    """The prefill attention of one step, planned once and run for every layer.

    Sequence ``i``'s ``n_i`` query rows are ``query_start_loc[i] : query_start_loc[i + 1]`` of
    every layer's ``q``; ``context_lens[i]`` counts its cached tokens *including* them (written
    with :func:`cupaged.write_kv` first), so its query ``j`` sits at position
    ``context_lens[i] - n_i + j`` (see :func:`cupaged.paged_prefill`)::

        plan = PrefillPlan(tables, lens, starts, cache.k[0], 8)    # checks, host lengths, kernels
        out = plan.run(q, cache.k[layer], cache.v[layer])           # per layer: the launches

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
            block each, merged by log-sum-exp (split-K); the heuristic in ``cupaged._launch``
            decides when ``None`` (it splits only batches too small to fill the GPU).
        checked: check, once here, that every context length is in
            ``[0, max_blocks * block_size]`` and every block id a length reaches is in
            ``[0, num_blocks)``, on the arrays' own dtypes before they are narrowed to int32
            (one synchronisation on a GPU). ``checked=False`` *trusts* the caller: a bad id or
            length reads outside the cache (garbage output or a crash). Pass it only for tables
            and lengths built by cupaged (``PagedCache.block_tables``, ``StepPlan``).

    Raises:
        TypeError: arrays on different devices, wrong dtypes, or a ``causal`` that is not a bool.
        ValueError: wrong shapes, an unsupported head_dim or block_size (the message lists the
            supported ones), a bad ``query_start_loc``, ``n_i > context_lens[i]``, or (checked)
            bad context lengths or block ids.
    """

    __slots__ = (
        "_arrays",
        "_args",
        "_kernel",
        "_launch",
        "_merge",
        "_merge_args",
        "causal",
        "checked",
        "num_seqs",
        "total_query_tokens",
    )

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
        checked: bool = True,
    ) -> None:
        xp = array_module(block_tables, k_cache)
        for name, x in (("context_lens", context_lens), ("query_start_loc", query_start_loc)):
            if array_module(x) not in (xp, np):
                raise TypeError(
                    f"expected {name} on the cache's device or in host memory, got "
                    f"{type(x).__name__}"
                )
        num_blocks, num_kv_heads, block_size, head_dim, num_q_heads = check_layer_and_heads(
            k_cache, num_q_heads
        )
        causal = as_bool(causal, "causal")
        splits = None if num_splits is None else as_int(num_splits, "num_splits")
        if splits is not None and splits < 1:
            raise ValueError(f"expected num_splits >= 1, got {splits}")
        dtype = element_type(k_cache)
        _launch.check_decode_shape(dtype, head_dim, block_size)
        num_seqs, max_blocks = check_shape(
            "block_tables", block_tables, [("num_seqs", None), ("max_blocks", None)]
        )
        check_shape("context_lens", context_lens, [("num_seqs", num_seqs)])
        check_shape("query_start_loc", query_start_loc, [("num_seqs + 1", num_seqs + 1)])
        check_index_array("block_tables", block_tables)
        check_index_array("context_lens", context_lens)
        check_index_array("query_start_loc", query_start_loc)
        check_num_blocks(num_blocks)

        # Host copies of two [num_seqs]-sized arrays (none made for host arrays): the grid
        # needs the longest query run, and the split-K plan the tiles' KV ranges.
        host_starts, host_lens = to_numpy(query_start_loc), to_numpy(context_lens)
        total = int(host_starts[-1])
        if total > INT32_MAX:
            raise ValueError(f"expected at most {INT32_MAX} query tokens, got {total}")
        max_query_len = check_query_start_loc(host_starts, host_lens, total)
        lens = xp.asarray(context_lens)  # the device's copy of host lengths, on their own dtype
        if checked:  # on the caller's arrays, before they are narrowed to int32
            check_decode_tables(block_tables, lens, block_size, num_blocks)
        self.num_seqs, self.total_query_tokens = num_seqs, total
        self.causal, self.checked = causal, checked
        q_shape = (total, num_q_heads, head_dim)
        self._arrays = LayerArrays(xp, dtype, tuple(k_cache.shape), Q_AXES, q_shape)
        if total == 0:  # nothing to attend: run only checks its arguments
            self._launch = None
            return

        device = device_of(xp)
        group = num_q_heads // num_kv_heads
        launch = _launch.prefill_launch(
            dtype,
            num_seqs,
            num_kv_heads,
            group,
            head_dim,
            block_size,
            max_query_len,
            query_start_loc=host_starts,
            context_lens=np.minimum(host_lens.astype(np.int64), MAX_CONTEXT_LEN),
            causal=causal,
            splits=splits,
            total_query_tokens=total,
            target=target(device),
        )
        self._launch = launch
        self._kernel = attention_kernel(device, "paged_prefill.cu", launch, group, head_dim)
        tables = owned_int32(xp, block_tables)
        lens, starts = owned_int32(xp, lens), owned_int32(xp, query_start_loc)
        if launch.num_splits > 1:
            split_shape = (total, num_q_heads, launch.num_splits)
            partial_out = xp.empty((*split_shape, head_dim), np.float32)
            partial_lse = xp.empty(split_shape, np.float32)
        else:  # unused by the kernel; real arrays so that no argument is a null pointer
            partial_out = partial_lse = xp.empty(1, np.float32)
        scale = head_dim**-0.5 if scale is None else float(scale)
        scalars = (
            num_kv_heads,
            group,
            launch.heads_per_block,
            max_blocks,
            num_seqs,
            launch.query_rows,
            int(causal),
            launch.partition_tokens,
            launch.num_splits,
        )
        # The kernel's arguments but out, q and the layer's K/V: (before them, after them).
        self._args = (
            (partial_out, partial_lse),
            (tables, lens, starts, *map(np.int32, scalars), np.float32(scale)),
        )
        self._merge = None
        if launch.num_splits > 1:
            self._merge = get_kernel(device, "paged_prefill.cu", launch.merge_name)
            splits_of = (launch.partition_tokens, launch.num_splits)
            self._merge_args = (
                (partial_out, partial_lse, lens, starts),
                tuple(map(np.int32, (num_seqs, int(causal), *splits_of))),
            )

    @property
    def num_splits(self) -> int:
        """Thread blocks per query tile and head chunk (1: no split-K, no merge launch)."""
        return 1 if self._launch is None else self._launch.num_splits

    def run(self, q: Any, k_cache: Any, v_cache: Any, *, out: Any = None) -> Any:
        """Prefill attention of one layer: what :func:`cupaged.paged_prefill` computes.

        Args:
            q: ``[total_query_tokens, num_q_heads, head_dim]``, the cache's element type.
            k_cache: one layer, the planned layout (``cache.k[layer]``), C-contiguous, 16-byte
                aligned.
            v_cache: same shape and dtype as ``k_cache``.
            out: optional ``[total_query_tokens, num_q_heads, head_dim]`` C-contiguous output,
                ``q``'s dtype.

        Returns:
            ``out`` (a new array when ``None``), in ``q``'s dtype.

        Raises:
            TypeError, ValueError: an argument that does not match the plan (nothing is run).
        """
        out, q, k_cache, v_cache, out_storage = self._arrays.views(q, k_cache, v_cache, out)
        launch = self._launch
        if launch is None:
            return out
        partials, rest = self._args
        self._kernel(
            launch.grid,
            launch.block,
            (out_storage, *partials, q, k_cache, v_cache, *rest),
            shared_mem=launch.shared_mem,
        )
        if self._merge is not None:
            threads = (_launch.PREFILL_MERGE_THREADS,)
            arrays, merge_scalars = self._merge_args
            self._merge(launch.merge_grid, threads, (out_storage, *arrays, *merge_scalars))
        return out
