"""The oracle: paged attention, KV write and block copy in plain array ops.

Deliberately naive, and sharing no code with the kernels: every sequence's K/V is gathered through
its block table into a contiguous array and attended with an explicit softmax. Runs on NumPy and
CuPy alike (``xp`` is the module of the inputs). Slow by design; use it to check, not to serve.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._backend import array_module, to_numpy
from ._checks import (
    as_bool,
    check_attention_args,
    check_block_ids,
    check_context_lens,
    check_prefill_args,
    check_query_start_loc,
)
from ._util import cdiv
from .dtypes import as_storage, dtype_name, from_float, to_float


def reference_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_tables: Any,
    context_lens: Any,
    scale: float | None = None,
    *,
    compute_dtype: str = "float32",
    out_dtype: str | None = None,
) -> Any:
    """Decode attention of one query token per sequence over a paged KV cache, naively.

    For sequence ``i`` and query head ``h``, with ``g = num_q_heads // num_kv_heads`` query heads per
    KV head and ``L = context_lens[i]``::

        K, V = tokens 0 .. L-1 of KV head h // g, gathered through block_tables[i]
        out[i, h] = softmax(scale * K @ q[i, h]) @ V

    A sequence with ``L == 0`` gets a zero output row.

    Args:
        q: ``[num_seqs, num_q_heads, head_dim]`` float32, float16 or bfloat16 (as ``uint16``).
        k_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, same element type as ``q``.
        v_cache: same shape and element type as ``k_cache``.
        block_tables: ``[num_seqs, max_blocks]`` int32/int64; entry ``j`` of row ``i`` is the
            physical block holding tokens ``j * block_size ..`` of sequence ``i``.
        context_lens: ``[num_seqs]`` int32/int64, each in ``[0, max_blocks * block_size]``.
        scale: softmax scale; ``head_dim ** -0.5`` when ``None``.
        compute_dtype: ``"float32"`` (the default) or ``"float64"`` for scores, softmax and sums.
        out_dtype: element type of the result; ``q``'s when ``None``. ``"float64"`` is allowed.

    Returns:
        ``[num_seqs, num_q_heads, head_dim]`` array on the inputs' device.
    """
    xp = array_module(q, k_cache, v_cache, block_tables, context_lens)
    compute = np.dtype(compute_dtype)
    if compute not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"expected compute_dtype float32 or float64, got {compute_dtype!r}")
    dims = check_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    num_seqs, num_q_heads, head_dim = q.shape
    block_size = dims.block_size
    tables, lens = to_numpy(block_tables), to_numpy(context_lens)
    check_context_lens(lens, dims.max_blocks * block_size)
    check_block_ids(tables, lens, block_size, dims.num_blocks)
    scale = head_dim**-0.5 if scale is None else float(scale)
    group = num_q_heads // dims.num_kv_heads
    kv_head_of = xp.arange(num_q_heads) // group

    out = xp.zeros((num_seqs, num_q_heads, head_dim), compute)
    for i in range(num_seqs):
        length = int(lens[i])
        if length == 0:
            continue
        blocks = xp.asarray(tables[i, : cdiv(length, block_size)])
        k = _gather_sequence(k_cache, blocks, length, compute)[kv_head_of]  # [Hq, L, D]
        v = _gather_sequence(v_cache, blocks, length, compute)[kv_head_of]
        qi = to_float(q[i], compute)  # [Hq, D]
        scores = xp.einsum("hd,hld->hl", qi, k) * compute.type(scale)
        scores -= scores.max(axis=1, keepdims=True)
        weights = xp.exp(scores)
        weights /= weights.sum(axis=1, keepdims=True)
        out[i] = xp.einsum("hl,hld->hd", weights, v)

    target = dims.dtype if out_dtype is None else out_dtype
    if target == "float64":
        return out
    return from_float(out, dtype_name(target), like=q)


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
    compute_dtype: str = "float32",
    out_dtype: str | None = None,
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
        compute_dtype: ``"float32"`` (the default) or ``"float64"``.
        out_dtype: element type of the result; ``q``'s when ``None``. ``"float64"`` is allowed.

    Returns:
        ``[total_query_tokens, num_q_heads, head_dim]`` array on the inputs' device.

    Raises:
        ValueError: wrong shapes, bad ``query_start_loc``, ``n_i > context_lens[i]``, lengths
            past the table or block ids out of range.
        TypeError: wrong dtypes, arrays on different devices, or a ``causal`` that is not a
            bool.
    """
    xp = array_module(q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    compute = np.dtype(compute_dtype)
    if compute not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"expected compute_dtype float32 or float64, got {compute_dtype!r}")
    dims = check_prefill_args(q, k_cache, v_cache, block_tables, context_lens, query_start_loc)
    causal = as_bool(causal, "causal")
    total, num_q_heads, head_dim = q.shape
    block_size = dims.block_size
    tables, lens = to_numpy(block_tables), to_numpy(context_lens)
    starts = to_numpy(query_start_loc)
    check_query_start_loc(starts, lens, total)
    check_context_lens(lens, dims.max_blocks * block_size)
    check_block_ids(tables, lens, block_size, dims.num_blocks)
    scale = head_dim**-0.5 if scale is None else float(scale)
    kv_head_of = xp.arange(num_q_heads) // (num_q_heads // dims.num_kv_heads)

    out = xp.zeros((total, num_q_heads, head_dim), compute)
    for i in range(dims.num_seqs):
        begin, end, length = int(starts[i]), int(starts[i + 1]), int(lens[i])
        n = end - begin
        if n == 0:
            continue
        blocks = xp.asarray(tables[i, : cdiv(length, block_size)])
        k = _gather_sequence(k_cache, blocks, length, compute)[kv_head_of]  # [Hq, L, D]
        v = _gather_sequence(v_cache, blocks, length, compute)[kv_head_of]
        qi = to_float(q[begin:end], compute)  # [n, Hq, D]
        scores = xp.einsum("nhd,hld->hnl", qi, k) * compute.type(scale)  # [Hq, n, L]
        if causal:
            position = length - n + xp.arange(n)  # of each query token in the sequence
            future = xp.arange(length)[None, :] > position[:, None]  # [n, L]
            scores = xp.where(future[None], compute.type(-np.inf), scores)
        scores -= scores.max(axis=2, keepdims=True)
        weights = xp.exp(scores)
        weights /= weights.sum(axis=2, keepdims=True)
        # Row by row over the tokens each query sees: a masked token's weight is 0, but
        # 0 * Inf (or NaN) in its V would still reach the row through a full product.
        for j in range(n):
            visible = length - n + j + 1 if causal else length
            out[begin + j] = xp.einsum("hl,hld->hd", weights[:, j, :visible], v[:, :visible])

    target = dims.dtype if out_dtype is None else out_dtype
    if target == "float64":
        return out
    return from_float(out, dtype_name(target), like=q)


def _gather_sequence(cache: Any, blocks: Any, length: int, dtype: np.dtype) -> Any:
    """``[num_kv_heads, length, head_dim]``: a sequence's tokens, in order, as ``dtype``."""
    gathered = cache[blocks]  # [n_blocks, H, block_size, D]
    n_blocks, heads, block_size, head_dim = gathered.shape
    tokens = gathered.transpose(1, 0, 2, 3).reshape(heads, n_blocks * block_size, head_dim)
    return to_float(tokens[:, :length], dtype)


def reference_write_kv(k_cache: Any, v_cache: Any, k: Any, v: Any, slot_mapping: Any) -> None:
    """Scatter token ``t``'s K/V to slot ``slot_mapping[t]`` (skip ``-1``), in place; no checks.

    ``slot = block * block_size + offset``. Shapes as in :func:`cupaged.write_kv`.
    """
    block_size = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].astype(np.int64)
    blocks, offsets = slots // block_size, slots % block_size
    as_storage(k_cache)[blocks, :, offsets, :] = as_storage(k)[keep]
    as_storage(v_cache)[blocks, :, offsets, :] = as_storage(v)[keep]


def reference_copy_blocks(k_cache: Any, v_cache: Any, src: Any, dst: Any) -> None:
    """Copy block ``src[i]`` to block ``dst[i]`` in every layer, in place; no checks.

    The block axis is the fourth from the end, so a single layer ``[num_blocks, ...]`` and the
    whole cache ``[num_layers, num_blocks, ...]`` both work.
    """
    for cache in (k_cache, v_cache):
        layers = (slice(None),) * (cache.ndim - 4)
        cache[(*layers, dst)] = cache[(*layers, src)]
