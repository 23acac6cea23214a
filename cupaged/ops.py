"""The functional API: NumPy-style functions on raw cache arrays.

The array module of the inputs picks the backend: CuPy arrays run on the GPU, NumPy arrays on the
CPU; mixing them is a ``TypeError``. Every function checks shapes and dtypes before touching memory,
so a rejected call changes nothing.

``write_kv`` and ``copy_blocks`` are implemented with array ops for now (the same as the reference);
the fused CUDA kernels of ``cuda/`` take their place behind these signatures.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._backend import array_module, to_numpy
from ._checks import check_dtype, check_index_array, check_shape
from .dtypes import array_dtype_name
from .reference import reference_copy_blocks, reference_write_kv

_LAYER_AXES = ("num_blocks", "num_kv_heads", "block_size", "head_dim")


def write_kv(
    k_cache: Any, v_cache: Any, k: Any, v: Any, slot_mapping: Any, *, checked: bool = False
) -> None:
    """Write new tokens' keys and values into one layer of a paged cache, in place.

    Token ``t`` goes to block ``slot_mapping[t] // block_size`` at offset
    ``slot_mapping[t] % block_size``; a slot of ``-1`` skips the token (padding)::

        slot = block * block_size + offset        block_size = 4, slot 9 -> block 2, offset 1

    Args:
        k_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]`` float32, float16 or bfloat16
            (``uint16``), written in place.
        v_cache: same shape and dtype as ``k_cache``, written in place.
        k: ``[num_tokens, num_kv_heads, head_dim]``, same element type as the cache.
        v: same shape and element type as ``k``.
        slot_mapping: ``[num_tokens]`` int32 or int64.
        checked: also check, at the cost of a device synchronisation, that every slot is ``-1`` or
            inside the cache and that no slot appears twice.

    Raises:
        TypeError: arrays on different devices, or wrong dtypes.
        ValueError: wrong shapes, or (checked) a slot out of range or repeated.
    """
    array_module(k_cache, v_cache, k, v, slot_mapping)
    num_blocks, num_kv_heads, block_size, head_dim = check_shape(
        "k_cache", k_cache, [(axis, None) for axis in _LAYER_AXES]
    )
    check_shape("v_cache", v_cache, list(zip(_LAYER_AXES, k_cache.shape, strict=True)))
    token_dims = [("num_tokens", None), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)]
    num_tokens, _, _ = check_shape("k", k, token_dims)
    check_shape("v", v, [("num_tokens", num_tokens), *token_dims[1:]])
    check_shape("slot_mapping", slot_mapping, [("num_tokens", num_tokens)])
    check_index_array("slot_mapping", slot_mapping)
    elem = array_dtype_name(k_cache)
    check_dtype("v_cache", v_cache, elem, "k_cache's dtype")
    check_dtype("k", k, elem, "the cache's dtype")
    check_dtype("v", v, elem, "the cache's dtype")
    if checked and num_tokens:
        slots = to_numpy(slot_mapping)
        capacity = num_blocks * block_size
        bad = slots[(slots < -1) | (slots >= capacity)]
        if bad.size:
            raise ValueError(f"expected slots in [0, {capacity}) or -1, got {bad[:8].tolist()}")
        used = slots[slots >= 0]
        if np.unique(used).size != used.size:
            raise ValueError("expected distinct slots, got a slot written twice")
    reference_write_kv(k_cache, v_cache, k, v, slot_mapping)


def copy_blocks(k_cache: Any, v_cache: Any, src: Any, dst: Any, *, checked: bool = False) -> None:
    """Copy block ``src[i]`` onto block ``dst[i]`` in every layer of K and V, in place.

    Copy-on-write uses it to give a sequence its own copy of a shared block. The pairs are copied
    in parallel, so an id that is both a source and a destination, or a repeated destination, gives
    an undefined result; ``checked`` rejects both.

    Args:
        k_cache: ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`` (the whole cache)
            or ``[num_blocks, num_kv_heads, block_size, head_dim]`` (one layer).
        v_cache: same shape and dtype as ``k_cache``.
        src: ``[num_copies]`` int32 or int64 block ids.
        dst: ``[num_copies]`` int32 or int64 block ids.
        checked: also check, at the cost of a device synchronisation, that ids are in range,
            destinations distinct, and no id both a source and a destination.

    Raises:
        TypeError: arrays on different devices, or wrong dtypes.
        ValueError: wrong shapes, or (checked) bad block ids.
    """
    array_module(k_cache, v_cache, src, dst)
    if k_cache.ndim not in (4, 5):
        raise ValueError(
            "expected k_cache of shape ([num_layers,] num_blocks, num_kv_heads, block_size, "
            f"head_dim), got {tuple(k_cache.shape)}"
        )
    axes = ("num_layers",) * (k_cache.ndim - 4) + _LAYER_AXES
    check_shape("v_cache", v_cache, list(zip(axes, k_cache.shape, strict=True)))
    check_dtype("v_cache", v_cache, array_dtype_name(k_cache), "k_cache's dtype")
    (num_copies,) = check_shape("src", src, [("num_copies", None)])
    check_shape("dst", dst, [("num_copies", num_copies)])
    check_index_array("src", src)
    check_index_array("dst", dst)
    if checked and num_copies:
        num_blocks = k_cache.shape[-4]
        ids = np.concatenate([to_numpy(src), to_numpy(dst)])
        if ids.min() < 0 or ids.max() >= num_blocks:
            raise ValueError(f"expected block ids in [0, {num_blocks}), got {ids.tolist()}")
        dst_ids = to_numpy(dst)
        if np.unique(dst_ids).size != num_copies:
            raise ValueError(f"expected distinct destination blocks, got {dst_ids.tolist()}")
        both = np.intersect1d(to_numpy(src), dst_ids)
        if both.size:
            raise ValueError(f"expected no block both source and destination, got {both.tolist()}")
    if num_copies:
        reference_copy_blocks(k_cache, v_cache, src, dst)
