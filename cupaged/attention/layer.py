"""What the attention plans share: the device and GPU they plan for, the checks of a layer's
arrays against a plan, and the loaded kernel of a launch plan.

The layering reads top-down: ``ops`` (the one-shot forms) -> ``decode`` / ``prefill`` (the plans)
-> this module -> ``kernels.launch_*`` (the launch table), ``kernels.loader`` (compiled kernels),
``backend``.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any

import numpy as np

from .._arrays.checks import as_int, check_dtype, check_shape, check_writable
from ..backend import array_module, device_module
from ..dtypes import (
    Q_DTYPE_NAMES,
    array_dtype_name,
    as_storage,
    cache_dtype,
    carriers,
    dtype_name,
    is_fp8,
)
from ..kernels.loader import get_kernel
from ..kernels.target import DEFAULT_SHARED_MEMORY, NOMINAL_TARGET, Target
from .scales import kv_scale_args

LAYER_AXES = ("num_blocks", "num_kv_heads", "block_size", "head_dim")
DECODE_Q_AXES = ("num_seqs", "num_q_heads", "head_dim")  # a decode step's queries


def device_of(xp: Any) -> str:
    """``"cpu"`` for NumPy (the CPU backend), ``"cuda"`` for CuPy."""
    return "cpu" if xp is np else "cuda"


def device_id(xp: Any) -> int:
    """The current device's id on CUDA (kernels are kept per device), 0 on the CPU: one runtime
    call, no ``Device`` object (every ``run`` asks)."""
    return 0 if xp is np else int(xp.cuda.runtime.getDevice())


def target(device: str) -> Target:
    """The GPU that launches are planned for: the current CUDA device's architecture, its
    multiprocessors and the shared memory a block may opt into; the nominal H100 for the CPU
    backend."""
    if device == "cpu":
        return NOMINAL_TARGET
    return _cuda_target(device_module("cuda").cuda.runtime.getDevice())


@functools.cache
def _cuda_target(cuda_device: int) -> Target:
    device = device_module("cuda").cuda.Device(cuda_device)
    attributes = device.attributes
    return Target(
        int(device.compute_capability),  # "90" on an H100
        int(attributes["MultiProcessorCount"]),
        int(attributes["MaxSharedMemoryPerBlockOptin"]),
    )


def sm_count(device: str) -> int:
    """Multiprocessors of the device launches are planned for (see :func:`target`)."""
    return target(device).sm_count


def address(x: Any) -> int:
    """Address of an array's first element (NumPy or CuPy)."""
    if isinstance(x, np.ndarray):
        try:  # a writable array exports its buffer: the cheapest way to its address
            return ctypes.addressof(ctypes.c_char.from_buffer(x))
        except (TypeError, ValueError, BufferError):  # read-only, empty or strided
            return int(x.ctypes.data)
    return int(x.data.ptr)


def check_contiguous(**arrays: Any) -> None:
    """Refuse an array that is not C-contiguous, naming it and its strides."""
    for name, x in arrays.items():
        if not x.flags.c_contiguous:
            raise ValueError(f"expected {name} C-contiguous, got strides {x.strides}")


def check_aligned(**arrays: Any) -> None:
    """Refuse an array whose first element is not 16-byte aligned (the kernels' vector loads)."""
    for name, x in arrays.items():
        if address(x) % 16:
            raise ValueError(f"expected {name} 16-byte aligned, got address {address(x):#x}")


def check_out_overlap(xp: Any, q: Any, out: Any) -> None:
    """Refuse an ``out`` that shares memory with ``q`` without being ``q`` itself (the same first
    element and strides; its shape and dtype are checked apart).

    A thread block reads its rows and heads of ``q`` before it writes the same rows and heads of
    ``out`` (with split-K, the merge writes them after every block has read), so ``out`` may be
    ``q`` (in place), or memory apart from it; anything between (``out`` a row further along
    ``q``'s buffer) lets one block's output overwrite queries that another block has yet to
    read. ``xp.may_share_memory`` compares the two arrays' byte ranges in one call without
    touching their data (NumPy's is cheaper than reading two addresses from Python; CuPy's runs
    no kernel), and only arrays that may share pay for the addresses.

    Raises:
        ValueError: ``out`` overlaps ``q`` and is not ``q``; nothing is written.
    """
    if not xp.may_share_memory(q, out):
        return
    offset = address(out) - address(q)
    if offset == 0 and out.strides == q.strides:
        return
    raise ValueError(
        f"expected out to be q itself or not to overlap it, got an out that starts {offset:+d} "
        f"bytes from q's first element, strides {out.strides} (q's: {q.strides}, "
        f"{q.nbytes} bytes): a kernel would overwrite queries it has yet to read"
    )


def owned_int32(xp: Any, x: Any) -> Any:
    """A C-contiguous int32 copy of ``x`` on ``xp``'s device that shares no memory with ``x``.

    A plan keeps what it checked: a later write to the caller's array cannot reach a kernel.
    ``x`` may be a host (NumPy) array when ``xp`` is CuPy: the upload is the copy.
    """
    if xp is not np and isinstance(x, np.ndarray):
        return xp.asarray(np.ascontiguousarray(x, dtype=np.int32))
    return x.astype(np.int32, order="C")  # astype copies


def copy_into(dst: Any, src: Any) -> None:
    """Copy ``src`` (int32 or int64, ``dst``'s shape and array type) into ``dst``, a plan's own
    C-contiguous int32 array, narrowing an int64 ``src``.

    On CuPy a C-contiguous int32 ``src`` is one ``cudaMemcpyAsync`` on the current stream
    (``MemoryPointer.copy_from_device_async``), ordered as a kernel there is; the assignment it
    replaces launches CuPy's elementwise copy, whose dispatch costs the host several times as
    much (docs/benchmarks.md, the host path of a decode step).
    """
    if type(dst) is np.ndarray or src.dtype != dst.dtype or not src.flags.c_contiguous:
        dst[...] = src
    else:
        dst.data.copy_from_device_async(src.data, dst.nbytes)


def attention_kernel(
    device: str, source: str, launch: Any, group: int, head_dim: int, grid: Any = None
) -> Any:
    """The kernel of an attention launch plan, with the dynamic shared memory it asks for
    (opted into above the default). The launch table picked it for this device's target
    (:func:`target`), so it fits; the check stays as the last guard before a launch. ``grid``:
    the launch's (``launch.grid`` when ``None``), which sizes the CPU backend's threads."""
    if device == "cuda" and not target(device).fits(launch.shared_mem):
        raise ValueError(
            f"expected at most {target(device).shared_memory} bytes of shared memory per block "
            f"on this GPU, got {launch.shared_mem} for {launch.name} ({group} query heads per KV "
            f"head, head_dim {head_dim})"
        )
    kernel = get_kernel(device, source, launch.name)
    if device == "cuda" and launch.shared_mem > DEFAULT_SHARED_MEMORY:
        kernel.max_dynamic_shared_size_bytes = launch.shared_mem
    if device == "cpu":  # heavy blocks: helper threads from two on (see kernels/cpu/threads.py)
        kernel = kernel.with_workers(cpu_threads().attention_workers(grid or launch.grid))
    return kernel


def ctas_per_sm(kernel: Any, launch: Any) -> int:
    """Thread blocks of a loaded CUDA kernel's launch resident per multiprocessor: CUDA's
    occupancy calculator on its real registers and shared memory (the CPU backend, which has no
    cubin, takes ``decode_ctas_per_sm``: what an H100 would)."""
    driver = device_module("cuda").cuda.driver
    ctas = driver.occupancyMaxActiveBlocksPerMultiprocessor(
        kernel.kernel.ptr, math.prod(launch.block), launch.shared_mem
    )
    return max(1, int(ctas))


class LayerArrays:
    """What every layer's ``run`` of a plan must match, and its checks: the array type, the
    cache's element type, one layer's cache layout and the query rows, C-contiguous.

    The query (and the output, ``q``'s dtype) is of the cache's element type, or, over an fp8
    cache, ``q_dtype``: the one of float32, float16 and bfloat16 the plan was made for
    (``kv_dtype`` names the fp8 of a ``uint8`` cache; an ``ml_dtypes`` fp8 cache names itself).
    :meth:`views` compares the common case in a handful of comparisons (exact array type,
    storage dtype, shapes and C strides) and takes the full checks, which name what was expected
    and what arrived, for anything else.
    """

    __slots__ = (
        "_cache_dtypes",
        "_device_id",
        "_kinds",
        "_kv_dtype",
        "_layout",
        "_q_axes",
        "_q_names",
        "_q_nbytes",
        "_q_shape",
        "_q_strides",
        "_shapes",
        "_strides",
        "_xp",
        "dtype",
    )

    def __init__(
        self,
        xp: Any,
        dtype: str,
        layout: tuple[int, ...],
        q_axes: tuple[str, ...],
        q_shape: tuple,
        kv_dtype: Any = None,
        q_dtype: str | None = None,
    ) -> None:
        # An fp8 plan reads uint8 bytes in its own format, on both devices (a PyTorch fp8
        # tensor arrives as its bytes, its format checked by check_kv_dtype).
        self._xp, self.dtype = xp, dtype
        self._kv_dtype = dtype if is_fp8(dtype) else kv_dtype
        self._device_id = device_id(xp)
        self._layout, self._q_axes, self._q_shape = tuple(layout), q_axes, tuple(q_shape)
        # What the fast path compares (q, out, k_cache, v_cache) with: the exact array type, the
        # dtype objects (every carrier: bfloat16 as uint16, int16 or ml_dtypes.bfloat16; q's, of
        # the query types the cache takes), the shapes and the C-contiguous strides.
        if is_fp8(dtype) and q_dtype not in Q_DTYPE_NAMES:
            raise TypeError(f"expected q_dtype one of {Q_DTYPE_NAMES} over fp8, got {q_dtype!r}")
        q_names = (q_dtype,) if is_fp8(dtype) else (dtype,)
        self._q_names = {c: name for name in q_names for c in carriers(name)}
        self._q_strides = {q.itemsize: _c_strides(self._q_shape, q.itemsize) for q in self._q_names}
        self._q_nbytes = {size: math.prod(self._q_shape) * size for size in self._q_strides}
        cache = np.dtype(cache_dtype(dtype, xp))
        bytes_ = (np.dtype(np.uint8),) if is_fp8(dtype) else ()
        self._cache_dtypes = frozenset((cache, *carriers(dtype), *bytes_))
        self._kinds = (xp.ndarray,) * 4
        self._shapes = (self._q_shape, self._q_shape, self._layout, self._layout)
        self._strides = _c_strides(self._layout, cache.itemsize)

    def views(self, q: Any, k_cache: Any, v_cache: Any, out: Any) -> tuple[Any, ...]:
        """``(out, q, k_cache, v_cache, out_storage, q_dtype)`` to launch on: ``out`` allocated
        in ``q``'s dtype when ``None``; storage views (bfloat16 as ``uint16``, fp8 as ``uint8``),
        ``q`` contiguous; ``q_dtype`` the query's element type.

        Raises:
            TypeError, ValueError: an argument that does not match the plan (nothing is run).
        """
        given = out is not None
        if not given:
            out = self._xp.empty(q.shape, q.dtype)  # q's dtype object: bfloat16 in, bfloat16 out
        q_name = self._q_names.get(q.dtype)
        if (  # the common case in a handful of comparisons; anything else takes the long way
            q_name is not None
            and (type(q), type(out), type(k_cache), type(v_cache)) == self._kinds
            and out.dtype == q.dtype
            and k_cache.dtype in self._cache_dtypes
            and v_cache.dtype == k_cache.dtype
            and (q.shape, out.shape, k_cache.shape, v_cache.shape) == self._shapes
            and q.strides == out.strides == self._q_strides[q.dtype.itemsize]
            and k_cache.strides == v_cache.strides == self._strides
            and (self._xp is not np or out.flags.writeable)
        ):
            if given and out is not q and self._overlap(q, out):
                check_out_overlap(self._xp, q, out)  # the same memory, or refused
            # out has q's dtype, v_cache k_cache's: one view each decides the other's.
            storage = as_storage(q)
            q, out_storage = storage, (out if storage is q else as_storage(out))
            storage = as_storage(k_cache)
            k_cache, v_cache = storage, (v_cache if storage is k_cache else as_storage(v_cache))
        else:
            q, k_cache, v_cache, out_storage, q_name = self._checked(q, k_cache, v_cache, out)
            k_cache, v_cache = as_storage(k_cache), as_storage(v_cache)
        # Storage views first: an ml_dtypes array exports no buffer, the cheap way to an address.
        if (address(k_cache) | address(v_cache)) % 16:
            check_aligned(k_cache=k_cache, v_cache=v_cache)  # refused, by name
        if self._device_id != device_id(self._xp):
            raise ValueError(
                f"expected the device this plan was made on (CUDA device {self._device_id}) to "
                f"be current, got device {device_id(self._xp)}: the plan's kernels and their "
                f"shared-memory opt-in are that device's; make a plan on each device"
            )
        return out, q, k_cache, v_cache, out_storage, q_name

    def _overlap(self, q: Any, out: Any) -> bool:
        """Whether ``q`` and ``out``, C-contiguous of the planned shape (the fast path checked
        it), may share memory: NumPy's ``may_share_memory`` (cheaper than two addresses read
        from Python), on CuPy the two byte ranges compared (CuPy's function is Python code
        that costs a few microseconds per run)."""
        if self._xp is np:
            return self._xp.may_share_memory(q, out)
        begin_q, begin_out = q.data.ptr, out.data.ptr
        size = self._q_nbytes[q.dtype.itemsize]  # both of the planned shape and q's dtype
        return begin_q < begin_out + size and begin_out < begin_q + size

    def check_kv_dtype(self, kv_dtype: Any) -> None:
        """A ``kv_dtype`` given to a run: it must name the plan's fp8 format (the format of
        ``uint8`` caches, which a PyTorch fp8 tensor's dtype fills in).

        Raises:
            TypeError: another format, a dtype that is not fp8, or a plan of a cache that is
                not fp8.
        """
        name = dtype_name(kv_dtype)
        if not is_fp8(self.dtype):
            raise TypeError(
                f"expected {self.dtype} caches (the plan's) and no kv_dtype, got kv_dtype={name} "
                f"(given, or the dtype of fp8 tensors)"
            )
        if name != self.dtype:
            raise TypeError(
                f"expected kv_dtype={self.dtype!r} (the plan's fp8 format) or None, got "
                f"kv_dtype={kv_dtype!r}"
            )

    def _checked(self, q: Any, k_cache: Any, v_cache: Any, out: Any) -> tuple[Any, ...]:
        """The full checks, naming what was expected (the plan's) and what arrived."""
        xp = array_module(q, k_cache, v_cache, out)
        if xp is not self._xp:
            raise TypeError(
                f"expected {self._xp.__name__} arrays (the plan's device), got {xp.__name__} arrays"
            )
        check_shape("q", q, list(zip(self._q_axes, self._q_shape, strict=True)))
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_shape(name, x, list(zip(LAYER_AXES, self._layout, strict=True)))
        q_name = check_query_dtype(q, self.dtype, "the planned dtype")
        if q_name not in self._q_names.values():
            check_dtype("q", q, next(iter(self._q_names.values())), "the plan's q_dtype")
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_dtype(name, x, self.dtype, "the planned dtype", self._kv_dtype)
        check_contiguous(k_cache=k_cache, v_cache=v_cache)
        check_shape("out", out, list(zip(self._q_axes, self._q_shape, strict=True)))
        check_dtype("out", out, q_name, "q's dtype")
        check_contiguous(out=out)
        check_writable("out", out)
        check_out_overlap(self._xp, q, out)
        q = self._xp.ascontiguousarray(as_storage(q))
        return q, k_cache, v_cache, as_storage(out), q_name


def check_query_dtype(q: Any, cache_elem: str, why: str = "the cache's dtype") -> str:
    """The element type of ``q`` for a cache of ``cache_elem``: the cache's, or over an fp8
    cache one of float32, float16, bfloat16 (never fp8).

    Raises:
        TypeError: another dtype arrived.
    """
    if not is_fp8(cache_elem):
        check_dtype("q", q, cache_elem, why)
        return cache_elem
    try:
        name = array_dtype_name(q)
    except TypeError:
        name = None
    if name not in Q_DTYPE_NAMES:
        raise TypeError(
            f"expected q of dtype float32, float16 or bfloat16 over a {cache_elem} cache (a "
            f"query is never fp8), got {q.dtype}"
        )
    return name


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Byte strides of a C-contiguous array of ``shape``."""
    strides, step = [], itemsize
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def cpu_threads() -> Any:
    """The CPU backend's thread policy (:mod:`cupaged.kernels.cpu.threads`), imported on first use: a
    GPU-only program never loads the CPU backend."""
    from ..kernels.cpu import threads

    return threads


def check_layer_and_heads(k_cache: Any, num_q_heads: Any) -> tuple[int, int, int, int, int]:
    """A plan's ``k_cache`` layer (``[num_blocks, num_kv_heads, block_size, head_dim]``) and its
    ``num_q_heads`` (a positive multiple of ``num_kv_heads``), checked: the five sizes."""
    num_blocks, num_kv_heads, block_size, head_dim = check_shape(
        "k_cache", k_cache, [(axis, None) for axis in LAYER_AXES]
    )
    num_q_heads = as_int(num_q_heads, "num_q_heads")
    if num_kv_heads == 0 or num_q_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"expected num_q_heads to be a positive multiple of num_kv_heads={num_kv_heads}, "
            f"got {num_q_heads}"
        )
    return num_blocks, num_kv_heads, block_size, head_dim, num_q_heads


def planned_tail(
    xp: Any, elem: str, head_dim: int, num_kv_heads: int, scale: Any, variants: Any, spare: Any
) -> dict[str, Any]:
    """The arguments that end an attention kernel's record, from ``scale`` on, as its plan
    holds them: the softmax scale (``head_dim ** -0.5`` when ``None``), the fp8 scales of 1.0
    (a run's replace them; a cache that is not fp8 never reads them), then the variants.

    A pointer whose variant is off is never read, but gets ``spare`` (a real float32 array,
    never null): the ALiBi slopes' without slopes, and the sinks' always (a run that passes
    sinks replaces it).
    """
    return {
        "scale": np.float32(head_dim**-0.5 if scale is None else float(scale)),
        **kv_scale_args(xp, elem, num_kv_heads, None, None).named(),
        "window_left": np.int32(variants.window_left),
        "soft_cap": np.float32(variants.logits_soft_cap),
        "alibi_slopes": spare if variants.alibi_slopes is None else variants.alibi_slopes,
        "sinks": spare,
    }


def fp8_query_dtype(q: Any, k_cache: Any, kv_dtype: Any = None) -> str | None:
    """For a one-shot call: the element type of ``q`` over an fp8 ``k_cache`` (an ``ml_dtypes``
    fp8 array, or ``uint8`` bytes that ``kv_dtype`` names), checked with ``q``'s three axes;
    ``None`` for a cache of another type (without ``kv_dtype``), whose checks are the caller's.

    Raises:
        TypeError: a ``uint8`` cache without ``kv_dtype``, a ``kv_dtype`` for a cache that is
            not fp8, or a ``q`` that is not float32, float16 or bfloat16.
        ValueError: ``q`` is not ``[num_seqs, num_q_heads, head_dim]``.
    """
    if kv_dtype is None and k_cache.dtype != np.uint8:
        try:
            name = array_dtype_name(k_cache)
        except TypeError:
            return None  # the caller's checks name it
        if not is_fp8(name):
            return None
    else:
        name = array_dtype_name(k_cache, kv_dtype)
    check_shape("q", q, [(axis, None) for axis in DECODE_Q_AXES])
    return check_query_dtype(q, name)
