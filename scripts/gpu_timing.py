"""How ``scripts/gpu_bench.py`` times: kernels by CUDA events (wall clock on the CPU backend),
the host's share of a call by ``time.perf_counter`` around calls that are not synchronised, and
the ``--budget`` that every table keeps (no row starts after it; a peer's compile is cut at it).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time

import numpy as np


def timer(xp, fn, repeats):
    """Median seconds of ``fn()``; CUDA events around each call on the GPU."""
    fn()  # compile and warm up
    times = []
    for _ in range(repeats):
        if xp is np:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        else:
            begin, end = xp.cuda.Event(), xp.cuda.Event()
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(xp.cuda.get_elapsed_time(begin, end) / 1e3)
    return float(np.median(times))


def copy_bandwidth(xp, nbytes):
    """Device-to-device copy bandwidth in GB/s (reads + writes)."""
    src = xp.ones(nbytes // 4, np.float32)
    dst = xp.empty_like(src)
    seconds = timer(xp, lambda: dst.__setitem__(Ellipsis, src), 10)
    return 2 * src.nbytes / seconds / 1e9


class Clock:
    """The ``--budget``: tables add no row after it has run out."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.perf_counter()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def within(self, items, lines, unit="rows"):
        """``items`` while the budget lasts; the table says where it stopped."""
        for i, item in enumerate(items):
            if self.left() < 0:
                lines.append(
                    f"\n(stopped after {i} of {len(items)} {unit}: the time budget of "
                    f"{self.seconds:.0f} s ran out)"
                )
                print(lines[-1], flush=True)
                return
            yield item


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    """Raise ``TimeoutError`` in this (the main) thread after ``seconds``: Python code waiting on
    a compiler's process is interrupted; native code, when it returns."""

    def expire(signum, frame):
        raise TimeoutError(f"{what} ran past {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def synchronize(xp):
    """Wait for the device (every stream of it: PyTorch's work too)."""
    if xp is not np:
        xp.cuda.Device().synchronize()


def free(xp):
    """Hand cached device memory back between shapes (CuPy's pool and PyTorch's)."""
    if xp is np:
        return
    xp.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")  # imported by the peers, if at all
    if torch is not None:
        torch.cuda.empty_cache()


def host_seconds(xp, fn, calls):
    """``(host, wall)`` seconds per call: ``time.perf_counter`` around ``calls`` calls that are
    not synchronised (what the host spends), then once more after a synchronisation."""
    for _ in range(min(calls, 10)):  # warm: plans, compiles, allocator
        fn()
    synchronize(xp)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls
    synchronize(xp)
    return host, (time.perf_counter() - start) / calls
