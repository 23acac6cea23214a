from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's id: fresh inputs per test, reproducible per run."""
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)
