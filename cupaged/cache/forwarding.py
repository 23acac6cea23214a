"""The :class:`~cupaged.BlockManager` verbs that a :class:`~cupaged.PagedCache` passes on as they
are: the reads, and the lifecycle calls that move no K/V.

A ``PagedCache`` *has* a block manager (it used to be one): these methods keep every public name
of the manager working on the cache, each an explicit call of the manager's public verb (no
``__getattr__``). What the cache adds to a call (the K/V writes, the copies, the swapped K/V,
the freed sequences' host copies) is in :mod:`~cupaged.cache.paged_cache`. Each is marked
:func:`~cupaged.paging.transaction.forwards`, so that inside ``with cache.transaction():`` the
call it passes on joins the block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..paging.batch import SequenceBatch
from ..paging.manager import BlockManager
from ..paging.pool import BlockPool
from ..paging.prefix import PrefixCacheStats
from ..paging.results import Admission, StepPlan
from ..paging.transaction import Transaction, forwards


class ManagerVerbs:
    """The block manager's public verbs on an object that has one (``self._manager``); see
    :class:`~cupaged.BlockManager` for each."""

    _manager: BlockManager

    @property
    def manager(self) -> BlockManager:
        """The :class:`~cupaged.BlockManager` that keeps this cache's bookkeeping (for code that
        takes a manager; changing it directly bypasses the cache's K/V)."""
        return self._manager

    @property
    def num_blocks(self) -> int:
        """Physical blocks in the pool."""
        return self._manager.num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._manager.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any sequence (cached but evictable ones included)."""
        return self._manager.num_free_blocks

    @property
    def window_left(self) -> int:
        """The sliding window (``-1``: none); the plans and tables this cache makes carry it."""
        return self._manager.window_left

    @property
    def pool(self) -> BlockPool:
        """The :class:`~cupaged.BlockPool` (read it; changing it by hand breaks the tables)."""
        return self._manager.pool

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Hits, misses, evictions and served tokens of prefix caching (a snapshot)."""
        return self._manager.prefix_cache_stats

    @property
    def sequence_ids(self) -> list[int]:
        """Ids of the live sequences, oldest first."""
        return self._manager.sequence_ids

    def transaction(self) -> Transaction:
        """:meth:`BlockManager.transaction`: ``with cache.transaction():`` runs the cache's calls
        made directly in the block as one call, all or nothing."""
        return self._manager.transaction()

    @forwards
    def num_cached_tokens(self, sid: int) -> int:
        """:meth:`BlockManager.num_cached_tokens`."""
        return self._manager.num_cached_tokens(sid)

    @forwards
    def is_swapped(self, sid: int) -> bool:
        """Whether sequence ``sid`` is swapped out to host memory."""
        return self._manager.is_swapped(sid)

    @forwards
    def seq_len(self, sid: int) -> int:
        """Number of tokens stored (or reserved) for sequence ``sid``."""
        return self._manager.seq_len(sid)

    @forwards
    def block_table(self, sid: int) -> list[int]:
        """:meth:`BlockManager.block_table`."""
        return self._manager.block_table(sid)

    @forwards
    def refcount(self, block: int) -> int:
        """:meth:`BlockManager.refcount`."""
        return self._manager.refcount(block)

    @forwards
    def add_sequence(
        self, tokens: Sequence[int] | None = None, cache_salt: str | bytes | None = None
    ) -> int:
        """:meth:`BlockManager.add_sequence`."""
        return self._manager.add_sequence(tokens, cache_salt)

    @forwards
    def admit(self, prompt: Sequence[int], cache_salt: str | bytes | None = None) -> Admission:
        """:meth:`BlockManager.admit`: write K/V of ``prompt[num_cached_tokens:]`` to the
        admission's slots."""
        return self._manager.admit(prompt, cache_salt)

    @forwards
    def fork(self, sid: int) -> int:
        """:meth:`BlockManager.fork`: the child shares every block of ``sid``."""
        return self._manager.fork(sid)

    @forwards
    def fork_many(self, sid: int, n: int) -> list[int]:
        """:meth:`BlockManager.fork_many`."""
        return self._manager.fork_many(sid, n)

    @forwards
    def commit(self, sids: int | Iterable[int] | SequenceBatch) -> None:
        """:meth:`BlockManager.commit`."""
        self._manager.commit(sids)

    @forwards
    def batch(self, sids: Iterable[int]) -> SequenceBatch:
        """:meth:`BlockManager.batch`."""
        return self._manager.batch(sids)

    @forwards
    def block_tables(
        self, sids: Iterable[int] | SequenceBatch | StepPlan, *, host: bool = False
    ) -> tuple[Any, Any]:
        """:meth:`BlockManager.block_tables`."""
        return self._manager.block_tables(sids, host=host)

    @forwards
    def lengths(self, sids: Iterable[int] | SequenceBatch) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`BlockManager.lengths`."""
        return self._manager.lengths(sids)
