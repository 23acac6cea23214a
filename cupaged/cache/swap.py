"""Swapping a sequence's K/V to host memory and back (preemption without recomputation).

:class:`Swapper` owns the host copies of swapped-out sequences; :class:`~cupaged.PagedCache`
composes it with its table, pool, chains and K/V arrays, and calls it inside its transaction. A
swapped-out sequence keeps its row (length, prefix chain, released count) with an all-zero table
and ``live = -1``, and holds no device block::

    swap_out:  gather its blocks' K/V (every layer) -> pinned host buffers; release the blocks
    swap_in:   take fresh blocks; copy the host K/V in; register its committed blocks again

With a sliding window only the blocks it holds travel: the entries the window released (``-1``)
are ``-1`` again after the swap-in, and the host copy has ``ceil(n / block_size) - released``
blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays.checks import require
from .._util import cdiv
from ..dtypes import as_storage
from ..errors import CupagedError
from ..paging.chains import Chains
from ..paging.pool import BlockPool, grouped
from ..paging.sequences import SequenceTable
from ..paging.transaction import Transaction


class Swapper:
    """Host copies of swapped-out sequences, and the moves between device and host.

    Args:
        table, pool, chains, transaction: the cache's bookkeeping (undo goes to ``transaction``).
        k, v: the cache's ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`` arrays.
        xp: their array module (NumPy or CuPy).

    Its array work (gathers, host copies) runs on the storage views of the pages: ``uint16``
    for a native bfloat16 cache of CuPy 14, whose own, experimental bfloat16 kernels it never
    needs; :meth:`gather` hands back the cache's dtype.
    """

    def __init__(
        self,
        table: SequenceTable,
        pool: BlockPool,
        chains: Chains,
        transaction: Transaction,
        k: Any,
        v: Any,
        xp: Any,
    ) -> None:
        self.table, self.pool, self.chains = table, pool, chains
        self.transaction = transaction
        self._log = transaction.log  # (the same list for the transaction's life)
        self.dtype = k.dtype
        self.k, self.v, self.xp = as_storage(k), as_storage(v), xp
        self._host: dict[int, tuple[Any, Any]] = {}  # sid -> host (k, v) [L, n_blocks, ...]

    def __contains__(self, sid: int) -> bool:
        return sid in self._host

    def __len__(self) -> int:
        return len(self._host)

    def swap_out(self, sid: int) -> None:
        """Move ``sid``'s K/V to host memory and free its device blocks (inside a call)."""
        table, xp = self.table, self.xp
        row = table.resident_row(sid)
        blocks = table.tables[row, table.released.item(row) : table.held(row)]
        index = xp.asarray(blocks.astype(np.intp))
        host = []
        for pages in (self.k, self.v):  # (before any change: a failed copy changes nothing)
            gathered = pages[:, index]  # [num_layers, n_blocks, heads, block_size, head_dim]
            buffer = _host_empty(xp, gathered.shape, gathered.dtype)
            if xp is np:
                buffer[...] = gathered
            else:
                gathered.get(out=buffer)
            host.append(buffer)
        self._log.append((self._forget, sid))
        held = table.detach(row)  # (its undo recorded; batches holding it check again)
        self.pool.release(held[::-1].copy())
        self._host[sid] = (host[0], host[1])

    def swap_in(self, sid: int) -> None:
        """Bring a swapped-out sequence back on fresh blocks (inside a call).

        Raises:
            CupagedError: ``sid`` is not swapped out. OutOfBlocksError: too few blocks (nothing
            changes).
        """
        table, xp = self.table, self.xp
        row = table.row(sid)
        if sid not in self._host:
            raise CupagedError(f"sequence {sid} is not swapped out")
        k_host, v_host = self._host[sid]
        n_blocks = k_host.shape[1]
        blocks = self.pool.allocate(n_blocks)  # raises before any change (its undo recorded)
        self._log.append((self._host.__setitem__, sid, (k_host, v_host)))
        index = xp.asarray(np.asarray(blocks, dtype=np.intp))
        self.transaction.kv_written = True
        self.k[:, index] = xp.asarray(k_host)
        self.v[:, index] = xp.asarray(v_host)
        start = table.released.item(row)  # entries the window released stay released
        table.attach(row, sid, blocks)  # (its undo recorded)
        del self._host[sid]
        self.chains.register_again(row, blocks, start)

    def gather(self, row: int) -> tuple[Any, Any]:
        """Copies of a resident row's keys and values, in token order: each ``[num_layers,
        length, num_kv_heads, head_dim]``, zeros for the tokens of released blocks."""
        table, xp = self.table, self.xp
        length, start = table.lens.item(row), table.released.item(row)
        blocks = xp.asarray(table.tables[row, start : table.held(row)].astype(np.intp))
        out = []
        for pages in (self.k, self.v):
            layers, _, heads, block_size, head_dim = pages.shape
            gathered = pages[:, blocks].transpose(0, 1, 3, 2, 4)  # [L, n, block_size, H, D]
            tokens = gathered.reshape(layers, blocks.size * block_size, heads, head_dim)
            if start:  # the released blocks' tokens first: zeros
                kept = xp.zeros((layers, length, heads, head_dim), pages.dtype)
                kept[:, start * block_size :] = tokens[:, : length - start * block_size]
                out.append(kept)
            else:
                out.append(tokens[:, :length].copy())
        return out[0].view(self.dtype), out[1].view(self.dtype)

    def drop(self, sids: list[int]) -> None:
        """Forget the host copies of freed sequences (inside a call)."""
        dropped = {sid: self._host[sid] for sid in sids if sid in self._host}
        if dropped:
            self._log.append((self._host.update, dropped))
            for sid in dropped:
                del self._host[sid]

    def check_invariants(self, block_size: int) -> None:
        """A swapped-out sequence of ``n`` tokens keeps ``ceil(n / block_size)`` host blocks,
        less those the window released."""
        table = self.table
        for sid, row in table.rows.items():
            swapped = sid in self._host
            require(
                swapped == (table.live.item(row) < 0),
                f"sequence {sid} is {'' if swapped else 'not '}swapped but its row says otherwise",
            )
            if swapped:
                n_blocks = self._host[sid][0].shape[1]
                length, released = table.lens.item(row), table.released.item(row)
                require(
                    n_blocks == cdiv(length, block_size) - released,
                    f"swapped sequence {sid} has {length} tokens ({released} blocks released) in "
                    f"{n_blocks} host blocks",
                )
        require(self._host.keys() <= table.rows.keys(), "a freed sequence kept its host copy")

    def _forget(self, sid: int) -> None:
        self._host.pop(sid, None)


class DeferredCopies:
    """Copy-on-write copies a step left to the caller (``step(..., apply_copies=False)``), by
    destination: the only pairs :meth:`PagedCache.apply_copies` copies. Any other destination
    may hold another sequence's written tokens (or a cached prefix), which a copy would
    overwrite.

    Each pair left to apply holds one reference to its source block (``pool.hold``: a reference
    that is no sharer, so the block's table holder still writes in place), so that the block
    keeps the bytes the copy must read whatever happens before it is applied:
    the sequences that share it freed, swapped out or moved past it by their window, its block
    can go to no other sequence. The hold goes when the pair is applied, or when the sequence
    it copies for is freed (the copy is moot then). A sequence with a copy left to apply is
    not swapped out (its block would travel without the bytes the copy brings)::

        step(..., apply_copies=False)   pair src -> dst left: src held (+1), dst in the row
        free(every sharer of src)       src stays in use: no other sequence takes it
        apply_copies(src, dst)          src -> dst copied, then the hold let go

    Args:
        table, pool, transaction: the cache's bookkeeping (undo goes to ``transaction``).
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
                f"cache left to apply, got destination {repeated} twice"
            )
        for s, d in zip(src, dst, strict=True):
            entry = left.get(d)
            if entry is None or entry[0] != s or not self._applicable(d, entry):
                raise ValueError(
                    f"expected copy-on-write pairs that a step(..., apply_copies=False) of "
                    f"this cache left to apply, got {s} -> {d}"
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
                f"call apply_copies first"
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


def _host_empty(xp: Any, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Host memory for a swapped-out sequence: pinned when the cache is on the GPU."""
    if xp is np:
        return np.empty(shape, dtype)
    import cupyx

    return cupyx.empty_pinned(shape, dtype)
