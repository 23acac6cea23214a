"""How sequences start, fork and end: rows, references and prefix chains, with their undo.

:class:`Lifecycle` changes the table, the pool and the chains for the manager's ``admit``,
``add_sequence``, ``fork_many`` and ``free_many``, inside the manager's transaction; each change
records its undo first. A row references the blocks of its entries ``released[row] ..
cdiv(lens[row], block_size) - 1``: entries a sliding window released (``-1``) hold nothing, so a
fork shares only the blocks in the window and a free returns only those.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from .._arrays.checks import require
from .._util import cdiv
from ..errors import OutOfBlocksError
from .chains import Chains
from .planner import NO_SLOTS, Planner
from .pool import BlockPool
from .prefix import Block, PrefixCache, PrefixChain
from .results import Admission
from .sequences import SequenceTable
from .transaction import Transaction

_NO_BLOCKS = np.zeros(0, np.intp)
_NO_BLOCKS.flags.writeable = False


class Lifecycle:
    """Starts, forks and ends sequences over a table, a pool and prefix chains."""

    def __init__(
        self,
        table: SequenceTable,
        pool: BlockPool,
        index: PrefixCache,
        chains: Chains,
        planner: Planner,
        transaction: Transaction,
    ) -> None:
        self.table, self.pool, self.index, self.chains = table, pool, index, chains
        self.planner, self.transaction = planner, transaction
        self._log = transaction.log  # (the same list for the transaction's life)
        self.block_size = table.block_size

    def admit(self, prompt: np.ndarray, salt: bytes | None, reserve: bool = True) -> Admission:
        """A new sequence for ``prompt`` (checked int64): its cached prefix attached, and with
        ``reserve`` the rest of the prompt too (host slots in the admission)."""
        bs, pool = self.block_size, self.pool
        hits, chain, keys = self._match(prompt, salt)
        if not reserve:
            sid, _, _ = self._attach(hits, chain)
            return Admission(sid, len(hits) * bs, NO_SLOTS)
        n_hits, n = len(hits), len(prompt)
        cached = n_hits * bs
        if n_hits:
            hits = np.asarray(hits, np.intp)  # (the prefix memo's array as it is)
            held = pool.refcounts[hits]
            in_use = int(np.count_nonzero(held))
        else:
            held, in_use = None, 0
        needed = cdiv(n, bs) - n_hits
        revived = n_hits - in_use  # evictable hits: reviving them leaves fewer to take
        if needed > pool.num_free - revived:  # (the transaction puts the match's counters back)
            raise OutOfBlocksError(needed, pool.num_free - revived, f"admitting a {n}-token prompt")
        tail, pending = None, False
        if self.chains.enabled:
            # The keys of the full blocks after the hits, hashed by the match: registered at
            # commit, once their K/V are written (pending); the tokens of a last, partly filled
            # block go to the new row's tail.
            if keys:
                chain.add(keys)
                pending = True
            full = n_hits + len(keys)
            if n > full * bs:
                tail = prompt[full * bs :]
        # The hits and the blocks for the rest of the prompt, in one pass over the row.
        sid, _, new = self._attach(hits, chain, needed, n, held, in_use, tail, pending)
        offsets = self.planner.offsets
        if n == cached:
            slots = NO_SLOTS
        elif needed == 1:
            slots = offsets[: n - cached] + new.item(0) * bs  # int32: slots fit (init)
        else:
            slots = ((new * bs).astype(np.int32)[:, None] + offsets).reshape(-1)[: n - cached]
        return Admission(sid, cached, slots)

    def _match(
        self, prompt: np.ndarray, salt: bytes | None
    ) -> tuple[list[int], PrefixChain | None, list[Block]]:
        if not self.chains.enabled:
            return [], None, []
        self._log.append((self.index.restore_stats, self.index.save_stats()))
        return self.index.match_unchecked(prompt, salt)

    def _attach(
        self,
        hits: Any,
        chain: PrefixChain | None,
        needed: int = 0,
        length: int | None = None,
        held: np.ndarray | None = None,
        in_use: int | None = None,
        tail: np.ndarray | None = None,
        pending: bool = False,
    ) -> tuple[int, int, np.ndarray]:
        """A new sequence holding the cached blocks ``hits`` (full; a list or an intp array), then
        ``needed`` fresh blocks, ``length`` tokens long (``len(hits) * block_size`` when
        ``None``); ``held``, ``in_use``: the hits' refcounts and their nonzero count, if known;
        ``tail``, ``pending``: see :meth:`SequenceTable.acquire`.

        Returns:
            ``(sid, row, fresh blocks)``.
        """
        pool, n_hits = self.pool, len(hits)
        if n_hits:
            hits = np.asarray(hits, np.intp)
            pool.acquire_unchecked(hits, held=held, in_use=in_use)
        new = pool.take(needed) if needed else _NO_BLOCKS
        blocks = np.concatenate((hits, new)) if n_hits and needed else hits if n_hits else new
        cached = n_hits * self.block_size
        sid, row = self.table.acquire(
            blocks, cached if length is None else length, cached, tail, pending
        )
        if self.chains.enabled:
            self.chains.set([row], [chain])
        return sid, row, new

    def fork(self, parent: int, n: int) -> list[int]:
        """``n`` new sequences sharing every block of row ``parent``."""
        table = self.table
        table.check_room(n, f"fork_many(..., {n})")
        children, rows = table.clone(parent, n)
        held = table.tables[parent, table.released.item(parent) : table.held(parent)]
        self.pool.add_refs(held.astype(np.intp), n)
        if self.chains.enabled:
            chain = self.chains[parent]
            self.chains.set(rows.tolist(), [chain.copy() for _ in range(n)])
        return children

    def release(self, rows: list[int]) -> None:
        """Drop the sequences' references (each one's last block first) and their rows."""
        held = self.table.free(rows)
        if held is not None:
            self.pool.release(held, repeats=len(rows) > 1)
        if self.chains.enabled:
            self.chains.drop(rows)

    def check(self, window: Any, held: dict[int, int] | None = None) -> None:
        """Check every row against the pool: a resident row's held blocks are distinct, its
        shared last block flagged, and every block's refcount is its number of table entries
        (``window``: the manager's :class:`~cupaged.paging.window.Window`, or ``None``) plus
        ``held``: references that no table makes, by block (the copies a cache left to apply
        hold their sources).

        Raises:
            AssertionError: naming the first broken invariant.
        """
        held = held or {}
        references: Counter[int] = Counter(held)
        table, pool = self.table, self.pool
        check_table(table)
        for sid, row in table.rows.items():
            resident = table.live.item(row) >= 0
            self.chains.check(sid, row, resident)
            require(
                window is not None or not table.released.item(row),
                f"sequence {sid} released blocks without a window",
            )
            if window is not None:
                window.check(sid, row)
            if not resident:
                continue
            blocks = table.tables[row, table.released.item(row) : table.held(row)].tolist()
            require(len(set(blocks)) == len(blocks), f"sequence {sid} references a block twice")
            partly = table.lens.item(row) % self.block_size  # (then it holds a block)
            if partly and pool.refcount(blocks[-1]) - held.get(blocks[-1], 0) > 1:
                require(
                    bool(table.shared[row]),
                    f"sequence {sid} shares its partly filled last block {blocks[-1]} unflagged",
                )
            references.update(blocks)
        self.chains.check_rows(set(table.rows.values()))
        pool.check_invariants(references)


def check_table(table: SequenceTable) -> None:
    """Check a table's rows against its ids; raises ``AssertionError`` naming the first break."""
    rows = table.rows
    free = set(table.free_rows)
    require(len(free) == len(table.free_rows), "a table row is on the free list twice")
    used = set(rows.values())
    require(len(used) == len(rows), "two sequences share a table row")
    require(not free & used, f"rows both free and in use: {sorted(free & used)}")
    require(
        len(free) + len(used) == table.tables.shape[0],
        f"{table.tables.shape[0]} table rows but {len(free)} free and {len(used)} in use",
    )
    require(table.cached.keys() <= rows.keys(), "a freed sequence kept a cached-token count")
    for sid, row in rows.items():
        require(0 <= sid < table.next_id, f"sequence id {sid} was never handed out")
        require(
            table.sids[row] == sid,
            f"row {row} of sequence {sid} names sequence {table.sids[row]}",
        )
        resident = table.live[row] == sid
        require(
            resident or table.live[row] == -1, f"row {row} of sequence {sid} is live as another"
        )
        held = table.held(row) if resident else 0
        require(
            not table.tables[row, held:].any(),
            f"table row {row} (sequence {sid}) has non-zero entries past its {held} block(s)",
        )
        released = table.released.item(row)
        require(
            0 <= released <= table.held(row),
            f"sequence {sid} released {released} of its {table.held(row)} table entries",
        )
        if resident:
            require(held < table.width, f"sequence {sid} has no spare column past its table")
            require(
                (table.tables[row, :released] == -1).all()
                and (table.tables[row, released:held] >= 0).all(),
                f"table row {row} (sequence {sid}) is not {released} released entries (-1) "
                f"then block ids: {table.tables[row, :held].tolist()}",
            )
    for row in free:
        require(
            table.sids[row] == -1
            and table.lens[row] == 0
            and table.live[row] == -1
            and table.released[row] == 0,
            f"free table row {row} is not empty",
        )
        require(not table.tables[row].any(), f"free table row {row} holds block ids")
