"""The queue of evictable blocks, least recently freed first, with lazy deletion.

A block that becomes evictable (no reference left, content still registered in the prefix cache)
is appended with a fresh stamp; reviving it on a prefix-cache hit only clears its stamp, which
turns its queue entry stale; eviction skips stale entries. Reviving many blocks is one vectorised
store, where an intrusive linked list needs a Python call per block (and a ``deque.remove`` is
O(n)). Stale entries are dropped when the queue reaches its capacity of ``2 * num_blocks + 64``
entries; at most ``num_blocks`` of them are live, so compaction is amortised O(1) per block.

Every change records its undo in the owner's :class:`~cupaged.paging.transaction.Transaction`
first (saved values, restored as they were: see that module's rules).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays.checks import require

NO_STAMP = -1  # the stamp of a block that is not evictable


class EvictionQueue:
    """Evictable blocks of a pool of ``num_blocks``, in least-recently-freed order.

    Args:
        num_blocks: blocks in the pool.
        log: where undo goes: ``log.append((undo, *args))`` before each change (a transaction's
            log, or a sink outside any).
    """

    def __init__(self, num_blocks: int, log: Any) -> None:
        capacity = 2 * num_blocks + 64
        self._queue = np.empty(capacity, np.intp)
        self._queue_stamp = np.empty(capacity, np.int64)
        self._stamp = np.full(num_blocks, NO_STAMP, np.int64)
        # Entries [_head, _tail) of the queue, each live while its stamp equals _stamp[block].
        self._head = self._tail = self._clock = 0
        self.count = 0  # live entries: the evictable blocks
        self._log = log

    def push(self, blocks: np.ndarray) -> None:
        """Append ``blocks`` (distinct, not evictable), newest last."""
        if not blocks.size:
            return
        # Their stamps are NO_STAMP (not evictable): the undo restores that, nothing to read.
        saved = self._head, self._tail, self._clock, self.count, blocks, NO_STAMP
        self._log.append((self._restore, *saved))
        if self._tail + blocks.size > self._queue.size:
            self._log.append(
                (
                    self._restore_queue,
                    self._queue.copy(),
                    self._queue_stamp.copy(),
                    self._head,
                    self._tail,
                )
            )
            self._compact()
        stamps = np.arange(self._clock, self._clock + blocks.size, dtype=np.int64)
        end = self._tail + blocks.size
        self._queue[self._tail : end] = blocks
        self._queue_stamp[self._tail : end] = stamps
        self._stamp[blocks] = stamps
        self._tail, self._clock = end, self._clock + blocks.size
        self.count += blocks.size

    def revive(self, blocks: np.ndarray) -> None:
        """Take evictable ``blocks`` (distinct) off the queue: their entries turn stale."""
        self._save(blocks)
        self._stamp[blocks] = NO_STAMP
        self.count -= blocks.size

    def oldest(self, n: int) -> tuple[np.ndarray, int]:
        """The ``n`` least recently freed blocks (``n <= count``) and where the queue's head goes
        once they leave; changes nothing (:meth:`drop` takes them)."""
        taken: list[np.ndarray] = []
        window = max(64, 4 * n)
        head, left = self._head, n
        while left:
            end = min(self._tail, head + window)
            blocks = self._queue[head:end]
            live = (self._stamp[blocks] == self._queue_stamp[head:end]).nonzero()[0][:left]
            taken.append(blocks[live])
            head = head + int(live[-1]) + 1 if live.size == left else end
            left -= live.size
            window *= 2
        return np.concatenate(taken), head

    def drop(self, blocks: np.ndarray, head: int) -> None:
        """Take what :meth:`oldest` returned off the queue; the caller recorded the undo
        (:meth:`restore_dropped`) first."""
        self._stamp[blocks] = NO_STAMP
        self.count -= blocks.size
        self._head = head

    def snapshot(self) -> tuple[int, int, int, int]:
        """What :meth:`drop` changes besides the stamps: for :meth:`restore_dropped`."""
        return self._head, self._tail, self._clock, self.count

    def stamps(self, blocks: np.ndarray) -> np.ndarray:
        return self._stamp[blocks]

    def restore_dropped(
        self, mark: tuple[int, int, int, int], blocks: np.ndarray, stamps: np.ndarray, keep: bool
    ) -> None:
        """Undo of :meth:`drop`: ``keep`` puts the blocks back as they were; otherwise they leave
        the queue for good (the count drops by them)."""
        head, tail, clock, count = mark
        self._head, self._tail, self._clock = head, tail, clock
        if keep:
            self._stamp[blocks] = stamps
            self.count = count
        else:
            self._stamp[blocks] = NO_STAMP
            self.count = count - blocks.size

    def blocks(self) -> list[int]:
        """Evictable blocks in eviction order (next to go first); O(n), for checks."""
        return self._queue[self._head : self._tail][self._live_entries()].tolist()

    def check(self) -> set[int]:
        """Check the queue against the stamps; returns the evictable blocks. O(num_blocks), for
        tests: ``AssertionError`` names the first break."""
        evictable = self.blocks()
        require(
            len(evictable) == self.count,
            f"the LRU queue holds {len(evictable)} blocks but counts {self.count}",
        )
        found = set(evictable)
        require(len(found) == len(evictable), "a block appears twice in the LRU queue")
        stamped = set((self._stamp != NO_STAMP).nonzero()[0].tolist())
        require(stamped == found, "stamped blocks and the LRU queue's live entries differ")
        return found

    def _save(self, blocks: np.ndarray) -> None:
        """Record the undo of a change of the queue's ends, its count and ``blocks``' stamps."""
        saved = self._head, self._tail, self._clock, self.count, blocks, self._stamp[blocks]
        self._log.append((self._restore, *saved))

    def _restore(
        self, head: int, tail: int, clock: int, count: int, blocks: np.ndarray, stamps: Any
    ) -> None:
        self._head, self._tail, self._clock, self.count = head, tail, clock, count
        self._stamp[blocks] = stamps

    def _restore_queue(self, queue: np.ndarray, stamps: np.ndarray, head: int, tail: int) -> None:
        self._queue[:] = queue
        self._queue_stamp[:] = stamps
        self._head, self._tail = head, tail

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
