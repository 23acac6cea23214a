"""Shared fixtures and the table layout of every benchmark in ``benches/``.

- Parameter ids name their axis (``block_size=16``, not ``16``), for every ``bench_*.py`` here.
- The default table shows the columns that matter for a comparison (median, interquartile range,
  rounds), one table per benchmark function (each with its own time unit), rows sorted by name so
  that the axes read in order. ``--benchmark-columns``, ``--benchmark-group-by`` and
  ``--benchmark-sort`` given on the command line win.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupaged import device_module, resolve_device

COLUMNS = ["median", "iqr", "rounds"]


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark reads the options
def pytest_configure(config: pytest.Config) -> None:
    option = config.option
    if getattr(option, "benchmark_columns", "absent") is None:
        option.benchmark_columns = COLUMNS
    if getattr(option, "benchmark_group_by", None) == "group":
        option.benchmark_group_by = "func"
    if getattr(option, "benchmark_sort", None) == "min":
        option.benchmark_sort = "name"


def pytest_make_parametrize_id(config: pytest.Config, val: object, argname: str) -> str:
    return f"{argname}={val}"


@pytest.fixture(scope="session")
def xp():
    """CuPy on a machine with a GPU, NumPy (the CPU backend) otherwise."""
    return device_module(resolve_device(None))


@pytest.fixture(scope="session")
def on_gpu(xp) -> bool:
    return xp is not np
