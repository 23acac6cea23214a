"""The functional API: NumPy-style functions on raw cache arrays, run by the kernels in ``cuda/``.

The array module of the inputs picks the backend: CuPy arrays run the CUDA kernels on the GPU
(CuPy ``RawModule``), NumPy arrays run the *same kernel source* on the CPU backend; mixing them is
a ``TypeError``. Every function checks shapes, dtypes, contiguity and alignment before launching,
so a rejected call changes nothing. Launch configurations come from ``cupaged.kernels.launch_copies``.

Arrays of other frameworks (PyTorch tensors, JAX arrays: anything with ``__dlpack__``) are taken
without a copy and results handed back as the caller's type (``cupaged._arrays.interop.takes_dlpack``,
docs/interop.md); the arrays of one call come from one framework.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from .._arrays.checks import (
    ITEMSIZES,
    as_bool,
    check_attention_args,
    check_copy_pairs,
    check_dtype,
    check_fp8_source,
    check_index_array,
    check_num_blocks,
    check_prefill_args,
    check_query_start_loc,
    check_shape,
    check_slots,
    check_writable,
    element_type,
)
from .._arrays.interop import takes_dlpack
from ..backend import array_module, to_numpy
from ..dtypes import as_storage, dtype_name, is_fp8
from ..kernels.args import CopyBlocksArgs, ScaleArgs, WriteKvArgs, WriteKvFp8Args, fields
from ..kernels.launch_copies import copy_blocks_launch, write_kv_launch
from ..kernels.loader import get_kernel
from ..variants import check_sinks
from .decode import DecodePlan
from .layer import (
    LAYER_AXES,
    address,
    check_contiguous,
    cpu_threads,
    device_id,
    device_of,
    fp8_query_dtype,
)
from .prefill import PrefillPlan, check_batch_arrays, check_metadata_devices, replan
from .reuse import PlanReuse, reuse_key
from .scales import kv_scale_args


@takes_dlpack
def write_kv(
    k_cache: Any,
    v_cache: Any,
    k: Any,
    v: Any,
    slot_mapping: Any,
    *,
    k_scale: Any = None,
    v_scale: Any = None,
    kv_dtype: Any = None,
    checked: bool = True,
) -> None:
    """Write new tokens' keys and values into one layer of a paged cache, in place.

    Token ``t`` goes to block ``slot_mapping[t] // block_size`` at offset
    ``slot_mapping[t] % block_size``; a slot of ``-1`` skips the token (padding)::

        slot = block * block_size + offset        block_size = 4, slot 9 -> block 2, offset 1

    An fp8 cache (docs/fp8.md) is written quantized, in the same launch: KV head ``h`` of a
    token stores ``fp8(clamp(float32(x) / scale(h), -max, max))``, rounded to nearest even
    (max 448 for float8_e4m3, 57344 for float8_e5m2; NaN stays NaN), as
    :func:`cupaged.reference_write_kv` does bit for bit.

    Args:
        k_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]`` float32, float16, bfloat16
            (``uint16``) or fp8 (``ml_dtypes`` on NumPy, ``uint8`` with ``kv_dtype``),
            C-contiguous, written in place.
        v_cache: same shape and dtype as ``k_cache``, written in place.
        k: ``[num_tokens, num_kv_heads, head_dim]``, the cache's element type; for an fp8 cache
            float32, float16 or bfloat16 (the model's).
        v: same shape and element type as ``k``.
        slot_mapping: ``[num_tokens]`` int32 or int64.
        k_scale: an fp8 cache's K scale (``None``: 1.0): a positive finite number, or a
            float32 array of shape ``()``, ``[1]`` or ``[num_kv_heads]`` on the cache's device,
            read by the kernel (checked positive and finite in checked mode). Only for fp8.
        v_scale: the same for V.
        kv_dtype: ``"float8_e4m3"`` or ``"float8_e5m2"``: the format a ``uint8`` cache holds
            (CuPy has no fp8 dtype); refused for a cache of another type.
        checked: check, before the launch and on the arrays' device (one synchronisation on a
            GPU), that every slot is ``-1`` or inside the cache and that no slot appears twice,
            and that array scales are positive and finite. ``checked=False`` skips that and
            *trusts* the caller: a slot out of range writes outside the cache (memory
            corruption or a crash), a repeated slot races, a bad scale stores garbage. Pass it
            only for slot mappings built by cupaged itself (``PagedCache.reserve``).

    Raises:
        TypeError: arrays on different devices, or wrong dtypes (a ``uint8`` cache without
            ``kv_dtype``, a ``kv_dtype`` for a cache that is not fp8, a scale that is neither a
            number nor a float32 array of the cache's device).
        ValueError: wrong shapes, a cache that is not C-contiguous or is read-only, scales for
            a cache that is not fp8, a scale that is not positive and finite (an array of it:
            checked) or has another shape, or (checked) a slot out of range or repeated.
    """
    xp = array_module(k_cache, v_cache, k, v, slot_mapping)
    shapes = _checked_shapes(
        _write_shapes, _check_write_shapes, k_cache, v_cache, k, v, slot_mapping, kv_dtype=kv_dtype
    )
    elem, src, num_blocks, num_kv_heads, block_size, head_dim, num_tokens = shapes
    _check_target_caches(k_cache, v_cache, num_blocks)
    scales = _write_scales(xp, elem, num_kv_heads, k_scale, v_scale, checked)
    if checked and num_tokens:
        check_slots(slot_mapping, num_blocks * block_size)
    if num_tokens == 0:
        return
    k_cache, v_cache = as_storage(k_cache), as_storage(v_cache)
    k, v = xp.ascontiguousarray(as_storage(k)), xp.ascontiguousarray(as_storage(v))
    slots = xp.ascontiguousarray(slot_mapping)
    aligned = all(address(x) % 16 == 0 for x in (k_cache, v_cache, k, v))
    kernel, grid, block, fill = _write_plan(
        device_of(xp), device_id(xp), elem, src, slots.dtype, shapes[3:], aligned
    )
    if scales is None:
        kernel(grid, block, fill(k, v, k_cache, v_cache, slots))
    else:
        kernel(grid, block, fill(k, v, k_cache, v_cache, slots, scales))


def _write_scales(
    xp: Any, elem: str, num_kv_heads: int, k_scale: Any, v_scale: Any, checked: bool
) -> ScaleArgs | None:
    """The scale arguments of ``write_kv_fp8`` (``kv_scale_args``); ``None`` for ``write_kv``,
    whose cache takes no scales (given ones are refused there)."""
    if is_fp8(elem) or k_scale is not None or v_scale is not None:
        return kv_scale_args(xp, elem, num_kv_heads, k_scale, v_scale, checked=checked)
    return None


_shape_and_dtype = operator.attrgetter("shape", "dtype")


def _checked_shapes(
    memo: dict[tuple, tuple], check: Any, *arrays: Any, kv_dtype: Any = None
) -> tuple:
    """``check(*arrays, kv_dtype)`` (the checks of a call that read only shapes and dtypes), run
    once per combination of the arrays' shapes and dtypes and ``kv_dtype`` and then remembered in
    ``memo`` (bounded: cleared when full): a step repeats the same combination, and the checks
    cost as much as a small launch. A failing check raises on every call."""
    if kv_dtype is not None and type(kv_dtype) is not str:
        kv_dtype = dtype_name(kv_dtype)  # hashable, and a list is refused by name, not hashed
    key = (kv_dtype, *map(_shape_and_dtype, arrays))
    shapes = memo.get(key)
    if shapes is None:
        shapes = check(*arrays, kv_dtype)
        if len(memo) >= 256:
            memo.clear()
        memo[key] = shapes
    return shapes


# Shapes and dtypes of write_kv / copy_blocks calls whose checks passed -> what the checks return.
_write_shapes: dict[tuple, tuple[str, str, int, int, int, int, int]] = {}
_copy_shapes: dict[tuple, tuple[int, int, int]] = {}


def _check_write_shapes(
    k_cache: Any, v_cache: Any, k: Any, v: Any, slot_mapping: Any, kv_dtype: Any
) -> tuple[str, str, int, int, int, int, int]:
    """The shape and dtype checks of ``write_kv``: ``(cache element type, k's element type,
    num_blocks, num_kv_heads, block_size, head_dim, num_tokens)``."""
    num_blocks, num_kv_heads, block_size, head_dim = check_shape(
        "k_cache", k_cache, [(axis, None) for axis in LAYER_AXES]
    )
    check_shape("v_cache", v_cache, list(zip(LAYER_AXES, k_cache.shape, strict=True)))
    token_dims = [("num_tokens", None), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)]
    num_tokens, _, _ = check_shape("k", k, token_dims)
    check_shape("v", v, [("num_tokens", num_tokens), *token_dims[1:]])
    check_shape("slot_mapping", slot_mapping, [("num_tokens", num_tokens)])
    check_index_array("slot_mapping", slot_mapping)
    elem = element_type(k_cache, kv_dtype)
    check_dtype("v_cache", v_cache, elem, "k_cache's dtype", kv_dtype)
    if is_fp8(elem):
        why = f"a {elem} cache quantizes it as it writes"
        src = check_fp8_source("k", k, f"float32, float16 or bfloat16 ({why})")
    else:
        src = elem
    check_dtype("k", k, src, "the cache's dtype")
    check_dtype("v", v, src, "k's dtype" if is_fp8(elem) else "the cache's dtype")
    return elem, src, num_blocks, num_kv_heads, block_size, head_dim, num_tokens


@functools.lru_cache(maxsize=256)
def _write_plan(
    device: str,
    cuda_device: int,
    elem: str,
    src: str,
    slot_dtype: np.dtype,
    dims: tuple[int, ...],
    aligned: bool,
) -> tuple[Any, tuple, tuple, Callable[..., tuple]]:
    """Kernel, grid, block and the filler of the arguments (the arrays and an fp8 cache's
    scales left to each call; ``WriteKvArgs.filler``) of one ``write_kv`` shape (``elem``: the
    cache's element type, ``src``: k's; ``dims``: num_kv_heads, block_size, head_dim,
    num_tokens), kept like :func:`_copy_plan`'s."""
    num_kv_heads, block_size, head_dim, num_tokens = dims
    name, grid, block = write_kv_launch(
        elem,
        slot_dtype,
        num_tokens,
        head_dim * ITEMSIZES[elem],
        aligned,
        num_kv_heads,
        device,
        src_dtype=src,
    )
    kernel = get_kernel(device, "write_kv.cu", name)
    if device == "cpu":  # one OS thread unless the launch is large (see kernels/cpu/threads.py)
        token_bytes = 2 * num_kv_heads * head_dim * ITEMSIZES[src]
        kernel = kernel.with_workers(cpu_threads().stride_workers(num_tokens, token_bytes))
    arrays = dict.fromkeys(("k", "v", "k_cache", "v_cache", "slots"))
    sizes = {
        "num_kv_heads": np.int32(num_kv_heads),
        "block_size": np.int32(block_size),
        "head_dim": np.int32(head_dim),
    }
    if is_fp8(elem):
        args = WriteKvFp8Args(**arrays, **sizes, **dict.fromkeys(fields(ScaleArgs)))
    else:
        args = WriteKvArgs(**arrays, **sizes)
    return kernel, grid, block, args.filler()


@takes_dlpack
def copy_blocks(
    k_cache: Any, v_cache: Any, src: Any, dst: Any, *, kv_dtype: Any = None, checked: bool = True
) -> None:
    """Copy block ``src[i]`` onto block ``dst[i]`` in every layer of K and V, in place, in one launch.

    Copy-on-write uses it to give a sequence its own copy of a shared block. The pairs are copied
    in parallel, so an id that is both a source and a destination, or a repeated destination, would
    give an undefined result; the checks reject both.

    Args:
        k_cache: ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`` (the whole cache)
            or ``[num_blocks, num_kv_heads, block_size, head_dim]`` (one layer), C-contiguous;
            float32, float16, bfloat16 or fp8 (``ml_dtypes``, or ``uint8`` with ``kv_dtype``),
            copied bit for bit.
        v_cache: same shape and dtype as ``k_cache``.
        src: ``[num_copies]`` int32 or int64 block ids.
        dst: ``[num_copies]`` int32 or int64 block ids.
        kv_dtype: the fp8 format of a ``uint8`` cache, as in :func:`write_kv` (checked when
            given; a copy needs no format, so a ``uint8`` cache without it is copied as bytes).
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
    xp = array_module(k_cache, v_cache, src, dst)
    element_bytes, num_blocks, num_copies = _checked_shapes(
        _copy_shapes, _check_copy_shapes, k_cache, v_cache, src, dst, kv_dtype=kv_dtype
    )
    _check_target_caches(k_cache, v_cache, num_blocks)
    if checked and num_copies:
        check_copy_pairs(src, dst, num_blocks)
    if num_copies == 0:
        return
    aligned = address(k_cache) % 16 == 0 and address(v_cache) % 16 == 0
    kernel, grid, block, fill = _copy_plan(
        device_of(xp), device_id(xp), k_cache.shape, element_bytes, aligned, num_copies
    )
    if src.dtype != np.int32 or not src.flags.c_contiguous:
        src = xp.ascontiguousarray(src, dtype=np.int32)
    if dst.dtype != np.int32 or not dst.flags.c_contiguous:
        dst = xp.ascontiguousarray(dst, dtype=np.int32)
    kernel(grid, block, fill(k_cache, v_cache, src, dst))


def _check_copy_shapes(
    k_cache: Any, v_cache: Any, src: Any, dst: Any, kv_dtype: Any
) -> tuple[int, int, int]:
    """The shape and dtype checks of ``copy_blocks``: ``(bytes per element, num_blocks,
    num_copies)``."""
    if k_cache.ndim not in (4, 5):
        raise ValueError(
            "expected k_cache of shape ([num_layers,] num_blocks, num_kv_heads, block_size, "
            f"head_dim), got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        axes = ("num_layers",) * (k_cache.ndim - 4) + LAYER_AXES
        check_shape("v_cache", v_cache, list(zip(axes, k_cache.shape, strict=True)))
    if kv_dtype is None and k_cache.dtype == np.uint8 and v_cache.dtype == np.uint8:
        element_bytes = 1  # fp8 bytes of a format the copy need not know
    else:
        elem = element_type(k_cache, kv_dtype)
        check_dtype("v_cache", v_cache, elem, "k_cache's dtype", kv_dtype)
        element_bytes = ITEMSIZES[elem]
    if src.ndim != 1 or dst.shape != src.shape:
        (num_copies,) = check_shape("src", src, [("num_copies", None)])
        check_shape("dst", dst, [("num_copies", num_copies)])
    check_index_array("src", src)
    check_index_array("dst", dst)
    return element_bytes, k_cache.shape[-4], src.shape[0]


@functools.lru_cache(maxsize=256)
def _copy_plan(
    device: str,
    cuda_device: int,
    shape: tuple[int, ...],
    element_bytes: int,
    aligned: bool,
    num_copies: int,
) -> tuple[Any, tuple, tuple, Callable[..., tuple]]:
    """Kernel, grid, block and the filler of the arguments (the arrays left to each call;
    ``CopyBlocksArgs.filler``) of one ``copy_blocks`` shape (kept: a copy-on-write step repeats
    the same shape, and each lookup would cost as much as a small copy)."""
    num_layers = shape[0] if len(shape) == 5 else 1
    num_blocks, heads, tokens, dim = shape[-4:]
    block_bytes = heads * tokens * dim * element_bytes
    name, grid, block, word = copy_blocks_launch(
        block_bytes, aligned, num_copies, num_layers, device, element_bytes=element_bytes
    )
    kernel = get_kernel(device, "copy_blocks.cu", name)
    if device == "cpu":  # one OS thread unless the launch is large (see kernels/cpu/threads.py)
        kernel = kernel.with_workers(
            cpu_threads().stride_workers(grid[0] * grid[1] * grid[2], block_bytes)
        )
    args = CopyBlocksArgs(
        k_cache=None,
        v_cache=None,
        src=None,
        dst=None,
        num_blocks=np.int32(num_blocks),
        words_per_block=np.int64(block_bytes // word),
    )
    return kernel, grid, block, args.filler()


@takes_dlpack
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
    batch_invariant: bool = False,
    cascade: bool | None = None,
    checked: bool = True,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    kv_dtype: Any = None,
) -> Any:
    """Decode attention over a paged KV cache with the fused kernel (split-K when it pays).

    Computes what :func:`cupaged.reference_attention` computes: for sequence ``i`` and query head
    ``h`` (``g = num_q_heads // num_kv_heads`` query heads share KV head ``h // g``),
    ``out[i, h] = softmax(scale * K_i q[i, h]) V_i`` over the first ``context_lens[i]`` tokens;
    a sequence with context length 0 gets a zero row. Scores, softmax and sums are float32.

    With the attention variants (docs/variants.md), for the query at position
    ``p = context_lens[i] - 1`` and a key at position ``j``::

        s = scale * q.k
        if logits_soft_cap > 0:  s = logits_soft_cap * tanh(s / logits_soft_cap)
        if alibi_slopes given:   s += alibi_slopes[h] * (j - p)
        keys with j < p - window_left are not attended          (window_left = -1: all)
        out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sinks[h] - m)),
              m = max(max_j s_j, sinks[h])                      (no sink term without sinks)

    The window is planned, not masked: only the ``window_left + 1`` last tokens' K/V are read,
    and the entries of ``block_tables`` before the window are never read (they may be ``-1``,
    as a sliding-window :class:`PagedCache` leaves them).

    The one-shot form of :class:`DecodePlan`: it plans (and, checked, checks) and runs once. A
    model that attends every layer over the same tables plans once per step
    (``cache.decode_plan(batch, num_q_heads)``) and calls ``plan.run`` per layer. A call of
    the shapes and options of one of the last few, on the same thread and CUDA stream, updates
    that call's plan (``DecodePlan.update``) instead of making one (cupaged/attention/reuse.py);
    with ``alibi_slopes`` or ``num_splits`` every call makes its own.

    Args:
        q: ``[num_seqs, num_q_heads, head_dim]`` float32, float16 or bfloat16 (``uint16``).
        k_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, same element type (or
            fp8, ``kv_dtype``), C-contiguous (``cache.k[layer]``).
        v_cache: same shape and dtype as ``k_cache``.
        block_tables: ``[num_seqs, max_blocks]`` int32 (int64 is converted).
        context_lens: ``[num_seqs]`` int32 (int64 is converted).
        scale: softmax scale; ``head_dim ** -0.5`` when ``None``.
        max_context_len: the longest context in the batch; used only with ``num_splits`` and
            ``checked=False``, to size the pieces without reading ``context_lens`` back. A hint
            only: a wrong value changes how the work is cut, never the result. (The default
            split is planned on the device from the lengths themselves.)
        out: optional ``[num_seqs, num_q_heads, head_dim]`` C-contiguous output, ``q``'s dtype:
            ``q`` itself (in place) or memory that does not overlap ``q``.
        num_splits: cut each sequence into at most this many pieces (tests, experiments); when
            ``None`` the work is balanced by tokens over the device (:class:`DecodePlan`).
        batch_invariant: ``True``: each sequence's output is bitwise the same in any batch
            and at any position in it (fixed-size pieces; :class:`DecodePlan`,
            docs/batch-invariance.md); not with ``num_splits``.
        cascade: rows that share leading blocks read them once (:class:`DecodePlan`,
            docs/cascade.md): ``None`` when that saves enough bytes, ``True`` whenever two
            rows share a block, ``False`` never.
        checked: check, before the launch and on the arrays' device (one synchronisation on a
            GPU), that every context length is in ``[0, max_blocks * block_size]`` and that every
            block id a length reaches is in ``[0, num_blocks)`` (entries past a sequence's
            length are padding and may hold anything). ``checked=False`` skips that and *trusts*
            the caller: a bad id or length reads outside the cache (garbage output or a crash).
            Pass it only for tables and lengths built by cupaged (``PagedCache.block_tables``).
            With a window, only the entries the window reaches are checked.
        window_left: sliding window, keys ``j >= p - window_left`` (``window_left + 1`` keys at
            most: Mistral's ``sliding_window = 4096`` is ``4095``); ``-1``, no window.
        logits_soft_cap: soft-cap of the scaled scores (Gemma 2: 50.0); ``0.0``, none.
        alibi_slopes: ``[num_q_heads]`` float32 on the inputs' device (ALiBi); ``None``, none.
        sinks: ``[num_q_heads]`` float32 on the inputs' device, a learned logit per head in the
            softmax denominator only (gpt-oss); ``None``, none.
        k_scale, v_scale: over an fp8 cache (docs/fp8.md), the scales K and V were written
            with: positive finite numbers, or float32 arrays of shape ``()``, ``[1]`` or
            ``[num_kv_heads]`` on the inputs' device (read by the kernel; checked with one
            synchronisation unless ``checked=False``); ``None``, 1.0. Attends over
            ``fp8 * scale``; ``q`` stays float32, float16 or bfloat16. Refused for other caches.
        kv_dtype: the fp8 format of ``uint8`` caches (a GPU fp8 cache); ``None`` otherwise.

    Returns:
        ``[num_seqs, num_q_heads, head_dim]`` in ``q``'s dtype, on the inputs' device.

    Raises:
        TypeError: arrays on different devices, or wrong dtypes (slopes and sinks: float32
            arrays of the inputs' device; an fp8 ``q``, a ``uint8`` cache without
            ``kv_dtype``, a ``kv_dtype`` for a cache that is not fp8; scales that are neither
            numbers nor float32 arrays of the inputs' device).
        ValueError: wrong shapes, an unsupported head_dim or block_size (the message lists the
            supported ones), caches not C-contiguous or not 16-byte aligned, a read-only ``out``
            or one that overlaps ``q`` without being ``q``, ``window_left < -1``, a negative or
            non-finite ``logits_soft_cap``, slopes or sinks not of shape ``[num_q_heads]``,
            scales for a cache that is not fp8 or not positive and finite (a device array: when
            checked) or of another shape, (checked) bad context lengths or block ids, or
            ``num_splits`` with ``batch_invariant=True``.
    """
    xp = array_module(q, k_cache, v_cache, block_tables, context_lens)
    q_dtype = fp8_query_dtype(q, k_cache, kv_dtype)  # None: not an fp8 cache
    if q_dtype is None:  # over fp8 the plan and its run check the rest
        check_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    sinks = check_sinks(xp, q.shape[1], sinks)  # before the plan checks and plans
    if q_dtype is not None or k_scale is not None or v_scale is not None:
        # What the host can check of the scales, before anything plans; the run checks the
        # values of a device array (checked) before it launches.
        elem = element_type(k_cache, kv_dtype)
        kv_scale_args(xp, elem, k_cache.shape[1], k_scale, v_scale, checked=False)
    options = {
        "scale": scale,
        "num_splits": num_splits,
        "batch_invariant": batch_invariant,
        "cascade": cascade,
        "max_context_len": max_context_len,
        "window_left": window_left,
        "logits_soft_cap": logits_soft_cap,
        "alibi_slopes": alibi_slopes,
        "q_dtype": q_dtype,
        "kv_dtype": kv_dtype,
    }
    key = reuse_key(xp, q, k_cache, block_tables, **options)

    def make() -> DecodePlan:
        return DecodePlan(
            block_tables, context_lens, k_cache, q.shape[1], checked=checked, **options
        )

    plan = _PLANS.plan(key, block_tables, context_lens, checked, make)
    return plan.run(q, k_cache, v_cache, sinks=sinks, out=out, k_scale=k_scale, v_scale=v_scale)


# The one-shot decode's last plans, reused by shape on the same thread and stream (reuse.py).
_PLANS = PlanReuse()


@takes_dlpack
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
    batch_invariant: bool = False,
    checked: bool = True,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    kv_dtype: Any = None,
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

    Attention variants (docs/variants.md), for query ``p`` of head ``h`` and key ``j``: the
    score ``s = scale * q.k`` is soft-capped (``logits_soft_cap * tanh(s / logits_soft_cap)``),
    then biased by ALiBi (``alibi_slopes[h] * (j - p)``); keys ``j < p - window_left`` are not
    attended (causal or not); a sink adds ``exp(sinks[h] - m)`` to the softmax denominator once.
    With a window only the KV tiles a query tile can see are read, and the table entries before
    ``max(0, context_lens[i] - n_i - window_left)`` are never read (they may be ``-1``)::

        window_left = 2, causal:  query at p = 6 attends 4, 5, 6
        position   0 1 2 3 4 5 6 7
        p = 6      . . . . x x x .

    The one-shot form of :class:`PrefillPlan`: it reads the lengths on the host, checks, plans
    and runs once. A model that attends every layer over the same rows plans once per step and
    calls ``plan.run`` per layer. A call of the shapes and options of one of the last few (same
    thread, device and stream) re-plans that call's plan in its own buffers instead of making
    one (``cupaged/attention/reuse.py``). ``context_lens`` and ``query_start_loc`` may be host
    (NumPy) arrays beside device ones: the synchronisation-free form (as FlashInfer's ``plan``
    takes host ``indptr`` arrays); device arrays are read back to the host (the grid needs the
    longest query run), one synchronisation.

    Args:
        q: ``[total_query_tokens, num_q_heads, head_dim]`` float32, float16 or bfloat16
            (``uint16``).
        k_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, same element type or
            fp8 (docs/fp8.md: ``ml_dtypes`` fp8 on the CPU, ``uint8`` named by ``kv_dtype``),
            C-contiguous and 16-byte aligned (``cache.k[layer]``).
        v_cache: same shape and dtype as ``k_cache``.
        block_tables: ``[num_seqs, max_blocks]`` int32 (int64 is converted after the checks).
        context_lens: ``[num_seqs]`` int32 (int64 is converted after the checks), on the
            inputs' device or a host (NumPy) array.
        query_start_loc: ``[num_seqs + 1]`` int32 or int64: 0, non-decreasing, ending at
            ``total_query_tokens`` (``StepPlan.query_start_loc``, a host array), on the inputs'
            device or a host array. Always checked (on the host, where it sizes the grid), with
            ``n_i <= context_lens[i]``.
        scale: softmax scale; ``head_dim ** -0.5`` when ``None``.
        causal: mask the tokens after each query's position (``True``, prefill), or attend to
            the whole context (``False``). A bool (``TypeError`` otherwise).
        out: optional ``[total_query_tokens, num_q_heads, head_dim]`` C-contiguous output,
            ``q``'s dtype: ``q`` itself (in place) or memory that does not overlap ``q``.
        num_splits: cut every query tile's KV range into about this many pieces, one thread
            block each, merged by log-sum-exp (split-K); the heuristic in
            ``cupaged.kernels.launch_prefill`` decides when ``None`` (it splits only batches too
            small to fill the GPU, from the host copies of the lengths that the
            ``query_start_loc`` check reads anyway).
        batch_invariant: ``True``: each query row's output is bitwise the same in any batch
            and at any position in it (no split-K; :class:`PrefillPlan`,
            docs/batch-invariance.md); not with ``num_splits``.
        checked: check, before the launch and on the arrays' device, that every context length
            is in ``[0, max_blocks * block_size]`` and every block id a length reaches is in
            ``[0, num_blocks)``. ``checked=False`` skips that and *trusts* the caller: a bad id
            or length reads outside the cache (garbage output or a crash). Pass it only for
            tables and lengths built by cupaged (``PagedCache.block_tables``). With a window,
            only the entries from each sequence's first reachable key on are checked.
        window_left: a query at position ``p`` attends keys ``p - window_left ..`` (``-1``:
            no window; ``0``: itself alone, causal). An int ``>= -1``.
        logits_soft_cap: ``> 0`` soft-caps the scores at it (Gemma 2: 50.0); ``0.0``: none.
        alibi_slopes: ``[num_q_heads]`` float32 on the inputs' device, or ``None``.
        sinks: ``[num_q_heads]`` float32 on the inputs' device (a learned logit per head in the
            softmax denominator only, gpt-oss), or ``None``.
        k_scale, v_scale: over an fp8 cache, the scales K and V were written with (it holds
            ``x / scale``; attention reads ``fp8 * scale``): ``None`` (1.0), a positive finite
            number, or a float32 ``[]``, ``[1]`` or ``[num_kv_heads]`` array on the inputs'
            device, read by the kernel (checked on the device with ``checked``). ``None`` for
            any other cache.
        kv_dtype: the fp8 format of ``uint8`` caches; ``None`` otherwise.

    Returns:
        ``[total_query_tokens, num_q_heads, head_dim]`` in ``q``'s dtype, on the inputs' device.

    Raises:
        TypeError: arrays on different devices, wrong dtypes (an fp8 ``q``, a ``uint8`` cache
            without ``kv_dtype``, a ``kv_dtype`` for a cache that is not fp8), a ``causal``
            that is not a bool, a variant or a scale of the wrong type (slopes, sinks or scales
            not float32 arrays of the device).
        ValueError: wrong shapes, an unsupported head_dim or block_size (the message lists the
            supported ones), caches not C-contiguous or not 16-byte aligned, a bad
            ``query_start_loc``, ``n_i > context_lens[i]``, a read-only ``out`` or one that
            overlaps ``q`` without being ``q``, (checked) bad context lengths or block ids,
            ``window_left < -1``, a negative or non-finite soft-cap, slopes or sinks not of
            shape ``[num_q_heads]``, scales that are not positive and finite (a device array:
            when checked), of another shape, or given for a cache that is not fp8, or
            ``num_splits`` with ``batch_invariant=True``.
    """
    xp = array_module(q, k_cache, v_cache, block_tables)
    check_metadata_devices(xp, context_lens, query_start_loc)  # host arrays: never read back
    q_dtype = fp8_query_dtype(q, k_cache, kv_dtype)  # None: not an fp8 cache
    if q_dtype is None:
        check_prefill_args(q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    else:  # over fp8 the plan and its run check the caches; the lengths are read below
        check_batch_arrays(block_tables, context_lens, query_start_loc)
    sinks = check_sinks(xp, q.shape[1], sinks)  # before the plan compiles anything
    # Host copies of the lengths (none for host arrays); the plan checks them, against q's
    # rows here first (the same message as its own check's).
    host_starts, host_lens = to_numpy(query_start_loc), to_numpy(context_lens)
    if host_starts[0] != 0 or host_starts[-1] != q.shape[0]:
        check_query_start_loc(host_starts, host_lens, q.shape[0])
    options = {
        "scale": scale,
        "causal": as_bool(causal, "causal"),  # keyed: checked first
        "num_splits": num_splits,
        "batch_invariant": batch_invariant,
        "window_left": window_left,
        "logits_soft_cap": logits_soft_cap,
        "alibi_slopes": alibi_slopes,
        "q_dtype": q_dtype,
        "kv_dtype": kv_dtype,
    }
    key = reuse_key(xp, q, k_cache, block_tables, rows=q.shape[0], checked=bool(checked), **options)

    def make() -> PrefillPlan:
        return PrefillPlan(
            block_tables, host_lens, host_starts, k_cache, q.shape[1], checked=checked, **options
        )

    def update(plan: PrefillPlan) -> None:
        replan(plan, block_tables, host_lens, host_starts, tables_checked=bool(checked))

    plan = _PREFILL_PLANS.reuse(key, make, update)
    return plan.run(q, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale, sinks=sinks, out=out)


# The one-shot prefill's last plans, reused by shape alike, re-planned for each call's lengths.
_PREFILL_PLANS = PlanReuse()


def _check_target_caches(k_cache: Any, v_cache: Any, num_blocks: int) -> None:
    """The per-call checks of a cache that a kernel writes (its flags can change between calls
    with the same shape): C-contiguous, writable, block ids that fit the kernels' int32."""
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        check_contiguous(k_cache=k_cache, v_cache=v_cache)
    check_writable("k_cache", k_cache)
    check_writable("v_cache", v_cache)
    check_num_blocks(num_blocks)
