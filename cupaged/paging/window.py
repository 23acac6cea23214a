"""The sliding window of a block manager: releasing the blocks that no query can see any more.

With ``window_left = W`` a query at position ``i`` sees the keys at positions ``j >= i - W``
(FlashAttention's and FlashInfer's left window; ``W = -1``: no window). A step that takes a
sequence from ``n0`` to ``n`` tokens has its first query at ``n0``, and every later query sits
further right, so once it starts no query can see a position below ``n0 - W``: every block whose
last position is below it is released (its reference dropped: back to the pool, or with prefix
caching left evictable). ``block_size = 4``, ``W = 5``, a one-token step from 10 to 11 tokens::

    positions   [0 1 2 3] [4 5 6 7] [8 9 10 .]     the query at 10 sees 5 .. 10
    entries        -1         7         3          block 0 ends at 3 < 10 - 5: released

    released = max(0, (n0 - W) // block_size)      leading entries, -1 in the table

The table entry of a released block becomes ``-1``; the length and the logical positions stay,
so ``token pos -> tables[row, pos // block_size]`` holds for every position in the window. A
sequence then holds at most ``ceil((W + 1) / block_size) + 1`` blocks after each one-token step.

:class:`Window` does the release in every call that grows a sequence (``step``, ``reserve``,
``append``), inside its transaction and after the step's plan (``append``: after its writes),
so that no block it releases is taken and written by the same call: a call that fails
(``OutOfBlocksError``, an interrupt) is rolled back, its release with it, and the blocks it
puts back still hold their K/V. A sequence that a step does not grow (0 tokens) releases nothing, so the
decode query at a sequence's last token always finds its window held. Only blocks before it go, never the partly filled last block the
step writes into (its last position is at least ``n0``). With prefix caching the row's pending
full blocks are registered first (their K/V were written by the step before: that is what the
next step tells), so a released block that has a key stays findable as an evictable block.
"""

from __future__ import annotations

import numpy as np

from .._arrays.checks import INT32_MAX, require
from ..variants import check_window_left as check_window_left
from .chains import Chains
from .pool import BlockPool
from .sequences import SequenceTable
from .transaction import Transaction


class Window:
    """Releases, for a table's rows, the blocks before a sliding window, recording undo first.

    Args:
        window_left: ``W >= 0``: keys at ``j >= i - W`` are seen by the query at ``i``.
        table, pool, chains, transaction: the manager's bookkeeping (undo goes to
            ``transaction``).

    Example:
        >>> from cupaged import BlockManager
        >>> manager = BlockManager(8, block_size=4, device="cpu", window_left=5)
        >>> sid = manager.admit(list(range(10))).sid     # 10 tokens: blocks 0, 1, 2
        >>> _ = manager.step(sid)                        # its query at 10 sees 5 .. 10
        >>> manager.block_table(sid), manager.seq_len(sid), manager.num_free_blocks
        ([-1, 1, 2], 11, 6)
    """

    def __init__(
        self,
        window_left: int,
        table: SequenceTable,
        pool: BlockPool,
        chains: Chains,
        transaction: Transaction,
    ) -> None:
        self.window_left = window_left
        # What the int32 lengths are shifted by: a window past every length releases nothing.
        self._shift = min(window_left, INT32_MAX)
        self.table, self.pool, self.chains = table, pool, chains
        self._log = transaction.log  # (the same list for the transaction's life)

    def release(self, rows: np.ndarray, counts: int | np.ndarray, grown: bool = False) -> None:
        """Release the blocks that the steps of ``rows`` (distinct, resident; before their
        growth by ``counts[i]`` tokens, one int for all) leave out of the window: vectorised,
        O(released blocks) beyond a few array operations over the batch. A row that does not
        grow releases nothing (a decode query at its last token still sees what it saw).
        Nothing here fails; every change records its undo first.

        ``grown``: the rows have grown by ``counts`` already (a call after the step's plan and
        writes, so that no block it releases can be taken and written by the same call: a
        rollback puts released blocks back in the table, with their contents). Their pending
        blocks are then registered by :meth:`register_pending` before the plan."""
        if isinstance(counts, int):
            if not counts:
                return
        else:
            rows = rows[counts > 0]
        table, bs = self.table, self.table.block_size
        lens = table.lens[rows]
        if grown:
            lens = lens - (counts if isinstance(counts, int) else counts[counts > 0])
        target = (lens - self._shift) // bs  # negative before the window's first block
        current = table.released[rows]
        due = (target > current).nonzero()[0]
        if not due.size:
            return
        rows, start, stop = rows[due], current[due], target[due]
        counts = stop - start
        if self.chains.enabled and not grown:  # first register what the step before wrote
            self._register(rows)
        # The released entries in the flat table (row * width + column: 1-D gathers and stores).
        width = table.width
        if counts.max() == 1:  # a decode step: at most one block each
            at = rows * width + start
        else:  # each row's run, last block first: a prompt's head stays cached longest
            within = np.arange(counts.sum()) - (counts.cumsum() - counts).repeat(counts)
            at = (rows * width + stop - 1).repeat(counts) - within
        blocks = table.release_leading(rows, start, stop, at)  # (its undo recorded)
        # A block appears twice only if it has two references (forks stepped together).
        repeats = rows.size > 1 and bool(np.count_nonzero(self.pool.refcounts[blocks] > 1))
        self.pool.release(blocks, repeats=repeats)

    def register_pending(self, rows: np.ndarray, counts: int | np.ndarray) -> None:
        """Before a step's plan: register the pending full blocks of the rows that grow (the step
        before wrote their K/V), so that a block :meth:`release` drops after the plan stays
        findable by its key (see the module)."""
        if not self.chains.enabled:
            return
        if not isinstance(counts, int):
            rows = rows[counts > 0]
        elif not counts:
            return
        self._register(rows)

    def _register(self, rows: np.ndarray) -> None:
        pending = rows[self.table.pending[rows]].tolist()
        if pending:
            self.chains.save(pending)
            self.chains.commit(pending)

    def check(self, sid: int, row: int) -> None:
        """A row released no block that a query at its last token sees; ``AssertionError``
        otherwise."""
        table = self.table
        length, released = table.lens.item(row), table.released.item(row)
        most = max(0, (length - 1 - self._shift) // table.block_size) if length else 0
        require(
            released <= most,
            f"sequence {sid} of {length} tokens released {released} blocks, expected at most "
            f"{most} with window_left={self.window_left}",
        )
