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

With prefix caching, every full block is registered under a key that chains the keys of the blocks
before it (:mod:`cupaged.prefix_cache`); a new sequence whose prompt starts with cached blocks
shares them instead of recomputing them, and freed cached blocks stay findable until evicted.
Swapping moves a sequence's K/V to host memory and back, for preemption.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ._backend import array_module, device_module, resolve_device, to_numpy
from ._checks import as_int, check_dtype, check_shape, require
from .block_pool import BlockPool
from .block_table import DeviceBlockTable
from .dtypes import as_storage, storage_dtype
from .errors import CupagedError, OutOfBlocksError
from .memory import CacheSpec
from .ops import copy_blocks, write_kv
from .prefix_cache import (
    BlockHasher,
    PrefixCacheStats,
    blake2b_block_hash,
    block_content,
    salt_root,
)

_INT32_MAX = 2**31 - 1
_NOTHING_RELEASED: dict[int, int] = {}


@dataclass(slots=True)
class _Sequence:
    blocks: list[int]  # physical block ids in logical order
    length: int  # tokens stored (or reserved)
    row: int  # row of the device block table; -1 while swapped out
    # Prefix caching only: token ids, the key of each full block, the chain's root and salt.
    tokens: list[int] | None = None
    keys: list[bytes] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)  # BLAKE2b chain of the token prefix
    root: bytes = b""
    salt: bytes | None = None
    cached_tokens: int = 0  # prompt tokens served from the cache when the sequence was added
    swapped: tuple[Any, Any] | None = None  # host (k, v) [num_layers, n_blocks, ...] when out


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
        enable_prefix_caching: register full blocks by content so that sequences sharing a prompt
            prefix share its blocks; ``add_sequence``, ``append`` and ``reserve`` then take token ids.
        block_hasher: the :data:`~cupaged.prefix_cache.BlockHasher` of prefix caching (BLAKE2b by
            default); tests inject colliding ones.

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
        *,
        enable_prefix_caching: bool = False,
        block_hasher: BlockHasher | None = None,
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
        self.prefix_caching = bool(enable_prefix_caching)
        if block_hasher is not None and not self.prefix_caching:
            raise ValueError("block_hasher= needs enable_prefix_caching=True")
        self._hasher = block_hasher or blake2b_block_hash
        self._stats = PrefixCacheStats()

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
        """Blocks not referenced by any sequence (cached but evictable ones included)."""
        return self._pool.num_free

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Hits, misses, evictions and served tokens of prefix caching (a snapshot)."""
        return replace(self._stats, evictions=self._pool.evictions)

    def num_cached_tokens(self, sid: int) -> int:
        """Prompt tokens of ``sid`` found in the cache by ``add_sequence(tokens=...)``.

        The caller computes K/V for the rest of the prompt only: ``prompt[num_cached_tokens:]``.
        """
        return self._get(sid).cached_tokens

    def is_swapped(self, sid: int) -> bool:
        """Whether sequence ``sid`` is swapped out to host memory."""
        return self._get(sid).swapped is not None

    @property
    def sequence_ids(self) -> list[int]:
        """Ids of the live sequences, oldest first."""
        return list(self._seqs)

    def seq_len(self, sid: int) -> int:
        """Number of tokens stored (or reserved) for sequence ``sid``."""
        return self._get(sid).length

    def block_table(self, sid: int) -> list[int]:
        """Physical block ids of sequence ``sid`` in logical order (a copy)."""
        return list(self._resident(sid).blocks)

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
        seqs = [self._resident(sid) for sid in sids]
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
        seq = self._resident(sid)
        blocks = self._xp.asarray(np.asarray(seq.blocks, dtype=np.intp))
        out = []
        for pages in (self.k, self.v):
            layers, _, heads, block_size, head_dim = pages.shape
            gathered = pages[:, blocks].transpose(0, 1, 3, 2, 4)  # [L, n, block_size, H, D]
            tokens = gathered.reshape(layers, len(seq.blocks) * block_size, heads, head_dim)
            out.append(tokens[:, : seq.length].copy())
        return out[0], out[1]

    # ----------------------------------------------------------------------------- lifecycle

    def add_sequence(
        self, tokens: Sequence[int] | None = None, cache_salt: str | bytes | None = None
    ) -> int:
        """Start a sequence. Returns its id.

        Without prefix caching the sequence starts empty and takes no block until tokens arrive.
        With it, pass the prompt's token ids: every leading full block of the prompt already in
        the cache is attached (shared, refcount up), and :meth:`num_cached_tokens` says how many
        prompt tokens that covers; append K/V for the rest. The block holding the prompt's last
        token is never attached, so at least one token is left to compute (its logits are needed).

        Args:
            tokens: the prompt's token ids (prefix caching only).
            cache_salt: a per-request salt (prefix caching only); sequences share cached blocks
                only with sequences of the same salt.
        """
        if not self.prefix_caching:
            if tokens is not None or cache_salt is not None:
                raise ValueError(
                    "tokens= and cache_salt= need PagedCache(enable_prefix_caching=True)"
                )
            sid = self._next_id
            self._seqs[sid] = _Sequence(blocks=[], length=0, row=self._table.acquire_row([]))
            self._next_id += 1
            return sid
        prompt = _token_list(tokens if tokens is not None else [], "tokens")
        salt = cache_salt.encode() if isinstance(cache_salt, str) else cache_salt
        if salt is not None and not isinstance(salt, bytes):
            raise TypeError(
                f"expected cache_salt to be str or bytes, got {type(cache_salt).__name__}"
            )
        bs = self.spec.block_size
        root = salt_root(salt)
        hits: list[tuple[int, bytes, bytes]] = []  # (block, key, digest)
        parent, parent_digest = root, root
        for j in range(max(len(prompt) - 1, 0) // bs):
            chunk = prompt[j * bs : (j + 1) * bs]
            key, digest = self._chain(parent, parent_digest, chunk)
            found = self._pool.lookup(key)
            if found is None or found[1] != block_content(parent_digest, chunk, salt):
                break  # a miss, or a hash collision caught by the content check
            hits.append((found[0], key, digest))
            parent, parent_digest = key, digest
        for block, _, _ in hits:
            self._pool.acquire(block)
        cached = len(hits) * bs
        self._stats.hits += len(hits)
        self._stats.misses += len(prompt) // bs - len(hits)
        self._stats.cached_tokens += cached
        blocks = [block for block, _, _ in hits]
        sid = self._next_id
        self._seqs[sid] = _Sequence(
            blocks=blocks, length=cached, row=self._table.acquire_row(blocks),
            tokens=prompt[:cached], keys=[key for _, key, _ in hits],
            digests=[digest for _, _, digest in hits], root=root, salt=salt,
            cached_tokens=cached,
        )  # fmt: skip
        self._next_id += 1
        return sid

    def fork(self, sid: int) -> int:
        """Start a sequence that shares every block of ``sid`` (parallel sampling, beam search).

        No K/V is copied: each shared block's refcount goes up by one. Whichever of the two
        sequences first writes into a shared, partly filled block gets a private copy of it.

        Returns:
            The child's id.
        """
        parent = self._resident(sid)
        for block in parent.blocks:
            self._pool.incref(block)
        child = self._next_id
        row = self._table.acquire_row(parent.blocks)
        self._seqs[child] = replace(
            parent,
            blocks=list(parent.blocks),
            row=row,
            tokens=None if parent.tokens is None else list(parent.tokens),
            keys=list(parent.keys),
            digests=list(parent.digests),
            cached_tokens=0,
        )
        self._next_id += 1
        return child

    def free(self, sid: int) -> None:
        """End sequence ``sid``: drop its references; unshared blocks return to the pool.

        Cached full blocks are not wiped: they become evictable, last block first, so that a
        prompt's head survives eviction longest.
        """
        seq = self._get(sid)
        del self._seqs[sid]
        self._release(seq)

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
                (full blocks are registered under keys of their token ids), refused without.
        """
        seq = self._resident(sid)
        k, v = self._check_kv(k, v)
        (new_tokens,) = self._check_tokens(
            [seq], [k.shape[1]], None if tokens is None else [tokens]
        )
        if k.shape[1] == 0:
            return
        slots = self._reserve(
            [seq], [k.shape[1]], f"appending {k.shape[1]} token(s) to sequence {sid}"
        )
        for layer in range(self.spec.num_layers):
            write_kv(self.k[layer], self.v[layer], k[layer], v[layer], slots)
        self._register_full_blocks(seq, new_tokens)

    def reserve(
        self,
        sids: int | Iterable[int],
        num_tokens: int | Sequence[int] = 1,
        tokens: Sequence[Sequence[int]] | None = None,
    ) -> Any:
        """Make room for the next tokens of a batch and return where to write them.

        For pipelines that compute K/V layer by layer and write them with :func:`cupaged.write_kv`
        (``cache.k[layer]``, ``cache.v[layer]``, ``slots``). The lengths grow at once: write every
        returned slot in every layer before attending. Shared partly filled blocks are copied
        first (copy-on-write). All or nothing: if the pool cannot hold every token of every
        sequence, :class:`OutOfBlocksError` is raised and nothing changes.

        Args:
            sids: one sequence id or several distinct ones.
            num_tokens: tokens per sequence: one int for all, or one per sequence.
            tokens: with prefix caching, the new tokens' ids, one sequence of ids per sequence
                (full blocks are registered at once: write their K/V before anyone attends).

        Returns:
            ``[sum(num_tokens)]`` int32 slot mapping on the cache's device, sequence after sequence
            in the order of ``sids``: ``slot = block * block_size + offset``.
        """
        sid_list = [sids] if isinstance(sids, (int, np.integer)) else list(sids)
        seqs = [self._resident(sid) for sid in sid_list]
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
        new_tokens = self._check_tokens(seqs, counts, tokens)
        slots = self._reserve(
            seqs, counts, f"reserving {sum(counts)} token(s) for {len(seqs)} sequence(s)"
        )
        for seq, ids in zip(seqs, new_tokens, strict=True):
            self._register_full_blocks(seq, ids)
        return slots

    # ----------------------------------------------------------------------------- swapping

    def swap_out(self, sid: int) -> None:
        """Move sequence ``sid``'s K/V (every layer) to host memory and free its device blocks.

        The host copy is pinned on the GPU and taken in one gather and one transfer per K and V.
        Shared blocks are copied too: the swapped sequence owns a private host copy, and the
        other sequences keep their references. Until :meth:`swap_in`, the sequence cannot be
        appended to, reserved for, forked or attended to (``CupagedError``); ``seq_len``, ``free``
        and ``swap_in`` work.
        """
        seq = self._resident(sid)
        index = self._xp.asarray(np.asarray(seq.blocks, dtype=np.intp))
        host = []
        for pages in (self.k, self.v):
            gathered = pages[:, index]  # [num_layers, n_blocks, heads, block_size, head_dim]
            buffer = _host_empty(self._xp, gathered.shape, gathered.dtype)
            if self._xp is np:
                buffer[...] = gathered
            else:
                gathered.get(out=buffer)
            host.append(buffer)
        self._release(seq)
        seq.blocks, seq.row, seq.swapped = [], -1, (host[0], host[1])

    def swap_in(self, sid: int) -> None:
        """Bring a swapped-out sequence back: allocate blocks and copy its K/V in.

        The blocks are fresh (sharing is not restored); full ones are registered in the prefix
        cache again unless their key is taken. All or nothing: :class:`OutOfBlocksError` changes
        nothing and the sequence stays swapped out.
        """
        seq = self._get(sid)
        if seq.swapped is None:
            raise CupagedError(f"sequence {sid} is not swapped out")
        k_host, v_host = seq.swapped
        blocks = self._pool.allocate(k_host.shape[1])  # raises before any change
        index = self._xp.asarray(np.asarray(blocks, dtype=np.intp))
        self.k[:, index] = self._xp.asarray(k_host)
        self.v[:, index] = self._xp.asarray(v_host)
        seq.blocks, seq.row, seq.swapped = blocks, self._table.acquire_row(blocks), None
        self._register_keys(seq, 0)

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

    def _release(self, seq: _Sequence) -> None:
        """Drop a resident sequence's references (last block first) and its table row."""
        if seq.swapped is not None:
            return
        for block in reversed(seq.blocks):
            self._pool.decref(block)
        self._table.release_row(seq.row, len(seq.blocks))

    def _check_tokens(
        self, seqs: list[_Sequence], counts: list[int], tokens: Sequence[Sequence[int]] | None
    ) -> list[list[int]]:
        """Validate the token ids given with new tokens: required with prefix caching only."""
        if not self.prefix_caching:
            if tokens is not None:
                raise ValueError("tokens= needs PagedCache(enable_prefix_caching=True)")
            return [[] for _ in seqs]
        if tokens is None:
            raise ValueError(
                "expected tokens= (the new tokens' ids): prefix caching keys full blocks by them"
            )
        if isinstance(tokens, (str, bytes)) or len(tokens) != len(seqs):
            raise ValueError(f"expected one list of token ids per sequence ({len(seqs)})")
        lists = [_token_list(ids, "tokens") for ids in tokens]
        for n, ids in zip(counts, lists, strict=True):
            if len(ids) != n:
                raise ValueError(f"expected {n} token ids (one per new token), got {len(ids)}")
        return lists

    def _register_full_blocks(self, seq: _Sequence, new_tokens: list[int]) -> None:
        """Record new token ids and register every block they completed."""
        if seq.tokens is None:
            return
        seq.tokens.extend(new_tokens)
        self._register_keys(seq, len(seq.keys))

    def _register_keys(self, seq: _Sequence, start: int) -> None:
        """Register full blocks ``start ..`` of ``seq`` under their chained keys."""
        if seq.tokens is None:
            return
        bs = self.spec.block_size
        for j in range(start, seq.length // bs):
            parent = seq.keys[j - 1] if j else seq.root
            parent_digest = seq.digests[j - 1] if j else seq.root
            chunk = seq.tokens[j * bs : (j + 1) * bs]
            if j == len(seq.keys):
                key, digest = self._chain(parent, parent_digest, chunk)
                seq.keys.append(key)
                seq.digests.append(digest)
            content = block_content(parent_digest, chunk, seq.salt)
            self._pool.register(seq.blocks[j], seq.keys[j], content)

    def _chain(self, parent: bytes, parent_digest: bytes, chunk: list[int]) -> tuple[bytes, bytes]:
        """The next block's lookup key (``block_hasher``) and verification digest (BLAKE2b).

        The digest chain always uses BLAKE2b, whatever ``block_hasher`` is, so that a hit is
        verified against the whole token prefix even when the lookup keys collide.
        """
        key = self._hasher(parent, chunk)
        if self._hasher is blake2b_block_hash:
            return key, key  # the same function: one hash serves both
        return key, blake2b_block_hash(parent_digest, chunk)

    def _resident(self, sid: int) -> _Sequence:
        seq = self._get(sid)
        if seq.swapped is not None:
            raise CupagedError(f"sequence {sid} is swapped out; call swap_in({sid}) first")
        return seq

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
            self._check_prefix_invariants(sid, seq)
            if seq.swapped is not None:
                require(not seq.blocks and seq.row == -1, f"swapped sequence {sid} holds blocks")
                n_blocks = seq.swapped[0].shape[1]
                require(
                    n_blocks == self.spec.blocks_for(seq.length),
                    f"swapped sequence {sid} has {seq.length} tokens in {n_blocks} host blocks",
                )
                continue
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

    def _check_prefix_invariants(self, sid: int, seq: _Sequence) -> None:
        if seq.tokens is None:
            require(not seq.keys, f"sequence {sid} has block keys without prefix caching")
            return
        require(
            len(seq.tokens) == seq.length,
            f"sequence {sid} has {seq.length} tokens but {len(seq.tokens)} token ids",
        )
        full = seq.length // self.spec.block_size
        require(
            len(seq.keys) == len(seq.digests) == full,
            f"sequence {sid} has {full} full blocks, {len(seq.keys)} keys, {len(seq.digests)} digests",
        )
        for j, block in enumerate(seq.blocks[:full]):
            key = self._pool.cached_key(block)
            require(
                key is None or key == seq.keys[j],
                f"block {block} of sequence {sid} is registered under another key",
            )


def _token_list(tokens: Any, what: str) -> list[int]:
    """Token ids as a list of Python ints, from a sequence of ints or a 1-D integer array."""
    if isinstance(tokens, (str, bytes)):
        raise TypeError(
            f"expected {what} to be a sequence of int token ids, got {type(tokens).__name__}"
        )
    array = to_numpy(tokens) if hasattr(tokens, "dtype") else np.asarray(list(tokens))
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise TypeError(
            f"expected {what} to be a 1-D sequence of int token ids, got {array.dtype} "
            f"of shape {array.shape}"
        )
    return array.astype(np.int64).tolist()


def _host_empty(xp: Any, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Host memory for a swapped-out sequence: pinned when the cache is on the GPU."""
    if xp is np:
        return np.empty(shape, dtype)
    import cupyx

    return cupyx.empty_pinned(shape, dtype)
