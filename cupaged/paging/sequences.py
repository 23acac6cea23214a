"""Per-sequence state in NumPy arrays: the rows, their block tables, and the verbs that write them.

Every live sequence owns one row of a few arrays (:class:`SequenceTable`), so that a decode step
for a whole batch is a handful of vectorised operations on those arrays::

    tables[row, j]   physical block of the sequence's tokens j * block_size .. (j + 1) * block_size - 1
                     (-1: released by a sliding window, see :mod:`~cupaged.paging.window`)
    lens[row]        tokens stored or reserved; the row's entries run to cdiv(lens[row], block_size)
    released[row]    leading entries released by the window (all -1): the row holds the blocks of
                     entries released[row] .. cdiv(lens[row], block_size) - 1 (0 without a window)
    sids[row]        the sequence's id (-1: a free row)
    live[row]        the id again while the sequence is resident, -1 while it is swapped out
                     (its table row is then all 0) or the row is free: one comparison checks
                     that a batch's sequences are all alive and resident
    shared[row]      the partly filled last block may be shared with another sequence (set by a
                     fork; cleared once the row has a private last block)
    version[row]     when the row's table last changed (a logical clock)
    tail[row]        token ids of the unfilled last block (prefix caching only)
    pending[row]     full blocks wait to be registered until their K/V are known written

Entries past a row's last block are 0 (padding, never read: the lengths say how many count).
With a window, a row of 11 tokens (block_size 4) that released one block::

    entry     0    1    2    3 ...        lens = 11, released = 1: it holds blocks 7 and 3
    tables   -1    7    3    0 ...        (-1: released; 0 past the last block: padding)

The table also owns the ids: ``rows`` maps each live sequence id to its row, ids are handed out
in order from ``next_id`` and never reused.

The table is the only writer of these arrays: others read them and decide what changes, and a
verb makes the change, keeps the invariants and records its undo in the transaction first. Every
row keeps one spare column past its last block (``make_room``): a decode step writes its new
block there without widening the table first.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from .._arrays.checks import as_int
from .._util import cdiv
from ..errors import CupagedError
from .transaction import Transaction

NO_ENTRIES = np.zeros(0, np.intp)
NO_ENTRIES.flags.writeable = False
_ONE32 = np.int32(1)


class _Undo:
    """The undo records of :class:`SequenceTable`'s verbs, its base: each restores saved values
    (running it twice, or when the change did not happen, leaves the same state)."""

    tables: np.ndarray
    lens: np.ndarray
    released: np.ndarray
    sids: np.ndarray
    live: np.ndarray
    version: np.ndarray
    tail: np.ndarray
    shared: np.ndarray
    pending: np.ndarray
    clock: int
    epoch: int
    free_rows: list[int]
    rows: dict[int, int]
    next_id: int
    cached: dict[int, int]

    def _save(self, rows: Any, acquiring: bool = False) -> tuple:
        """What a change of ``rows`` (a row or an ``intp`` array) may overwrite, for
        :meth:`_restore`: their entries, ids and cached counts, the free-row list and
        ``next_id``. ``acquiring``: the rows are the free ones taken next: empty, so nothing of
        them is saved."""
        mark = self._free_mark()
        if acquiring:
            taken = self.free_rows[len(self.free_rows) - rows.size :]
            return rows, None, mark, taken, self.next_id, None
        cached = self.cached
        if isinstance(rows, np.ndarray):  # (fancy indexing copies already)
            snapshot = tuple(array[rows] for array in self._row_arrays())
            kept = {sid: cached[sid] for sid in self.sids[rows].tolist() if sid in cached}
            return rows, snapshot, mark, [], self.next_id, kept
        row = rows  # one row (a free, a swap): scalars and its two rows' copies
        sid = self.sids.item(row)
        snapshot = (
            self.tables[row].copy(),
            self.lens.item(row),
            self.released.item(row),
            sid,
            self.live.item(row),
            self.shared.item(row),
            self.pending.item(row),
            self.tail[row].copy(),
        )
        kept = {sid: cached[sid]} if sid in cached else {}
        return row, snapshot, mark, [], self.next_id, kept

    def _restore(self, saved: tuple) -> None:
        """Put back what :meth:`_save` saved (a rollback; running it twice changes nothing)."""
        rows, snapshot, mark, taken, next_id, cached = saved
        row_list = rows.tolist() if isinstance(rows, np.ndarray) else [rows]
        for sid, row in zip(self.sids[rows].reshape(-1).tolist(), row_list, strict=True):
            if sid >= 0 and self.rows.get(sid) == row:  # ids the rows hold now
                del self.rows[sid]
                self.cached.pop(sid, None)
        if snapshot is None:  # rows that were free: empty again
            self.tables[rows] = self.lens[rows] = self.released[rows] = 0
            self.sids[rows] = self.live[rows] = -1
            self.shared[rows] = self.pending[rows] = False
        else:
            for array, saved_rows in zip(self._row_arrays(), snapshot, strict=True):
                if array.ndim == 2 and saved_rows.shape[-1] != array.shape[1]:  # widened since
                    array[rows, saved_rows.shape[-1] :] = 0
                    array[rows, : saved_rows.shape[-1]] = saved_rows
                else:
                    array[rows] = saved_rows
            for sid, row in zip(self.sids[rows].reshape(-1).tolist(), row_list, strict=True):
                if sid >= 0:
                    self.rows[sid] = row
            self.cached.update(cached)
        self.version[rows] = self.clock  # batches refresh these rows
        del self.free_rows[mark + self.tables.shape[0] - len(taken) :]
        self.free_rows += taken
        self.next_id = next_id
        self.epoch += 1  # residency may change back (after the change: see `epoch`)

    def _unacquire(self, row: int, mark: int, sid: int) -> None:
        """Undo of :meth:`acquire` of ``sid`` into free ``row`` (``mark``: :meth:`_free_mark`
        before): the row is empty and free again."""
        if self.rows.get(sid) == row:
            del self.rows[sid]
            self.cached.pop(sid, None)
        self.tables[row] = self.lens[row] = self.released[row] = 0
        self.sids[row] = self.live[row] = -1
        self.shared[row] = self.pending[row] = False
        self.version[row] = self.clock
        del self.free_rows[mark + self.tables.shape[0] - 1 :]
        self.free_rows.append(row)
        self.next_id = sid
        self.epoch += 1  # a sequence stopped being one (after the change: see `epoch`)

    def _free_mark(self) -> int:
        """Where the free-row list ends now, counted back from the table's row count: growing
        the rows puts the new ones at the list's head (taken last), which moves its end and the
        row count alike, so a later rollback in the same call finds the same place."""
        return len(self.free_rows) - self.tables.shape[0]

    def _ungrow(self, rows: Any, lens: Any, at: Any, old: Any, width: int, unshare: Any,
                shared: Any) -> None:  # fmt: skip
        """Undo of :meth:`grow` (``at``: flat entries at the table's ``width`` then)."""
        if at.size:
            self.tables[at // width, at % width] = old
        self.lens[rows] = lens
        if unshare is not None:
            self.shared[unshare] = shared
        self.version[rows] = self.clock

    def _ungrow_one(self, row: int, length: int, column: int) -> None:
        """Undo of :meth:`grow_one` with a new block (its entry was padding)."""
        self.tables[row, column] = 0
        self.lens[row] = length
        self.version[row] = self.clock

    def _unrelease(self, rows: Any, start: Any, at: Any, width: int, blocks: Any) -> None:
        """Undo of :meth:`release_leading` (the pool's own record restores the references)."""
        self.tables[at // width, at % width] = blocks
        self.released[rows] = start
        self.version[rows] = self.clock

    def _put(self, name: str, rows: Any, values: Any) -> None:
        """Undo of a change of one array's entries (``name``: ``shared``, ``pending``, ``tail``),
        read at rollback: the arrays may have grown since."""
        getattr(self, name)[rows] = values
        self.version[rows] = self.clock

    def _row_arrays(self) -> tuple[np.ndarray, ...]:
        t = self
        return (t.tables, t.lens, t.released, t.sids, t.live, t.shared, t.pending, t.tail)


class SequenceTable(_Undo):
    """The rows of the live sequences and their ids; grows by doubling (rows and width apart).

    Args:
        block_size: tokens per block.
        tail_width: token ids kept per row for its unfilled last block (``block_size`` with
            prefix caching, else 0).
        window_left: the sliding window whose releases the rows follow (-1: none; read by the
            plans the table issues).
        transaction: where the verbs record their undo (the manager's; one of its own by
            default).
    """

    def __init__(
        self,
        block_size: int,
        tail_width: int = 0,
        rows: int = 16,
        width: int = 16,
        window_left: int = -1,
        transaction: Transaction | None = None,
    ):
        self.block_size = block_size
        self.window_left = window_left
        self._log = (transaction or Transaction()).log  # (the same list for its life)
        self.tables = np.zeros((rows, width), np.int32)
        self.flat = self.tables.reshape(-1)  # the same memory: entry row * width + j
        self.lens = np.zeros(rows, np.int32)
        self.released = np.zeros(rows, np.int32)
        self.sids = np.full(rows, -1, np.int64)
        self.live = np.full(rows, -1, np.int64)
        self.version = np.zeros(rows, np.int64)
        self.tail = np.zeros((rows, tail_width), np.int64)
        self.shared = np.zeros(rows, bool)
        self.pending = np.zeros(rows, bool)
        self.clock = 1
        # An upper bound on the blocks any row holds: a decode step raises it by one without a
        # reduction over the batch, and only when it reaches the width is the true maximum taken.
        self.held_bound = 0
        # Bumped whenever a resident sequence stops being one (freed, swapped out), always after
        # the change: a batch checked at the same epoch needs no new check, and a batch made
        # (without a lock) while another thread frees one of its sequences keeps the earlier
        # epoch, so its first use checks again.
        self.epoch = 0
        self.free_rows: list[int] = list(range(rows - 1, -1, -1))
        self.rows: dict[int, int] = {}  # live sequence id -> row
        self.next_id = 0
        self.cached: dict[int, int] = {}  # live sequence id -> prompt tokens found cached

    @property
    def width(self) -> int:
        return self.tables.shape[1]

    # ------------------------------------------------------------------------------ ids

    def row(self, sid: Any) -> int:
        """The row of live sequence ``sid`` (resident or swapped out).

        Raises:
            KeyError: ``sid`` is unknown or was freed.
        """
        row = self.rows.get(sid) if type(sid) is int else None
        if row is not None:  # a live plain int: mostly
            return row
        if isinstance(sid, (int, np.integer)) and not isinstance(sid, (bool, np.bool_)):
            row = self.rows.get(int(sid))
            if row is not None:
                return row
            if 0 <= sid < self.next_id:
                raise KeyError(f"sequence {sid} was already freed")
        raise KeyError(f"unknown sequence id {sid!r}")

    def resident_row(self, sid: Any) -> int:
        """:meth:`row` of a sequence whose blocks are on the device.

        Raises:
            KeyError: unknown or freed. CupagedError: swapped out.
        """
        row = self.row(sid)
        live = self.live.item(row)
        if live != sid:  # (ids are never reused: the row's own sequence, resident, or neither)
            if live >= 0:  # the row went to another sequence: read while another thread freed it
                raise KeyError(f"sequence {sid} was already freed")
            raise CupagedError(f"sequence {sid} is swapped out; call swap_in({sid}) first")
        return row

    def resident_rows(self, sids: list[Any]) -> list[int]:
        """:meth:`resident_row` of each id (plain resident ints looked up inline)."""
        get, live, rows = self.rows.get, self.live, []
        for sid in sids:
            row = get(sid) if type(sid) is int else None
            if row is None or live.item(row) != sid:
                row = self.resident_row(sid)  # raises, or takes the slow path of an np.integer
            rows.append(row)
        return rows

    def distinct_rows(self, sids: Iterable[Any]) -> np.ndarray:
        """Rows of distinct resident sequences, as an ``intp`` array."""
        if isinstance(sids, (str, bytes)) or not isinstance(sids, Iterable):
            as_int(sids, "sequence id")  # raises the TypeError
        sid_list = list(sids)
        rows = self.resident_rows(sid_list)
        if len(set(rows)) != len(rows):
            raise ValueError(f"expected distinct sequence ids, got {sid_list}")
        return np.array(rows, np.intp)

    def held(self, row: int) -> int:
        """Entries of a resident row up to its last block (released ones included: the row holds
        blocks ``tables[row, released[row] : held(row)]``)."""
        return cdiv(self.lens.item(row), self.block_size)

    # ------------------------------------------------------------------------------ rows

    def acquire(
        self,
        blocks: np.ndarray | None = None,
        length: int = 0,
        cached: int = 0,
        tail: np.ndarray | None = None,
        pending: bool = False,
    ) -> tuple[int, int]:
        """A new resident sequence (the id ``next_id``) on a free row: holding ``blocks`` from
        entry 0, ``length`` tokens long, ``cached`` of them found in the prefix cache, ``tail``
        the ids of its partly filled last block, ``pending``: full blocks wait for a commit.

        Returns:
            ``(sid, row)``.
        """
        if not self.free_rows:
            self._grow_rows(2 * self.tables.shape[0])  # (no undo: growing keeps every row)
        sid, row = self.next_id, self.free_rows[-1]
        self._log.append((self._unacquire, row, self._free_mark(), sid))
        self.free_rows.pop()
        self.sids[row] = self.live[row] = sid
        self.version[row] = self.clock
        self.rows[sid] = row
        self.next_id = sid + 1
        if blocks is not None and blocks.size:
            self.make_room(blocks.size)
            self.tables[row, : blocks.size] = blocks
        if length:
            self.lens[row] = length
        if tail is not None and tail.size:
            self.tail[row, : tail.size] = tail
        if pending:
            self.pending[row] = True
        if cached:
            self.cached[sid] = cached
        return sid, row

    def clone(self, parent: int, n: int) -> tuple[list[int], np.ndarray]:
        """``n`` new sequences that copy resident row ``parent``: its entries (released ones
        too), length, released count, tail and pending flag; a partly filled last block is then
        shared by all of them (the caller adds the blocks' references).

        Returns:
            ``(sids, rows)``.
        """
        while len(self.free_rows) < n:  # (no undo: growing keeps every row)
            self._grow_rows(2 * self.tables.shape[0])
        rows = np.array(self.free_rows[: -n - 1 : -1], dtype=np.intp)
        sids = list(range(self.next_id, self.next_id + n))
        self._log.append((self._restore, self._save(rows, acquiring=True)))
        self._log.append((self._put, "shared", parent, self.shared.item(parent)))
        del self.free_rows[-n:]
        self.sids[rows] = self.live[rows] = sids
        self.version[rows] = self.clock
        self.rows.update(zip(sids, rows.tolist(), strict=True))
        self.next_id += n
        self.tables[rows] = self.tables[parent]  # released entries (-1) too
        self.lens[rows] = self.lens.item(parent)
        self.released[rows] = self.released.item(parent)
        if self.tail.shape[1]:  # (prefix caching)
            self.tail[rows] = self.tail[parent]
        if self.pending.item(parent):  # (the rows were free: not pending)
            self.pending[rows] = True
        if self.lens.item(parent) % self.block_size:  # a partly filled last block: shared now
            self.shared[parent] = True
            self.shared[rows] = True
        return sids, rows

    def free(self, rows: list[int]) -> np.ndarray | None:
        """End the sequences of ``rows``: their rows are zeroed and free, their ids forgotten.

        Returns:
            The blocks they held (each row's last block first, row after row: the order to drop
            their references in), ``None`` when they held none.
        """
        runs = []
        for row in rows:
            length = self.lens.item(row)
            if length and self.live.item(row) >= 0:  # a swapped-out row holds none
                start = row * self.width
                end = start + cdiv(length, self.block_size)
                runs.append(self.flat[start + self.released.item(row) : end][::-1])
        held = (np.concatenate(runs) if len(runs) > 1 else runs[0].copy()) if runs else None
        at: Any = rows[0] if len(rows) == 1 else np.array(rows, np.intp)
        self._log.append((self._restore, self._save(at)))
        for row in rows:
            sid = self.sids.item(row)
            del self.rows[sid]
            if self.cached:
                self.cached.pop(sid, None)
        self.tables[at] = 0
        self.lens[at] = self.released[at] = 0
        self.sids[at] = self.live[at] = -1
        self.shared[at] = self.pending[at] = False
        self.version[at] = self.clock
        self.free_rows.extend(rows[::-1])
        self.epoch += 1  # after the change (see `epoch`)
        return held

    # ------------------------------------------------------------------------------ steps

    def make_room(self, held: int) -> None:
        """Columns for rows holding up to ``held`` blocks, and one spare past them (the one
        spare column: a decode step writes a row's next block there, and :meth:`grow` restores
        it). Widening keeps every entry, so it needs no undo."""
        if held > self.held_bound:
            self.held_bound = held
        if held + 1 > self.tables.shape[1]:
            width = max(held + 1, 2 * self.tables.shape[1])
            tables = np.zeros((self.tables.shape[0], width), np.int32)
            tables[:, : self.tables.shape[1]] = self.tables
            self.tables, self.flat = tables, tables.reshape(-1)

    def grow(
        self,
        rows: np.ndarray,
        lens: np.ndarray,
        ends: np.ndarray,
        at: np.ndarray = NO_ENTRIES,
        blocks: Any = None,
        unshare: np.ndarray | None = None,
    ) -> None:
        """A step: rows ``rows`` (lengths ``lens``) grow to ``ends`` tokens; flat entries ``at``
        (at the current width: padding, or a shared last block replaced by its copy) get
        ``blocks``; ``unshare``: rows whose last block is their own now. Entries past a row's
        spare column need :meth:`make_room` first."""
        if not at.size and unshare is None:  # (a decode step that takes no block: mostly)
            self._log.append((self._ungrow, rows, lens, at, at, 1, None, None))
            self.lens[rows] = ends
            return
        width = self.width
        old = self.flat[at] if at.size else at
        shared = None if unshare is None else self.shared[unshare]
        self._log.append((self._ungrow, rows, lens, at, old, width, unshare, shared))
        if at.size:
            self.flat[at] = blocks
            self.version[at // width] = self.clock
        self.lens[rows] = ends
        if unshare is not None:
            self.shared[unshare] = False
        if at.size:
            self._spare()

    def grow_one(self, row: int, length: int, block: int = -1) -> None:
        """One token for row ``row`` (``length`` tokens before). Into its own last block: a
        single store, no undo (the caller holds the claim with an empty log: an interrupt lands
        before or after it). With ``block``: into that new block, its next entry (the spare
        column), undo recorded."""
        if block < 0:
            self.lens[row] = length + 1
            return
        column = length // self.block_size
        self._log.append((self._ungrow_one, row, length, column))
        self.tables[row, column] = block
        self.lens[row] = length + 1
        self.version[row] = self.clock
        self._spare()

    def _spare(self) -> None:
        """Rows hold one more block each (at most): the spare column again (see held_bound)."""
        self.held_bound += 1
        if self.held_bound + 1 > self.tables.shape[1]:
            # The true maximum over all rows, then widen if needed, and only then the lower
            # bound stored: an interrupt before leaves the old one (an upper bound still).
            held = cdiv(int(self.lens.max()), self.block_size)
            self.make_room(held)
            self.held_bound = held

    def release_leading(
        self, rows: np.ndarray, start: np.ndarray, stop: np.ndarray, at: np.ndarray
    ) -> np.ndarray:
        """The window releases entries ``start[i] .. stop[i] - 1`` of ``rows[i]``, at flat
        entries ``at`` (at the current width, in the order their blocks go): the entries become
        ``-1`` and ``released`` is ``stop``.

        Returns:
            Their blocks, in the order of ``at`` (``intp``).
        """
        blocks = self.flat[at].astype(np.intp)
        self._log.append((self._unrelease, rows, start, at, self.width, blocks))
        self.flat[at] = -1
        self.released[rows] = stop
        self.version[rows] = self.clock
        return blocks

    # ------------------------------------------------------------------------------ prefix chains

    def mark_pending(self, rows: Any, pending: bool) -> None:
        """Set the pending flag of ``rows`` (a row, a list or an array of rows)."""
        self._log.append((self._put, "pending", rows, self.pending[rows]))  # (a copy)
        self.pending[rows] = pending

    def write_tails(self, rows: Any, offset: Any, tokens: Any) -> None:
        """A step's new token ids into the tails of ``rows`` at ``offset`` (each row's length
        modulo the block size before the step): past every id the tails hold, so no undo."""
        self.tail[rows, offset] = tokens

    def restart_tail(self, row: int, tokens: np.ndarray) -> None:
        """Row ``row``'s tail is ``tokens`` from position 0 (a step filled its block)."""
        self._log.append((self._put, "tail", row, self.tail[row].copy()))
        self.tail[row, : tokens.size] = tokens

    # ------------------------------------------------------------------------------ swapping

    def detach(self, row: int) -> np.ndarray:
        """Swap resident ``row`` out: its held blocks (entries ``released .. held - 1``, in order,
        a copy) are returned for the caller to release; the row keeps its length, released count
        and id, with an all-zero table, ``live = -1`` and no shared block."""
        blocks = self.tables[row, self.released.item(row) : self.held(row)].copy()
        self._log.append((self._restore, self._save(row)))
        self.tables[row] = 0
        self.live[row] = -1
        self.shared[row] = False
        self.version[row] = self.clock
        self.epoch += 1  # after the change (see `epoch`): batches holding it check again
        return blocks

    def attach(self, row: int, sid: int, blocks: Any) -> None:
        """Make swapped-out ``row`` (sequence ``sid``) resident again on ``blocks``, one per entry
        it held: the entries its window released stay ``-1`` (one spare column kept)."""
        blocks = np.asarray(blocks, np.int32)
        self._log.append((self._restore, self._save(row)))
        start = self.released.item(row)
        self.make_room(start + blocks.size)
        self.tables[row, :start] = -1
        self.tables[row, start : start + blocks.size] = blocks
        self.live[row] = sid
        self.version[row] = self.clock

    # ------------------------------------------------------------------------------ batches

    def tick(self) -> int:
        """The clock now, then advanced: a batch that refreshes its device tables at this tick
        refreshes next the rows whose ``version`` is past it."""
        clock = self.clock
        self.clock = clock + 1
        return clock

    def touch_all(self) -> None:
        """Every row counts as changed (after a rollback: batches refresh all of theirs)."""
        self.version[:] = self.clock

    # ------------------------------------------------------------------------------ checking

    def check_room(self, n: int, what: str) -> None:
        """Refuse ``n`` new rows that the host's free memory cannot hold, before growing.

        Raises:
            MemoryError: naming the call, the bytes it needs and the bytes available.
        """
        if len(self.free_rows) < n:
            row_bytes = self.width * 4 + self.tail.shape[1] * 8 + 50  # every array's entries
            need = (self.tables.shape[0] + n) * row_bytes
            available = _available_memory()
            if available is not None and need > available:
                raise MemoryError(
                    f"{what}: expected new sequences whose table rows fit in the host's free "
                    f"memory ({available / 2**30:.1f} GiB), got {n} needing "
                    f"{need / 2**30:.1f} GiB"
                )

    def _grow_rows(self, rows: int) -> None:
        # No undo: growing keeps every row, and the new rows are free. Everything is built
        # first and then stored with no call in between, so no interrupt splits it.
        old = self.tables.shape[0]

        def grown(array: np.ndarray, fill: int) -> np.ndarray:
            out = np.full((rows, *array.shape[1:]), fill, array.dtype)
            out[:old] = array
            return out

        tables, lens, released = grown(self.tables, 0), grown(self.lens, 0), grown(self.released, 0)
        flat = tables.reshape(-1)
        sids, live = grown(self.sids, -1), grown(self.live, -1)
        shared, pending = grown(self.shared, False), grown(self.pending, False)
        version, tail = grown(self.version, 0), grown(self.tail, 0)
        free = list(range(rows - 1, old - 1, -1))
        self.tables, self.lens, self.flat, self.sids, self.live = tables, lens, flat, sids, live
        self.released, self.shared, self.pending = released, shared, pending
        self.version, self.tail = version, tail
        self.free_rows[:0] = free


def _available_memory() -> int | None:
    """Bytes of physical memory free now (``None`` where the OS does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
