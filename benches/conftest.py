from __future__ import annotations

import numpy as np
import pytest

from cupaged._backend import cuda_available, device_module


@pytest.fixture(scope="session")
def xp():
    """CuPy on a machine with a GPU, NumPy (the CPU backend) otherwise."""
    return device_module("cuda") if cuda_available() else np


@pytest.fixture(scope="session")
def on_gpu(xp) -> bool:
    return xp is not np
