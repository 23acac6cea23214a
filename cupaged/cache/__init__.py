"""The K/V arrays of a paged cache over :class:`~cupaged.BlockManager`'s public verbs.

==================  ===================================================================
``paged_cache``     :class:`~cupaged.PagedCache`: the K/V pool and its writes
``forwarding``      the manager's other verbs on a cache, passed on as they are
``swap``            moving a sequence's K/V bytes to host memory and back, for given block ids
``scales``          the per-layer K/V scales of an fp8 cache
``spec``            :class:`~cupaged.CacheSpec`: memory arithmetic, to size a cache
==================  ===================================================================
"""

from __future__ import annotations

from .paged_cache import PagedCache
from .spec import CacheSpec

__all__ = ["CacheSpec", "PagedCache"]
