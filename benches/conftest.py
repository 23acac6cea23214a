"""Shared fixtures and the table layout of every benchmark in ``benches/``.

- Parameter ids name their axis (``block_size=16``, not ``16``), for every ``bench_*.py`` here
  and only here (tests/ keep pytest's ids however pytest is started).
- One table per benchmark function, each in its own time unit, unless a benchmark sets its own
  ``benchmark.group`` (decode attention groups fused, reference and contiguous per shape, so the
  ratios in a table compare them); rows sorted by name, so that the axes read in order; columns
  median, interquartile range and rounds. ``--benchmark-columns``, ``--benchmark-group-by`` and
  ``--benchmark-sort`` given on the command line win.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupaged import device_module, resolve_device

COLUMNS = ["median", "iqr", "rounds"]
_naming_ids = False  # True while a module of benches/ is being parametrized


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark reads the options
def pytest_configure(config: pytest.Config) -> None:
    option = config.option
    if getattr(option, "benchmark_columns", "absent") is None:
        option.benchmark_columns = COLUMNS
    if getattr(option, "benchmark_sort", None) == "min":
        option.benchmark_sort = "name"


@pytest.hookimpl(wrapper=True)
def pytest_generate_tests(metafunc: pytest.Metafunc):
    # This hook runs only for modules under benches/ (a conftest's generate hook is local to its
    # folder) and pytest computes the ids inside it, so the global id hook below is scoped here.
    global _naming_ids
    _naming_ids = True
    try:
        return (yield)
    finally:
        _naming_ids = False


def pytest_make_parametrize_id(config: pytest.Config, val: object, argname: str) -> str | None:
    return f"{argname}={val}" if _naming_ids else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Group each benchmark by its function unless it names a group itself."""
    for item in items:
        if "benchmark" not in getattr(item, "fixturenames", ()):
            continue
        marker = item.get_closest_marker("benchmark")
        kwargs = dict(marker.kwargs) if marker else {}
        if "group" not in kwargs:
            item.add_marker(pytest.mark.benchmark(**kwargs, group=item.originalname))


@pytest.fixture(scope="session")
def xp():
    """CuPy on a machine with a GPU, NumPy (the CPU backend) otherwise."""
    return device_module(resolve_device(None))


@pytest.fixture(scope="session")
def on_gpu(xp) -> bool:
    return xp is not np
