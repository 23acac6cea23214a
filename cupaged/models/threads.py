"""One BLAS thread for NumPy on the CPU device, where the model's matrix products are small.

NumPy's OpenBLAS starts a thread per core and spins them around every product. The products of
a 135M model at decode batch sizes take microseconds, so with other jobs on the cores the spinning
threads wait for each other far longer than they compute: on this project's 2-core machine at
load average 5, the serving demo on SmolLM2 took 227 s with OpenBLAS's default threads and 30 s
with one. Idle, one thread is a little slower (about 20 % per decode step).
"""

from __future__ import annotations

import ctypes
import os

# OpenBLAS's setter under the names its builds export (NumPy's wheels bundle scipy-openblas).
_SETTERS = (
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)
_USER_SETTINGS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")


def limit_blas_threads(n: int = 1) -> bool:
    """Set the thread count of the OpenBLAS loaded in this process to ``n``, unless the user
    chose one (``OPENBLAS_NUM_THREADS`` or ``OMP_NUM_THREADS`` set).

    Returns:
        Whether a count was set (``False``: the user's setting stands, or no OpenBLAS found).
    """
    if any(os.environ.get(name) for name in _USER_SETTINGS):
        return False
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:  # not Linux: leave the threads as they are
        return False
    done = False
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(ctypes.c_int(n))
                done = True
                break
    return done
