"""PagedCache: sequences stored in fixed-size blocks of one preallocated K/V pool.

Token ``pos`` of a sequence lives in physical block ``table[pos // block_size]`` at offset
``pos % block_size``. With ``block_size = 4``, a sequence of 7 tokens whose table is ``[5, 2]``::

    logical block    0                 1
    tokens           0  1  2  3        4  5  6  .
                     |  |  |  |        |  |  |
    physical block   5 [0  1  2  3]    2 [4  5  6  .]     <- one free slot left in block 2

Its 8th token (position 7) fills block 2; the 9th takes a new block from the pool.

Blocks are shared by reference: :meth:`PagedCache.fork` gives a child the parent's table and bumps
every block's refcount. The first write into a shared, partly filled last block copies it first
(copy-on-write); full shared blocks are never written again, so they are never copied.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._backend import array_module, device_module, resolve_device
from ._checks import as_int, check_dtype, check_shape, require
from .block_pool import BlockPool
from .block_table import DeviceBlockTable
from .dtypes import as_storage, storage_dtype
from .errors import OutOfBlocksError
from .memory import CacheSpec
from .ops import copy_blocks, write_kv

_INT32_MAX = 2**31 - 1
_NOTHING_RELEASED: dict[int, int] = {}


@dataclass(slots=True)
class _Sequence:
    blocks: list[int]  # physical block ids in logical order
    length: int  # tokens stored (or reserved)
    row: int  # row of the device block table


class PagedCache:
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

    Attributes:
        k: ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`` keys; ``k[layer]`` is
            one layer's pages, the layout that :func:`cupaged.write_kv` and the attention take.
        v: values, same shape and dtype as ``k``.
        spec: the :class:`~cupaged.CacheSpec` (shape and memory arithmetic).
        device: ``"cuda"`` or ``"cpu"``.

    Example:
        >>> import numpy as np
        >>> cache = PagedCache(num_blocks=8, block_size=4, num_layers=2, num_kv_heads=1,
        ...                    head_dim=8, dtype="float32", device="cpu")
        >>> sid = cache.add_sequence()
        >>> kv = np.ones((2, 6, 1, 8), np.float32)     # [num_layers, n_tokens, heads, head_dim]
        >>> cache.append(sid, kv, kv)
        >>> cache.block_table(sid), cache.seq_len(sid), cache.num_free_blocks
        ([0, 1], 6, 6)
        >>> child = cache.fork(sid)                      # shares blocks 0 and 1
        >>> cache.append(child, kv[:, :1], kv[:, :1])    # copies block 1 before writing
        >>> cache.block_table(child)
        [0, 2]
        >>> cache.free(sid); cache.free(child); cache.num_free_blocks
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
    ) -> None:
        self.spec = CacheSpec(num_layers, num_kv_heads, head_dim, dtype, block_size)
        num_blocks = as_int(num_blocks, "num_blocks")
        if num_blocks < 1:
            raise ValueError(f"expected num_blocks >= 1, got {num_blocks}")
        if num_blocks * block_size > _INT32_MAX:
            raise ValueError(
                f"expected num_blocks * block_size <= {_INT32_MAX} (slots are int32), "
                f"got {num_blocks} * {block_size}"
            )
        self.device = resolve_device(device)
        self._xp = device_module(self.device)
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.k = self._xp.zeros(shape, storage_dtype(self.spec.dtype))
        self.v = self._xp.zeros(shape, storage_dtype(self.spec.dtype))
        self._pool = BlockPool(num_blocks)
        self._table = DeviceBlockTable(self._xp)
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0

    # ----------------------------------------------------------------------------- introspection

    @property
    def num_blocks(self) -> int:
        """Physical blocks in the pool."""
        return self._pool.num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.spec.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any sequence."""
        return self._pool.num_free

    @property
    def sequence_ids(self) -> list[int]:
        """Ids of the live sequences, oldest first."""
        return list(self._seqs)

    def seq_len(self, sid: int) -> int:
        """Number of tokens stored (or reserved) for sequence ``sid``."""
        return self._get(sid).length

    def block_table(self, sid: int) -> list[int]:
        """Physical block ids of sequence ``sid`` in logical order (a copy)."""
        return list(self._get(sid).blocks)

    def refcount(self, block: int) -> int:
        """Number of sequences whose table references physical block ``block``."""
        return self._pool.refcount(block)

    def block_tables(self, sids: Iterable[int]) -> tuple[Any, Any]:
        """Dense block tables and lengths of a batch, on the cache's device, for attention.

        Build them once per decode step and pass them to every layer's attention call.

        Args:
            sids: the batch's sequence ids, in the order of the query rows.

        Returns:
            ``(block_tables, context_lens)``: ``[len(sids), max_blocks]`` int32, padded with 0
            past each sequence's last block (``max_blocks`` is the batch's longest table, at
            least 1), and ``[len(sids)]`` int32.
        """
        seqs = [self._get(sid) for sid in sids]
        width = max((len(seq.blocks) for seq in seqs), default=0)
        tables = self._table.gather([seq.row for seq in seqs], max(width, 1))
        lens = np.fromiter((seq.length for seq in seqs), dtype=np.int32, count=len(seqs))
        return tables, self._xp.asarray(lens)

    def gather_kv(self, sid: int) -> tuple[Any, Any]:
        """Copy a sequence's keys and values out of the pages, in token order.

        Returns:
            ``(k, v)``, each ``[num_layers, seq_len, num_kv_heads, head_dim]`` in the cache's
            storage dtype.
        """
        seq = self._get(sid)
        blocks = self._xp.asarray(np.asarray(seq.blocks, dtype=np.intp))
        out = []
        for pages in (self.k, self.v):
            layers, _, heads, block_size, head_dim = pages.shape
            gathered = pages[:, blocks].transpose(0, 1, 3, 2, 4)  # [L, n, block_size, H, D]
            tokens = gathered.reshape(layers, len(seq.blocks) * block_size, heads, head_dim)
            out.append(tokens[:, : seq.length].copy())
        return out[0], out[1]

    # ----------------------------------------------------------------------------- lifecycle

    def add_sequence(self) -> int:
        """Start an empty sequence; no block is taken until tokens arrive. Returns its id."""
        sid = self._next_id
        self._seqs[sid] = _Sequence(blocks=[], length=0, row=self._table.acquire_row([]))
        self._next_id += 1
        return sid

    def fork(self, sid: int) -> int:
        """Start a sequence that shares every block of ``sid`` (parallel sampling, beam search).

        No K/V is copied: each shared block's refcount goes up by one. Whichever of the two
        sequences first writes into a shared, partly filled block gets a private copy of it.

        Returns:
            The child's id.
        """
        parent = self._get(sid)
        for block in parent.blocks:
            self._pool.incref(block)
        child = self._next_id
        row = self._table.acquire_row(parent.blocks)
        self._seqs[child] = _Sequence(list(parent.blocks), parent.length, row)
        self._next_id += 1
        return child

    def free(self, sid: int) -> None:
        """End sequence ``sid``: drop its references; unshared blocks return to the pool."""
        seq = self._get(sid)
        del self._seqs[sid]
        for block in reversed(seq.blocks):
            self._pool.decref(block)
        self._table.release_row(seq.row, len(seq.blocks))

    # ----------------------------------------------------------------------------- writing

    def append(self, sid: int, k: Any, v: Any) -> None:
        """Append tokens' keys and values to sequence ``sid``, in every layer.

        All or nothing: when the pool cannot hold every new token, :class:`OutOfBlocksError` is
        raised and nothing is allocated or written.

        Args:
            sid: the sequence.
            k: ``[num_layers, n_tokens, num_kv_heads, head_dim]`` in the cache's dtype (bfloat16 as
                ``uint16``, or ``ml_dtypes.bfloat16`` on the CPU), on the cache's device.
            v: same shape and dtype as ``k``.
        """
        seq = self._get(sid)
        k, v = self._check_kv(k, v)
        if k.shape[1] == 0:
            return
        slots = self._reserve(
            [seq], [k.shape[1]], f"appending {k.shape[1]} token(s) to sequence {sid}"
        )
        for layer in range(self.spec.num_layers):
            write_kv(self.k[layer], self.v[layer], k[layer], v[layer], slots)

    def reserve(self, sids: int | Iterable[int], num_tokens: int | Sequence[int] = 1) -> Any:
        """Make room for the next tokens of a batch and return where to write them.

        For pipelines that compute K/V layer by layer and write them with :func:`cupaged.write_kv`
        (``cache.k[layer]``, ``cache.v[layer]``, ``slots``). The lengths grow at once: write every
        returned slot in every layer before attending. Shared partly filled blocks are copied
        first (copy-on-write). All or nothing: if the pool cannot hold every token of every
        sequence, :class:`OutOfBlocksError` is raised and nothing changes.

        Args:
            sids: one sequence id or several distinct ones.
            num_tokens: tokens per sequence: one int for all, or one per sequence.

        Returns:
            ``[sum(num_tokens)]`` int32 slot mapping on the cache's device, sequence after sequence
            in the order of ``sids``: ``slot = block * block_size + offset``.
        """
        sid_list = [sids] if isinstance(sids, (int, np.integer)) else list(sids)
        seqs = [self._get(sid) for sid in sid_list]
        if len(set(map(id, seqs))) != len(seqs):
            raise ValueError(f"expected distinct sequence ids, got {sid_list}")
        if not isinstance(num_tokens, Iterable):
            counts = [as_int(num_tokens, "num_tokens")] * len(seqs)
        else:
            counts = [as_int(n, "num_tokens") for n in num_tokens]
            if len(counts) != len(seqs):
                raise ValueError(
                    f"expected one token count per sequence ({len(seqs)}), got {len(counts)}"
                )
        if any(n < 0 for n in counts):
            raise ValueError(f"expected num_tokens >= 0, got {counts}")
        return self._reserve(
            seqs, counts, f"reserving {sum(counts)} token(s) for {len(seqs)} sequence(s)"
        )

    # ----------------------------------------------------------------------------- internals

    def _reserve(self, seqs: list[_Sequence], counts: list[int], what: str) -> Any:
        """Allocate blocks and copy shared last blocks for ``counts[i]`` tokens of ``seqs[i]``.

        Plans first and checks the pool once, so that a failure changes nothing. Forked siblings
        in one batch that share a partly filled last block are counted exactly: all but the last
        writer copy it, and the last one writes in place once the others have let go.
        """
        block_size = self.spec.block_size
        released: dict[int, int] = {}  # copy-on-write references dropped so far by the plan
        needed = 0
        for seq, n in zip(seqs, counts, strict=True):
            needed += -(-(seq.length + n) // block_size) - len(seq.blocks)
            if self._needs_copy(seq, n, released):
                last = seq.blocks[-1]
                released[last] = released.get(last, 0) + 1
                needed += 1
        if needed > self._pool.num_free:
            raise OutOfBlocksError(needed, self._pool.num_free, what)

        free_before = self._pool.num_free
        slots = np.empty(sum(counts), dtype=np.int32)
        copy_src: list[int] = []
        copy_dst: list[int] = []
        start = 0
        for seq, n in zip(seqs, counts, strict=True):
            if self._needs_copy(seq, n, _NOTHING_RELEASED):
                old = seq.blocks[-1]
                (new,) = self._pool.allocate(1)
                self._pool.decref(old)
                seq.blocks[-1] = new
                self._table.write(seq.row, len(seq.blocks) - 1, [new])
                copy_src.append(old)
                copy_dst.append(new)
            grow = -(-(seq.length + n) // block_size) - len(seq.blocks)
            if grow:
                new_blocks = self._pool.allocate(grow)
                self._table.write(seq.row, len(seq.blocks), new_blocks)
                seq.blocks.extend(new_blocks)
            if n == 1:  # the decode step: skip NumPy's per-call overhead
                pos = seq.length
                slots[start] = seq.blocks[pos // block_size] * block_size + pos % block_size
            elif n:
                pos = np.arange(seq.length, seq.length + n)
                table = np.asarray(seq.blocks, dtype=np.int32)
                slots[start : start + n] = table[pos // block_size] * block_size + pos % block_size
            seq.length += n
            start += n
        require(
            free_before - self._pool.num_free == needed,
            f"the reservation planned {needed} block(s) but took {free_before - self._pool.num_free}",
        )
        if copy_src:
            src = self._xp.asarray(np.asarray(copy_src, dtype=np.int32))
            dst = self._xp.asarray(np.asarray(copy_dst, dtype=np.int32))
            copy_blocks(self.k, self.v, src, dst)
        return self._xp.asarray(slots)

    def _needs_copy(self, seq: _Sequence, n: int, released: dict[int, int]) -> bool:
        """Would writing ``n`` tokens into ``seq`` touch a block that another sequence still holds?

        Only a partly filled last block can be written; ``released`` counts references to it
        that earlier sequences of the same batch will have dropped by then.
        """
        if n == 0 or seq.length % self.spec.block_size == 0:
            return False
        last = seq.blocks[-1]
        return self._pool.refcount(last) - released.get(last, 0) > 1

    def _get(self, sid: int) -> _Sequence:
        is_id = isinstance(sid, (int, np.integer)) and not isinstance(sid, bool)  # True == 1
        if is_id and sid in self._seqs:
            return self._seqs[sid]
        if is_id and 0 <= sid < self._next_id:
            raise KeyError(f"sequence {sid} was already freed")
        raise KeyError(f"unknown sequence id {sid!r}")

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

        - every block is free or referenced, and its refcount equals its number of table entries;
        - a sequence of ``n`` tokens holds ``ceil(n / block_size)`` distinct blocks;
        - the device block-table rows match the sequences' tables, padded with 0.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        references: Counter[int] = Counter()
        rows: dict[int, list[int]] = {}
        for sid, seq in self._seqs.items():
            require(0 <= sid < self._next_id, f"sequence id {sid} was never handed out")
            expected = self.spec.blocks_for(seq.length)
            require(
                len(seq.blocks) == expected,
                f"sequence {sid} has {seq.length} tokens in {len(seq.blocks)} blocks, "
                f"expected {expected}",
            )
            require(
                len(set(seq.blocks)) == len(seq.blocks),
                f"sequence {sid} references a block twice: {seq.blocks}",
            )
            require(seq.row not in rows, f"sequence {sid} shares table row {seq.row}")
            rows[seq.row] = seq.blocks
            references.update(seq.blocks)
        self._pool.check_invariants(references)
        self._table.check_invariants(rows)
