"""The oracle: paged attention, KV write and block copy in plain array ops.

Deliberately naive, and sharing no code with the kernels: every sequence's K/V is gathered through
its block table into a contiguous array and attended with an explicit softmax. Runs on NumPy and
CuPy alike (``xp`` is the module of the inputs). Slow by design; use it to check, not to serve.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays.checks import (
    as_bool,
    check_attention_args,
    check_block_ids,
    check_context_lens,
    check_prefill_args,
    check_query_start_loc,
)
from .._arrays.interop import takes_dlpack
from .._util import cdiv
from ..backend import array_module, to_numpy
from ..dtypes import (
    array_dtype_name,
    as_storage,
    dtype_name,
    float_to_fp8_bits,
    from_float,
    is_fp8,
    to_float,
)
from ..variants import Variants, check_sinks, check_variants
from .scales import kv_scale_args


@takes_dlpack
def reference_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    context_lens: Any,
    scale: float | None = None,
    *,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    compute_dtype: str = "float32",
    out_dtype: str | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
    kv_dtype: Any = None,
) -> Any:
    """Decode attention of one query token per sequence over a paged KV cache, naively.

    For sequence ``i`` and query head ``h``, with ``g = num_q_heads // num_kv_heads`` query heads per
    KV head and ``L = context_lens[i]``::

        K, V = tokens 0 .. L-1 of KV head h // g, gathered through block_tables[i]
        out[i, h] = softmax(scale * K @ q[i, h]) @ V

    A sequence with ``L == 0`` gets a zero output row. The query sits at position ``L - 1``; the
    variants (``window_left``, ``logits_soft_cap``, ``alibi_slopes``, ``sinks``) change the
    scores and the softmax as docs/variants.md defines, and the gather reads only the table
    entries of the window (a sliding-window cache's released entries before it are ``-1``).

    Args:
        q: ``[num_seqs, num_q_heads, head_dim]`` float32, float16 or bfloat16 (as ``uint16``).
        k_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, same element type as ``q``.
        v_cache: same shape and element type as ``k_cache``.
        block_tables: ``[num_seqs, max_blocks]`` int32/int64; entry ``j`` of row ``i`` is the
            physical block holding tokens ``j * block_size ..`` of sequence ``i``.
        context_lens: ``[num_seqs]`` int32/int64, each in ``[0, max_blocks * block_size]``.
        scale: softmax scale; ``head_dim ** -0.5`` when ``None``.
        window_left: keys ``j >= L - 1 - window_left`` are attended; -1: all.
        logits_soft_cap: ``s = cap * tanh(s / cap)`` when above 0.
        alibi_slopes: ``[num_q_heads]`` float32 on the inputs' device: ``s += slope[h] * (j - i)``.
        sinks: ``[num_q_heads]`` float32 on the inputs' device: a logit per head in the softmax
            denominator only.
        compute_dtype: ``"float32"`` (the default) or ``"float64"`` for scores, softmax and sums.
        out_dtype: element type of the result; ``q``'s when ``None``. ``"float64"`` is allowed.
        k_scale, v_scale: over an fp8 cache (``ml_dtypes`` fp8, or ``uint8`` named by
            ``kv_dtype``), the scales it was written with: a positive finite number (taken as
            float32), or a float32 array of shape ``()``, ``[1]`` or ``[num_kv_heads]``;
            ``None``, 1.0. The cache is dequantized first (``to_float(fp8) * scale`` of each
            KV head, in float64), then attended as any other; ``q`` is float32, float16 or
            bfloat16.
        kv_dtype: the fp8 format of ``uint8`` caches.

    Returns:
        ``[num_seqs, num_q_heads, head_dim]`` array on the inputs' device.
    """
    xp = array_module(q, k_cache, v_cache, block_tables, context_lens)
    compute = np.dtype(compute_dtype)
    if compute not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"expected compute_dtype float32 or float64, got {compute_dtype!r}")
    k_cache, v_cache, likes = _dequantized_caches(q, k_cache, v_cache, k_scale, v_scale, kv_dtype)
    dims = check_attention_args(q, *likes, block_tables, context_lens)
    num_seqs, num_q_heads, head_dim = q.shape
    block_size = dims.block_size
    variants = check_variants(xp, num_q_heads, window_left, logits_soft_cap, alibi_slopes)
    sinks = check_sinks(xp, num_q_heads, sinks)
    tables, lens = to_numpy(block_tables), to_numpy(context_lens)
    check_context_lens(lens, dims.max_blocks * block_size)
    firsts = variants.first_key(lens.astype(np.int64) - 1)
    check_block_ids(tables, lens, block_size, dims.num_blocks, firsts)
    scale = head_dim**-0.5 if scale is None else float(scale)
    kv_head_of = xp.arange(num_q_heads) // (num_q_heads // dims.num_kv_heads)
    score = _Scores(xp, compute, scale, variants, sinks)

    out = xp.zeros((num_seqs, num_q_heads, head_dim), compute)
    for i in range(num_seqs):
        length = int(lens[i])
        if length == 0:
            continue
        base, k, v = _gather_window(k_cache, v_cache, tables[i], int(firsts[i]), length, compute)
        k, v = k[kv_head_of], v[kv_head_of]  # [Hq, L - base, D]
        qi = to_float(q[i], compute)  # [Hq, D]
        out[i] = score.attend(qi, k, v, base, length - 1, int(firsts[i]), length)

    target = dims.dtype if out_dtype is None else out_dtype
    if target == "float64":
        return out.astype(np.float64, copy=False)  # float64 whatever compute_dtype was
    return from_float(out, dtype_name(target), like=q)


@takes_dlpack
def reference_prefill(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    context_lens: Any,
    query_start_loc: Any,
    scale: float | None = None,
    causal: bool = True,
    *,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    compute_dtype: str = "float32",
    out_dtype: str | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
    kv_dtype: Any = None,
) -> Any:
    """Attention of many query tokens per sequence over a paged KV cache, naively.

    Sequence ``i`` has ``n = query_start_loc[i+1] - query_start_loc[i]`` query rows and
    ``L = context_lens[i]`` cached tokens *including* them, so its query ``j`` sits at position
    ``L - n + j``::

        positions   0 1 2 3 4 5 6 7          L = 8, n = 3
        tokens      c c c c c q q q          c: cached prefix, q: this call's queries
        query j=0             ^ attends 0..5 (causal), 0..7 (not causal)

        K, V = tokens 0 .. L-1 of KV head h // g, gathered through block_tables[i]
        out[row, h] = softmax(scale * K @ q[row, h] + mask) @ V

    Args:
        q: ``[total_query_tokens, num_q_heads, head_dim]`` float32, float16 or bfloat16.
        k_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, same element type.
        v_cache: same shape and element type as ``k_cache``.
        block_tables: ``[num_seqs, max_blocks]`` int32/int64.
        context_lens: ``[num_seqs]`` int32/int64, each in ``[n_i, max_blocks * block_size]``.
        query_start_loc: ``[num_seqs + 1]`` int32/int64, from 0 to ``total_query_tokens``,
            non-decreasing (a sequence may have no query rows).
        scale: softmax scale; ``head_dim ** -0.5`` when ``None``.
        causal: query ``j`` attends to positions ``0 .. L - n + j``; all ``L`` when ``False``.
            A bool.
        window_left: a query at position ``i`` attends keys ``j >= i - window_left`` only (with
            ``causal=False`` the window bounds the left side only); -1: no window.
        logits_soft_cap, alibi_slopes, sinks: as in :func:`reference_attention`.
        compute_dtype: ``"float32"`` (the default) or ``"float64"``.
        out_dtype: element type of the result; ``q``'s when ``None``. ``"float64"`` is allowed.
        k_scale, v_scale, kv_dtype: an fp8 cache's scales and format, as in
            :func:`reference_attention`: the cache is dequantized first (``fp8 * scale`` of each
            KV head, float64), then attended as any other.

    Returns:
        ``[total_query_tokens, num_q_heads, head_dim]`` array on the inputs' device.

    Raises:
        ValueError: wrong shapes, bad ``query_start_loc``, ``n_i > context_lens[i]``, lengths
            past the table, block ids out of range, or bad scales (not positive and finite, of
            the wrong shape, or given for a cache that is not fp8).
        TypeError: wrong dtypes (an fp8 ``q``, a ``uint8`` cache without ``kv_dtype``),
            arrays on different devices, or a ``causal`` that is not a bool.
    """
    xp = array_module(q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    compute = np.dtype(compute_dtype)
    if compute not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"expected compute_dtype float32 or float64, got {compute_dtype!r}")
    k_cache, v_cache, likes = _dequantized_caches(q, k_cache, v_cache, k_scale, v_scale, kv_dtype)
    dims = check_prefill_args(q, *likes, block_tables, context_lens, query_start_loc)
    causal = as_bool(causal, "causal")
    total, num_q_heads, head_dim = q.shape
    block_size = dims.block_size
    variants = check_variants(xp, num_q_heads, window_left, logits_soft_cap, alibi_slopes)
    sinks = check_sinks(xp, num_q_heads, sinks)
    tables, lens = to_numpy(block_tables), to_numpy(context_lens)
    starts = to_numpy(query_start_loc)
    check_query_start_loc(starts, lens, total)
    check_context_lens(lens, dims.max_blocks * block_size)
    rows = np.diff(starts.astype(np.int64))
    firsts = variants.first_key(lens.astype(np.int64) - rows)  # of each sequence's first query
    check_block_ids(tables, lens, block_size, dims.num_blocks, firsts)
    scale = head_dim**-0.5 if scale is None else float(scale)
    kv_head_of = xp.arange(num_q_heads) // (num_q_heads // dims.num_kv_heads)
    score = _Scores(xp, compute, scale, variants, sinks)

    out = xp.zeros((total, num_q_heads, head_dim), compute)
    for i in range(dims.num_seqs):
        begin, end, length = int(starts[i]), int(starts[i + 1]), int(lens[i])
        n = end - begin
        if n == 0:
            continue
        base, k, v = _gather_window(k_cache, v_cache, tables[i], int(firsts[i]), length, compute)
        k, v = k[kv_head_of], v[kv_head_of]  # [Hq, L - base, D]
        for j in range(n):
            position = length - n + j
            first = variants.first_key(position)
            last = position + 1 if causal else length
            qj = to_float(q[begin + j], compute)  # [Hq, D]
            out[begin + j] = score.attend(qj, k, v, base, position, first, last)

    target = dims.dtype if out_dtype is None else out_dtype
    if target == "float64":
        return out.astype(np.float64, copy=False)  # float64 whatever compute_dtype was
    return from_float(out, dtype_name(target), like=q)


class _Scores:
    """One query row's attention over its visible keys, with the variants: the scaled scores,
    soft-capped, ALiBi added, the window's and the causal bound's keys left out (sliced away,
    not masked, so that a NaN or Inf in an unseen key's V cannot reach the row), and a softmax
    whose denominator has the sink."""

    def __init__(self, xp: Any, compute: np.dtype, scale: float, variants: Variants, sinks: Any):
        self.xp, self.compute, self.scale, self.variants = (
            xp,
            compute,
            compute.type(scale),
            variants,
        )
        self.slopes = (
            None if variants.alibi_slopes is None else variants.alibi_slopes.astype(compute)
        )
        self.sinks = None if sinks is None else sinks.astype(compute)

    def attend(
        self, q: Any, k: Any, v: Any, base: int, position: int, first: int, last: int
    ) -> Any:
        """``q`` ``[Hq, D]`` at ``position`` over the keys ``first .. last - 1`` of ``k``/``v``
        (``[Hq, n, D]``, the keys from position ``base`` on): ``[Hq, D]``."""
        xp = self.xp
        k, v = k[:, first - base : last - base], v[:, first - base : last - base]
        keys = xp.arange(first, last)
        if k.shape[1] == 0:
            return xp.zeros(q.shape, self.compute)
        scores = xp.einsum("hd,hld->hl", q, k) * self.scale  # [Hq, keys]
        cap = self.variants.logits_soft_cap
        if cap > 0:
            scores = self.compute.type(cap) * xp.tanh(scores / self.compute.type(cap))
        if self.slopes is not None:
            scores = scores + self.slopes[:, None] * (keys - position).astype(self.compute)[None, :]
        peak = scores.max(axis=1)
        if self.sinks is not None:
            peak = xp.maximum(peak, self.sinks)
        # A row without a finite peak (every score -inf, one +inf, a NaN) is NaN as written
        # (docs/variants.md: exp(inf - inf)), as in the kernels: said outright, not computed,
        # which NumPy would report with a RuntimeWarning ("invalid value encountered").
        finite = xp.isfinite(peak)
        peak = xp.where(finite, peak, 0)
        shifted = xp.where(finite[:, None], scores - peak[:, None], 0)
        weights = xp.where(finite[:, None], xp.exp(shifted), self.compute.type(np.nan))
        total = weights.sum(axis=1)
        if self.sinks is not None:
            total = total + xp.exp(xp.where(finite, self.sinks - peak, 0))
        return xp.einsum("hl,hld->hd", weights, v) / total[:, None]


def _gather_window(
    k_cache: Any, v_cache: Any, row: np.ndarray, first: int, length: int, dtype: np.dtype
) -> tuple[int, Any, Any]:
    """``(base, k, v)``: a sequence's tokens ``base .. length - 1`` of every KV head
    (``[num_kv_heads, length - base, head_dim]`` as ``dtype``), ``base`` the start of the block
    holding position ``first``: the table entries before it are not read."""
    block_size = k_cache.shape[2]
    first_block = min(first, length) // block_size
    xp = array_module(k_cache)
    blocks = xp.asarray(row[first_block : cdiv(length, block_size)])
    base = first_block * block_size
    k = _gather_sequence(k_cache, blocks, length - base, dtype)
    v = _gather_sequence(v_cache, blocks, length - base, dtype)
    return base, k, v


def _gather_sequence(cache: Any, blocks: Any, length: int, dtype: np.dtype) -> Any:
    """``[num_kv_heads, length, head_dim]``: a sequence's tokens, in order, as ``dtype``."""
    gathered = cache[blocks]  # [n_blocks, H, block_size, D]
    n_blocks, heads, block_size, head_dim = gathered.shape
    tokens = gathered.transpose(1, 0, 2, 3).reshape(heads, n_blocks * block_size, head_dim)
    if tokens.dtype == np.float64:  # a dequantized fp8 cache (_dequantized_caches)
        return tokens[:, :length].astype(dtype, copy=False)
    return to_float(tokens[:, :length], dtype)


def reference_write_kv(
    k_cache: Any,
    v_cache: Any,
    k: Any,
    v: Any,
    slot_mapping: Any,
    k_scale: Any = None,
    v_scale: Any = None,
    kv_dtype: Any = None,
) -> None:
    """Scatter token ``t``'s K/V to slot ``slot_mapping[t]`` (skip ``-1``), in place.

    ``slot = block * block_size + offset``. Shapes as in :func:`cupaged.write_kv`, and not
    checked (nor the slots). An fp8 cache (``ml_dtypes``, or ``uint8`` with ``kv_dtype``) stores
    ``float_to_fp8_bits(float32(x) / scale)``: the quotient in float32, then clamped and rounded
    to nearest even; ``k_scale`` / ``v_scale`` are ``None`` (1.0), a number (taken as float32)
    or a float32 array of shape ``()``, ``[1]`` or ``[num_kv_heads]`` on the cache's device.

    Raises:
        TypeError, ValueError: the scales, checked as :func:`cupaged.write_kv` checks them (a
            zero, negative, infinite or NaN one, a complex one, one of another shape, dtype or
            device, scales for a cache that is not fp8), before anything is written.
    """
    block_size = k_cache.shape[2]
    elem = array_dtype_name(k_cache, kv_dtype)
    if is_fp8(elem) or k_scale is not None or v_scale is not None:
        xp = array_module(k_cache)
        kv_scale_args(xp, elem, k_cache.shape[1], k_scale, v_scale)  # the checks only
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].astype(np.int64)
    blocks, offsets = slots // block_size, slots % block_size
    for cache, x, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        if is_fp8(elem):
            rows = float_to_fp8_bits(to_float(x[keep]) / _per_head(x, scale), elem)
        else:
            rows = as_storage(x)[keep]
        as_storage(cache)[blocks, :, offsets, :] = rows


def _per_head(x: Any, scale: Any) -> Any:
    """A scale as float32, shaped to divide ``[num_tokens, num_kv_heads, head_dim]`` rows."""
    if scale is None:
        return np.float32(1.0)
    if not hasattr(scale, "shape") or isinstance(scale, np.generic):
        return np.float32(scale)
    return array_module(x).asarray(scale, dtype=np.float32).reshape(-1, 1)


def reference_copy_blocks(k_cache: Any, v_cache: Any, src: Any, dst: Any) -> None:
    """Copy block ``src[i]`` to block ``dst[i]`` in every layer, in place; no checks.

    The block axis is the fourth from the end, so a single layer ``[num_blocks, ...]`` and the
    whole cache ``[num_layers, num_blocks, ...]`` both work.
    """
    for cache in (k_cache, v_cache):
        layers = (slice(None),) * (cache.ndim - 4)
        cache[(*layers, dst)] = cache[(*layers, src)]


def _dequantized_caches(
    q: Any, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any, kv_dtype: Any
) -> tuple[Any, Any, tuple[Any, Any]]:
    """``(k, v, likes)`` of an attention oracle's caches: for an fp8 cache, K and V dequantized
    (``to_float`` times the scale of each KV head, float64, ``[num_blocks, num_kv_heads,
    block_size, head_dim]``) and ``likes``, stand-ins of ``q``'s element type with the caches'
    shapes for the shape checks (which read metadata only); for another cache the caches as they
    are, twice.

    Raises:
        TypeError: a ``uint8`` cache without ``kv_dtype``, a ``kv_dtype`` for a cache that is not
            fp8, an fp8 ``q``, K and V of different types, or scales of the wrong type.
        ValueError: scales for a cache that is not fp8, not positive and finite, or of another
            shape than ``()``, ``[1]`` or ``[num_kv_heads]``.
    """
    xp = array_module(q, k_cache, v_cache)
    elem = _fp8_name(k_cache, kv_dtype)
    num_kv_heads = k_cache.shape[1] if k_cache.ndim == 4 else 0
    if elem is None:
        if k_scale is not None or v_scale is not None:
            kv_scale_args(xp, array_dtype_name(k_cache), num_kv_heads, k_scale, v_scale)  # raises
        return k_cache, v_cache, (k_cache, v_cache)
    if array_dtype_name(v_cache, kv_dtype) != elem:
        raise TypeError(f"expected v_cache of dtype {elem} (k_cache's), got {v_cache.dtype}")
    if is_fp8(array_dtype_name(q)):
        raise TypeError(f"expected q of dtype float32, float16 or bfloat16, got {q.dtype}")
    zero = xp.zeros((), q.dtype)
    likes = (xp.broadcast_to(zero, k_cache.shape), xp.broadcast_to(zero, v_cache.shape))
    if k_cache.ndim != 4:
        return k_cache, v_cache, likes  # the shape checks say what was expected
    kv_scale_args(xp, elem, num_kv_heads, k_scale, v_scale)  # the checks only
    k = to_float(k_cache, np.float64, kv_dtype) * _head_scales(xp, k_scale, num_kv_heads)
    v = to_float(v_cache, np.float64, kv_dtype) * _head_scales(xp, v_scale, num_kv_heads)
    return k, v, likes


def _fp8_name(cache: Any, kv_dtype: Any) -> str | None:
    """The fp8 format of a cache, or ``None`` for another element type (or an unknown dtype,
    which the shape and dtype checks name)."""
    if kv_dtype is None and cache.dtype != np.uint8:
        try:
            name = array_dtype_name(cache)
        except TypeError:
            return None
        return name if is_fp8(name) else None
    return array_dtype_name(cache, kv_dtype)  # raises for uint8 alone, or kv_dtype of a non-fp8


def _head_scales(xp: Any, scale: Any, num_kv_heads: int) -> Any:
    """A checked scale as float64 ``[1, num_kv_heads, 1, 1]``: a number as float32 (as the
    kernels take it), an array's values, ``None`` 1.0."""
    if scale is None:
        values = xp.ones(1, np.float64)
    elif not hasattr(scale, "shape") or isinstance(scale, np.generic):
        values = xp.full(1, np.float32(scale), np.float64)
    else:
        values = xp.asarray(scale).astype(np.float64).reshape(-1)
    return xp.broadcast_to(values, (num_kv_heads,)).reshape(1, num_kv_heads, 1, 1)
