"""How a step is planned: the slots to write, the blocks to take and to copy.

:class:`Planner` turns "``counts[i]`` new tokens for sequence ``rows[i]``" into changes of the
table (:mod:`~cupaged.paging.sequences`), the pool (:mod:`~cupaged.paging.pool`) and the prefix
chains (:mod:`~cupaged.paging.chains`), each given to it at construction. It decides what changes;
the owners' verbs make each change and record its undo first (the table's :meth:`grow
<cupaged.paging.sequences.SequenceTable.grow>`). Every plan is all or nothing: whatever can fail
(the pool's capacity, a user ``block_hasher``) runs before the first change.

One planner, vectorised (a fixed number of array operations per step, whatever the batch), with
two fast branches:

- :meth:`Planner.plan`'s decode branch (one token each, nothing shared), the common case: about
  15 array operations, through the flat table and a batch's row offsets; up to ``SMALL_BATCH``
  rows it tests its per-row flags through a list (:func:`_any`), and it skips the work of rows
  that start or fill a block when none does;
- :meth:`Planner.one_token`: ``step(sid)`` of one token without prefix caching or a window,
  under the transaction's claim: into the sequence's own, unshared last block, one store with no
  undo to record; into a new block, one take and one entry, committed as a call is.

They call NumPy's array methods (``x.nonzero()[0]``, ``x.repeat(n)``, ``x.cumsum()``) rather than
the functions of the same name, whose Python wrappers cost as much as the work on these arrays.
``tests/paging/test_step_api.py`` checks the batched plans against the same steps one sequence at a
time on a twin manager after every operation of seeded random walks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import OutOfBlocksError
from .chains import Chains
from .pool import BlockPool, grouped
from .sequences import NO_ENTRIES, SequenceTable
from .transaction import Transaction

NO_SLOTS = np.zeros(0, np.int32)
NO_SLOTS.flags.writeable = False
# Constants as 0-d arrays: an operation of a small array with one costs less than with a
# NumPy or Python scalar (no scalar conversion).
_ONE32 = np.array(1, np.int32)
NO_ROWS = NO_ENTRIES
# Up to this many rows the decode branch tests its flags through a list: a few array operations
# cost more than a short Python loop (the W1 and W3b workloads of benches/bench_block_manager.py
# decide it).
SMALL_BATCH = 16

Plan = tuple[np.ndarray, np.ndarray, np.ndarray]  # (slots, copy_src, copy_dst), host int32


def _any(flags: np.ndarray) -> bool:
    """Whether any of a step's bool flags is set: for a few rows, a lookup in a list costs less
    than counting."""
    return True in flags.tolist() if flags.size <= SMALL_BATCH else bool(np.count_nonzero(flags))


class Planner:
    """Plans steps over a table, a pool and prefix chains, inside a transaction."""

    def __init__(
        self, table: SequenceTable, pool: BlockPool, chains: Chains, transaction: Transaction
    ) -> None:
        self.table, self.pool, self.chains = table, pool, chains
        self.transaction = transaction
        self.block_size = table.block_size
        self.offsets = np.arange(table.block_size, dtype=np.int32)  # slot offsets in a block
        # The block size (and one less) as the lengths' type, 0-d: arithmetic on an int32
        # array with a Python int converts the int at every operation.
        self._bs32 = np.array(table.block_size, np.int32)
        self._bs_less1 = np.array(table.block_size - 1, np.int32)
        self._bs_less1p = np.array(table.block_size - 1, np.intp)
        # A power-of-two block size takes offsets with a mask, cheaper than a remainder.
        power_of_two = not table.block_size & (table.block_size - 1)
        self._mask = self._bs_less1 if power_of_two else None
        # The one-store path: no chain to extend, no window to move.
        self._one_store = not chains.enabled and table.window_left < 0

    def plan(
        self,
        rows: np.ndarray,
        counts: int | np.ndarray,
        tokens: np.ndarray | list[np.ndarray] | None,
        what: str | None,
        bases: np.ndarray | None = None,
    ) -> Plan:
        """Allocate, copy-on-write and slot-map ``counts`` new tokens for each of ``rows``.

        ``bases`` is ``rows * width`` when the caller keeps it (a batch). Raises
        :class:`OutOfBlocksError` (``what`` names the call) before any change.
        """
        if type(counts) is int and counts == 1:  # the decode branch, unless a row is shared
            table = self.table
            if rows.size <= SMALL_BATCH:  # a few rows' flags: looked up in lists
                if True not in table.shared[rows].tolist():
                    settled = not self.chains.enabled or True not in table.pending[rows].tolist()
                    return self._decode(rows, tokens, what, bases, settled)
            elif not np.count_nonzero(table.shared) or not np.count_nonzero(table.shared[rows]):
                return self._decode(rows, tokens, what, bases)
        return self._plan(rows, counts, tokens, what)

    def one_token(self, sid: Any, tokens: Any) -> int | None:
        """``plan`` of one token for sequence ``sid`` without prefix caching or a window, under
        the transaction's claim: its slot. Into the sequence's own, unshared last block, one
        store that needs no undo (an interrupt lands before or after it); into a new block, the
        block's take and the entry, committed here as a call would be. ``None`` when
        :meth:`plan` must run inside a call (a shared block, no free block, prefix caching, a
        window, tokens to check, an unknown or swapped id, another call inside)."""
        if not self._one_store or tokens is not None or type(sid) is not int:
            return None
        transaction = self.transaction
        if not transaction.try_claim():
            return None  # another call is inside: the full path refuses it
        try:  # every read and the store under the claim: another thread's call never interleaves
            table, bs = self.table, self.block_size
            row = table.rows.get(sid)
            if row is None or table.live.item(row) != sid:
                return None
            length = table.lens.item(row)
            offset = length % bs
            if offset:
                if table.shared.item(row):
                    return None
                slot = table.tables.item(row, length // bs) * bs + offset
                table.grow_one(row, length)
                return slot
            if not self.pool.num_free:
                return None  # the full path raises OutOfBlocksError
            block = self.pool.take(1).item(0)  # (each change records its undo first)
            table.grow_one(row, length, block)
            transaction.log.clear()  # writes: the commit, one C call in this frame (as atomic's)
            return block * bs
        except BaseException:
            transaction.abort()  # (what was recorded: undone)
            raise
        finally:
            transaction.leave()

    # ------------------------------------------------------------------------------ any step

    def _plan(
        self,
        rows: np.ndarray,
        counts: int | np.ndarray,
        tokens: np.ndarray | list[np.ndarray] | None,
        what: str | None,
    ) -> Plan:
        """:meth:`plan` of any step, copy-on-write included, in a fixed number of array
        operations. Table entries are addressed in the flat table (``row * width + column``):
        1-D gathers and stores, cheaper than 2-D ones on the arrays of a step. Up to
        ``SMALL_BATCH`` rows its sums and maxima are taken over lists (cheaper than reductions)."""
        table, pool, chains = self.table, self.pool, self.chains
        bs, bs32 = self.block_size, self._bs32
        small = rows.size <= SMALL_BATCH
        lens = table.lens[rows]
        width = table.width
        base = rows * width  # each row's first flat entry (at this width)
        uniform = isinstance(counts, int)
        ends = lens + counts
        writing = None if uniform else counts > 0  # (None: every row writes, or none does)
        # Blocks held before and after (cdiv of non-negative lengths), as entry offsets (intp):
        # they index, repeat and add to ``base`` without a cast each.
        held = (lens + self._bs_less1p) // bs32
        after = (ends + self._bs_less1p) // bs32
        # Rows that write into a last block that may be shared: none, mostly (one check).
        flagged = None
        if not uniform or counts:
            flagged = table.shared[rows]
            if writing is not None:
                flagged &= writing
            if not (True in flagged.tolist() if small else np.count_nonzero(flagged)):
                flagged = None  # (none to copy, none to unshare)
        copies = None if flagged is None else self._copies(flagged, base + held, small)
        need = after - held if copies is None else after - held + copies[0]
        total = sum(need.tolist()) if small else int(need.sum())
        if total > pool.num_free:
            if what is None:
                tokens_in = counts * rows.size if uniform else int(counts.sum())
                what = f"reserving {tokens_in} token(s) for {rows.size} sequence(s)"
            raise OutOfBlocksError(total, pool.num_free, what)
        registering = chains.enabled and tokens is not None
        keys = chains.keys(rows, lens, counts, tokens) if registering else None

        # -- from here on nothing fails: each change records its undo first
        if chains.enabled:
            chains.save(rows.tolist())
            new = chains.commit_and_take(rows, lambda: need, total)  # (their last step's K/V)
        else:
            new = pool.take(total) if total else None
        src = dst = NO_SLOTS
        at = NO_ENTRIES
        if total:
            # The rows' new widest, and the spare column.
            table.make_room(max(after.tolist()) if small else int(after.max()))
            if table.width != width:  # (widened)
                width = table.width
                base = rows * width
            # Each row's entries from its copied last block (if any) on, in the order the blocks
            # were taken: one run per row, the new blocks in order.
            first = base + (held if copies is None else held - copies[0])
            ahead = None  # blocks taken for the rows before (one row: none)
            if rows.size > 1:
                ahead = need.cumsum() - need
                first -= ahead
            at = first.repeat(need) + np.arange(total)
            if copies is not None:  # each copying row's run starts at its copied entry
                copying = copies[0].nonzero()[0]
                taken = copying if ahead is None else ahead[copying]
                src, dst = table.flat[at[taken]], new[taken].astype(np.int32)
        unshare = None  # writing rows flagged shared: each writer's last block is its own after
        if flagged is not None:
            unshare = rows if uniform else rows[writing]
        table.grow(rows, lens, ends, at, new, unshare)
        if table.width != width:  # (widened for the spare column)
            width = table.width
            base = rows * width
        if copies is not None:  # never the last reference (see _copies): none goes to the pool
            pool.add_refs(copies[1], -copies[2])
        flat = table.flat
        offset = None  # (of one token each: where it goes in its block)
        if uniform and counts == 1:
            offset = lens % bs32
            slots = flat[base + lens // bs32] * bs32 + offset
        elif uniform and not counts:
            slots = NO_SLOTS
        elif uniform:  # [rows, counts] positions
            steps = self.offsets[:counts] if counts <= bs else np.arange(counts, dtype=np.int32)
            pos = lens[:, None] + steps
            slots = flat[pos // bs32 + base[:, None]]  # (two operations beat one divmod)
            slots *= bs32
            slots += pos % bs32
            slots = slots.reshape(-1)
        else:
            ahead = counts.cumsum() - counts  # tokens of the rows before
            pos = (lens - ahead).repeat(counts) + np.arange(int(ahead[-1] + counts[-1]))
            first = base.repeat(counts)
            slots = (flat[first + pos // bs] * bs + pos % bs).astype(np.int32)
        if registering:
            chains.extend(rows, offset, counts, tokens, keys)
        return slots, src, dst

    def _decode(
        self,
        rows: np.ndarray,
        tokens: Any,
        what: str | None,
        bases: np.ndarray | None,
        settled: bool = False,
    ) -> Plan:
        """:meth:`plan` of one token per sequence, nothing shared: about 15 array operations,
        entries read and written in the flat table (``bases``: ``rows * width``; ``settled``:
        no row is pending either)."""
        table, bs, pool, chains = self.table, self.block_size, self.pool, self.chains
        bs32 = self._bs32
        lens = table.lens[rows]
        offset = lens % bs32 if self._mask is None else lens & self._mask
        # The entry of the block the token goes to (0, padding, where offset is 0: a new block;
        # the spare column keeps it inside the table).
        index = (rows * table.width if bases is None else bases) + lens // bs32
        # Rows whose token starts a block (they take one) or fills one (its key is hashed):
        # mostly none, one step in block_size has some. A few rows' offsets are looked up in a
        # list, cheaper than an array comparison each.
        if rows.size <= SMALL_BATCH:
            offsets = offset.tolist()
            crossing = (offset == 0).nonzero()[0] if 0 in offsets else NO_ROWS
            may_fill = bs - 1 in offsets
        else:
            crossing, may_fill = (offset == 0).nonzero()[0], True
        if crossing.size and crossing.size > pool.num_free:
            what = what or f"reserving {rows.size} token(s) for {rows.size} sequence(s)"
            raise OutOfBlocksError(crossing.size, pool.num_free, what)
        registering = chains.enabled and tokens is not None
        # The chains this step commits (pending rows) or extends (rows that fill a block).
        touched = pending = None
        if chains.enabled and settled:  # (may_fill: some row fills)
            touched = offset == bs - 1 if registering and may_fill else None
        elif chains.enabled:
            pending = table.pending[rows]
            touched = pending | (offset == bs - 1) if registering and may_fill else pending
            if not _any(touched):
                touched = None
        filling = touched is not None and registering and may_fill
        keys = chains.keys(rows, lens, 1, tokens, touched if settled else None) if filling else []

        # -- from here on nothing fails: each change records its undo first
        if touched is not None:
            chains.save(rows[touched].tolist())
            if pending is not None and np.count_nonzero(pending):  # their last step's K/V
                new = chains.commit_and_take(rows, lambda: offset == 0, crossing.size)
            elif crossing.size:
                new = pool.take(crossing.size)
        elif crossing.size:
            new = pool.take(crossing.size)
        blocks = table.flat[index]  # (before the step: at the width the step planned)
        if crossing.size:
            at = index[crossing]
            blocks[crossing] = new
            table.grow(rows, lens, lens + _ONE32, at, new)
        else:
            table.grow(rows, lens, lens + _ONE32)
        if registering:  # the new ids go to the tails; the filled blocks' keys to their chains
            chains.extend(rows, offset, 1, tokens, keys)
        blocks *= bs32
        blocks += offset
        return blocks, NO_SLOTS, NO_SLOTS

    def _copies(
        self, flagged: np.ndarray, ends: np.ndarray, small: bool
    ) -> tuple[np.ndarray, Any, Any] | None:
        """Per row, 1 where the write lands in a partly filled last block that another sequence
        still holds (copy it first), else 0, with the copied blocks and how many rows copy each
        (one block: two ints; ``flagged``: the writing rows whose ``shared`` flag is set, some;
        ``ends``: each row's flat entry past its last block); ``None`` when no row copies.

        Forked siblings of one batch that share a block are counted exactly: with ``r``
        references, the first ``r - 1`` writers (in batch order) copy, and a last writer from the
        batch writes in place once the others have let go.
        """
        table = self.table
        partial = flagged.nonzero()[0]  # (a superset of the rows whose last block is shared)
        refcount = self.pool.refcounts
        if self.pool.num_held:  # copies still to read some blocks hold references: no sharers
            refcount = refcount - self.pool.held_refs
        # (A flagged row's last block is partly filled: a write clears the flag.)
        last = table.flat[ends[partial] - 1]
        refs = refcount[last]
        shared = refs > 1
        sharing = np.count_nonzero(shared)
        if not sharing:
            return None
        if sharing < partial.size:
            partial, last, refs = partial[shared], last[shared], refs[shared]
        copy = np.zeros(flagged.size, np.int64)
        if small:
            one_block = len(set(last.tolist())) == 1
        else:
            one_block = last.min() == last.max()
        if one_block:  # mostly: forks of one sequence, one block
            holders, writers = refs.item(0), last.size
            # A holder outside the batch stays: all copy; else the first r - 1 writers.
            copying = writers if holders > writers else holders - 1
            copy[partial[:copying]] = 1
            return copy, last.item(0), copying
        blocks, writers = grouped(last)
        if np.count_nonzero(writers < refcount[blocks]) == blocks.size:
            copy[partial] = 1  # a holder outside the batch stays for every block: all copy
            return copy, blocks.astype(np.intp), writers
        order = last.argsort(kind="stable")
        ranked = last[order]
        starts = np.concatenate(([True], ranked[1:] != ranked[:-1])).nonzero()[0]
        runs = np.concatenate((starts[1:], [order.size])) - starts
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size) - starts.repeat(runs)
        copying = rank < refs - 1
        if not np.count_nonzero(copying):
            return None
        copy[partial[copying]] = 1
        blocks, times = grouped(last[copying].astype(np.intp))
        return copy, blocks, times
