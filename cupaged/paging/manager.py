"""BlockManager: the bookkeeping of a paged KV cache, with no K/V arrays.

Token ``pos`` of a sequence lives in physical block ``table[pos // block_size]`` at offset
``pos % block_size``. With ``block_size = 4``, a sequence of 7 tokens whose table is ``[5, 2]``::

    logical block    0                 1
    tokens           0  1  2  3        4  5  6  .
                     |  |  |  |        |  |  |
    physical block   5 [0  1  2  3]    2 [4  5  6  .]     <- one free slot left in block 2

Its 8th token (position 7) fills block 2; the 9th takes a new block from the pool.

Blocks are shared by reference: :meth:`BlockManager.fork` gives a child the parent's table and bumps
every block's refcount. The first write into a shared, partly filled last block gets a fresh block
and a *copy* ``(src, dst)`` in the step's plan (copy-on-write); full shared blocks are never written
again, so they are never copied. :class:`~cupaged.PagedCache` has one of these, owns the K/V
arrays and applies the copies itself; an engine that owns its own tensors uses ``BlockManager``
directly and applies them (one ``copy_blocks`` per step, for all layers, or ``step(...,
copy=...)`` to apply them inside the step's transaction).

The manager composes one owner per piece of state and passes each what it works on::

    Transaction     the guard and the undo log of the public call in progress
    BlockPool       free stack, refcounts, key -> block map, LRU of evictable blocks
    SequenceTable   the sequences' rows: block tables, lengths, ids
    PrefixCache     the chain walk: keys of full blocks, matching a prompt
    Chains          each sequence's prefix chain, and registering its blocks
    Planner         a step's slots, new blocks and copies
    Window          with window_left >= 0, releasing the blocks no query can see any more
    DeferredCopies  copy-on-write pairs left to apply, holding their sources

Every public call that changes state is ``validate -> plan -> apply`` inside the transaction: what
can fail runs before the first change, and each change records its undo first. Swapping is
bookkeeping here too (``swap_out`` frees a sequence's blocks and hands their ids over,
``swap_in`` takes fresh ones): whoever owns the K/V moves the bytes of those ids inside the same
``with manager.transaction():``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from .._arrays.checks import as_int
from .._util import cdiv
from ..backend import device_module, resolve_device, to_numpy
from ..errors import CupagedError
from ..variants import check_window_left
from .batch import SequenceBatch
from .chains import Chains
from .copies import DeferredCopies
from .lifecycle import Lifecycle
from .planner import NO_SLOTS, Planner
from .pool import BlockPool
from .prefix import BlockHasher, PrefixCache, PrefixCacheStats, as_salt
from .results import Admission, OneSlots, StepPlan, StepStamp
from .sequences import SequenceTable
from .tokens import step_tokens, token_array, token_counts
from .transaction import Transaction, atomic, forwards, run_atomically
from .window import Window

_INT32_MAX = 2**31 - 1


def _checked_sizes(num_blocks: Any, block_size: Any) -> tuple[int, int]:
    """The pool's sizes, as ints: each at least 1, and slots (``num_blocks * block_size``) int32.

    Raises:
        TypeError: not ints. ValueError: out of range.
    """
    num_blocks = as_int(num_blocks, "num_blocks")
    block_size = as_int(block_size, "block_size")
    if num_blocks < 1:
        raise ValueError(f"expected num_blocks >= 1, got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"expected block_size >= 1, got {block_size}")
    if num_blocks * block_size > _INT32_MAX:
        raise ValueError(
            f"expected num_blocks * block_size <= {_INT32_MAX} (slots are int32), "
            f"got {num_blocks} * {block_size}"
        )
    return num_blocks, block_size


class BlockManager:
    """Block pool, per-sequence block tables, refcounts, copy-on-write plans and prefix caching.

    No K/V arrays: this is what :class:`~cupaged.PagedCache` composes, and what an engine that
    owns its tensors uses. The step API works on whole batches::

        batch = manager.batch(sids)                  # resolve the ids once
        plan = manager.step(batch)                   # one token each: slots and copies
        copy_blocks(k_all_layers, v_all_layers, plan.copy_src, plan.copy_dst)   # if any
        tables, lens = manager.block_tables(batch)   # once per step, for every layer

    Args:
        num_blocks: physical blocks in the pool.
        block_size: tokens per block.
        device: where slot mappings and block tables go: ``"cuda"`` (CuPy arrays), ``"cpu"``
            (NumPy arrays) or ``None`` for CUDA when CuPy sees a GPU and the CPU otherwise.
        enable_prefix_caching: register full blocks by content so that sequences sharing a prompt
            prefix share its blocks; ``tokens=`` then carries the new tokens' ids (it is accepted,
            and checked, in every mode, so callers need no branch).
        block_hasher: the :data:`~cupaged.paging.prefix.BlockHasher` of prefix caching (BLAKE2b by
            default); tests inject colliding ones.
        window_left: a sliding window ``W``: the query at ``i`` sees keys ``j >= i - W``, and each
            growing call first releases the blocks before its first query's window (their
            entries become ``-1``; see :mod:`~cupaged.paging.window`). ``-1``: no window.

    Example:
        >>> manager = BlockManager(num_blocks=8, block_size=4, device="cpu")
        >>> a = manager.admit([7, 8, 9, 10, 11, 12]).sid    # 6 tokens: blocks 0 and 1
        >>> b = manager.fork(a)                             # shares both blocks
        >>> plan = manager.step([a, b])     # both write into shared block 1: a copies it first,
        >>> plan.copy_src.tolist(), plan.copy_dst.tolist()  # b, its last holder, writes in place
        ([1], [2])
        >>> manager.block_table(a), manager.block_table(b), plan.slots.tolist()
        ([0, 2], [0, 1], [10, 6])
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        device: str | None = None,
        enable_prefix_caching: bool = False,
        block_hasher: BlockHasher | None = None,
        window_left: int = -1,
    ) -> None:
        num_blocks, block_size = _checked_sizes(num_blocks, block_size)
        if block_hasher is not None and not enable_prefix_caching:
            raise ValueError("block_hasher= needs enable_prefix_caching=True")
        window = check_window_left(window_left)
        self.device = resolve_device(device)
        self.prefix_caching = bool(enable_prefix_caching)
        self._xp = device_module(self.device)
        self._capacity = num_blocks * block_size  # tokens the pool can ever hold
        self._transaction = Transaction()
        self._pool = BlockPool(num_blocks, self._transaction)
        self._index = PrefixCache(self._pool, block_size, block_hasher)
        tail = block_size if self.prefix_caching else 0
        self._table = SequenceTable(
            block_size, tail, window_left=window, transaction=self._transaction
        )
        self._chains = Chains(
            self._table, self._pool, self._index, self._transaction, self.prefix_caching
        )
        self._planner = Planner(self._table, self._pool, self._chains, self._transaction)
        self._lifecycle = Lifecycle(
            self._table, self._pool, self._index, self._chains, self._planner, self._transaction
        )
        owners = (self._table, self._pool, self._chains, self._transaction)
        self._window = Window(window, *owners) if window >= 0 else None
        self._one_slot = OneSlots()
        self._copies = DeferredCopies(self._table, self._pool, self._transaction)
        # After any rollback every row counts as changed: batches refresh their device tables.
        self._transaction.after_rollback.append(self._table.touch_all)

    # ----------------------------------------------------------------------------- introspection

    @property
    def num_blocks(self) -> int:
        """Physical blocks in the pool."""
        return self._pool.num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._table.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any sequence (cached but evictable ones included)."""
        return self._pool.num_free

    @property
    def window_left(self) -> int:
        """The sliding window (``-1``: none); the plans and tables this manager makes carry it."""
        return self._table.window_left

    @property
    def pool(self) -> BlockPool:
        """The :class:`~cupaged.BlockPool` (read it; changing it by hand breaks the tables)."""
        return self._pool

    def transaction(self) -> Transaction:
        """The manager's :class:`~cupaged.paging.transaction.Transaction`, for compound calls.

        ``with manager.transaction():`` runs a block as one call: exclusive (another thread is
        refused) and all or nothing (an exception out of the block, ``KeyboardInterrupt``
        included, undoes every change the block's calls made). The public calls made directly
        in the block join it; a call from elsewhere meanwhile (a signal handler, a callback) is
        refused. Owners of K/V record the undo of their own changes with ``record``::

            with manager.transaction():
                blocks = manager.swap_out(sid)          # the bookkeeping: ids handed over
                host[sid] = k_pages[:, blocks].copy()   # the bytes, before anything reuses them
        """
        return self._transaction

    def lengths(self, sids: Iterable[int] | SequenceBatch) -> tuple[np.ndarray, np.ndarray]:
        """``(lens, released)`` of live sequences (resident or swapped out): each one's length
        and the leading blocks its window released (0 without a window), ``[len(sids)]`` int32
        host arrays (copies)."""
        if isinstance(sids, SequenceBatch):
            rows = self._rows_of(sids)
        else:
            rows = np.array([self._table.row(sid) for sid in sids], np.intp)
        return self._table.lens[rows], self._table.released[rows]

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Hits, misses, evictions and served tokens of prefix caching (a snapshot)."""
        return replace(self._index.stats, evictions=self._pool.evictions)

    @property
    def sequence_ids(self) -> list[int]:
        """Ids of the live sequences, oldest first."""
        return list(self._table.rows)

    def num_cached_tokens(self, sid: int) -> int:
        """Prompt tokens of ``sid`` found in the prefix cache when it was added or admitted.

        The caller computes K/V for the rest of the prompt only: ``prompt[num_cached_tokens:]``.
        """
        self._table.row(sid)
        return self._table.cached.get(sid, 0)

    def is_swapped(self, sid: int) -> bool:
        """Whether sequence ``sid`` is swapped out to host memory."""
        return self._table.live.item(self._table.row(sid)) < 0

    def seq_len(self, sid: int) -> int:
        """Number of tokens stored (or reserved) for sequence ``sid``."""
        return self._table.lens.item(self._table.row(sid))

    def block_table(self, sid: int) -> list[int]:
        """Physical block ids of sequence ``sid`` in logical order (a copy); ``-1`` for a block
        that the window released (the entries keep their positions)."""
        table = self._table
        row = table.resident_row(sid)
        return table.tables[row, : table.held(row)].tolist()

    def refcount(self, block: int) -> int:
        """Number of sequences whose table references physical block ``block`` (a released
        entry, ``-1``, is no block: ``ValueError``); a copy left to apply that reads it is no
        sequence (``PagedCache.pending_copies``)."""
        return self._pool.refcount(block) - int(self._pool.held_refs[block])

    # ----------------------------------------------------------------------------- lifecycle

    @atomic
    def add_sequence(
        self, tokens: Sequence[int] | None = None, cache_salt: str | bytes | None = None
    ) -> int:
        """Start a sequence and return its id; with prefix caching, attach its cached prefix.

        The sequence takes no new block until tokens arrive. With prefix caching, every leading
        full block of ``tokens`` (the prompt) already in the cache is attached (shared, refcount
        up) and :meth:`num_cached_tokens` says how many prompt tokens that covers; the block
        holding the prompt's last token is never attached, so at least one token is left to
        compute (its logits are needed). :meth:`admit` does this and reserves the rest at once.

        Args:
            tokens: the prompt's token ids (used with prefix caching, checked in every mode).
            cache_salt: a per-request salt: sequences share cached blocks only with sequences of
                the same salt.
        """
        prompt = token_array(tokens if tokens is not None else ())
        salt = as_salt(cache_salt)
        return self._lifecycle.admit(prompt, salt, reserve=False).sid

    @atomic
    def admit(self, prompt: Sequence[int], cache_salt: str | bytes | None = None) -> Admission:
        """Admit a request in one call: attach its cached prefix and reserve the rest of the prompt.

        All or nothing: :class:`OutOfBlocksError` changes nothing (counters included).

        Args:
            prompt: the prompt's token ids (matched against the prefix cache when it is enabled).
            cache_salt: a per-request salt, as in :meth:`add_sequence`.

        Returns:
            The :class:`Admission`: write K/V of ``prompt[num_cached_tokens:]`` to its slots.
        """
        prompt = token_array(prompt, "prompt")
        salt = None if cache_salt is None else as_salt(cache_salt)
        admission = self._lifecycle.admit(prompt, salt)
        admission.slots = self._on_device(admission.slots)
        return admission

    @forwards
    def fork(self, sid: int) -> int:
        """Start a sequence that shares every block of ``sid`` (parallel sampling, beam search).

        No K/V is copied: each shared block's refcount goes up by one (with a window, the blocks
        in it: the child's released entries are ``-1`` too). Whichever of the two sequences
        first writes into a shared, partly filled block gets a private copy of it.

        Returns:
            The child's id.
        """
        return self.fork_many(sid, 1)[0]

    @atomic
    def fork_many(self, sid: int, n: int) -> list[int]:
        """``n`` forks of ``sid`` at once (beam search); as :meth:`fork`, vectorised."""
        n = as_int(n, "n")
        if n < 0:
            raise ValueError(f"expected n >= 0 forks, got {n}")
        parent = self._table.resident_row(sid)
        return self._lifecycle.fork(parent, n) if n else []

    @atomic
    def free(self, sid: int) -> None:
        """End sequence ``sid``: drop its references; unshared blocks return to the pool.

        Cached full blocks are not wiped: they become evictable, last block first, so that a
        prompt's head survives eviction longest. Blocks the window released were dropped then.
        """
        rows = [self._table.row(sid)]
        if len(self._copies):  # mostly: no copy left to apply
            self._copies.forget([self._table.sids.item(rows[0])])
        self._lifecycle.release(rows)

    @atomic
    def free_many(self, sids: Iterable[int]) -> None:
        """End several sequences at once (as :meth:`free` one after the other, vectorised)."""
        sid_list = list(sids)
        rows = [self._table.row(sid) for sid in sid_list]  # raises for an unknown one
        if len(set(rows)) != len(rows):
            raise ValueError(f"expected distinct sequence ids, got {sid_list}")
        if len(self._copies):  # mostly: no copy left to apply
            self._copies.forget([self._table.sids.item(row) for row in rows])
        self._lifecycle.release(rows)

    @atomic
    def commit(self, sids: int | Iterable[int] | SequenceBatch) -> None:
        """Declare the K/V of every token reserved so far for these sequences written.

        With prefix caching a block becomes findable by other sequences only once its K/V are
        known to be written: at the sequence's next ``step`` (the previous one was computed),
        by ``append``, or here (after a prefill, or a last step whose blocks should serve later
        requests). A sequence freed before keeps them out of the cache: unwritten K/V are never
        served. Without prefix caching it does nothing.
        """
        if type(sids) is int:
            rows = [self._table.resident_row(sids)]
        else:
            rows = self._rows_of(sids).tolist()
        if self.prefix_caching:
            pending = [row for row in rows if self._table.pending.item(row)]
            if pending:
                self._chains.save(pending)
                self._chains.commit(pending)

    # ----------------------------------------------------------------------------- steps

    def batch(self, sids: Iterable[int]) -> SequenceBatch:
        """A persistent handle on a batch of resident sequences (ids resolved once)."""
        if isinstance(sids, (str, bytes)) or not isinstance(sids, Iterable):
            raise TypeError(f"expected an iterable of sequence ids, got {type(sids).__name__}")
        sid_list = [as_int(sid, "sequence id") for sid in sids]
        # The epoch before the lookups (this call takes no claim): a sequence that another thread
        # frees meanwhile moves it on, and the batch's first use checks every sequence again.
        epoch = self._table.epoch
        rows = self._table.distinct_rows(sid_list)
        return SequenceBatch(self._table, np.array(sid_list, np.int64), rows, self._xp, epoch)

    def step(
        self,
        sids: int | Iterable[int] | SequenceBatch,
        num_tokens: int | Sequence[int] | np.ndarray = 1,
        tokens: Any = None,
        *,
        tables: bool = False,
        copy: Callable[[np.ndarray, np.ndarray], None] | None = None,
        hold_copies: bool = False,
    ) -> StepPlan:
        """Make room for the next tokens of a batch: the slots to write and the blocks to copy.

        The lengths grow at once; with a window, each growing sequence first releases the blocks
        before its first new token's window (the step may take them). All or nothing: if the pool
        cannot hold every token of every sequence, :class:`OutOfBlocksError` is raised and
        nothing changes (nothing is released). Apply the plan's copies
        (``copy_blocks(k, v, plan.copy_src, plan.copy_dst)`` over every layer) before writing K/V
        into its slots.

        Args:
            sids: a :class:`SequenceBatch` of this manager, one sequence id, or several distinct
                ones.
            num_tokens: tokens per sequence: one int for all, or one per sequence.
            tokens: the new tokens' ids: a ``[B]`` array or list (one token each), a ``[B, n]``
                array, or one sequence of ids per sequence (one sequence of ids for a single id).
                Required with prefix caching (full blocks are registered under keys of their
                token ids), checked and otherwise unused without it.
            tables: also build the batch's block tables and lengths (``plan.block_tables``,
                ``plan.context_lens``): with ``plan.slots`` and ``plan.query_start_loc``, every
                argument a mixed step's attention (``PrefillPlan``) needs, from one call.
            copy: applies the copies inside the step's transaction: ``copy(src, dst)`` with the
                ``[num_copies]`` int32 host arrays, when there are any (``plan.copies_applied``
                is then ``True``); an exception from it undoes the step.
            hold_copies: with ``copy=None``, leave the copies to apply later and hold each
                source block (no other sequence takes it, whatever happens to its sharers) until
                :meth:`release_copies` takes the pair; :meth:`pending_copies` lists them.

        Returns:
            The :class:`StepPlan`.
        """
        if type(sids) is int and type(num_tokens) is int and num_tokens == 1 and not tables:
            slot = None if self._transaction.depth else self._one_token(sids, tokens)
            if slot is not None:
                return StepPlan(slot, NO_SLOTS, NO_SLOTS, 1, 1)
        return run_atomically(
            self._transaction, self._step, sids, num_tokens, tokens, tables, copy, hold_copies
        )

    @atomic
    def block_tables(
        self, sids: Iterable[int] | SequenceBatch | StepPlan, *, host: bool = False
    ) -> tuple[Any, Any]:
        """Dense block tables and lengths of a batch, on the manager's device, for attention.

        Build them once per decode step and pass them to every layer's attention call.

        Args:
            sids: a :class:`SequenceBatch`, the batch's sequence ids in the order of the query
                rows, or a :class:`StepPlan` of this manager made with ``step(...,
                tables=True)``: its step's tables, refused (``ValueError``) once a later call
                changed its sequences (their lengths, residency, or the batch's order), which
                would attend entries the window released since, or blocks that went to others.
            host: the same tables and lengths as host (NumPy) copies, whatever the device (the
                cascade planner reads them: docs/cascade.md), padded to the batch's longest
                table; nothing is read back from a GPU.

        Returns:
            ``(block_tables, context_lens)``: ``[len(sids), width]`` int32, padded with 0 past
            each sequence's last block (``-1`` for blocks the window released: attend with
            :attr:`window_left`), and ``[len(sids)]`` int32. For a list of ids ``width`` is the
            batch's longest table (at least 1); for a :class:`SequenceBatch` it is at least
            that, and the array is the batch's own, refreshed in place by the next call.
        """
        if isinstance(sids, StepPlan):
            if host:
                self._step_tables(sids)  # (its checks: a stale plan is refused)
                return self._host_tables(sids.stamp.rows)
            return self._step_tables(sids)
        rows = self._rows_of(sids)
        return self._host_tables(rows) if host else self._tables(rows, sids)

    # ----------------------------------------------------------------------------- swapping

    @atomic
    def swap_out(self, sid: int) -> np.ndarray:
        """Swap sequence ``sid`` out: free its device blocks and keep its row (length, prefix
        chain, released entries) for :meth:`swap_in`; shared blocks keep their other holders.

        Returns the blocks it held, in order (``[n]`` int32 host array, the window's released
        entries left out): copy their K/V out inside the same ``with manager.transaction():``,
        before anything else takes them (:class:`~cupaged.PagedCache` does). Until
        :meth:`swap_in` the sequence cannot be stepped, forked or attended to
        (``CupagedError``); ``seq_len``, ``free`` and ``swap_in`` work.

        Raises:
            KeyError: unknown id. CupagedError: swapped out already, or a copy for it left to
            apply (``hold_copies``): its block would travel without the copied bytes.
        """
        table = self._table
        row = table.resident_row(sid)
        if len(self._copies):
            self._copies.refuse_swap(sid)
        blocks = table.detach(row)  # (its undo recorded; batches holding it check again)
        self._pool.release(blocks[::-1].copy())  # the last block first: the head stays longest
        return blocks

    @atomic
    def swap_in(self, sid: int) -> np.ndarray:
        """Bring a swapped-out sequence back on fresh blocks, one per block it held (sharing is
        not restored; full ones are registered in the prefix cache again unless their key is
        taken), and return them in order (``[n]`` int32 host array): copy its K/V into them
        inside the same ``with manager.transaction():``.

        Raises:
            KeyError: unknown id. CupagedError: not swapped out. OutOfBlocksError: too few
            blocks (nothing changes).
        """
        table = self._table
        row = table.row(sid)
        if table.live.item(row) >= 0:
            raise CupagedError(f"sequence {sid} is not swapped out")
        start = table.released.item(row)  # entries the window released stay released
        blocks = self._pool.allocate(table.held(row) - start)  # raises before any change
        table.attach(row, sid, blocks)  # (its undo recorded)
        self._chains.register_again(row, blocks, start)
        return np.array(blocks, np.int32)

    # ----------------------------------------------------------------------------- copies left

    def pending_copies(self) -> tuple[np.ndarray, np.ndarray]:
        """The copy-on-write pairs that ``step(..., hold_copies=True)`` left and no
        :meth:`release_copies` took yet: ``(src, dst)``, ``[num_pairs]`` int32 host arrays, in
        the order the steps left them (pairs of freed sequences are gone)."""
        return self._copies.pending()

    @atomic
    def release_copies(self, src: Any, dst: Any) -> None:
        """Take pairs that ``step(..., hold_copies=True)`` left (host or device int32 arrays,
        any order, all of a step's or some) and let their sources go: their bytes are copied
        by the same ``with manager.transaction():`` (``PagedCache.apply_copies``).

        Raises:
            ValueError: a pair that is not such a copy still to apply: any other destination
                may hold another sequence's written tokens, which the copy would overwrite.
        """
        src_list, dst_list = to_numpy(src).tolist(), to_numpy(dst).tolist()
        self._copies.take(src_list, dst_list)  # refuses others
        self._copies.let_go(src_list)

    # ----------------------------------------------------------------------------- checking

    def check_invariants(self) -> None:
        """Check every invariant of the bookkeeping; O(pool + tables), for tests and debugging.

        - every block is free or referenced, and its refcount equals its number of table entries;
        - a resident sequence of ``n`` tokens holds ``ceil(n / block_size)`` distinct blocks,
          less the leading ones the window released (``-1``, no more than the window allows);
        - rows, ids and padding agree; prefix chains have one key per full block.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        self._lifecycle.check(self._window, self._copies.holds())

    # ----------------------------------------------------------------------------- internals
    # Called inside the transaction.

    def _step(
        self, sids: Any, num_tokens: Any, tokens: Any, tables: bool, copy: Any, hold: bool
    ) -> StepPlan:
        rows = self._rows_of(sids)
        counts = token_counts(num_tokens, rows.size, self._capacity)
        if tokens is None and not self.prefix_caching:
            new_tokens = None  # nothing to check
        else:
            single = isinstance(sids, (int, np.integer))
            new_tokens = step_tokens(single, rows.size, counts, tokens, self.prefix_caching)
        if self._window is not None:  # what the step before wrote, registered before the plan
            self._window.register_pending(rows, counts)
        bases = None  # each row's first flat entry: what the decode path reads
        if type(counts) is int and counts == 1 and isinstance(sids, SequenceBatch):
            bases = sids.flat_bases()
        slots, src, dst = self._planner.plan(rows, counts, new_tokens, None, bases)
        if self._window is not None:  # after the plan: it cannot take (and write) what goes
            self._window.release(rows, counts, grown=True)
        copied = False
        if src.size:
            if copy is not None:
                self._transaction.wrote_kv()
                copy(src, dst)
                copied = True
            elif hold:
                self._copies.leave(src, dst, rows)
        plan = StepPlan(self._on_device(slots), src, dst, counts, rows.size, copied)
        plan.issuer = self._table
        if tables:
            table = self._table
            plan.block_tables, plan.context_lens = self._tables(rows, sids)
            plan.host_context_lens = table.lens[rows]
            batch = sids if isinstance(sids, SequenceBatch) else None
            own_rows = rows if batch is None else rows.copy()  # (a batch's rows change in place)
            plan.stamp = StepStamp(own_rows, table.sids[rows], batch, table.epoch)
        return plan

    def _step_tables(self, step: StepPlan) -> tuple[Any, Any]:
        """A ``step(..., tables=True)`` plan's block tables and lengths, for the attention of
        its step (see :meth:`block_tables`). A swap-out and swap-in (the lengths as they were)
        moves a sequence's blocks: the tables then follow them.

        Raises:
            ValueError: a plan of another manager, one without tables, or a stale one.
        """
        table, stamp = self._table, step.stamp
        if step.issuer is not table or stamp is None:
            foreign = step.issuer is not None and step.issuer is not table
            raise ValueError(
                "expected a StepPlan of this cache made with step(..., tables=True), got "
                + ("one of another cache" if foreign else "one without")
            )
        rows, batch = stamp.rows, stamp.batch
        if (
            np.count_nonzero(table.live[rows] != stamp.sids)
            or np.count_nonzero(table.lens[rows] != step.host_context_lens)
            or (batch is not None and not np.array_equal(batch.sids, stamp.sids))
        ):
            raise ValueError(
                "expected the StepPlan of the latest step of its sequences, got a stale one: a "
                "later call stepped, freed or swapped out some of them (or replaced them in its "
                "batch); plan attention from the newest step"
            )
        if batch is not None:  # its device tables, refreshed where a later call changed a row
            return batch.device_tables(), step.context_lens
        if table.epoch != stamp.epoch:  # (a swap-out and in since may have moved blocks)
            width = step.block_tables.shape[1]
            return self._xp.asarray(table.tables[rows, :width]), step.context_lens
        return step.block_tables, step.context_lens

    def _one_token(self, sid: int, tokens: Any) -> Any:
        """``step(sid)`` of one token by the planner's one-store path (:meth:`Planner.one_token
        <cupaged.paging.planner.Planner.one_token>`): its slot array, or ``None`` when the
        general path must run."""
        slot = self._planner.one_token(sid, tokens)
        return None if slot is None else self._on_device(self._one_slot.cut(slot))

    def _rows_of(self, sids: Any) -> np.ndarray:
        """Rows of a batch of distinct resident sequences of this manager."""
        if isinstance(sids, SequenceBatch):
            if sids.table is not self._table:
                raise ValueError(
                    "expected a SequenceBatch made by this manager's batch(), got one of "
                    "another PagedCache/BlockManager"
                )
            return sids.rows()
        if isinstance(sids, (int, np.integer)) and not isinstance(sids, (bool, np.bool_)):
            return np.array([self._table.resident_row(sids)], np.intp)
        return self._table.distinct_rows(sids)

    def _tables(self, rows: np.ndarray, sids: Any) -> tuple[Any, Any]:
        table = self._table
        lens = table.lens[rows]
        if isinstance(sids, SequenceBatch):
            return sids.device_tables(), self._xp.asarray(lens)
        width = max(int(cdiv(lens.max(), self.block_size)) if lens.size else 0, 1)
        width = min(width, table.width)
        return self._xp.asarray(table.tables[rows, :width]), self._xp.asarray(lens)

    def _host_tables(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        table = self._table
        lens = table.lens[rows]
        width = max(int(cdiv(lens.max(), self.block_size)) if lens.size else 0, 1)
        return table.tables[rows, : min(width, table.width)], lens

    def _on_device(self, host: np.ndarray) -> Any:
        return host if self._xp is np else self._xp.asarray(host)
