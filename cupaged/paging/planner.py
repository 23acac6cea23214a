"""How a step is planned: the slots to write, the blocks to take and to copy.

:class:`Planner` turns "``counts[i]`` new tokens for sequence ``rows[i]``" into changes of the
table (:mod:`~cupaged.paging.sequences`), the pool (:mod:`~cupaged.paging.pool`) and the prefix
chains (:mod:`~cupaged.paging.chains`), each given to it at construction. Every plan is all or
nothing: whatever can fail (the pool's capacity, a user ``block_hasher``) runs before the first
change, and each change records its undo in the transaction first.

Two paths compute the same thing, each where it is cheapest (a NumPy call on the short arrays of
a step costs more than a Python iteration), and :meth:`Planner.plan` picks:

- :meth:`Planner.plan_rows`: row by row in scalar arithmetic (one sequence, a small batch, a few
  forks sharing a block);
- :meth:`Planner.plan_batch`: any batch in a fixed number of array operations; its decode step
  (one token each for more than ``SMALL_DECODE`` rows, nothing shared), the common case, goes
  straight to ``_decode``, the fewest operations, through the flat table and a batch's row
  offsets. Up to ``SMALL_BATCH`` rows ``_decode`` tests its per-row flags through a list
  (:func:`_any`), and it skips the work of rows that start or fill a block when none does.

They call NumPy's array methods (``x.nonzero()[0]``, ``x.repeat(n)``, ``x.cumsum()``) rather than
the functions of the same name, whose Python wrappers cost as much as the work on these arrays.
``tests/test_step_api.py`` checks the two paths against each other on twin managers after every
operation of seeded random walks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._util import cdiv
from ..errors import OutOfBlocksError
from .chains import Chains
from .pool import BlockPool, grouped
from .sequences import SHARED_BITS, SequenceTable
from .transaction import Transaction

NO_SLOTS = np.zeros(0, np.int32)
NO_SLOTS.flags.writeable = False
_ONE32 = np.int32(1)
NO_ROWS = np.zeros(0, np.intp)
NO_ROWS.flags.writeable = False
# Below these batch sizes a step plans row by row, and up to SMALL_BATCH rows the decode step
# tests its flags through a list: a few dozen array operations cost more than a short Python loop
# (the W1 and W3b workloads of benches/bench_block_manager.py decide them).
SMALL_BATCH = 16
SMALL_DECODE = 4

Plan = tuple[np.ndarray, np.ndarray, np.ndarray]  # (slots, copy_src, copy_dst), host int32


def _any(flags: np.ndarray) -> bool:
    """Whether any of a step's bool flags is set: for a few rows, a lookup in a list costs less
    than counting."""
    return True in flags.tolist() if flags.size <= SMALL_BATCH else bool(np.count_nonzero(flags))


class Planner:
    """Plans steps over a table, a pool and prefix chains, recording undo in a transaction."""

    def __init__(
        self, table: SequenceTable, pool: BlockPool, chains: Chains, transaction: Transaction
    ) -> None:
        self.table, self.pool, self.chains = table, pool, chains
        self.transaction = transaction
        self._log = transaction.log  # (the same list for the transaction's life)
        self.block_size = table.block_size
        self.offsets = np.arange(table.block_size, dtype=np.int32)  # slot offsets in a block
        # The block size as the lengths' type: arithmetic on an int32 array with a Python int
        # converts the int at every operation.
        self._bs32 = np.int32(table.block_size)
        # A power-of-two block size takes offsets with a mask, cheaper than a remainder.
        power_of_two = not table.block_size & (table.block_size - 1)
        self._mask = np.int32(table.block_size - 1) if power_of_two else None

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
        if type(counts) is int and counts == 1 and rows.size > SMALL_DECODE:
            # Mostly nothing shared (the global count first: no gather then): the decode step.
            table = self.table
            if rows.size <= SMALL_BATCH:  # both flags of a few rows in one gather
                flags = table.either[rows].tolist()
                if not any(flags):
                    return self._decode(rows, tokens, what, bases, settled=True)
                if not any(flag & SHARED_BITS for flag in flags):  # pending ones only
                    return self._decode(rows, tokens, what, bases)
                return self.plan_rows(rows.tolist(), [1] * rows.size, tokens, what)
            shared = table.shared
            if not np.count_nonzero(shared) or not _any(shared[rows]):
                return self._decode(rows, tokens, what, bases)
            return self.plan_batch(rows, counts, tokens, what)
        if rows.size > SMALL_BATCH:
            return self.plan_batch(rows, counts, tokens, what)
        per_row = [counts] * rows.size if isinstance(counts, int) else counts.tolist()
        return self.plan_rows(rows.tolist(), per_row, tokens, what)

    def one_token(self, row: int, sid: int) -> int | None:
        """The slot of one token for ``sid`` in its own, unshared last block: a single store
        that needs no undo (an interrupt lands before or after it). ``None`` when the general
        path must run (a new or shared block). Call it holding the transaction's claim."""
        table, bs = self.table, self.block_size
        length = table.lens.item(row)
        offset = length % bs
        if not offset or table.live.item(row) != sid or table.shared.item(row):
            return None
        slot = table.tables.item(row, length // bs) * bs + offset
        table.lens[row] = length + 1
        return slot

    # ------------------------------------------------------------------------------ row by row

    def plan_rows(self, rows: list[int], counts: list[int], tokens: Any, what: str | None) -> Plan:
        """:meth:`plan` row by row in scalar arithmetic: one sequence or a small batch."""
        table, bs, pool, chains = self.table, self.block_size, self.pool, self.chains
        refcount, lens, tables = pool.refcounts, table.lens, table.tables
        holds = pool.held_refs if pool.num_held else None  # references that share nothing
        plans = []
        released: dict[int, int] = {}  # copy-on-write references that earlier rows drop
        total = widest = 0
        for row, n in zip(rows, counts, strict=True):
            length = lens.item(row)
            held, after = cdiv(length, bs), cdiv(length + n, bs)
            copy = last = 0
            if n and length % bs:
                last = tables.item(row, held - 1)
                sharers = refcount.item(last) - (0 if holds is None else holds.item(last))
                if sharers - released.get(last, 0) > 1:  # another holder stays: copy
                    copy, released[last] = 1, released.get(last, 0) + 1
            plans.append((row, n, length, held, after, copy, last))
            total += after - held + copy
            widest = max(widest, after)
        if total > pool.num_free:
            what = what or f"reserving {sum(counts)} token(s) for {len(rows)} sequence(s)"
            raise OutOfBlocksError(total, pool.num_free, what)
        registering = chains.enabled and tokens is not None
        keys = []
        if registering:  # hashed before any change: a user block_hasher may raise
            for i, (row, n, length, *_) in enumerate(plans):
                if n and length % bs + n >= bs:  # it fills a block
                    ids = tokens[i : i + 1] if isinstance(tokens, np.ndarray) else tokens[i]
                    keys += chains.keys(np.array([row]), np.array([length]), np.array([n]), [ids])

        # -- from here on nothing fails: each change records its undo first
        row_array = np.array(rows, np.intp)
        saved = (table.lens[row_array], table.shared[row_array])
        self._log.append((self._undo_rows, plans, saved, table.tail[row_array]))
        if chains.enabled:  # the chains this step commits or extends
            chains.save([row for row in rows if table.pending.item(row)] + [k[0] for k in keys])
        new_blocks = chains.commit_and_take(
            rows, lambda: [after - held + copy for _, _, _, held, after, copy, _ in plans], total
        )  # this step of theirs: the last step's K/V were written
        if total:
            new = new_blocks.tolist()
            table.ensure_width(widest + 1)  # one spare column: see plan_batch
            tables = table.tables  # maybe grown
        taken, sources, copies, slots = 0, [], [], []
        # Each row's written blocks, and where its slots start in their slots less the tokens of
        # the rows before it (not needed when every row takes one token: a slot each).
        runs, shifts, segment, ahead = [], [], 0, 0
        one_each = counts.count(1) == len(counts)
        for row, n, length, held, after, copy, _ in plans:
            if after - held + copy:
                if copy:
                    sources.append(tables.item(row, held - 1))
                    copies.append(new[taken])
                    tables[row, held - 1] = new[taken]
                if after > held:
                    tables[row, held:after] = new_blocks[taken + copy : taken + copy + after - held]
                taken += after - held + copy
                table.version[row] = table.clock
            if one_each:
                slots.append(tables.item(row, length // bs) * bs + length % bs)
            else:
                first = length // bs
                runs.append(tables[row, first:after])
                shifts.append(segment + length - first * bs - ahead)
                segment += (after - first) * bs
                ahead += n
            lens[row] = length + n
            if n:
                table.shared[row] = False  # copied, or the last holder: the last block is its own
        if registering:
            self._store_tails(plans, tokens, keys)
        src = dst = NO_SLOTS
        if sources:
            src, dst = np.array(sources, np.int32), np.array(copies, np.int32)
            # Never a last reference (see `released`): no block goes back to the pool.
            if len(released) == 1:  # forks of one sequence: one source
                ((block, times),) = released.items()
                pool.add_refs(block, -times)
            else:
                pool.add_refs(np.array(list(released), np.intp), -np.array(list(released.values())))
        if one_each:
            return np.array(slots, np.int32), src, dst
        # Every slot of every row's written blocks, then each row's n tokens cut out of its
        # stretch: a handful of array operations for the whole batch.
        every = (np.concatenate(runs)[:, None] * bs + self.offsets).reshape(-1)
        index = np.array(shifts).repeat(counts)  # (the method: np.repeat of a list is slower)
        index += np.arange(ahead)
        return every[index], src, dst

    def _store_tails(self, plans: list[tuple], tokens: Any, keys: list) -> None:
        """The new tokens of rows that fill no block go into their tails; the others' tails and
        chains come from their keys."""
        table, bs = self.table, self.block_size
        filling = {entry[0] for entry in keys}
        for i, (row, n, length, *_) in enumerate(plans):
            if n and row not in filling:
                offset = length % bs
                ids = tokens[i : i + 1] if isinstance(tokens, np.ndarray) else tokens[i]
                table.tail[row, offset : offset + n] = ids
        if keys:
            self.chains.add_keys(keys)

    def _undo_rows(self, plans: list[tuple], saved: tuple, tails: np.ndarray) -> None:
        """Undo of :meth:`plan_rows`: the entries it filled were padding, or the copied block."""
        table = self.table
        for row, _, _, held, after, copy, last in plans:
            table.tables[row, held:after] = 0
            if copy:
                table.tables[row, held - 1] = last
        rows = np.array([plan[0] for plan in plans], np.intp)
        table.lens[rows], table.shared[rows] = saved
        table.tail[rows] = tails

    # ------------------------------------------------------------------------------ vectorised

    def plan_batch(
        self,
        rows: np.ndarray,
        counts: int | np.ndarray,
        tokens: np.ndarray | list[np.ndarray] | None,
        what: str | None,
    ) -> Plan:
        """:meth:`plan` for any batch, fully vectorised, copy-on-write included (a decode step
        that shares nothing takes :meth:`_decode`).

        Table entries are addressed in the flat table (``row * width + column``): 1-D gathers
        and stores, cheaper than 2-D ones on the arrays of a step.
        """
        table = self.table
        bs, chains = self.block_size, self.chains
        lens = table.lens[rows]
        uniform = isinstance(counts, int)
        ends = lens + counts
        if uniform:
            writing = np.ones(rows.size, bool) if counts else np.zeros(rows.size, bool)
        else:
            writing = counts > 0
        held = cdiv(lens, bs)
        grow = cdiv(ends, bs) - held
        copy = self._copies(rows, lens, held, writing)
        need = grow + copy if copy is not None else grow
        total = int(need.sum())
        if total > self.pool.num_free:
            if what is None:
                tokens_in = counts * rows.size if uniform else int(counts.sum())
                what = f"reserving {tokens_in} token(s) for {rows.size} sequence(s)"
            raise OutOfBlocksError(total, self.pool.num_free, what)
        registering = chains.enabled and tokens is not None
        keys = chains.keys(rows, lens, counts, tokens) if registering else None

        # -- from here on nothing fails: each change records its undo first
        self._log.append((table.put, rows, table.snapshot(rows)))
        chains.save(rows.tolist())
        new = chains.commit_and_take(rows, lambda: need, total)  # (see plan_rows)
        src = dst = NO_SLOTS
        if total:
            table.ensure_width(int((held + grow).max()) + 1)  # one spare column: see _decode
            changed = need.nonzero()[0]
            table.touch(rows[changed])
            base = rows * table.width
            if copy is None and grow.max() == 1:  # at most one block each
                table.flat[base[changed] + held[changed]] = new
            else:
                src, dst = self._apply_growth(base, held, grow, copy, need, new)
        flat = table.flat
        offset = None  # (of one token each: where it goes in its block)
        if uniform and counts == 1:
            offset = lens % bs
            slots = flat[rows * table.width + lens // bs] * bs + offset
        elif uniform and not counts:
            slots = NO_SLOTS
        else:
            if uniform:
                pos = lens.repeat(counts) + np.arange(counts * rows.size) % counts
            else:
                ahead = counts.cumsum() - counts  # tokens of the rows before
                pos = (lens - ahead).repeat(counts) + np.arange(int(ahead[-1] + counts[-1]))
            first = (rows * table.width).repeat(counts)
            slots = flat[first + pos // bs] * bs + pos % bs
        table.lens[rows] = ends
        table.shared[rows[writing]] = False  # each writer's last block is its own now
        if registering:
            chains.extend(rows, offset, counts, tokens, keys)
        return slots.astype(np.int32, copy=False), src, dst

    def _decode(
        self,
        rows: np.ndarray,
        tokens: Any,
        what: str | None,
        bases: np.ndarray | None,
        settled: bool = False,
    ) -> Plan:
        """:meth:`plan_batch` of one token per sequence, nothing shared: about 15 array
        operations, entries read and written in the flat table (``bases``: ``rows * width``;
        ``settled``: no row is pending either)."""
        table, bs, pool, chains = self.table, self.block_size, self.pool, self.chains
        bs32 = self._bs32
        lens = table.lens[rows]
        offset = lens % bs32 if self._mask is None else lens & self._mask
        width = table.width
        # The entry of the block the token goes to (0, padding, where offset is 0: a new block).
        index = (rows * width if bases is None else bases) + lens // bs32
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
        at = index[crossing] if crossing.size else NO_ROWS
        self._log.append((self._undo_decode, rows, lens, at, width))
        if touched is not None:
            chains.save(rows[touched].tolist())
            if pending is not None and np.count_nonzero(pending):  # their last step's K/V: written
                new = chains.commit_and_take(rows, lambda: offset == 0, crossing.size)
            elif crossing.size:
                new = pool.take(crossing.size)
        elif crossing.size:
            new = pool.take(crossing.size)
        if crossing.size:
            table.flat[at] = new
            table.version[rows[crossing]] = table.clock
        blocks = table.flat[index]  # (after the new entries: at the width the step planned)
        table.lens[rows] = lens + _ONE32
        if crossing.size:  # each crossing row holds one block more: keep a spare column
            table.held_bound += 1
            if table.held_bound + 1 > width:
                table.held_bound = 0  # the true maximum over all rows, then grow if needed
                table.ensure_width(cdiv(int(table.lens.max()), bs) + 1)
        if registering:  # the new ids go to the tails; the filled blocks' keys to their chains
            chains.extend(rows, offset, 1, tokens, keys)
        blocks *= bs32
        blocks += offset
        return blocks, NO_SLOTS, NO_SLOTS

    def _undo_decode(self, rows: np.ndarray, lens: np.ndarray, at: np.ndarray, width: int) -> None:
        table = self.table
        # The entries a decode step fills were padding (flat indices at the step's width).
        table.tables[at // width, at % width] = 0
        table.lens[rows] = lens
        table.touch(rows)

    def _copies(
        self, rows: np.ndarray, lens: np.ndarray, held: np.ndarray, writing: np.ndarray
    ) -> np.ndarray | None:
        """Per row, 1 where the write lands in a partly filled last block that another sequence
        still holds (copy it first), else 0; ``None`` when no row needs a copy.

        Forked siblings of one batch that share a block are counted exactly: with ``r``
        references, the first ``r - 1`` writers (in batch order) copy, and a last writer from the
        batch writes in place once the others have let go.
        """
        partial = (writing & (lens % self.block_size != 0)).nonzero()[0]
        if not partial.size:
            return None
        table, refcount = self.table, self.pool.refcounts
        if self.pool.num_held:  # copies still to read some blocks hold references: no sharers
            refcount = refcount - self.pool.held_refs
        last = table.flat[rows[partial] * table.width + held[partial] - 1]
        refs = refcount[last]
        shared = refs > 1
        if not np.count_nonzero(shared):
            return None
        partial, last, refs = partial[shared], last[shared], refs[shared]
        copy = np.zeros(rows.size, np.int64)
        blocks, writers = grouped(last)
        if np.count_nonzero(writers < refcount[blocks]) == blocks.size:
            copy[partial] = 1  # a holder outside the batch stays for every block: all copy
            return copy
        order = last.argsort(kind="stable")
        ranked = last[order]
        starts = np.concatenate(([True], ranked[1:] != ranked[:-1])).nonzero()[0]
        runs = np.concatenate((starts[1:], [order.size])) - starts
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size) - starts.repeat(runs)
        copy[partial[rank < refs - 1]] = 1
        return copy if np.count_nonzero(copy) else None

    def _apply_growth(
        self,
        base: np.ndarray,
        held: np.ndarray,
        grow: np.ndarray,
        copy: np.ndarray | None,
        need: np.ndarray,
        new: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Write the new blocks into the tables (``base``: each row's first flat entry): each
        row's copy (if any) first, then its growth."""
        flat = self.table.flat
        offsets = need.cumsum() - need
        src = dst = NO_SLOTS
        if copy is not None:
            copied = copy.nonzero()[0]
            at = base[copied] + held[copied] - 1
            dst = new[offsets[copied]]
            src = flat[at]  # a copy (fancy indexing)
            flat[at] = dst
            blocks, times = grouped(src.astype(np.intp))
            self.pool.add_refs(blocks, -times)  # never the last reference: see _copies
            dst = dst.astype(np.int32)
            offsets = offsets + copy  # the growth of a row that copies follows its copy
        grown = np.arange(base.size).repeat(grow)
        within = np.arange(grown.size) - (grow.cumsum() - grow).repeat(grow)
        flat[base[grown] + held[grown] + within] = new[offsets[grown] + within]
        return src, dst
