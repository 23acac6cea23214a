"""The CPU backend: the project's CUDA kernel sources, built by g++ and run on the CPU.

No installable package runs CUDA C on a CPU, so cupaged carries a small one (DESIGN.md §5):

- ``csrc/shim.h``, force-included before the kernel source, turns the CUDA device API into host
  C++ (keywords, built-in variables, barriers, warp collectives, assert, atomics, device math,
  half/bfloat16 fallbacks, the async copies of ``cuda_pipeline_primitives.h``);
- ``csrc/runtime.h`` runs each CUDA thread as a fiber: a block's threads on one OS thread,
  switched by hand at barriers and warp collectives, blocks spread over a few OS threads;
  deadlocks, failed asserts and divergent barriers become :class:`~cupaged.errors.KernelError`;
- :mod:`.toolchain` generates the launch table, runs g++ and caches the library;
- :mod:`.module` is the Python face, CuPy's ``RawModule``/``RawKernel`` calling convention;
- :mod:`.options` picks the scheduling order, worker threads and strict barriers;
- :mod:`.threads` decides how many OS threads a launch takes when the options leave it open.

Example (not a doctest: it compiles for a second or two)::

    import numpy as np
    from cupaged.kernels.cpu import CpuModule, schedule

    # tests/cpu/cpu_kernels/failures.cu: scale(out, x, float alpha, int n, long long, uchar, double)
    kernel = CpuModule("failures.cu", ["cpu_test::scale"]).get_function("cpu_test::scale")
    x = np.arange(100, dtype=np.float32)
    out = np.empty_like(x)
    args = (out, x, np.float32(2), np.int32(100), np.int64(0), np.uint8(0), np.float64(0))
    with schedule("reverse"):  # or "forward" (the default), "warp_ahead"
        kernel((1,), (128,), args)  # grid, block, args[, shared_mem], like cupy.RawKernel

Kernels written for it follow DESIGN.md §4; the shim's own notes (csrc/shim.h) list what it emulates
and how: barriers count live threads, warp collectives wait per mask, shared memory (static and
dynamic) is NaN before every block, an async copy (``__pipeline_memcpy_async``) leaves NaN in its
destination until the issuing thread's ``__pipeline_wait_prior`` lands it, device asserts and
deadlocks raise ``KernelError``.
"""

from __future__ import annotations

from .module import CpuKernel, CpuModule
from .options import SCHEDULES, LaunchOptions, current_options, launch_options, schedule
from .toolchain import cache_dir, check_platform, cuda_include_dir

__all__ = [
    "SCHEDULES",
    "CpuKernel",
    "CpuModule",
    "LaunchOptions",
    "cache_dir",
    "check_platform",
    "cuda_include_dir",
    "current_options",
    "launch_options",
    "schedule",
]
