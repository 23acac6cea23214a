"""Which folder a bare ``pytest`` collects: ``tests/``, or ``benches/`` with ``--benchmark-only``.

``pyproject.toml`` lists both folders in ``testpaths``; this hook keeps a plain ``pytest`` (the
README's test command) to the tests, without importing or skipping any benchmark, and makes
``pytest --benchmark-only`` run the benchmarks without a line per skipped test. Folders or files
named on the command line are collected as given.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.args_source is not pytest.Config.ArgsSource.TESTPATHS:
        return None
    try:
        top = collection_path.resolve().relative_to(ROOT).parts[0]
    except (ValueError, IndexError):
        return None
    benchmarks = bool(config.getoption("benchmark_only", default=False))
    if top == "benches":
        return True if not benchmarks else None
    if top == "tests":
        return True if benchmarks else None
    return None
