"""Prefix caching: content keys of full blocks, and the hit/miss counters.

A full block is identified by a chain of hashes: its key hashes its parent block's key and its own
token ids, so equal keys mean an equal prefix up to and including the block::

    root  = H("cupaged-salt" + salt)                       (b"" without a salt)
    key_0 = hasher(root,  tokens[0 : bs])
    key_1 = hasher(key_0, tokens[bs : 2 bs])  ...

The default hasher is BLAKE2b (128-bit digest), never Python's ``hash()``: a collision would hand
one request another's K/V. As a second line of defence every hit is verified against the content
stored with the block: the BLAKE2b digest of the whole token prefix before it (a chain that does
not depend on the injectable ``block_hasher``), its own token ids, and the salt. A per-request ``cache_salt`` starts a separate chain,
so tenants who must not share K/V never do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

BlockHasher = Callable[[bytes, Sequence[int]], bytes]
"""``hasher(parent_key, token_ids) -> key``: the content key of a full block."""


def blake2b_block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The default :data:`BlockHasher`: BLAKE2b-128 of the parent key and the int64 token ids."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(np.asarray(tokens, dtype="<i8").tobytes())
    return digest.digest()


def salt_root(salt: bytes | None) -> bytes:
    """The parent key of a sequence's first block: empty, or a hash of the salt."""
    if salt is None:
        return b""
    return hashlib.blake2b(b"cupaged-salt" + salt, digest_size=16).digest()


def block_content(parent_digest: bytes, tokens: Sequence[int], salt: bytes | None) -> tuple:
    """What a hit is verified against: the BLAKE2b digest of the whole token prefix before the
    block (a chain like the keys, but always BLAKE2b), the block's token ids, and the salt.

    Verifying against the prefix's digest rather than the parent's key or physical block means a
    collision of ``block_hasher`` anywhere up the chain is caught, and a block id reused for other
    content cannot pass for the old one.
    """
    return (parent_digest, tuple(tokens), salt)


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
