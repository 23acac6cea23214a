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
        bs, pool, table = self.block_size, self.pool, self.table
        hits, chain, keys = self._match(prompt, salt)
        if not reserve:
            sid, _, _ = self._attach(hits, chain)
            return Admission(sid, len(hits) * bs, NO_SLOTS)
        n_hits, n = len(hits), len(prompt)
        cached = n_hits * bs
        if n_hits:
            hits = np.asarray(hits, np.intp)
            held = pool.refcounts[hits]
            in_use = int(np.count_nonzero(held))
        else:
            held, in_use = None, 0
        needed = cdiv(n, bs) - n_hits
        revived = n_hits - in_use  # evictable hits: reviving them leaves fewer to take
        if needed > pool.num_free - revived:  # (the transaction puts the match's counters back)
            raise OutOfBlocksError(needed, pool.num_free - revived, f"admitting a {n}-token prompt")
        # The hits and the blocks for the rest of the prompt, in one pass over the row.
        sid, row, new = self._attach(hits, chain, needed, n, held, in_use)
        if self.chains.enabled:
            # The keys of the full blocks after the hits, hashed by the match: registered at
            # commit, once their K/V are written (the new row's undo covers these changes).
            if keys:
                chain.add(keys)
                table.pending[row] = True
            full = n_hits + len(keys)
            if n > full * bs:  # the tokens of a last, partly filled block
                table.tail[row, : n - full * bs] = prompt[full * bs :]
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
    ) -> tuple[int, int, np.ndarray]:
        """A new sequence holding the cached blocks ``hits`` (full; a list or an intp array), then
        ``needed`` fresh blocks, ``length`` tokens long (``len(hits) * block_size`` when
        ``None``); ``held``, ``in_use``: the hits' refcounts and their nonzero count, if known.

        Returns:
            ``(sid, row, fresh blocks)``.
        """
        table, pool = self.table, self.pool
        sid = table.next_id
        if not table.free_rows:
            table.next_free(1)  # grows the table (no undo needed)
        row = table.free_rows[-1]  # the row acquire_one takes
        self._log.append((table.unacquire, row, len(table.free_rows), sid))
        table.acquire_one(sid)
        n_hits = len(hits)
        if n_hits:
            hits = np.asarray(hits, np.intp)
            pool.acquire_unchecked(hits, held=held, in_use=in_use)
        new = pool.take(needed) if needed else _NO_BLOCKS
        if n_hits or needed:
            table.ensure_width(n_hits + needed + 1)  # one spare column: see Planner._decode
            table.tables[row, : n_hits + needed] = np.concatenate((hits, new)) if n_hits else new
            table.lens[row] = n_hits * self.block_size if length is None else length
        if self.chains.enabled:
            self.chains.set([row], [chain])
        if n_hits:
            table.cached[sid] = n_hits * self.block_size
        return sid, row, new

    def fork(self, parent: int, n: int) -> list[int]:
        """``n`` new sequences sharing every block of row ``parent``."""
        table = self.table
        table.check_room(n, f"fork_many(..., {n})")
        children = list(range(table.next_id, table.next_id + n))
        rows = table.next_free(n)
        self._log.append((table.restore, table.save(rows, acquiring=True)))
        self._log.append((table.shared.__setitem__, parent, table.shared.item(parent)))
        table.acquire_many(children)
        length, released = table.lens.item(parent), table.released.item(parent)
        table.tables[rows] = table.tables[parent]  # released entries (-1) too
        table.lens[rows] = length
        table.released[rows] = released
        held = table.tables[parent, released : cdiv(length, self.block_size)]
        self.pool.add_refs(held.astype(np.intp), n)
        if length % self.block_size:  # a partly filled last block is now shared
            table.shared[parent] = True
            table.shared[rows] = True
        if self.chains.enabled:
            table.tail[rows] = table.tail[parent]
            table.pending[rows] = table.pending[parent]
            chain = self.chains[parent]
            self.chains.set(rows.tolist(), [chain.copy() for _ in range(n)])
        return children

    def release(self, rows: list[int]) -> None:
        """Drop the sequences' references (each one's last block first) and their rows."""
        table = self.table
        if len(rows) == 1:
            return self._release_one(rows[0])
        row_array = np.array(rows, np.intp)
        self._log.append((table.restore, table.save(row_array)))
        # Each row's blocks, last first, row after row (views of the flat table, joined once).
        width, flat, lens, live = table.width, table.flat, table.lens, table.live
        runs = []
        for row in rows:
            length = lens.item(row)
            if length and live.item(row) >= 0:  # a swapped-out row holds none
                start = row * width
                end = start + cdiv(length, self.block_size)
                runs.append(flat[start + table.released.item(row) : end][::-1])
        if runs:
            entries = np.concatenate(runs) if len(runs) > 1 else runs[0]
            self.pool.release(entries, repeats=len(runs) > 1)
        self.chains.drop(rows)
        table.release(row_array)

    def _release_one(self, row: int) -> None:
        """:meth:`release` of one sequence (``free``, an engine's finished request): what it
        does for many rows, in scalar reads and row stores."""
        table, bs = self.table, self.block_size
        self._log.append((table.restore_row, table.save_row(row)))
        length = table.lens.item(row)
        if length and table.live.item(row) >= 0:  # a swapped-out row holds none
            start = row * table.width
            end = start + cdiv(length, bs)
            self.pool.release(table.flat[start + table.released.item(row) : end][::-1])
        if self.chains.enabled:
            self.chains.drop([row])
        table.release_row(row)

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
        table.check_invariants()
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
