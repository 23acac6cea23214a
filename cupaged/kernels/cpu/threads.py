"""How many OS threads run a CPU launch: the CPU backend's own policy.

The launch tables (``cupaged/kernels/launch_*.py``) give every kernel its CUDA geometry, grid
and block.
How a launch's thread blocks are spread over the host's OS threads is the CPU backend's business
alone, and is decided here. The *workers* of a launch are the calling thread and helper threads of
the runtime's pool (``csrc/runtime.h``); each takes whole blocks from a shared counter, so a
launch never has more workers than blocks, and only the launch options ask for more than one
per CPU.

Who decides, first match wins (:func:`launch_workers`):

1. ``LaunchOptions.workers`` (``launch_options(workers=...)``, ``CUPAGED_CPU_WORKERS``);
2. the call's ``workers=`` argument;
3. the kernel's own cap (``CpuKernel.with_workers``), which ``cupaged.attention.ops`` gives the kernels whose
   blocks' work it knows, from :func:`stride_workers` and :func:`attention_workers`;
4. :func:`default_workers`, by the launch's CUDA threads.

The rules weigh a helper's wake-up and its share of the blocks against the work it takes over;
the measurements behind the thresholds are in docs/benchmarks.md ("One launch geometry and the
helper threads of the CPU backend").
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

# A launch with fewer CUDA threads than this, in all its blocks, runs on the calling thread alone:
# waking a helper thread of the pool costs about as much as a few thousand fiber switches.
POOL_MIN_THREADS = 4096
# A copy or KV write takes helpers when it moves at least POOL_MIN_BYTES in blocks of at least
# POOL_MIN_BLOCK_BYTES each, or at least POOL_LARGE_BYTES in any blocks (past the caches a second
# thread pays even for small blocks); below, one OS thread is faster.
POOL_MIN_BYTES = 4 << 20
POOL_MIN_BLOCK_BYTES = 4096
POOL_LARGE_BYTES = 16 << 20


@functools.cache
def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow).

    Read once per process, at the first launch.
    """
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def capped(workers: Any) -> int:
    """A launch's cap on OS threads, checked, and at most one per CPU.

    Raises:
        ValueError: ``workers`` is not a positive int.
    """
    if type(workers) is not int or workers < 1:
        raise ValueError(f"expected workers a positive int or None, got {workers!r}")
    return min(workers, cpu_count())


def default_workers(num_blocks: int, block: tuple[int, int, int]) -> int:
    """Workers of a launch that nothing else decides: one per CPU, except small launches."""
    if num_blocks < 2 or num_blocks * block[0] * block[1] * block[2] < POOL_MIN_THREADS:
        return 1
    return min(cpu_count(), num_blocks)


def launch_workers(
    option: int | None,
    call: Any,
    cap: int | None,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
) -> int:
    """The workers one launch asks the runtime for (the runtime takes at most one per block).

    Args:
        option: ``LaunchOptions.workers`` of the current context; wins when set.
        call: the call's ``workers=`` argument (checked, and capped at the CPUs).
        cap: the kernel's own cap (``CpuKernel.with_workers``), already capped.
        grid: the launch's blocks.
        block: threads per block.

    Raises:
        ValueError: ``call`` is neither ``None`` nor a positive int.
    """
    if option is not None:
        return option
    if call is not None:
        return capped(call)
    if cap is not None:
        return cap
    return default_workers(grid[0] * grid[1] * grid[2], block)


def stride_workers(num_blocks: int, block_bytes: int) -> int:
    """The cap for a ``copy_blocks`` or ``write_kv`` launch whose ``num_blocks`` blocks move
    ``block_bytes`` each (a pair's K or V block; a token's K and V rows): one per block for a
    large launch (see ``POOL_MIN_BYTES``), else 1.

    Their blocks are light: one thread each, striding over the words (``CPU_STRIDE_THREADS`` in
    the launch table), so the runtime's rule, which counts CUDA threads, would never call the
    helpers; bytes tell when a helper's share of the blocks pays for its wake-up.
    """
    total = num_blocks * block_bytes
    if total >= POOL_LARGE_BYTES or (
        total >= POOL_MIN_BYTES and block_bytes >= POOL_MIN_BLOCK_BYTES
    ):
        return num_blocks
    return 1


def attention_workers(grid: tuple[int, ...]) -> int:
    """The cap for an attention launch (decode, prefill): one per thread block.

    Their blocks are heavy here (a block's fibers switch at every barrier of every tile), so a
    helper pays for its wake-up from the second block on, far below the runtime's own threshold
    in CUDA threads.
    """
    return max(math.prod(grid), 1)
