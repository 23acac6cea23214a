"""The functional API: NumPy-style functions on raw cache arrays, run by the kernels in ``cuda/``.

The array module of the inputs picks the backend: CuPy arrays run the CUDA kernels on the GPU
(CuPy ``RawModule``), NumPy arrays run the *same kernel source* on the CPU backend; mixing them is
a ``TypeError``. Every function checks shapes, dtypes, contiguity and alignment before launching,
so a rejected call changes nothing. Launch configurations come from ``cupaged._launch``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from . import _launch
from ._backend import array_module, device_module, to_numpy
from ._checks import (
    check_attention_args,
    check_block_ids,
    check_context_lens,
    check_dtype,
    check_index_array,
    check_shape,
)
from ._kernels import get_kernel
from .dtypes import array_dtype_name, as_storage, itemsize

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
            (``uint16``), C-contiguous, written in place.
        v_cache: same shape and dtype as ``k_cache``, written in place.
        k: ``[num_tokens, num_kv_heads, head_dim]``, same element type as the cache.
        v: same shape and element type as ``k``.
        slot_mapping: ``[num_tokens]`` int32 or int64.
        checked: also check, at the cost of a device synchronisation, that every slot is ``-1`` or
            inside the cache and that no slot appears twice (two writes to one slot race).

    Raises:
        TypeError: arrays on different devices, or wrong dtypes.
        ValueError: wrong shapes, a cache that is not C-contiguous, or (checked) a slot out of
            range or repeated.
    """
    xp = array_module(k_cache, v_cache, k, v, slot_mapping)
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
    _check_contiguous(k_cache=k_cache, v_cache=v_cache)
    if checked and num_tokens:
        slots = to_numpy(slot_mapping)
        capacity = num_blocks * block_size
        bad = slots[(slots < -1) | (slots >= capacity)]
        if bad.size:
            raise ValueError(f"expected slots in [0, {capacity}) or -1, got {bad[:8].tolist()}")
        used = slots[slots >= 0]
        if np.unique(used).size != used.size:
            raise ValueError("expected distinct slots, got a slot written twice")
    if num_tokens == 0:
        return
    k_cache, v_cache = as_storage(k_cache), as_storage(v_cache)
    k, v = xp.ascontiguousarray(as_storage(k)), xp.ascontiguousarray(as_storage(v))
    slots = xp.ascontiguousarray(slot_mapping)
    aligned = all(_address(x) % 16 == 0 for x in (k_cache, v_cache, k, v))
    name, grid, block = _launch.write_kv_launch(
        elem, slots.dtype, num_tokens, head_dim * itemsize(elem), aligned
    )
    kernel = get_kernel(_device(xp), "write_kv.cu", name)
    scalars = (np.int32(num_kv_heads), np.int32(block_size), np.int32(head_dim))
    kernel(grid, block, (k, v, k_cache, v_cache, slots, *scalars))


def copy_blocks(k_cache: Any, v_cache: Any, src: Any, dst: Any, *, checked: bool = False) -> None:
    """Copy block ``src[i]`` onto block ``dst[i]`` in every layer of K and V, in place, in one launch.

    Copy-on-write uses it to give a sequence its own copy of a shared block. The pairs are copied
    in parallel, so an id that is both a source and a destination, or a repeated destination, gives
    an undefined result; ``checked`` rejects both.

    Args:
        k_cache: ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`` (the whole cache)
            or ``[num_blocks, num_kv_heads, block_size, head_dim]`` (one layer), C-contiguous.
        v_cache: same shape and dtype as ``k_cache``.
        src: ``[num_copies]`` int32 or int64 block ids.
        dst: ``[num_copies]`` int32 or int64 block ids.
        checked: also check, at the cost of a device synchronisation, that ids are in range,
            destinations distinct, and no id both a source and a destination.

    Raises:
        TypeError: arrays on different devices, or wrong dtypes.
        ValueError: wrong shapes, caches that are not C-contiguous, or (checked) bad block ids.
    """
    xp = array_module(k_cache, v_cache, src, dst)
    if k_cache.ndim not in (4, 5):
        raise ValueError(
            "expected k_cache of shape ([num_layers,] num_blocks, num_kv_heads, block_size, "
            f"head_dim), got {tuple(k_cache.shape)}"
        )
    axes = ("num_layers",) * (k_cache.ndim - 4) + _LAYER_AXES
    check_shape("v_cache", v_cache, list(zip(axes, k_cache.shape, strict=True)))
    elem = array_dtype_name(k_cache)
    check_dtype("v_cache", v_cache, elem, "k_cache's dtype")
    (num_copies,) = check_shape("src", src, [("num_copies", None)])
    check_shape("dst", dst, [("num_copies", num_copies)])
    check_index_array("src", src)
    check_index_array("dst", dst)
    _check_contiguous(k_cache=k_cache, v_cache=v_cache)
    num_blocks = k_cache.shape[-4]
    if checked and num_copies:
        ids = np.concatenate([to_numpy(src), to_numpy(dst)])
        if ids.min() < 0 or ids.max() >= num_blocks:
            raise ValueError(f"expected block ids in [0, {num_blocks}), got {ids.tolist()}")
        dst_ids = to_numpy(dst)
        if np.unique(dst_ids).size != num_copies:
            raise ValueError(f"expected distinct destination blocks, got {dst_ids.tolist()}")
        both = np.intersect1d(to_numpy(src), dst_ids)
        if both.size:
            raise ValueError(f"expected no block both source and destination, got {both.tolist()}")
    if num_copies == 0:
        return
    num_layers = k_cache.shape[0] if k_cache.ndim == 5 else 1
    block_bytes = int(np.prod(k_cache.shape[-3:])) * itemsize(elem)
    aligned = _address(k_cache) % 16 == 0 and _address(v_cache) % 16 == 0
    name, grid, block, word = _launch.copy_blocks_launch(
        block_bytes, aligned, num_copies, num_layers
    )
    kernel = get_kernel(_device(xp), "copy_blocks.cu", name)
    src = xp.ascontiguousarray(src, dtype=np.int32)
    dst = xp.ascontiguousarray(dst, dtype=np.int32)
    args = (k_cache, v_cache, src, dst, np.int32(num_blocks), np.int64(block_bytes // word))
    kernel(grid, block, args)


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
    checked: bool = False,
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
        max_context_len: the longest context in the batch, to size the splits without reading
            ``context_lens`` back from the device; computed (one synchronisation) when ``None``.
        out: optional ``[num_seqs, num_q_heads, head_dim]`` C-contiguous output, ``q``'s dtype.
        num_splits: force this many splits (the heuristic in ``cupaged._launch`` decides when
            ``None``).
        checked: also check context lengths and the block ids they use (one synchronisation).

    Returns:
        ``[num_seqs, num_q_heads, head_dim]`` in ``q``'s dtype, on the inputs' device.

    Raises:
        TypeError: arrays on different devices, or wrong dtypes.
        ValueError: wrong shapes, an unsupported head_dim or block_size (the message lists the
            supported ones), caches not C-contiguous or not 16-byte aligned, or (checked) bad
            context lengths or block ids.
    """
    xp = array_module(q, k_cache, v_cache, block_tables, context_lens)
    dims = check_attention_args(q, k_cache, v_cache, block_tables, context_lens)
    _launch.check_decode_shape(dims.dtype, dims.head_dim, dims.block_size)
    _check_contiguous(k_cache=k_cache, v_cache=v_cache)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if _address(x) % 16:
            raise ValueError(f"expected {name} 16-byte aligned, got address {_address(x):#x}")
    if out is None:
        out = xp.empty(q.shape, q.dtype)  # q's dtype object: bfloat16 in, bfloat16 out
    else:
        array_module(q, out)
        check_shape(
            "out", out, list(zip(("num_seqs", "num_q_heads", "head_dim"), q.shape, strict=True))
        )
        check_dtype("out", out, dims.dtype, "q's dtype")
        _check_contiguous(out=out)
    if dims.num_seqs == 0:
        return out
    tables = xp.ascontiguousarray(block_tables, dtype=np.int32)
    lens = xp.ascontiguousarray(context_lens, dtype=np.int32)
    if checked or max_context_len is None:
        host_lens = to_numpy(lens)
        if checked:
            check_context_lens(host_lens, dims.max_blocks * dims.block_size)
            check_block_ids(to_numpy(tables), host_lens, dims.block_size, dims.num_blocks)
        if max_context_len is None:
            max_context_len = int(host_lens.max())
    group = dims.num_q_heads // dims.num_kv_heads
    device = _device(xp)
    launch = _launch.decode_launch(
        dims.dtype, dims.num_seqs, dims.num_kv_heads, group, dims.head_dim, dims.block_size,
        int(max_context_len), _sm_count(device), num_splits,
    )  # fmt: skip
    if device == "cuda" and launch.shared_mem > _device_shared_memory_limit():
        raise ValueError(
            f"expected at most {_device_shared_memory_limit()} bytes of shared memory per block, "
            f"got {launch.shared_mem} for {group} query heads per KV head at head_dim "
            f"{dims.head_dim}; split the query heads into several calls"
        )
    kernel = get_kernel(device, "paged_attention.cu", launch.name)
    if device == "cuda" and launch.shared_mem > _launch.DEFAULT_SHARED_MEMORY:
        kernel.max_dynamic_shared_size_bytes = launch.shared_mem
    split_shape = (dims.num_seqs, dims.num_q_heads, launch.num_splits)
    if launch.num_splits > 1:
        partial_out = xp.empty((*split_shape, dims.head_dim), np.float32)
        partial_lse = xp.empty(split_shape, np.float32)
    else:  # unused by the kernel; real arrays so that no argument is a null pointer
        partial_out = partial_lse = xp.empty(1, np.float32)
    scale = dims.head_dim**-0.5 if scale is None else scale
    q = xp.ascontiguousarray(as_storage(q))
    out_storage = as_storage(out)
    args = (
        out_storage, partial_out, partial_lse, q, as_storage(k_cache), as_storage(v_cache),
        tables, lens, np.int32(dims.num_kv_heads), np.int32(group), np.int32(dims.max_blocks),
        np.int32(launch.partition_tokens), np.float32(scale),
    )  # fmt: skip
    kernel(launch.grid, launch.block, args, shared_mem=launch.shared_mem)
    if launch.num_splits > 1:
        merge = get_kernel(device, "paged_attention.cu", launch.merge_name)
        merge(
            launch.merge_grid,
            launch.block,
            (out_storage, partial_out, partial_lse, np.int32(launch.num_splits)),
        )
    return out


def _device(xp: Any) -> str:
    return "cpu" if xp is np else "cuda"


def _device_shared_memory_limit() -> int:
    cupy = device_module("cuda")
    return _device_attribute(cupy.cuda.Device().id, "MaxSharedMemoryPerBlockOptin")


@functools.cache
def _device_attribute(device_id: int, name: str) -> int:
    return int(device_module("cuda").cuda.Device(device_id).attributes[name])


def _sm_count(device: str) -> int:
    if device == "cpu":
        return _launch.NOMINAL_SM_COUNT
    return _device_attribute(device_module("cuda").cuda.Device().id, "MultiProcessorCount")


def _address(x: Any) -> int:
    """Address of an array's first element (NumPy or CuPy)."""
    return int(x.data.ptr) if hasattr(x.data, "ptr") else int(x.ctypes.data)


def _check_contiguous(**arrays: Any) -> None:
    for name, x in arrays.items():
        if not x.flags.c_contiguous:
            raise ValueError(f"expected {name} C-contiguous, got strides {x.strides}")
