"""The functional API: NumPy-style functions on raw cache arrays, run by the kernels in ``cuda/``.

The array module of the inputs picks the backend: CuPy arrays run the CUDA kernels on the GPU
(CuPy ``RawModule``), NumPy arrays run the *same kernel source* on the CPU backend; mixing them is
a ``TypeError``. Every function checks shapes, dtypes, contiguity and alignment before launching,
so a rejected call changes nothing. Launch configurations come from ``cupaged._launch``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import operator
from typing import Any

import numpy as np

from . import _launch
from ._backend import array_module, device_module, to_numpy
from ._checks import (
    INT32_MAX,
    ITEMSIZES,
    MAX_CONTEXT_LEN,
    check_attention_args,
    check_copy_pairs,
    check_decode_tables,
    check_dtype,
    check_index_array,
    check_num_blocks,
    check_prefill_args,
    check_query_start_loc,
    check_shape,
    check_slots,
    check_writable,
    element_type,
)
from ._kernels import get_kernel
from .dtypes import as_storage

_LAYER_AXES = ("num_blocks", "num_kv_heads", "block_size", "head_dim")


def write_kv(
    k_cache: Any, v_cache: Any, k: Any, v: Any, slot_mapping: Any, *, checked: bool = True
) -> None:
    """Write new tokens' keys and values into one layer of a paged cache, in place.

    Token ``t`` goes to block ``slot_mapping[t] // block_size`` at offset
    ``slot_mapping[t] % block_size``; a slot of ``-1`` skips the token (padding)::

        slot = block * block_size + offset        block_size = 4, slot 9 -> block 2, offset 1

    Args:
        k_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]`` float32, float16 or bfloat16
            (``uint16``), C-contiguous, written in place.
        v_cache: same shape and dtype as ``k_cache``, written in place.
        k: ``[num_tokens, num_kv_heads, head_dim]``, same element type as the cache.
        v: same shape and element type as ``k``.
        slot_mapping: ``[num_tokens]`` int32 or int64.
        checked: check, before the launch and on the arrays' device (one synchronisation on a
            GPU), that every slot is ``-1`` or inside the cache and that no slot appears twice.
            ``checked=False`` skips that and *trusts* the caller: a slot out of range writes
            outside the cache (memory corruption or a crash), a repeated slot races. Pass it only
            for slot mappings built by cupaged itself (``PagedCache.reserve``).

    Raises:
        TypeError: arrays on different devices, or wrong dtypes.
        ValueError: wrong shapes, a cache that is not C-contiguous or is read-only, or (checked)
            a slot out of range or repeated.
    """
    xp = _array_module(k_cache, v_cache, k, v, slot_mapping)
    shapes = _checked_shapes(
        _write_shapes, _check_write_shapes, k_cache, v_cache, k, v, slot_mapping
    )
    elem, num_blocks, num_kv_heads, block_size, head_dim, num_tokens = shapes
    _check_target_caches(k_cache, v_cache, num_blocks)
    if checked and num_tokens:
        check_slots(slot_mapping, num_blocks * block_size)
    if num_tokens == 0:
        return
    k_cache, v_cache = as_storage(k_cache), as_storage(v_cache)
    k, v = xp.ascontiguousarray(as_storage(k)), xp.ascontiguousarray(as_storage(v))
    slots = xp.ascontiguousarray(slot_mapping)
    aligned = all(_address(x) % 16 == 0 for x in (k_cache, v_cache, k, v))
    kernel, grid, block, scalars = _write_plan(
        _device(xp), _device_id(xp), elem, slots.dtype, shapes[2:], aligned
    )
    kernel(grid, block, (k, v, k_cache, v_cache, slots, *scalars))


_shape_and_dtype = operator.attrgetter("shape", "dtype")


def _checked_shapes(memo: dict[tuple, tuple], check: Any, *arrays: Any) -> tuple:
    """``check(*arrays)`` (the checks of a call that read only shapes and dtypes), run once per
    combination of the arrays' shapes and dtypes and then remembered in ``memo`` (bounded: cleared
    when full): a step repeats the same combination, and the checks cost as much as a small
    launch. A failing check raises on every call."""
    key = tuple(map(_shape_and_dtype, arrays))
    shapes = memo.get(key)
    if shapes is None:
        shapes = check(*arrays)
        if len(memo) >= 256:
            memo.clear()
        memo[key] = shapes
    return shapes


# Shapes and dtypes of write_kv / copy_blocks / paged_prefill calls whose checks passed -> what
# the checks return.
_write_shapes: dict[tuple, tuple[str, int, int, int, int, int]] = {}
_copy_shapes: dict[tuple, tuple[str, int, int]] = {}
_prefill_shapes: dict[tuple, Any] = {}
# (dims, lengths' bytes, ...) -> the PrefillLaunch of a paged_prefill call whose lengths passed
# their check (bounded: cleared when full).
_prefill_plans: dict[tuple, Any] = {}


def _check_prefill_shapes(*arrays: Any) -> Any:
    """The shape and dtype checks of ``paged_prefill``: its ``AttentionDims``."""
    dims = check_prefill_args(*arrays)
    _launch.check_decode_shape(dims.dtype, dims.head_dim, dims.block_size)
    return dims


def _check_write_shapes(
    k_cache: Any, v_cache: Any, k: Any, v: Any, slot_mapping: Any
) -> tuple[str, int, int, int, int, int]:
    """The shape and dtype checks of ``write_kv``: ``(element type, num_blocks, num_kv_heads,
    block_size, head_dim, num_tokens)``."""
    num_blocks, num_kv_heads, block_size, head_dim = check_shape(
        "k_cache", k_cache, [(axis, None) for axis in _LAYER_AXES]
    )
    check_shape("v_cache", v_cache, list(zip(_LAYER_AXES, k_cache.shape, strict=True)))
    token_dims = [("num_tokens", None), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)]
    num_tokens, _, _ = check_shape("k", k, token_dims)
    check_shape("v", v, [("num_tokens", num_tokens), *token_dims[1:]])
    check_shape("slot_mapping", slot_mapping, [("num_tokens", num_tokens)])
    check_index_array("slot_mapping", slot_mapping)
    elem = element_type(k_cache)
    for name, x, why in (("v_cache", v_cache, "k_cache's dtype"), ("k", k, "the cache's dtype"),
                         ("v", v, "the cache's dtype")):  # fmt: skip
        if element_type(x) != elem:
            check_dtype(name, x, elem, why)
    return elem, num_blocks, num_kv_heads, block_size, head_dim, num_tokens


@functools.lru_cache(maxsize=256)
def _write_plan(
    device: str,
    device_id: int,
    elem: str,
    slot_dtype: np.dtype,
    dims: tuple[int, ...],
    aligned: bool,
) -> tuple[Any, tuple, tuple, tuple]:
    """Kernel, grid, block and scalar arguments of one ``write_kv`` shape (``dims``: num_kv_heads,
    block_size, head_dim, num_tokens), kept like :func:`_copy_plan`'s."""
    num_kv_heads, block_size, head_dim, num_tokens = dims
    name, grid, block = _launch.write_kv_launch(
        elem, slot_dtype, num_tokens, head_dim * ITEMSIZES[elem], aligned, num_kv_heads, device
    )
    kernel = get_kernel(device, "write_kv.cu", name)
    if device == "cpu":  # one OS thread unless the launch is large (see cpu_stride_workers)
        token_bytes = 2 * num_kv_heads * head_dim * ITEMSIZES[elem]
        kernel = kernel.with_workers(_launch.cpu_stride_workers(num_tokens, token_bytes))
    return kernel, grid, block, (np.int32(num_kv_heads), np.int32(block_size), np.int32(head_dim))


def copy_blocks(k_cache: Any, v_cache: Any, src: Any, dst: Any, *, checked: bool = True) -> None:
    """Copy block ``src[i]`` onto block ``dst[i]`` in every layer of K and V, in place, in one launch.

    Copy-on-write uses it to give a sequence its own copy of a shared block. The pairs are copied
    in parallel, so an id that is both a source and a destination, or a repeated destination, would
    give an undefined result; the checks reject both.

    Args:
        k_cache: ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`` (the whole cache)
            or ``[num_blocks, num_kv_heads, block_size, head_dim]`` (one layer), C-contiguous.
        v_cache: same shape and dtype as ``k_cache``.
        src: ``[num_copies]`` int32 or int64 block ids.
        dst: ``[num_copies]`` int32 or int64 block ids.
        checked: check, before the launch and on the arrays' device (one synchronisation on a
            GPU), that ids are in ``[0, num_blocks)``, destinations distinct, and no id both a
            source and a destination. ``checked=False`` skips that and *trusts* the caller: an id
            out of range reads or writes outside the cache (memory corruption or a crash). Pass
            it only for pairs that cupaged planned itself (copy-on-write in ``PagedCache``).

    Raises:
        TypeError: arrays on different devices, or wrong dtypes.
        ValueError: wrong shapes, caches that are not C-contiguous or are read-only, or
            (checked) bad block ids.
    """
    xp = _array_module(k_cache, v_cache, src, dst)
    elem, num_blocks, num_copies = _checked_shapes(
        _copy_shapes, _check_copy_shapes, k_cache, v_cache, src, dst
    )
    _check_target_caches(k_cache, v_cache, num_blocks)
    if checked and num_copies:
        check_copy_pairs(src, dst, num_blocks)
    if num_copies == 0:
        return
    aligned = _address(k_cache) % 16 == 0 and _address(v_cache) % 16 == 0
    kernel, grid, block, scalars = _copy_plan(
        _device(xp), _device_id(xp), k_cache.shape, elem, aligned, num_copies
    )
    if src.dtype != np.int32 or not src.flags.c_contiguous:
        src = xp.ascontiguousarray(src, dtype=np.int32)
    if dst.dtype != np.int32 or not dst.flags.c_contiguous:
        dst = xp.ascontiguousarray(dst, dtype=np.int32)
    kernel(grid, block, (k_cache, v_cache, src, dst, *scalars))


def _check_copy_shapes(k_cache: Any, v_cache: Any, src: Any, dst: Any) -> tuple[str, int, int]:
    """The shape and dtype checks of ``copy_blocks``: ``(element type, num_blocks, num_copies)``."""
    if k_cache.ndim not in (4, 5):
        raise ValueError(
            "expected k_cache of shape ([num_layers,] num_blocks, num_kv_heads, block_size, "
            f"head_dim), got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        axes = ("num_layers",) * (k_cache.ndim - 4) + _LAYER_AXES
        check_shape("v_cache", v_cache, list(zip(axes, k_cache.shape, strict=True)))
    elem = element_type(k_cache)
    if element_type(v_cache) != elem:
        check_dtype("v_cache", v_cache, elem, "k_cache's dtype")
    if src.ndim != 1 or dst.shape != src.shape:
        (num_copies,) = check_shape("src", src, [("num_copies", None)])
        check_shape("dst", dst, [("num_copies", num_copies)])
    check_index_array("src", src)
    check_index_array("dst", dst)
    return elem, k_cache.shape[-4], src.shape[0]


@functools.lru_cache(maxsize=256)
def _copy_plan(
    device: str, device_id: int, shape: tuple[int, ...], elem: str, aligned: bool, num_copies: int
) -> tuple[Any, tuple, tuple, tuple]:
    """Kernel, grid, block and scalar arguments of one ``copy_blocks`` shape (kept: a copy-on-write
    step repeats the same shape, and each lookup would cost as much as a small copy)."""
    num_layers = shape[0] if len(shape) == 5 else 1
    num_blocks, heads, tokens, dim = shape[-4:]
    block_bytes = heads * tokens * dim * ITEMSIZES[elem]
    name, grid, block, word = _launch.copy_blocks_launch(
        block_bytes, aligned, num_copies, num_layers, device
    )
    kernel = get_kernel(device, "copy_blocks.cu", name)
    if device == "cpu":  # one OS thread unless the launch is large (see cpu_stride_workers)
        kernel = kernel.with_workers(_launch.cpu_stride_workers(grid[0] * grid[1] * grid[2],
                                                                block_bytes))  # fmt: skip
    return kernel, grid, block, (np.int32(num_blocks), np.int64(block_bytes // word))


def paged_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    context_lens: Any,
    scale: float | None = None,
    *,
    max_context_len: int | None = None,
    out: Any = None,
    num_splits: int | None = None,
    checked: bool = True,
) -> Any:
    """Decode attention over a paged KV cache with the fused kernel (split-K when it pays).

    Computes what :func:`cupaged.reference_attention` computes: for sequence ``i`` and query head
    ``h`` (``g = num_q_heads // num_kv_heads`` query heads share KV head ``h // g``),
    ``out[i, h] = softmax(scale * K_i q[i, h]) V_i`` over the first ``context_lens[i]`` tokens;
    a sequence with context length 0 gets a zero row. Scores, softmax and sums are float32.

    Build ``block_tables`` and ``context_lens`` once per decode step (``cache.block_tables``) and
    pass the same arrays, and ``max_context_len``, to every layer.

    Args:
        q: ``[num_seqs, num_q_heads, head_dim]`` float32, float16 or bfloat16 (``uint16``).
        k_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, same element type,
            C-contiguous (``cache.k[layer]``).
        v_cache: same shape and dtype as ``k_cache``.
        block_tables: ``[num_seqs, max_blocks]`` int32 (int64 is converted).
        context_lens: ``[num_seqs]`` int32 (int64 is converted).
        scale: softmax scale; ``head_dim ** -0.5`` when ``None``.
        max_context_len: the longest context in the batch; used only with ``num_splits`` and
            ``checked=False``, to size the pieces without reading ``context_lens`` back. A hint
            only: a wrong value changes how the work is cut, never the result. (The default
            split is planned on the device from the lengths themselves.)
        out: optional ``[num_seqs, num_q_heads, head_dim]`` C-contiguous output, ``q``'s dtype.
        num_splits: cut each sequence into at most this many pieces (tests, experiments); when
            ``None`` the work is balanced by tokens over the device (:class:`DecodePlan`).
        checked: check, before the launch and on the arrays' device (one synchronisation on a
            GPU), that every context length is in ``[0, max_blocks * block_size]`` and that every
            block id a length reaches is in ``[0, num_blocks)`` (entries past a sequence's
            length are padding and may hold anything). ``checked=False`` skips that and *trusts*
            the caller: a bad id or length reads outside the cache (garbage output or a crash).
            Pass it only for tables and lengths built by cupaged (``PagedCache.block_tables``).

    Returns:
        ``[num_seqs, num_q_heads, head_dim]`` in ``q``'s dtype, on the inputs' device.

    Raises:
        TypeError: arrays on different devices, or wrong dtypes.
        ValueError: wrong shapes, an unsupported head_dim or block_size (the message lists the
            supported ones), caches not C-contiguous or not 16-byte aligned, a read-only ``out``,
            or (checked) bad context lengths or block ids.
    """
    from .decode import DecodePlan

    array_module(q, k_cache, v_cache, block_tables, context_lens)
    check_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    plan = DecodePlan(
        block_tables, context_lens, k_cache, q.shape[1], scale=scale, num_splits=num_splits,
        max_context_len=max_context_len, checked=checked,
    )  # fmt: skip
    return plan.run(q, k_cache, v_cache, out=out)


def paged_prefill(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    context_lens: Any,
    query_start_loc: Any,
    scale: float | None = None,
    causal: bool = True,
    *,
    out: Any = None,
    num_splits: int | None = None,
    checked: bool = True,
) -> Any:
    """Attention of many query tokens per sequence over a paged KV cache, fused.

    Prompts, prompt chunks after a cached prefix, speculative verification and mixed batches of
    prefill chunks and decode rows, in one launch. Computes what
    :func:`cupaged.reference_prefill` computes: sequence ``i``'s ``n_i`` query rows are
    ``query_start_loc[i] : query_start_loc[i + 1]`` of ``q``; ``context_lens[i]`` counts its
    cached tokens *including* them (write their K/V with :func:`write_kv` first), so its query
    ``j`` sits at position ``p = context_lens[i] - n_i + j``::

        a chunk of 3 new tokens after a cached prefix of 5 (block_size 4):
        position   0 1 2 3 | 4 5 6 7      context_lens = 8, n = 3
        token      c c c c | c q q q      queries at positions 5, 6, 7
        causal     query 0 (p = 5) attends 0..5, query 2 (p = 7) attends 0..7

    With ``causal=False`` every query attends to all ``context_lens[i]`` tokens. Query head
    ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``. Scores, softmax and sums are
    float32. A decode batch (every ``n_i = 1``) gives what :func:`paged_attention` gives.

    Args:
        q: ``[total_query_tokens, num_q_heads, head_dim]`` float32, float16 or bfloat16
            (``uint16``).
        k_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, same element type,
            C-contiguous and 16-byte aligned (``cache.k[layer]``).
        v_cache: same shape and dtype as ``k_cache``.
        block_tables: ``[num_seqs, max_blocks]`` int32 (int64 is converted after the checks).
        context_lens: ``[num_seqs]`` int32 (int64 is converted after the checks).
        query_start_loc: ``[num_seqs + 1]`` int32 or int64: 0, non-decreasing, ending at
            ``total_query_tokens`` (``StepPlan.query_start_loc``). Always checked (it is read
            on the host to size the grid), with ``n_i <= context_lens[i]``.
        scale: softmax scale; ``head_dim ** -0.5`` when ``None``.
        causal: mask the tokens after each query's position (``True``, prefill), or attend to
            the whole context (``False``).
        out: optional ``[total_query_tokens, num_q_heads, head_dim]`` C-contiguous output,
            ``q``'s dtype.
        num_splits: cut every query tile's KV range into about this many pieces, one thread
            block each, merged by log-sum-exp (split-K); the heuristic in ``cupaged._launch``
            decides when ``None`` (it splits only batches too small to fill the GPU, from the
            host copies of the lengths that the ``query_start_loc`` check reads anyway).
        checked: check, before the launch and on the arrays' device, that every context length
            is in ``[0, max_blocks * block_size]`` and every block id a length reaches is in
            ``[0, num_blocks)``. ``checked=False`` skips that and *trusts* the caller: a bad id
            or length reads outside the cache (garbage output or a crash). Pass it only for
            tables and lengths built by cupaged (``PagedCache.block_tables``).

    Returns:
        ``[total_query_tokens, num_q_heads, head_dim]`` in ``q``'s dtype, on the inputs' device.

    Raises:
        TypeError: arrays on different devices, or wrong dtypes.
        ValueError: wrong shapes, an unsupported head_dim or block_size (the message lists the
            supported ones), caches not C-contiguous or not 16-byte aligned, a bad
            ``query_start_loc``, ``n_i > context_lens[i]``, a read-only ``out``, or (checked)
            bad context lengths or block ids.
    """
    arrays = (q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    xp = array_module(*arrays)
    dims = _checked_shapes(_prefill_shapes, _check_prefill_shapes, *arrays)  # (a step's layers)
    _check_contiguous(k_cache=k_cache, v_cache=v_cache)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if _address(x) % 16:
            raise ValueError(f"expected {name} 16-byte aligned, got address {_address(x):#x}")
    check_num_blocks(dims.num_blocks)
    total = q.shape[0]
    if total > INT32_MAX:
        raise ValueError(f"expected at most {INT32_MAX} query tokens, got {total}")
    # Host copies of two [num_seqs]-sized arrays: the grid needs the longest query run, and the
    # split-K plan the tiles' KV ranges (no other read back from the device).
    host_starts, host_lens = to_numpy(query_start_loc), to_numpy(context_lens)
    device = _device(xp)
    group = dims.num_q_heads // dims.num_kv_heads
    # Every layer of a step passes the same lengths: their check and the launch plan are kept
    # per (shapes, the lengths' bytes), the values of the last few steps.
    key = (dims, total, bool(causal), num_splits, device, _device_id(xp), host_starts.dtype,
           host_lens.dtype, host_starts.tobytes(), host_lens.tobytes())  # fmt: skip
    launch = _prefill_plans.get(key) if num_splits is None or type(num_splits) is int else None
    if launch is None:
        max_query_len = check_query_start_loc(host_starts, host_lens, total)
    if out is None:
        out = xp.empty(q.shape, q.dtype)  # q's dtype object: bfloat16 in, bfloat16 out
    else:
        array_module(q, out)
        axes = ("total_query_tokens", "num_q_heads", "head_dim")
        check_shape("out", out, list(zip(axes, q.shape, strict=True)))
        check_dtype("out", out, dims.dtype, "q's dtype")
        _check_contiguous(out=out)
        check_writable("out", out)
    if total == 0:
        return out
    if checked:  # on the caller's arrays, before they are narrowed to int32
        check_decode_tables(block_tables, context_lens, dims.block_size, dims.num_blocks)
    if launch is None:
        launch = _launch.prefill_launch(
            dims.dtype, dims.num_seqs, dims.num_kv_heads, group, dims.head_dim, dims.block_size,
            max_query_len, host_starts, np.minimum(host_lens.astype(np.int64), MAX_CONTEXT_LEN),
            bool(causal), None, num_splits, total, _target(device),
        )  # fmt: skip
        if len(_prefill_plans) >= 8:
            _prefill_plans.clear()
        if num_splits is None or type(num_splits) is int:
            _prefill_plans[key] = launch
    kernel = _attention_kernel(device, "paged_prefill.cu", launch, group, dims.head_dim)
    tables = xp.ascontiguousarray(block_tables, dtype=np.int32)
    lens = xp.ascontiguousarray(context_lens, dtype=np.int32)
    starts = xp.ascontiguousarray(query_start_loc, dtype=np.int32)
    if launch.num_splits > 1:
        split_shape = (total, dims.num_q_heads, launch.num_splits)
        partial_out = xp.empty((*split_shape, dims.head_dim), np.float32)
        partial_lse = xp.empty(split_shape, np.float32)
    else:  # unused by the kernel; real arrays so that no argument is a null pointer
        partial_out = partial_lse = xp.empty(1, np.float32)
    scale = dims.head_dim**-0.5 if scale is None else scale
    out_storage = as_storage(out)
    args = (
        out_storage, partial_out, partial_lse, xp.ascontiguousarray(as_storage(q)),
        as_storage(k_cache), as_storage(v_cache), tables, lens, starts,
        np.int32(dims.num_kv_heads), np.int32(group), np.int32(launch.heads_per_block),
        np.int32(dims.max_blocks), np.int32(dims.num_seqs), np.int32(launch.query_rows),
        np.int32(bool(causal)), np.int32(launch.partition_tokens), np.int32(launch.num_splits),
        np.float32(scale),
    )  # fmt: skip
    kernel(launch.grid, launch.block, args, shared_mem=launch.shared_mem)
    if launch.num_splits > 1:
        merge = get_kernel(device, "paged_prefill.cu", launch.merge_name)
        merge(
            launch.merge_grid,
            (_launch.PREFILL_MERGE_THREADS,),
            (out_storage, partial_out, partial_lse, lens, starts, np.int32(dims.num_seqs),
             np.int32(bool(causal)), np.int32(launch.partition_tokens),
             np.int32(launch.num_splits)),
        )  # fmt: skip
    return out


def _array_module(*arrays: Any) -> Any:
    """``array_module`` with a shortcut for plain NumPy arrays (the CPU backend's launch path)."""
    for x in arrays:
        if type(x) is not np.ndarray:
            return array_module(*arrays)
    return np


def _device(xp: Any) -> str:
    return "cpu" if xp is np else "cuda"


def _device_id(xp: Any) -> int:
    """The current device's id on CUDA (kernels are kept per device), 0 on the CPU."""
    return 0 if xp is np else int(xp.cuda.Device().id)


def _attention_kernel(device: str, source: str, launch: Any, group: int, head_dim: int) -> Any:
    """The kernel of an attention launch plan, with the dynamic shared memory it asks for
    (opted into above the default). The launch table picked it for this device's target
    (:func:`_target`), so it fits; the check stays as the last guard before a launch."""
    if device == "cuda" and not _target(device).fits(launch.shared_mem):
        raise ValueError(
            f"expected at most {_target(device).shared_memory} bytes of shared memory per block "
            f"on this GPU, got {launch.shared_mem} for {launch.name} ({group} query heads per KV "
            f"head, head_dim {head_dim})"
        )
    kernel = get_kernel(device, source, launch.name)
    if device == "cuda" and launch.shared_mem > _launch.DEFAULT_SHARED_MEMORY:
        kernel.max_dynamic_shared_size_bytes = launch.shared_mem
    if device == "cpu":  # heavy blocks: helper threads from two on (see cpu_attention_workers)
        kernel = kernel.with_workers(_launch.cpu_attention_workers(launch.grid))
    return kernel


def _ctas_per_sm(kernel: Any, launch: Any) -> int:
    """Thread blocks of a loaded CUDA kernel's launch resident per multiprocessor: CUDA's
    occupancy calculator on its real registers and shared memory (the CPU backend, which has no
    cubin, takes ``_launch.decode_ctas_per_sm``: what an H100 would)."""
    driver = device_module("cuda").cuda.driver
    ctas = driver.occupancyMaxActiveBlocksPerMultiprocessor(
        kernel.kernel.ptr, math.prod(launch.block), launch.shared_mem
    )
    return max(1, int(ctas))


def _target(device: str) -> _launch.Target:
    """The GPU that launches are planned for: the current CUDA device's architecture, its
    multiprocessors and the shared memory a block may opt into; the nominal H100 for the CPU
    backend."""
    if device == "cpu":
        return _launch.NOMINAL_TARGET
    return _cuda_target(device_module("cuda").cuda.runtime.getDevice())


@functools.cache
def _cuda_target(device_id: int) -> _launch.Target:
    device = device_module("cuda").cuda.Device(device_id)
    attributes = device.attributes
    return _launch.Target(
        int(device.compute_capability),  # "90" on an H100
        int(attributes["MultiProcessorCount"]),
        int(attributes["MaxSharedMemoryPerBlockOptin"]),
    )


def _sm_count(device: str) -> int:
    """Multiprocessors of the device launches are planned for (see :func:`_target`)."""
    return _target(device).sm_count


def _address(x: Any) -> int:
    """Address of an array's first element (NumPy or CuPy)."""
    if isinstance(x, np.ndarray):
        try:  # a writable array exports its buffer: the cheapest way to its address
            return ctypes.addressof(ctypes.c_char.from_buffer(x))
        except (TypeError, ValueError, BufferError):  # read-only, empty or strided
            return int(x.ctypes.data)
    return int(x.data.ptr)


def _check_target_caches(k_cache: Any, v_cache: Any, num_blocks: int) -> None:
    """The per-call checks of a cache that a kernel writes (its flags can change between calls
    with the same shape): C-contiguous, writable, block ids that fit the kernels' int32."""
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        _check_contiguous(k_cache=k_cache, v_cache=v_cache)
    check_writable("k_cache", k_cache)
    check_writable("v_cache", v_cache)
    check_num_blocks(num_blocks)


def _check_contiguous(**arrays: Any) -> None:
    for name, x in arrays.items():
        if not x.flags.c_contiguous:
            raise ValueError(f"expected {name} C-contiguous, got strides {x.strides}")
