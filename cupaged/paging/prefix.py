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
from collections.abc import Callable, Sequence
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


def _block_array(blocks: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block ids as a read-only ``intp`` array (what the prefix memo hands out, never copied)."""
    array = np.array(blocks, np.intp)
    array.flags.writeable = False
    return array


@dataclass(slots=True)
class PrefixChain:
    """The keys of a sequence's full blocks, in order, and where its chain starts.

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
    keys: list[bytes] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)
    committed: int = 0

    def copy(self) -> PrefixChain:
        return PrefixChain(
            self.root, self.salt, list(self.keys), list(self.digests), self.committed
        )


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

    The chain walk is written once (:meth:`keys`); :meth:`match` looks its keys up in the pool's
    prefix map until the first miss, :meth:`extend` registers the blocks it reaches.

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
        # BLAKE2b of (parent digest + block tokens) for blocks that hit, keyed by exactly those
        # two byte strings: a prompt head that many requests share costs a dict lookup per block
        # after its first hit, not a hash. A pure function's cache: exact, whatever the pool holds.
        self._memo: dict[tuple[bytes, bytes], bytes] = {}
        # Prompt heads that hit: (root, length in blocks, the last block's bytes) -> [all their
        # digests, the blocks they hit, the pool's ``unregistrations`` when those blocks were
        # seen, the head's bytes]. The lengths tried (newest first) and the bytes held are
        # bounded.
        self._runs: dict[tuple[bytes, int, bytes], list[Any]] = {}
        self._run_keys: set[tuple[bytes, int]] = set()  # (root, length) of the runs held
        self._run_lengths: list[int] = []
        self._run_bytes = 0

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

    def keys(self, chain: PrefixChain, tokens: np.ndarray) -> list[tuple[bytes, bytes]]:
        """The chain walk, written once: ``(key, digest)`` of each full block of ``tokens``
        (int64), the blocks that follow ``chain``'s last one; ``chain`` itself is not changed."""
        data, bs = tokens.tobytes(), self.block_size
        width = bs * TOKEN_DTYPE.itemsize
        key = chain.keys[-1] if chain.keys else chain.root
        digest = chain.digests[-1] if chain.digests else chain.root
        out, fresh, hasher = [], _BLAKE2B_16.copy, None if self._default else self.hasher
        for j in range(len(tokens) // bs):
            h = fresh()
            h.update(digest + data[j * width : (j + 1) * width])
            digest = h.digest()
            # The default hasher's key chain and the digest chain are one.
            key = digest if hasher is None else hasher(key, tokens[j * bs : (j + 1) * bs].tolist())
            out.append((key, digest))
        return out

    def next_keys(self, chains: list[PrefixChain], chunks: np.ndarray) -> list[tuple[bytes, bytes]]:
        """``(key, digest)`` of one full block after each chain: ``chunks`` is ``[len(chains),
        block_size]`` int64 (a decode step's blocks that filled, one per sequence)."""
        if not self._default:
            return [self.keys(chain, chunk)[0] for chain, chunk in zip(chains, chunks, strict=True)]
        # The default hasher, one block per chain, inlined: :meth:`keys` for many short chains.
        data, width = chunks.tobytes(), self.block_size * TOKEN_DTYPE.itemsize
        out, fresh = [], _BLAKE2B_16.copy
        for j, chain in enumerate(chains):
            h = fresh()
            h.update(
                (chain.digests[-1] if chain.digests else chain.root)
                + data[j * width : (j + 1) * width]
            )
            digest = h.digest()
            out.append((digest, digest))
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
        return (blocks.tolist() if isinstance(blocks, np.ndarray) else blocks), chain

    def match_unchecked(
        self, tokens: np.ndarray, salt: bytes | None
    ) -> tuple[list[int] | np.ndarray, PrefixChain, tuple[list[bytes], list[bytes]]]:
        """:meth:`match` for checked int64 ``tokens`` and a ``bytes`` salt (the hit blocks as a
        list, or as a read-only ``intp`` array when a remembered prompt head gave them all);
        also returns the keys and digests of the prompt's full blocks after the hits, which
        admission registers."""
        chain = PrefixChain(salt_root(salt), salt)
        full = len(tokens) // self.block_size
        lookable = max(len(tokens) - 1, 0) // self.block_size
        find = self.pool.keys.find
        blocks: list[int] = []
        if self._default:
            blocks, digests = self._match_default(tokens.tobytes(), chain.root, full, lookable)
            hits = len(blocks)
            if hits:
                chain.keys, chain.digests = digests[:hits], digests[:hits]
            rest = digests[hits:]
            rest = (rest, rest)  # key = digest
        else:
            keys = self.keys(chain, tokens[: full * self.block_size])
            for key, digest in keys[:lookable]:
                block = find(key, digest)
                if block is None:
                    break  # a miss, or a hash collision caught by the content check
                blocks.append(block)
            hits = len(blocks)
            chain.keys = [key for key, _ in keys[:hits]]
            chain.digests = [digest for _, digest in keys[:hits]]
            rest = ([key for key, _ in keys[hits:]], [digest for _, digest in keys[hits:]])
        chain.committed = hits  # cached blocks: written by whoever registered them
        stats = self.stats
        stats.hits += hits
        stats.misses += full - hits
        stats.cached_tokens += hits * self.block_size
        return blocks, chain, rest

    def _match_default(
        self, data: bytes, root: bytes, full: int, lookable: int
    ) -> tuple[list[int] | np.ndarray, list[bytes]]:
        """The default hasher's match over a prompt's bytes: the hit blocks, and the digests (=
        keys) of its ``full`` full blocks.

        Three phases: (1) a prompt head that an earlier match hit (the runs: its bytes, compared
        exactly, give all its digests in one lookup); (2) block after block while blocks hit
        (the memo saves the hash of a block that hit before); (3) the hashes of the blocks after
        the hits, which admission registers once their K/V are written. Every digest is the
        BLAKE2b chain of :meth:`keys`, however it was found.
        """
        width = self.block_size * TOKEN_DTYPE.itemsize
        find = self.pool.keys.find
        blocks: list[int] | np.ndarray = []
        digests: list[bytes] = []
        unregistrations = self.pool.keys.unregistrations
        for length in self._run_lengths:  # (1)
            if length > lookable:
                continue
            # Keyed by the head's last block (hashing all of it would cost more than the
            # comparison): the whole head's bytes must match too.
            run = self._runs.get((root, length, data[(length - 1) * width : length * width]))
            if run is None or not data.startswith(run[3]):
                continue
            known, seen, when, _ = run
            if when == unregistrations:  # no key lost its block since: the same blocks hit
                blocks = seen  # an intp array, which admission takes as it is
            else:
                blocks = []  # up to the first evicted block or collision (content check)
                for key in known:  # (the default hasher: key, digest and content are one)
                    block = find(key, key)
                    if block is None:
                        break
                    blocks.append(block)
                if len(blocks) == len(known):  # all there again: remember where
                    run[1], run[2] = _block_array(blocks), unregistrations
            digests = list(known)
            break
        fresh = _BLAKE2B_16.copy
        digest = digests[-1] if digests else root
        found: list[int] = []
        if len(blocks) == len(digests):  # (2): no run, or all of it hit
            memo, remember = self._memo, self._memo.get
            for j in range(len(digests), lookable):
                chunk = data[j * width : (j + 1) * width]
                known = remember((digest, chunk))
                if known is None:
                    h = fresh()
                    h.update(digest + chunk)
                    block = find(known := h.digest(), known)
                    if block is None:
                        digests.append(known)  # a miss, or a collision the content check caught
                        digest = known
                        break
                    if len(memo) >= _MEMO_ENTRIES:
                        memo.clear()
                    memo[(digest, chunk)] = known
                else:
                    block = find(known, known)
                    if block is None:
                        digests.append(known)
                        digest = known
                        break
                found.append(block)
                digests.append(known)
                digest = known
        if found:
            blocks = (blocks.tolist() if isinstance(blocks, np.ndarray) else blocks) + found
        hits = len(blocks)
        for j in range(len(digests), full):  # (3)
            h = fresh()
            h.update(digest + data[j * width : (j + 1) * width])
            digest = h.digest()
            digests.append(digest)
        if hits >= _MIN_RUN:  # remember this head for the next request that shares it
            if (root, hits) not in self._run_keys:
                if self._run_bytes + hits * width > _RUN_BYTES:
                    self._runs.clear()
                    self._run_keys.clear()
                    self._run_bytes = 0
                last = data[(hits - 1) * width : hits * width]
                self._runs[(root, hits, last)] = [
                    digests[:hits],
                    _block_array(blocks[:hits]),
                    unregistrations,
                    data[: hits * width],
                ]
                self._run_keys.add((root, hits))
                self._run_bytes += hits * width
            if not self._run_lengths or self._run_lengths[0] != hits:
                lengths = [hits, *(n for n in self._run_lengths if n != hits)]
                self._run_lengths = lengths[:_RUN_LENGTHS]
        return blocks, digests

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
        pairs = self.keys(chain, tokens)
        keys, digests = [key for key, _ in pairs], [digest for _, digest in pairs]
        self.pool.keys.register_many(blocks, keys, digests)
        chain.keys += keys
        chain.digests += digests
        chain.committed = len(chain.keys)


# Entries of PrefixCache._memo (about 250 bytes each) before it starts over.
_MEMO_ENTRIES = 1 << 14
# PrefixCache._runs: heads of at least this many blocks, of at most this many lengths at a time,
# up to this many bytes of prompts in all before it starts over.
_MIN_RUN = 4
_RUN_LENGTHS = 4
_RUN_BYTES = 8 << 20

# BLAKE2b-128 of ``parent + data``: copying a prepared state is faster than parsing the keyword
# arguments of a new one.
_BLAKE2B_16 = hashlib.blake2b(digest_size=16)
