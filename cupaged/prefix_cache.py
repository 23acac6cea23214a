"""Prefix caching's public names, at the path the docs and earlier releases import them from.

The code lives in :mod:`cupaged.paging.prefix` (content keys, chains, :class:`PrefixCache`) and
:mod:`cupaged.paging.tokens` (token-id checks).
"""

from __future__ import annotations

from .paging.prefix import (
    BlockHasher,
    PrefixCache,
    PrefixCacheStats,
    PrefixChain,
    as_salt,
    blake2b_block_hash,
    salt_root,
)
from .paging.tokens import TOKEN_DTYPE, token_array

__all__ = [
    "TOKEN_DTYPE",
    "BlockHasher",
    "PrefixCache",
    "PrefixCacheStats",
    "PrefixChain",
    "as_salt",
    "blake2b_block_hash",
    "salt_root",
    "token_array",
]
