"""PagedCache: a :class:`~cupaged.BlockManager` that owns the K/V pool and writes into it.

The bookkeeping (tables, refcounts, copy-on-write plans, prefix caching) is the block manager's;
this class adds the arrays: one ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]``
array each for K and V, :meth:`PagedCache.append` (plan + write in one call), copy-on-write copies
applied by ``copy_blocks``, and swapping a sequence's K/V to host memory and back (preemption).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ._backend import array_module
from ._checks import check_dtype, check_shape, require
from ._launch import check_decode_shape
from .block_manager import _NO_COPIES, Admission, BlockManager, StepPlan
from .block_table import SequenceBatch
from .dtypes import as_storage, storage_dtype
from .errors import CupagedError
from .memory import CacheSpec
from .ops import copy_blocks, write_kv
from .prefix_cache import BlockHasher


class PagedCache(BlockManager):
    """A paged KV cache: block pool, per-sequence block tables, refcounts and copy-on-write.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: tokens per block.
        num_layers: transformer layers (each has its own K and V pages).
        num_kv_heads: key/value heads per layer.
        head_dim: elements per head vector.
        dtype: ``"float16"``, ``"float32"`` or ``"bfloat16"`` (stored as ``uint16``).
        device: ``"cuda"`` (CuPy arrays), ``"cpu"`` (NumPy arrays) or ``None`` for CUDA when CuPy
            sees a GPU and the CPU otherwise.
        enable_prefix_caching: register full blocks by content so that sequences sharing a prompt
            prefix share its blocks; ``add_sequence``, ``admit``, ``append``, ``step`` and
            ``reserve`` then take token ids.
        block_hasher: the :data:`~cupaged.prefix_cache.BlockHasher` of prefix caching (BLAKE2b by
            default); tests inject colliding ones.
        attention_kernels: refuse, here and now, a shape that the fused attention kernels cannot
            take (dtype, ``head_dim`` in 64..256 in multiples of 16, ``block_size`` in 1..256),
            rather than at the first ``paged_attention`` hours into a job. ``False`` for a cache
            attended only by :func:`~cupaged.reference_attention` or your own kernels.

    Attributes:
        k: ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`` keys; ``k[layer]`` is
            one layer's pages, the layout that :func:`cupaged.write_kv` and the attention take.
        v: values, same shape and dtype as ``k``.
        spec: the :class:`~cupaged.CacheSpec` (shape and memory arithmetic).
        device: ``"cuda"`` or ``"cpu"``.

    Example:
        >>> import numpy as np
        >>> cache = PagedCache(num_blocks=8, block_size=4, num_layers=2, num_kv_heads=1,
        ...                    head_dim=64, dtype="float32", device="cpu")
        >>> sid = cache.add_sequence()
        >>> kv = np.ones((2, 6, 1, 64), np.float32)    # [num_layers, n_tokens, heads, head_dim]
        >>> cache.append(sid, kv, kv)
        >>> cache.block_table(sid), cache.seq_len(sid), cache.num_free_blocks
        ([0, 1], 6, 6)
        >>> child = cache.fork(sid)                      # shares blocks 0 and 1
        >>> cache.append(child, kv[:, :1], kv[:, :1])    # copies block 1 before writing
        >>> cache.block_table(child)
        [0, 2]
        >>> cache.free_many([sid, child]); cache.num_free_blocks
        8
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        num_layers: int = 1,
        num_kv_heads: int = 1,
        head_dim: int = 128,
        dtype: Any = "float16",
        device: str | None = None,
        *,
        enable_prefix_caching: bool = False,
        block_hasher: BlockHasher | None = None,
        attention_kernels: bool = True,
    ) -> None:
        self.spec = CacheSpec(num_layers, num_kv_heads, head_dim, dtype, block_size)
        if attention_kernels:
            check_decode_shape(self.spec.dtype, self.spec.head_dim, self.spec.block_size)
        super().__init__(
            num_blocks,
            self.spec.block_size,
            device=device,
            enable_prefix_caching=enable_prefix_caching,
            block_hasher=block_hasher,
        )
        shape = (num_layers, self.num_blocks, num_kv_heads, self.spec.block_size, head_dim)
        self.k = self._xp.zeros(shape, storage_dtype(self.spec.dtype))
        self.v = self._xp.zeros(shape, storage_dtype(self.spec.dtype))
        self._swapped: dict[int, tuple[Any, Any]] = {}  # sid -> host (k, v) [L, n_blocks, ...]

    # ----------------------------------------------------------------------------- writing

    def append(self, sid: int, k: Any, v: Any, tokens: Sequence[int] | None = None) -> None:
        """Append tokens' keys and values to sequence ``sid``, in every layer.

        All or nothing: when the pool cannot hold every new token, :class:`OutOfBlocksError` is
        raised and nothing is allocated or written.

        Args:
            sid: the sequence.
            k: ``[num_layers, n_tokens, num_kv_heads, head_dim]`` in the cache's dtype (bfloat16 as
                ``uint16``, or ``ml_dtypes.bfloat16`` on the CPU), on the cache's device.
            v: same shape and dtype as ``k``.
            tokens: the appended tokens' ids, ``n_tokens`` of them; required with prefix caching
                (full blocks are registered under keys of their token ids).
        """
        with self._atomic as atomic:  # a failed copy or write undoes the plan too
            row = self._resident_row(sid)  # (inside: no other thread's call in between)
            k, v = self._check_kv(k, v)
            n = int(k.shape[1])
            new_tokens = self._check_tokens(True, 1, n, tokens)
            if n == 0:
                return
            rows = np.array([row], np.intp)
            slots, src, dst = self._plan(
                rows, n, new_tokens, f"appending {n} token(s) to sequence {sid}"
            )
            atomic.kv_written = True
            self._copy(src, dst, checked=False)  # the cache's own plan: valid by construction
            slots = self._xp.asarray(slots)
            for layer in range(self.spec.num_layers):
                # The slots come from this cache's own plan: distinct and in range, so unchecked.
                write_kv(self.k[layer], self.v[layer], k[layer], v[layer], slots, checked=False)
            atomic.undo.append(self._chains_restorer([row]))
            self._commit_rows([row])  # written: its full blocks may serve other sequences now

    def step(
        self,
        sids: int | Iterable[int] | SequenceBatch,
        num_tokens: int | Sequence[int] | np.ndarray = 1,
        tokens: Any = None,
        *,
        apply_copies: bool = True,
        tables: bool = False,
    ) -> StepPlan:
        """:meth:`BlockManager.step`, with the copy-on-write copies applied to ``k`` and ``v``.

        Args:
            tables: also build ``plan.block_tables`` and ``plan.context_lens`` (see
                :meth:`BlockManager.step`).
            apply_copies: ``False`` leaves them to the caller (``plan.copies_applied`` is then
                ``False``): call :meth:`apply_copies` with ``plan.copy_src, plan.copy_dst`` (or
                batch them with your own launch) before writing this step's K/V.
        """
        if type(sids) is int and type(num_tokens) is int and num_tokens == 1 and not tables:
            # One token in its own last block: no copy to apply.
            slot = None if tokens is not None else self._step_one(sids)
            if slot is not None:
                return StepPlan(slot, _NO_COPIES, _NO_COPIES, 1, 1)
        if not apply_copies:  # the manager's step as it is (its own transaction)
            return super().step(sids, num_tokens, tokens, tables=tables)
        with self._atomic as atomic:  # a failed copy undoes the plan too
            plan = super().step(sids, num_tokens, tokens, tables=tables)
            if plan.copy_src.size:
                atomic.kv_written = True
                self._copy(plan.copy_src, plan.copy_dst, checked=False)  # its own plan: valid
                plan.copies_applied = True
        return plan

    def reserve(
        self,
        sids: int | Iterable[int] | SequenceBatch,
        num_tokens: int | Sequence[int] | np.ndarray = 1,
        tokens: Any = None,
    ) -> Any:
        """Make room for the next tokens of a batch and return where to write them.

        For pipelines that compute K/V layer by layer and write them with :func:`cupaged.write_kv`
        (``cache.k[layer]``, ``cache.v[layer]``, ``slots``). The lengths grow at once: write every
        returned slot in every layer before attending. Shared partly filled blocks are copied
        first (copy-on-write). All or nothing: if the pool cannot hold every token of every
        sequence, :class:`OutOfBlocksError` is raised and nothing changes. :meth:`step` returns
        the whole plan.

        Args:
            sids: a :class:`SequenceBatch`, one sequence id, or several distinct ones.
            num_tokens: tokens per sequence: one int for all, or one per sequence.
            tokens: the new tokens' ids (see :meth:`BlockManager.step`); required with prefix
                caching (full blocks become findable once their K/V are known written: at the
                sequence's next step, or by :meth:`commit`).

        Returns:
            ``[sum(num_tokens)]`` int32 slot mapping on the cache's device, sequence after sequence
            in the order of ``sids``: ``slot = block * block_size + offset``.
        """
        if type(sids) is int and type(num_tokens) is int and num_tokens == 1 and tokens is None:
            slot = self._step_one(sids)  # the per-token call, in its fewest operations
            if slot is not None:
                return slot
        return self.step(sids, num_tokens, tokens).slots

    def admit(self, prompt: Sequence[int], cache_salt: str | bytes | None = None) -> Admission:
        return super().admit(prompt, cache_salt)  # a fresh tail: never a copy to apply

    admit.__doc__ = BlockManager.admit.__doc__

    def decode_plan(
        self,
        sids: Iterable[int] | SequenceBatch,
        num_q_heads: int,
        *,
        scale: float | None = None,
        num_splits: int | None = None,
    ) -> Any:
        """The decode attention of a batch, planned once for every layer of this step.

        ``plan.run(q, cache.k[layer], cache.v[layer])`` then attends each layer (see
        :class:`cupaged.DecodePlan`). The plan reads the batch's tables as they are now: make a new
        one after the next ``step`` (a :class:`SequenceBatch`'s device tables are refreshed in
        place, which a captured CUDA graph may rely on with :meth:`DecodePlan.update`).

        Args:
            sids: a :class:`SequenceBatch`, or sequence ids in the order of the query rows.
            num_q_heads: query heads, a multiple of ``spec.num_kv_heads``.
            scale: softmax scale; ``head_dim ** -0.5`` when ``None``.
            num_splits: see :class:`cupaged.DecodePlan`.
        """
        from .decode import DecodePlan

        tables, lens = self.block_tables(sids)
        # The cache's own tables: valid by construction, so the plan trusts them.
        return DecodePlan(tables, lens, self.k[0], num_q_heads, scale=scale,
                          num_splits=num_splits, checked=False)  # fmt: skip

    def gather_kv(self, sid: int) -> tuple[Any, Any]:
        """Copy a sequence's keys and values out of the pages, in token order.

        Returns:
            ``(k, v)``, each ``[num_layers, seq_len, num_kv_heads, head_dim]`` in the cache's
            storage dtype.
        """
        row = self._resident_row(sid)
        length = int(self._seqs.lens[row])
        blocks = self._xp.asarray(self._seqs.tables[row, : self._held(row)].astype(np.intp))
        out = []
        for pages in (self.k, self.v):
            layers, _, heads, block_size, head_dim = pages.shape
            gathered = pages[:, blocks].transpose(0, 1, 3, 2, 4)  # [L, n, block_size, H, D]
            tokens = gathered.reshape(layers, blocks.size * block_size, heads, head_dim)
            out.append(tokens[:, :length].copy())
        return out[0], out[1]

    # ----------------------------------------------------------------------------- swapping

    def swap_out(self, sid: int) -> None:
        """Move sequence ``sid``'s K/V (every layer) to host memory and free its device blocks.

        The host copy is pinned on the GPU and taken in one gather and one transfer per K and V.
        Shared blocks are copied too: the swapped sequence owns a private host copy, and the
        other sequences keep their references. Until :meth:`swap_in`, the sequence cannot be
        appended to, reserved for, forked or attended to (``CupagedError``); ``seq_len``, ``free``
        and ``swap_in`` work.
        """
        table = self._seqs
        with self._atomic as atomic:  # (the copy too: no other thread's call in between)
            row = self._resident_row(sid)
            blocks = table.tables[row, : self._held(row)]
            index = self._xp.asarray(blocks.astype(np.intp))
            host = []
            for pages in (self.k, self.v):
                gathered = pages[:, index]  # [num_layers, n_blocks, heads, block_size, head_dim]
                buffer = _host_empty(self._xp, gathered.shape, gathered.dtype)
                if self._xp is np:
                    buffer[...] = gathered
                else:
                    gathered.get(out=buffer)
                host.append(buffer)
            saved = table.snapshot(row)
            atomic.undo.append(lambda: (table.restore(row, saved), self._swapped.pop(sid, None)))
            self._pool.release(blocks[::-1].copy())
            table.tables[row] = 0
            table.live[row] = -1
            table.epoch += 1  # batches holding it must check again
            table.shared[row] = False
            table.touch(row)
            self._swapped[sid] = (host[0], host[1])

    def swap_in(self, sid: int) -> None:
        """Bring a swapped-out sequence back: allocate blocks and copy its K/V in.

        The blocks are fresh (sharing is not restored); full ones are registered in the prefix
        cache again unless their key is taken. All or nothing: :class:`OutOfBlocksError` changes
        nothing and the sequence stays swapped out.
        """
        table = self._seqs
        with self._atomic as atomic:  # (the lookups too: no other thread's call in between)
            row = self._row(sid)
            if sid not in self._swapped:
                raise CupagedError(f"sequence {sid} is not swapped out")
            k_host, v_host = self._swapped[sid]
            n_blocks = k_host.shape[1]
            blocks = self._pool.allocate(n_blocks)  # raises before any change
            saved = table.snapshot(row)
            atomic.undo.append(
                lambda: (
                    table.restore(row, saved),
                    self._swapped.__setitem__(sid, (k_host, v_host)),
                )
            )
            index = self._xp.asarray(np.asarray(blocks, dtype=np.intp))
            atomic.kv_written = True
            self.k[:, index] = self._xp.asarray(k_host)
            self.v[:, index] = self._xp.asarray(v_host)
            table.ensure_width(n_blocks + 1)
            table.tables[row, :n_blocks] = blocks
            table.live[row] = sid
            table.touch(row)
            del self._swapped[sid]
            if self.prefix_caching:
                self._prefix.register_chain(self._chains[row], blocks)

    # ----------------------------------------------------------------------------- internals

    def _release(self, sids: list[int], rows: list[int]) -> None:
        super()._release(sids, rows)
        if not self._swapped:  # mostly: no host copy to drop
            return
        dropped = {sid: self._swapped.pop(sid) for sid in sids if sid in self._swapped}
        if dropped:
            self._atomic.undo.append(lambda: self._swapped.update(dropped))

    def apply_copies(self, src: Any, dst: Any) -> None:
        """Copy block ``src[i]`` onto block ``dst[i]`` in every layer of ``k`` and ``v``, in one
        launch: a :class:`StepPlan`'s copy-on-write pairs (host or device int32 arrays), checked
        like any ``copy_blocks`` call."""
        with self._atomic:
            self._copy(src, dst, checked=True)

    def _copy(self, src: Any, dst: Any, checked: bool) -> None:
        if len(src):
            src, dst = self._xp.asarray(src), self._xp.asarray(dst)
            copy_blocks(self.k, self.v, src, dst, checked=checked)

    def _check_kv(self, k: Any, v: Any) -> tuple[Any, Any]:
        xp = array_module(k, v)
        if xp is not self._xp:
            raise TypeError(
                f"expected k and v on the cache's device ({self.device}: "
                f"{self._xp.__name__} arrays), got {xp.__name__} arrays"
            )
        spec = self.spec
        dims = [
            ("num_layers", spec.num_layers),
            ("n_tokens", None),
            ("num_kv_heads", spec.num_kv_heads),
            ("head_dim", spec.head_dim),
        ]
        check_shape("k", k, dims)
        if tuple(v.shape) != tuple(k.shape):
            raise ValueError(
                f"expected k and v of the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}"
            )
        check_dtype("k", k, spec.dtype, "the cache's dtype")
        check_dtype("v", v, spec.dtype, "the cache's dtype")
        return as_storage(k), as_storage(v)

    # ----------------------------------------------------------------------------- checking

    def check_invariants(self) -> None:
        """Check every invariant of the bookkeeping; O(pool + tables), for tests and debugging.

        :meth:`BlockManager.check_invariants`, and: a swapped-out sequence of ``n`` tokens keeps
        ``ceil(n / block_size)`` host blocks and holds no device block.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        super().check_invariants()
        for sid, row in self._rows.items():
            swapped = sid in self._swapped
            require(
                swapped == (self._seqs.live[row] < 0),
                f"sequence {sid} is {'' if swapped else 'not '}swapped but its row says otherwise",
            )
            if swapped:
                n_blocks = self._swapped[sid][0].shape[1]
                length = int(self._seqs.lens[row])
                require(
                    n_blocks == self.spec.blocks_for(length),
                    f"swapped sequence {sid} has {length} tokens in {n_blocks} host blocks",
                )
        require(self._swapped.keys() <= self._rows.keys(), "a freed sequence kept its host copy")


def _host_empty(xp: Any, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Host memory for a swapped-out sequence: pinned when the cache is on the GPU."""
    if xp is np:
        return np.empty(shape, dtype)
    import cupyx

    return cupyx.empty_pinned(shape, dtype)
