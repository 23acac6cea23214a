"""Persistent batch handles with device block tables: :class:`SequenceBatch`.

A :class:`SequenceBatch` is an ordered batch of sequences resolved to rows once, so that each step
skips the id lookups. It keeps the batch's block table on the device and refreshes only the rows
whose ``version`` moved since its last refresh: a decode step uploads the few rows that took a
block, not the whole table. On the CPU the "device" table is a second NumPy array, so the same
path runs in every test.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from .._arrays.checks import as_int
from .sequences import SequenceTable


class SequenceBatch:
    """An ordered batch of live sequences, resolved once, for the step API.

    Made by :meth:`cupaged.BlockManager.batch`; pass it wherever a list of sequence ids goes
    (``step``, ``reserve``, ``block_tables``) of the manager that made it (another manager
    refuses it). Each use checks, in one vectorised comparison, that its sequences are still
    alive and resident. Replace a finished sequence in place with :meth:`replace`; build a new
    batch when the batch changes more.

    Attributes:
        sids: ``[len(batch)]`` int64 sequence ids, in the order of the query rows (read-only).
        table: the :class:`SequenceTable` the batch's rows belong to.
    """

    def __init__(
        self, table: SequenceTable, sids: np.ndarray, rows: np.ndarray, xp: ModuleType, epoch: int
    ):
        self.table = table
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

    def rows(self) -> np.ndarray:
        """``[len(batch)]`` intp rows of the table, each checked resident (one comparison when
        no sequence stopped being resident since the last check).

        Raises:
            KeyError, CupagedError: as :meth:`SequenceTable.resident_row`, for the first
            sequence gone or swapped out.
        """
        table = self.table
        epoch = table.epoch  # (before the check: see SequenceTable.epoch)
        if self._epoch != epoch:
            if np.count_nonzero(table.live[self._rows] != self._sids):
                for sid in self._sids.tolist():
                    table.resident_row(sid)  # raises for the first gone or swapped one
            self._epoch = epoch
        return self._rows

    def replace(self, position: int, sid: int) -> None:
        """Put sequence ``sid`` at ``position`` in place of the one there (O(1) + one scan)."""
        position = as_int(position, "position")
        sid = as_int(sid, "sid")
        if not 0 <= position < len(self):
            raise IndexError(f"expected a position in [0, {len(self)}), got {position}")
        row = self.table.resident_row(sid)
        old = self._sids.item(position)
        if self._members is None:
            self._members = set(self._sids.tolist())
        if old != sid and sid in self._members:
            raise ValueError(f"expected distinct sequence ids, got {sid} twice in the batch")
        # The id set first grows, then shrinks: an interrupt in between leaves it a superset
        # (a later replace may refuse an id spuriously, never accept a duplicate).
        self._members.add(sid)
        self._replaced.append(position)
        # The rows as a new array, not changed in place: the undo records of an open
        # ``with transaction():`` block's steps hold the old one (a rollback restores those rows).
        rows = self._rows.copy()
        rows[position] = row
        self._sids[position] = sid
        self._rows = rows
        if self._bases_width:
            self._bases[position] = row * self._bases_width
        if old != sid:
            self._members.discard(old)

    def flat_bases(self) -> np.ndarray:
        """``rows * width`` (intp) at the table's width: each row's first flat entry."""
        width = self.table.width
        if self._bases_width != width:
            self._bases, self._bases_width = self._rows * width, width
        return self._bases

    def device_tables(self) -> Any:
        """The batch's ``[len, width]`` int32 block tables on the device, refreshed where stale."""
        xp, table = self._xp, self.table
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
        self._synced = table.tick()
        return self._device
