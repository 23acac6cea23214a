from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import seed_of, the_work


def pytest_configure(config):
    """``CUPAGED_KERNEL_LOG=<folder>``: every kernel load of this process (a compile or a cache
    read, with its seconds; the ``cupaged.kernels`` logger) goes to ``kernels-<worker>.log``
    there, so that a run can say how much of its time compiling took (``scripts/gpu-check``)."""
    folder = os.environ.get("CUPAGED_KERNEL_LOG")
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        handler = logging.FileHandler(Path(folder) / f"kernels-{worker}.log")
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger = logging.getLogger("cupaged.kernels")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's id: fresh inputs per test, the same in every run.
    A failing test's report names the seed (:func:`pytest_runtest_makereport`)."""
    seed = seed_of(request.node.nodeid)
    request.node.user_properties.append(("rng seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        for name, seed in item.user_properties:
            if name == "rng seed":
                report.sections.append(
                    ("rng", f"rng seeded with {seed}: numpy.random.default_rng({seed})")
                )
    return report


@pytest.fixture
def no_work(monkeypatch):
    """Loading a model or setting up a demo fails the test: a command line that must stop
    before the work."""
    import cupaged.demo
    import cupaged.models

    monkeypatch.setattr(cupaged.models, "load_model", the_work)
    monkeypatch.setattr(cupaged.demo, "Demo", the_work)


def _cupy_with_gpu():
    from cupaged.backend import cuda_available, cupy_module

    return cupy_module() if cuda_available() else None


@pytest.fixture(
    params=[
        "numpy",
        pytest.param("strict", marks=pytest.mark.strict),
        pytest.param("cupy", marks=pytest.mark.gpu),
    ],
)
def xp(request):
    """The array module under test: NumPy always; CuPy where a GPU is present; and, where none
    is, ``strict``: the CPU stand-in for CuPy (``tests/strict_cupy.py``), which takes the
    library's CUDA paths, runs the kernels on the CPU backend and refuses, as CuPy does, to turn
    its arrays into NumPy arrays implicitly (see tests/README.md)."""
    if request.param == "numpy":
        yield np
    elif request.param == "strict":
        if _cupy_with_gpu() is not None:
            pytest.skip("a CUDA GPU is here: the cupy variant runs what the stand-in imitates")
        import strict_cupy

        with strict_cupy.installed() as module:
            yield module
    else:
        cupy = _cupy_with_gpu()
        if cupy is None:
            pytest.skip("needs a CUDA GPU (CuPy sees none)")
        yield cupy
