from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's id: fresh inputs per test, reproducible per run."""
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)


def _cupy_with_gpu():
    from cupaged._backend import cuda_available, cupy_module

    return cupy_module() if cuda_available() else None


@pytest.fixture(
    params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)],
)
def xp(request):
    """The array module under test: NumPy always, CuPy where a GPU is present."""
    if request.param == "numpy":
        return np
    cupy = _cupy_with_gpu()
    if cupy is None:
        pytest.skip("needs a CUDA GPU (CuPy sees none)")
    return cupy
