"""Where a cache's blocks are in memory, and the NIXL descriptors of a set of them.

A :class:`~cupaged.PagedCache` keeps K and V each as one ``[num_layers, num_blocks, num_kv_heads,
block_size, head_dim]`` array, so block ``b`` of layer ``l`` is ``block_bytes`` contiguous bytes
at ``base + (l * num_blocks + b) * block_bytes``, and consecutive block ids are adjacent::

    K, layer 0:  [b0][b1][b2][b3][b4] ...      K, layer 1:  [b0][b1][b2][b3][b4] ...
    src 1 2 3 -> dst 6 7 8                     one run: one descriptor per layer per K/V,
    src 4     -> dst 2                         a second run (dst is not 9): another

A transfer of ``n`` blocks that fall into ``r`` runs (consecutive on *both* sides) is
``2 * num_layers * r`` descriptors, never ``2 * num_layers * n``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import is_cupy_array
from ..dtypes import is_fp8, itemsize
from ..errors import CupagedError
from .wire import LAYOUT, CacheLayout


def cache_layout(cache: Any, name: str) -> CacheLayout:
    """The :class:`CacheLayout` of a :class:`~cupaged.PagedCache` as it is now (its fp8 scales
    ``None`` while any layer's ``"auto"`` scales are pending).

    Raises:
        ValueError: K or V not one C-contiguous array (never so for a ``PagedCache``'s own).
    """
    spec = cache.spec
    for what, array in (("k", cache.k), ("v", cache.v)):
        if not array.flags.c_contiguous:
            raise ValueError(f"expected cache.{what} C-contiguous (one registration), got strides")
    if is_cupy_array(cache.k):
        memory, device_id = "VRAM", int(cache.k.device.id)
        k_addr, v_addr = int(cache.k.data.ptr), int(cache.v.data.ptr)
    else:
        memory, device_id = "DRAM", 0
        k_addr, v_addr = int(cache.k.ctypes.data), int(cache.v.ctypes.data)
    k_scales, v_scales = cache_scales(cache)
    return CacheLayout(
        name=name,
        layout=LAYOUT,
        dtype=spec.dtype,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        block_size=spec.block_size,
        head_dim=spec.head_dim,
        num_blocks=cache.num_blocks,
        block_bytes=spec.num_kv_heads * spec.block_size * spec.head_dim * itemsize(spec.dtype),
        memory=memory,
        device_id=device_id,
        k_addr=k_addr,
        v_addr=v_addr,
        k_scales=k_scales,
        v_scales=v_scales,
    )


def register(agent: Any, cache: Any, layout: CacheLayout) -> Any:
    """Register ``cache.k`` and ``cache.v`` with the NIXL ``agent``, one region each; the
    registration (for ``deregister_memory``)."""
    rows = [
        (layout.k_addr, int(cache.k.nbytes), layout.device_id, ""),
        (layout.v_addr, int(cache.v.nbytes), layout.device_id, ""),
    ]
    return agent.register_memory(rows, layout.memory)


def cache_scales(cache: Any) -> tuple[Any, Any]:
    """An fp8 cache's ``(k_scales, v_scales)`` as ``[num_layers][num_kv_heads]`` float lists;
    ``(None, None)`` for a cache that is not fp8 or whose ``"auto"`` scales are still pending
    in some layer (nothing is known yet to compare)."""
    if not is_fp8(cache.spec.dtype):
        return None, None
    k_rows, v_rows = [], []
    for layer in range(cache.spec.num_layers):
        try:
            cache.scale_options(layer, write=True)  # refuses a layer still pending
        except CupagedError:
            return None, None
        k, v = cache.kv_scales(layer)
        k_rows.append(_host(k).tolist())
        v_rows.append(_host(v).tolist())
    return k_rows, v_rows


def _host(x: Any) -> np.ndarray:
    return np.asarray(x.get() if is_cupy_array(x) else x, np.float64)


def runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of block pairs consecutive on both sides: ``(src_starts, dst_starts, lengths)``,
    ``[r]`` int64 each, for ``[n]`` int block ids ``src`` (this side) and ``dst`` (the peer's).

    Example:
        >>> s, d, n = runs(np.array([1, 2, 3, 4]), np.array([6, 7, 8, 2]))
        >>> s.tolist(), d.tolist(), n.tolist()
        ([1, 4], [6, 2], [3, 1])
    """
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    if src.size == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], lengths


def descriptor_rows(layout: CacheLayout, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``[2 * num_layers * r, 3]`` uint64 NIXL descriptor rows ``(address, bytes, device)`` of
    ``r`` runs of a cache: every layer of K, then every layer of V; run ``i`` covers blocks
    ``starts[i] .. starts[i] + lengths[i] - 1``. The peer's rows for the same runs come in the
    same order, so row ``j`` here is written to row ``j`` there."""
    block, layer = layout.block_bytes, layout.num_blocks * layout.block_bytes
    bases = np.array([layout.k_addr, layout.v_addr], np.uint64)[:, None, None]
    layers = (np.arange(layout.num_layers, dtype=np.uint64) * np.uint64(layer))[None, :, None]
    offsets = (np.asarray(starts, np.uint64) * np.uint64(block))[None, None, :]
    addresses = (bases + layers + offsets).reshape(-1)
    sizes = np.broadcast_to(
        np.asarray(lengths, np.uint64) * np.uint64(block), (2, layout.num_layers, len(starts))
    )
    rows = np.empty((addresses.size, 3), np.uint64)
    rows[:, 0] = addresses
    rows[:, 1] = sizes.reshape(-1)
    rows[:, 2] = layout.device_id
    return rows
