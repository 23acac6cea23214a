"""Swapping a sequence's K/V to host memory and back (preemption without recomputation).

:class:`Swapper` owns the host copies of swapped-out sequences and moves bytes only, for the
block ids it is given; the bookkeeping is the manager's (:meth:`~cupaged.BlockManager.swap_out`
frees a sequence's blocks and hands their ids over, :meth:`~cupaged.BlockManager.swap_in` takes
fresh ones). :class:`~cupaged.PagedCache` runs both halves in one transaction::

    swap_out:  blocks = manager.swap_out(sid); their K/V (every layer) -> pinned host buffers
    swap_in:   blocks = manager.swap_in(sid);  the host K/V -> those blocks

Within the transaction nothing else takes the freed blocks before their bytes are copied out,
and a failed copy undoes the bookkeeping. With a sliding window only the blocks a sequence
holds travel: the host copy has ``ceil(n / block_size) - released`` blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays.checks import require
from .._util import cdiv
from ..dtypes import as_storage
from ..paging.manager import BlockManager
from ..paging.transaction import Transaction


class Swapper:
    """Host copies of swapped-out sequences, and the moves of their bytes between device and
    host.

    Args:
        k, v: the cache's ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`` arrays.
        xp: their array module (NumPy or CuPy).
        transaction: the manager's (its calls record their undo there).

    Its array work (gathers, host copies) runs on the storage views of the pages: ``uint16``
    for a native bfloat16 cache of CuPy 14, whose own, experimental bfloat16 kernels it never
    needs; :meth:`gather` hands back the cache's dtype.
    """

    def __init__(self, k: Any, v: Any, xp: Any, transaction: Transaction) -> None:
        self.transaction = transaction
        self.dtype = k.dtype
        self.k, self.v, self.xp = as_storage(k), as_storage(v), xp
        self._host: dict[int, tuple[Any, Any]] = {}  # sid -> host (k, v) [L, n_blocks, ...]

    def __contains__(self, sid: int) -> bool:
        return sid in self._host

    def __len__(self) -> int:
        return len(self._host)

    def save(self, sid: int, blocks: np.ndarray) -> None:
        """Copy the K/V of ``blocks`` (``sid``'s, in order) to new host buffers, kept for
        :meth:`load` (inside the call that swapped ``sid`` out)."""
        xp = self.xp
        index = xp.asarray(blocks.astype(np.intp))
        host = []
        for pages in (self.k, self.v):
            gathered = pages[:, index]  # [num_layers, n_blocks, heads, block_size, head_dim]
            buffer = _host_empty(xp, gathered.shape, gathered.dtype)
            if xp is np:
                buffer[...] = gathered
            else:
                gathered.get(out=buffer)
            host.append(buffer)
        self.transaction.record(self._forget, sid)
        self._host[sid] = (host[0], host[1])

    def load(self, sid: int, blocks: np.ndarray) -> None:
        """Copy ``sid``'s host K/V into ``blocks`` (its fresh ones, in order) and forget the host
        copy (inside the call that swapped it in)."""
        k_host, v_host = self._host[sid]
        assert k_host.shape[1] == blocks.size, (
            f"sequence {sid} has {k_host.shape[1]} host blocks, got {blocks.size} to load"
        )
        xp = self.xp
        self.transaction.record(self._host.__setitem__, sid, (k_host, v_host))
        index = xp.asarray(blocks.astype(np.intp))
        self.transaction.wrote_kv()
        self.k[:, index] = xp.asarray(k_host)
        self.v[:, index] = xp.asarray(v_host)
        del self._host[sid]

    def gather(self, blocks: np.ndarray, length: int, start: int) -> tuple[Any, Any]:
        """Copies of a resident sequence's keys and values, in token order: each
        ``[num_layers, length, num_kv_heads, head_dim]``, zeros for the tokens of the ``start``
        blocks the window released; ``blocks`` are the ones it holds, in order."""
        xp = self.xp
        index = xp.asarray(blocks.astype(np.intp))
        out = []
        for pages in (self.k, self.v):
            layers, _, heads, block_size, head_dim = pages.shape
            gathered = pages[:, index].transpose(0, 1, 3, 2, 4)  # [L, n, block_size, H, D]
            tokens = gathered.reshape(layers, index.size * block_size, heads, head_dim)
            if start:  # the released blocks' tokens first: zeros
                kept = xp.zeros((layers, length, heads, head_dim), pages.dtype)
                kept[:, start * block_size :] = tokens[:, : length - start * block_size]
                out.append(kept)
            else:
                out.append(tokens[:, :length].copy())
        return out[0].view(self.dtype), out[1].view(self.dtype)

    def drop(self, sids: list[int]) -> None:
        """Forget the host copies of freed sequences (inside the call that frees them)."""
        dropped = {sid: self._host[sid] for sid in sids if sid in self._host}
        if dropped:
            self.transaction.record(self._host.update, dropped)
            for sid in dropped:
                del self._host[sid]

    def check_invariants(self, manager: BlockManager) -> None:
        """Exactly the swapped-out sequences of ``manager`` have host copies, each of
        ``ceil(n / block_size)`` blocks for ``n`` tokens, less those the window released."""
        live = manager.sequence_ids
        require(self._host.keys() <= set(live), "a freed sequence kept its host copy")
        for sid in live:
            swapped = sid in self._host
            require(
                swapped == manager.is_swapped(sid),
                f"sequence {sid} is {'' if swapped else 'not '}swapped but its row says otherwise",
            )
        swapped_ids = list(self._host)
        lens, released = manager.lengths(swapped_ids)
        for sid, length, gone in zip(swapped_ids, lens.tolist(), released.tolist(), strict=True):
            n_blocks = self._host[sid][0].shape[1]
            require(
                n_blocks == cdiv(length, manager.block_size) - gone,
                f"swapped sequence {sid} has {length} tokens ({gone} blocks released) in "
                f"{n_blocks} host blocks",
            )

    def _forget(self, sid: int) -> None:
        self._host.pop(sid, None)


def _host_empty(xp: Any, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Host memory for a swapped-out sequence: pinned when the cache is on the GPU."""
    if xp is np:
        return np.empty(shape, dtype)
    import cupyx

    return cupyx.empty_pinned(shape, dtype)
