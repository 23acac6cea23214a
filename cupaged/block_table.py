"""Padded int32 block tables of the live sequences, kept on the cache's device incrementally.

Each live sequence owns one row of a ``[rows, width]`` int32 array; entry ``j`` of its row is the
physical block that holds its tokens ``j * block_size .. (j + 1) * block_size - 1``. Entries past the
sequence's last block are 0 (padding, never read: ``context_lens`` says how many entries count).

The authoritative copy lives in host memory, where single-entry updates are cheap; the device copy
is refreshed lazily, uploading only the rows that changed since the last :meth:`gather` in one
scatter. A decode step thus moves a few rows, not the whole table. Both copies grow by doubling.
On the CPU the "device" copy is a second NumPy array, so the same code path runs in every test.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from ._backend import to_numpy
from ._checks import require


class DeviceBlockTable:
    """Rows of block ids, one per live sequence, mirrored to a device array."""

    def __init__(self, xp: ModuleType, rows: int = 16, width: int = 16) -> None:
        self._xp = xp
        self._host = np.zeros((rows, width), np.int32)
        self._device = xp.zeros((rows, width), np.int32)
        self._free_rows: list[int] = list(range(rows - 1, -1, -1))
        self._dirty: set[int] = set()

    def acquire_row(self, blocks: list[int]) -> int:
        """Take a free row and fill it with ``blocks``; returns the row index."""
        if not self._free_rows:
            self._grow(rows=2 * self._host.shape[0])
        row = self._free_rows.pop()
        self.write(row, 0, blocks)
        return row

    def release_row(self, row: int, num_used: int) -> None:
        """Give a row back, resetting its ``num_used`` leading entries to the padding value."""
        self._host[row, :num_used] = 0
        self._dirty.add(row)
        self._free_rows.append(row)

    def write(self, row: int, start: int, blocks: list[int]) -> None:
        """Set entries ``start .. start + len(blocks) - 1`` of ``row``."""
        if not blocks:
            return
        end = start + len(blocks)
        if end > self._host.shape[1]:
            self._grow(width=max(end, 2 * self._host.shape[1]))
        if len(blocks) == 1:
            self._host[row, start] = blocks[0]
        else:
            self._host[row, start:end] = blocks
        self._dirty.add(row)

    def gather(self, rows: list[int], width: int) -> Any:
        """Device array ``[len(rows), width]`` int32 of the given rows' first ``width`` entries."""
        self._sync()
        width = min(width, self._device.shape[1])
        index = self._xp.asarray(np.asarray(rows, dtype=np.intp))
        return self._device[index, :width]

    def check_invariants(self, rows: dict[int, list[int]]) -> None:
        """Check rows against their owners' block lists (``{row: blocks}``); for tests.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        free = set(self._free_rows)
        require(len(free) == len(self._free_rows), "a table row is on the free list twice")
        require(not free & rows.keys(), f"rows both free and in use: {sorted(free & rows.keys())}")
        require(
            len(free) + len(rows) == self._host.shape[0],
            f"{self._host.shape[0]} table rows but {len(free)} free and {len(rows)} in use",
        )
        device = to_numpy(self._device)
        for row in range(self._host.shape[0]):
            blocks = rows.get(row, [])
            host = self._host[row]
            require(
                host[: len(blocks)].tolist() == blocks,
                f"table row {row} holds {host[: len(blocks)].tolist()}, expected {blocks}",
            )
            require(not host[len(blocks) :].any(), f"table row {row} has non-zero padding entries")
            if row not in self._dirty:
                require(
                    np.array_equal(device[row], host),
                    f"device copy of table row {row} is stale but the row is not marked dirty",
                )

    def _sync(self) -> None:
        if not self._dirty:
            return
        rows = np.fromiter(self._dirty, dtype=np.intp, count=len(self._dirty))
        self._device[self._xp.asarray(rows)] = self._xp.asarray(self._host[rows])
        self._dirty.clear()

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old_rows, old_width = self._host.shape
        rows = rows or old_rows
        width = width or old_width
        host = np.zeros((rows, width), np.int32)
        host[:old_rows, :old_width] = self._host
        self._host = host
        # A resize re-uploads everything once; doubling makes that amortised O(1) per entry.
        self._device = self._xp.array(host)  # a copy: on NumPy, asarray would alias the host
        self._dirty.clear()
        self._free_rows[:0] = range(rows - 1, old_rows - 1, -1)
