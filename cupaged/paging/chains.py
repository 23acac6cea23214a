"""The prefix chains of the live sequences, and when their full blocks become findable.

With prefix caching every live sequence has a :class:`~cupaged.PrefixChain`: the keys of its full
blocks in order, each hashed once, when the block fills. The block is *registered*
(findable by other sequences) only once its K/V are known written: at the sequence's next step,
by ``append`` (which writes them itself), or by ``commit``. Until then the row is *pending*::

    keys       k0  k1  k2  k3          chain.keys (one per full block)
    committed  ---------^              chain.committed = 2: blocks 0 and 1 are findable
    pending    True                    table.pending[row]: keys 2 and 3 wait for their K/V

:class:`Chains` owns the chains (``row -> chain``) and does every registration; the pool owns the
key -> block map it registers into. Every change records its undo first.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import numpy as np

from .._arrays.checks import require
from .pool import BlockPool
from .prefix import Block, PrefixCache, PrefixChain
from .sequences import SequenceTable
from .transaction import Transaction


class Chains:
    """Prefix chains by table row, and their registration in the pool.

    Args:
        table: the sequences' rows (tails and pending flags live there).
        pool: where full blocks are registered.
        index: the :class:`~cupaged.PrefixCache` that hashes and matches chains.
        transaction: where undo is recorded.
        enabled: prefix caching is on (otherwise every call does nothing).
    """

    def __init__(
        self,
        table: SequenceTable,
        pool: BlockPool,
        index: PrefixCache,
        transaction: Transaction,
        enabled: bool,
    ) -> None:
        self.table, self.pool, self.index = table, pool, index
        self.enabled = enabled
        self._log = transaction.log
        self._chains: dict[int, PrefixChain] = {}

    def __contains__(self, row: int) -> bool:
        return row in self._chains

    def __getitem__(self, row: int) -> PrefixChain:
        return self._chains[row]

    # ------------------------------------------------------------------------------ entries

    def set(self, rows: list[int], chains: list[PrefixChain]) -> None:
        """Give ``rows`` their chains (new sequences)."""
        if len(rows) == 1:  # (a new sequence: an admission)
            row = rows[0]
            self._log.append((self._restore_entries, [(row, self._chains.get(row))]))
            self._chains[row] = chains[0]
            return
        self._log.append((self._restore_entries, self._entries(rows)))
        self._chains.update(zip(rows, chains, strict=True))

    def drop(self, rows: list[int]) -> None:
        """Forget the chains of ``rows`` (freed sequences)."""
        if self._chains:
            self._log.append((self._restore_entries, self._entries(rows)))
            for row in rows:
                self._chains.pop(row, None)

    def save(self, rows: list[int]) -> None:
        """Record the undo of changes to the chains of ``rows`` (keys, committed count, pending
        flag) that follow."""
        if self.enabled:
            pending, chains = self.table.pending, self._chains
            saved = [
                (row, len(chains[row].keys), chains[row].committed, pending.item(row))
                for row in rows
                if row in chains
            ]
            self._log.append((self._restore_chains, saved))

    # ------------------------------------------------------------------------------ keys

    def keys(
        self,
        rows: np.ndarray,
        lens: np.ndarray,
        counts: int | np.ndarray,
        tokens: Any,
        fills: np.ndarray | None = None,
    ) -> list[tuple[int, int, np.ndarray | None, list[Block]]]:
        """The keys of every block the new tokens fill, hashed before anything changes
        (``fills``: with one token each, the rows' mask of ``lens % block_size == block_size -
        1`` when the caller has it).

        Returns ``(row, first full block, tail tokens left, [Block, ...])`` per row that fills a
        block or keeps tail tokens (:data:`~cupaged.paging.prefix.Block`: key and digest).
        """
        bs, tail = self.table.block_size, self.table.tail
        if isinstance(counts, int) and counts == 1:  # a decode step: only rows that fill a block
            if fills is None:
                fills = lens % bs == bs - 1
            filling = fills.nonzero()[0]
            if not filling.size:
                return []
            filled = rows[filling]
            chunks = tail[filled]
            chunks[:, bs - 1] = tokens[filling]
            filled_rows = filled.tolist()
            chains = [self._chains[row] for row in filled_rows]
            keys = self.index.next_keys(chains, chunks)
            return [(row, 0, None, [key]) for row, key in zip(filled_rows, keys, strict=True)]
        out = []
        per_row = [counts] * rows.size if isinstance(counts, int) else counts.tolist()
        for i, n in enumerate(per_row):
            if not n:
                continue
            row, length = int(rows[i]), int(lens[i])
            offset = length % bs
            joined = np.concatenate([tail[row, :offset], tokens[i]]) if offset else tokens[i]
            full = len(joined) // bs * bs
            keys = self.index.keys(self._chains[row], joined[:full]) if full else []
            out.append((row, length // bs, joined[full:], keys))
        return out

    def extend(
        self,
        rows: np.ndarray,
        offset: np.ndarray | None,
        counts: int | np.ndarray,
        tokens: Any,
        keys: list[tuple[int, int, np.ndarray | None, list[Block]]],
    ) -> None:
        """Store the new tail tokens and extend the chains by the blocks that filled (pending:
        registered at the next commit): the one place a step's tails are written. ``offset``:
        with one token each, where it goes in its block (``lens % block_size``); :meth:`keys`
        carries the tails of other steps. The caller recorded :meth:`save` of these rows (and
        the tails' undo)."""
        if isinstance(counts, int) and counts == 1:  # as the planner tells a uniform step
            self.table.write_tails(rows, offset, tokens)
        if keys:
            self.add_keys(keys)

    def add_keys(self, keys: list[tuple[int, int, np.ndarray | None, list[Block]]]):
        """The part of :meth:`extend` that follows :meth:`keys`' entries: each row's tail tokens
        left and the keys of the blocks it filled."""
        table = self.table
        for row, _, rest, row_keys in keys:
            if rest is not None:
                table.restart_tail(row, rest)
            if row_keys:
                self._chains[row].add(row_keys)
        filled = [entry[0] for entry in keys if entry[3]]
        if filled:  # (one: a scalar store)
            table.mark_pending(filled[0] if len(filled) == 1 else filled, True)

    # ------------------------------------------------------------------------------ registration

    def commit(self, rows: Any, skipped: list | None = None) -> None:
        """Register the pending full blocks of ``rows`` (an int array or a list of ints), all in
        one call to the pool; ``skipped`` collects ``(row, block, key, digest)`` of those
        refused because another block holds their key. The caller recorded :meth:`save` of these rows."""
        if not self.enabled:
            return
        table, chains = self.table, self._chains
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
        previous = None
        registered = self.pool.keys.mapping.__contains__
        tables = table.tables
        for row in rows:
            chain = chains[row]
            start, end = chain.committed, len(chain.keys)
            run = chain.keys[start:end]
            if skipped is None:
                # The pool refuses a key that a block holds already (the first writer wins): a
                # run whose keys are all held, or are those of the run before (forks of one
                # sequence, one after another), registers nothing, and is skipped at the cost
                # of a lookup per key rather than an iteration of the pool's loop. (Refusals
                # that are recorded count.)
                if run == previous:
                    continue
                previous = run
                if all(map(registered, run)):
                    continue
            else:
                owners += [row] * (end - start)
            if end - start == 1:  # (a decode step's one block: cheaper than a slice)
                blocks.append(tables.item(row, start))
            else:
                blocks += tables[row, start:end].tolist()
            keys += run
            digests += chain.digests[start:end]
        refused = [] if skipped is not None else None
        if blocks:
            self.pool.keys.register_many(blocks, keys, digests, refused)
        for row in rows:
            chains[row].commit_all()
        if refused:
            skipped += [(owners[i], blocks[i], keys[i], digests[i]) for i in refused]
        table.mark_pending(rows[0] if len(rows) == 1 else rows, False)

    def commit_and_take(self, rows: Any, needs: Callable[[], Any], total: int) -> np.ndarray | None:
        """Register the pending blocks of ``rows`` (their last step's K/V were written), then take
        the ``total`` new blocks of the step, ``needs()[i]`` for ``rows[i]`` in order (asked for
        only when the take evicts); ``None`` when ``total`` is 0.

        Exactly what the same steps one sequence at a time do, where each row's blocks are
        registered just before its own are taken. The two orders differ only when the take
        evicts: a block of row ``j`` whose key a cached block held was not registered (the first
        writer wins), and the take of an earlier row then evicted that cached block. Such a block
        is registered after the take, as it would have been at row ``j``'s turn.
        """
        pool = self.pool
        if not (self.enabled and total > pool.num_stacked):  # no eviction: one commit, one take
            self.commit(rows)
            return pool.take(total) if total else None
        top, skipped, evicted = pool.num_stacked, [], []
        self.commit(rows, skipped)
        new = pool.take(total, evicted)
        if skipped and evicted:
            self._register_freed(rows, needs(), top, skipped, evicted)
        return new

    def register_again(self, row: int, blocks: list[int], start: int = 0) -> None:
        """Register the committed blocks of ``row``'s chain again, on fresh ``blocks``: those of
        its entries ``start ..`` (a swap-in; the window released the entries before ``start``)."""
        if self.enabled:
            chain = self._chains[row]
            done = chain.committed
            keys, digests = chain.keys[start:done], chain.digests[start:done]
            self.pool.keys.register_many(blocks[: len(keys)], keys, digests)

    # ------------------------------------------------------------------------------ checking

    def check(self, sid: int, row: int, resident: bool) -> None:
        """Check ``row``'s chain against its length and the pool; ``AssertionError`` names the
        first break."""
        table = self.table
        if not self.enabled:
            require(row not in self._chains, f"sequence {sid} has a chain without prefix caching")
            return
        chain = self._chains.get(row)
        require(chain is not None, f"sequence {sid} has no prefix chain")
        full = table.lens.item(row) // table.block_size
        require(
            len(chain.keys) == len(chain.digests) == full,
            f"sequence {sid} has {full} full blocks, {len(chain.keys)} keys, "
            f"{len(chain.digests)} digests",
        )
        require(
            0 <= chain.committed <= full and bool(table.pending[row]) == (chain.committed < full),
            f"sequence {sid} has {chain.committed} of {full} keys committed, "
            f"pending flag {bool(table.pending[row])}",
        )
        if resident:  # (entries the window released, -1, hold no block)
            for j, block in enumerate(table.tables[row, :full].tolist()):
                if block < 0:
                    continue
                key = self.pool.cached_key(block)
                require(
                    key is None or key == chain.keys[j],
                    f"block {block} of sequence {sid} is registered under another key",
                )

    def check_rows(self, rows: set[int]) -> None:
        require(self._chains.keys() <= rows, "a freed sequence kept its prefix chain")

    # ------------------------------------------------------------------------------ internals

    def _entries(self, rows: list[int]) -> list[tuple[int, PrefixChain | None]]:
        return [(row, self._chains.get(row)) for row in rows]

    def _restore_entries(self, entries: list[tuple[int, PrefixChain | None]]) -> None:
        for row, chain in entries:
            if chain is None:
                self._chains.pop(row, None)
            else:
                self._chains[row] = chain

    def _restore_chains(self, saved: list[tuple[int, int, int, bool]]) -> None:
        for row, keys, committed, _ in saved:
            # (the table's own record restores its pending flag)
            self._chains[row].truncate(keys, committed)

    def _register_freed(self, rows, needs, top, skipped, evicted) -> None:
        """The registrations :meth:`commit_and_take` owes: ``skipped`` holds ``(row, block, key,
        digest)`` refused at the commit; ``evicted`` the keys the take dropped, in order, the
        first one at position ``top`` of the take."""
        rows = rows.tolist() if isinstance(rows, np.ndarray) else list(rows)
        ends = np.cumsum(needs).tolist()  # each row's take ends before ends[i]
        turn = {row: i for i, row in enumerate(rows)}
        lost = {key: bisect.bisect_right(ends, top + e) for e, key in enumerate(evicted)}
        late = [entry for entry in skipped if lost.get(entry[2], len(rows)) < turn[entry[0]]]
        if late:  # in row order: the first writer still wins among them
            _, blocks, keys, digests = (list(field) for field in zip(*late, strict=True))
            self.pool.keys.register_many(blocks, keys, digests)
