"""Exceptions raised by cupaged.

Two kinds of failure exist in cupaged (STYLE.md §6): broken internal invariants raise
``AssertionError``; bad input at a public boundary raises ``ValueError``, ``TypeError``, ``KeyError``
or :class:`OutOfBlocksError`, with an "expected X, got Y" message. A call that raises changes nothing.
"""

from __future__ import annotations


class CupagedError(Exception):
    """Base class of the errors that are specific to cupaged."""


class OutOfBlocksError(CupagedError, MemoryError):
    """The block pool has fewer free blocks than an operation needs.

    Raised before anything is allocated: the cache is exactly as it was before the call.

    Attributes:
        needed: blocks the operation needed.
        available: blocks that were free.
    """

    def __init__(self, needed: int, available: int, what: str = "the operation") -> None:
        self.needed = needed
        self.available = available
        super().__init__(
            f"out of KV-cache blocks: {what} needs {needed} free block(s), got {available} "
            f"(free sequences, or create the cache with more blocks)"
        )


class KernelError(CupagedError):
    """A kernel failed while running on the CPU backend.

    Raised for a deadlock (threads wait at a barrier or warp collective that can never complete), a
    failed device ``assert``, a divergent ``__syncthreads`` or a malformed warp collective. The
    message names the kernel (its name expression), the block and thread, and the source line.
    """
