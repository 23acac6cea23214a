"""How the block manager plans a step: the slots to write, the blocks to take and to copy.

:class:`StepPlanner` is the half of :class:`~cupaged.BlockManager` that turns "``counts[i]`` new
tokens for sequence ``rows[i]``" into changes of the tables (:mod:`cupaged.block_table`), the
pool (:mod:`cupaged.block_pool`) and the prefix chains (:mod:`cupaged.prefix_cache`); the manager
holds that state and the public calls. Every plan is all or nothing: whatever can fail (the
pool's capacity, a user ``block_hasher``) runs before the first change, and each change after
that records its undo in the manager's transaction (``self._atomic``).

Three planners compute the same thing, each where it is cheapest (NumPy calls cost 0.2-1 µs each
on the arrays of a step, a Python iteration less than that):

- :meth:`StepPlanner._plan_rows`: row by row in scalar arithmetic (one sequence, a small batch);
- :meth:`StepPlanner._plan_decode`: one token per sequence in about 15 array operations, through
  the flat table and a batch's row offsets;
- :meth:`StepPlanner._plan_batch`: any batch, copy-on-write included, fully vectorised.

The planners call NumPy's array methods (``x.nonzero()[0]``, ``x.repeat(n)``, ``x.cumsum()``)
rather than the functions of the same name (``np.flatnonzero``, ``np.repeat``, ``np.cumsum``):
the functions' Python wrappers cost 0.4-1 µs more per call, as much as the work on these arrays.

``tests/test_step_api.py`` checks the vectorised planners against the scalar one on twin managers
after every operation of seeded random walks.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ._util import cdiv
from .block_pool import _grouped
from .errors import OutOfBlocksError

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .block_table import SequenceTable
    from .prefix_cache import PrefixCache, PrefixChain

_NO_COPIES = np.zeros(0, np.int32)
_NO_COPIES.flags.writeable = False
# Below these batch sizes a step plans row by row in scalar arithmetic: a few dozen array
# operations cost more than a short Python loop (measured on the W1/W3b benchmarks).
_SMALL_BATCH = 16
_SMALL_DECODE = 4


class StepPlanner:
    """The planners of :class:`~cupaged.BlockManager` (a base class: it holds no state).

    They read and change the manager's state: ``_seqs`` (:class:`SequenceTable`), ``_pool``
    (:class:`BlockPool`), ``_prefix`` (:class:`PrefixCache`) and ``_chains`` (row -> chain),
    ``_block_size``, ``_offsets`` (``arange(block_size)``, int32), ``prefix_caching`` and
    ``_atomic`` (the transaction whose ``undo`` list each change appends to).
    """

    _seqs: SequenceTable
    _pool: BlockPool
    _prefix: PrefixCache
    _chains: dict[int, PrefixChain]
    _block_size: int
    _offsets: np.ndarray
    prefix_caching: bool
    _atomic: Any

    def _plan(
        self,
        rows: np.ndarray,
        counts: int | np.ndarray,
        tokens: np.ndarray | list[np.ndarray] | None,
        what: str | None,
        bases: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Allocate, copy-on-write and slot-map ``counts`` new tokens for each of ``rows``.

        Everything that can fail (the pool's capacity, a user ``block_hasher``) runs before the
        first change. Returns ``(slots, copy_src, copy_dst)`` on the host. Three paths compute
        the same thing: a few sequences row by row in scalar arithmetic, a decode step (one token
        each) in the fewest array operations, and any batch in general.
        """
        decode = type(counts) is int and counts == 1
        if rows.size > _SMALL_BATCH or (decode and rows.size > _SMALL_DECODE):
            if decode:
                return self._plan_decode(rows, tokens, what, bases)
            return self._plan_batch(rows, counts, tokens, what)
        per_row = [counts] * rows.size if isinstance(counts, int) else counts.tolist()
        return self._plan_rows(rows.tolist(), per_row, tokens, what)

    def _plan_rows(
        self, rows: list[int], counts: list[int], tokens: Any, what: str | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_plan` row by row in scalar arithmetic: one sequence (append, a per-token step
        that takes a block) or a small batch, where array operations cost more than they save."""
        table, bs, pool = self._seqs, self._block_size, self._pool
        refcount, lens, tables = pool._refcount, table.lens, table.tables
        plans = []
        released: dict[int, int] = {}  # copy-on-write references that earlier rows drop
        total = widest = 0
        for row, n in zip(rows, counts, strict=True):
            length = lens.item(row)
            held, after = -(-length // bs), -(-(length + n) // bs)
            copy = last = 0
            if n and length % bs:
                last = tables.item(row, held - 1)
                if refcount.item(last) - released.get(last, 0) > 1:  # another holder stays: copy
                    copy, released[last] = 1, released.get(last, 0) + 1
            plans.append((row, n, length, held, after, copy, last))
            total += after - held + copy
            widest = max(widest, after)
        if total > pool.num_free:
            if what is None:
                what = f"reserving {sum(counts)} token(s) for {len(rows)} sequence(s)"
            raise OutOfBlocksError(total, pool.num_free, what)
        keys: list[Any] = [None] * len(rows)
        if self.prefix_caching and tokens is not None:
            for i, (row, n, length, *_) in enumerate(plans):
                ids = tokens[i : i + 1] if isinstance(tokens, np.ndarray) else tokens[i]
                if n:
                    offset = length % bs
                    joined = np.concatenate([table.tail[row, :offset], ids]) if offset else ids
                    full = joined.size // bs * bs
                    keys[i] = (
                        joined,
                        full,
                        self._prefix.keys(self._chains[row], joined[:full]),
                    )

        # -- from here on nothing fails: change the tables (undone on an interrupt)
        shared = [table.shared.item(row) for row in rows]
        tails = [table.tail[row].copy() for row in rows] if self.prefix_caching else None
        self._atomic.undo.extend(
            (lambda: self._undo_rows(plans, shared, tails), self._chains_restorer(rows))
        )
        # This step of theirs: the last step's K/V were written.
        new_blocks = self._commit_and_take(
            rows, lambda: [after - held + copy for _, _, _, held, after, copy, _ in plans], total
        )
        if total:
            new = new_blocks.tolist()
            table.ensure_width(widest + 1)  # one spare column: see _plan_decode
            tables = table.tables  # maybe grown
        taken, sources, copies, slots = 0, [], [], []
        # Each row's written blocks, and where its slots start in their slots less the tokens of
        # the rows before it.
        runs, shifts, segment, ahead = [], [], 0, 0
        for (row, n, length, held, after, copy, _), row_keys in zip(plans, keys, strict=True):
            if after - held + copy:
                if copy:
                    sources.append(tables.item(row, held - 1))
                    copies.append(new[taken])
                    tables[row, held - 1] = new[taken]
                tables[row, held:after] = new_blocks[taken + copy : taken + copy + after - held]
                taken += after - held + copy
                table.version[row] = table.clock
            if n == 1:
                slots.append(tables.item(row, length // bs) * bs + length % bs)
            first = length // bs
            runs.append(tables[row, first:after])
            shifts.append(segment + length - first * bs - ahead)
            segment += (after - first) * bs
            ahead += n
            lens[row] = length + n
            if n:
                table.shared[row] = False  # copied, or the last holder: the last block is its own
            if row_keys is not None:
                joined, full, row_keys = row_keys
                table.tail[row, : joined.size - full] = joined[full:]
                self._extend_chain(row, row_keys)
        src = dst = _NO_COPIES
        if sources:
            src, dst = np.array(sources, np.int32), np.array(copies, np.int32)
            # Never a last reference (see `released`): no block goes back to the pool.
            if len(released) == 1:  # forks of one sequence: one source
                pool.unshare(*next(iter(released.items())))
            else:
                pool.unshare(np.array(list(released), np.intp), np.array(list(released.values())))
        if len(slots) == len(rows):  # one token each
            return np.array(slots, np.int32), src, dst
        # Every slot of every row's written blocks, then each row's n tokens cut out of its
        # stretch: a handful of array operations for the whole batch.
        every = (np.concatenate(runs)[:, None] * bs + self._offsets).reshape(-1)
        index = np.array(shifts).repeat(counts)  # (the method: np.repeat of a list is slower)
        index += np.arange(ahead)
        return every[index], src, dst

    def _undo_rows(self, plans: list[tuple], shared: list[bool], tails: list | None) -> None:
        """Undo of :meth:`_plan_rows`: the entries it filled were padding, or the copied block."""
        table = self._seqs
        for i, (row, _, length, held, after, copy, last) in enumerate(plans):
            table.tables[row, held:after] = 0
            if copy:
                table.tables[row, held - 1] = last
            table.lens[row] = length
            table.shared[row] = shared[i]
            if tails is not None:
                table.tail[row] = tails[i]

    def _plan_decode(
        self, rows: np.ndarray, tokens: Any, what: str | None, bases: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_plan` for one token per sequence: a decode step in about 15 array operations.

        ``bases`` is ``rows * width`` when the caller keeps it (a :class:`SequenceBatch`): the
        entries are read and written in the flat table, one 1-D gather instead of a 2-D one.
        """
        table, bs, pool = self._seqs, self._block_size, self._pool
        # Maybe a shared last block: copy-on-write (the global count first: no gather mostly).
        if np.count_nonzero(table.shared) and np.count_nonzero(table.shared[rows]):
            if rows.size > _SMALL_BATCH:
                return self._plan_batch(rows, 1, tokens, what)
            return self._plan_rows(rows.tolist(), [1] * rows.size, tokens, what)
        lens = table.lens[rows]
        offset = lens % bs
        width = table.width
        # The entry of the block the token goes to (0, padding, where offset is 0: a new block).
        index = (rows * width if bases is None else bases) + lens // bs
        blocks = table.flat[index]
        crossing = (offset == 0).nonzero()[0]
        if crossing.size > pool.num_free:
            what = what or f"reserving {rows.size} token(s) for {rows.size} sequence(s)"
            raise OutOfBlocksError(crossing.size, pool.num_free, what)
        registering = self.prefix_caching and tokens is not None
        keys = self._keys(rows, lens, 1, tokens) if registering else None

        # -- from here on nothing fails: change the tables (undone on an interrupt)
        at = index[crossing]
        self._atomic.undo.append(lambda: self._undo_decode(rows, lens, at, width))
        if registering:  # the chains that commit or fill a block: few rows of the batch
            touched = table.pending[rows] | (offset == bs - 1)
            self._atomic.undo.append(self._chains_restorer(rows[touched].tolist()))
        if self.prefix_caching:  # (a decode step without it skips the call: 64 a W3b scenario)
            new = self._commit_and_take(rows, lambda: offset == 0, crossing.size)  # see _plan_rows
        elif crossing.size:
            new = pool.take(crossing.size)
        if crossing.size:
            table.flat[at] = new
            table.version[rows[crossing]] = table.clock
            blocks[crossing] = new
        table.lens[rows] = lens + 1
        if crossing.size:  # each crossing row holds one block more: keep a spare column
            table.held_bound += 1
            if table.held_bound + 1 > width:
                table.held_bound = 0  # the true maximum over all rows, then grow if needed
                table.ensure_width(cdiv(int(table.lens.max()), bs) + 1)
        if registering:
            self._register(rows, lens, 1, tokens, keys)
        blocks *= bs
        blocks += offset
        return blocks, _NO_COPIES, _NO_COPIES

    def _undo_decode(self, rows, lens, at, width) -> None:
        table = self._seqs
        # The entries a decode step fills were padding (flat indices at the step's width).
        table.tables[at // width, at % width] = 0
        table.lens[rows] = lens

    def _chains_restorer(self, rows: list[int]) -> Callable[[], None]:
        """An undo action that puts back the chains (keys, committed count, pending flag)."""
        if not self.prefix_caching:
            return lambda: None
        table, chains, pending = self._seqs, self._chains, self._seqs.pending
        saved = [
            (row, len(chains[row].keys), chains[row].committed, pending.item(row))
            for row in rows
            if row in chains
        ]

        def restore() -> None:
            for row, keys, committed, pending in saved:
                chain = self._chains[row]
                del chain.keys[keys:], chain.digests[keys:]
                chain.committed = committed
                table.pending[row] = pending

        return restore

    def _plan_batch(
        self,
        rows: np.ndarray,
        counts: int | np.ndarray,
        tokens: np.ndarray | list[np.ndarray] | None,
        what: str | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_plan` for any batch: fully vectorised, copy-on-write included.

        Table entries are addressed in the flat table (``row * width + column``): 1-D gathers
        and stores, cheaper than 2-D ones on the arrays of a step.
        """
        table, bs = self._seqs, self._block_size
        lens = table.lens[rows]
        uniform = isinstance(counts, int)
        ends = lens + counts
        if uniform:
            writing = np.ones(rows.size, bool) if counts else np.zeros(rows.size, bool)
        else:
            writing = counts > 0
        held = (lens + (bs - 1)) // bs
        grow = (ends + (bs - 1)) // bs - held
        copy = self._copies(rows, lens, held, writing)
        need = grow + copy if copy is not None else grow
        total = int(need.sum())
        if total > self._pool.num_free:
            if what is None:
                tokens_in = counts * rows.size if uniform else int(counts.sum())
                what = f"reserving {tokens_in} token(s) for {rows.size} sequence(s)"
            raise OutOfBlocksError(total, self._pool.num_free, what)
        registering = self.prefix_caching and tokens is not None
        keys = self._keys(rows, lens, counts, tokens) if registering else None

        # -- from here on nothing fails: change the tables (undone on an interrupt)
        saved = table.snapshot(rows)
        self._atomic.undo.extend(
            (lambda: table.restore(rows, saved), self._chains_restorer(rows.tolist()))
        )
        new = self._commit_and_take(rows, lambda: need, total)  # (see _plan_rows)
        src = dst = _NO_COPIES
        if total:
            table.ensure_width(int((held + grow).max()) + 1)  # one spare column: see _plan_decode
            changed = need.nonzero()[0]
            table.touch(rows[changed])
            base = rows * table.width
            if copy is None and grow.max() == 1:  # a decode step: at most one block each
                table.flat[base[changed] + held[changed]] = new
            else:
                src, dst = self._apply_growth(base, held, grow, copy, need, new)
        flat = table.flat
        if uniform and counts == 1:
            slots = flat[rows * table.width + lens // bs] * bs + lens % bs
        elif uniform and not counts:
            slots = _NO_COPIES
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
            self._register(rows, lens, counts, tokens, keys)
        return slots.astype(np.int32, copy=False), src, dst

    def _copies(
        self, rows: np.ndarray, lens: np.ndarray, held: np.ndarray, writing: np.ndarray
    ) -> np.ndarray | None:
        """Per row, 1 where the write lands in a partly filled last block that another sequence
        still holds (copy it first), else 0; ``None`` when no row needs a copy.

        Forked siblings of one batch that share a block are counted exactly: with ``r``
        references, the first ``r - 1`` writers (in batch order) copy, and a last writer from the
        batch writes in place once the others have let go.
        """
        partial = (writing & (lens % self._block_size != 0)).nonzero()[0]
        if not partial.size:
            return None
        table = self._seqs
        last = table.flat[rows[partial] * table.width + held[partial] - 1]
        refs = self._pool._refcount[last]
        shared = refs > 1
        if not np.count_nonzero(shared):
            return None
        partial, last, refs = partial[shared], last[shared], refs[shared]
        copy = np.zeros(rows.size, np.int64)
        blocks, writers = _grouped(last)
        if np.count_nonzero(writers < self._pool._refcount[blocks]) == blocks.size:
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
        flat = self._seqs.flat
        offsets = need.cumsum() - need
        src = dst = _NO_COPIES
        if copy is not None:
            copied = copy.nonzero()[0]
            at = base[copied] + held[copied] - 1
            dst = new[offsets[copied]]
            src = flat[at]  # a copy (fancy indexing)
            flat[at] = dst
            blocks, times = _grouped(src.astype(np.intp))
            self._pool.unshare(blocks, times)  # never the last reference: see _copies
            dst = dst.astype(np.int32)
            offsets = offsets + copy  # the growth of a row that copies follows its copy
        grown = np.arange(base.size).repeat(grow)
        within = np.arange(grown.size) - (grow.cumsum() - grow).repeat(grow)
        flat[base[grown] + held[grown] + within] = new[offsets[grown] + within]
        return src, dst

    def _keys(
        self,
        rows: np.ndarray,
        lens: np.ndarray,
        counts: int | np.ndarray,
        tokens: np.ndarray | list[np.ndarray],
    ) -> list[tuple[int, int, np.ndarray, list[tuple[bytes, bytes]]]]:
        """The keys of every block the new tokens fill, hashed before anything changes.

        Returns ``(row, first full block, tail tokens left, [(key, digest), ...])`` per row that
        fills a block or keeps tail tokens.
        """
        bs, tail = self._block_size, self._seqs.tail
        if isinstance(counts, int) and counts == 1:  # a decode step: only rows that fill a block
            filling = (lens % bs == bs - 1).nonzero()[0]
            if not filling.size:
                return []
            filled = rows[filling]
            chunks = tail[filled]
            chunks[:, bs - 1] = tokens[filling]
            filled_rows = filled.tolist()
            chains = [self._chains[row] for row in filled_rows]
            keys = self._prefix.next_keys(chains, chunks)
            return [(row, 0, None, [key]) for row, key in zip(filled_rows, keys, strict=True)]
        out = []
        per_row = [counts] * rows.size if isinstance(counts, int) else counts.tolist()
        for i, n in enumerate(per_row):
            if not n:
                continue
            row = int(rows[i])
            offset = int(lens[i]) % bs
            joined = np.concatenate([tail[row, :offset], tokens[i]])
            full = len(joined) // bs * bs
            keys = self._prefix.keys(self._chains[row], joined[:full])
            out.append((row, int(lens[i]) // bs, joined[full:], keys))
        return out

    def _register(self, rows, lens, counts, tokens, keys) -> None:
        """Store the new tail tokens and extend the chains by the blocks that filled."""
        table = self._seqs
        decode = isinstance(counts, int) and counts == 1
        if decode:
            table.tail[rows, lens % self._block_size] = tokens
        for row, _, rest, row_keys in keys:
            if not decode:
                table.tail[row, : rest.size] = rest
            self._extend_chain(row, row_keys)

    def _extend_chain(self, row: int, keys: list[tuple[bytes, bytes]]) -> None:
        """Append the keys of blocks that just filled; they are registered (findable) only once
        their K/V are known written: see :meth:`commit`."""
        if keys:
            chain = self._chains[row]
            if len(keys) == 1:
                chain.keys.append(keys[0][0])
                chain.digests.append(keys[0][1])
            else:
                new_keys, new_digests = zip(*keys, strict=True)
                chain.keys += new_keys
                chain.digests += new_digests
            self._seqs.pending[row] = True

    def _commit_and_take(
        self, rows: Any, needs: Callable[[], Any], total: int
    ) -> np.ndarray | None:
        """Register the pending blocks of ``rows`` (their last step's K/V were written), then take
        the ``total`` new blocks of the step, ``needs()[i]`` for ``rows[i]`` in order (asked for
        only when the take evicts); ``None`` when ``total`` is 0.

        Exactly what the same steps one sequence at a time do, where each row's blocks are
        registered just before its own are taken. The two orders differ only when the take
        evicts: a block of row ``j`` whose key a cached block held was not registered (the first
        writer wins), and the take of an earlier row then evicted that cached block. Such a block
        is registered after the take, as it would have been at row ``j``'s turn.
        """
        pool = self._pool
        if not (self.prefix_caching and total > pool._top):  # no eviction: one commit, one take
            self._commit_rows(rows)
            return pool.take(total) if total else None
        top, skipped, evicted = pool._top, [], []
        self._commit_rows(rows, skipped)
        new = pool.take(total, evicted)
        if skipped and evicted:
            self._register_freed(rows, needs(), top, skipped, evicted)
        return new

    def _register_freed(self, rows, needs, top, skipped, evicted) -> None:
        """The registrations :meth:`_commit_and_take` owes: ``skipped`` holds ``(row, block, key,
        digest)`` refused at the commit; ``evicted`` the keys the take dropped, in order, the
        first one at position ``top`` of the take."""
        rows = rows.tolist() if isinstance(rows, np.ndarray) else list(rows)
        ends = np.cumsum(needs).tolist()  # each row's take ends before ends[i]
        turn = {row: i for i, row in enumerate(rows)}
        lost = {key: bisect.bisect_right(ends, top + e) for e, key in enumerate(evicted)}
        late = [entry for entry in skipped if lost.get(entry[2], len(rows)) < turn[entry[0]]]
        if late:  # in row order: the first writer still wins among them
            _, blocks, keys, digests = (list(field) for field in zip(*late, strict=True))
            self._pool.register_many(blocks, keys, digests)

    def _commit_rows(self, rows: Any, skipped: list | None = None) -> None:
        """Register the pending full blocks of ``rows`` (an int array or a list of ints), all in
        one call to the pool; ``skipped`` collects ``(row, block, key, digest)`` of those refused
        because another block holds their key."""
        if not self.prefix_caching:
            return
        table, chains = self._seqs, self._chains
        if isinstance(rows, np.ndarray):
            rows = rows[table.pending[rows]].tolist()
        else:
            pending = table.pending
            rows = [row for row in rows if pending.item(row)]
        if not rows:
            return
        blocks: list[int] = []
        keys: list[bytes] = []
        digests: list[bytes] = []
        owners: list[int] = []
        for row in rows:
            chain = chains[row]
            start, end = chain.committed, len(chain.keys)
            if end - start == 1:  # a decode step fills at most one block a sequence
                blocks.append(table.tables.item(row, start))
                keys.append(chain.keys[start])
                digests.append(chain.digests[start])
            else:
                blocks += table.tables[row, start:end].tolist()
                keys += chain.keys[start:end]
                digests += chain.digests[start:end]
            if skipped is not None:
                owners += [row] * (end - start)
            chain.committed = end
        refused = [] if skipped is not None else None
        self._pool.register_many(blocks, keys, digests, refused)
        if refused:
            skipped += [(owners[i], blocks[i], keys[i], digests[i]) for i in refused]
        if len(rows) == 1:
            table.pending[rows[0]] = False
        else:
            table.pending[rows] = False
