"""What a benchmark measured, and how much of its own timing it does, in both ways its body runs.

``pytest --benchmark-only`` times every benchmark; ``pytest benches --benchmark-disable`` (what CI
runs: ``.ci/run``) runs each body once as a test, and pytest-benchmark then keeps no statistics.
Benchmarks read their median through :func:`median_seconds` (NaN when nothing was timed) and size
the timing loops of their own (floors, alternating cases) through :func:`repeats`, so that a
disabled run checks every body quickly while ``--benchmark-only`` measures what it always did.
"""

from __future__ import annotations

import math
from typing import Any


def median_seconds(benchmark: Any) -> float:
    """The median of the timed rounds in seconds, or NaN when benchmarks are disabled (the body
    ran once, untimed: its derived numbers are NaN too)."""
    return benchmark.stats.stats.median if benchmark.enabled else math.nan


def repeats(benchmark: Any, n: int) -> int:
    """``n`` calls or rounds of a benchmark's own timing loop when benchmarks time, one when they
    are disabled."""
    return n if benchmark.enabled else 1
