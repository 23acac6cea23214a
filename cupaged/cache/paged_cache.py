"""PagedCache: the K/V pool and its writes, over a :class:`~cupaged.BlockManager`'s public verbs.

The bookkeeping (tables, refcounts, copy-on-write plans, prefix caching, which blocks a swap
frees or takes) is the block manager's, which the cache has (``cache.manager``) and calls only
through its public verbs; this class adds the arrays: one
``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`` array each for K and V,
:meth:`PagedCache.append` (plan + write in one call), copy-on-write copies applied by
``copy_blocks``, swapping a sequence's K/V to host memory and back (preemption, by a
:class:`~cupaged.cache.swap.Swapper`), and the attention plans of a step over its own tables.

With ``window_left=W`` (a sliding window, :mod:`~cupaged.paging.window`) the cache releases the
blocks no query can see any more, and its plans attend with that window: a model whose layers
all use one window (Mistral) has one such cache; one that mixes full and sliding layers
(Gemma 2/3, gpt-oss) has two, one per kind, and admits, steps and frees each request on both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .._arrays.checks import check_dtype, check_fp8_source, check_shape
from .._util import cdiv
from ..attention.decode import DecodePlan
from ..attention.ops import copy_blocks, write_kv
from ..attention.prefill import PrefillPlan
from ..backend import array_module, device_module
from ..dtypes import Q_DTYPE_NAMES, array_dtype_name, as_storage, cache_dtype, is_fp8
from ..errors import CupagedError, OutOfBlocksError
from ..kernels.launch_decode import check_decode_shape
from ..paging.batch import SequenceBatch
from ..paging.manager import BlockManager
from ..paging.prefix import BlockHasher
from ..paging.results import StepPlan
from ..paging.tokens import step_tokens
from ..paging.transaction import atomic, forwards, run_atomically
from .forwarding import ManagerVerbs
from .scales import KVScales
from .spec import CacheSpec
from .swap import Swapper


class PagedCache(ManagerVerbs):
    """A paged KV cache: block pool, per-sequence block tables, refcounts and copy-on-write.

    It has a :class:`BlockManager` (:attr:`manager`) for the bookkeeping and offers every public
    verb of it too (:class:`~cupaged.cache.forwarding.ManagerVerbs`: ``add_sequence``,
    ``admit``, ``fork``, ``seq_len``, ``block_tables``, ``transaction`` ...), adding the K/V
    arrays to the calls that move K/V. It is no ``BlockManager`` subclass: code that takes a
    manager takes ``cache.manager``.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: tokens per block.
        num_layers: transformer layers (each has its own K and V pages).
        num_kv_heads: key/value heads per layer.
        head_dim: elements per head vector.
        dtype: ``"float16"``, ``"float32"``, ``"bfloat16"`` (``uint16`` bits, ``ml_dtypes`` on
            CuPy 14), or fp8: ``"float8_e4m3"`` / ``"float8_e5m2"`` (``ml_dtypes`` arrays on the
            CPU, ``uint8`` on a GPU; docs/fp8.md).
        device: ``"cuda"`` (CuPy arrays), ``"cpu"`` (NumPy arrays) or ``None`` for CUDA when CuPy
            sees a GPU and the CPU otherwise.
        enable_prefix_caching: register full blocks by content so that sequences sharing a prompt
            prefix share its blocks; ``add_sequence``, ``admit``, ``append``, ``step`` and
            ``reserve`` then take token ids.
        block_hasher: the :data:`~cupaged.paging.prefix.BlockHasher` of prefix caching (BLAKE2b by
            default); tests inject colliding ones.
        attention_kernels: refuse, here and now, a shape that the fused attention kernels cannot
            take (dtype, ``head_dim`` in 64..256 in multiples of 16, ``block_size`` in 1..256),
            rather than at the first ``paged_attention`` hours into a job. ``False`` for a cache
            attended only by :func:`~cupaged.reference_attention` or your own kernels.
        window_left: a sliding window ``W`` (``-1``: none): the query at ``i`` sees keys
            ``j >= i - W``; blocks before the window are released (their table entries ``-1``)
            and the cache's plans attend with ``window_left=W`` (see :class:`BlockManager`).
        k_scales, v_scales: an fp8 cache's scales (:meth:`set_kv_scales`); ``None``: 1.0.

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
        window_left: int = -1,
        k_scales: Any = None,
        v_scales: Any = None,
    ) -> None:
        self.spec = CacheSpec(num_layers, num_kv_heads, head_dim, dtype, block_size)
        if attention_kernels:
            check_decode_shape(self.spec.dtype, self.spec.head_dim, self.spec.block_size)
        self._manager = BlockManager(
            num_blocks,
            self.spec.block_size,
            device=device,
            enable_prefix_caching=enable_prefix_caching,
            block_hasher=block_hasher,
            window_left=window_left,
        )
        self.device = self._manager.device
        self.prefix_caching = self._manager.prefix_caching
        self._xp = device_module(self.device)
        self._transaction = self._manager.transaction()  # (what `atomic` enters)
        self._scales = KVScales(self._xp, self.spec.dtype, num_layers, num_kv_heads)
        self._scales.set(k_scales, v_scales)  # (before the K/V: a refusal allocates none)
        shape = (num_layers, self.num_blocks, num_kv_heads, self.spec.block_size, head_dim)
        self.k, self.v = (self._xp.zeros(shape, cache_dtype(dtype, self._xp)) for _ in "kv")
        self._swapper = Swapper(self.k, self.v, self._xp, self._transaction)

    # ----------------------------------------------------------------------------- writing

    @atomic
    def append(self, sid: int, k: Any, v: Any, tokens: Sequence[int] | None = None) -> None:
        """Append tokens' keys and values to sequence ``sid``, in every layer.

        All or nothing: when the pool cannot hold every new token, :class:`OutOfBlocksError` is
        raised and nothing is allocated or written. With a window, the blocks before the window
        of the first new token are released in the same call (none of them takes a new token).

        Args:
            sid: the sequence.
            k: ``[num_layers, n_tokens, num_kv_heads, head_dim]`` in the cache's dtype (bfloat16:
                any carrier), on the cache's device; for an fp8 cache float32, float16 or
                bfloat16, quantized with each layer's scales.
            v: same shape and dtype as ``k``.
            tokens: the appended tokens' ids, ``n_tokens`` of them; required with prefix caching
                (full blocks are registered under keys of their token ids).
        """
        k, v = _check_kv(self._xp, self.device, self.spec, k, v)
        manager, transaction, n = self._manager, self._transaction, int(k.shape[1])
        if n == 0:  # nothing to plan: the checks only
            manager.block_table(sid)  # (KeyError, or CupagedError for a swapped-out one)
            step_tokens(True, 1, 0, tokens, self.prefix_caching)
            return
        what = "appending {} token(s) to sequence {}"  # (formatted on a refusal only)
        if n > manager.num_blocks * manager.block_size:  # more than the pool can ever hold
            manager.block_table(sid)  # (KeyError, or CupagedError for a swapped-out one)
            length, size = manager.seq_len(sid), manager.block_size
            needed = cdiv(length + n, size) - cdiv(length, size)
            raise OutOfBlocksError(needed, manager.num_free_blocks, what.format(n, sid))
        # The copies applied inside the step; with a window the step releases the blocks before
        # its first new token's window, none of which holds one of its slots.
        try:
            plan = manager.step(sid, n, tokens, copy=self._copy_own)
        except OutOfBlocksError as error:  # (nothing changed) named as the call the caller made
            raise OutOfBlocksError(error.needed, error.available, what.format(n, sid)) from None
        transaction.wrote_kv()
        for layer in range(self.spec.num_layers):
            self._scales.calibrate(layer, k[layer], v[layer], transaction.record)
            options = self._scales.options(layer, write=True)
            # The slots come from this cache's own plan: distinct and in range, so unchecked.
            pages = self.k[layer], self.v[layer]
            write_kv(*pages, k[layer], v[layer], plan.slots, checked=False, **options)
        if self.prefix_caching:  # written: its full blocks may serve others now
            manager.commit(sid)

    @forwards
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
                ``False``): call :meth:`apply_copies` with ``plan.copy_src, plan.copy_dst``
                before writing this step's K/V. Until then each pair holds its source block
                (so that nothing overwrites what it copies), and :meth:`pending_copies` lists
                them: a ``KeyboardInterrupt`` that lands once the step is done loses the plan,
                never the pairs.
        """
        if apply_copies:
            return self._manager.step(sids, num_tokens, tokens, tables=tables, copy=self._copy_own)
        return self._manager.step(sids, num_tokens, tokens, tables=tables, hold_copies=True)

    @forwards
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
        return self._manager.step(sids, num_tokens, tokens, copy=self._copy_own).slots

    @atomic
    def apply_copies(self, src: Any, dst: Any) -> None:
        """Copy block ``src[i]`` onto block ``dst[i]`` in every layer of ``k`` and ``v``, in one
        launch: the copy-on-write pairs of a :class:`StepPlan` that this cache's
        ``step(..., apply_copies=False)`` left to the caller (host or device int32 arrays), in
        any order, all of a step's or some; then their sources' holds go.

        Raises:
            ValueError: a pair that is not such a copy still to apply: any other destination may
                hold another sequence's written tokens, which the copy would overwrite.
        """
        self._manager.release_copies(src, dst)  # refuses others; copied below, in this call
        self._transaction.wrote_kv()
        self._copy(src, dst, checked=True)

    def pending_copies(self) -> tuple[np.ndarray, np.ndarray]:
        """The copy-on-write pairs that ``step(..., apply_copies=False)`` left and no
        :meth:`apply_copies` applied yet: ``(src, dst)``, ``[num_pairs]`` int32 host arrays, in
        the order the steps left them (pairs of freed sequences are gone).

        What a caller learns here when the plan that carried them was lost (a
        ``KeyboardInterrupt`` that landed after the step was done), or to apply several steps'
        pairs in one launch::

            cache.apply_copies(*cache.pending_copies())
        """
        return self._manager.pending_copies()

    def kv_scales(self, layer: int) -> tuple[Any, Any]:
        """``(k_scale, v_scale)``: ``[num_kv_heads]`` float32 device arrays that ``cache.k[layer]``
        is read with (``(None, None)`` for a cache that is not fp8)."""
        return self._scales.layer(layer)

    def scale_options(self, layer: int, *, write: bool = False) -> dict[str, Any]:
        """The keywords of ``layer``'s scales for a plan's ``run`` (``write_kv`` with ``write``:
        ``kv_dtype`` too): :meth:`KVScales.options <cupaged.cache.scales.KVScales.options>`."""
        return self._scales.options(layer, write)

    @atomic
    def set_kv_scales(self, k_scales: Any = None, v_scales: Any = None) -> None:
        """Replace an fp8 cache's scales, while it holds no K/V.

        ``k_scales``, ``v_scales``: each ``None`` (1.0), a positive finite number, a
        ``[num_layers]`` or ``[num_layers, num_kv_heads]`` array of them (copied), or ``"auto"``
        (each layer's first write fixes them: :mod:`cupaged.cache.scales`).

        Raises:
            CupagedError: the cache holds K/V (a block in use or cached, a sequence swapped out).
            ValueError, TypeError: not an fp8 cache, or bad values. (Refused: nothing changes.)
        """
        _check_no_kv(self._manager.pool, len(self._swapper))
        self._scales.set(k_scales, v_scales, self._transaction.record)

    def calibrate_kv_scales(self, layer: int, k: Any, v: Any) -> None:
        """Fix ``layer``'s pending ``"auto"`` scales from the ``[n_tokens, num_kv_heads,
        head_dim]`` K/V about to be written there by ``write_kv`` (:meth:`append` does it)."""
        if self._scales.pending(layer):
            transaction = self._transaction
            run_atomically(transaction, self._scales.calibrate, layer, k, v, transaction.record)

    # ----------------------------------------------------------------------------- attention

    @forwards
    def decode_plan(
        self,
        sids: StepPlan | Iterable[int] | SequenceBatch,
        num_q_heads: int,
        *,
        scale: float | None = None,
        num_splits: int | None = None,
        batch_invariant: bool = False,
        logits_soft_cap: float = 0.0,
        alibi_slopes: Any = None,
        q_dtype: Any = None,
        cascade: bool | None = None,
    ) -> DecodePlan:
        """The decode attention of a batch, planned once for every layer of this step.

        ``plan.run(q, cache.k[layer], cache.v[layer])`` then attends each layer (see
        :class:`cupaged.DecodePlan`). The plan reads the batch's tables as they are now: make a new
        one after the next ``step`` (a :class:`SequenceBatch`'s device tables are refreshed in
        place, which a captured CUDA graph may rely on with :meth:`DecodePlan.update`). It
        attends with the cache's :attr:`window_left`, so it never reads a released entry. It
        trusts the cache's own tables and scales (``scale_options``); a scale array of yours
        given to ``run`` is checked there (``tables_checked=False``, ``trusted_scales``).

        Args:
            sids: a :class:`SequenceBatch`, sequence ids in the order of the query rows, or a
                :class:`StepPlan` of this cache made with ``step(..., tables=True)``, the
                latest of its sequences (``ValueError`` once a later call stepped, freed or
                swapped out one of them).
            num_q_heads: query heads, a multiple of ``spec.num_kv_heads``.
            scale: softmax scale; ``head_dim ** -0.5`` when ``None``.
            num_splits, batch_invariant: see :class:`cupaged.DecodePlan` (docs/batch-invariance.md).
            logits_soft_cap, alibi_slopes: the model's variants, as :class:`cupaged.DecodePlan`
                takes them.
            q_dtype: the queries' dtype over an fp8 cache (a plan runs one; default float16),
                else ``None`` or the cache's dtype. Then ``run(..., **cache.scale_options(layer))``.
            cascade: rows sharing leading blocks (forks, prefix-cache hits) read them once
                (docs/cascade.md): ``None`` when that saves enough bytes, ``True`` whenever
                two rows share a block, ``False`` never.
        """
        tables, lens = self._manager.block_tables(sids)  # (a StepPlan: its step's)
        options = _variants(self.window_left, logits_soft_cap, alibi_slopes)
        if self.device == "cuda" and cascade is not False and not batch_invariant:
            # the cascade planner reads host copies (none runs with batch_invariant=True)
            options["host_tables"] = self._manager.block_tables(sids, host=True)
        options.update(scale=scale, num_splits=num_splits, cascade=cascade, **self._trusted())
        options.update(_fp8_plan_options(self.spec.dtype, q_dtype), batch_invariant=batch_invariant)
        return DecodePlan(tables, lens, self.k[0], num_q_heads, **options)

    @forwards
    def prefill_plan(
        self,
        step: StepPlan | Iterable[int] | SequenceBatch,
        num_q_heads: int,
        *,
        num_tokens: Any = None,
        scale: float | None = None,
        causal: bool = True,
        num_splits: int | None = None,
        batch_invariant: bool = False,
        logits_soft_cap: float = 0.0,
        alibi_slopes: Any = None,
        q_dtype: Any = None,
    ) -> PrefillPlan:
        """The attention of a prefill or mixed step, planned once for every layer of the step.

        ``plan.run(q, cache.k[layer], cache.v[layer])`` then attends each layer's packed queries
        (see :class:`cupaged.PrefillPlan`): sequence ``i``'s new tokens, the last ``n_i`` of
        its length, are rows ``query_start_loc[i] : query_start_loc[i + 1]`` of ``q``. The
        tables and lengths are the cache's own, so nothing is checked or read back per step
        (nor the cache's own scales at each ``run``; a scale array of yours is checked), and it
        attends with the cache's :attr:`window_left`.

        Args:
            step: a :class:`StepPlan` of this cache made with ``step(..., tables=True)`` (its
                new tokens are the queries), the latest of its sequences (``ValueError`` once a
                later call stepped, freed or swapped out one of them), or sequence ids / a
                :class:`SequenceBatch` whose last ``num_tokens`` tokens are (an admission's
                prompt chunk).
            num_q_heads: query heads, a multiple of ``spec.num_kv_heads``.
            num_tokens: with ids or a batch: the query tokens per sequence (host ints).
            scale, causal, num_splits, batch_invariant, logits_soft_cap, alibi_slopes: see
                :class:`cupaged.PrefillPlan`.
            q_dtype: as :meth:`decode_plan` takes it.
        """
        manager = self._manager
        if isinstance(step, StepPlan):
            tables, _ = manager.block_tables(step)
            lens, starts = step.host_context_lens, step.query_start_loc
        else:
            if num_tokens is None:
                raise TypeError("expected num_tokens= (query tokens per sequence) with ids")
            if not isinstance(step, SequenceBatch):
                step = list(step)  # (resolved twice: for the tables, for the lengths)
            tables, _ = manager.block_tables(step)
            lens, released = manager.lengths(step)
            held_from = released.astype(np.int64) * self.spec.block_size
            starts = _query_starts(self.window_left, held_from, lens, num_tokens)
        options = _variants(self.window_left, logits_soft_cap, alibi_slopes)
        options.update(scale=scale, causal=causal, num_splits=num_splits, **self._trusted())
        options.update(_fp8_plan_options(self.spec.dtype, q_dtype), batch_invariant=batch_invariant)
        return PrefillPlan(tables, lens, starts, self.k[0], num_q_heads, **options)

    def gather_kv(self, sid: int) -> tuple[Any, Any]:
        """Copy a sequence's keys and values out of the pages, in token order.

        Returns:
            ``(k, v)``, each ``[num_layers, seq_len, num_kv_heads, head_dim]`` in the cache's
            array dtype; ``k[:, pos]`` is position ``pos``. The tokens of blocks that the
            window released (entries ``-1`` of :meth:`block_table`) are zeros.
        """
        held = np.array(self._manager.block_table(sid), np.int32)  # (refuses a swapped one)
        start = int(np.count_nonzero(held < 0))  # the window's released entries lead
        return self._swapper.gather(held[start:], self._manager.seq_len(sid), start)

    # ----------------------------------------------------------------------------- lifecycle

    @atomic
    def free(self, sid: int) -> None:
        """:meth:`BlockManager.free`, and the host copy of a swapped-out sequence with it."""
        self._manager.free(sid)
        if len(self._swapper):  # mostly: no host copy to drop
            self._swapper.drop([sid])

    @atomic
    def free_many(self, sids: Iterable[int]) -> None:
        """:meth:`BlockManager.free_many`, and the host copies of swapped-out ones with them."""
        sid_list = list(sids)
        self._manager.free_many(sid_list)
        if len(self._swapper):
            self._swapper.drop(sid_list)

    # ----------------------------------------------------------------------------- swapping

    @atomic
    def swap_out(self, sid: int) -> None:
        """Move sequence ``sid``'s K/V (every layer) to host memory and free its device blocks.

        Shared blocks are copied too: the swapped sequence owns a private host copy, and the
        other sequences keep their references. Until :meth:`swap_in`, the sequence cannot be
        appended to, reserved for, forked or attended to (``CupagedError``); ``seq_len``, ``free``
        and ``swap_in`` work. A sequence with a copy left to apply (``step(...,
        apply_copies=False)``) is refused (``CupagedError``): apply it first.
        """
        self._swapper.save(sid, self._manager.swap_out(sid))  # (the blocks: freed, unchanged)

    @atomic
    def swap_in(self, sid: int) -> None:
        """Bring a swapped-out sequence back: allocate blocks and copy its K/V in.

        The blocks are fresh (sharing is not restored); full ones are registered in the prefix
        cache again unless their key is taken. All or nothing: :class:`OutOfBlocksError` changes
        nothing and the sequence stays swapped out.
        """
        self._swapper.load(sid, self._manager.swap_in(sid))

    # ----------------------------------------------------------------------------- checking

    def check_invariants(self) -> None:
        """Check every invariant of the bookkeeping; O(pool + tables), for tests and debugging.

        :meth:`BlockManager.check_invariants`, and: a swapped-out sequence of ``n`` tokens keeps
        ``ceil(n / block_size)`` host blocks and holds no device block.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        self._manager.check_invariants()
        self._swapper.check_invariants(self._manager)
        self._scales.check_invariants()

    # ----------------------------------------------------------------------------- internals

    def _trusted(self) -> dict[str, Any]:
        """The plans' keywords for what they need not check: the cache's own tables and
        lengths (valid by construction) and its own scales (checked when set). A scale array of
        the caller's is checked at each ``run``."""
        own = self._scales.k, self._scales.v
        return {"tables_checked": False, "trusted_scales": () if own[0] is None else own}

    def _copy_own(self, src: np.ndarray, dst: np.ndarray) -> None:
        """A step's copies, inside it: the cache's own plan, valid by construction."""
        self._copy(src, dst, checked=False)

    def _copy(self, src: Any, dst: Any, checked: bool) -> None:
        if len(src):
            src, dst = self._xp.asarray(src), self._xp.asarray(dst)
            copy_blocks(self.k, self.v, src, dst, checked=checked)


def _check_no_kv(pool: Any, swapped: int) -> None:
    """Refuse new scales while a cache holds K/V: a block in use or in the prefix cache, or
    ``swapped`` sequences swapped out (their K/V would be read with the wrong scale)."""
    if pool.num_used or pool.num_evictable or swapped:
        raise CupagedError(
            "expected set_kv_scales on a cache that holds no K/V (they would be read with the "
            f"wrong scale), got {pool.num_used} block(s) in use, {pool.num_evictable} in the "
            f"prefix cache, {swapped} sequence(s) swapped out"
        )


def _check_kv(xp: Any, device: str, spec: CacheSpec, k: Any, v: Any) -> tuple[Any, Any]:
    """``append``'s K/V checked against the cache (device, shape, dtype), as storage views: the
    cache's dtype, or for an fp8 cache one of float32, float16, bfloat16 (both alike)."""
    got = array_module(k, v)
    if got is not xp:
        raise TypeError(
            f"expected k and v on the cache's device ({device}: {xp.__name__} arrays), got "
            f"{got.__name__} arrays"
        )
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
    if not is_fp8(spec.dtype):
        check_dtype("k", k, spec.dtype, "the cache's dtype")
        check_dtype("v", v, spec.dtype, "the cache's dtype")
        return as_storage(k), as_storage(v)
    why = f"quantized into the {spec.dtype} cache"
    for name, x in (("k", k), ("v", v)):
        check_fp8_source(name, x, f"one of {Q_DTYPE_NAMES} ({why})")
    check_dtype("v", v, array_dtype_name(k), "k's dtype")
    return as_storage(k), as_storage(v)


def _query_starts(window_left: int, held_from: np.ndarray, lens: np.ndarray, num_tokens: Any):
    """``query_start_loc`` of ``num_tokens`` queries per sequence (the last of each one's
    ``lens``), checked: one int count per sequence, in 1 .. its length, within what the window
    still holds (positions from ``held_from``)."""
    counts = np.asarray(num_tokens)
    if counts.shape != lens.shape or counts.dtype.kind not in "iu":
        raise ValueError(f"expected one int count per sequence ({lens.size}), got {counts!r}")
    if counts.size and (counts.min() < 1 or (counts > lens).any()):
        raise ValueError(
            f"expected counts in 1 .. each sequence's length {lens.tolist()}, got {counts.tolist()}"
        )
    if window_left >= 0:  # the queries' keys must still be held
        _check_held(window_left, held_from, lens, counts)
    starts = np.zeros(lens.size + 1, np.int32)
    np.cumsum(counts, out=starts[1:])
    return starts


def _check_held(window_left: int, held_from: np.ndarray, lens: np.ndarray, counts: np.ndarray):
    """Refuse query counts whose first query (at ``L - n``, seeing from ``L - n - W``) would
    reach a position before ``held_from``, where the window released the blocks."""
    most = np.where(held_from > 0, lens - held_from - window_left, lens)
    short = np.flatnonzero(counts > most)
    if short.size:
        i = int(short[0])
        raise ValueError(
            f"expected at most {int(most[i])} query tokens for sequence {i} (the window of "
            f"{window_left} released its positions before {int(held_from[i])}), got "
            f"{int(counts[i])}"
        )


def _fp8_plan_options(dtype: str, q_dtype: Any) -> dict[str, Any]:
    """The plans' ``q_dtype`` / ``kv_dtype`` keywords for a cache of ``dtype``: the one given,
    or for an fp8 cache its own (``kv_dtype``) and the queries' (float16 by default)."""
    if not is_fp8(dtype):
        return {} if q_dtype is None else {"q_dtype": q_dtype}
    return {"q_dtype": "float16" if q_dtype is None else q_dtype, "kv_dtype": dtype}


def _variants(window_left: int, logits_soft_cap: Any, alibi_slopes: Any) -> dict[str, Any]:
    """The variant keywords of a cache's plans: its window, and those the caller gave (the plans
    check them); a variant left off is not passed."""
    options: dict[str, Any] = {}
    if window_left >= 0:
        options["window_left"] = window_left
    if not (isinstance(logits_soft_cap, (int, float)) and logits_soft_cap == 0.0):
        options["logits_soft_cap"] = logits_soft_cap
    if alibi_slopes is not None:
        options["alibi_slopes"] = alibi_slopes
    return options
