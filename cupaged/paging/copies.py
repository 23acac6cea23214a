"""Copy-on-write copies left to apply: which pairs, and the holds that keep their sources.

A step made with ``hold_copies=True`` (``PagedCache.step(..., apply_copies=False)``) leaves its
copy-on-write pairs to the caller. Until they are applied, each source block must keep the bytes
the copy reads, whatever the sequences do meanwhile: this is bookkeeping of block ids, so it is
the manager's (the pool's holds, the table's rows), and the K/V bytes stay with whoever owns the
arrays. :class:`~cupaged.BlockManager` composes one :class:`DeferredCopies`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._util import cdiv
from ..errors import CupagedError
from .pool import BlockPool, grouped
from .sequences import SequenceTable
from .transaction import Transaction


class DeferredCopies:
    """Copy-on-write copies a step left to the caller (``step(..., hold_copies=True)``), by
    destination: the only pairs :meth:`BlockManager.release_copies
    <cupaged.BlockManager.release_copies>` (and :meth:`PagedCache.apply_copies
    <cupaged.PagedCache.apply_copies>`) take. Any other destination
    may hold another sequence's written tokens (or a cached prefix), which a copy would
    overwrite.

    Each pair left to apply holds one reference to its source block (``pool.hold``: a reference
    that is no sharer, so the block's table holder still writes in place), so that the block
    keeps the bytes the copy must read whatever happens before it is applied:
    the sequences that share it freed, swapped out or moved past it by their window, its block
    can go to no other sequence. The hold goes when the pair is applied, or when the sequence
    it copies for is freed (the copy is moot then). A sequence with a copy left to apply is
    not swapped out (its block would travel without the bytes the copy brings)::

        step(..., hold_copies=True)     pair src -> dst left: src held (+1), dst in the row
        free(every sharer of src)       src stays in use: no other sequence takes it
        release_copies(src, dst)        the pair taken, the hold let go (its bytes copied in
                                        the same call: PagedCache.apply_copies)

    Args:
        table, pool, transaction: the manager's bookkeeping (undo goes to ``transaction``).
    """

    def __init__(self, table: SequenceTable, pool: BlockPool, transaction: Transaction) -> None:
        self.table, self.pool = table, pool
        self._log = transaction.log
        self._left: dict[int, tuple[int, int, int]] = {}  # dst -> (src, sid, column)

    def __len__(self) -> int:
        return len(self._left)

    def leave(self, src: np.ndarray, dst: np.ndarray, rows: np.ndarray) -> None:
        """Remember a step's pairs (``rows``: the step's), each with the sequence and column its
        destination serves, and hold their sources."""
        table, left = self.table, self._left
        held = cdiv(table.lens[rows], table.block_size)
        found = self._in_last_blocks(src, dst, rows, held)
        if found is None:
            # Each destination's one holder (refcount 1), a row of the step: one comparison over
            # the columns that hold blocks (the padding past them is 0, which is a block id too).
            holding = np.arange(table.width) < held[:, None]
            matches = (table.tables[rows] == dst[:, None, None]) & holding
            pair, at, columns = matches.nonzero()
            sids = table.sids[rows[at]].tolist()
            found = {
                dst.item(j): (src.item(j), sid, column)
                for j, sid, column in zip(pair.tolist(), sids, columns.tolist(), strict=True)
            }
        # A destination left before and never applied went back to the pool since (its
        # sequence's window released it) and came back here: that old pair's hold goes.
        stale = [left[d][0] for d in found if d in left]
        self._log.append((self._restore, {d: left.get(d) for d in found}))
        left.update(found)
        first = src.item(0)
        if not np.count_nonzero(src != first):  # mostly: one source (forks of one sequence)
            self.pool.hold(first, src.size)
        else:
            self.pool.hold(*grouped(src.astype(np.intp)))
        if stale:
            self.let_go(stale)

    def _in_last_blocks(
        self, src: np.ndarray, dst: np.ndarray, rows: np.ndarray, held: np.ndarray
    ) -> dict[int, tuple[int, int, int]] | None:
        """:meth:`leave`'s pairs when every destination is the last block of a row of the step
        (a copied block takes the row's first new token: the last one when a step adds one
        token each), else ``None``."""
        table = self.table
        columns = held - 1
        last = table.flat[rows * table.width + columns].tolist()  # (a row that holds none:
        # the entry before its row, unused)
        held_list = held.tolist()
        where = {block: i for i, block in enumerate(last) if held_list[i]}
        targets = dst.tolist()
        at = [where.get(d) for d in targets]
        if None in at:
            return None
        sids, columns = table.sids[rows].tolist(), columns.tolist()
        return {
            d: (s, sids[i], columns[i]) for d, s, i in zip(targets, src.tolist(), at, strict=True)
        }

    def pending(self) -> tuple[np.ndarray, np.ndarray]:
        """``(src, dst)``: ``[num_pairs]`` int32 host arrays of every pair left to apply that
        can still be applied, in the order the steps left them."""
        pairs = [(entry[0], d) for d, entry in self._left.items() if self._applicable(d, entry)]
        if not pairs:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        src, dst = np.array(pairs, np.int32).T
        return src.copy(), dst.copy()

    def take(self, src: list[int], dst: list[int]) -> None:
        """Check that every pair is one left to apply, and forget them (they are applied now:
        :meth:`let_go` their sources once copied).

        Raises:
            ValueError: naming the first pair that is not.
        """
        left = self._left
        if len(set(dst)) != len(dst):  # each pair is left once: a repeat is not one of them
            repeated = next(d for i, d in enumerate(dst) if d in dst[:i])
            raise ValueError(
                f"expected copy-on-write pairs that a step(..., apply_copies=False) of this "
                f"cache (hold_copies=True of this manager) left to apply, got destination {repeated} twice"
            )
        for s, d in zip(src, dst, strict=True):
            entry = left.get(d)
            if entry is None or entry[0] != s or not self._applicable(d, entry):
                raise ValueError(
                    f"expected copy-on-write pairs that a step(..., apply_copies=False) of "
                    f"this cache (hold_copies=True of this manager) left to apply, got {s} -> {d}"
                )
        self._log.append((self._restore, {d: left[d] for d in dst}))
        for d in dst:
            del left[d]

    def let_go(self, src: list[int]) -> None:
        """Drop the holds of applied pairs' sources (a source no sequence holds any more goes
        back to the pool)."""
        if src:
            self.pool.let_go(np.array(src, np.intp))

    def forget(self, sids: list[int]) -> None:
        """Drop the pairs left for sequences about to be freed, and their holds."""
        gone = set(sids)
        dropped = {d: entry for d, entry in self._left.items() if entry[1] in gone}
        if dropped:
            self._log.append((self._left.update, dropped))
            for d in dropped:
                del self._left[d]
            self.let_go([entry[0] for entry in dropped.values()])

    def refuse_swap(self, sid: int) -> None:
        """Refuse to swap out ``sid`` while a copy for it is left to apply.

        Raises:
            CupagedError: naming the pairs to apply first.
        """
        pairs = [(e[0], d) for d, e in self._left.items() if e[1] == sid]
        if pairs:
            shown = ", ".join(f"{s} -> {d}" for s, d in pairs)
            raise CupagedError(
                f"expected sequence {sid} with no copy-on-write copy left to apply before "
                f"swap_out (its blocks would travel without the copied bytes), got {shown}: "
                f"call apply_copies first (release_copies on a BlockManager)"
            )

    def holds(self) -> dict[int, int]:
        """References the pairs hold, by source block (for the invariant checks)."""
        counts: dict[int, int] = {}
        for src, _, _ in self._left.values():
            counts[src] = counts.get(src, 0) + 1
        return counts

    def _applicable(self, d: int, entry: tuple[int, int, int]) -> bool:
        """Whether ``d`` is still the block its sequence's row holds at the pair's column."""
        table = self.table
        row = table.rows.get(entry[1])
        return (
            row is not None
            and table.live.item(row) == entry[1]
            and entry[2] < table.width
            and table.tables.item(row, entry[2]) == d
        )

    def _restore(self, saved: dict[int, Any]) -> None:
        for d, entry in saved.items():
            if entry is None:
                self._left.pop(d, None)
            else:
                self._left[d] = entry
