"""Per-sequence state in NumPy arrays, and persistent batch handles with device block tables.

Every live sequence owns one row of a few arrays (:class:`SequenceTable`), so that a decode step
for a whole batch is a handful of vectorised operations on those arrays::

    tables[row, j]   physical block of the sequence's tokens j * block_size .. (j + 1) * block_size - 1
    lens[row]        tokens stored or reserved; the row holds cdiv(lens[row], block_size) blocks
    sids[row]        the sequence's id (-1: a free row)
    live[row]        the id again while the sequence is resident, -1 while it is swapped out
                     (its table row is then all 0) or the row is free: one comparison checks
                     that a batch's sequences are all alive and resident
    shared[row]      the partly filled last block may be shared with another sequence (set by a
                     fork; cleared once the row has a private last block)
    version[row]     when the row's table last changed (a logical clock)
    tail[row]        token ids of the unfilled last block (prefix caching only)
    pending[row]     full blocks wait to be registered until their K/V are known written

Entries past a row's last block are 0 (padding, never read: the lengths say how many count).

A :class:`SequenceBatch` is an ordered batch of sequences resolved to rows once, so that each step
skips the id lookups. It keeps the batch's block table on the device and refreshes only the rows
whose ``version`` moved since its last refresh: a decode step uploads the few rows that took a
block, not the whole table. On the CPU the "device" table is a second NumPy array, so the same
path runs in every test.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from ._checks import require
from ._util import cdiv

if TYPE_CHECKING:
    from .block_manager import BlockManager


class SequenceTable:
    """The rows of the live sequences; grows by doubling (rows and width apart)."""

    def __init__(self, tail_width: int = 0, rows: int = 16, width: int = 16) -> None:
        self.tables = np.zeros((rows, width), np.int32)
        self.flat = self.tables.reshape(-1)  # the same memory: entry row * width + j
        self.lens = np.zeros(rows, np.int32)
        self.sids = np.full(rows, -1, np.int64)
        self.live = np.full(rows, -1, np.int64)
        self.shared = np.zeros(rows, bool)
        self.version = np.zeros(rows, np.int64)
        self.tail = np.zeros((rows, tail_width), np.int64)
        self.pending = np.zeros(rows, bool)
        self.clock = 1
        # An upper bound on the blocks any row holds: a decode step raises it by one without a
        # reduction over the batch, and only when it reaches the width is the true maximum taken.
        self.held_bound = 0
        # Bumped whenever a resident sequence stops being one (freed, swapped out), always after
        # the change: a batch checked at the same epoch needs no new check, and a batch made
        # (without a lock) while another thread frees one of its sequences keeps the earlier
        # epoch, so its first use checks again.
        self.epoch = 0
        self._free_rows: list[int] = list(range(rows - 1, -1, -1))

    @property
    def width(self) -> int:
        return self.tables.shape[1]

    def acquire(self, sid: int) -> int:
        """A free row for sequence ``sid``: resident, empty, length 0."""
        if not self._free_rows:
            self._grow_rows(2 * self.tables.shape[0])
        row = self._free_rows.pop()
        self.sids[row] = self.live[row] = sid
        self.version[row] = self.clock
        return row

    def acquire_many(self, sids: list[int]) -> np.ndarray:
        """Rows for several new sequences at once (as :meth:`acquire`, in order)."""
        while len(self._free_rows) < len(sids):
            self._grow_rows(2 * self.tables.shape[0])
        rows = np.array(self._free_rows[: -len(sids) - 1 : -1], dtype=np.intp)
        del self._free_rows[-len(sids) :]
        self.sids[rows] = self.live[rows] = sids
        self.version[rows] = self.clock
        return rows

    def release(self, rows: np.ndarray) -> None:
        """Give rows back, zeroed."""
        self.tables[rows] = 0
        self.lens[rows] = 0
        self.sids[rows] = self.live[rows] = -1
        self.shared[rows] = self.pending[rows] = False
        self.version[rows] = self.clock
        self._free_rows.extend(rows.tolist()[::-1])
        self.epoch += 1  # after the change (see `epoch`)

    def release_one(self, row: int) -> None:
        """:meth:`release` for one row."""
        self.tables[row] = 0
        self.lens[row] = 0
        self.sids[row] = self.live[row] = -1
        self.shared[row] = self.pending[row] = False
        self.version[row] = self.clock
        self._free_rows.append(row)
        self.epoch += 1  # after the change (see `epoch`)

    def snapshot(self, rows: Any) -> tuple:
        """Everything stored for ``rows`` (an index or an index array), for :meth:`restore`."""
        if isinstance(rows, np.ndarray):  # fancy indexing copies already
            return tuple(array[rows] for array in self._row_arrays())
        return tuple(array[rows].copy() for array in self._row_arrays())

    def restore(self, rows: Any, snapshot: tuple) -> None:
        """Put back what :meth:`snapshot` saved (a rollback)."""
        for array, saved in zip(self._row_arrays(), snapshot, strict=True):
            if array.ndim == 2 and saved.shape[-1] != array.shape[1]:  # the table grew since
                array[rows, saved.shape[-1] :] = 0
                array[rows, : saved.shape[-1]] = saved
            else:
                array[rows] = saved
        self.epoch += 1  # residency may change back (after the change: see `epoch`)

    def free_rows_mark(self) -> int:
        return len(self._free_rows)

    def unrelease(self, mark: int) -> None:
        """Take back the rows released since ``free_rows_mark()`` returned ``mark``."""
        del self._free_rows[mark:]

    def _row_arrays(self) -> tuple[np.ndarray, ...]:
        return (self.tables, self.lens, self.sids, self.live, self.shared, self.pending,
                self.tail, self.version)  # fmt: skip

    def touch(self, rows: Any) -> None:
        """Record that the tables of ``rows`` changed (batches refresh them)."""
        self.version[rows] = self.clock

    def ensure_width(self, width: int) -> None:
        """At least ``width`` columns (the block manager keeps one spare past every table, so
        ``width - 1`` bounds the blocks of the row it grows)."""
        if width > self.held_bound:
            self.held_bound = width - 1
        if width > self.tables.shape[1]:
            tables = np.zeros(
                (self.tables.shape[0], max(width, 2 * self.tables.shape[1])), np.int32
            )
            tables[:, : self.tables.shape[1]] = self.tables
            self.tables, self.flat = tables, tables.reshape(-1)

    def check_invariants(self, rows: dict[int, int], block_size: int) -> None:
        """Check the rows against ``{sid: row}``; raises ``AssertionError`` naming the first break."""
        free = set(self._free_rows)
        require(len(free) == len(self._free_rows), "a table row is on the free list twice")
        used = set(rows.values())
        require(len(used) == len(rows), "two sequences share a table row")
        require(not free & used, f"rows both free and in use: {sorted(free & used)}")
        require(
            len(free) + len(used) == self.tables.shape[0],
            f"{self.tables.shape[0]} table rows but {len(free)} free and {len(used)} in use",
        )
        for sid, row in rows.items():
            require(
                self.sids[row] == sid,
                f"row {row} of sequence {sid} names sequence {self.sids[row]}",
            )
            resident = self.live[row] == sid
            require(
                resident or self.live[row] == -1, f"row {row} of sequence {sid} is live as another"
            )
            held = cdiv(int(self.lens[row]), block_size) if resident else 0
            require(
                not self.tables[row, held:].any(),
                f"table row {row} (sequence {sid}) has non-zero entries past its {held} block(s)",
            )
        for row in free:
            require(
                self.sids[row] == -1 and self.lens[row] == 0 and self.live[row] == -1,
                f"free table row {row} is not empty",
            )
            require(not self.tables[row].any(), f"free table row {row} holds block ids")

    def _grow_rows(self, rows: int) -> None:
        old = self.tables.shape[0]

        def grown(array: np.ndarray, fill: int) -> np.ndarray:
            out = np.full((rows, *array.shape[1:]), fill, array.dtype)
            out[:old] = array
            return out

        self.tables, self.lens = grown(self.tables, 0), grown(self.lens, 0)
        self.flat = self.tables.reshape(-1)
        self.sids, self.live = grown(self.sids, -1), grown(self.live, -1)
        self.shared, self.pending = grown(self.shared, False), grown(self.pending, False)
        self.version, self.tail = grown(self.version, 0), grown(self.tail, 0)
        self._free_rows[:0] = range(rows - 1, old - 1, -1)


class SequenceBatch:
    """An ordered batch of live sequences, resolved once, for the step API.

    Made by :meth:`cupaged.BlockManager.batch`; pass it wherever a list of sequence ids goes
    (``step``, ``reserve``, ``block_tables``). Each use checks, in one vectorised comparison, that
    its sequences are still alive and resident. Replace a finished sequence in place with
    :meth:`replace`; build a new batch when the batch changes more.

    Attributes:
        sids: ``[len(batch)]`` int64 sequence ids, in the order of the query rows (read-only).
    """

    def __init__(
        self, manager: BlockManager, sids: np.ndarray, rows: np.ndarray, xp: ModuleType, epoch: int
    ):
        self._manager = manager
        self._sids = sids
        # Made at first use (a batch made for one step needs neither): the ids as a set, for
        # replace's check that they stay distinct; a read-only view that follows replace().
        self._members: set[int] | None = None
        self._sids_view: np.ndarray | None = None
        self._rows = rows
        self._xp = xp
        self._device: Any = None  # [len, width] int32 block tables on the device
        self._synced = 0  # the table clock when the device copy was last refreshed
        self._replaced: list[int] = []  # positions to refresh whatever their version
        self._epoch = epoch  # the table epoch at the last check that every sequence is resident
        self._bases = rows  # rows * _bases_width: where each row starts in the flat table
        self._bases_width = 0

    @property
    def sids(self) -> np.ndarray:
        if self._sids_view is None:
            self._sids_view = self._sids.view()  # callers cannot write through it
            self._sids_view.flags.writeable = False
        return self._sids_view

    def __len__(self) -> int:
        return self._sids.size

    def __repr__(self) -> str:
        return f"SequenceBatch({self._sids.tolist()})"

    def replace(self, position: int, sid: int) -> None:
        """Put sequence ``sid`` at ``position`` in place of the one there (O(1) + one scan)."""
        position = int(position)
        if not 0 <= position < len(self):
            raise IndexError(f"expected a position in [0, {len(self)}), got {position}")
        row = self._manager._resident_row(sid)
        old = self._sids.item(position)
        if self._members is None:
            self._members = set(self._sids.tolist())
        if old != sid and sid in self._members:
            raise ValueError(f"expected distinct sequence ids, got {sid} twice in the batch")
        self._members.discard(old)
        self._members.add(int(sid))
        self._sids[position] = sid
        self._rows[position] = row
        if self._bases_width:
            self._bases[position] = row * self._bases_width
        self._replaced.append(position)

    def flat_bases(self, width: int) -> np.ndarray:
        """``rows * width`` (intp): each row's first entry in the flat table of that width."""
        if self._bases_width != width:
            self._bases, self._bases_width = self._rows * width, width
        return self._bases

    def device_tables(self, table: SequenceTable) -> Any:
        """The batch's ``[len, width]`` int32 block tables on the device, refreshed where stale."""
        xp = self._xp
        if self._device is None or self._device.shape[1] != table.width:
            self._device = xp.asarray(table.tables[self._rows])
            if xp is np:
                self._device = self._device.copy()  # never alias the host table
            self._replaced.clear()
        else:
            stale = table.version[self._rows] > self._synced
            if self._replaced:
                stale[self._replaced] = True
                self._replaced.clear()
            positions = stale.nonzero()[0]
            if positions.size:
                rows = table.tables[self._rows[positions]]
                if xp is np:
                    self._device[positions] = rows
                else:
                    self._device[xp.asarray(positions)] = xp.asarray(rows)
        self._synced = table.clock
        table.clock += 1
        return self._device
