"""Shared test axes, the single tolerance table, and random inputs.

Imported as ``from helpers import ...`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import struct
import time

import ml_dtypes
import numpy as np

from cupaged.dtypes import to_float
from cupaged.errors import CupagedError, KernelError

DTYPES = ("float32", "float16", "bfloat16")
GQA_RATIOS = (1, 4, 8)
BLOCK_SIZES = (1, 4, 16)

# DESIGN.md §6: kernel or reference output vs a float64 NumPy reference.
TOLERANCES = {
    "float32": dict(atol=1e-5, rtol=1e-5),
    "float16": dict(atol=1e-3, rtol=1e-3),
    "bfloat16": dict(atol=1e-2, rtol=1.6e-2),
}


def lengths_for(block_size: int) -> list[int]:
    """Ragged and boundary context lengths for a block size."""
    return sorted({1, max(block_size - 1, 1), block_size, block_size + 1, 97})


def assert_close(actual, expected: np.ndarray, dtype: str) -> None:
    """Compare ``actual`` (any cache element type, NumPy or CuPy) with a float64 reference."""
    got = to_float(actual, np.float64)
    got = got.get() if hasattr(got, "get") else got
    np.testing.assert_allclose(got, expected, **TOLERANCES[dtype])


def random_array(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    """Standard-normal values, never all zeros, in the storage dtype (bfloat16 as ``uint16``)."""
    values = rng.standard_normal(shape, dtype=np.float32)
    if dtype == "bfloat16":
        return values.astype(ml_dtypes.bfloat16).view(np.uint16)
    return values.astype(dtype)


def poison(shape, dtype: str) -> np.ndarray:
    """An output buffer full of NaN, so that unwritten elements cannot pass a comparison."""
    if dtype == "bfloat16":
        return np.full(shape, 0x7FC0, np.uint16)
    return np.full(shape, np.nan, dtype)


def scatter_into_pages(rng, seqs_kv, block_size, num_blocks, dtype):
    """Write each sequence's [L, H, D] K/V into shuffled, non-monotonic blocks of fresh pages."""
    num_kv_heads, head_dim = seqs_kv[0][0].shape[1:]
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = random_array(rng, shape, dtype)  # garbage everywhere else, never zeros
    v_cache = random_array(rng, shape, dtype)
    free = list(rng.permutation(num_blocks))
    tables = []
    for k, v in seqs_kv:
        n = -(-len(k) // block_size)
        table = [int(free.pop()) for _ in range(n)]
        for pos in range(len(k)):
            k_cache[table[pos // block_size], :, pos % block_size] = k[pos]
            v_cache[table[pos // block_size], :, pos % block_size] = v[pos]
        tables.append(table)
    width = max(1, max(map(len, tables)))
    padded = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
    return k_cache, v_cache, padded


def random_paged_batch(rng, lengths, num_kv_heads, head_dim, ratio, block_size, dtype):
    """Fresh K/V for ragged sequences, scattered into shuffled blocks, and a query per sequence.

    Returns ``(q, k_cache, v_cache, block_tables, context_lens, seqs)`` as NumPy arrays, ``seqs``
    being each sequence's contiguous ``(k, v)``, ``[L, num_kv_heads, head_dim]``.
    """
    seqs = [
        (random_array(rng, (n, num_kv_heads, head_dim), dtype),
         random_array(rng, (n, num_kv_heads, head_dim), dtype))
        for n in lengths
    ]  # fmt: skip
    num_blocks = sum(-(-n // block_size) for n in lengths) + 5
    k_cache, v_cache, tables = scatter_into_pages(rng, seqs, block_size, num_blocks, dtype)
    q = random_array(rng, (len(lengths), num_kv_heads * ratio, head_dim), dtype)
    return q, k_cache, v_cache, tables, np.array(lengths, dtype=np.int32), seqs


def cpu_toolchain_missing() -> str | None:
    """Why the CPU backend cannot build kernels here, or ``None`` when it can."""
    from cupaged._cpu import cuda_include_dir, toolchain

    try:
        toolchain.check_platform()
        toolchain.compiler()
        cuda_include_dir()
    except CupagedError as error:
        return str(error)
    return None


@contextlib.contextmanager
def scheduled(xp, order):
    """Run CPU-backend launches under ``order``; the GPU has its own."""
    if xp is np:
        from cupaged._cpu import schedule

        with schedule(order):
            yield
    else:
        yield


def kernel_error(kernel, *launch, **kwargs) -> str:
    """The message of the ``KernelError`` a CPU-backend launch raises, quickly (not a timeout)."""
    import pytest

    start = time.perf_counter()
    with pytest.raises(KernelError) as info:
        kernel(*launch, **kwargs)
    assert time.perf_counter() - start < 5.0  # detected, not timed out
    return str(info.value)


@contextlib.contextmanager
def recorded_cpu_launches():
    """Every CPU-backend launch made inside, as ``(kernel name, OS threads)``: the ``workers`` field
    of the request each one sends to the runtime."""
    import pytest

    from cupaged._cpu import module as cpu_module

    launches: list[tuple[str, int]] = []
    real_call = cpu_module.CpuKernel.__call__

    def recording_call(kernel, *args, **kwargs):
        launch = kernel._launch

        def spy(request, *rest):
            header = struct.unpack_from(cpu_module._HEADER, request)
            launches.append((kernel.name, header[8]))  # index, grid (3), block (3), schedule
            return launch(request, *rest)

        kernel._launch = spy
        try:
            return real_call(kernel, *args, **kwargs)
        finally:
            kernel._launch = launch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_module.CpuKernel, "__call__", recording_call)
        yield launches
