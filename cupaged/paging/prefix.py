"""Prefix caching: content keys of full blocks, the chain that links them, and the hit counters.

A full block is identified by a chain of hashes: its key hashes its parent block's key and its own
token ids, so equal keys mean an equal prefix up to and including the block::

    root  = H("cupaged-salt" + salt)                       (b"" without a salt)
    key_0 = hasher(root,  tokens[0 : bs])
    key_1 = hasher(key_0, tokens[bs : 2 bs])  ...

The default hasher is BLAKE2b (128-bit digest), never Python's ``hash()``: a collision would hand
one request another's K/V. As a second line of defence every hit is verified against the content
stored with the block: the BLAKE2b digest of the whole token prefix up to and including the block,
salt included (a chain like the keys, but always BLAKE2b, whatever ``block_hasher`` is). With the
default hasher the two chains are one and each block costs one hash. A per-request ``cache_salt``
starts a separate chain, so tenants who must not share K/V never do.

:class:`PrefixCache` walks and extends chains over a :class:`~cupaged.BlockPool`; the block manager
uses it, and an engine that owns its own tensors and uses ``BlockPool`` alone can too::

    pool = BlockPool(1024)
    prefix = PrefixCache(pool, block_size=16)
    hits, chain = prefix.match(prompt)          # leading cached blocks, and the chain after them
    pool.acquire(hits)
    own = pool.allocate(n_more)                 # ... write K/V of prompt[len(hits) * 16:] ...
    prefix.extend(chain, prompt[len(hits) * 16 : n_full * 16], own[: n_full - len(hits)])
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .pool import BlockPool
from .tokens import TOKEN_DTYPE, token_array

BlockHasher = Callable[[bytes, Sequence[int]], bytes]
"""``hasher(parent_key, token_ids) -> key``: the content key of a full block."""


def blake2b_block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The default :data:`BlockHasher`: BLAKE2b-128 of the parent key and the int64 token ids."""
    digest = _BLAKE2B_16.copy()
    digest.update(parent + np.asarray(tokens, dtype=TOKEN_DTYPE).tobytes())
    return digest.digest()


def salt_root(salt: bytes | None) -> bytes:
    """The parent key of a sequence's first block: empty, or a hash of the salt."""
    if salt is None:
        return b""
    return hashlib.blake2b(b"cupaged-salt" + salt, digest_size=16).digest()


def as_salt(cache_salt: str | bytes | None) -> bytes | None:
    """A ``cache_salt`` argument as bytes (``str`` is UTF-8 encoded)."""
    salt = cache_salt.encode() if isinstance(cache_salt, str) else cache_salt
    if salt is not None and not isinstance(salt, bytes):
        raise TypeError(f"expected cache_salt to be str or bytes, got {type(cache_salt).__name__}")
    return salt


Block = tuple[Hashable, bytes]
"""``(key, digest)`` of one full block: its lookup key (``block_hasher``) and the BLAKE2b digest
of the token prefix through it, which a hit is verified against."""


@dataclass(slots=True)
class PrefixChain:
    """The keys of a sequence's full blocks, in order, and where its chain starts.

    Each full block's key and digest are computed once, when the block's tokens become known (a
    prompt's at admission, a decode step's when its block fills), and kept here: what is
    registered, committed, forked and registered again after a swap is read, never hashed again.

    Attributes:
        root: the parent key of block 0 (:func:`salt_root` of ``salt``).
        salt: the per-request salt, or ``None``.
        keys: ``keys[j]`` is block ``j``'s lookup key (``block_hasher``).
        digests: ``digests[j]``: BLAKE2b of the whole token prefix through block ``j``, what a
            hit on ``keys[j]`` is verified against.
        committed: the leading blocks whose K/V are known written: only they are registered.
    """

    root: bytes
    salt: bytes | None
    keys: list[Hashable] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)
    committed: int = 0

    def copy(self) -> PrefixChain:
        return PrefixChain(
            self.root, self.salt, list(self.keys), list(self.digests), self.committed
        )

    def parent(self) -> tuple[Hashable, bytes]:
        """``(key, digest)`` that the chain's next full block follows."""
        if self.keys:
            return self.keys[-1], self.digests[-1]
        return self.root, self.root

    def commit_all(self) -> None:
        """Count every block of the chain committed (registered, or refused for a key held)."""
        self.committed = len(self.keys)

    def truncate(self, length: int, committed: int) -> None:
        """Keep the first ``length`` blocks, ``committed`` of them committed (an undo)."""
        del self.keys[length:], self.digests[length:]
        self.committed = committed

    def add(self, blocks: list[Block]) -> None:
        """Append full blocks (what :meth:`PrefixCache.keys` gives) to the chain."""
        if len(blocks) == 1:  # (a decode step's block)
            key, digest = blocks[0]
            self.keys.append(key)
            self.digests.append(digest)
        elif blocks:
            keys, digests = zip(*blocks, strict=True)
            self.keys += keys
            self.digests += digests


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters of a cache's prefix caching.

    Attributes:
        hits: full prompt blocks served from the cache by ``add_sequence(tokens=...)``.
        misses: full prompt blocks that were not (and so had to be computed).
        evictions: cached blocks reused for new content because no free block was left.
        cached_tokens: prompt tokens served from the cache (``hits * block_size``).
    """

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    cached_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / (hits + misses)``; 0 before the first lookup."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class PrefixCache:
    """Finds and registers full blocks by content over a :class:`~cupaged.BlockPool`.

    The chain walk is written once (``_walk``): each full block is hashed once, when its
    tokens become known, and its key and digest go to its sequence's :class:`PrefixChain`.
    Matching a prompt hashes its full blocks (its chain's entries, which admission keeps) and
    looks them up in the pool's prefix map until the first miss: lookups, nothing remembered.

    Args:
        pool: the pool whose prefix map holds the keys.
        block_size: tokens per block.
        hasher: the :data:`BlockHasher` (BLAKE2b by default); tests inject colliding ones.

    Example:
        >>> from cupaged import BlockPool
        >>> pool = BlockPool(8)
        >>> prefix = PrefixCache(pool, block_size=2)
        >>> blocks = pool.allocate(2)
        >>> chain = prefix.chain()
        >>> prefix.extend(chain, [5, 6, 7, 8], blocks)       # two full blocks, now findable
        >>> prefix.match([5, 6, 7, 8, 9])[0]                  # a prompt sharing both
        [0, 1]
        >>> prefix.match([5, 6, 7, 8])[0]     # the block of the last token is left to compute
        [0]
    """

    def __init__(self, pool: BlockPool, block_size: int, hasher: BlockHasher | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.hasher = hasher or blake2b_block_hash
        self._default = self.hasher is blake2b_block_hash
        self.stats = PrefixCacheStats()

    def save_stats(self) -> tuple[int, int, int]:
        """The counters a match changes, for :meth:`restore_stats` (a rollback)."""
        stats = self.stats
        return stats.hits, stats.misses, stats.cached_tokens

    def restore_stats(self, saved: tuple[int, int, int]) -> None:
        stats = self.stats
        stats.hits, stats.misses, stats.cached_tokens = saved

    def chain(self, cache_salt: str | bytes | None = None) -> PrefixChain:
        """An empty chain: the one of a sequence with no full block yet."""
        salt = as_salt(cache_salt)
        return PrefixChain(salt_root(salt), salt)

    def keys(self, chain: PrefixChain, tokens: np.ndarray) -> list[Block]:
        """:data:`Block` of each full block of ``tokens`` (int64), the blocks that follow
        ``chain``'s last one; ``chain`` itself is not changed."""
        return self._walk([chain.parent()], tokens)

    def next_keys(self, chains: list[PrefixChain], chunks: np.ndarray) -> list[Block]:
        """:data:`Block` of one full block after each chain: ``chunks`` is ``[len(chains),
        block_size]`` int64 (a decode step's blocks that filled, one per sequence)."""
        return self._walk([chain.parent() for chain in chains], chunks.reshape(-1))

    def _walk(self, parents: list[tuple[Hashable, bytes]], tokens: np.ndarray) -> list[Block]:
        """The chain walk, written once: :data:`Block` of each full block of ``tokens`` (int64,
        ``len(tokens) // block_size`` blocks). Block ``j`` follows ``parents[j]`` (``(key,
        digest)``) where given, else block ``j - 1``."""
        data, bs = tokens.tobytes(), self.block_size
        width = bs * TOKEN_DTYPE.itemsize
        hasher = None if self._default else self.hasher
        fresh, given, out = _BLAKE2B_16.copy, len(parents), []
        for j in range(len(tokens) // bs):
            if j < given:
                key, digest = parents[j]
            h = fresh()
            h.update(digest + data[j * width : (j + 1) * width])
            digest = h.digest()
            # The default hasher's key chain and the digest chain are one.
            key = digest if hasher is None else hasher(key, tokens[j * bs : (j + 1) * bs].tolist())
            out.append((key, digest))
        return out

    def match(
        self, tokens: Any, cache_salt: str | bytes | None = None
    ) -> tuple[list[int], PrefixChain]:
        """The cached leading full blocks of a prompt, and the chain through them.

        The block holding the prompt's last token is never matched: at least one token is left to
        compute, its logits are needed. Counts hits and misses; takes no reference (call
        :meth:`BlockPool.acquire` on the blocks).

        Returns:
            ``(blocks, chain)``: the hit blocks in order, and the chain of the prompt's first
            ``len(blocks)`` blocks.
        """
        blocks, chain, _ = self.match_unchecked(token_array(tokens), as_salt(cache_salt))
        return blocks, chain

    def match_unchecked(
        self, tokens: np.ndarray, salt: bytes | None
    ) -> tuple[list[int], PrefixChain, list[Block]]:
        """:meth:`match` for checked int64 ``tokens`` and a ``bytes`` salt; also returns the
        :data:`Block` entries of the prompt's full blocks after the hits, which admission keeps in
        the chain and registers once their K/V are written."""
        bs = self.block_size
        full = len(tokens) // bs
        lookable = max(len(tokens) - 1, 0) // bs
        chain = PrefixChain(salt_root(salt), salt)
        entries = self._walk([chain.parent()], tokens[: full * bs])  # each block hashed once
        find = self.pool.keys.find
        blocks: list[int] = []
        for key, digest in entries[:lookable]:
            block = find(key, digest)
            if block is None:
                break  # a miss, or a hash collision caught by the content check
            blocks.append(block)
        hits = len(blocks)
        if hits:
            chain.add(entries[:hits])
        chain.committed = hits  # cached blocks: written by whoever registered them
        stats = self.stats
        stats.hits += hits
        stats.misses += full - hits
        stats.cached_tokens += hits * bs
        return blocks, chain, entries[hits:]

    def extend(self, chain: PrefixChain, tokens: Any, blocks: Sequence[int] | np.ndarray) -> None:
        """Register ``blocks`` (in use) as the full blocks that follow ``chain``, holding
        ``tokens`` (``len(blocks) * block_size`` ids), and append their keys to ``chain``.

        A key that another block already holds keeps that block (the first writer wins).
        """
        tokens = token_array(tokens)
        if len(tokens) != len(blocks) * self.block_size:
            raise ValueError(
                f"expected {len(blocks) * self.block_size} token ids for {len(blocks)} full "
                f"block(s), got {len(tokens)}"
            )
        self.extend_unchecked(chain, tokens, np.asarray(blocks).tolist())

    def extend_unchecked(self, chain: PrefixChain, tokens: np.ndarray, blocks: list[int]) -> None:
        """:meth:`extend` with ``tokens`` an int64 array and ``blocks`` in use (unchecked)."""
        new = self.keys(chain, tokens)
        if new:
            keys, digests = zip(*new, strict=True)
            self.pool.keys.register_many(blocks, keys, digests)
        chain.add(new)
        chain.commit_all()


# BLAKE2b-128 of ``parent + data``: copying a prepared state is faster than parsing the keyword
# arguments of a new one.
_BLAKE2B_16 = hashlib.blake2b(digest_size=16)
