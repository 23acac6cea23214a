"""The pool of physical KV-cache blocks: free stack, refcounts, prefix-hash map, LRU of cached blocks.

A block id is an index into the block axis of the cache arrays. The pool knows nothing about arrays,
devices or sequences; :class:`~cupaged.PagedCache` maps sequences onto the ids it hands out.

Every block is in exactly one of three states::

    free       refcount 0, on the free stack, holds nothing worth keeping
    in use     refcount >= 1, referenced by that many block-table entries
    evictable  refcount 0 but its content is registered under a prefix hash: still findable,
               reused (evicted) in least-recently-freed order, only once the free stack is empty

Every operation is O(1) in the size of the pool (allocating ``n`` blocks is O(n)). The free stack
is a Python list used at its end. The evictable blocks form an intrusive doubly linked list kept
in two lists indexed by block id (``_prev``/``_next``, with a sentinel at index ``num_blocks``), so
that reviving a block on a prefix-cache hit unlinks it from the middle in O(1) without allocating
a Python object; a ``deque.remove`` there would be O(n).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from ._checks import as_int, require
from .errors import OutOfBlocksError


class BlockPool:
    """Free list, reference counts and prefix cache of ``num_blocks`` physical blocks.

    Freed blocks are handed out again first (LIFO), so a steady workload keeps touching the same,
    warm, blocks. A fresh pool hands out ids 0, 1, 2, ... in order. Blocks registered with
    :meth:`register` survive their last reference as *evictable* and are only reused, oldest first,
    when no free block is left.

    Example:
        >>> pool = BlockPool(4)
        >>> pool.allocate(2)
        [0, 1]
        >>> pool.incref(1)      # a fork shares block 1
        >>> pool.decref(1), pool.decref(1), pool.num_free
        (False, True, 3)
        >>> pool.allocate(1)    # the most recently freed block comes back first
        [1]
        >>> pool.register(0, b"prefix", content="tokens 0-15")
        0
        >>> pool.decref(0), pool.num_evictable, pool.lookup(b"prefix")
        (True, 1, (0, 'tokens 0-15'))
    """

    def __init__(self, num_blocks: int) -> None:
        num_blocks = as_int(num_blocks, "num_blocks")
        if num_blocks < 1:
            raise ValueError(f"expected num_blocks >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # Top of the stack is the end of the list; reversed so that a fresh pool hands out 0 first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refcount: list[int] = [0] * num_blocks
        # Prefix cache: block -> its hash and content while registered, and hash -> block.
        self._hash_of: list[Hashable | None] = [None] * num_blocks
        self._content_of: list[object] = [None] * num_blocks
        self._block_of: dict[Hashable, int] = {}
        # Evictable blocks, least recently freed first: a circular list through the sentinel.
        self._sentinel = num_blocks
        self._prev: list[int] = [num_blocks] * (num_blocks + 1)
        self._next: list[int] = [num_blocks] * (num_blocks + 1)
        self._num_evictable = 0
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks that :meth:`allocate` can hand out: free ones plus evictable ones."""
        return len(self._free) + self._num_evictable

    @property
    def num_evictable(self) -> int:
        """Blocks with no reference whose content is still registered in the prefix cache."""
        return self._num_evictable

    @property
    def num_used(self) -> int:
        """Number of blocks in use (refcount >= 1)."""
        return self.num_blocks - self.num_free

    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` blocks, each with refcount 1: free ones first, then the least recently freed
        evictable ones, whose prefix-cache entries are dropped.

        Raises:
            OutOfBlocksError: fewer than ``n`` blocks can be handed out; nothing was allocated.
        """
        n = as_int(n, "n")
        if n < 0:
            raise ValueError(f"expected n >= 0 blocks to allocate, got {n}")
        if n > self.num_free:
            raise OutOfBlocksError(n, self.num_free, f"allocating {n} block(s)")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block = self._next[self._sentinel]
                self._unlink(block)
                self._forget(block)
                self.evictions += 1
            self._refcount[block] = 1
            blocks.append(block)
        return blocks

    def incref(self, block: int) -> None:
        """Add a reference to a block in use (a fork shares it)."""
        block = self._check_in_use(block, "incref")
        self._refcount[block] += 1

    def decref(self, block: int) -> bool:
        """Drop a reference. A block left with none becomes evictable when its content is
        registered (newest at the tail of the LRU list), else free.

        Returns:
            True when the block has no reference left.
        """
        block = self._check_in_use(block, "decref")
        self._refcount[block] -= 1
        if self._refcount[block]:
            return False
        if self._hash_of[block] is None:
            self._free.append(block)
        else:
            self._link_tail(block)
        return True

    def refcount(self, block: int) -> int:
        """Number of references to ``block`` (0 when it is free or evictable)."""
        if type(block) is int and 0 <= block < self.num_blocks:  # the per-token fast path
            return self._refcount[block]
        return self._refcount[self._check_id(block)]

    # ------------------------------------------------------------------------------ prefix cache

    def register(self, block: int, key: Hashable, content: object = None) -> int:
        """Make a full block findable under ``key`` (its prefix hash), with ``content`` to verify.

        If another block already holds ``key``, that entry is kept (the first writer wins) and
        ``block`` stays unregistered.

        Returns:
            The block registered under ``key``.
        """
        block = self._check_in_use(block, "register")
        existing = self._block_of.get(key)
        if existing is not None:
            return existing
        require(self._hash_of[block] is None, f"block {block} is already registered")
        self._block_of[key] = block
        self._hash_of[block] = key
        self._content_of[block] = content
        return block

    def lookup(self, key: Hashable) -> tuple[int, object] | None:
        """The block registered under ``key`` and its content, or ``None``; changes nothing."""
        block = self._block_of.get(key)
        return None if block is None else (block, self._content_of[block])

    def acquire(self, block: int) -> None:
        """Take a reference to a registered block found by :meth:`lookup` (a prefix-cache hit);
        an evictable block is revived: unlinked from the LRU list in O(1)."""
        block = self._check_id(block)
        if self._hash_of[block] is None:
            raise ValueError(f"cannot acquire block {block}: expected a registered block")
        if self._refcount[block] == 0:
            self._unlink(block)
        self._refcount[block] += 1

    def cached_key(self, block: int) -> Hashable | None:
        """The key ``block`` is registered under, or ``None``."""
        return self._hash_of[self._check_id(block)]

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks in eviction order (next to go first); O(n), for tests and debugging."""
        order, block = [], self._next[self._sentinel]
        while block != self._sentinel:
            order.append(block)
            block = self._next[block]
        return order

    # ------------------------------------------------------------------------------ checking

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
        evictable = self.evictable_blocks()
        require(
            len(evictable) == self._num_evictable,
            f"the LRU list holds {len(evictable)} blocks but counts {self._num_evictable}",
        )
        evictable_set = set(evictable)
        require(len(evictable_set) == len(evictable), "a block appears twice in the LRU list")
        for block in evictable:
            nxt = self._next[block]
            require(self._prev[nxt] == block, f"LRU links around block {block} disagree")
        for block in range(self.num_blocks):
            count = self._refcount[block]
            state = "free" if block in free else "evictable" if block in evictable_set else "used"
            require(count >= 0, f"block {block} has a negative refcount {count}")
            require(
                (count == 0) == (state != "used"),
                f"block {block} has refcount {count} but is {state}",
            )
            require(
                not (block in free and block in evictable_set),
                f"block {block} is both free and evictable",
            )
            if state == "free":
                require(self._hash_of[block] is None, f"free block {block} is still registered")
            if state == "evictable":
                require(self._hash_of[block] is not None, f"evictable block {block} has no hash")
            if references is not None:
                expected = references.get(block, 0)
                require(
                    count == expected,
                    f"block {block} has refcount {count} but {expected} table reference(s)",
                )
        for key, block in self._block_of.items():
            require(
                self._hash_of[block] == key,
                f"the prefix map sends {key!r} to block {block}, registered as {self._hash_of[block]!r}",
            )
        registered = sum(key is not None for key in self._hash_of)
        require(
            registered == len(self._block_of),
            f"{registered} blocks are registered but the prefix map has {len(self._block_of)}",
        )
        if references is not None:
            stray = sorted(b for b in references if not 0 <= b < self.num_blocks)
            require(not stray, f"tables reference block ids outside the pool: {stray}")

    # ------------------------------------------------------------------------------ internals

    def _link_tail(self, block: int) -> None:
        last = self._prev[self._sentinel]
        self._next[last] = block
        self._prev[block] = last
        self._next[block] = self._sentinel
        self._prev[self._sentinel] = block
        self._num_evictable += 1

    def _unlink(self, block: int) -> None:
        before, after = self._prev[block], self._next[block]
        self._next[before] = after
        self._prev[after] = before
        self._num_evictable -= 1

    def _forget(self, block: int) -> None:
        del self._block_of[self._hash_of[block]]
        self._hash_of[block] = None
        self._content_of[block] = None

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
