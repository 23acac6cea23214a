"""Loading compiled kernels: CuPy ``RawModule`` (NVRTC) on the GPU, the CPU backend for NumPy.

A kernel is named by its source file in ``cuda/`` and its instantiation, the name expression that
RawModule and the CPU backend both take (``"cupaged::write_kv<__half, int, 8>"``). Each
instantiation is compiled on first use and kept per device; CuPy also caches cubins on disk and the
CPU backend caches its shared libraries. Each load (a compile, or a read of those caches) is
logged at ``DEBUG`` on the ``cupaged.kernels`` logger with its seconds: where the first call's
time goes.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import threading
import time
from typing import Any

from ..backend import cupy_module, kernel_dir
from .headers import find_nvrtc_headers, nvrtc_include_dirs

logger = logging.getLogger("cupaged.kernels")
_lock = threading.Lock()
_cuda_functions: dict[tuple[int, str, str], Any] = {}
_cpu_functions: dict[tuple[str, str], Any] = {}


def get_kernel(device: str, source: str, name: str) -> Any:
    """A callable kernel ``kernel(grid, block, args, shared_mem=0)`` for ``device``.

    Kept per device after the first call, on both backends: a later call is one dictionary
    lookup (a CPU launch of a small kernel costs a few microseconds, so rebuilding a module per
    call would dominate it).

    Args:
        device: ``"cuda"`` or ``"cpu"``.
        source: file name in ``cuda/`` (``"paged_attention.cu"``).
        name: the instantiation's name expression.
    """
    if device == "cpu":
        kernel = _cpu_functions.get((source, name))
        if kernel is None:
            kernel = _cpu_kernel(source, name)
        return kernel
    cupy = cupy_module()
    assert cupy is not None, "a CUDA kernel was requested without CuPy"
    key = (cupy.cuda.Device().id, source, name)
    with _lock:
        if key not in _cuda_functions:
            start = time.perf_counter()
            code = (kernel_dir() / source).read_text()
            module = cupy.RawModule(
                code=code,
                options=nvrtc_options(wmma=uses_wmma(code)),
                name_expressions=(name,),
            )
            _cuda_functions[key] = module.get_function(name)  # NVRTC compiles here
            _log_load("cuda", source, name, start)
        return _cuda_functions[key]


@functools.cache
def cpu_sanitize() -> bool:
    """``CUPAGED_CPU_SANITIZE=1``: build every kernel with AddressSanitizer (read once).

    The process must start with libasan preloaded; an out-of-range access then stops it with a
    report (tests/kernels/test_sanitizer.py).
    """
    return os.environ.get("CUPAGED_CPU_SANITIZE", "") == "1"


def _cpu_kernel(source: str, name: str) -> Any:
    from .cpu import CpuModule

    with _lock:
        kernel = _cpu_functions.get((source, name))
        if kernel is None:
            start = time.perf_counter()
            module = CpuModule(kernel_dir() / source, (name,), sanitize=cpu_sanitize())
            kernel = _cpu_functions[(source, name)] = module.get_function(name)
            _log_load("cpu", source, name, start)
        return kernel


def _log_load(device: str, source: str, name: str, start: float) -> None:
    """Log one kernel's load: ``"loaded <device> <source> <name> in <seconds> s"``."""
    logger.debug("loaded %s %s %s in %.3f s", device, source, name, time.perf_counter() - start)


def uses_wmma(code: str) -> bool:
    """Whether a kernel source includes ``mma.h`` (the WMMA API), which needs ``crt/mma.h``."""
    return _MMA_INCLUDE.search(code) is not None


_MMA_INCLUDE = re.compile(r"^\s*#\s*include\s*<mma\.h>", re.MULTILINE)


def nvrtc_options(wmma: bool = True) -> tuple[str, ...]:
    """NVRTC options: C++17, the kernel folder, a digest of every header in it, the CUDA headers.

    CuPy's on-disk cache keys a module by its source text and options only; the digest makes an
    edited ``common.cuh`` recompile the files that include it. The CUDA headers are the folder
    with ``cuda_fp16.h`` and the one with ``crt/mma.h``, found by ``cupaged.kernels.headers``
    (NVIDIA's wheels of NVRTC's CUDA version first, then the CUDA toolkits).

    Args:
        wmma: the source includes ``mma.h`` (:func:`uses_wmma`): ``crt/mma.h`` must be found.
            Without it (``write_kv``, ``copy_blocks``, the planner) a missing ``crt/`` is no
            error.

    Raises:
        CupagedError: ``wmma`` and no folder has ``crt/mma.h``; the message names the wheel to
            install.
    """
    folder = kernel_dir()
    digest = hashlib.sha256()
    for header in sorted(folder.glob("*.cuh")):
        digest.update(header.read_bytes())
    options = ["--std=c++17", f"-I{folder}", f"-DCUPAGED_HEADERS={digest.hexdigest()[:16]}"]
    options += [f"-I{include}" for include in nvrtc_include_dirs(require_crt=wmma)]
    return tuple(options)


def crt_include_dir() -> str | None:
    """The folder :func:`nvrtc_options` takes ``crt/mma.h`` from, or None when none has it.

    ``mma.h`` (the WMMA API) includes ``crt/mma.h``, which neither CUDA runtime wheel has: it
    comes with ``nvidia-cuda-nvcc-cu12`` (``nvidia/cuda_nvcc/include``), ``nvidia-cuda-crt``
    (``nvidia/cu13/include``) or a CUDA toolkit's ``include``.
    """
    crt = find_nvrtc_headers().crt
    return None if crt is None else str(crt)
