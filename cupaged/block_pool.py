"""The pool of physical KV-cache blocks: free stack, refcounts, prefix-hash map, LRU of cached blocks.

A block id is an index into the block axis of the cache arrays. The pool knows nothing about arrays,
devices or sequences; :class:`~cupaged.BlockManager` maps sequences onto the ids it hands out.

Every block is in exactly one of three states::

    free       refcount 0, on the free stack, holds nothing worth keeping
    in use     refcount >= 1, referenced by that many block-table entries
    evictable  refcount 0 but its content is registered under a prefix hash: still findable,
               reused (evicted) in least-recently-freed order, only once the free stack is empty

The state lives in NumPy arrays indexed by block id, so that the block manager moves a whole decode
step's worth of blocks in a handful of vectorised operations rather than one Python call per block:
the free stack is an array used at its top, refcounts an ``int32`` array. Every operation is O(1)
in the size of the pool (O(n) for ``n`` blocks).

The evictable blocks form a queue in least-recently-freed order with *lazy deletion*: a block that
becomes evictable is appended with a fresh stamp; reviving it on a prefix-cache hit only clears its
stamp, which turns its queue entry stale; eviction skips stale entries. Reviving many blocks is
one vectorised store, where the intrusive linked list that this replaces needed a Python call per
block (a ``deque.remove`` there would even be O(n)). Stale entries are dropped when the queue
reaches its capacity of ``2 * num_blocks + 64`` entries; at most ``num_blocks`` of them are live,
so compaction is amortised O(1) per block.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ._checks import as_int, require
from .errors import OutOfBlocksError

_NO_STAMP = -1  # the stamp of a block that is not evictable
_ONE = np.int32(1)


def _grouped(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of an id array, sorted, and how often each occurs: ``np.unique(ids,
    return_counts=True)`` in a few array operations (``np.unique`` and ``ufunc.at`` cost tens of
    microseconds on the short arrays of a step)."""
    if not ids.size:
        return ids, ids
    ordered = np.sort(ids)
    bounds = (ordered[1:] != ordered[:-1]).nonzero()[0] + 1
    bounds = np.concatenate(([0], bounds, [ordered.size]))
    return ordered[bounds[:-1]], bounds[1:] - bounds[:-1]


class BlockPool:
    """Free list, reference counts and prefix cache of ``num_blocks`` physical blocks.

    Freed blocks are handed out again first (LIFO), so a steady workload keeps touching the same,
    warm, blocks. A fresh pool hands out ids 0, 1, 2, ... in order. Blocks registered with
    :meth:`register` survive their last reference as *evictable* and are only reused, oldest first,
    when no free block is left. ``incref``, ``decref`` and ``acquire`` take one id or an array of
    ids; ids are checked once per call, at this boundary.

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
        >>> pool.incref([1, 1]); pool.refcount(1)   # bulk: one id twice is two references
        3
    """

    def __init__(self, num_blocks: int) -> None:
        num_blocks = as_int(num_blocks, "num_blocks")
        if num_blocks < 1:
            raise ValueError(f"expected num_blocks >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # The free stack: entries [0, _top) of _free, top at _top - 1; reversed so that a fresh
        # pool hands out 0 first.
        # Ids are kept as intp (what NumPy indexes with): an int32 index array costs NumPy a cast
        # on every gather and store, several times the gather itself on a decode step's arrays.
        self._free = np.arange(num_blocks - 1, -1, -1, dtype=np.intp)
        self._top = num_blocks
        self._refcount = np.zeros(num_blocks, np.int32)
        # release_entries' scratch: for each block, the position of its last entry in a call,
        # numbered on across calls (so that what earlier calls left is always smaller).
        self._last_entry = np.full(num_blocks, -1, np.int64)
        self._entries_seen = 0
        # Prefix cache: block -> its key and content while registered, and key -> block.
        self._key_of: list[Hashable | None] = [None] * num_blocks
        self._content_of: list[object] = [None] * num_blocks
        self._block_of: dict[Hashable, int] = {}
        self._registered = np.zeros(num_blocks, bool)
        # Bumped whenever a key stops mapping to its block (an eviction, a rolled-back
        # registration), never put back: while it stays the same, every key -> block mapping
        # seen earlier still holds (the prefix cache's memo of prompt heads relies on it).
        self.unregistrations = 0
        # Evictable blocks, least recently freed first: entries [_head, _tail) of the queue, each
        # live while its stamp equals _stamp[block].
        capacity = 2 * num_blocks + 64
        self._queue = np.empty(capacity, np.intp)
        self._queue_stamp = np.empty(capacity, np.int64)
        self._stamp = np.full(num_blocks, _NO_STAMP, np.int64)
        self._head = self._tail = self._clock = 0
        self._num_evictable = 0
        self.evictions = 0
        self._journal: list[tuple] | None = None  # undo records while a transaction is open

    @property
    def num_free(self) -> int:
        """Blocks that :meth:`allocate` can hand out: free ones plus evictable ones."""
        return self._top + self._num_evictable

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
        return self.take(n).tolist()

    def incref(self, blocks: int | Iterable[int] | np.ndarray) -> None:
        """Add a reference to each block (in use); an id given twice gets two (a fork shares them)."""
        ids = self._check_in_use(blocks, "incref")
        np.add.at(self._refcount, ids, 1)  # an id given twice counts twice

    def decref(self, blocks: int | Iterable[int] | np.ndarray) -> Any:
        """Drop a reference per id. A block left with none becomes evictable when its content is
        registered (newest at the tail of the LRU queue), else free; ids left in order.

        Returns:
            For one id, whether the block has no reference left; for several, the ``int32``
            array of blocks left without a reference, in the order they were released.
        """
        ids = self._check_in_use(blocks, "decref")
        distinct = True
        if ids.size > 1:
            unique, counts = np.unique(ids, return_counts=True)
            over = unique[counts > self._refcount[unique]]
            if over.size:
                raise ValueError(
                    f"cannot decref block {over[0]} {counts[unique == over[0]][0]} times: "
                    f"expected at most its {self._refcount[over[0]]} reference(s)"
                )
            distinct = unique.size == ids.size
        released = self.release(ids, distinct)
        if isinstance(blocks, (int, np.integer)):
            return bool(released.size)
        return released

    def refcount(self, block: int) -> int:
        """Number of references to ``block`` (0 when it is free or evictable)."""
        return int(self._refcount[self._check_ids(block)[0]])

    # ------------------------------------------------------------------------------ prefix cache

    def register(self, block: int, key: Hashable, content: object = None) -> int:
        """Make a full block findable under ``key`` (its prefix hash), with ``content`` to verify.

        If another block already holds ``key``, that entry is kept (the first writer wins) and
        ``block`` stays unregistered.

        Returns:
            The block registered under ``key``.
        """
        (block,) = self._check_in_use(block, "register").tolist()
        return self.register_unchecked(block, key, content)

    def lookup(self, key: Hashable) -> tuple[int, object] | None:
        """The block registered under ``key`` and its content, or ``None``; changes nothing."""
        block = self._block_of.get(key)
        return None if block is None else (block, self._content_of[block])

    def acquire(self, blocks: int | Iterable[int] | np.ndarray) -> None:
        """Take a reference to each registered block found by :meth:`lookup` (prefix-cache hits);
        evictable ones are revived: taken off the LRU queue in one vectorised store."""
        ids = self._check_ids(blocks)
        unregistered = ids[~self._registered[ids]]
        if unregistered.size:
            raise ValueError(
                f"cannot acquire block {int(unregistered[0])}: expected a registered block"
            )
        self.acquire_unchecked(ids, distinct=np.unique(ids).size == ids.size)

    def cached_key(self, block: int) -> Hashable | None:
        """The key ``block`` is registered under, or ``None``."""
        return self._key_of[int(self._check_ids(block)[0])]

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks in eviction order (next to go first); O(n), for tests and debugging."""
        return self._queue[self._head : self._tail][self._live_entries()].tolist()

    # ------------------------------------------------------------------------------ unchecked core
    # The block manager calls these with ids it knows to be valid (its own tables); the public
    # methods above check their arguments once and then call them too.

    def take(self, n: int, evicted: list[Hashable] | None = None) -> np.ndarray:
        """``n`` blocks as an ``intp`` array, refcount 1 each (``n <= num_free``, unchecked);
        ``evicted`` collects the keys of the cached blocks it evicts, in order."""
        top = self._top
        if n == 1 and top:  # one block (an admission, a per-token step): no reversal, no gather
            blocks = self._free[top - 1 : top].copy()
            self._top = top - 1
            if self._journal is not None:
                self._journal.append(("take", top, blocks))
            self._refcount[blocks[0]] = 1
            return blocks
        if n <= top:  # the common case: no eviction
            blocks = self._free[top - n : top][::-1].copy()
            self._top = top - n
        else:
            blocks = np.concatenate([self._free[:top][::-1], self._evict(n - top, evicted)])
            self._top = 0
        if self._journal is not None:
            self._journal.append(("take", top, blocks if n <= top else blocks[:top]))
        self._refcount[blocks] = 1
        return blocks

    def release(self, blocks: np.ndarray, distinct: bool = True) -> np.ndarray:
        """Drop one reference per entry of ``blocks`` (held references, unchecked).

        Returns:
            The blocks left without a reference, in release order (an id given twice is released
            at its last entry).
        """
        if blocks.dtype != np.intp:
            blocks = blocks.astype(np.intp)
        if self._journal is not None:  # callers pass arrays they do not change afterwards
            self._journal.append(("release", blocks))
        if distinct:
            left = self._refcount[blocks] - 1
            self._refcount[blocks] = left
            # Mostly every block goes (a sequence's own blocks): no mask to apply then.
            gone = blocks if not np.count_nonzero(left) else blocks[left == 0]
        else:  # an id may repeat (forks freed together, copy-on-write sources)
            ids, counts = _grouped(blocks)
            left = self._refcount[ids] - counts
            self._refcount[ids] = left
            if np.count_nonzero(left == 0):
                # Each gone block at its last entry, in release order: a stable sort of the
                # entries of gone blocks puts a block's last entry at the end of its run.
                entries = (self._refcount[blocks] == 0).nonzero()[0]
                order = blocks[entries].argsort(kind="stable")
                ranked = blocks[entries[order]]
                ends = np.append(ranked[1:] != ranked[:-1], True)
                gone = blocks[np.sort(entries[order[ends]])]
            else:
                gone = blocks[:0]
        if not self._block_of:  # nothing registered: every released block is plainly free
            self._push_free(gone)
        elif gone.size:
            cached = self._registered[gone]
            registered = np.count_nonzero(cached)
            if registered == gone.size:  # a prompt's full blocks: all stay findable
                self._push_evictable(gone)
            elif not registered:
                self._push_free(gone)
            else:
                self._push_free(gone[~cached])
                self._push_evictable(gone[cached])
        return gone

    def release_runs(self, runs: list[np.ndarray]) -> None:
        """:meth:`release` of each run in turn (each run's ids distinct: one sequence's blocks,
        forks of it in the next runs), in one call and a dozen array operations whatever the
        number of runs: no sort."""
        if runs:
            entries = np.concatenate(runs) if len(runs) > 1 else runs[0]
            self.release_entries(entries.astype(np.intp, copy=False), len(runs) > 1)

    def release_entries(self, entries: np.ndarray, repeats: bool) -> None:
        """Drop one reference per entry of ``entries`` (``intp``, held references, unchecked):
        :meth:`release_runs` of their concatenation. ``repeats``: an id may occur more than once
        (several runs); each block left without a reference goes at its last entry."""
        if self._journal is not None:  # callers pass arrays they do not change afterwards
            self._journal.append(("release_entries", entries))
        if not entries.size:
            return
        refcount = self._refcount
        np.subtract.at(refcount, entries, _ONE)  # (an int32 one: a Python 1 is 20x slower)
        gone = refcount[entries] == 0
        if not np.count_nonzero(gone):
            return
        if repeats:  # a block of several runs goes at its last entry, as one run after another
            seen = self._entries_seen
            order = np.arange(seen, seen + entries.size, dtype=np.int64)
            self._entries_seen = seen + entries.size
            last = self._last_entry
            np.maximum.at(last, entries, order)
            gone &= last[entries] == order
        gone = entries[gone]
        if not self._block_of:
            self._push_free(gone)
            return
        cached = self._registered[gone]
        self._push_free(gone[~cached])
        self._push_evictable(gone[cached])

    def acquire_unchecked(
        self,
        blocks: np.ndarray,
        distinct: bool = True,
        held: np.ndarray | None = None,
        in_use: int | None = None,
    ) -> None:
        """Take a reference per entry of ``blocks`` (registered or in use, unchecked); ``held``
        and ``in_use``, when the caller has them, are ``refcount[blocks]`` and its nonzero count
        (distinct ``blocks`` only)."""
        if blocks.dtype != np.intp:
            blocks = blocks.astype(np.intp)
        if not distinct:  # one reference per entry: count the repeats once
            blocks, counts = _grouped(blocks)
        if held is None or in_use is None or not distinct:
            held = self._refcount[blocks]
            in_use = np.count_nonzero(held)  # mostly all (a fork) or none (a prefix revived)
        revived = blocks[:0] if in_use == held.size else blocks if not in_use else blocks[held == 0]
        if self._journal is not None:  # callers pass arrays they do not change afterwards
            self._journal.append(("acquire", blocks, held))
        if revived.size:
            if self._journal is not None:
                self._journal.append(("revive", revived, self._stamp[revived]))
            self._stamp[revived] = _NO_STAMP
            self._num_evictable -= revived.size
        self._refcount[blocks] = held + (1 if distinct else counts)

    def register_unchecked(self, block: int, key: Hashable, content: object = None) -> int:
        """:meth:`register` for a block known to be in use."""
        existing = self._block_of.get(key)
        if existing is not None:
            return existing
        require(self._key_of[block] is None, f"block {block} is already registered")
        if self._journal is not None:
            self._journal.append(("register", [block]))
        self._block_of[key] = block
        self._key_of[block] = key
        self._content_of[block] = content
        self._registered[block] = True
        return block

    def register_many(
        self,
        blocks: list[int],
        keys: Sequence[Hashable],
        contents: Sequence[object],
        refused: list[int] | None = None,
    ) -> None:
        """:meth:`register_unchecked` of ``blocks[i]`` under ``keys[i]``, holding
        ``contents[i]``; ``refused`` collects each ``i`` whose key another block holds."""
        block_of, key_of, content_of = self._block_of, self._key_of, self._content_of
        registered: list[int] = []  # filled as blocks register, for a rollback
        if self._journal is not None:
            self._journal.append(("register", registered))
        for i, (block, key, content) in enumerate(zip(blocks, keys, contents, strict=True)):
            if key in block_of:
                if refused is not None:
                    refused.append(i)
                continue  # the first writer wins
            if key_of[block] is not None:
                require(False, f"block {block} is already registered")
            registered.append(block)
            block_of[key] = block
            key_of[block] = key
            content_of[block] = content
        if len(registered) <= 8:  # a few (an admission's own blocks, a decode step's)
            flags = self._registered
            for block in registered:
                flags[block] = True
        else:
            self._registered[registered] = True

    def share(self, blocks: np.ndarray, n: int) -> None:
        """Add ``n`` references to each of ``blocks`` (distinct, in use, unchecked): a fork."""
        blocks = blocks.astype(np.intp)  # a copy: the journal keeps it
        held = self._refcount[blocks]
        if self._journal is not None:
            self._journal.append(("acquire", blocks, held))
        self._refcount[blocks] = held + n

    def unshare(self, blocks: np.ndarray | int, counts: np.ndarray | int) -> None:
        """Drop ``counts[i]`` references from ``blocks[i]`` (distinct ids, each keeping at least
        one, unchecked; or one id and its count): the sources of copy-on-write copies, whose other
        holders stay."""
        if self._journal is not None:
            self._journal.append(("acquire", blocks, self._refcount[blocks]))
        self._refcount[blocks] -= counts

    # ------------------------------------------------------------------------------ transactions

    def begin(self) -> tuple[int, ...]:
        """Start recording what changes, so that :meth:`rollback` can undo it."""
        self._journal = []
        return (self._top, self._head, self._tail, self._clock, self._num_evictable, self.evictions)

    def end(self) -> None:
        """Stop recording: the changes since :meth:`begin` stay."""
        self._journal = None

    def rollback(self, mark: tuple[int, ...], keep_evicted: bool = True) -> None:
        """Undo everything since :meth:`begin` (``mark`` is what it returned).

        Blocks evicted since then are made findable again when ``keep_evicted``; otherwise (K/V
        may have been written into them) they stay out of the cache, as free blocks.
        """
        journal, self._journal = self._journal or [], None
        lost: list[np.ndarray] = []
        for record in reversed(journal):
            kind = record[0]
            if kind == "take":
                _, top, from_stack = record
                self._refcount[from_stack] = 0
                self._free[top - from_stack.size : top] = from_stack[::-1]
            elif kind == "evict":
                _, blocks, keys, contents, stamps = record
                self._refcount[blocks] = 0
                if keep_evicted:
                    for block, key, content in zip(blocks.tolist(), keys, contents, strict=True):
                        self._block_of[key] = block
                        self._key_of[block], self._content_of[block] = key, content
                    self._registered[blocks] = True
                    self._stamp[blocks] = stamps
                else:
                    lost.append(blocks)
            elif kind == "release":
                np.add.at(self._refcount, record[1], _ONE)
                self._stamp[record[1][self._refcount[record[1]] > 0]] = _NO_STAMP
            elif kind == "release_entries":
                np.add.at(self._refcount, record[1], _ONE)
                self._stamp[record[1]] = _NO_STAMP  # each one is referenced again
            elif kind == "acquire":
                self._refcount[record[1]] = record[2]
            elif kind == "revive":
                self._stamp[record[1]] = record[2]
            elif kind == "register":
                self.unregistrations += 1
                for block in record[1]:
                    del self._block_of[self._key_of[block]]
                    self._key_of[block] = self._content_of[block] = None
                    self._registered[block] = False
            elif kind == "queue":
                self._queue[: record[1].size] = record[1]
                self._queue_stamp[: record[2].size] = record[2]
        (self._top, self._head, self._tail, self._clock, self._num_evictable, self.evictions) = mark
        for blocks in lost:  # evicted, and maybe overwritten since: free, not findable
            self._push_free(blocks)
            self._num_evictable -= blocks.size

    # ------------------------------------------------------------------------------ checking

    def check_invariants(self, references: Mapping[int, int] | None = None) -> None:
        """Check the pool's bookkeeping; O(num_blocks), for tests and debugging.

        Args:
            references: optional count of block-table references per block id, as the owner of the
                tables sees them; every block's refcount must equal it (0 for absent ids).

        Raises:
            AssertionError: naming the first broken invariant.
        """
        stack = self._free[: self._top].tolist()
        free = set(stack)
        require(len(free) == len(stack), "a block appears twice on the free stack")
        evictable = self.evictable_blocks()
        require(
            len(evictable) == self._num_evictable,
            f"the LRU queue holds {len(evictable)} blocks but counts {self._num_evictable}",
        )
        evictable_set = set(evictable)
        require(len(evictable_set) == len(evictable), "a block appears twice in the LRU queue")
        stamped = set(np.flatnonzero(self._stamp != _NO_STAMP).tolist())
        require(stamped == evictable_set, "stamped blocks and the LRU queue's live entries differ")
        for block in range(self.num_blocks):
            count = int(self._refcount[block])
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
            require(
                bool(self._registered[block]) == (self._key_of[block] is not None),
                f"block {block}'s registered flag disagrees with its key",
            )
            if state == "free":
                require(self._key_of[block] is None, f"free block {block} is still registered")
            if state == "evictable":
                require(self._key_of[block] is not None, f"evictable block {block} has no hash")
            if references is not None:
                expected = references.get(block, 0)
                require(
                    count == expected,
                    f"block {block} has refcount {count} but {expected} table reference(s)",
                )
        for key, block in self._block_of.items():
            require(
                self._key_of[block] == key,
                f"the prefix map sends {key!r} to block {block}, registered as {self._key_of[block]!r}",
            )
        registered = sum(key is not None for key in self._key_of)
        require(
            registered == len(self._block_of),
            f"{registered} blocks are registered but the prefix map has {len(self._block_of)}",
        )
        if references is not None:
            stray = sorted(b for b in references if not 0 <= b < self.num_blocks)
            require(not stray, f"tables reference block ids outside the pool: {stray}")

    # ------------------------------------------------------------------------------ internals

    def _push_free(self, blocks: np.ndarray) -> None:
        self._free[self._top : self._top + blocks.size] = blocks
        self._top += blocks.size

    def _push_evictable(self, blocks: np.ndarray) -> None:
        if not blocks.size:
            return
        if self._tail + blocks.size > self._queue.size:
            if self._journal is not None:
                self._journal.append(("queue", self._queue.copy(), self._queue_stamp.copy()))
            self._compact()
        stamps = np.arange(self._clock, self._clock + blocks.size, dtype=np.int64)
        end = self._tail + blocks.size
        self._queue[self._tail : end] = blocks
        self._queue_stamp[self._tail : end] = stamps
        self._stamp[blocks] = stamps
        self._tail, self._clock = end, self._clock + blocks.size
        self._num_evictable += blocks.size

    def _evict(self, n: int, evicted: list[Hashable] | None = None) -> np.ndarray:
        """Take the ``n`` least recently freed evictable blocks and drop their cache entries
        (their keys appended to ``evicted``, in order, when given)."""
        taken: list[np.ndarray] = []
        window = max(64, 4 * n)
        while n:
            end = min(self._tail, self._head + window)
            live = self._live_entries(end).nonzero()[0][:n]
            taken.append(self._queue[self._head + live])
            self._head = self._head + int(live[-1]) + 1 if live.size == n else end
            n -= live.size
            window *= 2
        blocks = np.concatenate(taken)
        if self._journal is not None:
            keys = [self._key_of[block] for block in blocks.tolist()]
            contents = [self._content_of[block] for block in blocks.tolist()]
            self._journal.append(("evict", blocks, keys, contents, self._stamp[blocks]))
        self._stamp[blocks] = _NO_STAMP
        self._num_evictable -= blocks.size
        self._registered[blocks] = False
        self.unregistrations += 1
        for block in blocks.tolist():
            key = self._key_of[block]
            del self._block_of[key]
            if evicted is not None:
                evicted.append(key)
            self._key_of[block] = None
            self._content_of[block] = None
        self.evictions += blocks.size
        return blocks

    def _live_entries(self, end: int | None = None) -> np.ndarray:
        end = self._tail if end is None else end
        blocks = self._queue[self._head : end]
        return self._stamp[blocks] == self._queue_stamp[self._head : end]

    def _compact(self) -> None:
        live = self._live_entries()
        count = int(live.sum())
        self._queue[:count] = self._queue[self._head : self._tail][live]
        self._queue_stamp[:count] = self._queue_stamp[self._head : self._tail][live]
        self._head, self._tail = 0, count

    def _check_ids(self, blocks: Any) -> np.ndarray:
        """Block ids as an int64 array, each in ``[0, num_blocks)``; checked before any cast."""
        if isinstance(blocks, (bool, np.bool_)):
            ids = None
        elif isinstance(blocks, (int, np.integer)):
            ids = np.array([blocks]) if -(2**63) <= blocks < 2**63 else None
        elif not isinstance(blocks, Iterable) or isinstance(blocks, (str, bytes)):
            ids = None
        else:
            ids = np.asarray(blocks if hasattr(blocks, "dtype") else list(blocks))
            if ids.ndim == 1 and not ids.size:
                return ids.astype(np.int64)
        if ids is None or ids.ndim != 1 or ids.dtype.kind not in "iu":
            what = repr(blocks) if isinstance(blocks, (int, np.integer)) else type(blocks).__name__
            raise TypeError(f"expected a block id (an int) or a 1-D array of them, got {what}")
        bad = ids[(ids < 0) | (ids >= self.num_blocks)]
        if bad.size:
            raise ValueError(f"expected a block id in [0, {self.num_blocks}), got {bad[0]}")
        return ids.astype(np.int64)

    def _check_in_use(self, blocks: Any, op: str) -> np.ndarray:
        ids = self._check_ids(blocks)
        idle = ids[self._refcount[ids] == 0]
        if idle.size:
            raise ValueError(
                f"cannot {op} block {idle[0]}: expected a block in use, got a free one"
            )
        return ids
