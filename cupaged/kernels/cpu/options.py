"""How CPU launches run: scheduling order, worker threads, strict barriers.

Set per thread (and per asyncio task) with context managers; the defaults come from environment
variables, read once per process (at the first launch), so a whole test run can switch order
without touching code::

    CUPAGED_CPU_SCHEDULE=reverse pytest tests/      # forward (default) | reverse | warp_ahead
    CUPAGED_CPU_WORKERS=1                           # worker OS threads (default: see below)
    CUPAGED_CPU_STRICT=0                            # let two __syncthreads call sites meet

The scheduling order decides which CUDA thread of a block runs first; a thread runs until it
blocks (barrier, warp collective) or returns. A kernel with a missing ``__syncthreads`` gives a
wrong result under at least one order:

- ``forward``: threads 0, 1, 2, ... in turn; reads of lower-numbered threads' data look fine.
- ``reverse``: the highest-numbered thread first; reads of higher-numbered threads' data look fine.
- ``warp_ahead``: the last warp first, then warps 0, 1, ...: one warp runs each phase ahead.

After every ``__syncthreads`` the order starts again from its first thread.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Iterator

SCHEDULES = ("forward", "reverse", "warp_ahead")


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchOptions:
    """Options of the CPU launches made in the current context.

    Attributes:
        schedule: one of :data:`SCHEDULES`.
        workers: OS threads that share a launch's blocks (never more than the number of
            blocks). ``None``: the thread policy's choice, at most one per usable CPU (copies
            and KV writes by bytes, attention by blocks, other launches by CUDA threads: see
            :mod:`cupaged.kernels.cpu.threads`).
        strict: a ``__syncthreads`` reached at two different call sites by one block is a
            :class:`~cupaged.errors.KernelError` (hardware would let them meet).
    """

    schedule: str = "forward"
    workers: int | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"expected schedule one of {SCHEDULES}, got {self.schedule!r}")
        if self.workers is not None and (
            isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1
        ):
            raise ValueError(f"expected workers a positive int or None, got {self.workers!r}")
        if not isinstance(self.strict, bool):
            raise TypeError(f"expected strict a bool, got {type(self.strict).__name__}")


_CURRENT: contextvars.ContextVar[LaunchOptions | None] = contextvars.ContextVar(
    "cupaged_cpu_launch_options", default=None
)


_VARIABLES = ("CUPAGED_CPU_SCHEDULE", "CUPAGED_CPU_WORKERS", "CUPAGED_CPU_STRICT")


@functools.cache
def _from_environment() -> LaunchOptions:
    """The defaults, read from the environment once per process (a launch costs no lookups).

    An invalid value raises at every launch rather than being remembered as a default.
    """
    return _parse_environment(*(os.environ.get(v) for v in _VARIABLES))


def _parse_environment(
    schedule_text: str | None, workers_text: str | None, strict_text: str | None
) -> LaunchOptions:
    schedule = schedule_text or "forward"
    if schedule not in SCHEDULES:
        raise ValueError(f"expected CUPAGED_CPU_SCHEDULE one of {SCHEDULES}, got {schedule!r}")
    workers = None
    if workers_text:
        try:
            workers = int(workers_text)
        except ValueError:
            workers = 0
        if workers < 1:
            raise ValueError(f"expected CUPAGED_CPU_WORKERS a positive int, got {workers_text!r}")
    strict_text = (strict_text or "1").strip().lower()
    if strict_text not in ("0", "1", "true", "false", "yes", "no", "on", "off", ""):
        raise ValueError(f"expected CUPAGED_CPU_STRICT 0 or 1, got {strict_text!r}")
    strict = strict_text not in ("0", "false", "no", "off")
    return LaunchOptions(schedule=schedule, workers=workers, strict=strict)


def current_options() -> LaunchOptions:
    """The options a CPU launch made now would use."""
    options = _CURRENT.get()
    return options if options is not None else _from_environment()


@contextlib.contextmanager
def launch_options(
    *, schedule: str | None = None, workers: int | None = None, strict: bool | None = None
) -> Iterator[LaunchOptions]:
    """Override some launch options for the launches made inside the ``with`` block.

    Example:
        >>> from cupaged.kernels.cpu import launch_options, current_options
        >>> with launch_options(schedule="reverse", workers=1):
        ...     current_options().schedule
        'reverse'
    """
    base = current_options()
    options = LaunchOptions(
        schedule=base.schedule if schedule is None else schedule,
        workers=base.workers if workers is None else workers,
        strict=base.strict if strict is None else strict,
    )
    token = _CURRENT.set(options)
    try:
        yield options
    finally:
        _CURRENT.reset(token)


def schedule(order: str) -> contextlib.AbstractContextManager[LaunchOptions]:
    """Run the CPU launches inside the ``with`` block in scheduling order ``order``.

    Args:
        order: ``"forward"``, ``"reverse"`` or ``"warp_ahead"`` (see the module docstring).
    """
    return launch_options(schedule=order)
