"""cupaged: a paged KV cache and paged attention for CuPy (and NumPy on machines without a GPU).

Public names::

    PagedCache, BlockManager, BlockPool, CacheSpec          the block manager and its arithmetic
    SequenceBatch, StepPlan, Admission                      the step API's handle and results
    PrefixCache, PrefixChain                                prefix caching over a BlockPool
    write_kv, copy_blocks, paged_attention                  fused kernels on raw cache arrays
    DecodePlan                                              decode attention planned once per step
    DecodeGraph                                             a decode step captured as a CUDA graph
    PrefillPlan                                             prefill attention planned once per step
    paged_prefill                                           fused attention of many queries per sequence
    to_csr, from_csr                                        dense <-> CSR page tables
    reference_attention, reference_prefill                  the naive oracle attention
    to_float, from_float                                    bfloat16 bits (uint16) <-> float arrays
    resolve_device, device_module, to_numpy                 which device, its array module, to host
    PrefixCacheStats                                        prefix-caching counters
    CupagedError, OutOfBlocksError, KernelError             errors
"""

from __future__ import annotations

from .attention.decode import DecodePlan
from .attention.graph import DecodeGraph
from .attention.ops import copy_blocks, paged_attention, paged_prefill, write_kv
from .attention.page_table import from_csr, to_csr
from .attention.prefill import PrefillPlan
from .attention.reference import reference_attention, reference_prefill
from .backend import device_module, resolve_device, to_numpy
from .cache.paged_cache import PagedCache
from .cache.spec import CacheSpec
from .dtypes import from_float, to_float
from .errors import CupagedError, KernelError, OutOfBlocksError
from .paging.batch import SequenceBatch
from .paging.manager import BlockManager
from .paging.pool import BlockPool
from .paging.prefix import PrefixCache, PrefixCacheStats, PrefixChain
from .paging.results import Admission, StepPlan

__version__ = "0.1.0"

__all__ = [
    "Admission",
    "BlockManager",
    "PrefixCache",
    "PrefixChain",
    "SequenceBatch",
    "StepPlan",
    "BlockPool",
    "CacheSpec",
    "CupagedError",
    "DecodeGraph",
    "DecodePlan",
    "KernelError",
    "OutOfBlocksError",
    "PagedCache",
    "PrefillPlan",
    "PrefixCacheStats",
    "copy_blocks",
    "device_module",
    "from_csr",
    "from_float",
    "paged_attention",
    "paged_prefill",
    "reference_attention",
    "reference_prefill",
    "resolve_device",
    "to_csr",
    "to_float",
    "to_numpy",
    "write_kv",
]
