"""The pool of physical KV-cache blocks: a free stack and reference counts, nothing else.

A block id is an index into the block axis of the cache arrays. The pool knows nothing about arrays,
devices or sequences; :class:`~cupaged.PagedCache` maps sequences onto the ids it hands out.

Every operation is O(1) in the size of the pool (allocating ``n`` blocks is O(n)): the free blocks
form a stack in a Python list (``pop``/``append`` at its end), and refcounts are a list indexed by
block id. Nothing scans the pool or removes from the middle of a list.
"""

from __future__ import annotations

from collections.abc import Mapping

from ._checks import as_int, require
from .errors import OutOfBlocksError


class BlockPool:
    """Free list and reference counts of ``num_blocks`` physical blocks.

    A block is *free* (refcount 0, on the free stack) or *in use* (refcount >= 1, referenced by that
    many block-table entries). Freed blocks are handed out again first (LIFO), so a steady workload
    keeps touching the same, warm, blocks. A fresh pool hands out ids 0, 1, 2, ... in order.

    Example:
        >>> pool = BlockPool(4)
        >>> pool.allocate(2)
        [0, 1]
        >>> pool.incref(1)      # a fork shares block 1
        >>> pool.decref(1), pool.decref(1), pool.num_free
        (False, True, 3)
        >>> pool.allocate(1)    # the most recently freed block comes back first
        [1]
    """

    def __init__(self, num_blocks: int) -> None:
        num_blocks = as_int(num_blocks, "num_blocks")
        if num_blocks < 1:
            raise ValueError(f"expected num_blocks >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # Top of the stack is the end of the list; reversed so that a fresh pool hands out 0 first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refcount: list[int] = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Number of free blocks."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Number of blocks in use (refcount >= 1)."""
        return self.num_blocks - len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` free blocks, each with refcount 1.

        Raises:
            OutOfBlocksError: fewer than ``n`` blocks are free; nothing was allocated.
        """
        n = as_int(n, "n")
        if n < 0:
            raise ValueError(f"expected n >= 0 blocks to allocate, got {n}")
        if n > len(self._free):
            raise OutOfBlocksError(n, len(self._free), f"allocating {n} block(s)")
        blocks = [self._free.pop() for _ in range(n)]
        for block in blocks:
            self._refcount[block] = 1
        return blocks

    def incref(self, block: int) -> None:
        """Add a reference to a block in use (a fork or a prefix-cache hit shares it)."""
        block = self._check_in_use(block, "incref")
        self._refcount[block] += 1

    def decref(self, block: int) -> bool:
        """Drop a reference; the block returns to the free stack when none is left.

        Returns:
            True when the block became free.
        """
        block = self._check_in_use(block, "decref")
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            self._free.append(block)
            return True
        return False

    def refcount(self, block: int) -> int:
        """Number of references to ``block`` (0 when it is free)."""
        if type(block) is int and 0 <= block < self.num_blocks:  # the per-token fast path
            return self._refcount[block]
        return self._refcount[self._check_id(block)]

    def check_invariants(self, references: Mapping[int, int] | None = None) -> None:
        """Check the pool's bookkeeping; O(num_blocks), for tests and debugging.

        Args:
            references: optional count of block-table references per block id, as the owner of the
                tables sees them; every block's refcount must equal it (0 for absent ids).

        Raises:
            AssertionError: naming the first broken invariant.
        """
        free = set(self._free)
        require(len(free) == len(self._free), "a block appears twice on the free stack")
        for block in range(self.num_blocks):
            count = self._refcount[block]
            require(count >= 0, f"block {block} has a negative refcount {count}")
            require(
                (count == 0) == (block in free),
                f"block {block} has refcount {count} but is "
                f"{'on' if block in free else 'not on'} the free stack",
            )
            if references is not None:
                expected = references.get(block, 0)
                require(
                    count == expected,
                    f"block {block} has refcount {count} but {expected} table reference(s)",
                )
        if references is not None:
            stray = sorted(b for b in references if not 0 <= b < self.num_blocks)
            require(not stray, f"tables reference block ids outside the pool: {stray}")

    def _check_id(self, block: int) -> int:
        block = as_int(block, "block id")
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"expected a block id in [0, {self.num_blocks}), got {block}")
        return block

    def _check_in_use(self, block: int, op: str) -> int:
        block = self._check_id(block)
        if self._refcount[block] == 0:
            raise ValueError(f"cannot {op} block {block}: expected a block in use, got a free one")
        return block
