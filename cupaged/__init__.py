"""cupaged: a paged KV cache and paged attention for CuPy (and NumPy on machines without a GPU).

Public names::

    PagedCache, BlockPool, CacheSpec                        the block manager and its arithmetic
    write_kv, copy_blocks, paged_attention                  fused kernels on raw cache arrays
    to_csr, from_csr                                        dense <-> CSR page tables
    reference_attention                                     the naive oracle attention
    PrefixCacheStats                                        prefix-caching counters
    CupagedError, OutOfBlocksError, KernelError             errors
"""

from __future__ import annotations

from .block_pool import BlockPool
from .cache import PagedCache
from .errors import CupagedError, KernelError, OutOfBlocksError
from .memory import CacheSpec
from .ops import copy_blocks, paged_attention, write_kv
from .page_table import from_csr, to_csr
from .prefix_cache import PrefixCacheStats
from .reference import reference_attention

__version__ = "0.1.0"

__all__ = [
    "BlockPool",
    "CacheSpec",
    "CupagedError",
    "KernelError",
    "OutOfBlocksError",
    "PagedCache",
    "PrefixCacheStats",
    "copy_blocks",
    "from_csr",
    "paged_attention",
    "reference_attention",
    "to_csr",
    "write_kv",
]
