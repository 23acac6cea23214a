"""The pool of physical KV-cache blocks: free stack, refcounts, prefix-key map, LRU of cached blocks.

A block id is an index into the block axis of the cache arrays. The pool knows nothing about arrays,
devices or sequences; :class:`~cupaged.BlockManager` maps sequences onto the ids it hands out.

Every block is in exactly one of three states::

    free       refcount 0, on the free stack, holds nothing worth keeping
    in use     refcount >= 1, referenced by that many block-table entries
    evictable  refcount 0 but its content is registered under a prefix key: still findable,
               reused (evicted) in least-recently-freed order, only once the free stack is empty

    free --take--> in use --release (registered)--> evictable --take (evicts)--> in use
      ^              |  ^                              |
      +--release-----+  +--------acquire (a hit)-------+

The state lives in NumPy arrays indexed by block id, so that the block manager moves a whole decode
step's worth of blocks in a handful of vectorised operations rather than one Python call per block:
the free stack is an array used at its top, refcounts an ``int32`` array, the evictable blocks a
:class:`~cupaged.paging.lru.EvictionQueue`. Every operation is O(n) for ``n`` blocks, whatever the
size of the pool.

Inside a :class:`~cupaged.paging.transaction.Transaction` every change records its undo first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterable, Mapping
from threading import get_ident
from typing import Any

import numpy as np

from .._arrays.checks import as_int, require
from ..errors import OutOfBlocksError
from .keys import KeyMap
from .lru import EvictionQueue
from .transaction import Transaction

_ONE = np.int32(1)
_NO_SCOPE = contextlib.nullcontext()


class _Nowhere:
    """The undo log of a pool without a transaction: records go nowhere."""

    @staticmethod
    def append(record: Any) -> None:
        pass


_NOWHERE = _Nowhere()
_NO_IDS = np.zeros(0, np.intp)
_NO_REFS = np.int32(0)  # what a taken block's refcount was


def grouped(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of an id array, sorted, and how often each occurs: what
    ``np.unique(ids, return_counts=True)`` gives, in a few array operations (``np.unique`` and
    ``ufunc.at`` cost more than the work on the short arrays of a step)."""
    if not ids.size:
        return ids, ids
    ordered = np.sort(ids)
    bounds = (ordered[1:] != ordered[:-1]).nonzero()[0] + 1
    bounds = np.concatenate(([0], bounds, [ordered.size]))
    return ordered[bounds[:-1]], bounds[1:] - bounds[:-1]


class BlockPool:
    """Free list, reference counts and prefix-key map of ``num_blocks`` physical blocks.

    Freed blocks are handed out again first (LIFO), so a steady workload keeps touching the same,
    warm, blocks. A fresh pool hands out ids 0, 1, 2, ... in order. Blocks registered with
    :meth:`register` survive their last reference as *evictable* and are only reused, oldest first,
    when no free block is left. ``incref``, ``decref`` and ``acquire`` take one id or an array of
    ids; ids are checked once per call, at this boundary.

    Args:
        num_blocks: physical blocks.
        transaction: the owner's :class:`~cupaged.paging.transaction.Transaction`: while a call is
            inside it, every change records its undo there.

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

    def __init__(self, num_blocks: int, transaction: Transaction | None = None) -> None:
        num_blocks = as_int(num_blocks, "num_blocks")
        if num_blocks < 1:
            raise ValueError(f"expected num_blocks >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._transaction = transaction
        # Undo goes to the owner's transaction log (inside a call: the checked calls below enter
        # the transaction themselves when none is open), or nowhere for a pool of its own.
        self._log: Any = transaction.log if transaction is not None else _NOWHERE
        # The free stack: entries [0, _top) of _free, top at _top - 1; reversed so that a fresh
        # pool hands out 0 first. Ids are intp (what NumPy indexes with): an int32 index array
        # costs NumPy a cast on every gather and store.
        self._free = np.arange(num_blocks - 1, -1, -1, dtype=np.intp)
        self._top = num_blocks
        self._refcount = np.zeros(num_blocks, np.int32)
        self._refcount_view = self._refcount.view()
        self._refcount_view.flags.writeable = False
        # Of those references, the ones held for copies still to read a block (:meth:`hold`):
        # they keep it from the pool as a table's do, but share nothing, so the copy-on-write
        # test leaves them out (:attr:`held_refs`): a block's one table holder writes in place.
        self._held = np.zeros(num_blocks, np.int32)
        self._held_view = self._held.view()
        self._held_view.flags.writeable = False
        self.num_held = 0  # their total: while 0, nothing needs leaving out
        # release's scratch: for each block, the position of its last entry in a call,
        # numbered on across calls (so that what earlier calls left is always smaller).
        self._last_entry = np.full(num_blocks, -1, np.int64)
        self._entries_seen = 0
        self.keys = KeyMap(num_blocks, self._log)  # the prefix-key map (read it)
        self._lru = EvictionQueue(num_blocks, self._log)
        self.evictions = 0
        # Evicted blocks that a rollback could not make findable again (their K/V may have been
        # overwritten): freed once the whole rollback is done (see _restore_evicted).
        self._lost: list[int] = []
        if transaction is not None:
            transaction.after_rollback.append(self._free_lost)

    # ------------------------------------------------------------------------------ reading

    @property
    def num_free(self) -> int:
        """Blocks that :meth:`allocate` can hand out: free ones plus evictable ones."""
        return self._top + self._lru.count

    @property
    def num_stacked(self) -> int:
        """Free blocks on the stack: what a take gets without evicting a cached block."""
        return self._top

    @property
    def num_evictable(self) -> int:
        """Blocks with no reference whose content is still registered under a prefix key."""
        return self._lru.count

    @property
    def num_used(self) -> int:
        """Number of blocks in use (refcount >= 1)."""
        return self.num_blocks - self.num_free

    @property
    def refcounts(self) -> np.ndarray:
        """``[num_blocks]`` int32, read-only and live: each block's references."""
        return self._refcount_view

    @property
    def held_refs(self) -> np.ndarray:
        """``[num_blocks]`` int32, read-only and live: each block's references that
        :meth:`hold` took (part of :attr:`refcounts`; a block's sharers are the rest)."""
        return self._held_view

    def refcount(self, block: int) -> int:
        """Number of references to ``block`` (0 when it is free or evictable)."""
        return int(self._refcount[check_ids(block, self.num_blocks)[0]])

    def lookup(self, key: Hashable) -> tuple[int, object] | None:
        """The block registered under ``key`` and its content, or ``None``; changes nothing."""
        return self.keys.lookup(key)

    def cached_key(self, block: int) -> Hashable | None:
        """The key ``block`` is registered under, or ``None``."""
        return self.keys.key_of(int(check_ids(block, self.num_blocks)[0]))

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks in eviction order (next to go first); O(n), for tests and debugging."""
        return self._lru.blocks()

    # ------------------------------------------------------------------------------ checked calls

    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` blocks, each with refcount 1: free ones first, then the least recently freed
        evictable ones, whose prefix-cache entries are dropped.

        Raises:
            OutOfBlocksError: fewer than ``n`` blocks can be handed out; nothing was allocated.
        """
        n = as_int(n, "n")
        if n < 0:
            raise ValueError(f"expected n >= 0 blocks to allocate, got {n}")
        with self._scope():
            if n > self.num_free:
                raise OutOfBlocksError(n, self.num_free, f"allocating {n} block(s)")
            return self.take(n).tolist()

    def incref(self, blocks: int | Iterable[int] | np.ndarray) -> None:
        """Add a reference to each block (in use); an id given twice gets two (a fork shares them)."""
        with self._scope():
            ids = self._check_in_use(blocks, "incref")
            self._log.append((self._restore_refs, ids, self._refcount[ids]))
            np.add.at(self._refcount, ids.astype(np.intp), _ONE)  # an id given twice counts twice

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
        with self._scope():
            released = self.release(ids, repeats=not distinct)
        if isinstance(blocks, (int, np.integer)):
            return bool(released.size)
        return released

    def register(self, block: int, key: Hashable, content: object = None) -> int:
        """Make a full block findable under ``key`` (its prefix key), with ``content`` to verify.

        If another block already holds ``key``, that entry is kept (the first writer wins) and
        ``block`` stays unregistered.

        Returns:
            The block registered under ``key``.
        """
        (block,) = self._check_in_use(block, "register").tolist()
        found = self.keys.lookup(key)
        if found is not None:
            return found[0]
        if self.keys.key_of(block) is not None:
            raise ValueError(f"expected a block not registered yet, got block {block}")
        with self._scope():
            self.keys.register_many([block], [key], [content])
        return block

    def acquire(self, blocks: int | Iterable[int] | np.ndarray) -> None:
        """Take a reference to each registered block found by :meth:`lookup` (prefix-cache hits);
        evictable ones are revived: taken off the LRU queue in one vectorised store."""
        ids = check_ids(blocks, self.num_blocks)
        unregistered = ids[~self.keys.registered[ids]]
        if unregistered.size:
            raise ValueError(
                f"cannot acquire block {int(unregistered[0])}: expected a registered block"
            )
        with self._scope():
            self.acquire_unchecked(ids, distinct=np.unique(ids).size == ids.size)

    # ------------------------------------------------------------------------------ unchecked core
    # The block manager calls these with ids it knows to be valid (its own tables); the checked
    # calls above check their arguments once and then call them too.

    def take(self, n: int, evicted: list[Hashable] | None = None) -> np.ndarray:
        """``n`` blocks as an ``intp`` array, refcount 1 each (``n <= num_free``, unchecked);
        ``evicted`` collects the keys of the cached blocks it evicts, in order."""
        top = self._top
        if n <= top:  # the common case: no eviction (a copy: the undo record keeps it)
            blocks = self._free[top - n : top][::-1].copy()
            self._log.append((self._restore_stack, top, blocks, blocks, _NO_REFS))
            self._top = top - n
            self._refcount[blocks] = 1
            return blocks
        lost = self._evict(n - top, evicted)  # (its undo is recorded first: undone last)
        stacked = self._free[:top][::-1].copy()
        self._log.append((self._restore_stack, top, stacked, stacked, _NO_REFS))
        self._top = 0
        blocks = np.concatenate([stacked, lost])
        self._refcount[blocks] = 1
        return blocks

    def release(self, entries: np.ndarray, repeats: bool = False) -> np.ndarray:
        """Drop one reference per entry (held references, unchecked), in a dozen array
        operations: one sequence's blocks, or several sequences' runs joined (``repeats``: an id
        may occur in several runs, forks freed together). A block left without a reference goes
        at its last entry: evictable when registered, else free.

        Returns:
            The blocks left without a reference, in release order.
        """
        entries = np.array(entries, np.intp)  # (a copy: the undo keeps it; callers pass views)
        if not entries.size:
            return entries
        refcount = self._refcount
        held = refcount[entries]
        self._log.append((self._restore_stack, self._top, _NO_IDS, entries, held))
        if repeats:  # a block of several runs goes at its last entry, as one run after another
            np.subtract.at(refcount, entries, _ONE)  # (an int32 one: a Python 1 costs a cast)
            gone = refcount[entries] == 0
            if not np.count_nonzero(gone):
                return entries[:0]
            seen, self._entries_seen = self._entries_seen, self._entries_seen + entries.size
            order = np.arange(seen, seen + entries.size, dtype=np.int64)
            np.maximum.at(self._last_entry, entries, order)
            gone = entries[gone & (self._last_entry[entries] == order)]
        else:  # distinct ids: what is left of each is its count less one
            refcount[entries] = left = held - _ONE
            kept = np.count_nonzero(left)
            if kept == entries.size:
                return entries[:0]
            gone = entries if not kept else entries[left == 0]
        self._park(gone)
        return gone

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
        counts: Any = 1
        if not distinct:  # one reference per entry: count the repeats once
            blocks, counts = grouped(blocks)
        if held is None or in_use is None or not distinct:
            held = self._refcount[blocks]
            in_use = np.count_nonzero(held)  # mostly all (a fork) or none (a prefix revived)
        self._log.append((self._restore_refs, blocks, held))
        if in_use != held.size:
            self._lru.revive(blocks if not in_use else blocks[held == 0])
        self._refcount[blocks] = held + counts

    def add_refs(self, blocks: np.ndarray | int, delta: np.ndarray | int) -> None:
        """Add ``delta`` (or ``delta[i]``) references to each of ``blocks`` (distinct ids in use,
        unchecked; or one id): ``n`` for a fork of ``n``, minus the copies for the sources of
        copy-on-write copies, each keeping at least one."""
        self._log.append((self._restore_refs, blocks, self._refcount[blocks]))
        self._refcount[blocks] += delta

    def hold(self, blocks: np.ndarray | int, counts: np.ndarray | int) -> None:
        """Hold ``counts`` (or ``counts[i]``) references to each of ``blocks`` (distinct ids in
        use, unchecked; or one id) for copies still to read them: the blocks stay out of the pool
        until :meth:`let_go`, but the holds are no sharers (:attr:`held_refs`)."""
        self._log.append((self._restore_held, blocks, self._held[blocks], self.num_held))
        self._held[blocks] += counts
        self.num_held += int(counts) if isinstance(counts, (int, np.integer)) else int(counts.sum())
        self.add_refs(blocks, counts)

    def let_go(self, blocks: np.ndarray) -> None:
        """Drop one hold per entry of ``blocks`` (ids may repeat); a block left without any
        reference goes back to the pool, as :meth:`release` says."""
        blocks = np.array(blocks, np.intp)
        self._log.append((self._restore_held, blocks, self._held[blocks], self.num_held))
        np.subtract.at(self._held, blocks, _ONE)
        self.num_held -= blocks.size
        self.release(blocks, repeats=blocks.size > 1)

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
        evictable_set = self._lru.check()
        states = []
        for block in range(self.num_blocks):
            count = int(self._refcount[block])
            state = "free" if block in free else "evictable" if block in evictable_set else "used"
            states.append(state)
            require(count >= 0, f"block {block} has a negative refcount {count}")
            require(
                (count == 0) == (state != "used"),
                f"block {block} has refcount {count} but is {state}",
            )
            require(
                not (block in free and block in evictable_set),
                f"block {block} is both free and evictable",
            )
            if references is not None:
                expected = references.get(block, 0)
                require(
                    count == expected,
                    f"block {block} has refcount {count} but {expected} table reference(s)",
                )
        self.keys.check(states)
        if references is not None:
            stray = sorted(b for b in references if not 0 <= b < self.num_blocks)
            require(not stray, f"tables reference block ids outside the pool: {stray}")

    # ------------------------------------------------------------------------------ internals

    def _scope(self) -> Any:
        """The scope of a checked call: the owner's transaction unless a call is inside it."""
        transaction = self._transaction  # (entering it refuses another thread's call inside)
        inside = transaction is None or (transaction.depth and transaction.owner == get_ident())
        return _NO_SCOPE if inside else transaction  # (no owner, or this thread's call records)

    def _park(self, gone: np.ndarray) -> None:
        """Blocks left without a reference: registered ones evictable, the others free. (The
        free stack needs no undo of its own: it is unused above ``_top``, which the caller's
        record restores.)"""
        registered = np.count_nonzero(self.keys.registered[gone]) if len(self.keys) else 0
        if registered and registered == gone.size:  # a prompt's full blocks: all stay findable
            self._lru.push(gone)
            return
        cached = self.keys.registered[gone] if registered else None
        free = gone if cached is None else gone[~cached]
        self._free[self._top : self._top + free.size] = free
        self._top += free.size
        if cached is not None:
            self._lru.push(gone[cached])

    def _evict(self, n: int, evicted: list[Hashable] | None) -> np.ndarray:
        """Take the ``n`` least recently freed evictable blocks and drop their keys (appended to
        ``evicted``, in order, when given)."""
        lru, keys = self._lru, self.keys
        blocks, head = lru.oldest(n)
        block_list = blocks.tolist()
        dropped, contents = keys.entries(block_list)
        mark, stamps = lru.snapshot(), lru.stamps(blocks)
        self._log.append(
            (self._restore_evicted, mark, blocks, stamps, dropped, contents, self.evictions)
        )
        lru.drop(blocks, head)
        keys.drop(blocks)
        if evicted is not None:
            evicted += dropped
        self.evictions += n
        return blocks

    # Undo records: each restores saved values, so that running it again changes nothing.

    def _restore_refs(self, blocks: Any, held: Any) -> None:
        self._refcount[blocks] = held

    def _restore_held(self, blocks: Any, held: Any, num_held: int) -> None:
        self._held[blocks] = held
        self.num_held = num_held

    def _restore_stack(self, top: int, stacked: np.ndarray, blocks: np.ndarray, held: Any) -> None:
        """The stack as it was below ``top`` (``stacked`` were its top entries, top last), and
        the refcounts of ``blocks`` (an id given twice saved the same count twice)."""
        self._free[top - stacked.size : top] = stacked[::-1]
        self._top = top
        self._refcount[blocks] = held

    def _restore_evicted(
        self,
        mark: tuple[int, int, int, int],
        blocks: np.ndarray,
        stamps: np.ndarray,
        keys: list[Hashable],
        contents: list[object],
        evictions: int,
    ) -> None:
        """Evicted blocks become findable again, unless K/V were written into blocks the call
        took: they may hold the failed call's data, so they go back free and unregistered."""
        self._refcount[blocks] = 0
        self.evictions = evictions
        keep = self._transaction is None or not self._transaction.kv_written
        self._lru.restore_dropped(mark, blocks, stamps, keep)
        if keep:
            self.keys.restore(blocks, keys, contents)
        else:  # freed at the end of the rollback: an older record may still move the stack top
            self._lost += [block for block in blocks.tolist() if block not in self._lost]

    def _free_lost(self) -> None:
        if self._lost:
            lost = np.array(self._lost, np.intp)  # in eviction order: not np.setdiff1d's
            lost = lost[~np.isin(lost, self._free[: self._top])]
            self._free[self._top : self._top + lost.size] = lost
            self._top += lost.size
            self._lost.clear()

    def _check_in_use(self, blocks: Any, op: str) -> np.ndarray:
        ids = check_ids(blocks, self.num_blocks)
        idle = ids[self._refcount[ids] == 0]
        if idle.size:
            raise ValueError(
                f"cannot {op} block {idle[0]}: expected a block in use, got a free one"
            )
        return ids


def check_ids(blocks: Any, num_blocks: int) -> np.ndarray:
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
    bad = ids[(ids < 0) | (ids >= num_blocks)]
    if bad.size:
        raise ValueError(f"expected a block id in [0, {num_blocks}), got {bad[0]}")
    return ids.astype(np.int64)
