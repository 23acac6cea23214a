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
again, so they are never copied. :class:`~cupaged.PagedCache` builds on this class, owns the K/V
arrays and applies the copies itself; an engine that owns its own tensors uses ``BlockManager``
directly and applies them (one ``copy_blocks`` per step, for all layers).

The sequences' state lives in NumPy arrays (:mod:`cupaged.block_table`): a decode step for a batch
of ``B`` sequences is a fixed number of vectorised operations, whatever ``B`` is; Python loops run
only over blocks that fill (prefix-cache hashing) and blocks that must be copied. How a step is
planned (three planners, each where it is cheapest) is :mod:`cupaged.step_planner`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ._backend import device_module, resolve_device
from ._checks import as_int, require
from ._util import cdiv
from .block_pool import BlockPool
from .block_table import SequenceBatch, SequenceTable
from .errors import CupagedError, OutOfBlocksError
from .prefix_cache import (
    BlockHasher,
    PrefixCache,
    PrefixCacheStats,
    PrefixChain,
    as_salt,
    token_array,
)
from .step_planner import _NO_COPIES, StepPlanner

_INT32_MAX = 2**31 - 1
_NO_BLOCKS = np.zeros(0, np.intp)
_NO_BLOCKS.flags.writeable = False
_get_ident = threading.get_ident

SequenceIds = "int | Iterable[int] | SequenceBatch"


class _OneSlots:
    """The one-element slot arrays of the per-token calls, cut from a preallocated int32 buffer:
    each a view of its own element, never reused (a full buffer is replaced, not rewritten), for
    0.1 µs against 0.34 for ``np.array([slot], np.int32)``."""

    __slots__ = ("_buffer", "_next")

    def __init__(self, size: int = 4096) -> None:
        self._buffer = np.empty(size, np.int32)
        self._next = 0

    def cut(self, slot: int) -> np.ndarray:
        i, buffer = self._next, self._buffer
        if i == buffer.size:
            buffer = self._buffer = np.empty(buffer.size, np.int32)
            i = 0
        buffer[i] = slot
        self._next = i + 1
        return buffer[i : i + 1]


class StepPlan:
    """What a step of the block manager planned: where to write, and which blocks to copy first.

    Attributes:
        slots: ``[sum(num_tokens)]`` int32 slot mapping on the manager's device, sequence after
            sequence in batch order: ``slot = block * block_size + offset``.
        copy_src: ``[num_copies]`` int32 host array: blocks to copy (copy-on-write) ...
        copy_dst: ``[num_copies]`` int32 host array: ... onto these fresh blocks, in every layer,
            before any K/V of this step is written. Empty when nothing is shared.
        copies_applied: whether :class:`~cupaged.PagedCache` already copied them.
        block_tables: with ``step(..., tables=True)``, the batch's ``[len(batch), width]`` int32
            block tables on the device (as :meth:`BlockManager.block_tables` returns them, the
            step's tokens included), else ``None``.
        context_lens: with ``tables=True``, ``[len(batch)]`` int32 on the device: each
            sequence's length after the step (its new tokens included), else ``None``.
    """

    __slots__ = (
        "_counts", "_size", "block_tables", "context_lens", "copies_applied", "copy_dst",
        "copy_src", "slots",
    )  # fmt: skip

    def __init__(
        self,
        slots: Any,
        copy_src: np.ndarray,
        copy_dst: np.ndarray,
        counts: int | np.ndarray,
        size: int,
        copies_applied: bool = False,
    ) -> None:
        self.slots, self.copy_src, self.copy_dst = slots, copy_src, copy_dst
        self._counts, self._size, self.copies_applied = counts, size, copies_applied
        self.block_tables = self.context_lens = None

    @property
    def num_tokens(self) -> np.ndarray:
        """``[len(batch)]`` int32 host array: new tokens per sequence."""
        return np.broadcast_to(np.asarray(self._counts, np.int32), (self._size,)).copy()

    @property
    def query_start_loc(self) -> np.ndarray:
        """``[len(batch) + 1]`` int32 host array: sequence ``i``'s new tokens are rows
        ``query_start_loc[i] : query_start_loc[i + 1]`` of the step's packed queries."""
        out = np.zeros(self._size + 1, np.int32)
        np.cumsum(self.num_tokens, out=out[1:])
        return out

    def __repr__(self) -> str:
        return (
            f"StepPlan(slots={self.slots!r}, copy_src={self.copy_src.tolist()}, "
            f"copy_dst={self.copy_dst.tolist()}, num_tokens={self.num_tokens.tolist()})"
        )


@dataclass(slots=True)
class Admission:
    """A request admitted in one call: its sequence, the cached prefix, the slots for the rest.

    Attributes:
        sid: the new sequence.
        num_cached_tokens: prompt tokens served from the prefix cache: compute K/V (and write them
            to ``slots``) for ``prompt[num_cached_tokens:]`` only.
        slots: ``[len(prompt) - num_cached_tokens]`` int32 slot mapping on the manager's device.
    """

    sid: int
    num_cached_tokens: int
    slots: Any


class _Atomic:
    """The scope of one public call that changes the bookkeeping: exclusive and all or nothing.

    Entered by every public method that changes state (nested calls join the outermost one).
    A second thread entering while one is inside raises :class:`CupagedError` instead of
    corrupting the tables. Any exception inside, ``KeyboardInterrupt`` included, runs the undo
    actions the call recorded (newest first) and rolls the pool back, so that the failed call
    changes nothing.
    """

    __slots__ = ("_depth", "_lock", "_manager", "_mark", "_owner", "_pool", "_saved", "_stats",
                 "kv_written", "undo")  # fmt: skip

    def __init__(self, manager: BlockManager) -> None:
        self._manager = manager
        self._pool, self._stats = manager._pool, manager._prefix.stats  # fixed for its life
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self.undo: list[Callable[[], None]] = []
        self.kv_written = False  # K/V were written into taken blocks: evictions stay evicted

    def __enter__(self) -> _Atomic:
        me = _get_ident()
        if self._owner == me:
            self._depth += 1
            return self
        if not self._lock.acquire(False):  # (not blocking; positional: a keyword costs more)
            raise CupagedError(
                "expected one thread at a time in a PagedCache/BlockManager, got a call while "
                "another thread is inside one (guard the cache with your own lock)"
            )
        self._owner, self._depth = me, 1
        stats = self._stats
        self._saved = (self._manager._next_id, stats.hits, stats.misses, stats.cached_tokens)
        self._mark = self._pool.begin()
        self.kv_written = False
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if self._depth > 1:
            self._depth -= 1
            return
        self._depth = 0
        if kind is None:  # the common case: keep the changes
            try:
                self._pool.end()
                self.undo = []
            finally:  # an interrupt here must not leave the cache locked
                self._owner = None
                self._lock.release()
            return
        try:
            if self.undo:  # a batch may have copied the tables being undone to its device
                table = self._manager._seqs
                for action in reversed(self.undo):
                    action()
                table.touch(slice(None))  # every row counts as changed: batches refresh
            self._pool.rollback(self._mark, keep_evicted=not self.kv_written)
            stats = self._stats
            self._manager._next_id, stats.hits, stats.misses, stats.cached_tokens = self._saved
        finally:
            self.undo = []
            self._owner = None
            self._lock.release()


class BlockManager(StepPlanner):
    """Block pool, per-sequence block tables, refcounts, copy-on-write plans and prefix caching.

    No K/V arrays: this is what :class:`~cupaged.PagedCache` builds on, and what an engine that
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
        block_hasher: the :data:`~cupaged.prefix_cache.BlockHasher` of prefix caching (BLAKE2b by
            default); tests inject colliding ones.

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
    ) -> None:
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
        if block_hasher is not None and not enable_prefix_caching:
            raise ValueError("block_hasher= needs enable_prefix_caching=True")
        self.device = resolve_device(device)
        self._xp = device_module(self.device)
        self._block_size = block_size
        self._pool = BlockPool(num_blocks)
        self.prefix_caching = bool(enable_prefix_caching)
        self._prefix = PrefixCache(self._pool, block_size, block_hasher)
        self._seqs = SequenceTable(tail_width=block_size if self.prefix_caching else 0)
        self._offsets = np.arange(block_size, dtype=np.int32)  # slot offsets within a block
        self._one_slot = _OneSlots()
        self._rows: dict[int, int] = {}  # live sequence id -> row
        self._chains: dict[int, PrefixChain] = {}  # row -> prefix chain (prefix caching only)
        self._cached: dict[int, int] = {}  # live sequence id -> prompt tokens found cached
        self._next_id = 0
        self._atomic = _Atomic(self)

    # ----------------------------------------------------------------------------- introspection

    @property
    def num_blocks(self) -> int:
        """Physical blocks in the pool."""
        return self._pool.num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any sequence (cached but evictable ones included)."""
        return self._pool.num_free

    @property
    def pool(self) -> BlockPool:
        """The :class:`~cupaged.BlockPool` (read it; changing it by hand breaks the tables)."""
        return self._pool

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Hits, misses, evictions and served tokens of prefix caching (a snapshot)."""
        return replace(self._prefix.stats, evictions=self._pool.evictions)

    @property
    def sequence_ids(self) -> list[int]:
        """Ids of the live sequences, oldest first."""
        return list(self._rows)

    def num_cached_tokens(self, sid: int) -> int:
        """Prompt tokens of ``sid`` found in the prefix cache when it was added or admitted.

        The caller computes K/V for the rest of the prompt only: ``prompt[num_cached_tokens:]``.
        """
        self._row(sid)
        return self._cached.get(sid, 0)

    def is_swapped(self, sid: int) -> bool:
        """Whether sequence ``sid`` is swapped out to host memory."""
        return self._seqs.live[self._row(sid)] < 0

    def seq_len(self, sid: int) -> int:
        """Number of tokens stored (or reserved) for sequence ``sid``."""
        return int(self._seqs.lens[self._row(sid)])

    def block_table(self, sid: int) -> list[int]:
        """Physical block ids of sequence ``sid`` in logical order (a copy)."""
        row = self._resident_row(sid)
        return self._seqs.tables[row, : self._held(row)].tolist()

    def refcount(self, block: int) -> int:
        """Number of sequences whose table references physical block ``block``."""
        return self._pool.refcount(block)

    # ----------------------------------------------------------------------------- lifecycle

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
        with self._atomic:
            sid, _ = self._add(prompt, as_salt(cache_salt))
        return sid

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
        with self._atomic:
            return self._admit(prompt, salt)

    def _admit(self, prompt: np.ndarray, salt: bytes | None) -> Admission:
        bs, pool, table = self._block_size, self._pool, self._seqs
        if self.prefix_caching:
            hits, chain, keys = self._prefix.match_unchecked(prompt, salt)
        else:
            hits, chain, keys = [], None, ([], [])
        n_hits, n = len(hits), len(prompt)
        cached = n_hits * bs
        if n_hits:
            hits = np.asarray(hits, np.intp)  # (the prefix memo's array as it is)
            held = pool._refcount[hits]
            in_use = int(np.count_nonzero(held))
        else:
            held, in_use = None, 0
        needed = -(-n // bs) - n_hits
        # Too few blocks: the transaction puts the match's counters back.
        if needed > pool._top + pool._num_evictable - (n_hits - in_use):
            raise OutOfBlocksError(
                needed, pool.num_free - (n_hits - in_use), f"admitting a {n}-token prompt"
            )
        # The hits and the blocks for the rest of the prompt, in one pass over the row.
        sid, row, new = self._attach(hits, chain, needed, n, held, in_use)
        if self.prefix_caching:
            # The keys of the full blocks after the hits, hashed by the match: registered at
            # commit, once their K/V are written.
            rest_keys, rest_digests = keys
            if rest_keys:
                chain.keys += rest_keys
                chain.digests += rest_digests
                table.pending[row] = True
            full = n_hits + len(rest_keys)
            if n > full * bs:  # the tokens of a last, partly filled block
                table.tail[row, : n - full * bs] = prompt[full * bs :]
        if n == cached:
            slots = _NO_COPIES
        elif needed == 1:
            slots = self._offsets[: n - cached] + new.item(0) * bs  # int32: slots fit (init)
        else:
            slots = ((new * bs).astype(np.int32)[:, None] + self._offsets).reshape(-1)[: n - cached]
        return Admission(sid, cached, slots if self._xp is np else self._xp.asarray(slots))

    def fork(self, sid: int) -> int:
        """Start a sequence that shares every block of ``sid`` (parallel sampling, beam search).

        No K/V is copied: each shared block's refcount goes up by one. Whichever of the two
        sequences first writes into a shared, partly filled block gets a private copy of it.

        Returns:
            The child's id.
        """
        return self.fork_many(sid, 1)[0]

    def fork_many(self, sid: int, n: int) -> list[int]:
        """``n`` forks of ``sid`` at once (beam search); as :meth:`fork`, vectorised."""
        n = as_int(n, "n")
        if n < 0:
            raise ValueError(f"expected n >= 0 forks, got {n}")
        with self._atomic as atomic:  # (the lookups too: no other thread's call in between)
            parent = self._resident_row(sid)
            return self._fork(parent, n, atomic) if n else []

    def _fork(self, parent: int, n: int, atomic: _Atomic) -> list[int]:
        table = self._seqs
        children = list(range(self._next_id, self._next_id + n))
        rows = table.acquire_many(children)
        row_list = rows.tolist()
        atomic.undo.append(lambda: self._unattach(children, row_list))
        self._next_id += n
        length = table.lens.item(parent)
        table.tables[rows] = table.tables[parent]
        table.lens[rows] = length
        self._pool.share(table.tables[parent, : -(-length // self._block_size)], n)
        if length % self._block_size:  # a partly filled last block is now shared
            was_shared = table.shared.item(parent)
            atomic.undo.append(lambda: table.shared.__setitem__(parent, was_shared))
            table.shared[parent] = True
            table.shared[rows] = True
        if self.prefix_caching:
            table.tail[rows] = table.tail[parent]
            table.pending[rows] = table.pending[parent]
            for row in row_list:
                self._chains[row] = self._chains[parent].copy()
        self._rows.update(zip(children, row_list, strict=True))
        return children

    def free(self, sid: int) -> None:
        """End sequence ``sid``: drop its references; unshared blocks return to the pool.

        Cached full blocks are not wiped: they become evictable, last block first, so that a
        prompt's head survives eviction longest.
        """
        with self._atomic:  # (the lookup too: no other thread's call in between)
            self._release([sid], [self._row(sid)])

    def free_many(self, sids: Iterable[int]) -> None:
        """End several sequences at once (as :meth:`free` one after the other, vectorised)."""
        sid_list = list(sids)
        with self._atomic:  # (the lookups too: no other thread's call in between)
            get = self._rows.get
            rows = [(get(sid) if type(sid) is int else None) for sid in sid_list]
            if None in rows:
                rows = [self._row(sid) for sid in sid_list]  # raises for an unknown one
            if len(set(rows)) != len(rows):
                raise ValueError(f"expected distinct sequence ids, got {sid_list}")
            self._release(sid_list, rows)

    def commit(self, sids: int | Iterable[int] | SequenceBatch) -> None:
        """Declare the K/V of every token reserved so far for these sequences written.

        With prefix caching a block becomes findable by other sequences only once its K/V are
        known to be written, never at the ``step`` that reserves it: a sequence's full blocks are
        registered at its next ``step`` (which means the previous one was computed), by
        ``append`` (which writes them itself), or here. Call it after a prefill or a last step
        whose blocks should serve later requests; a sequence freed before either keeps its
        reserved blocks out of the cache, so unwritten K/V are never served. Without prefix
        caching it does nothing.
        """
        table = self._seqs
        with self._atomic as atomic:  # (the lookups too: no other thread's call in between)
            row = self._rows.get(sids) if type(sids) is int else None
            if row is not None and table.live.item(row) >= 0:  # one resident sequence (admission's)
                if not table.pending.item(row):
                    return  # nothing to register (or no prefix caching)
                chain = self._chains[row]
                committed, end = chain.committed, len(chain.keys)
                # Registering changes no key or digest of the chain.
                atomic.undo.append(lambda: self._uncommit_one(row, chain, committed))
                self._pool.register_many(  # what _commit_rows does, for one row
                    table.tables[row, committed:end].tolist(),
                    chain.keys[committed:end],
                    chain.digests[committed:end],
                )
                chain.committed = end
                table.pending[row] = False
                return
            if isinstance(sids, (int, np.integer)):
                rows = self._resident_rows([sids])
            else:
                rows = self._batch_rows(sids).tolist()
            pending = table.pending
            if not self.prefix_caching or not any(pending.item(row) for row in rows):
                return  # nothing to register
            atomic.undo.append(self._chains_restorer(rows))
            self._commit_rows(rows)

    def _uncommit_one(self, row: int, chain: PrefixChain, committed: int) -> None:
        """Undo of a one-row :meth:`commit` (the pool's rollback unregisters the blocks)."""
        chain.committed = committed
        self._seqs.pending[row] = True

    # ----------------------------------------------------------------------------- steps

    def batch(self, sids: Iterable[int]) -> SequenceBatch:
        """A persistent handle on a batch of resident sequences (ids resolved once)."""
        sid_list = list(sids)
        # The epoch before the lookups (this call takes no lock): a sequence that another thread
        # frees meanwhile moves it on, and the batch's first use checks every sequence again.
        epoch = self._seqs.epoch
        rows = self._resident_rows(sid_list)
        if len(set(rows)) != len(rows):
            raise ValueError(f"expected distinct sequence ids, got {sid_list}")
        sid_array, row_array = np.array(sid_list, np.int64), np.array(rows, np.intp)
        return SequenceBatch(self, sid_array, row_array, self._xp, epoch)  # all resident then

    def step(
        self,
        sids: int | Iterable[int] | SequenceBatch,
        num_tokens: int | Sequence[int] | np.ndarray = 1,
        tokens: Any = None,
        *,
        tables: bool = False,
    ) -> StepPlan:
        """Make room for the next tokens of a batch: the slots to write and the blocks to copy.

        The lengths grow at once. All or nothing: if the pool cannot hold every token of every
        sequence, :class:`OutOfBlocksError` is raised and nothing changes. Apply the plan's copies
        (``copy_blocks(k, v, plan.copy_src, plan.copy_dst)`` over every layer) before writing K/V
        into its slots.

        Args:
            sids: a :class:`SequenceBatch`, one sequence id, or several distinct ones.
            num_tokens: tokens per sequence: one int for all, or one per sequence.
            tokens: the new tokens' ids: a ``[B]`` array (one token each), a ``[B, n]`` array, or
                one sequence of ids per sequence (one sequence of ids for a single id). Required
                with prefix caching (full blocks are registered under keys of their token ids),
                checked and otherwise unused without it.
            tables: also build the batch's block tables and lengths (``plan.block_tables``,
                ``plan.context_lens``): with ``plan.slots`` and ``plan.query_start_loc``, every
                argument a mixed step's attention (``paged_prefill``) needs, from one call.

        Returns:
            The :class:`StepPlan`.
        """
        if type(sids) is int and type(num_tokens) is int and num_tokens == 1 and not tables:
            slot = None if tokens is not None else self._step_one(sids)
            if slot is not None:
                return StepPlan(slot, _NO_COPIES, _NO_COPIES, 1, 1)
        with self._atomic:  # (the lookups too: no other thread's call in between)
            rows = self._batch_rows(sids)
            counts = self._counts(num_tokens, rows.size)
            if tokens is None and not self.prefix_caching:
                new_tokens = None  # what _check_tokens gives: nothing to check
            else:
                single = isinstance(sids, (int, np.integer))
                new_tokens = self._check_tokens(single, rows.size, counts, tokens)
            bases = None  # each row's first flat entry: what the decode planner reads
            if type(sids) is SequenceBatch and type(counts) is int and counts == 1:
                width = self._seqs.width
                bases = sids._bases if sids._bases_width == width else sids.flat_bases(width)
            slots, src, dst = self._plan(rows, counts, new_tokens, None, bases)
            plan = StepPlan(slots if self._xp is np else self._xp.asarray(slots), src, dst,
                            counts, rows.size)  # fmt: skip
            if tables:
                plan.block_tables, plan.context_lens = self._tables(rows, sids)
        return plan

    def _step_one(self, sid: int) -> Any:
        """``step(sid)`` for one token of a sequence of its own (no prefix caching): in its last
        block (15 steps in 16 at block size 16) one length grows, a single store that needs no
        undo record; at a block boundary one free block is taken. ``None`` when the general path
        must run (a shared block, an eviction, prefix caching, an unknown or swapped id, or
        another call inside)."""
        if self.prefix_caching:
            return None
        lock = self._atomic._lock
        if not lock.acquire(False):  # (not blocking)
            return None  # another call is inside: the general path joins it or refuses
        try:  # every read and the store under the lock: another thread's call never interleaves
            row = self._rows.get(sid)
            if row is None:
                return None
            table, bs = self._seqs, self._block_size
            length = table.lens.item(row)
            offset = length % bs
            if table.live.item(row) != sid or (offset and table.shared.item(row)):
                return None
            if offset:
                slot = self._one_slot.cut(table.tables.item(row, length // bs) * bs + offset)
                table.lens[row] = length + 1
                return slot if self._xp is np else self._xp.asarray(slot)
        finally:  # an interrupt here must not leave the cache locked
            lock.release()
        return self._step_one_block(sid, row, length)

    def _step_one_block(self, sid: int, row: int, length: int) -> Any:
        """:meth:`_step_one` at a block boundary: the token opens a new block, taken from the free
        list (``None`` when that would evict, or when the sequence changed since ``_step_one``
        read it: the general path runs then)."""
        pool, table = self._pool, self._seqs
        held = length // self._block_size
        with self._atomic as atomic:
            if not pool._top or atomic._depth > 1:
                return None  # an eviction, or a call of this thread inside: the general path
            if (
                self._rows.get(sid) != row
                or table.lens.item(row) != length
                or table.live.item(row) != sid
            ):  # another thread's call since the look under the lock: the general path decides
                return None

            def undo() -> None:
                table.tables[row, held] = 0  # it was padding
                table.lens[row] = length

            atomic.undo.append(undo)
            block = pool.take(1).item(0)
            table.ensure_width(held + 2)  # one spare column: see _plan_decode
            table.tables[row, held] = block
            table.version[row] = table.clock
            table.lens[row] = length + 1
            slot = self._one_slot.cut(block * self._block_size)
        return slot if self._xp is np else self._xp.asarray(slot)

    def block_tables(self, sids: Iterable[int] | SequenceBatch) -> tuple[Any, Any]:
        """Dense block tables and lengths of a batch, on the manager's device, for attention.

        Build them once per decode step and pass them to every layer's attention call.

        Args:
            sids: a :class:`SequenceBatch`, or the batch's sequence ids in the order of the query
                rows.

        Returns:
            ``(block_tables, context_lens)``: ``[len(sids), width]`` int32, padded with 0 past
            each sequence's last block, and ``[len(sids)]`` int32. For a list of ids ``width``
            is the batch's longest table (at least 1); for a :class:`SequenceBatch` it is at
            least that, and the array is the batch's own, refreshed in place by the next call.
        """
        with self._atomic:  # it refreshes a batch's device tables and moves the table clock
            return self._tables(self._batch_rows(sids), sids)

    def _tables(self, rows: np.ndarray, sids: Any) -> tuple[Any, Any]:
        table = self._seqs
        lens = table.lens[rows]
        if isinstance(sids, SequenceBatch):
            return sids.device_tables(table), self._xp.asarray(lens)
        width = max(int(cdiv(lens.max(), self._block_size)) if lens.size else 0, 1)
        width = min(width, table.width)
        tables = table.tables[rows, :width]
        return self._xp.asarray(tables), self._xp.asarray(lens)

    # ----------------------------------------------------------------------------- checking

    def check_invariants(self) -> None:
        """Check every invariant of the bookkeeping; O(pool + tables), for tests and debugging.

        - every block is free or referenced, and its refcount equals its number of table entries;
        - a resident sequence of ``n`` tokens holds ``ceil(n / block_size)`` distinct blocks;
        - rows, ids and padding agree; prefix chains have one key per full block.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        references: Counter[int] = Counter()
        table = self._seqs
        for sid, row in self._rows.items():
            require(0 <= sid < self._next_id, f"sequence id {sid} was never handed out")
            length = int(table.lens[row])
            if self.prefix_caching:
                self._check_chain(sid, row, length)
            else:
                require(
                    row not in self._chains, f"sequence {sid} has a chain without prefix caching"
                )
            if table.live[row] < 0:
                continue
            blocks = table.tables[row, : self._held(row)].tolist()
            require(
                len(set(blocks)) == len(blocks),
                f"sequence {sid} references a block twice: {blocks}",
            )
            if length % self._block_size and self._pool._refcount[blocks[-1]] > 1:
                require(
                    table.shared[row],
                    f"sequence {sid} shares its partly filled last block {blocks[-1]} unflagged",
                )
            references.update(blocks)
        table.check_invariants(self._rows, self._block_size)
        self._pool.check_invariants(references)

    def _check_chain(self, sid: int, row: int, length: int) -> None:
        chain = self._chains.get(row)
        require(chain is not None, f"sequence {sid} has no prefix chain")
        full = length // self._block_size
        require(
            len(chain.keys) == len(chain.digests) == full,
            f"sequence {sid} has {full} full blocks, {len(chain.keys)} keys, "
            f"{len(chain.digests)} digests",
        )
        require(
            0 <= chain.committed <= full
            and bool(self._seqs.pending[row]) == (chain.committed < full),
            f"sequence {sid} has {chain.committed} of {full} keys committed, "
            f"pending flag {bool(self._seqs.pending[row])}",
        )
        if self._seqs.live[row] < 0:
            return
        for j, block in enumerate(self._seqs.tables[row, :full].tolist()):
            key = self._pool.cached_key(block)
            require(
                key is None or key == chain.keys[j],
                f"block {block} of sequence {sid} is registered under another key",
            )

    # ----------------------------------------------------------------------------- internals

    def _add(self, prompt: np.ndarray, salt: bytes | None) -> tuple[int, int]:
        hits, chain, _ = self._match(prompt, salt)
        sid, row, _ = self._attach(hits, chain)
        return sid, row

    def _match(
        self, prompt: np.ndarray, salt: bytes | None
    ) -> tuple[list[int], PrefixChain | None, tuple[list[bytes], list[bytes]]]:
        if not self.prefix_caching:
            return [], None, ([], [])
        return self._prefix.match_unchecked(prompt, salt)

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
        sid = self._next_id
        table, pool = self._seqs, self._pool
        row = table.acquire(sid)
        self._atomic.undo.append(lambda: self._unattach([sid], [row]))
        n_hits = len(hits)
        if n_hits:
            hits = np.asarray(hits, np.intp)
            pool.acquire_unchecked(hits, held=held, in_use=in_use)
        new = pool.take(needed) if needed else _NO_BLOCKS
        if n_hits or needed:
            table.ensure_width(n_hits + needed + 1)  # one spare column: see _plan_decode
            table.tables[row, : n_hits + needed] = np.concatenate((hits, new)) if n_hits else new
            table.lens[row] = n_hits * self._block_size if length is None else length
        if self.prefix_caching:
            self._chains[row] = chain
        self._rows[sid] = row
        if n_hits:
            self._cached[sid] = n_hits * self._block_size
        self._next_id += 1
        return sid, row, new

    def _unattach(self, sids: list[int], rows: list[int]) -> None:
        """Undo of :meth:`_attach` / :meth:`_fork`: forget new sequences, give their rows back."""
        for sid, row in zip(sids, rows, strict=True):
            self._rows.pop(sid, None)
            self._chains.pop(row, None)
            self._cached.pop(sid, None)
        self._seqs.release(np.array(rows, np.intp))

    def _release(self, sids: list[int], rows: list[int]) -> None:
        """Drop the sequences' references (each one's last block first) and their rows."""
        if len(rows) == 1:
            self._release_one(sids[0], rows[0])
            return
        table, rows_of, cached, chains = self._seqs, self._rows, self._cached, self._chains
        row_array = np.array(rows, np.intp)
        # What an interrupt must put back: the rows and the dictionary entries (mostly there are
        # no cached-token counts or chains: no prefix caching, or sequences that matched nothing).
        saved = table.snapshot(row_array), table.free_rows_mark()
        kept_cached = {sid: cached[sid] for sid in sids if sid in cached} if cached else {}
        kept_chains = {row: chains[row] for row in rows if row in chains} if chains else {}

        def undo() -> None:
            table.unrelease(saved[1])
            table.restore(row_array, saved[0])
            rows_of.update(zip(sids, rows, strict=True))
            cached.update(kept_cached)
            chains.update(kept_chains)

        self._atomic.undo.append(undo)
        # Each row's blocks, last first, row after row (views of the flat table, joined once).
        bs, width, flat = self._block_size, table.width, table.flat
        runs = [
            flat[row * width : row * width - (-length // bs)][::-1]
            for row, length, live in zip(
                rows, saved[0][1].tolist(), saved[0][3].tolist(), strict=True
            )  # fmt: skip
            if length and live >= 0  # a swapped-out row holds none
        ]
        if runs:
            entries = np.concatenate(runs) if len(runs) > 1 else runs[0]
            self._pool.release_entries(entries.astype(np.intp), len(runs) > 1)
        table.release(row_array)
        for sid in sids:
            del rows_of[sid]
        if kept_cached:
            for sid in kept_cached:
                del cached[sid]
        if kept_chains:
            for row in kept_chains:
                del chains[row]

    def _restore_entry(self, sid: int, row: int, cached: Any, chain: Any) -> None:
        """Put back a released sequence's id, row, cached-token count and prefix chain (undo)."""
        self._rows[sid] = row
        if cached is not None:
            self._cached[sid] = cached
        if chain is not None:
            self._chains[row] = chain

    def _release_one(self, sid: int, row: int) -> None:
        """:meth:`_release` of one sequence: what ``free`` does per call, in few operations."""
        table = self._seqs
        length = table.lens.item(row)
        resident = table.live.item(row) >= 0
        held = -(-length // self._block_size) if resident else 0
        blocks = table.tables[row, :held][::-1].astype(np.intp)  # last block first
        # What an interrupt must put back: what release_one clears (not the tail: it keeps it),
        # the free-row list and the dictionary entries.
        state = (length, resident, table.shared.item(row), table.pending.item(row),
                 len(table._free_rows), self._cached.get(sid), self._chains.get(row))  # fmt: skip

        def undo() -> None:
            length, resident, shared, pending, mark, cached, chain = state
            table.unrelease(mark)
            table.tables[row] = 0
            table.tables[row, :held] = blocks[::-1]
            table.lens[row], table.sids[row], table.live[row] = length, sid, sid if resident else -1
            table.shared[row], table.pending[row] = shared, pending
            table.epoch += 1  # after the change (see SequenceTable.epoch)
            self._restore_entry(sid, row, cached, chain)

        self._atomic.undo.append(undo)
        if held:
            self._pool.release(blocks)
        table.release_one(row)
        del self._rows[sid]
        if self._cached:
            self._cached.pop(sid, None)
        if self._chains:
            del self._chains[row]

    def _batch_rows(self, sids: Any) -> np.ndarray:
        """Rows of a batch of resident, distinct sequences."""
        if type(sids) is SequenceBatch or isinstance(sids, SequenceBatch):
            rows = sids._rows
            table = self._seqs
            epoch = table.epoch  # (before the check: see SequenceTable.epoch)
            if sids._epoch != epoch or sids._manager is not self:
                if np.count_nonzero(table.live[rows] != sids._sids):
                    for sid in sids._sids.tolist():
                        self._resident_row(sid)  # raises for the first gone or swapped one
                if sids._manager is self:  # no sequence stopped being resident since: no check
                    sids._epoch = epoch
            return rows
        if isinstance(sids, (int, np.integer)):
            return np.array([self._resident_row(sids)], np.intp)
        sid_list = list(sids)
        row_list = self._resident_rows(sid_list)
        if len(set(row_list)) != len(row_list):
            raise ValueError(f"expected distinct sequence ids, got {sid_list}")
        return np.array(row_list, dtype=np.intp)

    def _resident_rows(self, sids: list[Any]) -> list[int]:
        """:meth:`_resident_row` of each id (plain resident ints looked up inline)."""
        get, live, rows = self._rows.get, self._seqs.live, []
        for sid in sids:
            row = get(sid) if type(sid) is int else None
            if row is None or live.item(row) != sid:
                row = self._resident_row(sid)  # raises, or takes the slow path of an np.integer
            rows.append(row)
        return rows

    def _counts(self, num_tokens: Any, batch: int) -> int | np.ndarray:
        if type(num_tokens) is int and num_tokens >= 0:
            return num_tokens
        if isinstance(num_tokens, (int, np.integer)) and not isinstance(num_tokens, bool):
            n = int(num_tokens)
            if n < 0:
                raise ValueError(f"expected num_tokens >= 0, got {n}")
            return n
        if hasattr(num_tokens, "dtype") and num_tokens.dtype.kind in "iu":
            counts = num_tokens.get() if hasattr(num_tokens, "get") else np.asarray(num_tokens)
            if counts.shape != (batch,):
                raise ValueError(
                    f"expected one token count per sequence ({batch}), got shape {counts.shape}"
                )
            if counts.size and counts.min() < 0:
                raise ValueError(f"expected num_tokens >= 0, got {counts.tolist()}")
            return counts.astype(np.int64)
        if not isinstance(num_tokens, Iterable):
            as_int(num_tokens, "num_tokens")  # raises the TypeError
        counts = [as_int(n, "num_tokens") for n in num_tokens]
        if len(counts) != batch:
            raise ValueError(f"expected one token count per sequence ({batch}), got {len(counts)}")
        if any(n < 0 for n in counts):
            raise ValueError(f"expected num_tokens >= 0, got {counts}")
        return np.array(counts, np.int64)

    def _check_tokens(
        self, single: bool, batch: int, counts: int | np.ndarray, tokens: Any
    ) -> np.ndarray | list[np.ndarray] | None:
        """The new tokens' ids, checked: a ``[B]`` array for one token each, else one array per
        sequence; ``None`` when none were given without prefix caching."""
        if tokens is None:
            writing = counts if type(counts) is int else np.count_nonzero(counts)
            if self.prefix_caching and writing:
                raise ValueError(
                    "expected tokens= (the new tokens' ids): prefix caching keys full blocks by them"
                )
            return None
        if single and not _nested(tokens):
            rows = [token_array(tokens)]
        elif hasattr(tokens, "ndim") and tokens.ndim == 2:
            rows = list(_host_tokens(tokens))
        elif (
            hasattr(tokens, "ndim") and tokens.ndim == 1 and isinstance(counts, int) and counts == 1
        ):
            flat = token_array(tokens)
            if flat.size != batch:
                raise ValueError(f"expected one token id per sequence ({batch}), got {flat.size}")
            return flat
        else:
            if isinstance(tokens, (str, bytes)) or len(tokens) != batch:
                raise ValueError(f"expected one list of token ids per sequence ({batch})")
            rows = [token_array(ids) for ids in tokens]
        if len(rows) != batch:
            raise ValueError(f"expected one list of token ids per sequence ({batch})")
        for n, ids in zip(np.broadcast_to(counts, (batch,)).tolist(), rows, strict=True):
            if len(ids) != n:
                raise ValueError(f"expected {n} token ids (one per new token), got {len(ids)}")
        if isinstance(counts, int) and counts == 1:
            return np.concatenate(rows) if rows else np.zeros(0, np.int64)
        return rows

    def _held(self, row: int) -> int:
        """Blocks held by a resident row."""
        return cdiv(int(self._seqs.lens[row]), self._block_size)

    def _resident_row(self, sid: int) -> int:
        row = self._row(sid)
        live = self._seqs.live.item(row)
        if live != sid:  # (ids are never reused: the row's own sequence, resident, or neither)
            if live >= 0:  # the row went to another sequence: read while another thread freed it
                raise KeyError(f"sequence {sid} was already freed")
            raise CupagedError(f"sequence {sid} is swapped out; call swap_in({sid}) first")
        return row

    def _row(self, sid: int) -> int:
        row = self._rows.get(sid) if type(sid) is int else None
        if row is not None:  # a live plain int: mostly
            return row
        is_id = isinstance(sid, (int, np.integer)) and not isinstance(sid, (bool, np.bool_))
        if is_id:
            row = self._rows.get(int(sid))
            if row is not None:
                return row
            if 0 <= sid < self._next_id:
                raise KeyError(f"sequence {sid} was already freed")
        raise KeyError(f"unknown sequence id {sid!r}")


def _nested(tokens: Any) -> bool:
    """Whether ``tokens`` holds one sequence of ids per sequence (``[[...]]``, a 2-D array)."""
    if hasattr(tokens, "ndim"):
        return tokens.ndim == 2
    return isinstance(tokens, (list, tuple)) and bool(tokens) and hasattr(tokens[0], "__len__")


def _host_tokens(tokens: Any) -> np.ndarray:
    """A ``[B, n]`` token array on the host, checked like :func:`token_array` row by row."""
    host = tokens.get() if hasattr(tokens, "get") else np.asarray(tokens)
    flat = token_array(host.reshape(-1), "tokens")
    return flat.reshape(host.shape)
